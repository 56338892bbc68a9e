"""
bench.py --mode=serve: serve.py under load, and batch-1 decoding against transformers' generate.

    python bench.py --mode=serve [--clients=1,8,32] [--serve_tokens=100] [--dtype=auto]

A random model of GPT-2's architecture (124M with bench.py's default settings: 12 layers, 12 heads, 768
wide, block 1024, GPT-2's 50257 tokens, biases, tanh GELU) is written as a Hugging Face directory and
served by `python serve.py --init_from=DIR` in a process of its own, on 127.0.0.1. Then, in this process:

1. batch-1 decoding, greedy, serve_tokens new tokens after a random prompt of prompt_len tokens, side by
   side and alternating: the generation engine as serve.py runs it (dtype as given: auto is bfloat16
   where the CPU computes it natively, else float32) and transformers' GPT2LMHeadModel.generate on the same
   weights (its default float32, and the engine's dtype when that is another); tokens/s, the median of
   `repeats` runs after `warmup`;
2. for each number of clients C: C streaming clients at once (asyncio + httpx), each asking for
   serve_tokens tokens (temperature 1, its own seed, a random prompt): the tokens/s of all of them
   together, each client's time to its first token, and the gaps between its tokens (p50, p99);
3. 8 seeded requests one at a time, then the same 8 at once: whether each text is the same, and the
   ratio of their throughputs.

The server and the clients share the machine's cores (the clients' work is small: reading events).
"""

import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

from machinery import convert, engine, loading
from machinery.hardware import DTYPES
from machinery.meta import DatasetMeta
from machinery.tokenizer import GPT2_EOT, GPT2_VOCAB_SIZE
from model import GPT

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


def batch_one(cfg, hf_dir, dtype):
    """Greedy batch-1 tokens/s: our engine (as serve.py runs it) and transformers' generate, alternating."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()

    prompt = torch.randint(0, GPT2_VOCAB_SIZE, (cfg.prompt_len,),
                           generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n = cfg.serve_tokens
    loaded = loading.load(loading.ModelSource(init_from=hf_dir), "cpu", dtype)  # as serve.py's build loads it
    runner = engine.Engine(engine.prepare(loaded.model, loaded.device, loaded.dtype), loaded.tokenizer, loaded.device)

    def ours():
        g = runner.submit(engine.Request(prompt, max_tokens=n, temperature=0))
        while not g.done:
            runner.step()

    def transformers(hf_dtype):
        hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=hf_dtype).eval()
        ids = torch.tensor([prompt])

        def run():
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=GPT2_EOT)
        return run

    runs = {f"ours ({dtype})": ours, "transformers generate (float32)": transformers(torch.float32)}
    if dtype != "float32":  # transformers in our precision too: the same bytes to read per token
        runs[f"transformers generate ({dtype})"] = transformers(DTYPES[dtype])
    return {name: n / seconds for name, seconds in alternating(runs, cfg.warmup, cfg.repeats).items()}


async def client(http, url, prompt, seed, tokens):
    """One streaming request; (its text, seconds to the first token, the gaps between its tokens, tokens)."""
    t0 = time.perf_counter()
    stamps, text = [], ""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "seed": seed, "stream": True}
    async with http.stream("POST", url, json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                text += json.loads(line[6:])["choices"][0]["text"]
    return text, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def prompts(count, prompt_len, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, GPT2_VOCAB_SIZE, (prompt_len,), generator=g).tolist() for _ in range(count)]


async def load(url, requests, tokens):
    """The requests [(prompt, seed)] streamed at once: (texts, tokens/s of all together, first-token times,
    gaps between tokens)."""
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
                             f"--dtype={dtype}", f"--port={port}", "--max_batch=64", "--device=cpu", *settings],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # (a warning may come first, e.g. about an emulated dtype)
        if line.startswith("serving"):
            return proc
        seen.append(line)
    proc.kill()
    raise RuntimeError(f"serve.py did not start: {''.join(seen)[-2000:]}")


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_serve(cfg, workdir):
    from machinery.hardware import describe, pick_dtype

    hf_dir = os.path.join(workdir, "gpt2-shaped")
    model = gpt2_shaped(cfg, hf_dir)
    dtype = pick_dtype(cfg.dtype, "cpu")
    print(f"model: GPT-2 architecture, {model.get_num_params() / 1e6:.1f}M parameters ({cfg.n_layer} layers, "
          f"{cfg.n_embd} wide, vocab {model.config.vocab_size}), random weights; {describe('cpu', dtype)}", flush=True)
    print(f"batch 1, greedy, {cfg.serve_tokens} new tokens after {cfg.prompt_len}, median of {cfg.repeats} "
          f"after {cfg.warmup} warm-up (alternating):", flush=True)
    rates = batch_one(cfg, hf_dir, dtype)
    base = next(v for k, v in rates.items() if k.endswith("(float32)") and k.startswith("transformers"))
    for name, rate in rates.items():
        print(f"  {name:38} {rate:8.1f} tokens/s  ({rate / base:.2f}x transformers float32)", flush=True)
    port = free_port()
    server = start_server(hf_dir, dtype, port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        asyncio.run(load(url, list(zip(prompts(2, cfg.prompt_len, 99), (1, 2))), 8))  # warm-up
        print(f"through serve.py ({dtype}), streaming clients, {cfg.serve_tokens} tokens each:", flush=True)
        print(f"  {'clients':>7} {'tokens/s':>9} {'first token p50':>16} {'gap p50':>9} {'gap p99':>9}")
        figures = {}
        for clients in [int(c) for c in cfg.clients.split(",")]:
            requests = list(zip(prompts(clients, cfg.prompt_len, clients), range(clients)))
            _, rate, first, gaps = asyncio.run(load(url, requests, cfg.serve_tokens))
            figures[clients] = rate
            print(f"  {clients:7} {rate:9.1f} {statistics.median(first) * 1e3:13.0f} ms "
                  f"{percentile(gaps, 50) * 1e3:6.1f} ms {percentile(gaps, 99) * 1e3:6.1f} ms", flush=True)
        requests = list(zip(prompts(8, cfg.prompt_len, 1000), range(1000, 1008)))
        texts, at_once, _, _ = asyncio.run(load(url, requests, cfg.serve_tokens))
        t0 = time.perf_counter()
        alone = [asyncio.run(load(url, [r], cfg.serve_tokens))[0][0] for r in requests]
        one_at_a_time = 8 * cfg.serve_tokens / (time.perf_counter() - t0)
        same = alone == texts
        print(f"8 seeded requests: at once {at_once:.1f} tokens/s, one at a time {one_at_a_time:.1f} tokens/s: "
              f"{at_once / one_at_a_time:.2f}x; each text the same at once as alone: {'yes' if same else 'NO'}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return rates, figures, same
