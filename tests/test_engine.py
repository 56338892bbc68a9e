"""The generation engine (machinery/generation/engine.py): streamed text, stop texts, and a request's tokens that do not
depend on what else runs."""

import contextlib
import copy
import types

import pytest
import torch
import torch.nn.functional as F

from machinery.generation import engine, packing
from machinery.generation.request import QueueFull, Request, StreamText
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from test_generate import CUDA_BACKENDS, cuda_attention_stand_ins


# ---------------------------------------------------------------------- StreamText, the streaming logic


def feed(text_stream, tokenizer, ids):
    pieces = [text_stream.add(i) for i in ids]
    return pieces, pieces + [text_stream.finish()]


def test_streaming_holds_back_what_may_become_the_stop_text():
    tokenizer = CharTokenizer(sorted(set("Hello ROMEX then ROMEO: more")))
    stream = StreamText(tokenizer, stop=("ROMEO:",))
    pieces, everything = feed(stream, tokenizer, tokenizer.encode("Hello ROMEX then ROMEO: more"))
    assert "".join(everything) == stream.text == "Hello ROMEX then "
    assert stream.done
    assert "".join(pieces[:7]) == "Hello "  # printed as it comes, up to the R that may begin ROMEO:
    assert "".join(pieces[:11]) == "Hello ROMEX"  # ROMEX is not ROMEO: out it goes
    assert "".join(pieces[:20]) == "Hello ROMEX then "  # ROM is held back...
    assert all(p == "" for p in pieces[20:])  # ...and never printed: it was the stop text


def test_streaming_holds_back_split_utf8_characters_and_stops_at_a_stop_token():
    tokenizer = GPT2Tokenizer()
    text = "Fair 你好世界, café — ok"
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))  # split characters
    stream = StreamText(tokenizer, stop_tokens=[tokenizer.eot_token])
    pieces, everything = feed(stream, tokenizer, ids + [tokenizer.eot_token] + tokenizer.encode(" more"))
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == "".join(everything) == stream.text == text




def test_several_stop_texts_cut_at_the_first_to_appear_and_hold_back_the_longest_possible_start():
    tokenizer = CharTokenizer(sorted(set("abc xyz. END")))
    stream = StreamText(tokenizer, stop=("END", "xyz."))
    pieces, everything = feed(stream, tokenizer, tokenizer.encode("abc xyz abc xyz. END"))
    assert stream.done and stream.text == "abc xyz abc "  # xyz. comes first, END never does
    assert "".join(pieces[:4]) == "abc "  # ...
    assert "".join(pieces[:7]) == "abc "  # "xyz" may begin "xyz.": held back
    assert "".join(pieces[:8]) == "abc xyz "  # not followed by ".": out it goes


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_whole_decode_cut_at_the_first_stop_text_and_held_back_no_longer_than_needed(seed):
    """Random token sequences (GPT-2 tokens of mixed scripts, some splitting characters, and random ids), stop
    texts taken from the sequence's own text: what is streamed is at every token a prefix of the final text, all
    of it in the end; the final text is the whole sequence decoded at once, cut where a stop text first appears;
    and after each token everything but an incomplete character and a possible start of a stop text is out."""
    tokenizer = GPT2Tokenizer()
    g = torch.Generator().manual_seed(seed)
    words = tokenizer.encode("Fair 你好世界, café — ok 🙂 ROMEO: what light through yonder ")
    assert any(tokenizer.decode(words[:n]).endswith("\ufffd") for n in range(len(words)))  # split characters
    ids = []
    while len(ids) < 300:  # runs of the text's tokens (characters split and completed), now and then a random id
        i, n = torch.randint(0, len(words), (2,), generator=g).tolist()
        ids += words[i:i + n % 8 + 1] + ([int(torch.randint(0, 50256, (1,), generator=g))] if n % 5 == 0 else [])
    whole = tokenizer.decode(ids)
    start = int(torch.randint(100, len(whole) - 20, (1,), generator=g))
    stop = (whole[start:start + 5], "never in it \u2603\u2603") if seed % 2 else ()
    stream = StreamText(tokenizer, stop=stop)
    final = whole[:min([whole.find(t) for t in stop if t in whole], default=len(whole))]
    out = ""
    for k in range(len(ids)):
        out += stream.add(ids[k])
        assert final.startswith(out)
        if stream.done:
            break
        so_far = tokenizer.decode(ids[:k + 1]).rstrip("\ufffd")
        assert len(out) >= len(so_far) - max([len(t) - 1 for t in stop], default=0)
    out += stream.finish()
    assert out == stream.text == final and stream.done


