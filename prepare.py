"""
Turn a text file into a training dataset: data/<name>/{train.bin, val.bin, meta.json}.

    python prepare.py shakespeare_char [--input PATH]   # Tiny Shakespeare, one token per character
    python prepare.py shakespeare [--input PATH]        # the same corpus in GPT-2 BPE
    python prepare.py text --input PATH --name NAME [--tokenizer char|gpt2]
    python prepare.py text --input PATH --name NAME --tokenizer bpe --vocab_size 16384   # a BPE learned here
    python prepare.py text --input DIR --name NAME [--tokenizer gpt2|bpe ...]   # documents: token shards (corpus.py)
    python prepare.py fineweb_edu|openwebtext [--tokenizer gpt2|bpe ...]   # the same, from the Hugging Face hub
    python prepare.py chat --input FILE|DIR [--name NAME] [--max_len 1024]   # conversations (conversations.py)

train.bin / val.bin hold the token ids of the first 90% / last 10% of the text
(split by characters) as raw uint16, nanoGPT's format, so data prepared for
nanoGPT works here and the other way round. meta.json says which tokenizer made
them (and, for characters, the vocabulary). The file is read in chunks, so a
large corpus never has to fit in memory as one string.

--tokenizer bpe learns a byte-level BPE of --vocab_size tokens on the training
split (its first --tokenizer_chars characters, where given) with machinery/data/bpe.py,
and writes it beside meta.json (tokenizer.tiktoken). For a directory of documents
the training split is the documents after validation's first ones (corpus.py).
"""

import argparse
import os
import urllib.request
from contextlib import ExitStack

import numpy as np
from tqdm import tqdm

from machinery.data import bpe, conversations, corpus, dataset, meta
from machinery.errors import UserError, run_main
from machinery.fileio import atomic_write
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
CHUNK_BYTES = 4 << 20  # read ~4 MiB of whole lines at a time


def read_chunks(path, progress=True):
    """Yield the file's text in chunks of whole lines, strictly decoded as UTF-8."""
    size = os.path.getsize(path)
    offset = 0
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"reading {os.path.basename(path)}",
                                     disable=not progress or size < CHUNK_BYTES, leave=False) as bar:
        while True:
            lines = f.readlines(CHUNK_BYTES)
            if not lines:
                return
            raw = b"".join(lines)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it to UTF-8 first"
                ) from None
            offset += len(raw)
            bar.update(len(raw))
            yield text


def scan(path):
    """First pass: number of characters and the set of characters."""
    n_chars, chars = 0, set()
    for text in read_chunks(path):
        n_chars += len(text)
        chars.update(text)
    if n_chars == 0:
        raise UserError(f"{path} is empty; give a text file with some content")
    return n_chars, chars


def prepare(input_path, out_dir, tokenizer_kind="char", val_fraction=0.1, vocab_size=None, tokenizer_chars=None):
    """Tokenize input_path into out_dir/train.bin, val.bin and meta.json; return the DatasetMeta. For tokenizer
    "bpe", one of vocab_size tokens is learned first on the training split (its first tokenizer_chars)."""
    if not os.path.isfile(input_path):
        raise UserError(f"input file {input_path} does not exist; pass an existing text file with --input")
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if tokenizer_kind not in ("char", "gpt2", "bpe"):
        raise UserError(f"unknown tokenizer {tokenizer_kind!r}; use char, gpt2 or bpe")
    bpe.check_options(tokenizer_kind, vocab_size, tokenizer_chars)  # (before reading the corpus)
    n_chars, chars = scan(input_path)
    split_at = int(n_chars * (1 - val_fraction))
    tok = make_tokenizer(tokenizer_kind, input_path, chars, vocab_size, min(split_at, tokenizer_chars or split_at))
    if tok.vocab_size > 65536:
        raise UserError(f"{input_path} has {tok.vocab_size} distinct characters, more than uint16 can hold; "
                        f"use --tokenizer gpt2")
    try:
        os.makedirs(out_dir, exist_ok=True)
        # both token files are written beside their old versions and replaced only when both are complete:
        # a failure (a full disk, a bad byte late in the file) leaves an existing dataset untouched
        with ExitStack() as files:
            bins = {split: files.enter_context(atomic_write(os.path.join(out_dir, f"{split}.bin")))
                    for split in ("train", "val")}
            counts = write_tokens(input_path, tok, bins, split_at=split_at, n_chars=n_chars)
        # after the token files are in place: meta.json records what they are (meta.DatasetMeta.describes)
        data_meta = meta.DatasetMeta.of(tok, train_tokens=counts["train"], val_tokens=counts["val"],
                                        max_token_id=counts["max"], source=os.path.abspath(input_path))
        data_meta = meta.write(data_meta, out_dir)
    except OSError as e:
        raise UserError(f"cannot write the dataset in {out_dir} ({e.strerror or e}); free some space or pick "
                        f"another --data_dir (nothing there was changed)") from None
    print(f"{out_dir}: vocab_size {tok.vocab_size}, train {counts['train']:,} tokens, val {counts['val']:,} tokens")
    return data_meta


