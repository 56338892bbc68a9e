"""The prefix cache (machinery/generation/prefix_cache.py) in the engine: the same tokens and log-probabilities with it as
without, cached_tokens the tokens it really saved, a bounded LRU budget, salts kept apart, finished turns cached
for the next, and paused streams that give their slots up and resume as if they had been read at once."""

import collections
import concurrent.futures
import contextlib
import json
import random
import re
import socket
import time

import pytest
import torch

from machinery.generation import decode, engine, packing
from machinery.generation.prefix_cache import PrefixCache
from machinery.generation.request import Request
from test_engine import Tokens, small_model

CHUNK = 8


@pytest.fixture(scope="module")
def model():
    return packing.prepare(small_model(n_embd=32, block_size=48), "cpu", "float32")


class Counting:
    """Counts the tokens the model is run on row by row (the work the cache saves; a fixed step runs every row of
    the cache, whatever runs, and encodes no prompt)."""

    def __init__(self, runner):
        self.tokens, forward = 0, runner.model.forward

        def counted(idx, *args, **kwargs):
            self.tokens += idx.numel() if isinstance(kwargs.get("kv_cache"), decode.Rows) else 0
            return forward(idx, *args, **kwargs)
        runner.model.forward = counted
        self.restore = lambda: runner.model.__dict__.pop("forward")


def results(runner, waves):
    """Submit each wave of requests together, stepping until it is done; every request's events as
    (id, logprob, top, prompt, finish_reason), and its Generation."""
    out, generations = [], []
    for wave in waves:
        gs = [runner.submit(r) for r in wave]
        while not all(g.done for g in gs):
            runner.step()
        out += [[(t.id, t.logprob, t.top, t.prompt, t.finish_reason) for t in g] for g in gs]
        generations += gs
    return out, generations


def random_waves(seed):
    """Waves of requests whose prompts share prefixes with earlier ones, ending at chunk ends and inside chunks;
    greedy and seeded, n > 1 (one prompt several times, seeds apart), echo, logprobs, past block_size."""
    rng = random.Random(seed)
    base = [rng.randrange(70) for _ in range(48)]
    waves = []
    for _ in range(4):
        wave = []
        for _ in range(rng.randint(1, 3)):
            shared = rng.choice([CHUNK, 2 * CHUNK, 3 * CHUNK, rng.randint(1, 40)])
            prompt = base[:shared] + [rng.randrange(70) for _ in range(rng.randint(0, 12))]
            settings = dict(temperature=rng.choice([0.0, 1.0]), logprobs=rng.choice([None, 2]),
                            echo=rng.random() < 0.2, max_tokens=rng.choice([4, 30]))
            wave += [Request(prompt, seed=100 + i, **settings) for i in range(rng.choice([1, 1, 3]))]
        waves.append(wave)
    return waves


@pytest.mark.parametrize("seed, fixed", [(0, False), (1, False), (2, True)])
def test_cache_on_and_off_give_the_same_events_and_cached_tokens_is_the_work_saved(model, seed, fixed):
    """fixed: CUDA's fixed-shape decoding step (machinery/generation/decode.py), run here on the CPU."""
    waves = random_waves(seed)
    off = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, fixed=fixed)
    on = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=1, fixed=fixed)
    counts = []
    for runner in (off, on):
        counting = Counting(runner)
        expected_or_got, generations = results(runner, waves)
        counting.restore()
        counts.append((counting.tokens, sum(g.cached_tokens for g in generations)))
        counts[-1] += (expected_or_got,)
    assert counts[1][2] == counts[0][2]  # every event: token, logprob, alternatives, echo, finish reason
    assert counts[0][1] == 0 and counts[1][1] > 0
    assert counts[0][0] - counts[1][0] == counts[1][1]  # the model ran on exactly cached_tokens fewer tokens


def test_cached_tokens_are_the_whole_chunks_shared_but_the_one_ending_the_prompt(model):
    runner = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=1)
    a = list(range(20))

    def cached(prompt, salt=None):
        _, (g,) = results(runner, [[Request(prompt, max_tokens=1, cache_salt=salt)]])
        return g.cached_tokens
    assert cached(a) == 0  # chunks 0-7 and 8-15 kept; 16-19 is not a whole chunk
    assert cached(a[:13] + [60] * 17) == 8  # shares 13 tokens: the first chunk
    assert cached(a) == 16
    assert cached(a[:16]) == 8  # its last chunk is encoded again: its logits start the reply
    assert cached(a, salt="tenant") == 0 and cached(a, salt="tenant") == 16 and cached(a, salt="other") == 0


