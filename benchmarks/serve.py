"""
bench.py --mode=serve: serve.py under load, and batch-1 decoding against transformers' generate and llama.cpp.

    python bench.py --mode=serve [--clients=1,8,32] [--serve_tokens=100] [--dtype=auto] [--out_dir=DIR --text=FILE]
    python bench.py --mode=serve --device=cuda        # on a GPU: ours and transformers in bfloat16 and float32

A random model of GPT-2's architecture (124M with bench.py's default settings: 12 layers, 12 heads, 768
wide, block 1024, GPT-2's 50257 tokens, biases, tanh GELU) is written as a Hugging Face directory and
served by `python serve.py --init_from=DIR` in a process of its own, on 127.0.0.1. Then, in this process:

1. batch-1 decoding, greedy, serve_tokens new tokens after a random prompt of prompt_len tokens, side by
   side and alternating: the generation engine as serve.py runs it (dtype as given: auto is bfloat16
   where the CPU computes it natively, else float32) and with int8 weights (--quantize=int8; with
   --compile=True also compiled, as sample.py --compile=True --quantize=int8 runs it; and its int8 products
   alone, nothing else of a step: the kernel's bound), llama.cpp (llama-cpp-python, torch's number of threads)
   on the same weights as GGUF files in Q8_0 and F16 (export.py --to=gguf), and transformers'
   GPT2LMHeadModel.generate (its default float32, and the engine's dtype when that is another); tokens/s, the
   median of `repeats` runs after `warmup`; then the command itself, `sample.py` greedy, a process a run
   (sample_command: the tokens after its first SAMPLE_FEW); and the memory bound: the bytes of weights each row
   reads per token against the memory's read bandwidth, measured in the same run;
2. with --text (and --out_dir: a trained GPT-2 BPE checkpoint): bits per byte on that held-out text,
   eval.py --text in float32 and with --quantize=int8, and llama.cpp over the same windows in F32 and Q8_0;
3. for each number of clients C: C streaming clients at once (asyncio + httpx), each asking for
   serve_tokens tokens (temperature 1, its own seed, a random prompt): the tokens/s of all of them
   together, each client's time to its first token, and the gaps between its chunks (p50, p99);
4. 8 seeded requests one at a time, then the same 8 at once: whether each text is the same, and the
   ratio of their throughputs;
5. a chat's time to its first token as the conversation grows: a one-token completion (greedy) after a
   random prompt of each of prompt_lens tokens, through serve.py at dtype and at float32 (two servers, the
   lengths and the dtypes in turn, median of `repeats`).

The server and the clients share the machine's cores (the clients' work is small: reading events). With
--device=cuda everything runs on the GPU (int8 and llama.cpp are the CPU's rows: left out there).
"""

import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.llama_runs import llama_cpp_greedy, llama_cpp_text_loss
from machinery.generation import decode, engine, loading, packing
from machinery.weights import convert, gguf_export, quantize
from machinery.fileio import read_text
from machinery.hardware import DTYPES
from machinery.data.meta import DatasetMeta
from machinery.generation.request import Request
from machinery.generation.calibration_cache import CalibrationCache
from machinery.data.tokenizer import GPT2_EOT, GPT2_VOCAB_SIZE
from model import GPT

