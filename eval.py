"""
Judge a model: HellaSwag accuracy, and the loss on any text file.

    python eval.py --out_dir=out-owt                       # HellaSwag of a checkpoint (best.pt)
    python eval.py --init_from=gpt2 --hellaswag=hellaswag_val.jsonl
    python eval.py --out_dir=out-shakespeare-char --text=input.txt --json

HellaSwag (Zellers et al. 2019): each example is a context and four endings, one of them right.
Every ending is scored as a continuation of the context: the tokens of `ctx`, then the tokens of
" " + ending (encoded separately and concatenated, as build-nanogpt does; lm-evaluation-harness
adds the same leading space). acc picks the ending with the lowest summed cross-entropy over its
tokens, acc_norm the lowest mean per token, which is how GPT-2 124M's 29.55 % is reported. The
data is the validation split (10,042 examples), rowanz's hellaswag_val.jsonl: give a local copy
with --hellaswag=FILE, or it is downloaded once into data/hellaswag/. Only GPT-2 BPE models can
take it (the endings are English text in GPT-2's tokens).

--text=FILE: the loss (mean next-token cross-entropy, in nats), perplexity and bits per byte of
the model on a UTF-8 text (see text_loss for the windows). Bits per byte divides by the text's
size in bytes instead of its tokens, so models with different tokenizers compare.

Under torchrun the examples (and text windows) are split over the processes and the counts summed.
train.py runs HellaSwag every hellaswag_interval steps through TrainingHellaSwag.
"""

import json
import math
import os
import sys
import urllib.error
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from machinery import checkpoint, configurator, distributed
from machinery.configurator import setting
from machinery.errors import UserError, first_line, run_main
from machinery.fileio import atomic_write
from machinery.hardware import autocast, pick_dtype

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_CACHE = os.path.join("data", "hellaswag", "hellaswag_val.jsonl")
HELLASWAG_FORMAT = "HellaSwag lines are JSON objects with ctx (text), endings (4 texts) and label (0-3)"