# ---------------------------------------------------------------------- the engine


def small_model(n_embd=64, n_layer=2, vocab_size=70, block_size=32, seed=0):
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_embd=n_embd))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)  # peaked distributions: varied text
    return model


class Tokens:
    """A tokenizer of ids only (each id its own character), for engines fed token ids."""

    kind, eot_token = "ids", None

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def decode(self, ids):
        return "".join(chr(0x4E00 + i) for i in ids)


def run(runner, requests):
    """Submit requests together, step until all are done; each one's generated token ids."""
    generations = [runner.submit(r) for r in requests]
    while not all(g.done for g in generations):
        runner.step()
    return [[t.id for t in g if t.id is not None and not t.prompt] for g in generations]


# oneDNN itself (not the engine's choice) refuses to pack bfloat16 on a CPU without AVX-512 (or AVX-NE-CONVERT)
ONEDNN_BF16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                 reason="oneDNN cannot pack bfloat16 on this CPU (it needs AVX-512)")


def scored(runner, requests):
    """Submit requests together, step until all are done; each one's (token id, log-probability) pairs."""
    generations = [runner.submit(r) for r in requests]
    while not all(g.done for g in generations):
        runner.step()
    return [[(t.id, t.logprob) for t in g if t.id is not None and not t.prompt] for g in generations]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_requests_scores_do_not_depend_on_how_many_rows_decode_with_it(dtype):
    """40 seeded requests decoding together (more rows than oneDNN computes with one algorithm on a CPU with AMX:
    its bfloat16 products of more than 32 rows of GPT-2's width block otherwise, and round otherwise; there,
    without the engine's calibrate, 11 of these 40 requests scored differently; with AVX-512 BF16 and no AMX,
    one did while calibrate probed with one random row): every request's tokens and log-probabilities, bit
    for bit, are the ones it gets alone."""
    model = packing.prepare(small_model(n_embd=768, n_layer=1, vocab_size=300, block_size=64), "cpu", dtype)
    runner = engine.Engine(model, Tokens(300), max_batch=40)
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(0, 300, (3 + i % 9,), generator=g).tolist(), max_tokens=6,
                        temperature=1.0, seed=i, logprobs=0) for i in range(40)]
    together = scored(runner, requests)
    assert [scored(runner, [r])[0] for r in requests] == together


class Rounding:
    """A stand-in for oneDNN's packed product that rounds as a CPU whose kernels change with the number of rows
    might: a lone row unpadded, and passes of more than `most` rows, get a result off by one part in 2**-10.
    Otherwise each row's product alone, in float64, rounded: each row's own whatever the rows beside it, as this
    machine's own kernels need not be (on the H200's host, torch 2.11, a lone float32 row of this model rounded
    otherwise than 4 rows)."""

    def __init__(self, most, lone_differs):
        self.most, self.lone_differs, self.rows = most, lone_differs, []

    def __call__(self, x, packed, bias, *args):
        rows = x.shape[:-1].numel()
        self.rows.append(rows)
        weight, bias = packed.to_dense().double(), None if bias is None else bias.double()
        y = torch.cat([F.linear(row, weight, bias) for row in x.double().reshape(rows, -1).split(1)])
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y * (1 + 2 ** -10) if rows > self.most or rows == 1 and self.lone_differs else y


