"""
When train.py's loop evaluates (eval_due) and when it writes ckpt.pt besides (save_due), decided from the step and
the settings alone; and what an evaluation measures, the mean loss of each split over its target tokens
(split_losses), over every rank's batches. Not owned: what the loop does with the losses (best.pt, ckpt.pt:
train.py), HellaSwag's accuracy (scoring.py), the batches themselves (conversations.py).
"""

import math

import torch

from machinery import distributed
from machinery.data import conversations


def eval_due(iter_num, local_iter, cfg):
    """Whether the loop evaluates (and checkpoints) before step iter_num, the local_iter-th of this process.
    Every eval_interval steps (before the first one only with eval_at_start), after the last, and with eval_only."""
    return iter_num % cfg.eval_interval == 0 and (local_iter > 0 or cfg.eval_at_start) \
        or iter_num >= cfg.max_iters or cfg.eval_only


def save_due(iter_num, cfg):
    """Whether ckpt.pt is written right after step iter_num, besides evaluations and signals: every ckpt_interval
    steps and after the last, so saving never waits for an evaluation (which could fail)."""
    return iter_num == cfg.max_iters or bool(cfg.ckpt_interval and iter_num % cfg.ckpt_interval == 0)


@torch.no_grad()
def split_losses(model, dataset, generator, cfg, device, autocast, attention, world):
    """The mean loss of each split over its target tokens, {"train": ..., "val": ...}, over every rank's batches.
    eval_iters random batches of each split, drawn with generator (as in nanoGPT, the training batches' stream: a
    resumed run, which evaluates again at its first step, draws the same ones), split over the ranks, every rank
    the same number (an FSDP forward is a collective); with eval_whole_val, the whole val split in order. Each
    forward in autocast and attention (the training's attention kernel: sdpa_backend.Attention)."""
    model.eval()
    out = {}
    for split, data in (("train", dataset.train), ("val", dataset.val)):
        if split == "val" and cfg.eval_whole_val:
            batches = conversations.split_batches(data, cfg.batch_size, cfg.block_size, device, world.rank,
                                                  world.size)
        else:
            sampler = conversations.batch_sampler(data, cfg.batch_size, cfg.block_size, generator, device)
            batches = (sampler.next() for _ in range(math.ceil(cfg.eval_iters / world.size)))
        totals = torch.zeros(2, device=device, dtype=torch.float64)  # loss summed over the targets, targets
        for x, y in batches:
            with autocast, attention:
                _, loss = model(x, y)
            # loss is the mean over the batch's targets (-1: none), which vary: the whole split's last batch can be
            # smaller, a chat batch's rows hold conversations of any length
            targets = (y >= 0).sum()
            totals[0] += loss.double() * targets
            totals[1] += targets
        totals = distributed.all_reduce(totals)
        out[split] = (totals[0] / totals[1]).item()
    model.train()
    return out
