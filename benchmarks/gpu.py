"""
bench.py --mode=gpu: every figure the GPU's goals ask for, taken in one command, with one PASS / FAIL line a goal.

A GPU is lent for minutes, not hours, so what it must measure is one command, ordered by what matters most and
tried first on the CPU (`--device=cpu`: a small, quick form that prints every line, each figure it cannot take
there marked "not measured"). In turn, each part in a try of its own (a part that fails is a FAIL line, and the
rest still runs):

  1. the CUDA tests (tests/test_cuda*.py), pytest in a child process;
  2. batch-1 greedy decoding of the GPT-2 124M shape through sample.py, whole processes (bfloat16 and float32),
     against transformers' generate in the same dtype; a failed CUDA-graph capture is an error, not an eager
     figure (benchmarks.serve.sample_command);
  3. serve.py at 1 / 8 / 32 streaming clients, seeded requests the same at once as alone, and one client at
     max_batch 1 beside it (the fixed step reads every row's KV: what one client pays for 32 rows);
  4. Muon's training step against AdamW's on the GPU speedrun's model;
  5. GPT-2 124M's training step: ms/iter, tokens/s, MFU;
  6. the GPU speedrun against nanoGPT's recipe through our train.py, one pair of whole processes (4-5 minutes on
     an H100: last, and only when the budget leaves room for it).

Then the table for BENCHMARKS.md. The goals are issues 31 and 32's.
"""

import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import runs, serve
from machinery.hardware import describe, pick_device, pick_dtype
from machinery.tokenizer import GPT2_VOCAB_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_cuda_decoding.py", "tests/test_cuda_decisions.py"]
SPEEDRUN_SECONDS = 300  # a GPU speedrun pair (121.5 + 142.9 s on an H100 at 9a9f78c) and its start-ups


@dataclass
class Point:
    """One line of the report: what was measured, its figure, and PASS, FAIL or not measured (with why)."""

    name: str
    figure: str
    verdict: str

    def line(self):
        return f"{self.verdict:<13} {self.name}: {self.figure}"


def judged(name, figure, ok, gpu):
    """A Point judged by ok where the figure is the GPU's, else 'not measured' (a CPU's figure says nothing of
    the GPU's goal)."""
    if not gpu:
        return Point(name, f"{figure} (CPU quick form)", "not measured")
    return Point(name, figure, "PASS" if ok else "FAIL")


def sizes(gpu):
    """The settings of each part: as the goals state them on a GPU, small and quick on a CPU."""
    if gpu:
        return dict(device="cuda", layers=dict(n_layer=12, n_head=12, n_embd=768), tokens=500, repeats=3,
                    serve_tokens=300, train=dict(warmup=10, repeats=30), small=[], quick=[],
                    dtypes=("bfloat16", "float32"), lone_server=True)
    # (the quick form runs each kind of process once at most: a test runs it, and the suite's time is counted)
    small = ["--batch_size=4", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=32", "--compile=False",
             "--gradient_accumulation_steps=1"]
    return dict(device="cpu", layers=dict(n_layer=2, n_head=2, n_embd=64), tokens=40, repeats=1, serve_tokens=8,
                train=dict(warmup=1, repeats=3), small=small, dtypes=("float32",), lone_server=False,
                quick=[*small, "--max_iters=10", "--lr_decay_iters=10", "--eval_iters=2", "--eval_interval=10",
                       "--device=cpu"])


def machine(device):
    """One line: the GPU (or the CPU), torch and CUDA versions, Python, cores."""
    gpu = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if device == "cuda"
           else f"no GPU: {describe(device, pick_dtype('auto', device))}")
    return f"machine: {gpu}; torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores"