def make_tokenizer(kind, input_path, chars, vocab_size, learn_chars):
    """The tokenizer of kind for the text in input_path (chars: its characters); bpe: learned on its first
    learn_chars characters."""
    if kind == "char":
        return CharTokenizer(sorted(chars))
    if kind == "gpt2":
        return GPT2Tokenizer()
    return bpe.learn_on(bpe.pieces(read_chunks(input_path), learn_chars), vocab_size,
                        f"{learn_chars:,} characters of {input_path}")


def write_tokens(input_path, tok, bins, split_at, n_chars):
    """Encode the text chunk by chunk: characters before split_at into bins["train"], the rest into
    bins["val"], as raw uint16. Returns the token counts and the largest id ("max")."""
    counts, pos = {"train": 0, "val": 0, "max": -1}, 0
    with tqdm(total=n_chars, unit="char", unit_scale=True, desc="tokenizing", disable=n_chars < CHUNK_BYTES) as bar:
        for text in read_chunks(input_path, progress=False):
            cut = min(max(split_at - pos, 0), len(text))
            for split, part in (("train", text[:cut]), ("val", text[cut:])):
                if part:
                    ids = np.array(tok.encode(part), dtype=np.uint16)
                    bins[split].write(ids.tobytes())  # (numpy's tofile hides the OS error's reason)
                    counts[split] += len(ids)
                    counts["max"] = max(counts["max"], int(ids.max()))
            pos += len(text)
            bar.update(len(text))
    return counts


def download_shakespeare(data_dir):
    """Tiny Shakespeare, downloaded once into data/shakespeare_char/input.txt."""
    path = os.path.join(dataset.resolve(data_dir, "shakespeare_char"), "input.txt")
    if os.path.isfile(path):
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
            body = r.read()
    except Exception as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(f"cannot download Tiny Shakespeare ({reason}); "
                        f"give a local copy with --input PATH/TO/input.txt") from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_write(path) as f:
        f.write(body)
    return path


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message}; see --help")


