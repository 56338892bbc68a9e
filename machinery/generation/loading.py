"""
Which trained model to use, and where: the settings that every command using a model shares (sample.py,
eval.py, export.py, serve.py) and loading it.

    --init_from=resume --out_dir=DIR [--ckpt=best|latest]   a checkpoint of train.py (ours, nanoGPT's, a LoRA run's)
    --init_from=gpt2|gpt2-medium|gpt2-large|gpt2-xl|PATH     GPT-2 weights in Hugging Face's layout (convert.py)
    --meta=PATH                                             the tokenizer, for checkpoints that record none
    --device, --dtype, --quantize=int8                      where it runs, in which precision (hardware, quantize)
    --decode_attention=full|flex, --decode_ahead            CUDA's decoding step (decode_attention.py)

load() returns a Loaded: the model in eval mode on its device, its tokenizer and dataset metadata, and the
precision to run it in. Not here: reading checkpoints (weights/checkpoint.py) or decoding (engine.py).
"""

import sys
from dataclasses import dataclass
from typing import Optional

from machinery.data import dataset, meta
from machinery.generation import decode_attention
from machinery.weights import checkpoint, convert
from machinery.weights import quantize as quantization
from machinery.configurator import setting
from machinery.errors import UserError
from machinery.hardware import autocast, device_setting, dtype_setting, pick_device, pick_dtype


@dataclass
class ModelSource:
    """The settings that pick a trained model (the settings of sample.py, eval.py, export.py and serve.py begin with
    these)."""

    init_from: str = setting("resume", "resume (the checkpoint in out_dir), a GPT-2 size (gpt2, gpt2-medium, "
                                       "gpt2-large, gpt2-xl: from the local Hugging Face cache) or a Hugging Face "
                                       "GPT-2 directory")
    out_dir: str = setting("out", "training output directory (or a checkpoint file) to load")
    meta: Optional[str] = setting(None, "tokenizer for checkpoints without one (nanoGPT, Hugging Face): a "
                                        "meta.json from prepare.py or its dataset directory")
    ckpt: str = setting("best", "best (best val loss, best.pt) or latest (ckpt.pt)")

    def validate(self):
        if self.ckpt not in ("best", "latest"):
            raise UserError(f"ckpt must be best or latest, got {self.ckpt!r}")

    @property
    def name(self):
        """How results and logs name the model: its out_dir, or the GPT-2 weights it is."""
        return self.out_dir if self.init_from == "resume" else self.init_from


@dataclass
class RunSource(ModelSource):
    """A model source and where to run it (sample.py, eval.py and serve.py)."""

    device: str = device_setting()
    dtype: str = dtype_setting()
    quantize: Optional[str] = setting(None, "int8: weight-only int8 linear layers and output head, for fast "
                                            "decoding on the CPU (machinery/weights/quantize.py); None: the weights "
                                            "in dtype")

    def validate(self):
        super().validate()
        quantization.check(self.quantize, self.device if self.device != "auto" else None)


@dataclass
class EngineSource(RunSource):
    """A run source that the generation engine decodes (sample.py and serve.py): the engine's settings, declared
    and checked once for both."""

    compile: bool = setting(False, "torch.compile the model")
    prefix_cache_mb: int = setting(1024, "MB of memory (on the device) that keep prompts' encoded prefixes, exactly, "
                                         "for what begins with them: the next turn of a chat (serve.py, sample.py "
                                         "--chat), a shared system prompt, the prompt of the other samples; and "
                                         "serve.py's rows of streams nobody reads while others wait; 0: none")

    decode_attention: Optional[str] = setting(None, "how each row attends in CUDA's fixed decoding step: full (SDPA "
                                                    "over the whole cache, masked to the row's positions) or flex "
                                                    "(FlexAttention, compiled, over the row's own blocks of the cache "
                                                    "only; full where it cannot run, said once); None: flex for "
                                                    "serve.py on CUDA (its kernel compiled once at the start), full "
                                                    "for sample.py. The CPU decodes row by row, each row over its "
                                                    "own positions: flex does not apply there (refused)")

    decode_ahead: Optional[bool] = setting(None, "launch each step of CUDA's fixed decoding before reading the tokens "
                                                 "of the one before, so that reading, streaming and stop texts "
                                                 "overlap the GPU's next step (None: on where the fixed step runs; "
                                                 "False: each step's tokens read before the next is launched)")

    def validate(self):
        super().validate()
        if self.prefix_cache_mb < 0:
            raise UserError(f"prefix_cache_mb must be 0 (no prefix cache) or more, got {self.prefix_cache_mb}")
        device = self.device.split(":")[0]  # (auto: the engine checks, once it is picked)
        if self.decode_attention is not None:
            decode_attention.check(self.decode_attention, fixed=device in ("cuda", "auto"))
        decode_attention.check_ahead(self.decode_ahead, fixed=device in ("cuda", "auto"))


@dataclass
class Loaded:
    """A model ready to use: in eval mode on device; run it inside autocast (the dtype's mixed precision)."""

    model: object  # model.GPT
    tokenizer: object
    data_meta: meta.DatasetMeta
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def autocast(self):
        return autocast(self.device, self.dtype)


def load(source, device="cpu", dtype="float32"):
    """The model a ModelSource names with its tokenizer, on device (a device name or "auto"), for dtype.
    init_from=resume: the checkpoint in out_dir (best or latest; nanoGPT's ckpt.pt too; a LoRA run's: its base with
    the adapters merged in); else GPT-2 weights (convert.py). --meta
    overrides the tokenizer; a checkpoint without one (nanoGPT's) uses its dataset's meta.json or meta.pkl,
    else GPT-2 BPE, and says so on stderr."""
    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    if source.init_from == "resume":
        ckpt = checkpoint.load(checkpoint.find(source.out_dir, source.ckpt))
        model, data_meta = ckpt.build_model(), ckpt.data_meta
        if data_meta is None and source.meta is None:
            data_meta, found = meta.for_nanogpt(dataset.resolve(dataset.DATA_DIR, ckpt.dataset) if ckpt.dataset
                                                else None)
            print(f"note: the checkpoint records no tokenizer; using {found} (--meta picks another)", file=sys.stderr)
    else:
        model, data_meta = convert.load_pretrained(source.init_from)
    if source.meta is not None:
        data_meta = meta.from_path(source.meta)
    tokenizer = data_meta.make_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:  # its ids would index past the embedding
        raise UserError(f"the model has {model.config.vocab_size} tokens but the {tokenizer.kind} tokenizer has "
                        f"{tokenizer.vocab_size}: it was trained with another one; give its meta.json with --meta")
    return Loaded(model.eval().to(device), tokenizer, data_meta, device, dtype)


def load_run(source):
    """load() with the source's own --device and --dtype (a RunSource)."""
    return load(source, source.device, source.dtype)