def cuda_tests(gpu):
    """The CUDA test files in a child pytest: PASS when they pass and, on a GPU, some ran. In one process (no
    workers of pytest-xdist, where it is installed): one GPU, and few tests."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *CUDA_TESTS],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "WANDB_MODE": "offline"})
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    if proc.returncode not in (0, 5):
        return [Point("CUDA tests", f"{summary}\n{proc.stdout[-3000:]}", "FAIL")]
    ran = "passed" in summary
    return [judged("CUDA tests", summary, ran, gpu)]


def decoding(cfg, hf_dir, gpu, size):
    """sample.py's batch-1 greedy tokens/s (whole processes) at bfloat16 and float32 against transformers'
    generate in the same dtype, on the random model of GPT-2's shape in hf_dir."""
    device = size["device"]
    prompt = torch.randint(0, GPT2_VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    points, n = [], size["tokens"]
    for dtype in ("bfloat16", "float32"):
        if dtype not in size["dtypes"]:
            points.append(judged(f"sample.py {dtype}, GPT-2 shape, batch 1 greedy", "not timed: the quick form "
                                 "times float32 only", False, gpu))
            continue
        serve.sample_text(hf_dir, device, dtype, n)  # refuses a model that stops early
        ours, _ = serve.sample_command(hf_dir, device, dtype, n, size["repeats"])
        theirs = statistics.median(n / t for t in timings(serve.transformers_greedy(hf_dir, device, dtype, prompt, n),
                                                          size["repeats"]))
        figure = (f"{ours:,.0f} tokens/s, transformers' generate {theirs:,.1f} ({ours / theirs:.2f}x); CUDA graph: "
                  + ("captured" if gpu else "none on a CPU"))
        if dtype == "bfloat16":
            goal, ok = "goal >= 1,000 tokens/s and >= 6x transformers", ours >= 1000 and ours >= 6 * theirs
        else:
            goal, ok = "goal: faster than transformers", ours > theirs
        points.append(judged(f"sample.py {dtype}, GPT-2 shape, batch 1 greedy ({goal})", figure, ok, gpu))
    return points


def timings(run, repeats):
    """run's wall seconds, repeats times after one warm-up."""
    run()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    return seconds


def serving(hf_dir, gpu, size):
    """serve.py (its default max_batch, 32) under 1 / 8 / 32 streaming clients, 8 seeded requests at once against
    alone, then one client of a server with max_batch 1: tokens/s of each."""
    device = size["device"]
    dtype = pick_dtype("auto", device)
    tokens, clients = size["serve_tokens"], (1, 8, 32)
    with serve.server(hf_dir, dtype, device) as url:
        rates = {c: serve.stream_rate(url, c, tokens)[0] for c in clients}
        at_once, alone, same = serve.seeded_same(url, tokens)
    lone = math.nan  # (a second server: not in the quick form)
    if size["lone_server"]:
        with serve.server(hf_dir, dtype, device, "--max_batch=1") as url:
            lone = serve.stream_rate(url, 1, tokens)[0]
    table = ", ".join(f"{c}: {r:,.0f}" for c, r in rates.items())
    return [judged(f"serve.py {dtype}, streaming clients, tokens/s (goal 32 clients >= 10,000)", table,
                   rates.get(32, 0) >= 10000, gpu),
            judged("serve.py, one client (goal >= 800 tokens/s)",
                   f"{rates[1]:,.0f} at max_batch 32, {lone:,.0f} at max_batch 1", rates[1] >= 800, gpu),
            Point("serve.py, 8 seeded requests: each text the same at once as alone",
                  f"{'yes' if same else 'NO'} ({at_once:,.0f} tokens/s at once, {alone:,.0f} one at a time)",
                  "PASS" if same else "FAIL")]


def training_steps(gpu, size, step):
    """Muon's step against AdamW's on the GPU speedrun's model, and GPT-2 124M's step (ms/iter, tokens/s, MFU);
    step(argv) is bench.py --mode=train's measurement: (median seconds, tokens an iteration, MFU or None)."""
    extra = [f"--device={size['device']}", f"--warmup={size['train']['warmup']}",
             f"--repeats={size['train']['repeats']}", *size["small"]]
    speedrun_model = os.path.join(ROOT, "config/speedrun_shakespeare_char_gpu.py")
    muon, _, _ = step([speedrun_model, *extra])
    adamw, _, _ = step([speedrun_model, *extra, "--optimizer=adamw"])
    seconds, tokens, mfu = step([os.path.join(ROOT, "config/train_gpt2.py"), *extra])
    mfu_text = f"MFU {mfu:.1%}" if mfu else "MFU: no peak known for this device"
    return [judged("Muon's step against AdamW's, GPU speedrun model (goal <= 1.3x)",
                   f"{muon * 1e3:.1f} against {adamw * 1e3:.1f} ms/iter: {muon / adamw:.2f}x", muon <= 1.3 * adamw,
                   gpu),
            judged("GPT-2 124M training step (goal MFU >= 50 %)",
                   f"{seconds * 1e3:,.1f} ms/iter, {tokens / seconds:,.0f} tokens/s, {mfu_text}",
                   bool(mfu) and mfu >= 0.5, gpu)]


def speedrun(cfg, workdir, gpu, size, train_config):
    """One pair of whole train.py processes: the GPU speedrun and nanoGPT's GPU recipe through our train.py, on
    shakespeare_char (prepared here from text_source when data_dir lacks it)."""
    data_dir = shakespeare_char(cfg, workdir)
    fast = runs.run_ours("speedrun", ["config/speedrun_shakespeare_char_gpu.py", *size["quick"]], train_config,
                         workdir, data_dir)
    slow = runs.run_ours("nanoGPT's recipe", [*runs.NANOGPT_RECIPES["gpu"], *size["quick"]], train_config,
                         workdir, data_dir)
    ratio = fast.seconds / slow.seconds
    return [judged("GPU speedrun against nanoGPT's recipe, one pair (goal val <= 1.4697 in <= 0.33 of its time)",
                   f"{fast.seconds:.1f} s (val {fast.val_loss:.4f}) against {slow.seconds:.1f} s "
                   f"(val {slow.val_loss:.4f}): {ratio:.3f}", ratio <= 0.33 and fast.val_loss <= 1.4697, gpu)]


def shakespeare_char(cfg, workdir):
    """The data_dir that holds shakespeare_char: cfg's when prepared there, else one prepared in workdir."""
    if os.path.exists(os.path.join(cfg.data_dir, "shakespeare_char", "train.bin")):
        return os.path.abspath(cfg.data_dir)
    data_dir = os.path.join(workdir, "data")
    subprocess.run([sys.executable, "prepare.py", "shakespeare_char", f"--input={cfg.text_source}",
                    f"--data_dir={data_dir}"], cwd=ROOT, check=True, capture_output=True, timeout=600)
    return data_dir


def bench_gpu(cfg, workdir, step, train_config):
    """Every part in turn (a part that fails is a FAIL line and the next still runs), then every line again and
    the table for BENCHMARKS.md; the speedrun only while budget_s leaves it room. Returns the Points."""
    device = pick_device(cfg.device)
    gpu, size, start = device == "cuda", sizes(device == "cuda"), time.perf_counter()
    print(machine(device), flush=True)
    hf_dir = os.path.join(workdir, "gpt2-shaped")
    serve.gpt2_shaped(dataclasses.replace(cfg, **size["layers"]), hf_dir)
    points = []

    def part(name, fn, *args):
        t0 = time.perf_counter()
        try:
            done = fn(*args)
        except Exception as e:  # noqa: BLE001 (whatever went wrong is the report's line)
            done = [Point(name, f"{type(e).__name__}: {' '.join(str(e).split())[-1500:]}", "FAIL")]
        for p in done:
            print(p.line(), flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        points.extend(done)

    part("CUDA tests", cuda_tests, gpu)
    part("sample.py", decoding, cfg, hf_dir, gpu, size)
    part("serve.py", serving, hf_dir, gpu, size)
    part("training steps", training_steps, gpu, size, step)
    left = cfg.budget_s - (time.perf_counter() - start)
    if not gpu or left >= SPEEDRUN_SECONDS:
        part("GPU speedrun", speedrun, cfg, workdir, gpu, size, train_config)
    else:
        points.append(Point("GPU speedrun against nanoGPT's recipe", f"{left:.0f} s of budget_s left, a pair takes "
                            f"~{SPEEDRUN_SECONDS} s", "not measured"))
        print(points[-1].line(), flush=True)
    report(points, device, time.perf_counter() - start)
    return points


def report(points, device, seconds):
    """Every line again, then the markdown table for BENCHMARKS.md."""
    print(f"\n{machine(device)}; this command took {seconds:.0f} s")
    for p in points:
        print(p.line())
    print("\n| figure | measured | verdict |\n| --- | --- | --- |")
    for p in points:
        print(f"| {p.name} | {p.figure.splitlines()[0]} | {p.verdict} |")
