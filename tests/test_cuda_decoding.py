"""Decoding on CUDA (skipped without a GPU; CI is CPU-only): the engine's fixed step, captured as a CUDA graph,
gives the uncached model's greedy tokens (in float32 exactly, in bfloat16 within its rounding), a request's tokens
alone and among 31 others are the same (and a row's draw alone and in any batch), a step waits for the GPU once,
and serve.py answers; with decode_attention=flex (compiled, in the graph) too, and its logits are full's within
bfloat16's rounding. Collected with torch alone (a GPU machine may have nothing else): serve.py's test imports the
serving packages when it runs, and skips where they are missing (tested in test_cuda_decisions.py)."""

import warnings

import pytest
import torch

from machinery.generation import decode, engine, model_runner, packing
from machinery.generation.request import Request
from model import attention_backends
from test_decode_attention import BLOCK, EDGES, among_others
from test_engine import Tokens, run, small_model
from test_generate import draws_alone_and_in_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [1, 5, 9, 2, 7]
SERVING = ("fastapi", "starlette", "pydantic", "uvicorn", "httpx", "httpx2", "openai")  # what serve.py's test needs


def greedy(dtype, capture=True, device="cuda"):
    """60 greedy tokens of the engine's fixed step (the window of 32 slides) after PROMPT, and its runner."""
    runner = engine.Engine(packing.prepare(small_model(block_size=32), device, dtype), Tokens(70), device, fixed=True)
    runner.model_runner.fixed_step.capture = capture and runner.model_runner.fixed_step.capture
    return run(runner, [Request(PROMPT, max_tokens=60, temperature=0)])[0], runner


def uncached_logits(model, tokens, start, block_size):
    """The model's logits (float32) for each token of tokens from start on, each from the window of up to
    block_size tokens before it encoded from scratch (generate(use_cache=False)'s way)."""
    seq = torch.tensor([tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        return torch.stack([model(seq[:, max(0, t - block_size):t])[0][0, -1].float()
                            for t in range(start, len(tokens))])


def test_graph_decoding_gives_the_uncached_greedy_tokens_in_float32(tf32_off):
    model = small_model(block_size=32).to("cuda").eval()
    expected = model.generate(torch.tensor([PROMPT], device="cuda"), 60, temperature=0, use_cache=False)[0, 5:]
    tokens, runner = greedy("float32")
    assert runner.slots.device.type == "cuda"
    assert runner.model_runner.fixed_step.graph is not None  # a captured graph ran
    assert tokens == expected.tolist()


def test_graph_decoding_in_bfloat16_is_the_eager_steps_and_the_uncached_models_within_its_rounding():
    """bfloat16: the graph replays the eager step's kernels, so the same tokens bit for bit. Against the uncached
    model, which runs other kernels (causal attention over one row, not masked attention over the cache's rows) and
    rounds differently, a near tie may go the other way: each token the graph chose scores, in the uncached model on
    the same text, within 2^-3 of that step's largest logit of its best (measured on the CPU, this model's bfloat16
    logits are within 6 % of the largest of float64's: two bfloat16 computations within twice that; a token chosen
    wrongly, by a wrong position or mask, falls short by about the logits' spread)."""
    tokens, runner = greedy("bfloat16")
    assert runner.model_runner.fixed_step.graph is not None
    assert greedy("bfloat16", capture=False)[0] == tokens
    logits = uncached_logits(small_model(block_size=32).to("cuda", torch.bfloat16).eval(), PROMPT + tokens,
                             len(PROMPT), 32)
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    short = logits.amax(dim=-1) - chosen
    assert (short <= 2 ** -3 * logits.abs().amax(dim=-1)).all(), short.tolist()


def test_the_flex_graph_gives_the_uncached_greedy_tokens_in_float32_across_its_blocks(tf32_off):
    """decode_attention=flex, compiled and captured in the step's graph: block_size 200 (2 flex blocks), greedy
    tokens after a prompt of 120 cross the blocks' edge and slide past block_size, the uncached model's."""
    model = small_model(block_size=200).to("cuda").eval()
    prompt = torch.randint(0, 70, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = model.generate(torch.tensor([prompt], device="cuda"), 100, temperature=0, use_cache=False)[0, 120:]
    runner = engine.Engine(packing.prepare(small_model(block_size=200), "cuda", "float32"), Tokens(70), "cuda",
                           fixed=True, decode_attention="flex")
    assert run(runner, [Request(prompt, max_tokens=100, temperature=0)]) == [expected.tolist()]
    step = runner.model_runner.fixed_step
    assert step.graph is not None and step.fixed.attention.kind == "flex"


# (flex: block_size 200, prompts of 1 to 170 tokens: rows at either side of the flex blocks' edge)
@pytest.mark.parametrize("attention, block_size, spread, longest", [("full", 64, 1, 7), ("flex", 200, 37, 170)])
def test_a_requests_tokens_are_the_same_alone_and_among_31_others(attention, block_size, spread, longest):
    runner = engine.Engine(packing.prepare(small_model(n_embd=256, block_size=block_size), "cuda", "bfloat16"),
                           Tokens(70), "cuda", max_batch=32, decode_attention=attention)
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, 70, (1 + i * spread % longest,), generator=g).tolist(),
                        max_tokens=24, temperature=1.0, seed=i) for i in range(32)]
    together = run(runner, requests)
    step = runner.model_runner.fixed_step
    assert step.graph is not None and step.fixed.attention.kind == attention
    assert run(runner, [requests[5]]) == [together[5]] and run(runner, [requests[30]]) == [together[30]]