@pytest.mark.parametrize("lone_differs", [False, True])
def test_decoding_passes_hold_only_as_many_rows_as_the_kernels_compute_as_each_row_alone(monkeypatch, lone_differs):
    """Where a product of more than 5 rows rounds otherwise (and a lone row unpadded, or not), calibrate finds
    it, so 12 requests decode in passes of at most 5 rows (a lone row padded to MIN_ROWS where it must be), and
    each request scores as alone; a pass of all 12 at once scores otherwise."""
    rounding = Rounding(5, lone_differs)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", rounding)
    model = packing.prepare(small_model(), "cpu", "float32")
    runner = engine.Engine(model, Tokens(70), max_batch=12)
    assert runner.pass_rows == 5
    assert {m.min_rows for m in model.modules() if isinstance(m, packing.PackedLinear)} == \
        {packing.PackedLinear.MIN_ROWS if lone_differs else 1}
    requests = [Request([1 + i, 2, 3], max_tokens=4, temperature=1.0, seed=i, logprobs=0) for i in range(12)]
    rounding.rows.clear()
    together = scored(runner, requests)
    assert max(rounding.rows) == 5 and (1 not in rounding.rows) == lone_differs
    assert [scored(runner, [r])[0] for r in requests] == together
    runner.pass_rows = 12  # as the engine ran before calibrate: the same requests then score otherwise
    assert scored(runner, requests) != together


def in_lanes(terms):
    """The sums of terms' last dimension as a vector kernel makes them: 16 float32 lanes, each adding its terms in
    turn (one rounding a step, as a loop of FMAs), then the lanes."""
    lanes = terms.unflatten(-1, (-1, 16))
    total = torch.zeros(lanes.shape[:-2] + (16,))
    for step in lanes.unbind(-2):
        total = total + step
    return total.sum(-1)


class SumsInBlocks(packing.RowsLinear):
    """A bfloat16 layer whose products of more than 5 rows sum the two halves of the inputs apart, then add them
    (another blocking), where fewer rows sum them whole; both in_lanes, both rounded to bfloat16: they differ only
    where float32's last bits change a rounding."""

    def product(self, x):
        terms = x.float()[:, None, :] * self.weight.float()
        if len(x) <= 5:
            y = in_lanes(terms)
        else:
            half = terms.shape[-1] // 2
            y = in_lanes(terms[..., :half]) + in_lanes(terms[..., half:])
        return (y + self.bias.float()).to(torch.bfloat16)


def test_calibrate_sees_another_blocking_that_random_rows_hardly_show():
    """SumsInBlocks's products of 6 rows round otherwise than each row alone in under 0.05 % of the outputs of
    random rows (a few of 24,576: one random row, as calibrate probed before, would most often show none), and
    in over 1 % of those of calibrate's probe rows (_probe_rows); calibrate finds that a pass may hold 5 rows."""
    torch.manual_seed(0)
    layer = SumsInBlocks(torch.nn.Linear(1024, 256).to(torch.bfloat16))
    layer.min_rows = 1

    def differing(rows):  # outputs of a product of 6 of rows unlike the same rows' alone
        with torch.no_grad():
            return sum((layer(six) != torch.cat([layer(row) for row in six.split(1)])).sum().item()
                       for six in rows.split(6))

    random_rows, probes = torch.randn(96, 1024).to(torch.bfloat16), packing._probe_rows(layer).repeat(3, 1)
    assert len(probes) == 6 and differing(random_rows) < 0.0005 * 96 * 256 and differing(probes) > 0.01 * 6 * 256
    assert packing.calibrate(torch.nn.Sequential(layer), 8) == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_requests_tokens_do_not_depend_on_what_else_runs(dtype):
    """8 seeded requests of different prompt lengths together give each the tokens it gets alone. The model
    is GPT-2's width (768, its MLP 3072 wide: oneDNN computes a single row of 3072 -> 768 with another
    algorithm than two or more) in 1 layer; sampling at temperature 1 makes any difference in the logits
    likely to change a token. bfloat16 runs oneDNN's packed product where the CPU computes bfloat16
    natively, PyTorch's own kernel elsewhere (can_pack): each CPU kind checks its own path."""
    model = packing.prepare(small_model(n_embd=768, n_layer=1, vocab_size=300, block_size=64), "cpu", dtype)
    runner = engine.Engine(model, Tokens(300))
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(0, 300, (3 + 2 * i,), generator=g).tolist(), max_tokens=12,
                        temperature=1.0, seed=i) for i in range(8)]
    together = run(runner, requests)
    assert [run(runner, [r])[0] for r in requests] == together
    assert all(len(t) == 12 for t in together) and len({tuple(t) for t in together}) == 8


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_greedy_tokens_are_model_generates_cached_uncached_and_past_block_size(dtype):
    """Greedy decoding through the engine gives model.generate's tokens: with the cache, without it
    (use_cache=False: every window encoded again, as nanoGPT), and past block_size (the window slides).
    float16 too: the engine converts the weights (neither side packs them) and attends in float32."""
    model = small_model(block_size=16).to(getattr(torch, dtype))
    prompt = [1, 5, 9, 2, 7]
    expected = model.generate(torch.tensor([prompt]), 30, temperature=0, use_cache=False)[0, 5:].tolist()
    prepared = packing.prepare(small_model(block_size=16), "cpu", dtype)
    for use_cache in (True, False):
        runner = engine.Engine(prepared, Tokens(70), use_cache=use_cache)
        assert run(runner, [Request(prompt, max_tokens=30, temperature=0)]) == [expected]


