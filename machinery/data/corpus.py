"""
Large-corpus preparation: documents in (documents.py), token shards out (prepare.py's openwebtext, fineweb_edu
and `text --input DIR` modes), GPT-2's or a BPE learned on the corpus (`--tokenizer bpe`).

    documents, in order -> [eot] + encode_ordinary(doc) on every core (a process pool, results kept in order)
      -> shards of shard_tokens tokens: <name>_val_000000.bin (the first documents),
         then <name>_train_000001.bin, _000002.bin, ... (llm.c's format, see shards.py)

Owns the cutting (llm.c's fineweb.py layout: a document may continue in the next shard; small corpora and learned
BPEs split otherwise: small_corpus_val_tokens, held_out_documents), flat memory, and resuming an interrupted run
byte for byte (load_progress). README's corpus section says how to run it. Not here: reading documents
(documents.py), the shard format (shards.py), learning a BPE (bpe.py).
"""

import hashlib
import json
import os
import re
from collections import deque
from contextlib import closing
from dataclasses import replace
from itertools import islice

import numpy as np
from tqdm import tqdm

from machinery.data import bpe, dataset, meta, shards
from machinery.data.documents import HubSource, LocalSource
from machinery.errors import UserError
from machinery.fileio import atomic_write, remove_stale_temps
from machinery.data.tokenizer import GPT2_EOT

DEFAULT_SHARD_TOKENS = 100_000_000
VAL_PERCENT = 10  # validation's share of a corpus under two shards (prepare.py's --val_fraction for a text file)
MIN_SPLIT_TOKENS = 1025  # ... but at least one GPT-2 training window (block_size 1024 + 1), and as many for train
CHUNK_CHARS = 1 << 20  # documents are sent to the workers in chunks of about 1M characters
CHUNK_DOCS = 4096  # ... or this many documents, whichever comes first
PROGRESS_FILE = "prepare_progress.json"
HUB_CORPORA = {  # prepare.py's corpus -> (hub repository, default subset)
    "fineweb_edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
    "openwebtext": ("Skylion007/openwebtext", None),
}
# a BPE for a hub corpus is learned on this many of its training characters unless --tokenizer_chars says otherwise:
# ~2 billion, as nanochat's speedrun learns its tokenizer on (the whole of sample-10BT is ~45 billion)
HUB_TOKENIZER_CHARS = 2_000_000_000


