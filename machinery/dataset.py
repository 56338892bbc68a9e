"""
A prepared dataset: where it lives, what it holds, and its two splits opened for reading.

    DATA_DIR/NAME/   train.bin and val.bin (uint16 token ids, nanoGPT's layout), or llm.c's shards
                     NAME_{train,val}_NNNNNN.bin (shards.py); meta.json (meta.py: the tokenizer, the
                     largest id, the files it describes), or nanoGPT's meta.pkl, or nothing (GPT-2 BPE)

`--dataset` is a name under `--data_dir` or a directory path (resolve). load() memory-maps each split
(one .bin file, or a split's shards seen as one array), checks that each holds a training window,
and the Dataset checks the token ids against a model's vocabulary before training starts.
"""

import os
from dataclasses import dataclass

import numpy as np

from machinery import meta, shards
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
    """The dataset in directory, its splits memory-mapped; one-line errors for a missing or too short one."""
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