def test_prompts_encoded_in_chunks_give_the_uncached_tokens_and_scores():
    """Chunked prefill: whatever the chunk (1 token, 3, more than the prompt), greedy decoding gives the uncached
    model's tokens, and echo scores every prompt token as the model's plain forward does (across chunk ends)."""
    model = small_model(block_size=32)
    prompt = [(7 * i + 3) % 70 for i in range(20)]
    expected = model.generate(torch.tensor([prompt]), 20, temperature=0, use_cache=False)[0, 20:].tolist()
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt]), every_position=True)
    scores = torch.log_softmax(logits[0], -1)
    for chunk in (1, 3, 64):
        runner = engine.Engine(packing.prepare(small_model(block_size=32), "cpu", "float32"), Tokens(70),
                               prefill_chunk=chunk)
        assert run(runner, [Request(prompt, max_tokens=20, temperature=0)]) == [expected]
        g = runner.submit(Request(prompt, max_tokens=0, logprobs=1, echo=True))
        while not g.done:
            runner.step()
        events = list(g)[:-1]
        assert [e.id for e in events] == prompt and events[0].logprob is None
        assert [e.logprob for e in events[1:]] == pytest.approx([scores[j - 1, prompt[j]].item()
                                                                 for j in range(1, 20)], abs=1e-5)


def test_a_long_prompt_joins_in_chunks_while_the_running_rows_get_a_token_at_every_step():
    runner = engine.Engine(packing.prepare(small_model(block_size=64), "cpu", "float32"), Tokens(70),
                           prefill_chunk=4)
    running = [runner.submit(Request([i + 1, 2], max_tokens=40, temperature=0)) for i in range(3)]
    runner.step()
    long = runner.submit(Request(list(range(1, 31)), max_tokens=5, temperature=0))
    for _ in range(8):  # 30 prompt tokens, 4 a step: 8 steps
        before = [g.completion_tokens for g in running] + [long.length]
        runner.step()
        assert [g.completion_tokens for g in running] == [n + 1 for n in before[:3]]  # nobody waits for the prompt
        assert 0 < long.length - before[3] <= 4
    assert long.length == 30 and long.completion_tokens == 1  # its first token, sampled after its last chunk


