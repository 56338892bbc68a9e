"""The fixed decoding step's attention (machinery/generation/decode_attention.py), on the CPU: flex (each row over its own blocks
of the cache, through a block mask built at every step) is the float64 reference at every length and block edge
and full's within float32 rounding, a row's result is bit for bit the same whatever the other rows' lengths, the
block mask has the kernel read exactly a row's positions, the KV bytes a row reads grow with its length and not
block_size, the engine decodes with it the uncached model's tokens, the step's cache writes are the indexed
writes', flex that cannot run gives way to full, and sample.py / serve.py refuse a bad setting. Flex runs eagerly
here (PyTorch's unfused reference: compiling it takes a minute on a CPU); the CUDA tests run it compiled."""

import types

import pytest
import torch

import sample
import serve
from conftest import assert_one_error_line, assert_one_line, run_in_process
from machinery.generation import decode, decode_attention, engine, packing
from machinery.configurator import parse
from machinery.generation.decode_attention import BLOCK
from machinery.errors import UserError
from machinery.generation.request import Request
from model import GPTConfig, Head
from test_engine import Tokens, cuda_stand_ins, run, small_model

U = 2 ** -24  # float32's unit roundoff
HEAD_SIZE = 16
BLOCK_SIZE = 3 * BLOCK - 1  # the fixed cache: 3 * BLOCK positions (block_size and a spare)
EDGES = [0, 1, BLOCK - 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 3 * BLOCK - 1]  # positions (a row's
# length - 1) at the flex blocks' edges, and the cache's last


def fixed_cache(kind, rows, block_size=BLOCK_SIZE, layers=1, device="cpu", dtype=torch.float32):
    """A fixed step's cache of rows (2 heads of HEAD_SIZE) full of random keys and values (what earlier rows left),
    and a Fixed that attends over it as kind."""
    config = GPTConfig(block_size=block_size, vocab_size=70, n_layer=layers, n_head=2, n_embd=2 * HEAD_SIZE)
    slots = decode.Slots(config, rows, dtype, device, fixed=True, attention=kind)
    g = torch.Generator().manual_seed(0)
    for kv in slots.kv:
        kv.copy_(torch.randn(kv.shape, generator=g))
    return slots, decode.Fixed(slots, kind)


def qkv(rows, seed, device="cpu", dtype=torch.float32):
    """Random q, k, v (rows, 2 heads, 1, HEAD_SIZE), scaled up: peaked weights."""
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(rows, 2, 1, HEAD_SIZE, generator=g)).to(device, dtype) for _ in range(3)]


def step(fixed, pos, q, k, v):
    """The fixed step's attention (rows, heads, 1, head size) in layer 0 for rows at positions pos."""
    fixed.pos.copy_(torch.tensor(pos))
    fixed.positions(1, "cpu")
    return fixed.attend(0, q, k, v, Head(0.0))


def test_flex_is_the_float64_reference_at_every_length_and_fulls_within_float32_rounding():
    """Every length 1..block_size + 1 (the whole cache), 64 rows a step in a shuffled order, the cache's other
    positions random: softmax(q k^T / sqrt(d)) v over positions 0..pos in float64 from the cache (after the step's
    write), against float32's bound for d products and a sum over n positions, (d + n) u of the values' largest."""
    slots, flex = fixed_cache("flex", 64)
    full = decode.Fixed(slots, "full")
    order = torch.randperm(slots.length, generator=torch.Generator().manual_seed(1)).view(-1, 64).tolist()
    for i, pos in enumerate(order):
        q, k, v = qkv(64, i)
        out, other = step(flex, pos, q, k, v), step(full, pos, q, k, v)
        for row, p in enumerate(pos):
            keys, values = slots.k[0][row, :, :p + 1].double(), slots.v[0][row, :, :p + 1].double()
            weights = torch.softmax(q[row].double() @ keys.transpose(-1, -2) / HEAD_SIZE ** 0.5, dim=-1)
            bound = (HEAD_SIZE + p + 1) * U * values.abs().max().item()
            assert (out[row].double() - weights @ values).abs().max() <= bound, p
            assert (out[row] - other[row]).abs().max() <= 2 * bound, p
    assert sorted(sum(order, [])) == list(range(BLOCK_SIZE + 1))  # (every length, the edges among them)


def among_others(p, device="cpu", dtype=torch.float32):
    """Row 3's flex attention at position p in 4 steps whose 7 other rows are at random positions."""
    slots, flex = fixed_cache("flex", 8, device=device, dtype=dtype)
    mine, results = qkv(1, 100, device, dtype), []
    for draw in range(4):
        q, k, v = qkv(8, draw, device, dtype)
        for t, m in zip((q, k, v), mine):
            t[3] = m[0]
        pos = torch.randint(0, slots.length, (8,), generator=torch.Generator().manual_seed(draw)).tolist()
        pos[3] = p
        results.append(step(flex, pos, q, k, v)[3])
    return results


