"""
bench.py --mode=gpu: every figure the GPU's goals ask for, taken in one command, with one PASS / FAIL line a goal,
and the levers that decide the defaults measured side by side, a row each, with the kernels the time goes to.

A GPU is lent for minutes, not hours, so what it must measure is one command, ordered by what matters most and
tried first on the CPU (`--device=cpu`: a small, quick form that prints every line, each figure it cannot take
there marked "not measured"). In turn, each part in a try of its own (a part that fails is a FAIL line, and the
rest still runs), `--parts` choosing some of them (two commands where one would not fit a command's time):

  tests     the CUDA tests (tests/test_cuda*.py), pytest in a child process;
  sample    batch-1 greedy decoding of the GPT-2 124M shape through sample.py, whole processes (bfloat16 and
            float32), against transformers' generate in the same dtype; a failed CUDA-graph capture is an error,
            not an eager figure (benchmarks.serve.sample_command);
  decode    the decoding levers in this process, a row each: decode_attention (full, flex), decode_ahead, compile; batch 1
            (sample.py's engine) and 32 rows (serve.py's step), with the KV bytes a token reads; then the top
            kernels per decoded token of each (benchmarks/profile.py);
  serve     serve.py at 1 / 8 / 32 streaming clients, seeded requests the same at once as alone, and one client at
            max_batch 1 beside it (the fixed step computes every row: what one client pays for 32 rows), and 1 / 32
            clients with decode_attention=full (its default on CUDA is flex);
  train     Muon's training step against AdamW's on the GPU speedrun's model and GPT-2 124M's (ms/iter, tokens/s,
            MFU), each timed as train.py runs it (bench.py --mode=train), then the training levers a row each
            (cuda_graph, compile, sdpa_backend, the micro-batch) and the top kernels of a step of each model;
  speedrun  the GPU speedrun against nanoGPT's recipe through our train.py, one pair of whole processes (about 2
            minutes on an H200: last, and only when the budget leaves room for it).

Then the table for BENCHMARKS.md. The goals are issues 56 and 57's.
"""

import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from benchmarks import runs, serve
from benchmarks.profile import kernel_table, top_kernels
from machinery.errors import UserError
from machinery.hardware import describe, pick_device, pick_dtype
from machinery.generation.request import Request
from machinery.data.tokenizer import GPT2_VOCAB_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_cuda_decoding.py", "tests/test_cuda_decisions.py"]
PARTS = ("tests", "sample", "decode", "serve", "train", "speedrun")
PROFILED_STEPS = 50  # decoding steps under the profiler a lever (a token's kernels are the same at each step)
CHAR_VOCAB = 65  # shakespeare_char's characters (prepare.py shakespeare_char's meta.json)
SPEEDRUN_SECONDS = 150  # a GPU speedrun pair (27.1 + 84.6-97.1 s on an H200, 2026-11-28) and its margin
# (decode_attention, compile, decode_ahead): the first is the engine before issue 57; the quick form leaves compile out
DECODE_LEVERS = [("full", False, False), ("full", False, True), ("flex", False, True), ("full", True, True),
                 ("flex", True, True)]


@dataclass
class Point:
    """One line of the report: what was measured, its figure, and PASS, FAIL, not measured (with why), or lever (a
    row of a side-by-side comparison that chooses a default, judged by no goal)."""

    name: str
    figure: str
    verdict: str
    shown: bool = dataclasses.field(default=False, compare=False)  # printed as it was measured

    def line(self):
        return f"{self.verdict:<13} {self.name}: {self.figure}"

    def show(self):
        """Print the line now: a command stopped at a lent GPU's time limit keeps the rows it measured."""
        print(self.line(), flush=True)
        self.shown = True
        return self


def judged(name, figure, ok, gpu):
    """A Point judged by ok where the figure is the GPU's, else 'not measured' (a CPU's figure says nothing of
    the GPU's goal)."""
    if not gpu:
        return Point(name, f"{figure} (CPU quick form)", "not measured")
    return Point(name, figure, "PASS" if ok else "FAIL")


def lever(name, figure, gpu):
    """A lever's row: the GPU's figure, or the quick form's (which chooses nothing)."""
    return Point(name, figure if gpu else f"{figure} (CPU quick form)", "lever" if gpu else "not measured")