def test_a_request_cancelled_while_waiting_never_runs_and_slots_are_reused():
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2)
    seen = []
    forward = runner.model.forward
    runner.model.forward = lambda idx, *a, **k: seen.append(idx.tolist()) or forward(idx, *a, **k)
    first = [runner.submit(Request([1, 2, 3], max_tokens=3)) for _ in range(2)]
    waiting = runner.submit(Request([9, 9, 9, 9], max_tokens=3))
    runner.step()
    waiting.cancel()
    while not all(g.done for g in first):
        runner.step()
    runner.step()
    assert waiting.finish_reason == "abort" and waiting.slot is None and [9, 9, 9, 9] not in [r for b in seen for r in b]
    assert sorted(runner.slots.free) == [0, 1] and runner.load == (0, 0)
    assert run(runner, [Request([4, 5], max_tokens=3) for _ in range(5)])  # 5 requests through 2 rows


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fixed_shape_decoding_gives_the_uncached_tokens_and_each_requests_own(dtype):
    """The fixed step (CUDA's way, run here on the CPU): every row of the cache decodes at every step, attending
    over the whole cache through a mask. Greedy tokens are the uncached model's, past block_size too; seeded
    requests of different lengths give together what each gives alone (the shapes never change)."""
    prompt = [1, 5, 9, 2, 7]
    model = small_model(block_size=16).to(getattr(torch, dtype))
    expected = model.generate(torch.tensor([prompt]), 30, temperature=0, use_cache=False)[0, 5:].tolist()
    runner = engine.Engine(packing.prepare(small_model(block_size=16), "cpu", dtype), Tokens(70), max_batch=8,
                           fixed=True)
    assert runner.slots.length % 64 == 0 and runner.model_runner.fixed_step is not None
    assert run(runner, [Request(prompt, max_tokens=30, temperature=0)]) == [expected]
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(0, 70, (1 + 2 * i,), generator=g).tolist(), max_tokens=20,
                        temperature=1.0, seed=i) for i in range(8)]
    together = run(runner, requests)
    assert [run(runner, [r])[0] for r in requests] == together and len({tuple(t) for t in together}) == 8


def test_a_compiled_fixed_step_is_one_graph_whatever_the_lengths(eager_dynamo):
    """compile=True in a fixed engine compiles its decoding step alone: dynamo compiles it once and never again,
    whatever the number of tokens, the rows running or the prompt lengths (prompts are encoded eagerly; the
    "eager" backend keeps the test quick: dynamo decides what to recompile whatever the backend), and the tokens
    are the eager engine's."""
    rounds = [[[1, 2, 3]], [[4, 5], [6, 7, 8, 9, 10, 11], [12]]]  # the second: other lengths, more rows, longer
    eager = engine.Engine(packing.prepare(small_model(block_size=16), "cpu", "float32"), Tokens(70), max_batch=4,
                          fixed=True)
    expected = [run(eager, [Request(p, max_tokens=10 + 15 * r, temperature=0) for p in prompts])
                for r, prompts in enumerate(rounds)]
    model = packing.prepare(small_model(block_size=16), "cpu", "float32", compile=True)
    runner = engine.Engine(model, Tokens(70), max_batch=4, fixed=True, compile=True)
    graphs = []
    for r, prompts in enumerate(rounds):
        assert run(runner, [Request(p, max_tokens=10 + 15 * r, temperature=0) for p in prompts]) == \
            expected[r]
        graphs.append(eager_dynamo["stats"]["unique_graphs"])
    assert graphs == [1, 1], graphs


def cuda_stand_ins(monkeypatch):
    """The CUDA calls of FixedStep's capture, stood in for on the CPU: the streams set current are recorded."""
    set_streams = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", set_streams.append)
    return set_streams


def fixed_engine():
    """An engine that decodes in fixed steps (CUDA's way), on the CPU: 2 rows of a small float32 model."""
    return engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2, fixed=True)


def fixed_greedy(runner, capture):
    """Greedy tokens of two requests in turn through a fixed engine whose step captures (as on CUDA) or not."""
    runner.model_runner.fixed_step.capture = capture
    return [run(runner, [Request(p, max_tokens=12, temperature=0)]) for p in ([1, 5, 9], [2, 7])]


