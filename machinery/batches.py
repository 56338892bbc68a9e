"""
The batch stream: random training batches from a split of a dataset (dataset.py opens the
splits: nanoGPT's train.bin / val.bin memory-mapped, or llm.c's shards seen as one array), and
the whole split in order for evaluation.

A batch is B random windows of block_size + 1
tokens, gathered with one fancy-indexing call (no Python loop, no re-opening the
file per batch); x is the window without its last token, y without its first.

Evaluation can instead walk a whole split once, in order (whole_split_batches).

The sampler draws with its own random generator (not torch's global one), so that
 - every data-parallel rank draws different batches, and
 - its state goes into checkpoints and a resumed run draws exactly the batches
   the uninterrupted run would have drawn.
train.py starts that generator where nanoGPT's get_batch would start (see Trainer).
"""

import numpy as np
import torch


class BatchSampler:
    """Random (x, y) batches of one split, drawn with the given generator; several samplers can share one,
    as nanoGPT draws train and eval batches from one stream."""

    def __init__(self, data, batch_size, block_size, generator, device="cpu"):
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = generator
        self.device = torch.device(device)

    def next(self):
        starts = torch.randint(len(self.data) - self.block_size, (self.batch_size,), generator=self.generator)
        return _windows(self.data, starts, self.block_size, self.device)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def whole_split_batches(data, batch_size, block_size, device="cpu", rank=0, world_size=1, tail=False):
    """Every token of a split once, in order: the split cut into consecutive windows of block_size + 1
    tokens that overlap by one, so each token after the first is a target exactly once; batch_size windows
    per batch. The last (len - 1) % block_size targets, too few for a window, are left out (train.py's
    whole-split val loss), or with tail=True make a last, shorter window, padded with inputs 0 and targets -1,
    which the loss ignores (eval.py's loss on a text). With several processes, rank takes every
    world_size-th batch."""
    targets = len(data) - 1
    n = -(-targets // block_size) if tail else targets // block_size
    starts = torch.arange(n) * block_size
    for i in range(rank * batch_size, n, world_size * batch_size):
        yield _windows(data, starts[i:i + batch_size], block_size, torch.device(device))


def _windows(data, starts, block_size, device):
    """(x, y) on device for the windows data[s : s + block_size + 1] of each start s, with one gather; a window
    running past the end of data is padded (inputs 0, targets -1)."""
    index = starts[:, None] + torch.arange(block_size + 1)
    inside = index < len(data)
    windows = torch.from_numpy(data[index.clamp(max=len(data) - 1).numpy()].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if not inside.all():
        x, y = x.masked_fill(~inside[:, :-1], 0), y.masked_fill(~inside[:, 1:], -1)
    if device.type == "cuda":
        # pinned host memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