@dataclass
class EvalConfig(checkpoint.ModelSource):
    hellaswag: Optional[str] = setting(None, "HellaSwag data: a hellaswag_val.jsonl, or auto (downloaded once "
                                             f"into {HELLASWAG_CACHE}); None: auto unless --text is given")
    limit: Optional[int] = setting(None, "evaluate only the first N HellaSwag examples (None: all)")
    text: Optional[str] = setting(None, "a UTF-8 text file: report the model's loss, perplexity and bits per "
                                        "byte on it")
    batch_size: int = setting(8, "text windows per forward pass (--text)")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "auto, float32, bfloat16 or float16")
    json: bool = setting(False, "print one JSON object instead of one line per figure")

    def validate(self):
        super().validate()
        for name in ("limit", "batch_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def runs_hellaswag(self):
        return self.hellaswag is not None or self.text is None


# ---------------------------------------------------------------------- HellaSwag


def load_hellaswag(path):
    """The examples of a HellaSwag jsonl file, each {"ctx": str, "endings": [4 str], "label": 0-3}."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read HellaSwag file {path} ({getattr(e, 'strerror', None) or first_line(e)}); "
                        f"check --hellaswag") from None
    examples = [_hellaswag_example(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not examples:
        raise UserError(f"HellaSwag file {path} holds no examples; {HELLASWAG_FORMAT}")
    return examples


def _hellaswag_example(line, where):
    """One line of the file, checked; a malformed one is an error naming file and line."""
    try:
        d = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not valid JSON ({first_line(e)}); {HELLASWAG_FORMAT}") from None
    if not isinstance(d, dict):
        raise UserError(f"{where}: not a JSON object; {HELLASWAG_FORMAT}")
    ctx, endings, label = d.get("ctx"), d.get("endings"), d.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise UserError(f"{where}: no ctx text; {HELLASWAG_FORMAT}")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) and e for e in endings):
        raise UserError(f"{where}: endings must be 4 non-empty texts; {HELLASWAG_FORMAT}")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label <= 3:
        raise UserError(f"{where}: label must be an integer 0-3, got {label!r}; {HELLASWAG_FORMAT}")
    return {"ctx": ctx, "endings": endings, "label": label}


def hellaswag_path(setting_value):
    """The jsonl to read: the file given, or the cached download (fetched on first use)."""
    if setting_value not in (None, "auto"):
        return setting_value
    if not os.path.isfile(HELLASWAG_CACHE):
        download_hellaswag(HELLASWAG_CACHE)
    return HELLASWAG_CACHE


def download_hellaswag(path):
    """rowanz's validation file into path, atomically (a failed download leaves nothing behind). Under
    torchrun every rank may fetch it: each writes its own temporary file, and the renames all agree."""
    try:
        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot download HellaSwag ({first_line(e)}); offline, give a local copy of "
                        f"hellaswag_val.jsonl with --hellaswag=FILE") from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_write(path) as f:
        f.write(data)
    print(f"note: downloaded HellaSwag's validation split ({len(data) / 1e6:.1f} MB) into {path}", file=sys.stderr)


def example_tensors(encode, example, block_size):
    """The four rows of one example, right-padded to one length: inputs (4, T) and targets (4, T), the
    next token where it belongs to the ending and -1 elsewhere (context and padding are not scored)."""
    ctx = encode(example["ctx"])
    inputs, targets = [], []
    for ending in example["endings"]:
        end = encode(" " + ending)
        # a context too long for the model keeps its last tokens, those nearest the ending (the model
        # reads block_size tokens and predicts the next of each, so block_size + 1 tokens take part)
        row = (ctx + end)[-(block_size + 1):]
        scored = min(len(end), len(row) - 1)  # (an ending longer than block_size loses its first tokens)
        inputs.append(row[:-1])
        targets.append([-1] * (len(row) - 1 - scored) + row[-scored:])
    return _pad(inputs, 0), _pad(targets, -1)


def _pad(rows, value):
    """Rows of different lengths as one tensor, right-padded with value. The model is causal, so tokens
    padded on the right change nothing at the positions before them."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


@torch.no_grad()
def token_losses(model, inputs, targets, device, ctx):
    """Summed cross-entropy (nats, float32) over each row's scored tokens, and how many there are."""
    inputs, targets = inputs.to(device), targets.to(device)
    with ctx:
        logits, _ = model(inputs, targets)  # with targets the model returns every position's logits
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
    return losses.view_as(targets).sum(1), (targets != -1).sum(1)


def hellaswag_scores(model, encode, examples, device, ctx=nullcontext()):
    """One record per example: the summed and mean losses of its four endings, the choice by each
    (acc: lowest sum, acc_norm: lowest mean; the first of equals) and the label. One forward pass
    per example; the model is put in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    records = []
    try:
        for example in examples:
            sums, counts = token_losses(model, *example_tensors(encode, example, model.config.block_size),
                                        device, ctx)
            sums, means = sums.tolist(), (sums / counts).tolist()
            records.append({"sum": sums, "mean": means, "pred": min(range(4), key=sums.__getitem__),
                            "pred_norm": min(range(4), key=means.__getitem__), "label": example["label"]})
    finally:
        model.train(was_training)
    return records


def hellaswag_accuracy(model, encode, examples, device, ctx=nullcontext()):
    """acc and acc_norm over examples, and the counts behind them. Under torch.distributed example i
    goes to rank i % world_size and the counts are summed over the ranks; every rank runs the same
    number of forward passes (the last ones repeat an example, uncounted), since with FSDP a forward
    pass is a collective that all ranks must join."""
    if not examples:
        raise ValueError("hellaswag_accuracy needs at least one example")
    rank, world = _rank_and_size()
    mine = examples[rank::world]
    records = hellaswag_scores(model, encode, mine, device, ctx)
    for _ in range(math.ceil(len(examples) / world) - len(mine)):
        hellaswag_scores(model, encode, examples[:1], device, ctx)
    counts = torch.tensor([sum(r["pred_norm"] == r["label"] for r in records),
                           sum(r["pred"] == r["label"] for r in records), len(records)], device=device)
    correct_norm, correct, total = distributed.all_reduce(counts).tolist()
    return {"acc_norm": correct_norm / total, "acc": correct / total, "correct_norm": correct_norm,
            "correct": correct, "total": total}


def require_gpt2(kind, what, fix):
    """HellaSwag's endings are English text in GPT-2's tokens: other models cannot take it."""
    if kind != "gpt2":
        raise UserError(f"HellaSwag needs a GPT-2 BPE model, {what} uses the {kind or 'unknown'} tokenizer; {fix}")


class TrainingHellaSwag:
    """train.py's HellaSwag: acc_norm and acc every hellaswag_interval steps (with that step's evaluation)
    and at the last step, on the examples of cfg.hellaswag (read once, at setup). Calling it at an
    evaluation logs `step N: hellaswag ...` and returns the figures for metrics.jsonl ({} when not due).
    Every rank must call it: the examples are split over them."""

    def __init__(self, cfg, data_meta, device, ctx, log):
        self.interval, self.last_step = cfg.hellaswag_interval, cfg.max_iters
        self.device, self.ctx, self.log = device, ctx, log
        if not self.interval:
            return
        if self.interval % cfg.eval_interval:
            raise UserError(f"hellaswag_interval must be a multiple of eval_interval ({cfg.eval_interval}), got "
                            f"{self.interval}: HellaSwag runs with the evaluations")
        require_gpt2(data_meta.tokenizer, f"dataset {cfg.dataset}", "set hellaswag_interval=0")
        self.encode = data_meta.make_tokenizer().encode
        self.examples = load_hellaswag(hellaswag_path(cfg.hellaswag))

    def __call__(self, step, model):
        if not self.interval or (step % self.interval and step != self.last_step):
            return {}
        h = hellaswag_accuracy(model, self.encode, self.examples, self.device, self.ctx)
        self.log(f"step {step}: hellaswag acc_norm {h['acc_norm']:.4f}, acc {h['acc']:.4f} ({h['total']} examples)")
        return {"hellaswag_acc_norm": h["acc_norm"], "hellaswag_acc": h["acc"]}


def _rank_and_size():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---------------------------------------------------------------------- loss on a text


@torch.no_grad()
def text_loss(model, ids, device, ctx=nullcontext(), batch_size=8):
    """Total cross-entropy (nats) of the model predicting ids[1:] from what precedes, and how many
    tokens it predicted (len(ids) - 1).

    With B = block_size, the ids are cut into consecutive windows that overlap by one token: window k
    is ids[kB : kB + B + 1]; the model reads its first B tokens (fewer in the last window) and predicts
    each one's successor. So every token after the first is predicted exactly once, and token j (j >= 1)
    from the tokens ids[B * ((j - 1) // B) : j], 1 to B tokens of context: the first prediction of each
    window sees one token, the last sees B (no sliding window: one forward pass per B tokens).
    Under torch.distributed window k goes to rank k % world_size and the sums are added up."""
    was_training = model.training
    model.eval()
    B = model.config.block_size
    rank, world = _rank_and_size()
    starts = list(range(0, len(ids) - 1, B))[rank::world]
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    try:
        for i in range(0, len(starts), batch_size):
            windows = [ids[s:s + B + 1] for s in starts[i:i + batch_size]]
            sums, counts = token_losses(model, _pad([w[:-1] for w in windows], 0),
                                        _pad([w[1:] for w in windows], -1), device, ctx)
            total += sums.sum().double()
            count += counts.sum()
    finally:
        model.train(was_training)
    return distributed.all_reduce(total).item(), distributed.all_reduce(count).item()


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --text {path} ({getattr(e, 'strerror', None) or first_line(e)}); "
                        f"give a UTF-8 text file") from None


def text_figures(model, tokenizer, path, device, ctx, batch_size):
    """Loss, perplexity and bits per byte of the model on the text file at path."""
    text = read_text(path)
    try:
        ids = tokenizer.encode(text)
    except UserError as e:  # a character outside a char-level model's vocabulary
        raise UserError(f"--text {path}: {e}") from None
    if len(ids) < 2:
        raise UserError(f"--text {path} has {len(ids)} token(s): nothing to predict; give a longer text")
    nats, predicted = text_loss(model, ids, device, ctx, batch_size)
    n_bytes = len(text.encode("utf-8"))
    # bits per byte: every byte of the text counts, those of the first (unpredicted) token too
    return {"loss": nats / predicted, "perplexity": math.exp(nats / predicted),
            "bits_per_byte": nats / math.log(2) / n_bytes, "tokens": len(ids), "predicted": predicted,
            "bytes": n_bytes}


# ---------------------------------------------------------------------- the script


def load(cfg, device):
    """The model to evaluate (eval mode, on device) and its tokenizer."""
    model, tokenizer = checkpoint.load_model(cfg)
    return model.eval().to(device), tokenizer


def evaluate(cfg, device):
    """The figures cfg asks for, as a dict: {"hellaswag": {...}, "text": {...}}."""
    dtype = pick_dtype(cfg.dtype, device)
    ctx = autocast(device, dtype)
    model, tokenizer = load(cfg, device)
    results = {"model": cfg.out_dir if cfg.init_from == "resume" else cfg.init_from, "dtype": dtype}
    if cfg.runs_hellaswag:
        require_gpt2(tokenizer.kind, "this model", "evaluate it with --text=FILE instead")
        examples = load_hellaswag(hellaswag_path(cfg.hellaswag))[:cfg.limit]
        results["hellaswag"] = hellaswag_accuracy(model, tokenizer.encode, examples, device, ctx)
    if cfg.text is not None:
        results["text"] = text_figures(model, tokenizer, cfg.text, device, ctx, cfg.batch_size)
    return results


def report(results, as_json):
    if as_json:
        print(json.dumps(results))
        return
    if "hellaswag" in results:
        h = results["hellaswag"]
        print(f"hellaswag acc_norm {h['acc_norm']:.4f} ({h['correct_norm']}/{h['total']}), "
              f"acc {h['acc']:.4f} ({h['correct']}/{h['total']})")
    if "text" in results:
        t = results["text"]
        print(f"text loss {t['loss']:.4f}, perplexity {t['perplexity']:.2f}, bits per byte "
              f"{t['bits_per_byte']:.4f} ({t['tokens']} tokens, {t['bytes']} bytes)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # `--json` alone asks for JSON, as scripts expect (the configurator takes --key=value only)
    argv = ["--json=True" if a == "--json" else a for a in argv]
    cfg = configurator.parse(EvalConfig, argv, usage="python eval.py [config_file ...] [--key=value ...] [--json]")
    cfg.validate()
    world, device = distributed.setup(cfg.device)
    finished = False
    try:
        results = evaluate(cfg, device)
        finished = True
    finally:
        distributed.teardown(finished)
    if world.is_master:
        report(results, cfg.json)


if __name__ == "__main__":
    run_main(main)
