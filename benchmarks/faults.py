"""
bench.py --mode=faults: serve.py against the clients that break servers, on a model of GPT-2's shape.

    python bench.py --mode=faults [--dtype=auto]

The same random GPT-2-architecture model as --mode=serve, served by serve.py in a process of its own:

1. a long prompt among running streams: 8 streaming clients decode; a prompt of block_size tokens arrives;
   the longest gap between two tokens of the 8, and the median, with prompts encoded in chunks of 64
   (the default) and whole (--prefill_chunk=block_size, what the engine did before);
2. clients that stop reading: 16 streaming requests of n=8 (128 choices) whose clients never read; the
   server's resident memory (RSS) after they stall, against the bytes of 32 rows of KV cache (max_batch);
3. clients that hang up: the time of a request (greedy, 50 tokens) on an idle server, then right after 20
   non-streaming requests of 1,000 tokens whose clients hang up after 0.2 s.
"""

import asyncio
import json
import os
import socket
import statistics
import time

import httpx

from benchmarks.serve import client, free_port, gpt2_shaped, percentile, prompts, start_server
from machinery.hardware import describe, pick_dtype


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def serving(hf_dir, dtype, *settings):
    """(url, process) of serve.py with settings; stop it with process.terminate()."""
    port = free_port()
    return f"http://127.0.0.1:{port}", start_server(hf_dir, dtype, port, *settings)


async def long_prompt_among_streams(url, block_size, tokens):
    """Gaps (s) between the tokens of 8 streams while a block_size prompt is encoded; its first token's time."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as http:
        streams = [asyncio.create_task(client(http, f"{url}/v1/completions", p, seed, tokens))
                   for seed, p in enumerate(prompts(8, 8, 7))]
        await asyncio.sleep(3)  # the 8 are decoding
        t0 = time.perf_counter()
        body = {"prompt": prompts(1, block_size, 8)[0], "max_tokens": 1, "temperature": 0}
        await http.post(f"{url}/v1/completions", json=body, timeout=600)
        first = time.perf_counter() - t0
        results = await asyncio.gather(*streams)
    return [gap for r in results for gap in r[2]], first


def stalled_readers(url, pid, streams, n, tokens, seconds):
    """streams requests of n choices whose clients send and never read; the server's RSS (MB) over seconds."""
    port = int(url.rsplit(":", 1)[1])
    sockets, peak = [], rss_mb(pid)
    for i in range(streams):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": prompts(1, 8, 100 + i)[0], "n": n, "max_tokens": tokens, "stream": True,
                           "seed": i}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sockets.append(s)
    t0 = time.time()
    while time.time() - t0 < seconds:
        peak = max(peak, rss_mb(pid))
        time.sleep(0.5)
    health = httpx.get(f"{url}/health", timeout=60).json()
    for s in sockets:
        s.close()
    return peak, health


def request_seconds(url, tokens=50):
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompts(1, 8, 5)[0], "max_tokens": tokens,
                                                   "temperature": 0}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def hang_ups(url, count=20, tokens=1000):
    for i in range(count):
        try:
            httpx.post(f"{url}/v1/completions", json={"prompt": prompts(1, 8, 200 + i)[0], "max_tokens": tokens},
                       timeout=0.2)
        except httpx.TimeoutException:
            pass


def bench_faults(cfg, workdir):
    hf_dir = os.path.join(workdir, "gpt2-shaped")
    model = gpt2_shaped(cfg, hf_dir)
    dtype = pick_dtype(cfg.dtype, "cpu")
    mc = model.config
    kv_row_mb = 2 * mc.n_layer * (mc.block_size + 1) * mc.n_embd * 4 / 2**20  # float32: the CPU cache's dtype
    print(f"model: GPT-2 architecture, {model.get_num_params() / 1e6:.1f}M parameters, random weights; "
          f"{describe('cpu', dtype)}; one row of KV cache: {kv_row_mb:.1f} MB", flush=True)
    figures = {}
    for chunk in (64, mc.block_size):
        url, proc = serving(hf_dir, dtype, f"--prefill_chunk={chunk}")
        try:
            request_seconds(url, 5)  # warm-up
            gaps, first = asyncio.run(long_prompt_among_streams(url, mc.block_size, cfg.serve_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        figures[f"gaps, prefill_chunk={chunk}"] = (max(gaps), percentile(gaps, 50), first)
        print(f"8 streams while a {mc.block_size}-token prompt arrives, prefill_chunk={chunk}: longest gap "
              f"{max(gaps) * 1e3:.0f} ms, median {percentile(gaps, 50) * 1e3:.0f} ms; the prompt's first token "
              f"after {first:.2f} s", flush=True)
    url, proc = serving(hf_dir, dtype, "--max_batch=32", "--max_tokens=2000", "--stream_timeout=20")
    try:
        request_seconds(url, 5)
        before = rss_mb(proc.pid)
        peak, health = stalled_readers(url, proc.pid, 16, 8, 2000, 40)
        figures["rss"] = (before, peak, 32 * kv_row_mb)
        print(f"16 non-reading streams of n=8: RSS {before:.0f} MB before, at most {peak:.0f} MB (+{peak - before:.0f} "
              f"MB; 32 rows of KV cache: {32 * kv_row_mb:.0f} MB); /health then: {health}", flush=True)
        time.sleep(25)  # the stalled ones end (stream_timeout), the waiting ones run and end too
        idle = statistics.median(request_seconds(url) for _ in range(3))
        after = []
        for _ in range(3):
            hang_ups(url)
            after.append(request_seconds(url))
        figures["hang-ups"] = (idle, statistics.median(after))
        print(f"a 50-token request: {idle:.2f} s on an idle server, {statistics.median(after):.2f} s right after 20 "
              f"hang-ups ({statistics.median(after) / idle:.2f}x; median of 3)", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return figures
