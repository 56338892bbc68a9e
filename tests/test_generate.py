"""Generation in model.py: the KV cache is exact, sampling options do what they say, compiled decoding
does not recompile per token, the attention kernels are chosen on CUDA (stood in for). Small random fp32 models
on the CPU; logits compared within 1e-4."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from model import GPT, GPTConfig, KVCache, attention_backends, filter_logits, sample_next

# (seed, config) of the random models the exactness tests run on
MODELS = [
    (0, dict(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8)),
    (1, dict(block_size=16, vocab_size=37, n_layer=2, n_head=4, n_embd=32, bias=False)),
    (2, dict(block_size=12, vocab_size=65, n_layer=3, n_head=2, n_embd=24, gelu="tanh")),
    (3, dict(block_size=10, vocab_size=29, n_layer=2, n_head=2, n_embd=16, qk_norm=True)),  # keys cached normalised
]


def random_model(seed, config):
    """An eval-mode GPT with weight matrices larger than GPT-2's init, so that its outputs vary with the context."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


def prompts(model, seed):
    """Prompts of 1 token, a few, exactly block_size and more than block_size tokens (batch of 2)."""
    g = torch.Generator().manual_seed(seed)
    B, V = model.config.block_size, model.config.vocab_size
    return [torch.randint(V, (2, T), generator=g) for T in (1, 3, B, B + 5)]


@pytest.mark.parametrize("seed,config", MODELS)
def test_cached_greedy_tokens_equal_uncached(seed, config):
    model = random_model(seed, config)
    steps = 2 * config["block_size"] + 3  # runs well past block_size, where the window slides
    distinct = set()
    for idx in prompts(model, seed):
        cached = model.generate(idx, steps, temperature=0, use_cache=True)
        uncached = model.generate(idx, steps, temperature=0, use_cache=False)
        assert cached.shape == (2, idx.size(1) + steps)
        assert torch.equal(cached, uncached)
        distinct |= {tuple(row) for row in cached[:, idx.size(1):].tolist()}
    assert len(distinct) > 4  # the prompts lead to different continuations: the context matters


@pytest.mark.parametrize("seed,config", MODELS)
def test_cached_sampled_tokens_equal_uncached(seed, config):
    """Sampling, not only greedy: with the same seeded generator, the cache changes no drawn token.
    Each prompt (shorter than, equal to and longer than block_size; generation runs past block_size)
    samples with other options: plain, top_k, top_p, and top_k with top_p."""
    model = random_model(seed, config)
    steps = 2 * config["block_size"] + 3
    options = [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.3, top_p=0.9),
               dict(temperature=0.7, top_k=8, top_p=0.95)]
    distinct = set()
    for i, (idx, opts) in enumerate(zip(prompts(model, seed), options)):
        outs = [model.generate(idx, steps, generator=torch.Generator().manual_seed(100 + i), use_cache=use_cache,
                               **opts) for use_cache in (True, False)]
        assert outs[0].shape == (2, idx.size(1) + steps)
        assert torch.equal(outs[0], outs[1]), opts
        distinct |= {tuple(row) for row in outs[0][:, idx.size(1):].tolist()}
    assert len(distinct) == 8  # every row of every prompt drew its own continuation


@pytest.mark.parametrize("seed,config", MODELS)
def test_cached_logits_equal_uncached_at_every_step(seed, config):
    """Teacher-forced on random tokens: per-step logits with and without the cache agree within 1e-4,
    one new token per step and several at once (a cached prefix plus a chunk), before and past block_size."""
    model = random_model(seed, config)
    g = torch.Generator().manual_seed(seed)
    V, block_size = config["vocab_size"], config["block_size"]
    for idx in prompts(model, seed)[:2]:
        seq, cache = idx, KVCache(model.config, idx.size(0), torch.float32, "cpu")
        step = 0
        while seq.size(1) < 2 * block_size + 4:
            cached, full = model.next_logits(seq, cache), model.next_logits(seq)
            assert cached.shape == full.shape == (2, V)
            assert (cached - full).abs().max().item() <= 1e-4, f"step {step}, {seq.size(1)} tokens"
            # nanoGPT's definition: the forward pass over the last block_size tokens
            assert torch.equal(full, model(seq[:, -block_size:])[0][:, -1])
            grow = 3 if step % 4 == 1 else 1  # now and then three new tokens in one call
            seq = torch.cat((seq, torch.randint(V, (2, grow), generator=g)), dim=1)
            step += 1