@pytest.mark.parametrize("fixed", [False, True])
def test_on_cuda_every_attention_call_of_a_step_runs_with_the_kernels_chosen(monkeypatch, fixed):
    """Each step enters model.attention_backends' choice for CUDA (the one generate enters), around every
    attention call, a prompt's and a decoding row's (CUDA's choice stood in for; the model runs on the CPU)."""
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2, fixed=fixed)
    record = cuda_attention_stand_ins(monkeypatch, "machinery.generation.engine")
    run(runner, [Request([1, 5, 9], max_tokens=6, temperature=0), Request([2, 7], max_tokens=4)])
    assert record.backends and all(backends == CUDA_BACKENDS for backends in record.backends)
    assert set(record.devices) == {torch.device("cpu")} and len(record.devices) == len(record.backends)
    assert len(record.calls) >= 6 and all(record.calls), record.calls


def test_a_failed_graph_capture_puts_the_stream_back_and_decodes_eagerly(monkeypatch, capsys):
    """Where CUDA cannot capture the decoding step (a kernel that cannot be captured, a model that did not
    compile), the step says so once, makes current again the stream that the failed capture may have left
    current, and runs eagerly: the tokens of an engine that never captures."""
    expected = fixed_greedy(fixed_engine(), capture=False)
    set_streams = cuda_stand_ins(monkeypatch)

    def fail():
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    runner = fixed_engine()
    monkeypatch.setattr(runner.model_runner.fixed_step, "_capture", fail)
    assert fixed_greedy(runner, capture=True) == expected
    assert set_streams == ["stream of cpu"] and runner.model_runner.fixed_step.graph is None
    assert capsys.readouterr().err == ("note: the decoding step runs eagerly, without a CUDA graph (RuntimeError: "
                                       "operation not permitted when stream is capturing)\n")


def test_a_captured_step_reads_its_inputs_from_the_buffers_it_was_captured_on(monkeypatch):
    """A CUDA graph replays the kernels it captured on the same memory: the step's tokens and positions must go
    into the buffers the capture saw, and its logits be read from the buffer the capture wrote. A stand-in graph
    with those semantics (it computes again into the captured output from the captured inputs) gives the tokens
    of an engine that never captures."""
    expected = fixed_greedy(fixed_engine(), capture=False)
    cuda_stand_ins(monkeypatch)
    runner = fixed_engine()
    step, replays = runner.model_runner.fixed_step, []

    def capture():
        captured = step.idx, step.fixed.pos
        step.logits = step._run()

        def replay():  # on the captured tensors, whatever the step holds now
            now, (step.idx, step.fixed.pos) = (step.idx, step.fixed.pos), captured
            step.logits.copy_(step._run())
            step.idx, step.fixed.pos = now
            replays.append(1)
        step.graph = types.SimpleNamespace(replay=replay)
    monkeypatch.setattr(step, "_capture", capture)
    assert fixed_greedy(runner, capture=True) == expected
    # every decoding step but each request's first token (from its prompt pass), and the one launched ahead past its
    # last (the engine's `ahead`: discarded)
    assert len(replays) == 2 * 12


def test_stop_texts_stop_tokens_and_max_tokens_end_a_generation_with_its_reason():
    model = packing.prepare(small_model(), "cpu", "float32")
    runner = engine.Engine(model, Tokens(70))
    free = run(runner, [Request([3, 4], max_tokens=20, temperature=0.8, seed=1)])[0]
    text = Tokens(70).decode(free)
    cut = next(k for k in range(2, 18) if text.find(text[k:k + 2]) == k)  # a 2-token text first seen at k
    stop_at = next(k for k in range(2, 18) if free.index(free[k]) == k)  # a token first drawn at k
    g = runner.submit(Request([3, 4], max_tokens=20, temperature=0.8, seed=1, stop=(text[cut:cut + 2],)))
    h = runner.submit(Request([3, 4], max_tokens=20, temperature=0.8, seed=1, stop_tokens=(free[stop_at],)))
    i = runner.submit(Request([3, 4], max_tokens=4, temperature=0.8, seed=1))
    while not (g.done and h.done and i.done):
        runner.step()
    assert (g.finish_reason, h.finish_reason, i.finish_reason) == ("stop", "stop", "length")
    assert g.text.text == text[:cut] and h.text.text == text[:stop_at] and i.text.text == text[:4]
    assert g.completion_tokens == cut + 2  # drawn until the stop text was complete, then cut
    assert h.completion_tokens == stop_at + 1  # the stop token was drawn; it is not part of the text