@pytest.mark.parametrize("p", EDGES)
def test_a_rows_result_is_the_same_bit_for_bit_whatever_the_other_rows_lengths(p):
    results = among_others(p)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def read_positions(block_mask, row):
    """The positions flex's kernel reads for row: its full blocks whole (no mask_mod), its partial blocks where
    mask_mod allows; a block listed as both would be read twice."""
    full = block_mask.full_kv_indices[row, 0, 0, :block_mask.full_kv_num_blocks[row, 0, 0]].tolist()
    partial = block_mask.kv_indices[row, 0, 0, :block_mask.kv_num_blocks[row, 0, 0]].tolist()
    assert not set(full) & set(partial)
    span = [torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in range(BLOCK_SIZE // BLOCK + 1)]
    read = [span[b] for b in full]
    read += [span[b][block_mask.mask_mod(torch.tensor(row), 0, 0, span[b])] for b in partial]
    return sorted(torch.cat(read).tolist())


def test_the_block_mask_has_the_kernel_read_exactly_each_rows_positions():
    """The fused kernel reads what the block mask lists (the eager reference above applies mask_mod everywhere
    instead): at every position, a row's full and partial blocks cover positions 0..pos and nothing else."""
    rows = BLOCK_SIZE + 1  # a row at each position of the cache
    _, flex = fixed_cache("flex", rows)
    flex.pos.copy_(torch.arange(rows))
    flex.positions(1, "cpu")
    for p in range(rows):
        assert read_positions(flex.attention.block_mask, p) == list(range(p + 1)), p


def test_the_kv_bytes_a_row_reads_grow_with_its_length_and_not_block_size():
    """Flex: the row's blocks (pos // BLOCK full, one partial) x BLOCK positions x 2 heads x HEAD_SIZE x 2 (keys,
    values) x 4 bytes (float32) x 2 layers, whatever the cache's length; full: every position of the cache."""
    pos = [0, BLOCK - 1, BLOCK, 2 * BLOCK + 5, 3 * BLOCK - 1]
    per_position = 2 * HEAD_SIZE * 2 * 4 * 2
    for block_size in (BLOCK_SIZE, 8 * BLOCK - 1):
        for kind in decode_attention.KINDS:
            slots, fixed = fixed_cache(kind, len(pos), block_size, layers=2)
            fixed.pos.copy_(torch.tensor(pos))
            fixed.positions(1, "cpu")
            # (block_size + 1 is a multiple of BLOCK here: the cache's whole length for either way)
            expected = [(p // BLOCK + 1) * BLOCK if kind == "flex" else block_size + 1 for p in pos]
            assert decode_attention.kv_bytes(fixed.attention, slots).tolist() == [n * per_position for n in expected]


def test_a_fixed_cache_holds_whole_flex_blocks_for_flex_and_stays_as_long_as_it_was_for_full():
    """GPT-2's block_size: 1,025 positions rounded up to 1,152 (9 flex blocks) for flex, to 1,088 (64 keys a tile of
    SDPA's kernels) for full; a row-by-row cache holds exactly block_size + 1."""
    config = GPTConfig(block_size=1024, vocab_size=70, n_layer=1, n_head=1, n_embd=16)
    lengths = [decode.Slots(config, 1, torch.float32, "cpu", fixed, kind).length
               for fixed, kind in [(True, "flex"), (True, "full"), (False, "full")]]
    assert lengths == [1152, 1088, 1025]


def test_the_steps_cache_writes_are_the_indexed_writes_one_for_keys_and_values_from_the_model():
    """Fixed.store writes each row's new key and value where `keys[row, :, pos] = k` does: in one write where k and v
    are slices of one tensor (as the model's split qkv projection gives them), else in one each."""
    rows, heads = 4, 2
    pos = torch.tensor([0, BLOCK - 1, BLOCK, BLOCK_SIZE])
    projected = torch.randn(rows, 1, 3 * heads * HEAD_SIZE)  # (B, T, 3C) as the model's qkv layer gives it
    q, k, v = (t.view(rows, 1, heads, HEAD_SIZE).transpose(1, 2)[:, :, 0]
               for t in projected.split(heads * HEAD_SIZE, 2))
    assert decode.joint(k, v) is not None and decode.joint(k, v.clone()) is None
    for new_v in (v, v.clone()):
        slots, fixed = fixed_cache("full", rows)
        expected = [t.clone() for t in slots.kv[0]]
        expected[0][torch.arange(rows), :, pos], expected[1][torch.arange(rows), :, pos] = k, new_v
        fixed.pos.copy_(pos)
        fixed.positions(1, "cpu")
        fixed.store(0, k, new_v)
        assert torch.equal(slots.kv[0][0], expected[0]) and torch.equal(slots.kv[0][1], expected[1])


def test_the_model_gives_the_step_its_keys_and_values_as_one_tensor(monkeypatch):
    joined, joint = [], decode.joint
    monkeypatch.setattr(decode, "joint", lambda k, v: joined.append(joint(k, v) is not None) or joint(k, v))
    run(flex_engine(16, rows=2), [Request([1, 2, 3], max_tokens=3, temperature=0)])
    # 2 layers, 3 decoding steps: the first token comes from the prompt's pass, and a step launched ahead past the
    # last is discarded (the engine's `ahead`)
    assert joined == [True] * 2 * 3


def flex_engine(block_size, rows=4):
    """A float32 engine of a small model whose fixed step (CUDA's way, run here) attends with flex."""
    return engine.Engine(packing.prepare(small_model(block_size=block_size), "cpu", "float32"), Tokens(70),
                         max_batch=rows, fixed=True, decode_attention="flex")


def test_flex_decoding_gives_the_uncached_tokens_past_block_size_and_each_requests_own():
    """block_size 150 (2 flex blocks): greedy tokens after a prompt of 120 cross the blocks' edge and slide past
    block_size, the uncached model's exactly in float32; seeded requests of lengths at either side of the edge give
    together what each gives alone."""
    prompt = torch.randint(0, 70, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = small_model(block_size=150).generate(torch.tensor([prompt]), 40, temperature=0, use_cache=False)
    runner = flex_engine(150)
    assert run(runner, [Request(prompt, max_tokens=40, temperature=0)]) == [expected[0, 120:].tolist()]
    assert runner.model_runner.fixed_step.fixed.attention.kind == "flex"
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(0, 70, (n,), generator=g).tolist(), max_tokens=12, temperature=1.0,
                        seed=n) for n in (1, 60, BLOCK - 6, BLOCK + 3)]
    together = run(runner, requests)
    assert [run(runner, [r])[0] for r in requests] == together and len({tuple(t) for t in together}) == 4


def full_tokens():
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2, fixed=True)
    return run(runner, [Request([1, 5, 9], max_tokens=12, temperature=0)])


def test_flex_that_cannot_run_gives_way_to_full_said_once(capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("no triton here\nmore")
    runner = flex_engine(32, rows=2)
    runner.model_runner.fixed_step.fixed.attention.flex = fail
    assert run(runner, [Request([1, 5, 9], max_tokens=12, temperature=0)]) == full_tokens()
    assert runner.model_runner.fixed_step.fixed.attention.kind == "full"
    assert capsys.readouterr().err == f"{decode.FLEX_NOTE} (RuntimeError: no triton here)\n"


def test_a_flex_step_that_cannot_be_captured_is_captured_with_full(monkeypatch, capsys):
    """On CUDA (its calls stood in for), flex that fails in the capture (to compile, say) gives way to full, whose
    step is then captured (a stand-in graph that runs the step again on replay): full's tokens, one note."""
    expected = full_tokens()
    cuda_stand_ins(monkeypatch)
    runner = flex_engine(32, rows=2)
    step = runner.model_runner.fixed_step

    def capture():
        if step.fixed.attention.kind == "flex":
            raise RuntimeError("flex did not compile")
        step.logits = step._run()
        step.graph = types.SimpleNamespace(replay=lambda: step.logits.copy_(step._run()))
    monkeypatch.setattr(step, "_capture", capture)
    step.capture = True
    assert run(runner, [Request([1, 5, 9], max_tokens=12, temperature=0)]) == expected
    assert step.graph is not None and step.fixed.attention.kind == "full"
    assert capsys.readouterr().err == f"{decode.FLEX_NOTE} (RuntimeError: flex did not compile)\n"


@pytest.mark.parametrize("main", [sample.main, serve.main])
def test_sample_and_serve_refuse_a_bad_decode_attention_in_one_line(main):
    assert_one_error_line(run_in_process(main, "--decode_attention=fast"), "decode_attention", "full or flex")
    assert_one_error_line(run_in_process(main, "--device=cpu", "--decode_attention=flex"), "flex", "--device=cuda")


def test_the_setting_takes_flex_on_cuda_and_the_engine_refuses_it_where_rows_decode_alone():
    for device in ("cuda", "cuda:1", "auto"):  # (auto: the engine checks once the device is picked)
        parse(sample.SampleConfig, [f"--device={device}", "--decode_attention=flex"]).validate()
    # left out: the command's choice, flex for a server on CUDA (its kernel compiled once at the start), else full
    assert parse(serve.ServeConfig, []).decode_attention is None is parse(sample.SampleConfig, []).decode_attention
    assert [decode_attention.default(None, device, server) for device, server in
            (("cuda", True), ("cuda:1", True), ("cuda", False), ("cpu", True), ("cpu", False))] == \
        ["flex", "flex", "full", "full", "full"]
    assert decode_attention.default("full", "cuda", True) == "full" and \
        decode_attention.default("flex", "cuda", False) == "flex"  # (asked for: as asked)
    with pytest.raises(UserError) as excinfo:
        engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2,
                      decode_attention="flex")
    assert_one_line(excinfo, "flex", "fixed decoding step")
