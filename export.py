"""
Export a trained model to Hugging Face's GPT-2 format:

    python export.py --out_dir=out-shakespeare hf-shakespeare

writes hf-shakespeare/config.json and model.safetensors, which transformers loads with
GPT2LMHeadModel.from_pretrained("hf-shakespeare"), and so do this repository's
convert.load_hf and --init_from=hf-shakespeare. The checkpoint's tokenizer goes
into meta.json beside them (for sample.py). A model GPT-2's format cannot express is
refused; see convert.to_hf for how the exact GELU and bias=False are written.
nanoGPT's ckpt.pt exports too (--out_dir=its out_dir --ckpt=latest).
"""

import sys
from dataclasses import dataclass

from machinery import configurator, convert, loading
from machinery.configurator import setting
from machinery.errors import UserError, run_main

USAGE = "python export.py [--out_dir=DIR] [--ckpt=best|latest] [--to=hf] DEST  (DEST: a new or empty directory)"


@dataclass
class ExportConfig(loading.ModelSource):
    to: str = setting("hf", "format: hf (Hugging Face GPT2LMHeadModel: config.json + model.safetensors in DEST)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = configurator.parse(ExportConfig, [a for a in argv if a.startswith("-")], usage=USAGE, extra_files_ok=False)
    dests = [a for a in argv if not a.startswith("-")]
    if len(dests) != 1:
        raise UserError(f"give one destination directory: {USAGE}")
    if cfg.to != "hf":
        raise UserError(f"--to must be hf (Hugging Face GPT-2), got {cfg.to!r}")
    cfg.validate()
    loaded = loading.load(cfg)  # on the CPU, in float32
    config, tensors = convert.to_hf(loaded.model, loaded.data_meta)
    convert.write_hf(dests[0], config, tensors, loaded.data_meta)
    print(f"wrote {dests[0]}/config.json and model.safetensors from {cfg.name}")


if __name__ == "__main__":
    run_main(main)
