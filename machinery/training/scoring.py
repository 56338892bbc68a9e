"""
Scoring a model: the summed cross-entropy of rows of tokens (token_losses), HellaSwag's accuracy
(hellaswag_accuracy, and TrainingHellaSwag for train.py), and the loss on a whole text (text_loss).
eval.py is the command around them.

HellaSwag (Zellers et al. 2019): each example is a context and four endings, one of them right; every ending is
scored as a continuation of the context (example_tensors), acc by the lowest summed loss, acc_norm by the lowest
mean. The data is rowanz's hellaswag_val.jsonl: a local copy, or downloaded once into data/hellaswag/. Only GPT-2
BPE models can take it (the endings are English text in GPT-2's tokens). Under torchrun the examples (and text
windows) are split over the processes and the counts summed. Not here: the loss during training (train.py).
"""

import json
import math
import os
import sys
import urllib.error
import urllib.request
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from machinery import distributed
from machinery.data import dataset
from machinery.data.dataset import whole_split_batches
from machinery.errors import UserError, first_line
from machinery.fileio import atomic_write, read_text

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_CACHE = os.path.join(dataset.DATA_DIR, "hellaswag", "hellaswag_val.jsonl")
HELLASWAG_FORMAT = "HellaSwag lines are JSON objects with ctx (text), endings (4 texts) and label (0-3)"


# ---------------------------------------------------------------------- HellaSwag


def load_hellaswag(path):
    """The examples of a HellaSwag jsonl file, each {"ctx": str, "endings": [4 str], "label": 0-3}."""
    lines = read_text(path, "HellaSwag file", "check --hellaswag").splitlines()
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
    """The jsonl to read: the file given, or the cached download (fetched on first use): the validation split,
    10,042 examples."""
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
    next token where it belongs to the ending and -1 elsewhere (context and padding are not scored). The tokens
    of `ctx`, then those of " " + ending, encoded separately and concatenated, as build-nanogpt does
    (lm-evaluation-harness adds the same leading space)."""
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
    (acc: lowest sum, acc_norm: lowest mean, the one GPT-2 124M's published figure reports; the first of
    equals) and the label. One forward pass
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


def hellaswag_accuracy(model, encode, examples, device, ctx=nullcontext(), world=distributed.World()):
    """acc and acc_norm over examples, and the counts behind them. Under torchrun (world) example i
    goes to rank i % world.size and the counts are summed over the ranks; every rank runs the same
    number of forward passes (the last ones repeat an example, uncounted), since with FSDP a forward
    pass is a collective that all ranks must join."""
    if not examples:
        raise ValueError("hellaswag_accuracy needs at least one example")
    mine = examples[world.rank::world.size]
    records = hellaswag_scores(model, encode, mine, device, ctx)
    for _ in range(math.ceil(len(examples) / world.size) - len(mine)):
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

    def __init__(self, cfg, data_meta, device, ctx, log, world):
        self.interval, self.last_step = cfg.hellaswag_interval, cfg.max_iters
        self.device, self.ctx, self.log, self.world = device, ctx, log, world
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
        h = hellaswag_accuracy(model, self.encode, self.examples, self.device, self.ctx, self.world)
        self.log(f"step {step}: hellaswag acc_norm {h['acc_norm']:.4f}, acc {h['acc']:.4f} ({h['total']} examples)")
        return {"hellaswag_acc_norm": h["acc_norm"], "hellaswag_acc": h["acc"]}


# ---------------------------------------------------------------------- loss on a text


@torch.no_grad()
def text_loss(model, ids, device, ctx=nullcontext(), batch_size=8, world=distributed.World()):
    """Total cross-entropy (nats) of the model predicting ids[1:] from what precedes, and how many
    tokens it predicted (len(ids) - 1).

    With B = block_size, the ids are cut into consecutive windows that overlap by one token: window k
    is ids[kB : kB + B + 1]; the model reads its first B tokens (fewer in the last window) and predicts
    each one's successor (dataset.whole_split_batches with its tail). So every token after the first is
    predicted exactly once, and token j (j >= 1) from the tokens ids[B * ((j - 1) // B) : j], 1 to B tokens
    of context: the first prediction of each window sees one token, the last sees B (no sliding window: one
    forward pass per B tokens). Under torchrun (world) the batches are split over the ranks and the sums
    added up."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    try:
        for x, y in whole_split_batches(np.asarray(ids, dtype=np.int64), batch_size, model.config.block_size,
                                        "cpu", world.rank, world.size, tail=True):
            sums, counts = token_losses(model, x, y, device, ctx)
            total += sums.sum().double()
            count += counts.sum()
    finally:
        model.train(was_training)
    return distributed.all_reduce(total).item(), distributed.all_reduce(count).item()