def test_choices_of_one_request_encode_their_shared_prompt_once(model):
    runner = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=1)
    prompt = list(range(3 * CHUNK + 5))
    counting = Counting(runner)
    _, gs = results(runner, [[Request(prompt, max_tokens=3, seed=i) for i in range(4)]])
    decoded = sum(g.completion_tokens - 1 for g in gs)
    assert counting.tokens - decoded == len(prompt) + 3 * 5  # the others' prompt: their last 5 tokens only
    assert [g.cached_tokens for g in gs] == [0, 24, 24, 24]


def test_a_finished_turn_is_cached_when_idle_and_the_next_turn_encodes_only_what_is_new(model):
    def conversation(runner):
        turn1 = list(range(30))
        (events,), _ = results(runner, [[Request(turn1, max_tokens=10, temperature=0)]])
        while runner.cache_tail():  # (serve.py's engine does this in its thread when it is idle)
            pass
        turn2 = turn1 + [t[0] for t in events] + [7, 7, 7]
        return results(runner, [[Request(turn2, max_tokens=10, temperature=0, logprobs=1)]])
    off = engine.Engine(model, Tokens(70), max_batch=2, prefill_chunk=CHUNK)
    on = engine.Engine(model, Tokens(70), max_batch=2, prefill_chunk=CHUNK, prefix_cache_mb=1)
    (expected,), _ = conversation(off)
    (got,), (g,) = conversation(on)
    assert got == expected
    assert g.cached_tokens == 40  # 30 + 10 reply tokens: chunks up to 40 (the reply's ones encoded as a prompt)


def slots_of(n_layer=2, rows=2):
    from model import GPTConfig
    return decode.Slots(GPTConfig(block_size=32, vocab_size=70, n_layer=n_layer, n_head=2, n_embd=32), rows,
                        torch.float32, "cpu")


def test_the_cache_holds_its_budget_evicting_the_least_recently_used_chunks_first():
    slots = slots_of()
    for k in slots.k + slots.v:
        k.normal_()
    block = 2 * 2 * 2 * CHUNK * 16 * 4  # k and v, 2 layers, 2 heads, a chunk, head size 16, float32
    cache = PrefixCache(slots, CHUNK, 5 * block / 2**20)
    assert cache.blocks == 5 and cache.block_bytes == block
    a, b, c = list(range(16)), list(range(20, 36)), list(range(40, 56))
    for ids in (a, b):
        cache.store(None, ids[:8], 0)
        cache.store(None, ids, 0)
    assert cache.take(None, a, 0, 16, 1) == 16  # a used last: b is the least recently used
    cache.store(None, c[:8], 0)
    cache.store(None, c, 0)  # a sixth block: b's last chunk goes (the least recently used leaf)
    assert cache.cached(None, a, 16) == 16 and cache.cached(None, b, 16) == 8 and cache.cached(None, c, 16) == 16
    assert torch.equal(slots.k[1][1, :, :16], slots.k[1][0, :, :16])  # what was taken is what was stored
    for i in range(100):  # a flood of distinct prompts
        cache.store(None, [60 + i % 10, i // 10] + list(range(6)), 0)
    stats = cache.stats()
    assert stats["bytes_held"] == stats["bytes_budget"] == 5 * block and stats["entries"] == 5
    assert stats["evictions"] == 1 + 100 and cache.cached(None, a, 16) == 0


def test_a_paused_row_parks_in_the_cache_and_comes_back_exactly():
    slots = slots_of()
    for k in slots.k + slots.v:
        k.normal_()
    cache = PrefixCache(slots, CHUNK, 3 * 2 * 2 * 2 * CHUNK * 16 * 4 / 2**20)
    assert cache.park("row", 0, 19)  # 3 blocks
    assert not cache.park("another", 1, 1)  # parked blocks are never evicted
    cache.unpark("row", 1)
    assert torch.equal(slots.v[0][1, :, :19], slots.v[0][0, :, :19])
    assert not torch.equal(slots.v[0][1, :, :20], slots.v[0][0, :, :20])
    assert cache.stats()["bytes_held"] == 0


def test_with_16_unread_streams_of_8_choices_a_new_request_completes_and_the_streams_resume_as_if_read(model):
    """16 streams of n=8 that nobody reads (max_backlog 2, as serve.py's 16) on an engine of 4 slots (serve.py has
    32 for 128 such rows: the same shortage; without parking the new request would wait stall_timeout, 60 s):
    each runs until paused, parks, and gives its slot on."""
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, 70, (10,), generator=g).tolist(), max_tokens=6, seed=10 * s + i)
                for s in range(16) for i in range(8)]
    runner = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=1)  # 512 blocks
    runner.start()
    try:
        unread = [runner.submit(r, max_backlog=2) for r in requests]  # 128 rows parked in 2 blocks each
        new = runner.submit(Request([1, 2, 3], max_tokens=5))
        last = None
        while last is None or not last.finish_reason:
            last = new.next_event(timeout=5)
            assert last is not None, "the new request waited more than 5 s"
        texts = [[t.id for t in gen] for gen in unread]  # now they are read
    finally:
        runner.stop()
    assert runner.cache.stats()["bytes_held"] < runner.cache.stats()["bytes_budget"]
    off = engine.Engine(model, Tokens(70), max_batch=32, prefill_chunk=CHUNK)
    assert texts == [[t.id for t in gen] for gen in results_of(off, requests)]