@pytest.mark.parametrize("p", EDGES)
def test_a_rows_flex_attention_is_the_same_bit_for_bit_whatever_the_other_rows_lengths_on_cuda(p):
    """The compiled flex kernel (keys split across thread blocks, the parts combined) in bfloat16, at the flex
    blocks' edges: a row's result never depends on the other rows' lengths."""
    results = among_others(p, "cuda", torch.bfloat16)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def step_logits(attention, dtype, rows=8, steps=2 * BLOCK + 10):
    """The float32 logits (steps, rows, V) of a fixed step's graph in dtype attending as attention, fed random tokens,
    row r at position t - 20 r of step t (0 before: rows of other lengths), across 2 flex block edges; and the
    step."""
    model = packing.prepare(small_model(n_embd=256, block_size=300), "cuda", dtype)
    slots = decode.Slots(model.config, rows, next(model.parameters()).dtype, "cuda", fixed=True, attention=attention)
    step = decode.FixedStep(model, slots, attention=attention)
    tokens = torch.randint(0, 70, (rows, steps), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.inference_mode(), attention_backends("cuda"):
        for t in range(steps):
            pos = (t - 20 * torch.arange(rows)).clamp(min=0)
            logits.append(step(tokens.gather(1, pos[:, None]), pos)[:, 0].float().clone())
    return torch.stack(logits), step


def moved(logits, reference):
    """The median and the largest over steps and rows of |logits - reference| at its largest, over the reference's
    largest |logit|."""
    far = (logits - reference).abs().amax(dim=-1) / reference.abs().amax(dim=-1)
    return torch.quantile(far.flatten().cpu(), torch.tensor([0.5, 1.0]))


def test_flex_logits_are_fulls_within_bfloat16_rounding(tf32_off):
    """The same step in bfloat16 with either attention: flex moves full's logits less than bfloat16's rounding moves
    them from float32's, at the median step and at the worst (on the CPU, this model's: 0.7 % and 13 % against 1.4 %
    and 54 %; a wrong position or mask moves most steps' logits by about their spread)."""
    exact, _ = step_logits("full", "float32")
    full, _ = step_logits("full", "bfloat16")
    flex, step = step_logits("flex", "bfloat16")
    assert step.graph is not None and step.fixed.attention.kind == "flex"
    assert (moved(flex, full) <= moved(full, exact)).all(), (moved(flex, full), moved(full, exact))


def test_a_rows_draw_is_the_same_alone_and_in_any_batch_on_cuda():
    """CUDA's cumsum adds a row up in an order that depends on the batch's shape (a lone row: another scan), so
    float32 cumulative sums drew another token now and then: sample_next sums integer weights."""
    for alone, batched in draws_alone_and_in_batches("cuda", boundaries=4):
        assert alone == batched


def test_flat_distributions_over_gpt2s_vocabulary_draw_the_same_alone_and_at_once():
    """8 seeded requests at once and alone (bench.py --mode=gpu's check), where every draw is near a tie: 50,257
    tokens, temperature 50."""
    runner = engine.Engine(packing.prepare(small_model(vocab_size=50257, block_size=64), "cuda", "bfloat16"),
                           Tokens(50257), "cuda", max_batch=8)
    requests = [Request([3 + i, 7, 11 * i], max_tokens=24, temperature=50.0, seed=i) for i in range(8)]
    together = run(runner, requests)
    assert [run(runner, [r])[0] for r in requests] == together


def cache_on_and_off(device, dtype):
    """Every request's events with the prefix cache off and on, over test_prefix_cache.py's waves of requests
    sharing prefixes (greedy and seeded, n > 1, echo, logprobs, past block_size), and the tokens it saved."""
    from test_prefix_cache import CHUNK, random_waves, results

    model = packing.prepare(small_model(n_embd=32, block_size=48), device, dtype)
    events, saved = [], []
    for budget in (0, 1):
        runner = engine.Engine(model, Tokens(70), device, max_batch=4, prefill_chunk=CHUNK, prefix_cache_mb=budget)
        got, generations = results(runner, random_waves(3))
        events.append(got)
        saved.append(sum(g.cached_tokens for g in generations))
    return events, saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prefix_cache_changes_no_token_or_logprob_on_the_cuda_graph(dtype, tf32_off):
    """Issue 41 on CUDA: cached prefixes are the KV a recomputation gives, bit for bit, in the fixed step's graph."""
    events, saved = cache_on_and_off("cuda", dtype)
    assert events[1] == events[0] and saved[0] == 0 and saved[1] > 0


@pytest.mark.parametrize("ahead", [False, True])
def test_a_decoding_step_makes_the_host_wait_for_the_gpu_once(monkeypatch, ahead):
    """Sampling stays on the device: a step that only decodes (greedy, top-k and plain sampling rows together)
    synchronises once, to read the new tokens (torch's sync debug mode warns at each synchronising call). With
    ahead, that wait is the landing step's Flight.read alone (an event's wait, which the debug mode may not count),
    and the next step is in flight when it returns."""
    runner = engine.Engine(packing.prepare(small_model(), "cuda", "float32"), Tokens(70), "cuda", max_batch=4,
                           ahead=ahead)
    settings = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.0)]
    for i, kw in enumerate(settings):
        runner.submit(Request([1 + i, 2], max_tokens=20, seed=i, **kw))
    for _ in range(3):  # the prompts, then the graph's capture
        runner.step()
    counts, reads, read = [], [], model_runner.Flight.read
    monkeypatch.setattr(model_runner.Flight, "read", lambda self: reads.append(1) or read(self))
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(5):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runner.step()
            counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
            assert (runner.model_runner.flight is not None) == ahead
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts == [1] * 5 if not ahead else (len(reads) == 5 and all(c <= 1 for c in counts)), counts


