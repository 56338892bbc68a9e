"""
Dataset metadata: which tokenizer made a dataset's token ids, and what else prepare.py
knows about it. The one place that reads, writes and defaults it.

    data/<dataset>/meta.json    written by prepare.py (JSON, never a pickle)
    data/<dataset>/tokenizer.tiktoken   a learned BPE's ranks (tokenizer "bpe"), named by meta.json
    data/<dataset>/meta.pkl     nanoGPT's, for character-level data: read as plain data only (below)
    a checkpoint                carries a copy, so sample.py decodes as the data was encoded

A dataset with neither (nanoGPT's openwebtext, llm.c's shards) is GPT-2 BPE, as nanoGPT assumes.
"""

import hashlib
import io
import json
import os
import pickle
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

from machinery.data import chat
from machinery.errors import UserError
from machinery.fileio import atomic_write, read_json_object
from machinery.data.tokenizer import GPT2_VOCAB_SIZE, BPETokenizer, CharTokenizer, GPT2Tokenizer, format_ranks, parse_ranks

FILENAME = "meta.json"
BPE_FILENAME = "tokenizer.tiktoken"  # a learned BPE's ranks, beside meta.json
# a new model for GPT-2 BPE data gets GPT-2's 50257 tokens padded up to a multiple of 64 (faster matmuls), as
# nanoGPT's: 50304, GPTConfig's default vocab_size
GPT2_PADDED_VOCAB_SIZE = -(-GPT2_VOCAB_SIZE // 64) * 64
NANOGPT_PICKLE = "meta.pkl"  # what nanoGPT's prepare scripts write


@dataclass
class DatasetMeta:
    tokenizer: Optional[str]  # "char", "gpt2" or "bpe" (learned); None for token ids without text (bench.py's random data)
    vocab_size: int
    chars: Optional[str] = None  # the character vocabulary, in id order (tokenizer "char")
    train_tokens: Optional[int] = None
    val_tokens: Optional[int] = None
    max_token_id: Optional[int] = None  # the largest id in the data (checked against the model's vocabulary)
    documents: Optional[int] = None  # (corpora prepared into shards)
    shards: Optional[int] = None
    source: Optional[str] = None  # the text it was prepared from
    # the token files (*.bin) beside meta.json when it was written, name -> [bytes, mtime_ns]: max_token_id
    # speaks for them only while they are still those files (describes)
    files: Optional[dict] = None
    chat: Optional[str] = None  # the chat format of conversations (machinery/data/chat.py's TEMPLATE); None: plain text
    # a learned BPE (tokenizer "bpe"): its ranks in tiktoken's format (text), held in a checkpoint's copy and
    # in memory, but in meta.json's directory as the file tokenizer_file (its sha256 beside it); its special tokens
    ranks: Optional[str] = None
    tokenizer_file: Optional[str] = None
    tokenizer_sha256: Optional[str] = None
    special_tokens: Optional[dict] = None

    @classmethod
    def gpt2(cls, **extra):
        """The metadata of GPT-2 BPE data (of(GPT2Tokenizer()), without building the tokenizer)."""
        return cls(tokenizer="gpt2", vocab_size=GPT2_VOCAB_SIZE, **extra)

    @classmethod
    def of(cls, tokenizer, **extra):
        """The metadata of data encoded with tokenizer (a CharTokenizer or GPT2Tokenizer), or of token ids with
        no text behind them (tokenizer None; give vocab_size). extra: the statistics (train_tokens, ...)."""
        if tokenizer is None:
            return cls(tokenizer=None, **extra)
        if tokenizer.kind == "bpe":
            return cls(tokenizer="bpe", vocab_size=tokenizer.vocab_size,
                       ranks=format_ranks(tokenizer.ranks).decode("ascii"),
                       special_tokens=tokenizer.specials, **extra)
        chars = tokenizer.chars if tokenizer.kind == "char" else None
        return cls(tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size, chars=chars, **extra)

    @classmethod
    def from_dict(cls, d, where, directory=None):
        """From a dict read out of meta.json (directory: where it lies, for a learned BPE's file) or a
        checkpoint; keys of later versions are ignored."""
        if not isinstance(d.get("vocab_size"), int):
            raise UserError(f"{where} has no vocab_size; run prepare.py again")
        known = {f.name for f in fields(cls)}
        meta = cls(**{"tokenizer": None, **{k: v for k, v in d.items() if k in known}})
        if meta.tokenizer == "bpe" and meta.ranks is None and directory is not None:
            meta = replace(meta, ranks=_read_ranks(directory, meta, where))
        if meta.tokenizer not in (None, "char", "gpt2", "bpe") or (meta.tokenizer == "char" and not meta.chars) or (
                meta.tokenizer == "bpe" and not (meta.ranks and isinstance(meta.special_tokens, dict))):
            raise UserError(f"{where}: unknown tokenizer {meta.tokenizer!r} (expected 'char' with its chars, "
                            f"'gpt2', or 'bpe' with its ranks and special tokens)")
        return meta

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if v is not None}

    def make_tokenizer(self):
        if self.tokenizer == "char":
            return CharTokenizer(self.chars)
        if self.tokenizer == "bpe":  # (its chat format's special tokens are in its vocabulary)
            return BPETokenizer.learned(parse_ranks(self.ranks.encode("ascii")), self.special_tokens)
        if self.tokenizer == "gpt2":
            return chat.tokenizer(self.chat) if self.chat else GPT2Tokenizer()
        raise UserError("this model's data records no tokenizer (token ids only); give one with --meta")

    @property
    def model_vocab_size(self):
        """The vocabulary a new model for this data gets: GPT-2 BPE's padded to GPT2_PADDED_VOCAB_SIZE, any other
        its own size."""
        return GPT2_PADDED_VOCAB_SIZE if self.tokenizer == "gpt2" else self.vocab_size

    def describes(self, directory):
        """Does this metadata describe the token files in directory as they are now: the same .bin files, of
        the same sizes and modification times as when it was written? A train.bin rewritten since, a shard
        added, or a meta.json copied from another dataset does not."""
        return self.files is not None and self.files == token_file_stamps(directory)

    def same_tokens(self, other):
        """Do both encode text into the same ids?"""
        return ((self.tokenizer, self.chars, self.ranks, self.special_tokens)
                == (other.tokenizer, other.chars, other.ranks, other.special_tokens))

    def to_file_dict(self):
        """What meta.json holds: to_dict with a learned BPE's ranks left to their file."""
        return {k: v for k, v in self.to_dict().items() if k != "ranks"}