def test_echo_scores_the_prompt_and_max_tokens_0_generates_nothing():
    model = small_model()
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70))
    prompt = [3, 1, 4, 1, 5, 9]
    g = runner.submit(Request(prompt, max_tokens=0, logprobs=2, echo=True))
    while not g.done:
        runner.step()
    events = list(g)
    assert [e.id for e in events[:-1]] == prompt and all(e.prompt for e in events[:-1])
    assert events[-1].id is None and events[-1].finish_reason == "length" and g.completion_tokens == 0
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt]), every_position=True)
    expected = torch.log_softmax(logits[0], -1)
    assert events[0].logprob is None
    for j in range(1, len(prompt)):
        assert events[j].logprob == pytest.approx(expected[j - 1, prompt[j]].item(), abs=1e-5)
        assert [t for t, _ in events[j].top] == torch.topk(expected[j - 1], 2).indices.tolist()


def test_a_cancelled_generation_leaves_at_the_next_step_and_abort_all_ends_everything():
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=1, max_waiting=1)
    first = runner.submit(Request([1, 2], max_tokens=1000))
    runner.step()
    second = runner.submit(Request([1, 2], max_tokens=1000))
    with pytest.raises(QueueFull):
        runner.submit(Request([1, 2]))
    runner.step()
    assert runner.load == (1, 1) and first.completion_tokens >= 2 and second.completion_tokens == 0
    first.cancel()
    runner.step()  # the first leaves, the second takes its place in the same step
    assert first.finish_reason == "abort" and runner.load == (1, 0) and second.completion_tokens >= 1
    runner.abort_all()
    assert second.finish_reason == "abort" and list(second)[-1].finish_reason == "abort"
    runner.step()
    assert runner.load == (0, 0)


