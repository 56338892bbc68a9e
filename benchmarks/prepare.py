"""
bench.py --mode=prepare: the speed and memory of the large-corpus preparation (corpus.py, what
`prepare.py fineweb_edu --input PATH` runs) against tiktoken's own multi-threaded
encode_ordinary_batch on the same documents, one after the other in the same run.

The baseline is the favourable one: only the time inside tiktoken's encode calls counts, not
reading the documents. It runs first, in a child process: what it allocates (a batch of documents
and their tokens as Python ints) leaves with that process instead of staying in this one's heap,
which prepare's fork()ed workers would inherit and the memory figures would count. It also reads
the corpus into the page cache before ours reads it. Ours is the whole prepare_corpus call in this
process, with prepare.py's shard size unless told another: reading, tokenizing on num_proc processes
(which inherit the encoding built before they fork, as in prepare.py), writing the shards (for a
corpus of fewer than two shards, cutting the validation split at 10 % as prepare.py does).
Both count one <|endoftext|> per document, and their token counts must be equal: the check that
both encoded the same text.

Memory is the peak of this process plus its worker processes, sampled from /proc every
SAMPLE_SECONDS. resource.getrusage cannot give it: ru_maxrss is one process's own high-water mark
(RUSAGE_CHILDREN: that of the largest single descendant waited for), never the sum over processes
alive at the same time. Rss counts the pages the fork()ed workers share with this process once in
every process, so its sum overstates; Pss divides shared pages among their sharers, so its sum is
what the tree occupies. Both are reported.
"""

import dataclasses
import itertools
import json
import os
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from machinery.data import corpus, documents
from machinery.errors import UserError
from machinery.fileio import read_text
from machinery.data.tokenizer import gpt2_encoding

SYNTHETIC_DOC_LINES = 60  # documents of ~2.5 kB from Tiny Shakespeare
BASELINE_BATCH_DOCS = 8192  # documents per encode_ordinary_batch call
SAMPLE_SECONDS = 0.2
MIB = 1 << 20


@dataclass
class Measurement:
    name: str
    tokens: int
    documents: int
    seconds: float
    what: str  # what the seconds are the time of
    peak_rss: Optional[int] = None  # bytes, over the process tree
    peak_pss: Optional[int] = None

    def line(self):
        memory = ("memory not measured" if self.peak_rss is None else
                  f"peak Rss {self.peak_rss / MIB:,.0f} MiB, Pss {self.peak_pss / MIB:,.0f} MiB")
        return (f"{self.name}: {self.tokens:,} tokens, {self.documents:,} documents, {self.seconds:.2f} s "
                f"({self.what}), {self.tokens / self.seconds / 1e6:.3f} Mtok/s, {memory}")