READ_BYTES = 1 << 29  # (512 MiB: far beyond any cache)
SAMPLE_START = "The meaning of life is"  # sample.py's prompt in the whole-process row
SAMPLE_FEW = 2  # sample.py's first tokens a sample, not in the rate it says (sample.WARM_TOKENS)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_shaped(cfg, directory):
    """A random GPT-2-architecture model written as a Hugging Face directory; the model."""
    torch.manual_seed(cfg.seed)
    # the model the bench settings ask for (as train.py derives it), with what makes it GPT-2's architecture
    model = GPT(dataclasses.replace(cfg.gpt_config(cfg.vocab_size or GPT2_VOCAB_SIZE), bias=True, gelu="tanh"))
    config, tensors = convert.to_hf(model, DatasetMeta.gpt2())
    convert.write_hf(directory, config, tensors, DatasetMeta.gpt2())
    return model


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def alternating(runs, warmup, repeats):
    """{name: the median seconds of a call} of each function of runs {name: f}, called in turn (so that a drift
    of the machine's speed weighs on all alike), repeats times after warmup unmeasured rounds."""
    times = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def batch_one(cfg, hf_dir, model, device, dtype, workdir):
    """Greedy batch-1 tokens/s on device, alternating: our engine (as serve.py runs it) at dtype and at float32
    and, on the CPU, with int8 weights (--quantize=int8, the rest in dtype; with --compile=True also compiled; its
    products alone, int8_products) and llama.cpp on the same weights in Q8_0 and F16 (GGUF files of export.py
    --to=gguf); transformers' generate in float32 (and in dtype when that is another);
    ({name: (tokens/s, bytes of weights read per token)}, the memory's read bandwidth in bytes/s: a sum over
    READ_BYTES of float32, timed in turn with the rows, so that it sees the same load)."""
    prompt = torch.randint(0, GPT2_VOCAB_SIZE, (cfg.prompt_len,),
                           generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n = cfg.serve_tokens

    def ours(quantize=None, dtype=dtype, compile=False):
        return engine_greedy(hf_dir, device, dtype, prompt, n, quantize, compile)

    def llama(outtype):
        path = os.path.join(workdir, f"{outtype}.gguf")
        gguf_export.write_gguf(path, model, DatasetMeta.gpt2(), outtype)
        return llama_cpp_greedy(path, prompt, n, torch.get_num_threads())

    runs = {f"ours ({dtype})": (ours(), dtype)}
    if dtype != "float32":  # whether dtype pays on this machine: both in one run
        runs["ours (float32)"] = (ours(dtype="float32"), "float32")
    if device == "cpu":
        runs[f"ours (int8, the rest {dtype})"] = (ours("int8"), "int8")
        if cfg.compile:  # as sample.py --compile --quantize=int8 (its compiling is in the warm-up rounds)
            runs["ours (int8, --compile)"] = (ours("int8", compile=True), "int8")
        runs["int8 products alone: the kernel's bound"] = (int8_products(model, n), "int8")
        runs.update({"llama.cpp Q8_0": (llama("q8_0"), "q8_0"), "llama.cpp F16": (llama("f16"), "float16")})
    runs["transformers generate (float32)"] = (transformers_greedy(hf_dir, device, "float32", prompt, n), "float32")
    if dtype != "float32":  # transformers in our precision too: the same bytes to read per token
        runs[f"transformers generate ({dtype})"] = (transformers_greedy(hf_dir, device, dtype, prompt, n), dtype)
    memory = torch.ones(READ_BYTES // 4, device=device)  # the memory's read bandwidth, measured in turn with the rows

    def read_memory():
        memory.sum()
        synchronize(device)
    seconds = alternating({**{name: f for name, (f, _) in runs.items()}, "memory": read_memory}, cfg.warmup,
                          cfg.repeats)
    rates = {name: (n / seconds[name], weight_bytes(model, kind)) for name, (_, kind) in runs.items()}
    return rates, READ_BYTES / seconds["memory"]


def transformers_greedy(hf_dir, device, dtype, prompt, n):
    """A function that decodes n tokens greedily after prompt with transformers' GPT2LMHeadModel.generate (the
    model in hf_dir, in dtype), and waits for the device."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=DTYPES[dtype]).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def run():
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=GPT2_EOT)
        synchronize(device)
    return run


def greedy_engine(hf_dir, device, dtype, quantize=None, compile=False, max_batch=1, **settings):
    """Our engine on the model in hf_dir, loaded as serve.py's build loads it (quantize, compile: as --quantize,
    --compile), by default with one row of KV cache as sample.py makes for one sample (a fixed step, CUDA's,
    computes every row of the cache); settings: more of engine.Engine's; (the engine, the tokenizer). As serve.py's,
    its calibration is this machine's file (CalibrationCache): the bench's engines of one shape measure it once."""
    loaded = loading.load(loading.ModelSource(init_from=hf_dir), device, dtype)
    settings.setdefault("calibration", CalibrationCache())
    runner = engine.Engine(packing.prepare(loaded.model, loaded.device, loaded.dtype, compile, quantize),
                           loaded.tokenizer, loaded.device, max_batch=max_batch, compile=compile, **settings)
    return runner, loaded.tokenizer


def engine_greedy(hf_dir, device, dtype, prompt, n, quantize=None, compile=False):
    """A function that decodes n tokens greedily after prompt in our engine (greedy_engine's)."""
    runner, _ = greedy_engine(hf_dir, device, dtype, quantize, compile)

    def run():
        g = runner.submit(Request(prompt, max_tokens=n, temperature=0))
        while not g.done:
            runner.step()
        step = runner.model_runner.fixed_step
        if runner.device.type == "cuda" and step.graph is None:  # an eager figure is not the graph's
            raise RuntimeError(f"the engine's CUDA graph was not captured ({decode.EAGER_NOTE}: see above)")
    return run


def sample_command(hf_dir, device, dtype, n, repeats):
    """Greedy batch-1 tokens/s through the command, as a user runs it: `python sample.py --init_from=hf_dir
    --num_samples=1 --temperature=0` (the rest at its defaults), a process a run, asked for SAMPLE_FEW + n tokens;
    the rate its stderr says for the n after its first SAMPLE_FEW (the prompt's pass, the CUDA graph's capture), the
    median of repeats runs. (tokens/s, the sample it printed.)"""
    def run():
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--init_from={hf_dir}",
                               f"--device={device}", f"--dtype={dtype}", "--num_samples=1", "--temperature=0",
                               f"--max_new_tokens={SAMPLE_FEW + n}", f"--start={SAMPLE_START}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"sample.py failed: {proc.stderr[-2000:]}")
        if decode.EAGER_NOTE in proc.stderr:  # an eager figure is not the graph's
            raise RuntimeError(f"sample.py's CUDA graph was not captured: {proc.stderr[-2000:]}")
        said = re.search(rf"^decoded ([\d,]+) tokens in \S+ s: ([\d,.]+) tokens/s \(after each sample's first "
                         rf"{SAMPLE_FEW}\)$", proc.stderr, re.M)
        if not said or int(said[1].replace(",", "")) != n:
            raise RuntimeError(f"sample.py did not say it decoded {n} tokens after its first {SAMPLE_FEW}: "
                               f"{proc.stderr[-2000:]}")
        return float(said[2].replace(",", "")), proc.stdout
    rates, out = zip(*(run() for _ in range(repeats)))
    return statistics.median(rates), out[-1].removeprefix(SAMPLE_START).split("\n---------------\n")[0]


def sample_text(hf_dir, device, dtype, n):
    """The greedy continuation of SAMPLE_START that sample_command's longer run prints, made by our engine
    in-process (the path sample.py runs); a RuntimeError when it ends before SAMPLE_FEW + n tokens (at
    <|endoftext|>: the difference would not be n tokens)."""
    runner, tokenizer = greedy_engine(hf_dir, device, dtype)
    prompt = tokenizer.encode(SAMPLE_START)
    g = runner.submit(Request(prompt, max_tokens=SAMPLE_FEW + n, temperature=0,
                              stop_tokens=(GPT2_EOT,)))
    runner.run([g])
    if g.completion_tokens != SAMPLE_FEW + n:
        raise RuntimeError(f"greedy decoding ends after {g.completion_tokens} tokens (<|endoftext|>), not "
                           f"{SAMPLE_FEW + n}: sample.py's row would time fewer tokens; try another --seed")
    return g.text.text


def int8_products(model, n):
    """A function that runs only the int8 products of n decoding steps: every layer --quantize=int8 makes of
    model (the output head included) on one bfloat16 row, as a step calls them, and nothing else a step does:
    the speed int8 decoding cannot pass with PyTorch's kernel (the weights, 124 MB for GPT-2, stream from memory
    at each step as in decoding)."""
    layers = [m for m in quantize.quantize(copy.deepcopy(model), "int8").modules()
              if isinstance(m, quantize.Int8Linear)]
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in layers}

    def run():
        with torch.no_grad():
            for _ in range(n):
                for layer in layers:
                    layer(rows[layer.in_features])
    return run


def synchronize(device):
    """Wait for a CUDA device's queued work (device: a name or a torch.device); nothing elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model, kind):
    """Bytes of weights one decoding step reads: every matrix of the blocks and the output layer (the embeddings
    are looked up: one row each; vectors are a rounding error), at kind's bytes per weight (Q8_0: 32 int8 and
    a float16 scale per block of 32; int8: an int8 and, per row, a bfloat16 scale)."""
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and name != "pos_emb.weight"]
    weights, rows = sum(p.numel() for p in matrices), sum(p.size(0) for p in matrices)
    per_weight = {"float32": 4, "bfloat16": 2, "float16": 2, "q8_0": 34 / 32, "int8": 1}[kind]
    return weights * per_weight + (2 * rows if kind == "int8" else 0)


def print_batch_one(rates, bandwidth):
    """The batch-1 table: each row's tokens/s against transformers' float32, and against its memory bound (the
    tokens/s at which its weights stream at the measured bandwidth)."""
    base = next(v[0] for k, v in rates.items() if k.endswith("(float32)") and k.startswith("transformers"))
    print(f"  {'':40} {'tokens/s':>9} {'x transformers fp32':>20} {'weights/token':>14} {'memory bound':>13} "
          f"{'reached':>8}")
    for name, (rate, nbytes) in rates.items():
        print(f"  {name:40} {rate:9.1f} {rate / base:19.2f}x {nbytes / 1e6:11.0f} MB {bandwidth / nbytes:13.1f} "
              f"{rate * nbytes / bandwidth:8.0%}", flush=True)
    print(f"  memory bound: weight bytes per token / {bandwidth / 1e9:.1f} GB/s, the read bandwidth measured in turn "
          f"with the rows (a sum over {READ_BYTES >> 20} MiB of float32)", flush=True)


def bits_per_byte(cfg, workdir):
    """Bits per byte on the held-out text cfg.text of the trained model in cfg.out_dir (GPT-2 BPE): eval.py
    --text's, in processes of their own, in float32 and with --quantize=int8 (the rest float32), and llama.cpp's
    over the same windows (scoring.text_loss's) from GGUF files in F32 and Q8_0. {name: bits per byte}."""
    print(f"bits per byte of {cfg.out_dir} on {cfg.text}:", flush=True)
    figures = {}
    for name, extra in (("ours float32", []), ("ours int8", ["--quantize=int8"])):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), f"--out_dir={cfg.out_dir}",
                               f"--text={cfg.text}", "--json", "--device=cpu", "--dtype=float32", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"eval.py failed: {proc.stderr[-2000:]}")
        figures[name] = json.loads(proc.stdout.strip().splitlines()[-1])["text"]["bits_per_byte"]
    loaded = loading.load(loading.ModelSource(out_dir=cfg.out_dir), "cpu", "float32")
    text = read_text(cfg.text, "--text", "give a UTF-8 text file")
    ids = loaded.tokenizer.encode(text)
    for outtype in ("f32", "q8_0"):
        path = os.path.join(workdir, f"bpb-{outtype}.gguf")
        gguf_export.write_gguf(path, loaded.model, loaded.data_meta, outtype)
        nats = llama_cpp_text_loss(path, ids, loaded.model.config.block_size, torch.get_num_threads())
        figures[f"llama.cpp {outtype}"] = nats / math.log(2) / len(text.encode("utf-8"))
    for name, bits in figures.items():
        print(f"  {name:20} {bits:.4f} bits per byte ({bits / figures['ours float32'] - 1:+.3%} against ours in "
              f"float32)", flush=True)
    return figures


