"""
bench.py --mode=tokenizers: what a tokenizer learned on the corpus buys, on a text in a language other than English
(default --input: the Tang poems, ../shared/data/chinese-poetry/quantangshi.txt).

1. Compression: `prepare.py text` with char, GPT-2, and a BPE learned at each of BPE_SIZES: the characters and UTF-8
   bytes a token of the whole text, the BPE's learning time (prepare.py's own line) and the whole preparation's
   wall time. Then the two learners alone, each in a process of its own on the same training split at COMPARED:
   rustbpe (ours) and Hugging Face's tokenizers (BpeTrainer, byte-level, GPT-2's split): learning time, the
   process's peak memory (its VmHWM), characters a token of the whole text.
2. Equal wall time: one model shape (MODEL) trained by train.py on char, GPT-2 and the BPE learned at COMPARED, each
   stopped by SIGTERM (train.py saves ckpt.pt and exits) --train_s seconds after its process started; eval.py's
   bits per byte on the first EVAL_CHARS characters of the validation split (bits per byte: the figure that
   compares models of different tokenizers), and sample.py's continuation of the same poem's first line.

Every step is a whole process of ours, as a user runs it; the figures are printed as Markdown tables.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from machinery.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TEXT = os.path.join(ROOT, "..", "shared", "data", "chinese-poetry", "quantangshi.txt")
BPE_SIZES = (4096, 8192, 16384, 32768)
COMPARED = 16384  # one of BPE_SIZES: the size the two learners are compared at, and the equal-time models' BPE
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=128", "--batch_size=16",
         "--gradient_accumulation_steps=1", "--dropout=0.0", "--learning_rate=1e-3", "--decay_lr=False",
         "--warmup_iters=50", "--eval_interval=1000000", "--eval_iters=1", "--log_interval=10",
         "--max_iters=100000000", "--compile=False", "--device=cpu"]
EVAL_CHARS = 20_000  # of the validation split, for eval.py --text
PROMPT = "春望\n杜甫\n國破山河在，"  # a title, its poet and the poem's first line
SAMPLE_CHARS = 36  # characters of each continuation shown

# Hugging Face's learner, in a child process: byte-level BPE with GPT-2's split (ByteLevel's regex), n tokens
HF_LEARN = """
import json, sys, time
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
text, n, cut = open(sys.argv[1], encoding="utf-8").read(), int(sys.argv[2]), float(sys.argv[3])
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
start = time.perf_counter()
tok.train_from_iterator([text[:int(len(text) * cut)]], trainers.BpeTrainer(
    vocab_size=n, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
seconds = time.perf_counter() - start
figures = {"learn_s": seconds, "tokens": len(tok.encode(text).ids), "vocab": tok.get_vocab_size()}
"""
RUSTBPE_LEARN = """
import json, sys, time
from machinery.data import bpe
text, n, cut = open(sys.argv[1], encoding="utf-8").read(), int(sys.argv[2]), float(sys.argv[3])
start = time.perf_counter()
tok = bpe.learn([text[:int(len(text) * cut)]], n)
seconds = time.perf_counter() - start
figures = {"learn_s": seconds, "tokens": len(tok.encode(text)), "vocab": tok.vocab_size}
"""
# a learner's last line: its figures and its peak resident memory, read by the process itself at its end (VmHWM: its
# own program's; wait4's ru_maxrss counts the memory of the process it was started from too: bench.py's peak until
# then, ~230 MiB, would be the least a learner could show)
REPORT = """
peak_kib = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(json.dumps({**figures, "peak_mib": peak_kib / 1024}))
"""


def run(args, stop_after=None):
    """Run `python args...` in ROOT to its end, or SIGTERM it stop_after seconds after it started: (stdout,
    seconds). A failure is a one-line error with its last stderr line."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=err,
                                env=dict(os.environ, WANDB_MODE="disabled"))
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        while stop_after is not None and pid == 0 and time.perf_counter() - start < stop_after:
            time.sleep(0.2)
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid == 0:
            if stop_after is not None:
                proc.send_signal(signal.SIGTERM)
            pid, status = os.waitpid(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        what = "python -c" if args[0] == "-c" else f"{args[0]} {' '.join(args[1:3])}"  # (not the code's lines)
        raise UserError(f"{what} failed (exit {proc.returncode}): {(stderr.strip().splitlines() or [''])[-1]}")
    return stdout, seconds


def compression(text, data_dir):
    """{name: {tokens, vocab, learn_s, wall_s}} of prepare.py with each tokenizer."""
    rows = {}
    for kind, size in [("char", None), ("gpt2", None), *[("bpe", n) for n in BPE_SIZES]]:
        name = kind + (str(size) if size else "")
        args = ["prepare.py", "text", "--input", text, "--name", name, "--tokenizer", kind, "--data_dir", data_dir]
        out, wall = run(args + (["--vocab_size", str(size)] if size else []))
        with open(os.path.join(data_dir, name, "meta.json"), encoding="utf-8") as f:
            saved = json.load(f)
        learned = re.search(r"^learned in ([\d.]+) s$", out, re.M)
        rows[name] = {"tokens": saved["train_tokens"] + saved["val_tokens"], "vocab": saved["vocab_size"],
                      "learn_s": float(learned.group(1)) if learned else None, "wall_s": wall}
        print(f"{name}: {rows[name]}", flush=True)
    return rows


def learners(text):
    """{learner: {learn_s, tokens, vocab, peak_mib}}: rustbpe and Hugging Face's tokenizers on the training split,
    COMPARED tokens."""
    rows = {}
    for name, code in (("rustbpe", RUSTBPE_LEARN), ("HF tokenizers", HF_LEARN)):
        out, _ = run(["-c", code + REPORT, text, str(COMPARED), "0.9"])
        rows[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {rows[name]}", flush=True)
    return rows


def equal_time(name, data_dir, workdir, val_file, train_s, chars_per_token):
    """Train MODEL on dataset name for train_s seconds of wall time; its iterations, val bits per byte, sample."""
    out_dir = os.path.join(workdir, "out_" + name)
    log, _ = run(["train.py", f"--dataset={os.path.join(data_dir, name)}", f"--out_dir={out_dir}", *MODEL],
                 stop_after=train_s)
    iters = re.findall(r"^iter (\d+): loss (\S+),", log, re.M)
    source = [f"--out_dir={out_dir}", "--ckpt=latest", "--device=cpu", "--dtype=float32"]
    figures, _ = run(["eval.py", *source, f"--text={val_file}", "--json"])
    bpb = json.loads(figures.strip().splitlines()[-1])["text"]["bits_per_byte"]
    n_new = math.ceil(SAMPLE_CHARS / chars_per_token) + 8
    text, _ = run(["sample.py", *source, f"--start={PROMPT}", "--num_samples=1", f"--max_new_tokens={n_new}",
                   "--seed=1337", "--temperature=0.8"])
    continuation = text.split("\n---------------\n")[0][len(PROMPT):][:SAMPLE_CHARS]
    row = {"iters": int(iters[-1][0]) if iters else 0, "train_loss": float(iters[-1][1]) if iters else None,
           "val_bpb": bpb, "sample": continuation}
    print(f"{name}: {row}", flush=True)
    return row


def table(text, rows, learned, trained, train_s):
    """The Markdown tables of the figures."""
    with open(text, encoding="utf-8") as f:
        content = f.read()
    n_chars, n_bytes = len(content), len(content.encode("utf-8"))
    lines = [f"{os.path.basename(text)}: {n_chars:,} characters, {n_bytes:,} bytes", "",
             "| tokenizer | vocab | tokens | chars/token | bytes/token | learning s | prepare.py s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['vocab']:,} | {r['tokens']:,} | {n_chars / r['tokens']:.3f} | "
                     f"{n_bytes / r['tokens']:.2f} | {r['learn_s'] if r['learn_s'] is not None else '-'} | "
                     f"{r['wall_s']:.1f} |")
    lines += ["", f"| learner ({COMPARED / 1024:g}k, training split) | learning s | peak MiB | chars/token |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {r['learn_s']:.1f} | {r['peak_mib']:.0f} | {n_chars / r['tokens']:.3f} |"
              for name, r in learned.items()]
    lines += ["", f"Equal wall time: {train_s} s of train.py each ({' '.join(MODEL[:6])}); val bits per byte on the "
                  f"first {EVAL_CHARS:,} characters of the validation split; sample.py after {PROMPT!r}", "",
              "| tokenizer | iterations | last train loss | val bits/byte | sample (temperature 0.8, seed 1337) |",
              "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {name} | {r['iters']:,} | {r['train_loss']} | {r['val_bpb']:.3f} | {r['sample']!r} |"
              for name, r in trained.items()]
    return "\n".join(lines)


def bench_tokenizers(cfg, workdir):
    """The whole benchmark (cfg.input: the text, default DEFAULT_TEXT; cfg.train_s: each model's wall time)."""
    text = os.path.abspath(cfg.input or DEFAULT_TEXT)
    if not os.path.isfile(text):
        raise UserError(f"mode=tokenizers: {text} is not a file; give the text with --input=PATH")
    if not os.path.getsize(text):  # (before any process: prepare.py's would say so as a failed step)
        raise UserError(f"mode=tokenizers: {text} is empty; give a text with --input=PATH")
    data_dir = os.path.join(workdir, "data")
    rows = compression(text, data_dir)
    learned = learners(text)
    with open(text, encoding="utf-8") as f:
        content = f.read()
    val_file = os.path.join(workdir, "val.txt")
    with open(val_file, "w", encoding="utf-8") as f:
        f.write(content[int(len(content) * 0.9):][:EVAL_CHARS])  # (prepare.py's split: the last 10 % of characters)
    trained = {name: equal_time(name, data_dir, workdir, val_file, cfg.train_s, len(content) / rows[name]["tokens"])
               for name in ("char", "gpt2", f"bpe{COMPARED}")}
    print(table(text, rows, learned, trained, cfg.train_s))
