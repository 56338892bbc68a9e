"""
Sample text from a trained model:

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3

The checkpoint (out_dir/best.pt, or ckpt.pt before any improvement) carries its
tokenizer, so the text is encoded and decoded the way the training data was.
With one sample, text is printed as it is produced.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

import checkpoint
import configurator
from configurator import UserError
from hardware import autocast, pick_device, pick_dtype
from tokenizer import from_meta


def _(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class SampleConfig:
    out_dir: str = _("out", "training output directory (or a checkpoint file) to sample from")
    ckpt: str = _("best", "best (best val loss, best.pt) or latest (ckpt.pt)")
    start: str = _("\n", "prompt text, or FILE:path to read the prompt from a file")
    num_samples: int = _(10, "samples to draw (generated together as one batch)")
    max_new_tokens: int = _(500, "tokens to generate per sample")
    temperature: float = _(0.8, "0: greedy (argmax); <1 sharper, >1 more random")
    top_k: Optional[int] = _(200, "sample only among the k most likely tokens (None: all)")
    top_p: Optional[float] = _(None, "nucleus sampling: the smallest set of tokens with probability >= top_p")
    stop: Optional[str] = _(None, "stop a sample when it produces this text (BPE models stop at <|endoftext|> by default)")
    seed: int = _(1337, "random seed")
    device: str = _("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = _("auto", "auto, float32, bfloat16 or float16")
    compile: bool = _(False, "torch.compile the model")
    use_cache: bool = _(True, "KV cache (False: re-run the whole context for every token, as nanoGPT)")
    stream: bool = _(True, "print text as it is produced (when num_samples is 1)")


def read_prompt(start):
    if start.startswith("FILE:"):
        path = start[len("FILE:"):]
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the prompt file {path}: {getattr(e, 'strerror', None) or e}") from None
    return start


class StreamDecoder:
    """Turns a growing list of token ids into new text, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids = []
        self.emitted = 0

    def add(self, token_id):
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new


def main(argv=None):
    cfg = configurator.parse(SampleConfig, argv, usage="python sample.py [--key=value ...]", extra_files_ok=False)
    for name in ("num_samples", "max_new_tokens"):
        if getattr(cfg, name) <= 0:
            raise UserError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.temperature < 0:
        raise UserError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.top_k is not None and cfg.top_k <= 0:
        raise UserError(f"top_k must be positive, got {cfg.top_k}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.ckpt not in ("best", "latest"):
        raise UserError(f"ckpt must be best or latest, got {cfg.ckpt!r}")
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)

    ckpt = checkpoint.load(checkpoint.find(cfg.out_dir, cfg.ckpt))
    model = checkpoint.build_model(ckpt)
    if "tokenizer" not in ckpt:
        raise UserError("the checkpoint has no tokenizer metadata; it was not written by this train.py")
    tokenizer = from_meta(ckpt["tokenizer"])
    model.eval().to(device)
    if cfg.compile:
        model = torch.compile(model, dynamic=True)

    prompt = read_prompt(cfg.start)
    if not prompt:
        raise UserError("the prompt is empty; give some text with --start")
    ids = tokenizer.encode(prompt)
    block_size = model.config.block_size
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids)} tokens; keeping its last {block_size} (block_size)", file=sys.stderr)
        ids = ids[-block_size:]

    stop_tokens = None
    if cfg.stop is not None:
        stop_ids = tokenizer.encode(cfg.stop) if cfg.stop else []
        if len(stop_ids) != 1:
            raise UserError(f"--stop must be a single token of this tokenizer; {cfg.stop!r} is {len(stop_ids)}")
        stop_tokens = stop_ids
    elif tokenizer.eot_token is not None:
        stop_tokens = [tokenizer.eot_token]

    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.tensor(ids, dtype=torch.long, device=device)[None].repeat(cfg.num_samples, 1)
    stream = cfg.stream and cfg.num_samples == 1
    with torch.no_grad(), autocast(device, dtype):
        rows = [[] for _ in range(cfg.num_samples)]
        decoder = StreamDecoder(tokenizer)
        if stream:
            print(prompt, end="", flush=True)
        stops = set(stop_tokens or ())
        for tok in model.generate_stream(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                         stop_tokens, generator, cfg.use_cache):
            for row, t in zip(rows, tok.tolist()):
                if not (row and row[-1] in stops):  # a finished row keeps its stop token last
                    row.append(t)
            if stream and rows[0][-1] not in stops:
                print(decoder.add(rows[0][-1]), end="", flush=True)
    for row in rows:
        text = tokenizer.decode(row[:-1] if row and row[-1] in stops else row)
        print() if stream else print(prompt + text)
        print("---------------")


if __name__ == "__main__":
    configurator.run_main(main)