async def client(http, url, prompt, seed, tokens):
    """One streaming request; (its text, seconds to the first token, the gaps between its chunks (a chunk holds the
    tokens that arrived together), its tokens as the stream's usage counts them)."""
    t0 = time.perf_counter()
    stamps, text, count = [], "", None
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", url, json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["usage"] is not None:  # (the last chunk, which has no choice)
                    count = chunk["usage"]["completion_tokens"]
                elif chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
                    text += chunk["choices"][0]["text"]
    return text, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], count


def prompts(count, prompt_len, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, GPT2_VOCAB_SIZE, (prompt_len,), generator=g).tolist() for _ in range(count)]


async def load(url, requests, tokens):
    """The requests [(prompt, seed)] streamed at once: (texts, tokens/s of all together, first-token times,
    gaps between chunks)."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(requests) + 4)) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(http, url, p, seed, tokens) for p, seed in requests))
        seconds = time.perf_counter() - t0
    return ([r[0] for r in results], sum(r[3] for r in results) / seconds, [r[1] for r in results],
            [gap for r in results for gap in r[2]])


def start_server(hf_dir, dtype, port, *settings):
    """serve.py on hf_dir in a process of its own (settings: more of its --key=value), once it listens."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve.py"), f"--init_from={hf_dir}",
                             f"--dtype={dtype}", f"--port={port}", "--device=cpu", *settings],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # (a warning may come first, e.g. about an emulated dtype)
        if line.startswith("serving"):
            return proc
        seen.append(line)
    proc.kill()
    raise RuntimeError(f"serve.py did not start: {''.join(seen)[-2000:]}")


