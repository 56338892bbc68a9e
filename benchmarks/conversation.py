"""
bench.py --mode=conversation: the prefix cache (machinery/generation/prefix_cache.py) through serve.py, on conversations.

A random model of GPT-2's architecture (124M with bench.py's default settings) on the CPU, in --dtype (auto, as
serve.py's default). A conversation is a 300-token system prompt, then 8 turns of a 30-token user message and a
40-token reply (greedy), each turn's prompt the whole conversation so far (as every chat client sends it), the
replies as a text client would send them back (the reply's text encoded again). A pause of THINK_S between turns
stands for the user reading and typing; the engine then encodes the finished turn into the cache.

1. One conversation: the time to the first token at each turn, with the cache and without it (two servers in
   the same run), the prompt's tokens the cache gave (usage.prompt_tokens_details.cached_tokens), and whether
   every reply is the same both ways.
2. 8 other conversations at once, sharing the system prompt: tokens/s of all together, the median time to the
   first token at each turn, with and without the cache, the prompt tokens the cache gave at each turn; the memory
   the server's process holds (RSS) at the end.
3. A flood of distinct long prompts on a small model (--flood prompts of FLOOD_LEN tokens, 8 clients at once)
   against a 64 MB cache: the server's RSS as it goes, which the budget bounds.
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import time

import torch

from benchmarks.serve import GPT2_VOCAB_SIZE, free_port, gpt2_shaped, start_server
from machinery.hardware import pick_dtype
from machinery.data.tokenizer import GPT2Tokenizer

SYSTEM, USER, REPLY, TURNS, CONVERSATIONS = 300, 30, 40, 8, 8
THINK_S = 1.0  # between a reply and the next turn
FLOOD_LEN, FLOOD_MB = 512, 64


def random_ids(n, seed):
    return torch.randint(0, GPT2_VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def first_token(http, url, prompt):
    """One greedy streamed completion of REPLY tokens: (seconds to its first text, its text, its usage: the prompt's
    tokens and those taken from the prefix cache)."""
    t0, first, text, usage = time.perf_counter(), None, "", None
    body = {"prompt": prompt, "max_tokens": REPLY, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", url, json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                piece = event["choices"][0]["text"] if event["choices"] else ""  # (the usage's chunk has none)
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
                usage = event.get("usage") or usage
    return first, text, usage


async def think():
    """The user's pause between a reply and the next turn, in which the idle engine caches the finished turn."""
    await asyncio.sleep(THINK_S)


async def conversation(http, url, system, seed, tokenizer):
    """TURNS turns after system: (each turn's time to the first token, each reply's text, each turn's usage)."""
    ids, firsts, replies, usages = list(system), [], [], []
    for turn in range(TURNS):
        ids += random_ids(USER, seed * 100 + turn)
        first, text, usage = await first_token(http, url, ids)
        firsts.append(first)
        replies.append(text)
        usages.append(usage)
        ids += tokenizer.encode(text)
        await think()
    return firsts, replies, usages


async def conversations(url, seeds, tokenizer):
    """A conversation of each seed, all at once, sharing a system prompt: (their conversation()s, tokens/s of
    replies)."""
    import httpx

    system = random_ids(SYSTEM, 1)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(seeds) + 4)) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(conversation(http, url, system, seed, tokenizer) for seed in seeds))
        seconds = time.perf_counter() - t0 - TURNS * THINK_S
    return results, len(seeds) * TURNS * REPLY / seconds


@contextlib.contextmanager
def serving(hf_dir, dtype, *settings):
    """serve.py on hf_dir in dtype on the CPU: (its completions URL, its process); stopped on the way out."""
    port = free_port()
    proc = start_server(hf_dir, dtype, port, *settings)
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def warm_up(url):
    """A request of another prompt first (the first calls of oneDNN's kernels are slow)."""
    import httpx

    async with httpx.AsyncClient() as http:
        await first_token(http, url, random_ids(100, 7))


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure(hf_dir, dtype, cache_mb, tokenizer):
    """One conversation, then CONVERSATIONS others at once (the lone one's seed is none of theirs: they share
    only the system prompt with it), through a server with a cache of cache_mb (0: none)."""
    with serving(hf_dir, dtype, f"--prefix_cache_mb={cache_mb}") as (url, proc):
        asyncio.run(warm_up(url))
        (alone,), _ = asyncio.run(conversations(url, [CONVERSATIONS], tokenizer))
        together, rate = asyncio.run(conversations(url, range(CONVERSATIONS), tokenizer))
        return alone, together, rate, rss_mb(proc.pid)