def test_rows_that_run_long_share_the_slots_in_turn_and_a_new_request_joins_within_a_few_quanta(model, monkeypatch):
    """8 requests of 12 tokens, all read, on 4 slots, then a new one: the rows that have run a quantum (QUANTUM
    tokens, 4 here: quick) park and wait in line behind it, so it is done within 3 quanta of steps (without the
    rule, 24 steps: behind two waves of 12 tokens); every request's tokens and log-probabilities are the same as
    without the cache (each row computed as if alone)."""
    monkeypatch.setattr(engine, "QUANTUM", 4)
    rng = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, 70, (5,), generator=rng).tolist(), max_tokens=12, seed=s,
                        temperature=1.0, logprobs=2) for s in range(8)]
    requests.append(Request([1, 2, 3], max_tokens=2, seed=9))
    runner = engine.Engine(model, Tokens(70), max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=1)
    long = [runner.submit(r) for r in requests[:-1]]
    for _ in range(2):
        runner.step()
    new, steps = runner.submit(requests[-1]), 0
    while not new.done:
        runner.step()
        steps += 1
    assert steps <= 3 * 4
    while not all(g.done for g in long):
        runner.step()
    off = engine.Engine(model, Tokens(70), max_batch=32, prefill_chunk=CHUNK)
    assert [[(t.id, t.logprob, t.top) for t in g] for g in long + [new]] == \
        [[(t.id, t.logprob, t.top) for t in g] for g in results_of(off, requests)]


def results_of(runner, requests):
    gs = [runner.submit(r) for r in requests]
    while not all(g.done for g in gs):
        runner.step()
    return gs


