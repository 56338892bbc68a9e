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

from machinery import checkpoint, configurator, convert
from machinery.configurator import setting
from machinery.errors import UserError, run_main

USAGE = "python export.py [--out_dir=DIR] [--ckpt=best|latest] [--to=hf] DEST  (DEST: a new or empty directory)"


@dataclass
class ExportConfig:
    out_dir: str = setting("out", "training output directory (or a checkpoint file) to export")
    ckpt: str = setting("best", "best (best.pt) or latest (ckpt.pt)")
    to: str = setting("hf", "format: hf (Hugging Face GPT2LMHeadModel: config.json + model.safetensors in DEST)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = configurator.parse(ExportConfig, [a for a in argv if a.startswith("-")], usage=USAGE, extra_files_ok=False)
    dests = [a for a in argv if not a.startswith("-")]
    if len(dests) != 1:
        raise UserError(f"give one destination directory: {USAGE}")
    if cfg.to != "hf":
        raise UserError(f"--to must be hf (Hugging Face GPT-2), got {cfg.to!r}")
    if cfg.ckpt not in ("best", "latest"):
        raise UserError(f"ckpt must be best or latest, got {cfg.ckpt!r}")
    path = checkpoint.find(cfg.out_dir, cfg.ckpt)
    ckpt = checkpoint.load(path)
    config, tensors = convert.to_hf(ckpt.build_model(), ckpt.meta)
    convert.write_hf(dests[0], config, tensors, ckpt.meta)
    print(f"wrote {dests[0]}/config.json and model.safetensors from {path}")


if __name__ == "__main__":
    run_main(main)