def _read_ranks(directory, data_meta, where):
    """The ranks (text) of the learned BPE that meta.json in directory names, checked against its sha256."""
    name = data_meta.tokenizer_file or ""
    if os.path.basename(name) != name or not name:
        raise UserError(f"{where}: tokenizer_file {name!r} is not a file name beside it; run prepare.py again")
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path}, the dataset's tokenizer ({e.strerror}); run prepare.py again") from None
    if hashlib.sha256(data).hexdigest() != data_meta.tokenizer_sha256:
        raise UserError(f"{path} is not the tokenizer {where} was written with (its sha256 differs); run prepare.py "
                        f"again")
    return data.decode("ascii")


def read(directory):
    """directory/meta.json, else nanoGPT's meta.pkl there, else None."""
    return _find(directory)[0]


def _find(directory):
    """(metadata, the file it came from), or (None, None)."""
    path = os.path.join(directory, FILENAME)
    if os.path.isfile(path):
        return DatasetMeta.from_dict(read_json_object(path, "; run prepare.py again"), path, directory), path
    path = os.path.join(directory, NANOGPT_PICKLE)
    if os.path.isfile(path):
        return _from_nanogpt_pickle(path), path
    return None, None


def _from_nanogpt_pickle(path):
    """nanoGPT's character vocabulary ({vocab_size, itos, stoi}), read as plain data: a meta.pkl that asks
    for anything else (code) is refused before any of it runs."""
    d = read_plain_pickle(path)
    itos = d.get("itos") if isinstance(d, dict) else None
    vocab = d.get("vocab_size") if isinstance(d, dict) else None
    if not (isinstance(vocab, int) and vocab > 0 and isinstance(itos, dict)
            and all(isinstance(itos.get(i), str) and len(itos[i]) == 1 for i in range(vocab))):
        raise UserError(f"{path} is not a nanoGPT character meta.pkl (a dict with vocab_size and itos of single "
                        f"characters); give a meta.json with --meta, or prepare the dataset here")
    return DatasetMeta.of(CharTokenizer("".join(itos[i] for i in range(vocab))), source=path)


