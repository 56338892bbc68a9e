"""Huge pages for the weights (machinery/generation/hugepages.py), and the engine moving its weights there once it has
run the model often enough to gain the move back."""

import pytest
import torch

from machinery.generation import engine, hugepages, model_runner, packing
from machinery.generation.request import Request
from test_engine import Tokens, run, small_model

MIB = 1 << 20


def anon_huge_bytes(address):
    """The bytes of huge pages in the mapping that holds address, as Linux reports them in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: start-end perms offset dev ...
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_collapse_backs_a_tensors_memory_with_huge_pages_and_keeps_its_contents():
    values = torch.arange(8 * MIB // 4, dtype=torch.int32)  # 8 MiB, written: its pages exist
    got = hugepages.collapse([(values.data_ptr(), 8 * MIB)])
    if got == 0:
        pytest.skip("this kernel moves no memory into huge pages (MADV_COLLAPSE needs Linux 6.1+, huge pages on)")
    assert got % hugepages.HUGE_PAGE == 0 and got <= 10 * MIB  # the huge pages the 8 MiB touch: 5 at most
    assert anon_huge_bytes(values.data_ptr()) >= 3 * 2 * MIB  # 8 MiB hold 3 whole aligned 2 MiB pages at least
    assert torch.equal(values, torch.arange(8 * MIB // 4, dtype=torch.int32))


def test_memory_that_is_not_mapped_is_left_alone():
    assert hugepages.collapse([(0, 4 * MIB), (4 * MIB, 0)]) == 0  # (madvise fails there: nothing to move)


def test_the_engine_moves_every_linear_layers_weight_once_it_has_run_the_model_often_enough(monkeypatch):
    """Requests too short to move the weights at once: fewer than HUGE_PAGES_AFTER passes of the model move
    nothing; past them, the engine hands every linear layer's weight memory (oneDNN's packed copy where there is
    one: its bytes at least the matrix's) to the move in the background, once; the tokens are those of an engine
    that never moves them."""
    asked = []
    monkeypatch.setattr(model_runner, "HUGE_PAGES_AFTER", 12)
    monkeypatch.setattr(hugepages, "collapse_in_background", lambda regions: asked.append(list(regions)) or "thread")
    model = packing.prepare(small_model(), "cpu", "float32")
    runner = engine.Engine(model, Tokens(70), max_batch=2)
    first = run(runner, [Request([1, 2], 5, temperature=0), Request([3], 6, temperature=0)])
    moving = runner.model_runner
    assert asked == [] and moving.passes == 7 and moving.huge_pages is None  # (the two rows decode in one pass)
    second = run(runner, [Request([1, 2], 5, temperature=0)])
    layers = [m for m in model.modules() if isinstance(m, packing.RowsLinear)]
    assert asked == [[layer.memory() for layer in layers]] and runner.model_runner.huge_pages == "thread"
    assert len(layers) == 4 * 2 + 1 and all(isinstance(layer, packing.PackedLinear) for layer in layers)
    assert all(size >= layer.out_features * layer.in_features * 4 for layer, (_, size) in zip(layers, asked[0]))
    run(runner, [Request([4], 30, temperature=0)])
    assert len(asked) == 1  # once

    monkeypatch.undo()  # the real move, in its thread
    moved = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2)
    for _ in range(model_runner.HUGE_PAGES_AFTER // 10 + 1):  # requests too short to move at once, enough to pay for it
        assert run(moved, [Request([9], 10, temperature=0)])
    moved.model_runner.huge_pages.join(timeout=60)
    assert not moved.model_runner.huge_pages.is_alive()
    again = run(moved, [Request([1, 2], 5, temperature=0), Request([3], 6, temperature=0)])
    assert again == first and again[:1] == second


def test_a_request_long_enough_to_pay_for_the_move_has_the_weights_moved_at_once_on_every_thread(monkeypatch):
    """A request that may decode HUGE_PAGES_AFTER tokens more (max_tokens less those it has) has the weights moved
    before it decodes (after its prompt's pass), at once and on the process's threads, not in the background; a
    shorter one leaves them; and the tokens are those of an engine that never moves them."""
    calls, real = [], hugepages.collapse
    monkeypatch.setattr(model_runner, "HUGE_PAGES_AFTER", 12)
    monkeypatch.setattr(hugepages, "collapse_in_background", lambda regions: calls.append("background") or "thread")

    def collapse(regions, threads=1):
        calls.append((runner.model_runner.passes, threads))
        return real(regions, threads)

    monkeypatch.setattr(hugepages, "collapse", collapse)
    runner = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2)
    short = run(runner, [Request([1, 2], 11, temperature=0)])  # (its prompt's pass gives its first token)
    assert calls == [] and runner.model_runner.huge_pages is None and runner.model_runner.passes == 11
    long = run(runner, [Request([3], 13, temperature=0)])  # 12 passes to come after its prompt's
    assert calls == [(12, torch.get_num_threads())]
    assert runner.model_runner.huge_pages is not None  # (after its prompt's pass)
    monkeypatch.undo()
    never = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=2)
    assert run(never, [Request([1, 2], 11, temperature=0)]) == short
    assert run(never, [Request([3], 13, temperature=0)]) == long and never.model_runner.huge_pages is None


def test_collapse_shares_the_pages_out_among_threads_and_backs_the_same_memory():
    """Two threads move what one does: every huge page of a 6 MiB region that begins on one (3 of them), the
    contents unchanged."""
    tensors = [torch.arange(8 * MIB // 4, dtype=torch.int32) + i for i in range(2)]  # 8 MiB each, written
    starts = [-(-t.data_ptr() // (2 * MIB)) * 2 * MIB for t in tensors]  # (the first huge page inside each)
    if hugepages.collapse([(starts[0], 6 * MIB)]) < 6 * MIB:
        pytest.skip("this kernel backs no memory with huge pages on request (MADV_COLLAPSE: Linux 6.1+, THP on), "
                    "or not 3 of them now")
    assert hugepages.collapse([(starts[1], 6 * MIB)], threads=2) == 6 * MIB
    assert anon_huge_bytes(starts[1]) >= 6 * MIB
    assert all(torch.equal(t, torch.arange(8 * MIB // 4, dtype=torch.int32) + i) for i, t in enumerate(tensors))