def sizes(gpu):
    """The settings of each part: as the goals state them on a GPU, small and quick on a CPU."""
    if gpu:
        return dict(device="cuda", layers=dict(n_layer=12, n_head=12, n_embd=768), tokens=500, repeats=3,
                    serve_tokens=300, train=dict(warmup=10, repeats=30), lever_train=dict(warmup=5, repeats=10),
                    small=[], quick=[], dtypes=("bfloat16", "float32"), lone_server=True,
                    micro_batch=["--batch_size=24", "--gradient_accumulation_steps=20"],
                    decode=dict(levers=DECODE_LEVERS, rows=32, steps=200))
    # (the quick form runs each kind of process once at most: a test runs it, and the suite's time is counted)
    small = ["--batch_size=4", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=32", "--compile=False",
             "--gradient_accumulation_steps=1"]
    return dict(device="cpu", layers=dict(n_layer=2, n_head=2, n_embd=64), tokens=40, repeats=1, serve_tokens=8,
                train=dict(warmup=1, repeats=3), lever_train=dict(warmup=1, repeats=2), small=small,
                micro_batch=["--batch_size=2", "--gradient_accumulation_steps=2"],
                dtypes=("float32",), lone_server=False,
                decode=dict(levers=[lever for lever in DECODE_LEVERS if lever[:2] == ("full", False)], rows=4, steps=4),
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
            goal, ok = "goal >= 2,000 tokens/s", ours >= 2000
        else:
            goal, ok = "goal: faster than transformers", ours > theirs
        points.append(judged(f"sample.py {dtype}, GPT-2 shape, batch 1 greedy ({goal})", figure, ok, gpu))
    return points


def decode_levers(hf_dir, gpu, size):
    """The decoding levers side by side in this process, a row each (decode_attention, compile, decode_ahead): the
    engine's decoding rate at batch 1 (sample.py's) and at 32 rows (serve.py's step), prompts encoded first and not
    timed;
    then the top kernels per decoded token at batch 1 of each lever, and of a 32-row step at the defaults. The
    engine runs its fixed step here on a CPU too (the CUDA way), so the quick form runs what a GPU would."""
    device, dtype, sized = size["device"], pick_dtype("auto", size["device"]), size["decode"]
    points = []
    for attention, compiled, ahead in DECODE_LEVERS:
        name = f"decoding lever: decode_attention={attention}, compile={compiled}, decode_ahead={ahead}"
        if (attention, compiled, ahead) not in sized["levers"]:
            why = ("does not compile (minutes on a CPU)" if compiled else "leaves flex out (seconds uncompiled on a "
                   "CPU; tests/test_decode_attention.py runs it)")
            points.append(Point(name, f"the quick form {why}", "not measured"))
            continue
        one = decode_engine(hf_dir, device, dtype, 1, attention, compiled, ahead)
        many = decode_engine(hf_dir, device, dtype, sized["rows"], attention, compiled, ahead)
        rate_one, rate_many = decode_rate(one, 1, sized["steps"]), decode_rate(many, sized["rows"], sized["steps"])
        points.append(lever(name, f"batch 1: {rate_one:,.0f} tokens/s; {sized['rows']} rows: {rate_many:,.0f} "
                                  f"tokens/s", gpu).show())
        profiled = min(sized["steps"], PROFILED_STEPS)
        print(decode_profile(one, 1, profiled, f"batch 1, {dtype}, {name.split(': ')[1]}"), flush=True)
        if (attention, compiled, ahead) == DECODE_LEVERS[0]:
            print(decode_profile(many, sized["rows"], profiled,
                                 f"{sized['rows']} rows, {dtype}, {name.split(': ')[1]}"), flush=True)
    return points


def decode_engine(hf_dir, device, dtype, rows, attention, compile, ahead):
    """The engine of serve.py (sample.py: rows=1) on the model in hf_dir, decoding in its fixed step."""
    return serve.greedy_engine(hf_dir, device, dtype, compile=compile, max_batch=rows, fixed=True,
                               decode_attention=attention, ahead=ahead)[0]


def decoding_rows(runner, rows, steps, seed=0):
    """rows requests of 1 + 2 * steps tokens each (12-token prompts, temperature 1, seeded) in runner, stepped until
    every prompt is encoded and every row decodes (the first token of each sampled): their Generations."""
    generations = [runner.submit(Request(prompt, max_tokens=1 + 2 * steps, temperature=1.0, seed=seed + i))
                   for i, prompt in enumerate(serve.prompts(rows, 12, seed))]
    while not all(g.completion_tokens for g in generations):
        runner.step()
    return generations


def decode_rate(runner, rows, steps):
    """Decoded tokens/s of runner's steps with rows decoding rows: steps steps timed after as many unmeasured (the
    capture, compilation), every row then done (each step reads its tokens: the host waits for every step)."""
    generations = decoding_rows(runner, rows, steps)
    for _ in range(steps):
        runner.step()
    serve.synchronize(runner.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    seconds = time.perf_counter() - t0
    runner.run(generations)
    return rows * steps / seconds


def decode_profile(runner, rows, steps, title):
    """The top kernels per decoded token of steps steps of runner with rows decoding rows (warmed up: capture and
    compilation before)."""
    generations = decoding_rows(runner, rows, steps, seed=100)
    runner.step()

    def run():
        for _ in range(steps - 1):
            runner.step()
    kernels, total = top_kernels(run, rows * (steps - 1), runner.device)
    runner.run(generations)
    return kernel_table(f"top kernels per decoded token, {title}", kernels, total, "token")


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
    lone, full = math.nan, ""  # (more servers: not in the quick form)
    if size["lone_server"]:
        with serve.server(hf_dir, dtype, device, "--max_batch=1") as url:
            lone = serve.stream_rate(url, 1, tokens)[0]
        # its default decode_attention on CUDA is flex: full's beside it (the lever, as serve.py runs it)
        with serve.server(hf_dir, dtype, device, "--decode_attention=full") as url:
            full = "; decode_attention=full: " + ", ".join(f"{c}: {serve.stream_rate(url, c, tokens)[0]:,.0f}"
                                                          for c in (1, 32))
    table = ", ".join(f"{c}: {r:,.0f}" for c, r in rates.items())
    goal = "goal 32 clients >= 15,000, 8 >= 6,000"
    return [*one_client_parts(hf_dir, device, dtype, tokens, gpu),
            judged(f"serve.py {dtype}, streaming clients, tokens/s ({goal})", table + full,
                   rates.get(32, 0) >= 15000 and rates.get(8, 0) >= 6000, gpu),
            judged("serve.py, one client (goal >= 1,500 tokens/s at the default max_batch)",
                   f"{rates[1]:,.0f} at max_batch 32, {lone:,.0f} at max_batch 1", rates[1] >= 1500, gpu),
            Point("serve.py, 8 seeded requests: each text the same at once as alone",
                  f"{'yes' if same else 'NO'} ({at_once:,.0f} tokens/s at once, {alone:,.0f} one at a time)",
                  "PASS" if same else "FAIL")]


def one_client_parts(hf_dir, device, dtype, tokens, gpu):
    """Where one client's tokens/s goes, before HTTP: the engine that serve.py builds (max_batch 32, and 1)
    stepped in this thread as sample.py steps it, against in its own thread with a reader taking its events as
    serve.py's streams do (STREAM_BACKLOG unread pause it); serve.py's rate beside them says what HTTP adds."""
    from machinery.serving.openai_api import STREAM_BACKLOG

    figures = []
    for rows in (32, 1):
        runner = serve.greedy_engine(hf_dir, device, dtype, max_batch=rows)[0]
        inline = [one_request_rate(runner, tokens, None) for _ in range(2)][-1]  # (the first captures the graph)
        runner.start()
        try:
            threaded = one_request_rate(runner, tokens, STREAM_BACKLOG)
        finally:
            runner.stop()
        figures.append(f"max_batch {rows}: stepped here {inline:,.0f}, in its thread with a reader {threaded:,.0f}")
    return [lever("serve.py's engine, one request, tokens/s", "; ".join(figures), gpu).show()]


def one_request_rate(runner, tokens, backlog):
    """tokens/s of one seeded request of tokens tokens: stepped in this thread (backlog None), or read here from the
    engine's own thread (started) as its events arrive, at most backlog of them unread."""
    arrived = threading.Event()
    g = runner.submit(Request(serve.prompts(1, 12, 7)[0], max_tokens=tokens, temperature=1.0, seed=7),
                      notify=arrived.set, max_backlog=backlog)
    t0 = time.perf_counter()
    if backlog is None:
        runner.run([g])
    while backlog is not None and not (g.done and not g.events):
        arrived.wait(1)
        arrived.clear()
        g.take()
    return tokens / (time.perf_counter() - t0)


def training_steps(gpu, size, step):
    """Muon's step against AdamW's on the GPU speedrun's model and GPT-2 124M's step (ms/iter, tokens/s, MFU), each
    as train.py runs it at its defaults; then the training levers a row each, and the top kernels of a step of
    each model (printed as they come). step(argv, profile) is bench.py --mode=train's measurement (bench.StepFigures)."""
    measured = [f"--warmup={size['train']['warmup']}", f"--repeats={size['train']['repeats']}"]
    muon = step(training_args("speedrun model, muon", size, measured), profile=True)
    adamw = step(training_args("speedrun model, adamw", size, measured))
    big = step(training_args("GPT-2 124M", size, measured), profile=True)
    mfu_text = f"MFU {big.mfu:.1%}" if big.mfu else "MFU: no peak known for this device"
    points = [judged("Muon's step against AdamW's, GPU speedrun model, as train.py runs them (goal <= 1.15x)",
                     f"{muon.seconds * 1e3:.1f} against {adamw.seconds * 1e3:.1f} ms/iter: "
                     f"{muon.seconds / adamw.seconds:.2f}x", muon.seconds <= 1.15 * adamw.seconds, gpu),
              judged("GPT-2 124M training step (goal MFU >= 50 %)",
                     f"{big.seconds * 1e3:,.1f} ms/iter, {big.tokens / big.seconds:,.0f} tokens/s, {mfu_text}",
                     bool(big.mfu) and big.mfu >= 0.5, gpu)]
    for p in points:
        p.show()
    defaults = {"speedrun model, muon": muon, "speedrun model, adamw": adamw, "GPT-2 124M": big}
    for name in ("speedrun model, muon", "GPT-2 124M"):
        print(f"{name}, {defaults[name].kernels}", flush=True)
    return points + training_levers(gpu, size, step, defaults)


# the training levers, a row each: (the model, at its defaults in training_steps, and the lever's settings); the
# micro-batch's lever (the same tokens an iteration in other micro-batches) is sizes()'s, as the quick form's is small
TRAINING_LEVERS = [
    ("speedrun model, muon", ["--cuda_graph=False"]),
    ("speedrun model, adamw", ["--cuda_graph=False"]),
    ("speedrun model, muon", ["--compile=True"]),  # (its config's step is uncompiled: compiling costs more time)
    ("GPT-2 124M", ["--sdpa_backend=flash"]),  # (against the defaults: sdpa_backend=auto, PyTorch's choice)
    ("GPT-2 124M", ["--sdpa_backend=cudnn"]),
]


def training_args(model, size, *settings):
    """bench.py --mode=train's arguments for model (a TRAINING_LEVERS name) at the part's size, with settings. The
    speedrun model's vocabulary is shakespeare_char's: bench.py trains on random tokens, and would otherwise take
    GPT-2's where that dataset is not prepared (an output layer 774x as wide: the H200's 12.2 ms a step, not 7.0)."""
    if model == "GPT-2 124M":
        config, model_settings = "config/train_gpt2.py", []
    else:
        config, model_settings = "config/speedrun_shakespeare_char_gpu.py", [f"--vocab_size={CHAR_VOCAB}"]
    optimizer = ["--optimizer=adamw"] if model.endswith("adamw") else []
    return [os.path.join(ROOT, config), f"--device={size['device']}", *size["small"], *model_settings, *optimizer,
            *(s for group in settings for s in group)]


def training_levers(gpu, size, step, defaults):
    """A row per training lever: its ms/iter (and MFU where known) against its model's at the defaults. A lever
    that compiles is not measured on a CPU (minutes there), nor one that train.py refuses on this machine (an
    attention kernel it has not: its one line)."""
    measured = [f"--warmup={size['lever_train']['warmup']}", f"--repeats={size['lever_train']['repeats']}"]
    points = []
    for model, settings in TRAINING_LEVERS + [("GPT-2 124M", size["micro_batch"])]:
        name = f"training lever: {model}, {' '.join(s.removeprefix('--') for s in settings)}"
        if not gpu and "--compile=True" in settings:
            points.append(Point(name, "the quick form does not compile (minutes on a CPU)", "not measured"))
            continue
        try:
            got, base = step(training_args(model, size, measured, settings)), defaults[model]
        except UserError as e:
            points.append(Point(name, f"train.py refuses it here: {e}", "not measured"))
            continue
        mfu = f", MFU {got.mfu:.1%}" if got.mfu else ""
        points.append(lever(name, f"{got.seconds * 1e3:,.1f} ms/iter{mfu}; at the defaults "
                                  f"{base.seconds * 1e3:,.1f} ({got.seconds / base.seconds:.2f}x)", gpu).show())
    return points


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
    """Every part of cfg.parts in turn (a part that fails is a FAIL line and the next still runs), then every line
    again and the table for BENCHMARKS.md; the speedrun only while budget_s leaves it room. Returns the Points."""
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
            if not p.shown:
                p.show()
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        points.extend(done)

    wanted = cfg.parts.split(",")
    for name, fn, *args in (("tests", cuda_tests, gpu), ("sample", decoding, cfg, hf_dir, gpu, size),
                            ("decode", decode_levers, hf_dir, gpu, size), ("serve", serving, hf_dir, gpu, size),
                            ("train", training_steps, gpu, size, step)):
        if name in wanted:
            part(name, fn, *args)
    left = cfg.budget_s - (time.perf_counter() - start)
    if "speedrun" in wanted and (not gpu or left >= SPEEDRUN_SECONDS):
        part("speedrun", speedrun, cfg, workdir, gpu, size, train_config)
    elif "speedrun" in wanted:
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
