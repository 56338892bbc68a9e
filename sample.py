"""
Sample text from a trained model:

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    python sample.py --init_from=gpt2-xl --start="What is the answer to life?"

The checkpoint (out_dir/best.pt, or ckpt.pt before any improvement) carries its
tokenizer, so the text is encoded and decoded the way the training data was.
nanoGPT's ckpt.pt carries none: its data/<dataset>/meta.json is used when there is
one, else GPT-2 BPE (--meta picks one). With --init_from, OpenAI's GPT-2 weights
(from the local Hugging Face cache) or a Hugging Face GPT-2 directory sample with
GPT-2 BPE. With one sample, text is printed as it is produced.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

import checkpoint
import configurator
import convert
from configurator import UserError
from data import load_meta
from hardware import autocast, pick_device, pick_dtype
from model import GPT
from tokenizer import from_meta


def _(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class SampleConfig:
    init_from: str = _("resume", "resume (the checkpoint in out_dir), a GPT-2 size (gpt2, gpt2-medium, gpt2-large, "
                                  "gpt2-xl: from the local Hugging Face cache) or a Hugging Face GPT-2 directory")
    out_dir: str = _("out", "training output directory (or a checkpoint file) to sample from")
    meta: Optional[str] = _(None, "tokenizer for checkpoints without one (nanoGPT, Hugging Face): a meta.json "
                                  "from prepare.py or its dataset directory")
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


def load_model(cfg):
    """The model to sample from and its tokenizer's metadata."""
    if cfg.init_from == "resume":
        ckpt = checkpoint.load(checkpoint.find(cfg.out_dir, cfg.ckpt))
        model, meta = checkpoint.build_model(ckpt), ckpt.get("tokenizer")
        if meta is None and cfg.meta is None:  # a nanoGPT checkpoint
            meta, source = convert.nanogpt_meta(ckpt)
            print(f"note: the checkpoint records no tokenizer; using {source} (--meta picks another)", file=sys.stderr)
    else:
        meta = convert.pretrained_meta(cfg.init_from)
        model = GPT.from_pretrained(cfg.init_from)
    if cfg.meta is not None:
        is_dir = os.path.isdir(cfg.meta)
        named_meta = os.path.basename(cfg.meta) == "meta.json"
        meta = load_meta(cfg.meta if is_dir else os.path.dirname(cfg.meta) or ".") if is_dir or named_meta else None
        if meta is None:
            raise UserError(f"--meta: {cfg.meta} is not a meta.json file or a directory holding one")
    return model, meta


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

    model, meta = load_model(cfg)
    tokenizer = from_meta(meta)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the model has {model.config.vocab_size} tokens but the {tokenizer.kind} tokenizer has "
                        f"{tokenizer.vocab_size}: it was trained with another one; give its meta.json with --meta")
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