@contextlib.contextmanager
def server(hf_dir, dtype, device, *settings):
    """serve.py on hf_dir (start_server's), warmed up by two short requests; yields its completions URL and stops
    it on the way out."""
    port = free_port()
    proc = start_server(hf_dir, dtype, port, f"--device={device}", *settings)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        asyncio.run(load(url, list(zip(prompts(2, 8, 99), (1, 2))), 8))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def stream_rate(url, clients, tokens, prompt_len=12):
    """clients streaming requests of tokens tokens each at once, seeded: (tokens/s of all together, first-token
    times, gaps between chunks)."""
    requests = list(zip(prompts(clients, prompt_len, clients), range(clients)))
    _, rate, first, gaps = asyncio.run(load(url, requests, tokens))
    return rate, first, gaps


def seeded_same(url, tokens, prompt_len=12):
    """8 seeded requests at once, then one at a time: (tokens/s at once, tokens/s one at a time, whether each
    text is the same both ways)."""
    requests = list(zip(prompts(8, prompt_len, 1000), range(1000, 1008)))
    texts, at_once, _, _ = asyncio.run(load(url, requests, tokens))
    t0 = time.perf_counter()
    alone = [asyncio.run(load(url, [r], tokens))[0][0] for r in requests]
    return at_once, 8 * tokens / (time.perf_counter() - t0), alone == texts


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_serve(cfg, workdir):
    from machinery.hardware import describe, pick_device, pick_dtype

    hf_dir = os.path.join(workdir, "gpt2-shaped")
    model = gpt2_shaped(cfg, hf_dir)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    print(f"model: GPT-2 architecture, {model.get_num_params() / 1e6:.1f}M parameters ({cfg.n_layer} layers, "
          f"{cfg.n_embd} wide, vocab {model.config.vocab_size}), random weights; {describe(device, dtype)}",
          flush=True)
    print(f"batch 1, greedy, {cfg.serve_tokens} new tokens after {cfg.prompt_len}, median of {cfg.repeats} "
          f"after {cfg.warmup} warm-up (alternating):", flush=True)
    expected = sample_text(hf_dir, device, dtype, cfg.serve_tokens)  # (first: a model that stops early stops here)
    rates, bandwidth = batch_one(cfg, hf_dir, model, device, dtype, workdir)
    rate, text = sample_command(hf_dir, device, dtype, cfg.serve_tokens, cfg.repeats)
    rates[f"sample.py, whole process ({dtype})"] = (rate, weight_bytes(model, dtype))
    print_batch_one(rates, bandwidth)
    print(f"  sample.py: tokens {SAMPLE_FEW}-{SAMPLE_FEW + cfg.serve_tokens} of `sample.py --init_from=DIR "
          f"--num_samples=1 --temperature=0 --start='{SAMPLE_START}'` (the rate it says on stderr, median of "
          f"{cfg.repeats} processes); its text the engine's "
          f"greedy text: {'yes' if text == expected else 'NO'}", flush=True)
    bpb = bits_per_byte(cfg, workdir) if cfg.text else None
    with server(hf_dir, dtype, device) as url:
        print(f"through serve.py ({dtype}), streaming clients, {cfg.serve_tokens} tokens each:", flush=True)
        print(f"  {'clients':>7} {'tokens/s':>9} {'first token p50':>16} {'gap p50':>9} {'gap p99':>9}")
        figures = {}
        for clients in [int(c) for c in cfg.clients.split(",")]:
            figures[clients], first, gaps = stream_rate(url, clients, cfg.serve_tokens, cfg.prompt_len)
            print(f"  {clients:7} {figures[clients]:9.1f} {statistics.median(first) * 1e3:13.0f} ms "
                  f"{percentile(gaps, 50) * 1e3:6.1f} ms {percentile(gaps, 99) * 1e3:6.1f} ms", flush=True)
        at_once, one_at_a_time, same = seeded_same(url, cfg.serve_tokens, cfg.prompt_len)
        print(f"8 seeded requests: at once {at_once:.1f} tokens/s, one at a time {one_at_a_time:.1f} tokens/s: "
              f"{at_once / one_at_a_time:.2f}x; each text the same at once as alone: {'yes' if same else 'NO'}")
    lengths = [int(n) for n in cfg.prompt_lens.split(",")] if cfg.prompt_lens else []
    prompt_seconds = prompt_times(hf_dir, device, dtype, lengths, cfg.repeats) if lengths else None
    return rates, bandwidth, figures, same, bpb, prompt_seconds