@pytest.fixture(scope="module")
def serve_tests():
    """The module test_serve (its server, requests and checks), or a skip naming the serving package that this
    machine lacks: a missing module of ours, or of torch's, is still an error."""
    try:
        import fastapi  # noqa: F401 (serve.py's app, which imports it only when a server starts)
        import test_serve
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVING:
            raise
        pytest.skip(f"serve.py's test needs {e.name}: requirements-dev.txt's serving packages ({', '.join(SERVING)})")
    return test_serve


@pytest.fixture(scope="module")
def ckpt_dir(serve_tests, tmp_path_factory):
    """test_serve's random character model, by its fixture's function (a fixture imported at the top would import
    the serving packages with it)."""
    return serve_tests.ckpt_dir.__wrapped__(tmp_path_factory)


def test_serve_py_on_cuda_refuses_each_bad_request_and_then_serves(serve_tests, ckpt_dir):
    """serve.py on the GPU at its default precision (dtype=auto): each bad request of test_serve gets its 4xx (one
    that reached the model, a token id outside the vocabulary say, would be a device-side assert, which ends every
    later CUDA call of the process), then a real completion completes, decoded by the captured graph."""
    with serve_tests.serving(ckpt_dir, "--max_tokens=100000", "--dtype=auto", device="cuda") as server:
        for sent, status, _, _ in serve_tests.BAD:
            assert serve_tests.post(server, "/v1/completions", sent).status_code == status, sent
        serve_tests.assert_serves(server)
        assert server.engine.model_runner.fixed_step.graph is not None
