"""Decoding steps launched ahead (engine.Engine's `ahead`, sample.py's and serve.py's --decode_ahead): the fixed step
of the next token launched before the host reads the tokens of the one before, run here on the CPU (the CUDA way,
fixed=True). Every request's events are exactly those of the plain steps, whatever ends it (a stop text met while
the next step is in flight, a stop token, max_tokens, block_size's window sliding), alongside rows that score their
tokens and requests that join while others decode; in a steady batch the launch comes before the read; the setting
is refused where no fixed step runs."""

import pytest
import torch

from machinery.generation import decode, engine, loading, model_runner, packing
from machinery.errors import UserError
from machinery.generation.request import Request
from test_engine import Tokens, small_model


def events(runner, requests, join=()):
    """Submit requests, step until all are done, submitting each of join's (step, request) at its step; each
    request's events as (id, text, logprob, top, finish_reason, prompt) tuples, in the order submitted."""
    generations, join, steps = [runner.submit(r) for r in requests], list(join), 0
    while join or not all(g.done for g in generations):
        while join and join[0][0] <= steps:
            generations.append(runner.submit(join.pop(0)[1]))
        runner.step()
        steps += 1
    return [[(t.id, t.text, t.logprob, t.top, t.finish_reason, t.prompt) for t in g] for g in generations]


def fixed_engine(ahead, block_size=16, max_batch=8):
    return engine.Engine(packing.prepare(small_model(block_size=block_size), "cpu", "float32"), Tokens(70),
                         max_batch=max_batch, fixed=True, ahead=ahead)


def generated(runner, request):
    g = runner.submit(request)
    while not g.done:
        runner.step()
    return [t.id for t in g if t.id is not None and not t.prompt]


def test_steps_launched_ahead_give_exactly_the_plain_steps_events():
    plain, ahead = fixed_engine(False), fixed_engine(True)
    assert ahead.model_runner.ahead and not plain.model_runner.ahead
    # a stop text two greedy tokens long that the greedy continuation of [3, 4] meets after its 6th token: the
    # row ends there while the next step, launched ahead, is in flight
    tokens = generated(plain, Request([3, 4], max_tokens=12, temperature=0))
    stop = Tokens(70).decode(tokens[6:8])
    assert stop not in Tokens(70).decode(tokens[:7])  # (it first appears there)
    sampled = generated(plain, Request([2, 2, 2], max_tokens=25, temperature=0.8, top_p=0.9, seed=2))
    end = next(t for i, t in enumerate(sampled) if i >= 4 and t not in sampled[:i])  # a stop token met at the 5th+
    requests = [Request([1, 5, 9, 2, 7], max_tokens=30, temperature=0),  # past block_size 16: slides
                Request([3, 4], max_tokens=20, temperature=0, stop=(stop,)),
                Request([8, 3], max_tokens=9, temperature=1.0, top_k=5, seed=1),
                Request([2, 2, 2], max_tokens=25, temperature=0.8, top_p=0.9, seed=2, stop_tokens=(end,)),
                Request([6, 1], max_tokens=7, temperature=1.0, seed=3, logprobs=2),  # scored: never ahead
                Request([4, 4, 4, 4], max_tokens=11, temperature=1.0, seed=4, echo=True),
                Request([5], max_tokens=6, temperature=0)]  # (its one prompt token fed by the fixed step)
    join = [(5, Request([7, 7], max_tokens=8, temperature=1.0, seed=5)),  # joins while the others decode
            (9, Request([9], max_tokens=12, temperature=0))]
    expected = events(plain, requests, join)
    assert [e[-1][4] for e in expected] == ["length", "stop", "length", "stop", "length", "length", "length",
                                            "length", "length"]  # (each way of ending happens)
    assert events(ahead, requests, join) == expected
    # alone too; and alone each request draws the tokens it draws among the others (the fixed step: a row's tokens
    # are its own; its log-probabilities may round otherwise on the CPU, whose products a batch's rows share)
    alone = [events(plain, [r])[0] for r in requests]
    assert [events(ahead, [r])[0] for r in requests] == alone
    assert [[e[0] for e in r] for r in alone] == [[e[0] for e in r] for r in expected[:len(requests)]]