def prompt_times(hf_dir, device, dtype, lengths, repeats):
    """{dtype: {length: median seconds}} of a one-token greedy completion after a random prompt of each length,
    through serve.py at dtype and at float32 (a server each, both started first; lengths and dtypes in turn, so
    that a drift of the machine weighs on both alike), printed as a table."""
    dtypes = list(dict.fromkeys([dtype, "float32"]))
    servers = {}
    try:
        for d in dtypes:
            port = free_port()
            servers[d] = (start_server(hf_dir, d, port, f"--device={device}"), port)
        seconds = {d: {n: [] for n in lengths} for d in dtypes}
        prompt = prompts(1, max(lengths), 7)[0]  # (each length its first tokens: a conversation growing)
        for r in range(repeats + 1):  # (the first round warms each server up)
            for n in lengths:
                for d, (_, port) in servers.items():
                    took = one_token_after(f"http://127.0.0.1:{port}/v1/completions", prompt[:n])
                    if r:
                        seconds[d][n].append(took)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(timeout=60)
    medians = {d: {n: statistics.median(t) for n, t in by_length.items()} for d, by_length in seconds.items()}
    print(f"a one-token completion after a prompt of N tokens through serve.py, seconds (median of {repeats}):")
    print(f"  {'N':>12} " + " ".join(f"{n:>6}" for n in lengths))
    for d, by_length in medians.items():
        print(f"  {d:>12} " + " ".join(f"{by_length[n]:6.3f}" for n in lengths))
    if len(dtypes) > 1:
        print(f"  {dtype} no slower than float32 at every length: "
              f"{'yes' if all(medians[dtype][n] <= medians['float32'][n] for n in lengths) else 'NO'}", flush=True)
    return medians


def one_token_after(url, prompt):
    """Seconds of one request for a single greedy token after prompt (token ids), answered whole."""
    import httpx

    t0 = time.perf_counter()
    reply = httpx.post(url, json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                       timeout=600)
    seconds = time.perf_counter() - t0
    reply.raise_for_status()
    if reply.json()["usage"]["prompt_tokens"] != len(prompt):
        raise RuntimeError(f"serve.py read {reply.json()['usage']['prompt_tokens']} prompt tokens, not {len(prompt)}")
    return seconds