def parser():
    """The command line's options."""
    p = OneLineParser(description="Prepare a corpus for train.py: data/NAME/train.bin, val.bin and meta.json for a "
                                  "text file (for chat conversations also a loss mask and offsets); llm.c token shards "
                                  "for large corpora (openwebtext, fineweb_edu).")
    p.add_argument("corpus", choices=["shakespeare_char", "shakespeare", "text", "chat", "openwebtext", "fineweb_edu"],
                   help="which corpus to prepare: shakespeare_char: Tiny Shakespeare by character; shakespeare: Tiny Shakespeare in GPT-2 BPE; "
                        "text: any UTF-8 file, or a directory of documents, given with --input; chat: conversations "
                        "(JSON lines of {\"messages\": [...]}, or parquet with a messages column); openwebtext, "
                        "fineweb_edu: GPT-2 token shards, from the Hugging Face hub or --input")
    p.add_argument("--input", help="local text file (for shakespeare*: skips the download); for text, openwebtext and "
                                   "fineweb_edu, a directory or file of documents (.parquet with a text column, "
                                   ".jsonl[.gz] with a \"text\" field, .txt files of one document each); for chat, "
                                   "a .jsonl[.gz] or .parquet file of conversations, or a directory of them")
    p.add_argument("--name", help="the dataset's name: output in DATA_DIR/NAME (a plain name, not a path; default: "
                                  "the corpus's)")
    p.add_argument("--tokenizer", choices=["char", "gpt2", "bpe"],
                   help="for `text` (default char for a file, gpt2 for a directory; chat: gpt2 only) and the hub "
                        "corpora (gpt2 or bpe); bpe: a byte-level BPE learned on the training split, of --vocab_size "
                        "tokens")
    p.add_argument("--vocab_size", type=int, help="--tokenizer bpe: the tokens to learn, the 256 bytes and "
                                                  f"{len(bpe.SPECIALS)} special tokens among them (e.g. 16384)")
    p.add_argument("--tokenizer_chars", type=int, help="--tokenizer bpe: learn on the first this many characters "
                                                       "of the training split (default: all of it; for openwebtext "
                                                       f"and fineweb_edu {corpus.HUB_TOKENIZER_CHARS:,})")
    p.add_argument("--data_dir", default=dataset.DATA_DIR, help=f"where datasets live (default: {dataset.DATA_DIR})")
    p.add_argument("--val_fraction", type=float, default=0.1, help="share of a text file (or of the conversations) "
                                                                   "kept for validation")
    p.add_argument("--max_len", type=int, default=conversations.DEFAULT_MAX_LEN,
                   help="chat: the most tokens a conversation may have (default 1024; train with block_size >= "
                        "max_len - 1): a longer one is cut after its last assistant turn that fits, or dropped")
    p.add_argument("--subset", help="fineweb_edu: the hub subset (default sample-10BT; e.g. sample-100BT, "
                                    "CC-MAIN-2024-10)")
    p.add_argument("--num_proc", type=int, default=None, help="tokenizer processes for shards (default: every core)")
    p.add_argument("--shard_tokens", type=int, default=corpus.DEFAULT_SHARD_TOKENS,
                   help="tokens per shard (default 100M); the first shard is the validation split, or the first "
                        "10%% of a corpus of fewer than two shards")
    return p


def of_documents(args):
    """Is the corpus one of documents, prepared as token shards (corpus.py): a hub corpus or a directory?"""
    return args.corpus in corpus.HUB_CORPORA or (args.corpus == "text" and bool(args.input)
                                                  and os.path.isdir(args.input))


def check_tokenizer_options(args):
    """A one-line error for a --tokenizer the corpus is not prepared in (a preset's own, bpe for chat, char for
    documents), --vocab_size without bpe (or out of range), --tokenizer_chars without it (or below 1)."""
    if args.tokenizer is not None and args.corpus in ("shakespeare_char", "shakespeare"):
        raise UserError(f"{args.corpus} is prepared in its own tokenizer, not --tokenizer {args.tokenizer}; for "
                        f"another: prepare.py text --input FILE --name NAME --tokenizer {args.tokenizer}")
    if args.tokenizer == "bpe" and args.corpus == "chat":
        raise UserError("--tokenizer bpe is for `text` files and directories and the hub corpora (openwebtext, "
                        "fineweb_edu); chat is prepared with its own tokenizer")
    bpe.check_options(args.tokenizer, args.vocab_size, args.tokenizer_chars)
    if args.tokenizer == "char" and of_documents(args):
        raise UserError("documents are prepared in GPT-2 BPE or a BPE learned on them (--tokenizer gpt2 or bpe), not "
                        "by character; join them into one text file for char")


def main(argv=None):
    args = parser().parse_args(argv)
    if args.name is not None:
        corpus.check_name(args.name)  # nothing is ever written outside data_dir
    check_tokenizer_options(args)
    if of_documents(args):
        corpus.prepare_from_cli(args.corpus, args.data_dir, args.name, args.input, args.subset, args.num_proc,
                                args.shard_tokens, args.vocab_size, args.tokenizer_chars)
        return
    if args.corpus == "chat":
        if not args.input:
            raise UserError("`chat` needs --input FILE|DIR (JSON lines or parquet conversations)")
        conversations.prepare(args.input, dataset.resolve(args.data_dir, args.name or "chat"), args.tokenizer or "gpt2",
                              args.max_len, args.val_fraction)
        return
    if args.corpus == "text":
        if not args.input or not args.name:
            raise UserError("`text` needs --input PATH and --name NAME")
        name, kind = args.name, args.tokenizer or "char"
    else:
        name, kind = args.corpus, "char" if args.corpus == "shakespeare_char" else "gpt2"
    input_path = args.input or download_shakespeare(args.data_dir)
    prepare(input_path, dataset.resolve(args.data_dir, name), kind, args.val_fraction, args.vocab_size,
            args.tokenizer_chars)


if __name__ == "__main__":
    run_main(main)