class _Refused(Exception):
    """The pickle asks for more than plain data."""


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles what pickle encodes directly (dict, list, tuple, set, str, bytes, numbers, bool, None) and refuses
    everything else before it runs: every way a pickle reaches a callable (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*)
    goes through find_class."""

    def find_class(self, module, name):
        raise _Refused(f"it asks to import {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("it uses persistent ids")


def read_plain_pickle(path):
    """The plain data (dicts, lists, strings, numbers) pickled in path; anything that would import is refused."""
    try:
        with open(path, "rb") as f:
            return _PlainUnpickler(io.BytesIO(f.read())).load()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror})") from None
    except _Refused as e:
        raise UserError(f"refusing to load {path}: {e}, and it should hold only plain data (nothing in it was "
                        f"run); use a file from a source you trust") from None
    except Exception as e:  # truncated or not a pickle at all: EOFError, ValueError, ...
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}); prepare the dataset again") from None


def write(meta, directory):
    """Write directory/meta.json (and a learned BPE's file before it), recording the token files it describes
    (so write it after them); return what it holds."""
    meta = replace(meta, files=token_file_stamps(directory) or None)
    if meta.tokenizer == "bpe":
        data = meta.ranks.encode("ascii")
        with atomic_write(os.path.join(directory, BPE_FILENAME)) as f:
            f.write(data)
        meta = replace(meta, tokenizer_file=BPE_FILENAME, tokenizer_sha256=hashlib.sha256(data).hexdigest())
    with atomic_write(os.path.join(directory, FILENAME), "w", encoding="utf-8") as f:
        json.dump(meta.to_file_dict(), f, ensure_ascii=False, indent=1)
    return meta


def token_file_stamps(directory):
    """name -> [bytes, mtime_ns] of the token files (*.bin: train.bin and val.bin, or shards) in directory."""
    return {entry.name: [entry.stat().st_size, entry.stat().st_mtime_ns] for entry in os.scandir(directory)
            if entry.name.endswith(".bin") and entry.is_file()}


def for_dataset(directory):
    """The metadata of a prepared dataset; GPT-2 BPE for one without meta.json (nanoGPT's openwebtext)."""
    return read(directory) or DatasetMeta.gpt2()


def from_path(path):
    """--meta=PATH: a meta.json (or nanoGPT's meta.pkl) file, or the dataset directory holding one."""
    is_dir = os.path.isdir(path)
    found = None
    if is_dir:
        found = read(path)
    elif os.path.basename(path) == FILENAME and os.path.isfile(path):
        found = DatasetMeta.from_dict(read_json_object(path, "; run prepare.py again"), path, os.path.dirname(path))
    elif os.path.basename(path) == NANOGPT_PICKLE and os.path.isfile(path):
        found = _from_nanogpt_pickle(path)
    if found is None:
        raise UserError(f"--meta: {path} is not a {FILENAME} or {NANOGPT_PICKLE} file, or a directory holding one")
    return found


def for_nanogpt(directory):
    """The tokenizer of a checkpoint that records none (nanoGPT's), and where it came from: the meta.json or
    nanoGPT's meta.pkl of its dataset directory (None: not known), else GPT-2 BPE (as nanoGPT's sample.py
    assumes)."""
    if directory:
        found, path = _find(directory)
        if found:
            return found, path
    return DatasetMeta.gpt2(), f"GPT-2 BPE (no {FILENAME} or {NANOGPT_PICKLE} found)"