def test_generate_under_bfloat16_autocast(monkeypatch):
    """Under the CPU's bfloat16 autocast, the one cache generate makes and feeds at every token has the dtype
    KVCache.dtype_for decides: float32 on the CPU (where Head attends in float32), holding the keys and values exactly
    as they come out of the projections in bfloat16; and each greedy token is the float32 model's choice within
    bfloat16's rounding (past block_size too)."""
    model = random_model(*MODELS[1])
    caches = []
    next_logits = model.next_logits
    monkeypatch.setattr(model, "next_logits", lambda seq, cache=None: caches.append(cache) or next_logits(seq, cache))
    idx = torch.tensor([[0, 0, 0], [5, 9, 2]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(idx, 20, temperature=0)  # past block_size 16 too
        decided = KVCache.dtype_for(model, idx.device)
    assert out.shape == (2, 23) and len(caches) == 20
    cache = caches[0]
    assert cache is not None and all(c is cache for c in caches)  # one cache, fed at every token
    assert decided == torch.float32  # the CPU's rule (Head attends in float32 there), not autocast's bfloat16
    filled = [t[:, :, :cache.pos] for t in cache.k + cache.v]
    assert cache.pos > 0 and all(t.dtype == decided for t in cache.k + cache.v)
    # every cached number is a bfloat16 (the projections' output under autocast, kept exactly), unlike float32's
    assert all(torch.equal(t, t.bfloat16().float()) for t in filled) and all(t.abs().sum() > 0 for t in filled)
    model.generate(idx, 20, temperature=0)  # (without autocast, its cache holds numbers that bfloat16 cannot)
    assert not all(torch.equal(t[:, :, :c.pos], t[:, :, :c.pos].bfloat16().float())
                   for c in caches[-1:] for t in c.k + c.v)
    # each token, teacher-forced through the float32 model without a cache: its logit is the largest within 4
    # bfloat16 epsilons of the logits' scale (autocast rounds every layer's products to 8 bits: on other prompts
    # these models' tokens came within 1 epsilon; a cache that loses a token's values falls short by ~50)
    block_size, eps = model.config.block_size, torch.finfo(torch.bfloat16).eps
    with torch.no_grad():
        for t in range(idx.size(1), out.size(1)):
            logits = model(out[:, max(0, t - block_size):t])[0][:, -1].float()
            shortfall = logits.max(-1).values - logits.gather(-1, out[:, t:t + 1]).squeeze(-1)
            assert (shortfall <= 4 * eps * logits.abs().max(-1).values).all(), t


def test_temperature_zero_is_greedy_and_deterministic():
    model = random_model(*MODELS[1])
    idx = torch.tensor([[1, 2, 3]])
    runs = [model.generate(idx, 10, temperature=0, top_k=5, top_p=0.5,
                           generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    assert torch.equal(runs[0], runs[1])
    seq = idx
    for _ in range(10):
        seq = torch.cat((seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(runs[0], seq)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(filter_logits(logits, 0.9, top_k=1000), filter_logits(logits, 0.9))
    assert torch.equal(filter_logits(logits, 1.0, top_k=11), logits)
    assert filter_logits(logits, 1.0, top_k=2).isfinite().sum(-1).tolist() == [2, 2, 2]
    model = random_model(*MODELS[0])
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 5, top_k=1000,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 6)


def test_top_p_one_leaves_the_distribution_unchanged():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(filter_logits(logits, 0.8, top_k=20, top_p=1.0), filter_logits(logits, 0.8, top_k=20))
    draws = [sample_next(logits, 0.8, top_p=p, generator=torch.Generator().manual_seed(3)) for p in (1.0, None)]
    assert torch.equal(draws[0], draws[1])
    assert filter_logits(logits, 0.8, top_p=0.9).isinf().any()  # while a top_p below 1 does cut


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    kept = lambda p: filter_logits(logits, top_p=p).isfinite()[0].tolist()  # noqa: E731
    assert kept(0.45) == [False, True, False, False]
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.85) == [True, True, False, True]
    assert kept(0.99) == [True, True, True, True]


def test_top_p_among_equal_tokens_keeps_the_first_ones_of_the_vocabulary():
    """Ties are cut in the vocabulary's order (a stable sort), whatever the row's place in its batch: 4 equal
    tokens with top_p 0.5 keep the first two, 0.75 the first three."""
    logits = torch.zeros(3, 4)
    assert filter_logits(logits, top_p=0.5).isfinite().tolist() == [[True, True, False, False]] * 3
    assert filter_logits(logits, top_p=0.75).isfinite().tolist() == [[True, True, True, False]] * 3


def test_tiny_top_p_picks_the_argmax():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        assert torch.equal(sample_next(logits, 1.5, top_p=1e-6, generator=g), logits.argmax(-1))


def test_a_draw_lands_where_the_cumulative_probabilities_say():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # cumulative: 0.15, 0.65, 0.70, 1.0
    for u, token in ((0.0, 0), (0.1, 0), (0.2, 1), (0.64, 1), (0.66, 2), (0.69, 2), (0.71, 3), (0.999, 3)):
        assert sample_next(logits, 1.0, u=torch.tensor([[u]])).item() == token, u
    # top_p=0.7 keeps 0.5 and 0.3 (0.15 comes after 0.8 >= 0.7), renormalised: cumulative 0, 0.625, 0.625, 1.0
    assert [sample_next(logits, 1.0, top_p=0.7, u=torch.tensor([[u]])).item() for u in (0.6, 0.7)] == [1, 3]


def draws_alone_and_in_batches(device, boundaries=1):
    """Each of 33 near-uniform rows over GPT-2's vocabulary (steps of ~2e-5 in its cumulative probabilities), drawn
    by sample_next alone and in batches of 2, 8 and 33 rows (every place in a batch: each alignment of a row of
    50,257 floats), by uniform numbers that fall within float32's rounding of a boundary between two tokens (where
    two orders of adding up the row in float32 disagree), `boundaries` a row: (tokens alone, tokens in batches), for
    each of plain, top_k and top_p sampling."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 50257, generator=g, dtype=torch.float64) * 0.05
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    at = torch.randint(1000, 50000, (33, boundaries), generator=g)
    u = cdf.gather(1, at).float()  # (the float64 boundaries, rounded: within 3e-8 of them)
    logits = logits.float().to(device)
    results = []
    for settings in (dict(), dict(top_k=40000), dict(top_p=0.95)):
        for column in u.T:
            column = column[:, None].to(device)
            alone = torch.cat([sample_next(logits[i:i + 1], 1.0, u=column[i:i + 1], **settings) for i in range(33)])
            for size in (2, 8, 33):
                batched = torch.cat([sample_next(logits[i:i + size], 1.0, u=column[i:i + size], **settings)
                                     for i in range(0, 33, size)])
                results.append((alone.tolist(), batched.tolist()))
    return results


def test_a_rows_draw_is_the_same_alone_and_in_any_batch():
    """The engine's promise (a request's tokens never depend on what else runs) at the draw; on the CPU here,
    on CUDA in tests/test_cuda_decoding.py, where float32 sums of a row depend on the batch's shape."""
    for alone, batched in draws_alone_and_in_batches("cpu"):
        assert alone == batched


def test_vocab_size_limits_the_tokens_to_the_first_ones():
    model = random_model(*MODELS[1])
    out = model.generate(torch.zeros(4, 1, dtype=torch.long), 30, temperature=2.0, vocab_size=5,
                         generator=torch.Generator().manual_seed(0))
    assert out.max().item() < 5 and len(out.unique()) == 5


def test_a_stop_token_ends_each_sample():
    model = random_model(*MODELS[1])
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = model.generate(idx, 30, temperature=0)[:, 3:]
    stop = free[0, 5].item()  # a token that row 0 produces at step 5 at the latest
    ends = [row.index(stop) if stop in row else None for row in free.tolist()]
    out = model.generate(idx, 30, temperature=0, stop_tokens=[stop])[:, 3:]
    if None in ends:
        assert torch.equal(out, free)  # a row that never stops runs to max_new_tokens
    else:
        assert out.size(1) == max(ends) + 1 < 30  # generation stops once every row has stopped
    for row, end, free_row in zip(out.tolist(), ends, free.tolist()):
        if end is not None:
            assert row[:end + 1] == free_row[:end + 1]
            assert all(t == stop for t in row[end:])  # a finished row is padded with its stop token
    assert ends[0] is not None and ends[0] <= 5


def cuda_attention_stand_ins(monkeypatch, *users):
    """The attention kernels' choice as on CUDA, on the CPU: each module of users (by name) asks attention_backends
    of a device that is recorded and taken for a GPU; torch's sdpa_kernel, which it then enters, records the
    backends it is given (and picks them); each attention call records whether it ran inside. Without users the
    choice is left as it is (the device's own), still recorded."""
    record = SimpleNamespace(devices=[], backends=[], inside=0, calls=[])
    real_kernel, real_attention = torch.nn.attention.sdpa_kernel, F.scaled_dot_product_attention

    @contextlib.contextmanager
    def sdpa_kernel(backends):
        record.backends.append(list(backends))
        with real_kernel(backends):
            record.inside += 1
            try:
                yield
            finally:
                record.inside -= 1

    def attention(*args, **kwargs):
        record.calls.append(record.inside > 0)
        return real_attention(*args, **kwargs)

    def on_cuda(device):
        record.devices.append(torch.device(device))
        return attention_backends("cuda")

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", sdpa_kernel)
    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    for user in users:
        monkeypatch.setattr(f"{user}.attention_backends", on_cuda)
    return record


CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def test_generate_on_cuda_attends_with_the_kernels_the_engine_picks(monkeypatch):
    """Left to PyTorch's default choice, attention on an H100 in bfloat16 took ~46 ms a call when the keys'
    length changes at every token: on CUDA generate enters the engine's choice (flash, memory-efficient, then
    plain attention) once, around every attention call of the generation (CUDA stood in for)."""
    model = random_model(*MODELS[1])
    idx = prompts(model, 1)[1]
    expected = model.generate(idx, 20, temperature=0)
    record = cuda_attention_stand_ins(monkeypatch, "model")
    assert torch.equal(model.generate(idx, 20, temperature=0), expected)
    assert record.devices == [idx.device] and record.backends == [CUDA_BACKENDS]
    assert len(record.calls) >= 20 and all(record.calls), record.calls


def test_generate_on_the_cpu_leaves_the_attention_kernels_to_pytorch(monkeypatch):
    """On the CPU generate chooses nothing: no attention call runs inside a choice, and the tokens, greedy and
    sampled, are those of generate without the choice."""
    model = random_model(*MODELS[2])
    idx = prompts(model, 2)[1]
    record = cuda_attention_stand_ins(monkeypatch)
    greedy = model.generate(idx, 30, temperature=0)
    sampled = model.generate(idx, 30, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(0))
    assert record.backends == [] and record.calls and not any(record.calls)
    monkeypatch.setattr("model.attention_backends", lambda device: contextlib.nullcontext())  # no choice at all
    assert torch.equal(model.generate(idx, 30, temperature=0), greedy)
    assert torch.equal(model.generate(idx, 30, temperature=1.0, top_k=20,
                                      generator=torch.Generator().manual_seed(0)), sampled)


def test_compiled_decoding_does_not_recompile_per_token():
    """model.compile(dynamic=True), as sample.py --compile does: the number of graphs dynamo compiles does
    not grow with the number of tokens or the prompt length, and the tokens are those of the eager model.
    The "eager" backend keeps the test quick: dynamo decides what to recompile whatever the backend
    (inductor itself, measured by hand, compiles 3 graphs here: a 1-token prompt, other prompts, decoding)."""
    from torch._dynamo.utils import counters

    model = random_model(*MODELS[0])
    block_size = model.config.block_size
    rounds = [[1, 3], [5, 12]]  # prompt lengths (12 > block_size 8); the second round also runs longer
    expected = [[model.generate(torch.arange(T)[None] % 11, (2 + r) * block_size, temperature=0)
                 for T in lengths] for r, lengths in enumerate(rounds)]
    torch._dynamo.reset()
    counters.clear()
    try:
        model.compile(dynamic=True, backend="eager")
        graphs = []
        for r, lengths in enumerate(rounds):
            for T, want in zip(lengths, expected[r]):
                assert torch.equal(model.generate(torch.arange(T)[None] % 11, (2 + r) * block_size,
                                                  temperature=0), want)
            graphs.append(counters["stats"]["unique_graphs"])
        assert 1 <= graphs[0] <= 3, graphs  # prefill and decode (and perhaps a 1-token prompt)
        assert graphs[1] == graphs[0], graphs  # longer runs and new prompt lengths compiled nothing new
    finally:
        torch._dynamo.reset()


def test_sampling_draws_each_token_with_its_probability_and_never_one_of_probability_zero():
    """sample_next draws by inverse transform (one uniform number per row against the cumulative
    probabilities): over 40,000 draws from softmax(logits / 0.5) each token's frequency is within 4.5
    binomial standard deviations of its probability (a seeded, deterministic run; a token off by one
    index, or temperature applied wrongly, is off by many deviations), and the tokens top_k cut never come."""
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5, -3.0]]).repeat(40000, 1)
    draws = sample_next(logits, 0.5, generator=torch.Generator().manual_seed(0))
    p = torch.softmax(logits[0].double() / 0.5, dim=-1)
    counts = torch.bincount(draws, minlength=6).double()
    sd = (40000 * p * (1 - p)).sqrt()
    assert ((counts - 40000 * p).abs() <= 4.5 * sd).all(), (counts, 40000 * p)
    kept = sample_next(logits[:2000], 1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert set(kept.tolist()) == {0, 2, 4}  # the 3 most likely, each drawn
    with_zeros = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]]).repeat(2000, 1)
    assert set(sample_next(with_zeros, 1.0, generator=torch.Generator().manual_seed(2)).tolist()) == {1, 3}