def write_synthetic_corpus(text_path, out_path, megabytes, seed=0):
    """JSON lines of ~2.5 kB documents cut from a text file, copy after copy of it until `megabytes` MiB
    are written; in each copy a tenth of the words swap places at random, so that the corpus is not one
    text repeated. Returns the number of documents."""
    lines = read_text(text_path, "--text_source", "give a UTF-8 text file with --text_source=FILE, or a corpus "
                                                   "with --input=PATH").split("\n")
    rng = random.Random(seed)
    size, documents = 0, 0
    with open(out_path, "w", encoding="utf-8") as f:
        for copy in itertools.count():
            for start in range(0, len(lines), SYNTHETIC_DOC_LINES):
                words = "\n".join(lines[start:start + SYNTHETIC_DOC_LINES]).split(" ")
                for _ in range(len(words) // 10):
                    i, j = rng.randrange(len(words)), rng.randrange(len(words))
                    words[i], words[j] = words[j], words[i]
                line = json.dumps({"text": f"Copy {copy}, part {start}. " + " ".join(words)},
                                  ensure_ascii=False) + "\n"
                f.write(line)
                size, documents = size + len(line.encode("utf-8")), documents + 1
                if size >= megabytes * MIB:
                    return documents


def _tree_memory():
    """(Rss, Pss) in bytes summed over this process and all its descendants, now."""
    rss = pss = 0
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += map(int, f.read().split())
            with open(f"/proc/{pid}/smaps_rollup") as f:
                fields = dict(line.split()[:2] for line in f if line.startswith(("Rss:", "Pss:")))
        except OSError:  # the process ended meanwhile
            continue
        rss, pss = rss + int(fields["Rss:"]) * 1024, pss + int(fields["Pss:"]) * 1024
    return rss, pss


def memory_measurable():
    return os.path.exists(f"/proc/{os.getpid()}/smaps_rollup") and os.path.exists(
        f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")


class PeakMemory:
    """The peak Rss and Pss of the process tree while the with-block runs, sampled in a thread
    (None where /proc cannot tell: not Linux, or a kernel without smaps_rollup or children files)."""

    def __enter__(self):
        self.rss = self.pss = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if memory_measurable():
            self.rss = self.pss = 0
            self._thread.start()
        return self

    def _sample(self):
        rss, pss = _tree_memory()
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)

    def _run(self):
        self._sample()
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def tiktoken_baseline(source, num_threads):
    """tiktoken's encode_ordinary_batch(num_threads=...) over the documents, BASELINE_BATCH_DOCS at a
    time; only the encode calls are timed."""
    enc = gpt2_encoding()
    documents = iter(source.documents())
    tokens = count = 0
    seconds = 0.0
    while batch := list(itertools.islice(documents, BASELINE_BATCH_DOCS)):
        t0 = time.perf_counter()
        encoded = enc.encode_ordinary_batch(batch, num_threads=num_threads)
        seconds += time.perf_counter() - t0
        tokens += len(batch) + sum(map(len, encoded))  # one <|endoftext|> per document, as ours counts
        count += len(batch)
    if not count:
        raise UserError(f"{source.description} holds no documents; give a corpus with some")
    return Measurement(f"tiktoken encode_ordinary_batch(num_threads={num_threads})", tokens, count, seconds,
                       "encode calls only")


def measure_tiktoken(source, num_threads):
    """tiktoken_baseline in a child process, with the peak memory of the process tree."""
    with PeakMemory() as memory, ProcessPoolExecutor(1) as pool:
        baseline = pool.submit(tiktoken_baseline, source, num_threads).result()
    return dataclasses.replace(baseline, peak_rss=memory.rss, peak_pss=memory.pss)


def measure_prepare(source, out_dir, shard_tokens, num_proc):
    """corpus.prepare_corpus into out_dir, timed whole, with the peak memory of the process tree."""
    with PeakMemory() as memory:
        t0 = time.perf_counter()
        prepared = corpus.prepare_corpus(source, out_dir, "bench", shard_tokens, num_proc, progress=False)
        seconds = time.perf_counter() - t0
    return Measurement(f"prepare_corpus(num_proc={num_proc})", prepared.train_tokens + prepared.val_tokens,
                       prepared.documents, seconds, f"whole run: reading, encoding, writing {prepared.shards} "
                       f"shards of up to {shard_tokens:,} tokens", memory.rss, memory.pss)


def check_same_text(baseline, ours):
    if (baseline.tokens, baseline.documents) != (ours.tokens, ours.documents):
        raise RuntimeError(f"the two encodings disagree: tiktoken {baseline.tokens:,} tokens of "
                           f"{baseline.documents:,} documents, prepare {ours.tokens:,} tokens of "
                           f"{ours.documents:,} documents; they did not encode the same text")


def describe_machine():
    """Cores, CPU model and vector capability, and the load: what tokenizing speed depends on."""
    model = "?"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: {os.cpu_count()} cores ({usable} usable here), {model}, "
            f"{torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()[0]:.2f}")


def bench_prepare(cfg, workdir):
    """Both measurements on cfg.input (or a synthetic corpus written into workdir), their ratio."""
    num_proc = cfg.num_proc or os.cpu_count() or 1
    print(describe_machine(), flush=True)
    if cfg.input:
        source = documents.LocalSource(cfg.input)
        print(f"corpus: {cfg.input}, {sum(os.path.getsize(f) for f in source.files) / MIB:,.1f} MiB "
              f"in {len(source.files)} file(s)", flush=True)
    else:
        path = os.path.join(workdir, "synthetic.jsonl")
        count = write_synthetic_corpus(cfg.text_source, path, cfg.corpus_mb)
        source = documents.LocalSource(path)
        print(f"corpus: synthetic JSON lines from {cfg.text_source}, {os.path.getsize(path) / MIB:,.1f} MiB, "
              f"{count:,} documents", flush=True)
    baseline = measure_tiktoken(source, num_proc)
    print(baseline.line(), flush=True)
    ours = measure_prepare(source, os.path.join(workdir, "bench"), cfg.shard_tokens or corpus.DEFAULT_SHARD_TOKENS,
                           num_proc)
    print(ours.line(), flush=True)
    check_same_text(baseline, ours)
    ratio = (ours.tokens / ours.seconds) / (baseline.tokens / baseline.seconds)
    memory = ("not measured" if ours.peak_rss is None else
              f"{ours.peak_rss / MIB:,.0f} MiB Rss summed over its processes (Pss {ours.peak_pss / MIB:,.0f} MiB)")
    print(f"prepare_corpus / tiktoken: {ratio:.3f} of tiktoken's tokens/s (goal >= 0.7); peak memory {memory}, "
          f"goal <= 1024 MiB; load average now {os.getloadavg()[0]:.2f}")
    return baseline, ours