def check_name(name):
    """A dataset name must be a plain directory name: no path separator, no '..'."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or ".." in name or os.sep in name:
        raise UserError(f"--name {name!r} must be a plain name (letters, digits, - and _), not a path")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UserError(f"--name {name!r} must be a plain name (letters, digits, - and _)")
    return name


# ---------------------------------------------------------------------------- tokenization


def encode_chunk(docs, tok):
    """[eot] + encode_ordinary(doc) for each document, in the tiktoken encoding of tok (a GPT2Tokenizer or
    BPETokenizer): (all tokens as uint16, tokens per document)."""
    enc = tok.enc
    tokens, lengths = [], []
    for doc in docs:
        ids = enc.encode_ordinary(doc)
        tokens.append(enc.eot_token)
        tokens.extend(ids)
        lengths.append(len(ids) + 1)
    return np.array(tokens, dtype=np.uint16), np.array(lengths, dtype=np.int64)


def _chunks(documents):
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


_worker_tokenizer = None  # a worker process's tokenizer (_start_worker)


def _start_worker(tokenizer_meta):
    """Build the worker's tokenizer once, from metadata that pickles cheaply (a learned BPE's ranks as text)."""
    global _worker_tokenizer
    _worker_tokenizer = tokenizer_meta.make_tokenizer()


def _encode_in_worker(docs):
    return encode_chunk(docs, _worker_tokenizer)


def encoded_chunks(documents, num_proc, tokenizer_meta):
    """encode_chunk over the documents' chunks, results in input order, on num_proc processes, in the tokenizer
    tokenizer_meta (a DatasetMeta) describes.
    Pool.imap would read its whole input ahead of the workers (its feeder thread has no bound), so we
    keep at most 2 * num_proc chunks in flight ourselves: memory stays flat however large the corpus."""
    # built here, before the workers fork: they inherit GPT-2's encoding instead of each building it
    tok = tokenizer_meta.make_tokenizer()
    if num_proc <= 1:
        for chunk in _chunks(documents):
            yield encode_chunk(chunk, tok)
        return
    import multiprocessing

    with multiprocessing.Pool(num_proc, initializer=_start_worker, initargs=(tokenizer_meta,)) as pool:
        pending = deque()
        for chunk in _chunks(documents):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---------------------------------------------------------------------------- shards and progress


def shard_path(out_dir, name, index):
    split = "val" if index == 0 else "train"
    return os.path.join(out_dir, f"{name}_{split}_{index:06d}.bin")


def _write_json(path, obj):
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def load_progress(out_dir, name, description, shard_tokens, tokenizer):
    """The progress of an earlier run into out_dir (a fresh one if none), its finished shards checked.
    tokenizer: what the run's tokenizer is (progress_tokenizer), checked against the earlier run's.
    The progress file records, after each finished shard, where in the document stream it ended (documents done +
    tokens of the next one already written); a re-run skips those documents and writes exactly the bytes an
    uninterrupted run would (a learned BPE is learned again: rustbpe's learning is deterministic)."""
    fresh = {"name": name, "source": description, **tokenizer, "shard_tokens": shard_tokens,
             "shards": [], "complete": False}
    path = os.path.join(out_dir, PROGRESS_FILE)
    if not os.path.isdir(out_dir):
        return fresh
    if not os.path.isfile(path):
        found = shards.list_shards(out_dir)
        if found["train"] or found["val"] or any(os.path.exists(os.path.join(out_dir, f"{s}.bin"))
                                                 for s in ("train", "val")):
            raise UserError(f"{out_dir} already holds a dataset not made by this preparation; "
                            f"remove it or choose another --name")
        return fresh
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{path} is damaged; remove {out_dir} and prepare again") from None
    for key in ("name", "source", *tokenizer, "shard_tokens"):
        if state.get(key) != fresh[key]:
            raise UserError(f"{out_dir} was prepared with {key} {state.get(key)!r}, not {fresh[key]!r}; "
                            f"use the same options to continue, or remove {out_dir}")
    for i, record in enumerate(state["shards"]):  # keep the finished shards whose headers check out
        file = os.path.join(out_dir, record["file"])
        if not os.path.isfile(file) or shards.read_header(file) != record["tokens"]:
            state["shards"], state["complete"] = state["shards"][:i], False
            break
    return state


def progress_tokenizer(tokenizer_meta, held_out):
    """What the progress file records of the tokenizer: its kind; for a learned BPE also its ranks' sha256 and the
    documents held out from learning it (validation's)."""
    if tokenizer_meta.tokenizer != "bpe":
        return {"tokenizer": tokenizer_meta.tokenizer}
    return {"tokenizer": "bpe", "tokenizer_sha256": hashlib.sha256(tokenizer_meta.ranks.encode("ascii")).hexdigest(),
            "validation_documents": held_out}


def dataset_meta(state, tokenizer_meta):
    """The DatasetMeta of a finished preparation in the tokenizer tokenizer_meta describes."""
    records = state["shards"]
    return replace(tokenizer_meta, val_tokens=records[0]["tokens"],
                   train_tokens=sum(r["tokens"] for r in records[1:]),
                   max_token_id=max(r["max_token_id"] for r in records), documents=state["documents"],
                   shards=len(records), source=state["source"])


def small_corpus_val_tokens(total, description):
    """The validation tokens of a corpus of `total` tokens that fills fewer than two shards.

    Its first VAL_PERCENT %, but at least MIN_SPLIT_TOKENS, and train must keep as many (else a UserError);
    train gets the rest, in shards of shard_tokens (a whole shard for validation would leave train less). Under one
    shard nothing is on disk before the end; between one and two, the validation shard already written is cut
    again at the end (ShardWriter.recut), its tail read back into the first train shard."""
    val = max(total * VAL_PERCENT // 100, MIN_SPLIT_TOKENS)
    if total - val < MIN_SPLIT_TOKENS:
        lower = (f", or pass --shard_tokens {total // 2} or less to make the first shard of that size the "
                 f"validation split (for a smaller --block_size)") if total >= 2 else ""
        raise UserError(f"{description} gives only {total:,} tokens, too few for a validation and a train split of "
                        f"{MIN_SPLIT_TOKENS:,} tokens each (one GPT-2 window, block_size 1024 + 1); "
                        f"add documents{lower}")
    return val


def small_corpus_note(total, val, shard_tokens):
    share = (f"{VAL_PERCENT} %" if val == total * VAL_PERCENT // 100
             else f"{val:,} tokens, as {VAL_PERCENT} % would hold less than one GPT-2 window")
    return (f"note: the corpus has {total:,} tokens, less than {'one shard' if total < shard_tokens else 'two shards'}"
            f" of {shard_tokens:,}: validation gets the first {share} ({val:,} tokens), train the rest "
            f"({total - val:,} tokens)")


def stream_position(tokens, q, start):
    """The stream position at tokens[q]: (documents done, tokens of the next document written).

    `tokens` is a piece of the stream that begins at position `start` and goes on past q. Every document
    begins with <|endoftext|>, which encode_ordinary never gives, so the document starts are where it is."""
    docs, offset = start
    starts = np.flatnonzero(tokens[:q] == GPT2_EOT)
    started = docs + (offset > 0) + len(starts)  # documents begun before tokens[q]
    if tokens[q] == GPT2_EOT:
        return started, 0
    return started - 1, int(q - starts[-1]) if len(starts) else offset + q


def read_tokens(path, start, stop, chunk=shards.CHECK_CHUNK):
    """Tokens start..stop of the shard at path, in arrays of at most `chunk` (plain reads: no mapping)."""
    with open(path, "rb") as f:
        f.seek(shards.HEADER_BYTES + 2 * start)
        for pos in range(start, stop, chunk):
            yield np.fromfile(f, dtype="<u2", count=min(chunk, stop - pos))


def write_parts(path, n, parts):
    """A shard of the n tokens of the arrays `parts` at path, atomically; returns the largest token id."""
    largest, written = -1, 0
    with atomic_write(path) as f:
        f.write(shards.header_bytes(n))
        for part in parts:
            part.astype("<u2", copy=False).tofile(f)
            largest, written = max(largest, int(part.max()) if part.size else -1), written + part.size
    assert written == n, (written, n)
    return largest


class ShardWriter:
    """The shard being filled from the token stream, and the shards and progress file written so far.

    A full shard is written (and the progress file updated) only once more tokens follow; finish() writes
    the rest at the end."""

    def __init__(self, out_dir, state):
        self.out_dir, self.state = out_dir, state
        self.buf = np.empty(state["shard_tokens"], dtype=np.uint16)
        self.fill = 0
        self.end = None  # (documents done, tokens of the next document written) where the buffer ends

    def add(self, tokens, lengths, doc_base, drop=0):
        """Append tokens[drop:] of a chunk whose first document is number doc_base."""
        ends = np.cumsum(lengths)
        pos = drop
        while pos < len(tokens):
            if self.fill == len(self.buf):
                self.flush()
            take = min(len(self.buf) - self.fill, len(tokens) - pos)
            self.buf[self.fill:self.fill + take] = tokens[pos:pos + take]
            self.fill, pos = self.fill + take, pos + take
            done = int(np.searchsorted(ends, pos, side="right"))  # documents of the chunk fully written
            self.end = (doc_base + done, pos - (int(ends[done - 1]) if done else 0))

    def record(self, index, tokens, largest, end):
        return {"file": os.path.basename(shard_path(self.out_dir, self.state["name"], index)),
                "tokens": int(tokens), "end_doc": int(end[0]), "end_offset": int(end[1]), "max_token_id": largest}

    def write(self, tokens, end):
        """tokens as the next shard, ending at stream position `end`; recorded in the progress file."""
        index = len(self.state["shards"])
        os.makedirs(self.out_dir, exist_ok=True)
        shards.write_shard(shard_path(self.out_dir, self.state["name"], index), tokens)
        self.state["shards"].append(self.record(index, len(tokens), int(tokens.max()), end))
        _write_json(os.path.join(self.out_dir, PROGRESS_FILE), self.state)

    def flush(self):
        self.write(self.buf[:self.fill], self.end)
        self.fill = 0

    def finish(self, description):
        """Write what the buffer holds at the end of the stream.

        As it is where the corpus fills two shards or more (llm.c's layout) or validation is a learned BPE's
        held-out documents (in their shard already), else with validation cut to small_corpus_val_tokens (see the
        module doc)."""
        records, shard_tokens = self.state["shards"], len(self.buf)
        total = sum(r["tokens"] for r in records) + self.fill
        if total < 2 * shard_tokens and not self.state.get("validation_documents"):
            val = small_corpus_val_tokens(total, description)
            print(small_corpus_note(total, val, shard_tokens))
            if not records:  # all of it in the buffer: nothing written yet
                self.write(self.buf[:val], stream_position(self.buf[:self.fill], val, (0, 0)))
                self.write(self.buf[val:self.fill], self.end)
                self.fill = 0
                return
            if records[0]["tokens"] == shard_tokens:  # the whole first shard was written as validation
                self.recut(val)
                return
        if self.fill:  # (or a resumed run whose validation shard was cut already)
            self.flush()

    def recut(self, val):
        """Cut the validation shard (the first shard_tokens tokens, on disk) and the buffer again at val.

        The train shards are written first, from the validation shard's tail and the buffer, then the validation
        shard itself, then the progress file. Until that last write the progress file describes the first
        cut, so an interrupted run continues from it and cuts again (or, once the validation shard is
        replaced, its header no longer matches and the run starts again): either way the same bytes."""
        first, shard_tokens = self.state["shards"][0], len(self.buf)
        val_path = os.path.join(self.out_dir, first["file"])
        head = np.concatenate(list(read_tokens(val_path, 0, val + 1)))
        from_buf = min(self.fill, val)  # the first train shard: the validation shard's tail, then the buffer's head
        n = shard_tokens - val + from_buf
        end = (stream_position(self.buf[:self.fill], from_buf, (first["end_doc"], first["end_offset"]))
               if from_buf < self.fill else self.end)
        largest = write_parts(shard_path(self.out_dir, self.state["name"], 1), n,
                              [*read_tokens(val_path, val, shard_tokens), self.buf[:from_buf]])
        records = [self.record(0, val, int(head[:val].max()), stream_position(head, val, (0, 0))),
                   self.record(1, n, largest, end)]
        if from_buf < self.fill:
            rest = self.buf[from_buf:self.fill]
            shards.write_shard(shard_path(self.out_dir, self.state["name"], 2), rest)
            records.append(self.record(2, len(rest), int(rest.max()), self.end))
        shards.write_shard(val_path, head[:val])
        self.state["shards"], self.fill = records, 0
        _write_json(os.path.join(self.out_dir, PROGRESS_FILE), self.state)


def held_out_documents(source, shard_tokens):
    """How many of the first documents are validation's where the tokenizer is learned on the others: those
    within VAL_PERCENT % of the corpus's characters and shard_tokens characters, but at least one. The corpus is
    read only until that share is known; a one-line error unless a document is left for train. (A learned
    BPE decides the token counts, so validation cannot be cut at one: it is these whole documents, alone in the
    first shard.)"""
    total = 0
    for doc in source.documents():
        total += len(doc)
        if total * VAL_PERCENT // 100 >= shard_tokens:
            break
    budget, count, chars = min(total * VAL_PERCENT // 100, shard_tokens), 0, 0
    for doc in source.documents():
        if count and chars + len(doc) > budget:
            print(f"validation: the first {count:,} document{'s' * (count > 1)} ({chars:,} characters), held out "
                  f"from learning the tokenizer")
            return count
        count, chars = count + 1, chars + len(doc)
    if not chars:
        raise UserError(f"{source.description} holds no text (no documents, or empty ones); give documents to "
                        f"learn the tokenizer on")
    raise UserError(f"{source.description} has one document, too few to learn the tokenizer on some and validate "
                    f"on others (validation takes the first documents, at least one); add documents, or give it as "
                    f"a text file (split by characters)")


def learn_tokenizer(source, held_out, vocab_size, tokenizer_chars=None):
    """The DatasetMeta of a BPE of vocab_size tokens learned on the documents after the first held_out (the
    training split's), streamed: their first tokenizer_chars characters, where given."""
    what = f"the documents of {source.description} after validation's {held_out:,}"
    if tokenizer_chars:
        what += f" (their first {tokenizer_chars:,} characters)"
    tok = bpe.learn_on(bpe.pieces(source.documents(skip=held_out), tokenizer_chars), vocab_size, what)
    return meta.DatasetMeta.of(tok)


def write_validation(writer, source, held_out, num_proc, tokenizer_meta):
    """The first held_out documents (those the tokenizer was not learned on) as the validation shard, whole."""
    chunks = encoded_chunks(islice(source.documents(), held_out), num_proc, tokenizer_meta)
    with closing(chunks):
        writer.write(np.concatenate([tokens for tokens, _ in chunks]), (held_out, 0))


def check_options(shard_tokens, num_proc, vocab_size):
    """One-line errors for options out of range, before the corpus is read."""
    if shard_tokens < 1 or shard_tokens >= 1 << 31:
        raise UserError(f"--shard_tokens must be between 1 and 2**31 - 1, got {shard_tokens}")
    if num_proc is not None and num_proc < 1:
        raise UserError(f"--num_proc must be at least 1, got {num_proc}")
    if vocab_size is not None:
        bpe.check_vocab_size(vocab_size)


def prepare_corpus(source, out_dir, name, shard_tokens=DEFAULT_SHARD_TOKENS, num_proc=None, progress=True,
                   vocab_size=None, tokenizer_chars=None):
    """Tokenize source's documents into shards in out_dir, continuing an interrupted run; returns the meta.json it
    writes. GPT-2 BPE, or with vocab_size a BPE of that many tokens learned first (on tokenizer_chars
    characters of the training documents, where given)."""
    check_name(name)
    check_options(shard_tokens, num_proc, vocab_size)
    num_proc = num_proc or os.cpu_count() or 1
    held_out = held_out_documents(source, shard_tokens) if vocab_size else None
    tokenizer_meta = (learn_tokenizer(source, held_out, vocab_size, tokenizer_chars) if vocab_size
                      else meta.DatasetMeta.gpt2())
    state = load_progress(out_dir, name, source.description, shard_tokens,
                          progress_tokenizer(tokenizer_meta, held_out))
    if state["complete"]:
        print(f"{out_dir}: already prepared ({len(state['shards'])} shards)")
        return meta.read(out_dir) or dataset_meta(state, tokenizer_meta)
    if os.path.isdir(out_dir):
        remove_stale_temps(out_dir)  # what an interrupted run was writing
    writer = ShardWriter(out_dir, state)
    if held_out and not state["shards"]:
        write_validation(writer, source, held_out, num_proc, tokenizer_meta)
    done = state["shards"][-1] if state["shards"] else {"end_doc": 0, "end_offset": 0}
    doc_base, drop = done["end_doc"], done["end_offset"]
    resumed = sum(r["tokens"] for r in state["shards"])
    # closing(): an error stops the worker pool at once, not whenever the generator is collected
    chunks = encoded_chunks(source.documents(skip=doc_base), num_proc, tokenizer_meta)
    with tqdm(unit="tok", unit_scale=True, desc=f"tokenizing {name}", disable=not progress,
              initial=resumed) as bar, closing(chunks):
        for tokens, lengths in chunks:
            writer.add(tokens, lengths, doc_base, drop)
            bar.update(len(tokens) - drop)
            doc_base, drop = doc_base + len(lengths), 0
    writer.finish(source.description)
    state["complete"], state["documents"] = True, doc_base
    data_meta = meta.write(dataset_meta(state, tokenizer_meta), out_dir)
    _write_json(os.path.join(out_dir, PROGRESS_FILE), state)
    print(f"{out_dir}: {data_meta.shards} shards, train {data_meta.train_tokens:,} tokens, "
          f"val {data_meta.val_tokens:,} tokens, {data_meta.documents:,} documents")
    return data_meta


def prepare_from_cli(corpus, data_dir, name=None, input_path=None, subset=None, num_proc=None,
                     shard_tokens=DEFAULT_SHARD_TOKENS, vocab_size=None, tokenizer_chars=None):
    """prepare.py's openwebtext / fineweb_edu / `text --input DIR` corpora, into the dataset data_dir/name; with
    vocab_size in a BPE learned on it (a hub corpus's: on its first HUB_TOKENIZER_CHARS training characters unless
    tokenizer_chars says how many, and by default in NAME_bpeVOCAB)."""
    if corpus == "text":
        if not input_path or not name:
            raise UserError("`text` with a directory needs --input DIR and --name NAME")
        check_name(name)
        source = LocalSource(input_path)
    elif corpus in HUB_CORPORA:
        repo_id, default_subset = HUB_CORPORA[corpus]
        default_name = corpus if corpus != "fineweb_edu" or not subset else f"fineweb_edu_{subset}"
        name = check_name(name or default_name + (f"_bpe{vocab_size}" if vocab_size else ""))
        source = LocalSource(input_path) if input_path else HubSource(repo_id, subset or default_subset)
        if vocab_size and tokenizer_chars is None:
            tokenizer_chars = HUB_TOKENIZER_CHARS
    else:
        raise UserError(f"unknown corpus {corpus!r}; use openwebtext, fineweb_edu or text")
    return prepare_corpus(source, dataset.resolve(data_dir, name), name, shard_tokens, num_proc,
                          vocab_size=vocab_size, tokenizer_chars=tokenizer_chars)
