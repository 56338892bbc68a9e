"""
Token shards in llm.c's format, and random training windows across all shards of a split.

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, the number of tokens, then zeros)
followed by the tokens as uint16: the files llm.c's dev/data scripts and modded-nanogpt's FineWeb downloads use,
so shards made there train here and the other way round. A dataset directory holds <name>_val_NNNNNN.bin and
<name>_train_NNNNNN.bin (llm.c's `fineweb_train_000001.bin` is the same pattern).

Owns the format (writing, reading and checking a shard) and ShardedTokens, a split's shards seen as one array.
Not here: cutting a corpus into shards (corpus.py), drawing batches (dataset.BatchSampler).
"""

import os
import re

import numpy as np

from machinery.errors import UserError
from machinery.fileio import atomic_write

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_RE = re.compile(r"^(?P<name>.+)_(?P<split>train|val)_(?P<number>\d+)\.bin$")
CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning a shard (32 MiB of uint16)


def header_bytes(n_tokens):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, n_tokens)
    return header.tobytes()


def write_shard(path, tokens):
    """Write tokens (ids < 65536) as a shard at path, atomically: a temp file in the same directory,
    fsynced, then renamed over path, so a crash never leaves a half-written shard under its name."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError("a shard holds a 1-D array of tokens")
    if tokens.dtype != np.uint16:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
            raise ValueError("token ids must fit in uint16 to be written to a shard")
        tokens = tokens.astype(np.uint16)
    if tokens.size >= 1 << 31:
        raise ValueError("a shard holds fewer than 2**31 tokens (its header counts them in int32)")
    with atomic_write(path) as f:
        f.write(header_bytes(len(tokens)))
        tokens.astype("<u2", copy=False).tofile(f)


def read_header(path):
    """The number of tokens of the shard at path, after checking its magic, version and length."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise UserError(f"cannot read shard {path} ({e.strerror}); check the dataset directory") from None
    if len(raw) < HEADER_BYTES:
        raise UserError(f"{path} is {size} bytes, shorter than a shard header ({HEADER_BYTES} bytes); "
                        f"it is truncated or not a token shard: prepare it again")
    magic, version, n = np.frombuffer(raw, dtype="<i4", count=3).tolist()
    if magic != MAGIC:
        raise UserError(f"{path} is not a token shard (magic {magic}, expected {MAGIC}); "
                        f"remove it from the dataset directory or prepare it again")
    if version != VERSION:
        raise UserError(f"{path} has shard version {version}, this code reads version {VERSION} (uint16 tokens); "
                        f"prepare it again with this repository")
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise UserError(f"{path} is {size} bytes but its header announces {n} tokens "
                        f"({HEADER_BYTES + 2 * n} bytes); it is truncated or damaged: prepare it again")
    return n


def open_tokens(path):
    """The shard's tokens as a read-only uint16 memmap (nothing is read until indexed)."""
    n = read_header(path)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)  # numpy cannot map an empty range
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


def list_shards(data_dir):
    """{'train': [paths], 'val': [paths]} of the shards in data_dir, each split in shard-number order."""
    found = {"train": [], "val": []}
    if not os.path.isdir(data_dir):
        return found
    for entry in os.listdir(data_dir):
        m = SHARD_RE.match(entry)
        if m and os.path.isfile(os.path.join(data_dir, entry)):
            found[m["split"]].append((int(m["number"]), entry))
    return {split: [os.path.join(data_dir, e) for _, e in sorted(items)] for split, items in found.items()}


def check_max_token(path_or_array, vocab_size, chunk=CHECK_CHUNK, name=None):
    """Check that every token id is < vocab_size, a chunk at a time (a shard is never loaded whole);
    return the largest id. A path is opened as a shard; anything else is taken as a 1-D token array
    (read from the file `name`, for the message)."""
    if isinstance(path_or_array, (str, os.PathLike)):
        name, tokens = os.fspath(path_or_array), open_tokens(path_or_array)
    else:
        name, tokens = name or "the token array", path_or_array
    largest = -1
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        top = int(part.max()) if part.size else -1
        if top >= vocab_size:
            i = int(np.argmax(part >= vocab_size))
            raise UserError(f"{name} holds token id {int(part[i])} at position {start + i}, outside the "
                            f"vocabulary of {vocab_size} tokens; prepare the data with this model's tokenizer")
        largest = max(largest, top)
    return largest


class ShardedTokens:
    """Several shards seen as the one token array of their concatenation, in the order given.

    The shards of a split are one token stream cut at a fixed token count (corpus.py), even inside a document, so
    a training window may run across a shard boundary as it may across a document boundary: windows stay uniform
    by token over the whole split, and dataset.BatchSampler's generator state draws the same windows as a
    concatenated train.bin would (exact resume keeps working).

    Supports len(), an int, a slice with step 1, and an integer numpy array of any shape (the gather
    data[starts[:, None] + arange(block + 1)] of dataset._windows); the result is uint16 like a memmap's.
    Each shard is memory-mapped, so only the gathered tokens are read."""

    dtype = np.dtype(np.uint16)

    def __init__(self, paths):
        self.paths = [os.fspath(p) for p in paths]
        self.shards = [open_tokens(p) for p in self.paths]
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.ends = np.cumsum(lengths)  # ends[i]: global index just past shard i
        self.starts = self.ends - lengths

    def __len__(self):
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self):
        return (len(self),)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens supports slices with step 1 only")
            return self._gather(np.arange(start, max(start, stop), dtype=np.int64))
        index = np.asarray(index)
        if index.dtype.kind not in "iu":
            raise IndexError("ShardedTokens is indexed by integers")
        if index.ndim == 0:
            return self._gather(index.reshape(1))[0]
        return self._gather(index)

    def _gather(self, index):
        """Tokens at global positions index (any shape): each position looked up in its shard."""
        flat = index.reshape(-1).astype(np.int64)
        n = len(self)
        if flat.size and (flat.min() < -n or flat.max() >= n):
            raise IndexError(f"index out of range for {n} tokens")
        flat = np.where(flat < 0, flat + n, flat)
        shard = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, dtype=np.uint16)
        for s in np.unique(shard):  # a batch touches few shards: one vectorised gather each
            mask = shard == s
            out[mask] = self.shards[s][flat[mask] - self.starts[s]]
        return out.reshape(index.shape)
