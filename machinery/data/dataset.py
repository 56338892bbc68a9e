"""
A prepared dataset: where it lives, what it holds, its two splits opened for reading, and the
batches drawn from them.

    DATA_DIR/NAME/   train.bin and val.bin (uint16 token ids, nanoGPT's layout), or llm.c's shards
                     NAME_{train,val}_NNNNNN.bin (shards.py); meta.json (meta.py: the tokenizer, the
                     largest id, the files it describes), or nanoGPT's meta.pkl, or nothing (GPT-2 BPE)

`--dataset` is a name under `--data_dir` or a directory path (resolve). load() memory-maps each split and checks
it; training draws random windows (BatchSampler, exact on resume), evaluation walks a split (whole_split_batches).
Not here: preparing datasets (prepare.py, corpus.py, conversations.py), chat datasets' batches (conversations.py).
"""

import os
from dataclasses import dataclass

import numpy as np

from machinery.data import meta, shards
from machinery.errors import UserError

DATA_DIR = "data"  # where prepare.py writes datasets unless told otherwise (nanoGPT's data/)


def resolve(data_dir, dataset):
    """The directory of --dataset: a name under data_dir, or a path (with a path separator: e.g. ./fineweb10B,
    the llm.c / modded-nanogpt shards downloaded elsewhere)."""
    return dataset if os.sep in dataset or "/" in dataset else os.path.join(data_dir, dataset)


@dataclass
class Dataset:
    directory: str
    data_meta: meta.DatasetMeta
    train: object  # a uint16 np.memmap, or shards.ShardedTokens: len() and numpy-style indexing
    val: object

    @property
    def meta_path(self):
        return os.path.join(self.directory, meta.FILENAME)

    def check_token_ids(self, vocab_size):
        """Stop before the first step when the data holds a token id the model has no embedding for (on a GPU, a
        device-side assert): from the largest id prepare.py recorded, when its meta.json still describes the
        files (meta.DatasetMeta.describes), else by reading the files in chunks (BENCHMARKS.md: the cost).
        Returns whether the files were read."""
        data_meta = self.data_meta
        if data_meta.max_token_id is not None and data_meta.describes(self.directory):
            if data_meta.max_token_id >= vocab_size:
                raise UserError(f"{self.meta_path} records token id {data_meta.max_token_id}, outside the model's "
                                f"vocabulary of {vocab_size}; prepare the data with the model's tokenizer")
            return False
        for data in (self.train, self.val):
            for path in getattr(data, "paths", []):  # shards
                shards.check_max_token(path, vocab_size)
            if isinstance(data, np.memmap):
                shards.check_max_token(data, vocab_size, name=data.filename)
        return True


def load(directory, block_size):
    """The dataset in directory, its splits memory-mapped (one .bin file, or a split's shards seen as one array);
    one-line errors for a missing or too short one (each must hold a training window). The Dataset checks the
    token ids against a model's vocabulary before training starts."""
    if not os.path.isdir(directory):
        raise UserError(f"dataset directory {directory} does not exist; create it with prepare.py "
                        f"(e.g. python prepare.py shakespeare_char)")
    return Dataset(directory, meta.for_dataset(directory), load_split(directory, "train", block_size),
                   load_split(directory, "val", block_size))


def load_split(directory, split, block_size):
    """Memory-map directory/{split}.bin (nanoGPT's layout) or, without it, the split's llm.c shards
    (*_{split}_*.bin) as one array; check that it holds at least one training window."""
    path = os.path.join(directory, f"{split}.bin")
    if os.path.isfile(path):
        n = os.path.getsize(path) // 2
        data, where = (np.memmap(path, dtype=np.uint16, mode="r", shape=(n,)) if n else np.zeros(0, np.uint16)), path
    elif shards.list_shards(directory)[split]:
        data, where = shards.ShardedTokens(shards.list_shards(directory)[split]), f"the {split} shards of {directory}"
    else:
        raise UserError(f"{path} is missing (and there are no *_{split}_*.bin shards); run prepare.py for this "
                        f"dataset")
    if len(data) < block_size + 1:
        raise UserError(f"{where} has {len(data)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                        f"use more data or a smaller --block_size")
    return data


# ---------------------------------------------------------------------- batches
# (torch is imported inside: prepare.py uses this module's resolve() and does without torch, BENCHMARKS.md)


class BatchSampler:
    """Random (x, y) batches of one split, drawn with the given generator; several samplers can share one,
    as nanoGPT draws train and eval batches from one stream. B windows of block_size + 1 tokens, gathered with one
    fancy-indexing call; x is a window without its last token, y without its first. The generator is the
    sampler's own (not torch's global one), so every data-parallel rank draws different batches, and its state
    goes into checkpoints: a resumed run draws exactly the batches the uninterrupted run would have
    (train.py starts it where nanoGPT's get_batch would)."""

    def __init__(self, data, batch_size, block_size, generator, device="cpu"):
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = generator
        self.device = device

    def next(self):
        import torch

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
    starts = np.arange(n) * block_size
    for i in range(rank * batch_size, n, world_size * batch_size):
        yield _windows(data, starts[i:i + batch_size], block_size, device)


def _windows(data, starts, block_size, device):
    """(x, y) on device for the windows data[s : s + block_size + 1] of each start s, with one gather; a window
    running past the end of data is padded (inputs 0, targets -1)."""
    import torch

    device = torch.device(device)
    index = torch.as_tensor(starts)[:, None] + torch.arange(block_size + 1)
    inside = index < len(data)
    windows = torch.from_numpy(data[index.clamp(max=len(data) - 1).numpy()].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if not inside.all():
        x, y = x.masked_fill(~inside[:, :-1], 0), y.masked_fill(~inside[:, 1:], -1)
    return to_device(x, y, device)


def to_device(x, y, device):
    """A batch (x, y) built on the CPU, moved to device (a torch.device)."""
    if device.type == "cuda":
        # pinned host memory lets the copy run asynchronously with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
