"""
Dataset metadata: which tokenizer made a dataset's token ids, and what else prepare.py
knows about it. The one place that reads, writes and defaults it.

    data/<dataset>/meta.json    written by prepare.py (JSON, never a pickle)
    a checkpoint                carries a copy, so sample.py decodes as the data was encoded

A dataset without meta.json (nanoGPT's openwebtext) is GPT-2 BPE, as nanoGPT assumes.
"""

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

from fileio import atomic_write, read_json_object
from errors import UserError
from tokenizer import GPT2_VOCAB_SIZE, CharTokenizer, GPT2Tokenizer

FILENAME = "meta.json"


@dataclass
class DatasetMeta:
    tokenizer: Optional[str]  # "char" or "gpt2"; None for token ids without text (bench.py's random data)
    vocab_size: int
    chars: Optional[str] = None  # the character vocabulary, in id order (tokenizer "char")
    train_tokens: Optional[int] = None
    val_tokens: Optional[int] = None
    source: Optional[str] = None  # the text it was prepared from

    @classmethod
    def gpt2(cls):
        return cls(tokenizer="gpt2", vocab_size=GPT2_VOCAB_SIZE)

    @classmethod
    def of(cls, tokenizer, **extra):
        """The metadata of data encoded with tokenizer (a CharTokenizer or GPT2Tokenizer)."""
        chars = tokenizer.chars if tokenizer.kind == "char" else None
        return cls(tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size, chars=chars, **extra)

    @classmethod
    def from_dict(cls, d, where):
        """From a dict read out of meta.json or a checkpoint; keys of later versions are ignored."""
        known = {f.name for f in fields(cls)}
        try:
            meta = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError:
            raise UserError(f"{where} has no vocab_size; run prepare.py again") from None
        if meta.tokenizer not in (None, "char", "gpt2") or (meta.tokenizer == "char" and not meta.chars):
            raise UserError(f"{where}: unknown tokenizer {meta.tokenizer!r} (expected 'char' with its chars, "
                            f"or 'gpt2')")
        return meta

    def to_dict(self):
        return {k: v for k, v in asdict(self).items() if v is not None}

    def make_tokenizer(self):
        if self.tokenizer == "char":
            return CharTokenizer(self.chars)
        if self.tokenizer == "gpt2":
            return GPT2Tokenizer()
        raise UserError("this model's data records no tokenizer (token ids only); give one with --meta")

    def same_tokens(self, other):
        """Do both encode text into the same ids?"""
        return (self.tokenizer, self.chars) == (other.tokenizer, other.chars)


def read(directory):
    """directory/meta.json, or None when there is none."""
    path = os.path.join(directory, FILENAME)
    if not os.path.isfile(path):
        return None
    return DatasetMeta.from_dict(read_json_object(path, "; run prepare.py again"), path)


def write(meta, directory):
    with atomic_write(os.path.join(directory, FILENAME), "w", encoding="utf-8") as f:
        json.dump(meta.to_dict(), f, ensure_ascii=False, indent=1)


def for_dataset(directory):
    """The metadata of a prepared dataset; GPT-2 BPE for one without meta.json (nanoGPT's openwebtext)."""
    return read(directory) or DatasetMeta.gpt2()


def from_path(path):
    """--meta=PATH: a meta.json file or the dataset directory holding one."""
    is_dir = os.path.isdir(path)
    if not is_dir and os.path.basename(path) != FILENAME:
        raise UserError(f"--meta: {path} is not a {FILENAME} file or a directory holding one")
    meta = read(path if is_dir else os.path.dirname(path) or ".")
    if meta is None:
        raise UserError(f"--meta: {path} is not a {FILENAME} file or a directory holding one")
    return meta


def for_nanogpt(dataset, data_root="data"):
    """The tokenizer of a checkpoint that records none (nanoGPT's), and where it came from: the meta.json
    of its dataset directory (nanoGPT's meta.pkl is a pickle and is not loaded), else GPT-2 BPE."""
    if isinstance(dataset, str) and dataset:
        directory = os.path.join(data_root, dataset)
        meta = read(directory)
        if meta:
            return meta, os.path.join(directory, FILENAME)
    return DatasetMeta.gpt2(), "GPT-2 BPE (no meta.json found)"