def test_the_api_reports_cached_tokens_keeps_salts_apart_and_serves_the_cache_statistics(tmp_path_factory):
    """serve.py: usage.prompt_tokens_details.cached_tokens in completions and chat (streamed usage too), the same
    text with and without a hit, cache_salt, GET /metrics."""
    import httpx
    from test_serve import ckpt_dir, serving

    with serving(ckpt_dir.__wrapped__(tmp_path_factory), "--prefill_chunk=8") as server:
        def complete(route="completions", **body):
            base = {"prompt": "ROMEO: what light through yonder window", "max_tokens": 5, "temperature": 0}
            if route == "chat/completions":
                base = {"messages": [{"role": "user", "content": base["prompt"]}], "max_tokens": 5, "temperature": 0}
            answer = httpx.post(f"{server.url}/v1/{route}", json=base | body, timeout=30)
            return answer.status_code, answer.json()
        _, first = complete()
        _, again = complete()
        assert first["usage"]["prompt_tokens"] == 39 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # whole chunks but the last
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert complete(cache_salt="tenant")[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert complete(cache_salt=5)[0] == 400
        stream = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "prompt": "ROMEO: what light through yonder window", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        last = [line for line in stream.text.splitlines() if line.startswith("data: {")][-1]
        assert '"prompt_tokens_details": {"cached_tokens": 32}' in last
        _, chat = complete("chat/completions")
        _, chat_again = complete("chat/completions")
        assert chat_again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            (chat["usage"]["prompt_tokens"] - 1) // 8 * 8 > 0
        assert chat_again["choices"][0]["message"] == chat["choices"][0]["message"]
        metrics = dict(line.split() for line in httpx.get(f"{server.url}/metrics").text.splitlines())
        assert int(metrics["prefix_cache_hits"]) == 3 and int(metrics["prefix_cache_tokens_saved"]) == 32 * 2 + \
            chat_again["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_through_sockets_16_unread_streams_of_8_choices_let_a_new_request_complete_and_resume_as_if_read(
        tmp_path_factory, monkeypatch):
    """serve.py's connections (serve.bounded_http) hold a bounded number of bytes that their client has not read (not
    the MBs that Linux would let a kernel send buffer grow to): 16 clients each send a streamed request of n=8 and
    read nothing, their choices pause and park, and a new request completes within 5 s; read at last, each stream
    is what the request gives read at once (texts and log-probabilities). Quick: the clients' kernel receive buffers
    are small, logprobs make the chunks large, and a stream pauses 2 events behind (as in the engine's test), so that
    few tokens fill them."""
    import httpx

    from machinery.serving import openai_api
    from test_serve import ckpt_dir, serving

    monkeypatch.setattr(openai_api, "STREAM_BACKLOG", 2)
    body = dict(prompt="KING", n=8, max_tokens=40, seed=7, logprobs=5)
    with serving(ckpt_dir.__wrapped__(tmp_path_factory)) as server, contextlib.ExitStack() as clients:
        unread = [clients.enter_context(open_stream(server.url, body)) for _ in range(16)]
        deadline = time.time() + 10
        while sum(server.engine.load) < 16 * 8 and time.time() < deadline:  # every choice submitted
            time.sleep(0.01)
        new = httpx.post(f"{server.url}/v1/completions", json=dict(prompt="ROMEO:", max_tokens=5), timeout=5)
        assert new.status_code == 200 and new.json()["choices"][0]["finish_reason"] == "length"
        assert sum(server.engine.load) == 16 * 8  # none has ended: paused while their bytes wait unread
        expected = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"]
        with concurrent.futures.ThreadPoolExecutor(len(unread)) as readers:  # (all at once: they decode together)
            streams = list(readers.map(read_stream, unread))
        assert streams == [[(c["text"], c["logprobs"]) for c in expected]] * len(unread)


@contextlib.contextmanager
def open_stream(url, body):
    """A socket that has sent body as a streamed completions request, and reads nothing yet; its kernel receive
    buffer small (4 KiB: the TCP window it offers)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting)
    sock.settimeout(30)
    with sock:
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        data = json.dumps(body | {"stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        yield sock


def read_stream(sock):
    """Read a streamed response to its [DONE]; each choice's (text, logprobs) as a whole response gives them."""
    raw = b""
    while b"data: [DONE]" not in raw[-100:]:
        data = sock.recv(1 << 16)  # (the socket's timeout bounds each wait)
        assert data, f"the stream ended before [DONE]: {raw[-200:]!r}"
        raw += data
    choices = collections.defaultdict(lambda: ["", collections.defaultdict(list)])
    for event in re.findall(rb"^data: (\{.*\})$", raw, re.MULTILINE):  # (each event is a chunk of its own)
        for c in json.loads(event)["choices"]:
            choices[c["index"]][0] += c["text"]
            for key, values in (c["logprobs"] or {}).items():
                choices[c["index"]][1][key] += values
    return [(text, dict(logprobs)) for _, (text, logprobs) in sorted(choices.items())]


def test_sample_py_chat_encodes_only_each_turns_new_message_and_replies_as_without_the_cache():
    """talk.converse (sample.py --chat): after each reply the conversation is cached, so the next turn takes it
    (whole chunks) from the cache; the replies are those of an engine without the cache."""
    import io
    import types

    from machinery.data import chat
    from machinery.generation import talk

    tok = chat.tokenizer()
    model = packing.prepare(small_model(n_embd=32, block_size=256, vocab_size=tok.vocab_size), "cpu", "float32")
    cfg = types.SimpleNamespace(max_new_tokens=12, temperature=0.0, top_k=None, top_p=None, seed=1, stop=None,
                                stream=False, system="You answer in the manner of a Shakespearean clown. " * 4,
                                name="tiny")

    def talk_with(runner):
        lines = iter(["Good morrow, fool.", "What news from the court?", "And the king?", ""])
        submitted, submit = [], runner.submit
        runner.submit = lambda request, **kw: submitted.append(submit(request, **kw)) or submitted[-1]
        out = io.StringIO()
        talk.converse(cfg, runner, tok, read=lambda shown: next(lines), out=out)
        return out.getvalue(), submitted
    expected, _ = talk_with(engine.Engine(model, tok, max_batch=1, prefill_chunk=CHUNK))
    got, turns = talk_with(engine.Engine(model, tok, max_batch=1, prefill_chunk=CHUNK, prefix_cache_mb=4))
    assert got == expected
    for before, turn in zip(turns, turns[1:]):  # what it shares with the turn before (prompt and reply), whole chunks
        prompt = turn.ids[:turn.prompt_tokens]  # (a reply's text encoded again may split otherwise than it was drawn)
        shared = next(i for i, (a, b) in enumerate(zip(before.ids + [None], prompt + [None])) if a != b)
        assert turn.cached_tokens == min(shared // CHUNK, (turn.prompt_tokens - 1) // CHUNK) * CHUNK > 0
    # the reply's chunks too (encoded after it), not only the prompt's (encoded with it)
    assert any(turn.cached_tokens > before.prompt_tokens // CHUNK * CHUNK for before, turn in zip(turns, turns[1:]))


@pytest.fixture
def quick_conversation_mode(monkeypatch):
    """bench.py --mode=conversation made quick: a tiny model, a 100-token system prompt, 88-token user messages and
    12-token replies, 64-token prompts in the flood (a chunk each); serve.py's server (its build() and app) in a
    thread of this process, not a process (start_server has tests of its own), its RSS this process's; the pause
    between turns lasts until the engine has cached the finished turn (not THINK_S: so that a loaded machine changes
    no figure).
    run(turns, conversations, *settings): bench.main's result, and (engine, Generations submitted in order) of each
    server."""
    import asyncio
    import os
    import types

    import bench
    from benchmarks import conversation
    from test_serve import serving

    for name, value in dict(SYSTEM=100, USER=88, REPLY=12, THINK_S=0, FLOOD_LEN=64).items():
        monkeypatch.setattr(conversation, name, value)
    servers = []

    @contextlib.contextmanager
    def in_thread(hf_dir, dtype, *settings):
        with serving(hf_dir, f"--init_from={hf_dir}", f"--dtype={dtype}", *settings) as server:
            submitted, submit = [], server.engine.submit
            server.engine.submit = lambda request, **kw: submitted.append(submit(request, **kw)) or submitted[-1]
            servers.append((server.engine, submitted))
            yield f"{server.url}/v1/completions", types.SimpleNamespace(pid=os.getpid())

    async def think():
        while servers[-1][0].tails:  # (a finished turn is in tails before its client has its last event)
            await asyncio.sleep(0.005)
    monkeypatch.setattr(conversation, "serving", in_thread)
    monkeypatch.setattr(conversation, "think", think)

    def run(turns, conversations, *settings):
        monkeypatch.setattr(conversation, "TURNS", turns)
        monkeypatch.setattr(conversation, "CONVERSATIONS", conversations)
        threads = torch.get_num_threads()
        try:
            return bench.main(["--mode=conversation", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=512",
                               "--device=cpu", "--dtype=float32", "--threads=1", *settings]), servers
        finally:
            torch.set_num_threads(threads)
    return run


def chunks_shared(generations, chunk):
    """Each generation's prompt tokens that a prefix cache of whole chunks holds when it comes: the whole chunks it
    shares with an earlier generation's tokens (prompt and reply), but the chunk that ends its prompt."""
    expected = []
    for i, g in enumerate(generations):
        prompt = g.ids[:g.prompt_tokens]
        shared = max((next(j for j, (a, b) in enumerate(zip(h.ids + [None], prompt + [None])) if a != b)
                      for h in generations[:i]), default=0)
        expected.append(min(shared // chunk, (len(prompt) - 1) // chunk) * chunk)
    return expected


def test_conversation_mode_prints_every_row_and_the_cached_tokens_of_whole_shared_chunks(quick_conversation_mode,
                                                                                          capsys):
    """Its quick form end to end: a row per turn, the 8 at once with and without the cache, the flood's RSS before and
    after each 8 prompts; every reply the same (and NO where the lone conversation's or one of the 8's differs); the
    cached tokens printed are the chunk arithmetic's over what the server was sent (the 8 share only the system
    prompt with the conversation before them: 1 chunk of 64 each)."""
    from benchmarks import conversation

    (on, off, same), servers = quick_conversation_mode(2, 8, "--flood=16")
    out = capsys.readouterr().out
    (engine_on, sent), (engine_off, _), _ = servers
    assert engine_on.cache is not None and engine_off.cache is None and engine_on.prefill_chunk == 64
    rows = re.findall(r"^ +(\d) +(\d+) +(\d+) +\d+ +\d+ +[\d.]+x$", out, re.M)
    lone, together = sent[1:3], sent[3:]  # (sent[0]: the warm-up)
    assert [(int(turn), int(prompt)) for turn, prompt, _ in rows] == [(t, g.prompt_tokens) for t, g in
                                                                      enumerate(lone, 1)]
    expected = chunks_shared(sent, 64)
    assert [int(cached) for _, _, cached in rows] == expected[1:3] and expected[1] == 0
    assert expected[2] > 188 // 64 * 64  # a chunk of turn 1's prompt and reply, cached while the server was idle
    assert "every reply the same with and without the cache: yes" in out and same
    medians = re.findall(r"^  (cache|none ) +(?:\d+ +){2} *[\d.]+ tokens/s +RSS \d+ MB$", out, re.M)
    assert "8 other conversations at once" in out and medians == ["cache", "none "]
    by_conversation = collections.defaultdict(list)  # (each one's user messages: random, its own)
    for g, cached in zip(together, expected[3:]):
        by_conversation[tuple(g.ids[100:188])].append(cached)
    per_turn = [sum(turns) for turns in zip(*by_conversation.values())]
    assert len(by_conversation) == 8 and per_turn[0] == 8 * 64
    assert re.search(r"^  prompt tokens from the cache per turn, all 8: +" + " +".join(map(str, per_turn)) + "$",
                     out, re.M)
    flood = re.search(r"^flood: 16 distinct 64-token prompts, .*--prefix_cache_mb=64: the server's RSS \(MB\) (.+)$",
                      out, re.M)
    assert len(flood.group(1).split(" -> ")) == 1 + 2 + 1  # before, after each 8 (a quarter is less), at the end
    for which in (None, 5):
        assert not conversation.report(reply_changed(on, which), off)
        assert "every reply the same with and without the cache: NO" in capsys.readouterr().out


def reply_changed(on, which):
    """measure()'s results with one reply changed: the lone conversation's last (which None) or the last of the
    which-th conversation at once."""
    def changed(c):
        return c[0], c[1][:-1] + [c[1][-1] + "!"], c[2]
    alone, together, rate, rss = on
    if which is None:
        return changed(alone), together, rate, rss
    return alone, [changed(c) if i == which else c for i, c in enumerate(together)], rate, rss


def test_conversation_mode_says_so_when_a_reply_it_is_sent_differs_with_the_cache(quick_conversation_mode, capsys,
                                                                                  monkeypatch):
    """The reply that the client of the cache's server reads in the conversations at once (here one) made different:
    NO, end to end."""
    from benchmarks import conversation

    calls, first_token = [], conversation.first_token

    async def altered(http, url, prompt):
        first, text, usage = await first_token(http, url, prompt)
        calls.append(url)  # the cache's server's warm-up, its lone turn, then the one at once: changed
        return first, text + ("!" if len(calls) == 3 else ""), usage
    monkeypatch.setattr(conversation, "first_token", altered)
    (on, off, same), _ = quick_conversation_mode(1, 1, "--flood=0")
    assert "every reply the same with and without the cache: NO" in capsys.readouterr().out and not same
    assert on[0][1] == off[0][1] and on[1][0][1] != off[1][0][1]