def test_in_a_steady_batch_the_next_step_is_launched_before_the_tokens_are_read(monkeypatch):
    order, launch, read = [], decode.FixedStep.__call__, model_runner.Flight.read
    monkeypatch.setattr(decode.FixedStep, "__call__", lambda self, idx, pos: order.append("launch") or
                        launch(self, idx, pos))
    monkeypatch.setattr(model_runner.Flight, "read", lambda self: order.append("read") or read(self))
    runner = fixed_engine(True, block_size=32)
    requests = [Request([1, 2], max_tokens=6, temperature=0),
                Request([3, 4, 5], max_tokens=6, temperature=1.0, seed=0)]
    assert [len(r) for r in events(runner, requests)] == [6, 6]
    # the prompts' passes sample the first tokens (no fixed step); then the fixed step of the 2nd tokens launched,
    # the 3rd's launched before the 2nd's are read, ..., a 7th's launched before the 6th's are read (max_tokens
    # ends them there: it is discarded, see below)
    assert order == ["launch"] + ["launch", "read"] * 5
    assert runner.model_runner.flight is not None and all(g.done for g in runner.model_runner.flight.rows)


def test_a_row_that_ends_while_the_next_step_is_in_flight_has_that_token_discarded(monkeypatch):
    runner = fixed_engine(True, block_size=32)
    tokens = generated(fixed_engine(False, block_size=32), Request([7, 3], max_tokens=12, temperature=0))
    i = next(i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])  # the first token met anew
    launches, launch = [], decode.FixedStep.__call__
    monkeypatch.setattr(decode.FixedStep, "__call__", lambda self, idx, pos: launches.append(1) or
                        launch(self, idx, pos))
    ended = events(runner, [Request([7, 3], max_tokens=12, temperature=0,
                                    stop=(Tokens(70).decode([tokens[i]]),))])[0]
    assert [e[0] for e in ended] == tokens[:i + 1] and ended[-1][4] == "stop"  # (its text cut)
    # the steps that drew tokens 1..i (the prompt's pass drew the 0th), and the one launched ahead for token i + 1:
    # launched before token i was read, then discarded
    assert len(launches) == i + 1
    assert runner.model_runner.flight is not None and all(g.done for g in runner.model_runner.flight.rows)
    runner.step()  # it lands: nothing is emitted, and the engine decodes on
    assert runner.model_runner.flight is None
    assert generated(runner, Request([7, 3], max_tokens=12, temperature=0)) == tokens


def test_decode_ahead_is_refused_where_no_fixed_step_runs():
    with pytest.raises(UserError, match="decode_ahead applies to CUDA's fixed decoding step only"):
        engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), fixed=False, ahead=True)
    source = loading.EngineSource(device="cpu", decode_ahead=True)
    with pytest.raises(UserError, match="decode_ahead applies to CUDA's fixed decoding step only.*--device=cuda"):
        source.validate()
    loading.EngineSource(device="cpu", decode_ahead=False).validate()  # (off: nothing to refuse)
    cpu = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70))
    assert not cpu.model_runner.ahead  # the CPU's default
    assert engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), fixed=True).model_runner.ahead


def test_a_row_that_ends_at_block_size_fails_no_step_launched_for_the_others(monkeypatch):
    """A row that ends with block_size positions in its cache is still a running row when the next step is launched
    for the others: the position embedding must not be asked for its position. On the CPU that launch raised an
    IndexError, which the plain pass then covered in silence; on CUDA it is a device-side assert that ends the
    process (an H200 found it). So here no launch may fail, and the events are the plain steps'."""
    failures, launch = [], model_runner.ModelRunner._launch

    def recorded(self, rows, tokens):
        try:
            return launch(self, rows, tokens)
        except Exception as e:
            failures.append(e)
            raise
    monkeypatch.setattr(model_runner.ModelRunner, "_launch", recorded)
    plain, ahead = fixed_engine(False), fixed_engine(True)
    for max_tokens in range(12, 17):  # a 2-token prompt in block_size 16: it ends at, before and past the edge
        requests = [Request([1, 2], max_tokens=max_tokens, temperature=0),
                    Request([3], max_tokens=40, temperature=1.0, seed=max_tokens)]
        assert events(ahead, requests) == events(plain, requests)
    assert failures == []
