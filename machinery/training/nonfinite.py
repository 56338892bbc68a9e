"""
Stopping a training run on a non-finite loss or weights, without saving: the last good checkpoint stays as it was.
Owned here: the mark on the device (the first step whose loss was NaN or infinite, set without a host sync, so a
step never waits for it), read where the loop syncs anyway (a log line, a save, an evaluation), and the checks of
the weights before a save and of the val loss. Not owned: float16's skipped steps (the GradScaler's: no mark).
"""

import math

import torch

from machinery import distributed
from machinery.errors import UserError


class NonFinite:
    """The run's watch for NaN and infinity; at: the step of the first non-finite loss on the device (-1: none)."""

    def __init__(self, device, out_dir):
        self.at = torch.full((), -1, dtype=torch.long, device=device)
        self.no_save = (f"stopping without saving, the last good checkpoint in {out_dir} is untouched (try a "
                        f"lower learning_rate, grad_clip, or dtype=bfloat16)")

    def mark(self, loss, iteration):
        """Mark step iteration (an int, or a captured step's tensor) where loss is not finite, unless marked."""
        bad = ~torch.isfinite(loss.detach())
        self.at.copy_(torch.where(bad & (self.at < 0), iteration, self.at))

    def check(self, sync=False):
        """Stop once a non-finite loss has been marked; with sync (every rank calls it): on any rank."""
        bad = int((distributed.all_reduce(self.at.clone(), op="max") if sync else self.at).item())
        if bad >= 0:
            raise UserError(f"the loss became NaN or infinite in iteration {bad}; {self.no_save}")

    def check_weights(self, weights, iter_num):
        """Stop before saving weights (a state dict) of which one is not finite: a finite loss can still come with
        an overflowing gradient."""
        if not all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
            raise UserError(f"the weights became NaN or infinite by iteration {iter_num}; {self.no_save}")

    @staticmethod
    def check_val(val_loss, iter_num):
        if not math.isfinite(val_loss):
            raise UserError(f"validation loss is not finite at iteration {iter_num}; stopping without saving")