def flood(cfg, workdir, count):
    """count distinct prompts of FLOOD_LEN tokens, 8 at a time, through a small model's server with a FLOOD_MB
    cache: its RSS (MB) before and after every quarter."""
    import httpx

    small = dataclasses.replace(cfg, n_layer=2, n_head=2, n_embd=128)
    hf_dir = os.path.join(workdir, "small")
    gpt2_shaped(small, hf_dir)

    async def run(url, proc):
        sizes = [rss_mb(proc.pid)]
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=12)) as http:
            for start in range(0, count, 8):
                await asyncio.gather(*(http.post(url, json={"prompt": random_ids(FLOOD_LEN, 10_000 + i),
                                                            "max_tokens": 1}, timeout=600)
                                       for i in range(start, min(count, start + 8))))
                if (start + 8) % max(8, count // 4 // 8 * 8) == 0:
                    sizes.append(rss_mb(proc.pid))
        return sizes + [rss_mb(proc.pid)]
    with serving(hf_dir, "float32", f"--prefix_cache_mb={FLOOD_MB}") as (url, proc):
        return asyncio.run(run(url, proc))


def report(on, off):
    """Print measure()'s results with the cache (on) and without it (off): one conversation turn by turn, then those
    at once; whether every reply was the same both ways (returned too)."""
    print("one conversation: time to the first token (ms) at each turn; its prompt's tokens, those from the cache")
    print(f"  {'turn':>4} {'prompt':>6} {'cached':>6} {'cache':>7} {'none':>7} {'gain':>6}")
    for turn in range(TURNS):
        usage = on[0][2][turn]
        print(f"  {turn + 1:4} {usage['prompt_tokens']:6} {usage['prompt_tokens_details']['cached_tokens']:6} "
              f"{on[0][0][turn] * 1e3:7.0f} {off[0][0][turn] * 1e3:7.0f} {off[0][0][turn] / on[0][0][turn]:5.1f}x")
    same = on[0][1] == off[0][1] and [r[1] for r in on[1]] == [r[1] for r in off[1]]
    print(f"  every reply the same with and without the cache: {'yes' if same else 'NO'}")
    print(f"{CONVERSATIONS} other conversations at once (one system prompt): median first token (ms) per turn")
    for name, (_, together, rate, rss) in (("cache", on), ("none", off)):
        medians = [statistics.median(r[0][turn] for r in together) * 1e3 for turn in range(TURNS)]
        print(f"  {name:5} {' '.join(f'{m:6.0f}' for m in medians)}   {rate:6.1f} tokens/s   RSS {rss:.0f} MB")
    cached = [sum(r[2][turn]["prompt_tokens_details"]["cached_tokens"] for r in on[1]) for turn in range(TURNS)]
    print(f"  prompt tokens from the cache per turn, all {CONVERSATIONS}: {' '.join(f'{c:6}' for c in cached)}")
    return same


def bench_conversation(cfg, workdir):
    tokenizer = GPT2Tokenizer()
    hf_dir = os.path.join(workdir, "gpt2-shaped")
    model, dtype = gpt2_shaped(cfg, hf_dir), pick_dtype(cfg.dtype, "cpu")  # (the server's default: dtype=auto)
    print(f"model: GPT-2 architecture, {model.get_num_params() / 1e6:.1f}M parameters, random weights, {dtype}, "
          f"CPU, {torch.get_num_threads()} threads; a {SYSTEM}-token system prompt, {TURNS} turns of {USER} + "
          f"{REPLY} tokens, {THINK_S} s between turns", flush=True)
    on, off = measure(hf_dir, dtype, 1024, tokenizer), measure(hf_dir, dtype, 0, tokenizer)
    same = report(on, off)
    if cfg.flood:
        sizes = flood(cfg, workdir, cfg.flood)
        print(f"flood: {cfg.flood} distinct {FLOOD_LEN}-token prompts, a small model (2 layers, 128 wide), "
              f"--prefix_cache_mb={FLOOD_MB}: the server's RSS (MB) {' -> '.join(f'{s:.0f}' for s in sizes)}")
    return on, off, same
