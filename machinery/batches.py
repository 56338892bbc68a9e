"""
Training data: the token files prepare.py writes (nanoGPT's train.bin / val.bin, or llm.c's
shards, see shards.py), and random batches from them.

Each split is memory-mapped once. A batch is B random windows of block_size + 1
tokens, gathered with one fancy-indexing call (no Python loop, no re-opening the
file per batch); x is the window without its last token, y without its first.

Evaluation can instead walk a whole split once, in order (whole_split_batches).

The sampler draws with its own random generator (not torch's global one), so that
 - every data-parallel rank draws different batches, and
 - its state goes into checkpoints and a resumed run draws exactly the batches
   the uninterrupted run would have drawn.
train.py starts that generator where nanoGPT's get_batch would start (see Trainer).
"""

import os

import numpy as np
import torch

from machinery import meta, shards
from machinery.errors import UserError


def dataset_dir(data_dir, dataset):
    """--dataset is a name under --data_dir, or a directory path (with a path separator: e.g. ./fineweb10B,
    the llm.c / modded-nanogpt shards downloaded elsewhere)."""
    return dataset if os.sep in dataset or "/" in dataset else os.path.join(data_dir, dataset)


def load_dataset(directory, block_size):
    """A prepared dataset: its metadata and the train and val token arrays (memory-mapped)."""
    return meta.for_dataset(directory), load_split(directory, "train", block_size), \
        load_split(directory, "val", block_size)


def load_split(data_dir, split, block_size):
    """Memory-map data_dir/{split}.bin (nanoGPT's layout) or, without it, the split's llm.c shards
    (*_{split}_*.bin) as one array; check that it holds at least one training window."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isdir(data_dir):
        raise UserError(f"dataset directory {data_dir} does not exist; create it with prepare.py "
                        f"(e.g. python prepare.py shakespeare_char)")
    if not os.path.isfile(path) and shards.list_shards(data_dir)[split]:
        return shards.open_split(data_dir, split, block_size)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; run prepare.py for this dataset")
    n = os.path.getsize(path) // 2
    if n < block_size + 1:
        raise UserError(f"{path} has {n} tokens, fewer than block_size + 1 = {block_size + 1}; "
                        f"use more text or a smaller --block_size")
    return np.memmap(path, dtype=np.uint16, mode="r", shape=(n,))


def check_token_ids(data_meta, directory, splits, vocab_size):
    """Stop before the first step when the data holds a token id the model has no embedding for (on a GPU,
    a device-side assert): from the largest id prepare.py recorded, when its meta.json still describes the
    files (meta.DatasetMeta.describes), else by reading the files in chunks (BENCHMARKS.md: the cost).
    Returns whether the files were read."""
    if data_meta.max_token_id is not None and data_meta.describes(directory):
        if data_meta.max_token_id >= vocab_size:
            raise UserError(f"{os.path.join(directory, meta.FILENAME)} records token id {data_meta.max_token_id}, "
                            f"outside the model's vocabulary of {vocab_size}; prepare the data with the model's "
                            f"tokenizer")
        return False
    for data in splits:
        for path in getattr(data, "paths", []):  # shards
            shards.check_max_token(path, vocab_size)
        if isinstance(data, np.memmap):
            shards.check_max_token(data, vocab_size, name=data.filename)
    return True


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


def whole_split_batches(data, batch_size, block_size, device="cpu", rank=0, world_size=1):
    """Every token of a split once, in order: the split cut into consecutive windows of block_size + 1
    tokens that overlap by one (each token after the first is a target exactly once; the last
    (len - 1) % block_size targets, too few for a window, are left out), batch_size windows per batch.
    With several processes, rank takes every world_size-th batch."""
    n = (len(data) - 1) // block_size
    starts = torch.arange(n) * block_size
    for i in range(rank * batch_size, n, world_size * batch_size):
        yield _windows(data, starts[i:i + batch_size], block_size, torch.device(device))


def _windows(data, starts, block_size, device):
    """(x, y) on device for the windows data[s : s + block_size + 1] of each start s, with one gather."""
    windows = data[(starts[:, None] + torch.arange(block_size + 1)).numpy()].astype(np.int64)
    windows = torch.from_numpy(windows)
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if device.type == "cuda":
        # pinned host memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