def within_bfloat16_rounding(product, x, linear):
    """Where product (of x by linear in bfloat16) is within rounding of the exact x @ W.T + b (in float64, from the
    same bfloat16 numbers). The bound: each product of two bfloat16s is exact in float32; a sum of n of them in
    float32, in any order, is off by at most n float32 epsilons of sum |x||w|; the result (and perhaps the product
    before the bias) is rounded to bfloat16, half an epsilon relative each: within one bfloat16 epsilon of |x W.T| +
    |b| in all, taken twice here to spare."""
    weight, bias = linear.weight.double(), linear.bias.double()
    xw = x.double() @ weight.T
    bound = 2 * torch.finfo(torch.bfloat16).eps * (xw.abs() + bias.abs()) + \
        x.size(-1) * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T)
    return (product.double() - (xw + bias)).abs() <= bound


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_linear_computes_nn_linear_whatever_the_number_of_rows(dtype):
    """oneDNN's prepacked product equals nn.Linear's (float32: within rounding of 3072-term sums; bfloat16: within
    its own rounding, 8 bits, a bound that a product without its bias misses), and a row's result is the same in
    batches of 1 to 9 rows (bitwise). The bound is checked on PyTorch's own bfloat16 product on every CPU; oneDNN's
    only where it packs bfloat16."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(3072, 768).to(getattr(torch, dtype))
    x = torch.randn(9, 1, 3072).to(linear.weight.dtype)
    with torch.no_grad():
        if dtype == "bfloat16":
            assert within_bfloat16_rounding(linear(x), x, linear).all()
            # the negative control: the product with its bias left out (|b| up to 0.018 here) misses the bound
            assert not within_bfloat16_rounding(F.linear(x, linear.weight), x, linear).all()
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                pytest.skip("oneDNN cannot pack bfloat16 on this CPU (it needs AVX-512)")
        packed = packing.PackedLinear(linear)
        whole = packed(x)
        if dtype == "bfloat16":
            assert within_bfloat16_rounding(whole, x, linear).all()
        else:
            torch.testing.assert_close(whole, linear(x), atol=1e-5, rtol=1e-5)
        for rows in range(1, 9):
            assert torch.equal(packed(x[:rows]), whole[:rows])


@pytest.mark.parametrize("rows", [48, 40])
def test_packed_linear_takes_a_transposed_weight_as_its_row_major_copy(rows):
    """A Hugging Face GPT-2's matrices load as transposed views (its Conv1D layout); packed, they compute what
    the same weights in row-major order compute, bit for bit (48 rows: copied 16 rows at a time; 40: plainly)."""
    torch.manual_seed(0)
    conv1d = torch.randn(64, rows)  # (in, out), as Conv1D stores it
    transposed, row_major = torch.nn.Linear(64, rows), torch.nn.Linear(64, rows)
    with torch.no_grad():
        transposed.weight = torch.nn.Parameter(conv1d.t())
        row_major.weight.copy_(conv1d.t().contiguous())
        row_major.bias.copy_(transposed.bias)
    assert not transposed.weight.is_contiguous() and torch.equal(transposed.weight, row_major.weight)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(packing.PackedLinear(transposed)(x), packing.PackedLinear(row_major)(x))
        assert torch.equal(packing._contiguous(transposed.weight), row_major.weight)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=ONEDNN_BF16)])
def test_prepare_packs_each_matrix_as_it_converts_it_and_keeps_no_unpacked_copy(dtype):
    """prepare converts each linear layer's matrix to dtype and packs it on its own, two layers at a time in two
    threads (some matrices transposed views, as a Hugging Face GPT-2's load), and gives the process its threads
    back: the logits are bit for bit those of the whole model converted first and each layer packed after, and
    the prepared model holds no linear layer's matrix unpacked: its only matrices are the embeddings (the output
    layer's packed from the token embedding's, after its conversion)."""
    model = small_model()
    with torch.no_grad():
        for block in model.blocks:
            block.ffwd.fc.weight = torch.nn.Parameter(block.ffwd.fc.weight.t().contiguous().t())
    expected = copy.deepcopy(model).to(getattr(torch, dtype)).eval()
    for module, name, linear in packing._linear_layers(expected):
        setattr(module, name, packing.PackedLinear(linear))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two workers packing at once (each in one thread), whatever this process runs in
    try:
        prepared = packing.prepare(model, "cpu", dtype)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    idx = torch.randint(0, 70, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(prepared(idx)[0], expected(idx)[0])
    assert sum(isinstance(m, packing.PackedLinear) for m in prepared.modules()) == 4 * 2 + 1
    assert [name for name, p in prepared.named_parameters() if p.dim() > 1] == ["tok_emb.weight", "pos_emb.weight"]
    assert {p.dtype for p in prepared.parameters()} == {getattr(torch, dtype)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_layers_are_packed_in_float32_and_in_bfloat16_only_where_the_cpu_computes_it(dtype, cpu_bf16,
                                                                                         monkeypatch):
    """The packing decision under both answers of hardware.cpu_native (cpu_bf16), whatever this CPU is:
    float32 is always packed; bfloat16 only where native (elsewhere oneDNN would convert every product)."""
    class Packed(torch.nn.Module):  # stands in for PackedLinear, which cannot pack bfloat16 on every CPU
        def __init__(self, linear, dtype=None):
            super().__init__()
            self.bias = linear.bias  # (its weight packed: not a parameter any more)

    monkeypatch.setattr(packing, "PackedLinear", Packed)
    monkeypatch.setattr(packing, "uses_kernel", lambda dtype: False)  # (our kernels' layers: test_bf16_rows)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # oneDNN could pack it
    model = packing.prepare(small_model(), "cpu", dtype)
    packs = dtype == "float32" or cpu_bf16 == torch.bfloat16
    # every linear layer (4 in each of the 2 blocks, and the head) or none
    assert sum(isinstance(m, Packed) for m in model.modules()) == (4 * 2 + 1 if packs else 0)
    assert model.tok_emb.weight.dtype == getattr(torch, dtype)
