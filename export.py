"""
Export a trained model for other tools:

    python export.py --out_dir=out-shakespeare hf-shakespeare                    # Hugging Face (--to=hf)
    python export.py --out_dir=out-shakespeare --to=gguf --outtype=q8_0 s.gguf   # llama.cpp, Ollama, LM Studio

--to=hf writes a Hugging Face GPT-2 directory: config.json, generation_config.json and model.safetensors,
which transformers loads with GPT2LMHeadModel.from_pretrained("hf-shakespeare") (and pipeline(
"text-generation", model="hf-shakespeare"), and llama.cpp's convert_hf_to_gguf.py converts), and so do this
repository's convert.load_hf and --init_from=hf-shakespeare; for GPT-2 BPE models also GPT-2's tokenizer
(vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json: AutoTokenizer encodes as ours does).
A character-level model has no Hugging Face tokenizer: its export says so and writes the model. The
checkpoint's tokenizer also goes into meta.json (for sample.py). See convert.to_hf for how the exact GELU
and bias=False are written.

--to=gguf writes one GGUF file (llama.cpp's GPT-2 architecture, the tokenizer inside; machinery/weights/gguf_export.py)
in --outtype f32, f16 (the default) or q8_0. Needs the gguf package: pip install gguf==0.19.0.

A LoRA run's checkpoint (train.py --lora_rank) exports merged: its base with the adapters added in, as any model.
--adapter_only writes the adapters alone in PEFT's format instead (machinery/weights/lora.py): adapter_config.json and
adapter_model.safetensors, named by GPT-2's modules, which peft puts on the base's Hugging Face weights:

    python export.py --out_dir=out-lora --adapter_only lora-adapter
    PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained("gpt2"), "lora-adapter")

A chat LoRA run also trains its format's special tokens' embedding rows: they go in as PEFT's trainable tokens
(trainable_token_indices), with the tokenizer that has them and the chat template; grow the base to it first:

    tokenizer = AutoTokenizer.from_pretrained("lora-adapter")
    base = GPT2LMHeadModel.from_pretrained("gpt2"); base.resize_token_embeddings(len(tokenizer))
    PeftModel.from_pretrained(base, "lora-adapter")

Its base_model_name_or_path names the base as the run did: openai-community/gpt2 (...-xl) for --init_from=gpt2
(...), the absolute path of a Hugging Face directory for --init_from=DIR. A base of our own: export it (--to=hf),
train from that directory.

A model a format cannot express is refused in one line, and nothing is written. nanoGPT's ckpt.pt exports
too (--out_dir=its out_dir --ckpt=latest).
"""

import os
import sys
from dataclasses import dataclass
from typing import Optional

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)
from machinery import configurator
from machinery.generation import loading
from machinery.weights import checkpoint, convert, gguf_export, lora
from machinery.configurator import setting
from machinery.errors import UserError, run_main

USAGE = ("python export.py [--out_dir=DIR] [--ckpt=best|latest] [--to=hf|gguf] [--outtype=f32|f16|q8_0] "
         "[--adapter_only] DEST  (DEST: a new or empty directory for hf, a new file for gguf)")


@dataclass
class ExportConfig(loading.ModelSource):
    to: str = setting("hf", "format: hf (Hugging Face GPT2LMHeadModel and its tokenizer: a directory) or gguf "
                            "(llama.cpp: one file)")
    outtype: Optional[str] = setting(None, "to=gguf: the weights' type, f32, f16 or q8_0 (None: f16)")
    adapter_only: bool = setting(False, "a LoRA run: only its adapters, in PEFT's format (adapter_config.json, "
                                        "adapter_model.safetensors), not the merged model")

    def validate(self):
        super().validate()
        if self.to not in ("hf", "gguf"):
            raise UserError(f"--to must be hf (Hugging Face GPT-2) or gguf (llama.cpp), got {self.to!r}")
        if self.to == "gguf":
            gguf_export.check_outtype(self.outtype or "f16")
        if self.adapter_only and (self.to != "hf" or self.init_from != "resume"):
            raise UserError("--adapter_only writes a LoRA checkpoint's adapters (--out_dir) in PEFT's format, a "
                            "directory: drop --to and --init_from")
        if self.to == "hf" and self.outtype is not None:
            raise UserError(f"--outtype is for --to=gguf; a Hugging Face export keeps the model's float32 "
                            f"(drop --outtype={self.outtype})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = ["--adapter_only=True" if a == "--adapter_only" else a for a in argv]  # (the flag alone too)
    cfg = configurator.parse(ExportConfig, [a for a in argv if a.startswith("-")], usage=USAGE, extra_files_ok=False)
    dests = [a for a in argv if not a.startswith("-")]
    if len(dests) != 1:
        raise UserError(f"give one destination: {USAGE}")
    cfg.validate()
    if cfg.adapter_only:
        ckpt = checkpoint.load(checkpoint.find(cfg.out_dir, cfg.ckpt))
        adapters = ckpt.adapters  # (a whole model's checkpoint has none: one line)
        config, tensors = lora.peft_files(ckpt.lora_record, adapters, ckpt.model_config)
        files = {lora.PEFT_CONFIG: config, lora.PEFT_WEIGHTS: tensors}
        if config["trainable_token_indices"]:  # a chat format's tokens: the tokenizer that has them, and its template
            files.update(convert.hf_tokenizer_files(ckpt.data_meta, ckpt.model_config.block_size))
        written = convert.write_directory(dests[0], files)
        grow = (f"; grow the base's vocabulary to the tokenizer's first: base.resize_token_embeddings(len("
                f"AutoTokenizer.from_pretrained('{dests[0]}')))" if config["trainable_token_indices"] else "")
        print(f"wrote {dests[0]}: {', '.join(written)} from {ckpt.path} (base: {config['base_model_name_or_path']}"
              f"{grow})")
        return
    if cfg.to == "gguf":
        gguf_export.import_gguf()  # before loading anything
    loaded = loading.load(cfg)  # on the CPU, in float32
    if cfg.to == "gguf":
        name = os.path.basename(os.path.normpath(cfg.name))  # (general.name: the out_dir's or init_from's last part)
        gguf_export.write_gguf(dests[0], loaded.model, loaded.data_meta, cfg.outtype or "f16", name=name)
        print(f"wrote {dests[0]} ({cfg.outtype or 'f16'}) from {cfg.name}")
        return
    config, tensors = convert.to_hf(loaded.model, loaded.data_meta)
    written = convert.write_hf(dests[0], config, tensors, loaded.data_meta)
    if "vocab.json" not in written and "tokenizer.json" not in written:
        print(f"note: no Hugging Face tokenizer exists for this model's {loaded.data_meta.tokenizer} tokenizer: "
              f"wrote the model without tokenizer files (meta.json holds its vocabulary)", file=sys.stderr)
    print(f"wrote {dests[0]}: {', '.join(written)} from {cfg.name}")


if __name__ == "__main__":
    run_main(main)
