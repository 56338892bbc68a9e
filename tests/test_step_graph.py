"""train.py's step as one CUDA graph (machinery/training/step_graph.py), proved on the CPU: CUDA's graph is stood in for by
Recorded, which records the ATen ops of the captured function, with the tensors and the numbers they were given, and
replays those ops, as a graph does: a Python number is baked in at capture, a tensor is read at every replay, and a
read of a tensor's value on the host fails the capture. With it, in float32: the graphed step is the eager step bit
for bit (AdamW and Muon, a changing learning rate and momentum, clipping, accumulation, dropout); the warm-up and
capture leave no trace; resume is exact, across graphed and eager runs too; the static inputs hold each step's
batches and alias nothing; the non-finite mark still works; a failed capture says so and goes on eagerly; and the
decision. What needs a real GPU is in tests/test_cuda.py."""

import contextlib
import re
import shutil
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from conftest import assert_one_error_line, load_checkpoint, tiny_train_args, train
from machinery.training import step_graph
from machinery.weights import checkpoint
from machinery.configurator import parse
from machinery.errors import UserError
from optimizers import DeviceNumbers, get_lr, muon_momentum, set_schedule
from test_resume import assert_same, logged_losses
import train as train_script

aten = torch.ops.aten
# ops that read a tensor's value on the host: on CUDA a sync, which a capture refuses
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
# every step at another learning rate (warmup, then the cosine) and, with Muon, another momentum; the gradients
# clipped (their norm is above 0.1 in every step: checked), 2 micro-batches a step, dropout
SETTINGS = dict(gradient_accumulation_steps=2, dropout=0.1, grad_clip=0.1, learning_rate=3e-3, min_lr=3e-4,
                warmup_iters=2, lr_decay_iters=6, max_iters=6, muon_momentum_warmup=4, eval_at_start=False)
STEPS = 5


class Recorder(TorchDispatchMode):
    """The ATen ops run under it, with their arguments and results (profiler marks left out: no computation)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a tensor's value on the host during the capture")
        out = func(*args, **(kwargs or {}))
        if func.namespace != "profiler":
            self.ops.append((func, args, kwargs or {}, out))
        return out


class Recorded:
    """CUDA's graph on the CPU (step_graph.CudaGraph's methods): capture runs fn once, as a capture runs its Python,
    recording its ops; replay runs those ops again, each on the tensors it was given, or on what the replay has
    made in their place. calls counts the calls of each method."""

    def __init__(self, device="cpu"):
        self.ops, self.calls = None, Counter()

    def warm_up(self, fn, times):
        self.calls["warm_up"] += 1
        for _ in range(times):
            fn()

    def capture(self, fn):
        self.calls["capture"] += 1
        recorder = Recorder()
        with recorder:
            fn()
        self.ops = recorder.ops

    @torch.no_grad()
    def replay(self):
        self.calls["replay"] += 1
        made = {}  # id of a tensor the capture made -> the one this replay made in its place

        def now(a):
            return made.get(id(a), a) if isinstance(a, torch.Tensor) else a

        for func, args, kwargs, out in self.ops:
            result = func(*tree_map(now, args), **tree_map(now, kwargs))
            for captured, replayed in zip(tree_leaves(out), tree_leaves(result)):
                if isinstance(captured, torch.Tensor):
                    made[id(captured)] = replayed


@pytest.fixture(scope="module")
def data_dir(module_data):
    return module_data


@pytest.fixture
def trainers(tmp_path, data_dir):
    """trainers(graphed, **settings) -> a Trainer of SETTINGS on the CPU in float32 (its own out_dir), graphed with
    Recorded or eager; each releases its out_dir at the test's end. (Dropout draws from torch's global generator,
    which making a Trainer seeds: a test makes one, runs it, then the next.)"""
    made = []

    def make(graphed, **settings):
        out = tmp_path / f"out{len(made)}"
        trainer = train_script.Trainer(parse(train_script.TrainConfig,
                                             tiny_train_args(data_dir, out, **SETTINGS | settings)))
        made.append(trainer)
        assert trainer.step_graph is None  # (auto on the CPU: off)
        if graphed:
            trainer.step_graph = step_graph.GraphedStep(trainer, Recorded())
        return trainer

    yield make
    for trainer in made:
        trainer.out_dir_lock.release()


def steps(trainer, n, batch=None):
    """n iterations of train.py's loop (the schedule, then the step) from batch (None: the next one); their losses,
    and the next batch."""
    x, y = batch or trainer.next_batch()
    losses = []
    for _ in range(n):
        set_schedule(trainer.optimizer, trainer.iter_num, trainer.cfg)
        loss, x, y = trainer.optimizer_step(x, y)
        trainer.iter_num += 1
        losses.append(loss.detach().clone())
    return losses, (x, y)


def state(trainer):
    """What training keeps: weights, optimizer state, the non-finite mark, every RNG and the batch sampler."""
    return {"model": trainer.raw_model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "nonfinite_at": trainer.nonfinite.at, "rank": checkpoint.rank_state(trainer.train_sampler.state_dict())}


def copied(tree):
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_graphed_step_is_the_eager_step_bit_for_bit(trainers, monkeypatch, optimizer):
    norms, clip = [], torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(clip(*a, **k)) or norms[-1])
    eager = trainers(False, optimizer=optimizer)
    expected, after = steps(eager, STEPS)
    expected_state = copied(state(eager))
    assert len(norms) == STEPS and min(norms) > SETTINGS["grad_clip"]  # (the eager step clipped every time)
    graphed = trainers(True, optimizer=optimizer)
    got, after_graphed = steps(graphed, STEPS)
    assert graphed.step_graph.graph.calls == {"warm_up": 1, "capture": 1, "replay": STEPS}
    # (the warm-up's steps and the capture's ran train.py's step in Python; the replays, the ops recorded)
    assert len(norms) == STEPS + step_graph.WARMUP_STEPS + 1
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), (expected, got)
    assert_same(expected_state, state(graphed), "state")
    assert_same(after, after_graphed, "the next batch")
    # (each step had a learning rate and a Muon momentum of its own)
    assert len({get_lr(it, eager.cfg) for it in range(STEPS)}) == len({muon_momentum(it, eager.cfg)
                                                                       for it in range(STEPS)}) == STEPS

    # control: a graph that kept the numbers of its capture (step 0's learning rate) computes other steps
    stale = trainers(True, optimizer=optimizer)
    _, batch = steps(stale, 1)
    monkeypatch.setattr(DeviceNumbers, "fill", lambda self: None)
    losses = steps(stale, 2, batch)[0]
    assert torch.equal(losses[0], expected[1]) and not torch.equal(losses[1], expected[2])


@pytest.mark.parametrize("fresh", [True, False], ids=["new_optimizer", "optimizer_with_state"])
def test_the_warm_up_and_capture_leave_no_trace(trainers, monkeypatch, fresh):
    trainer = trainers(True, optimizer="muon")
    graphed, trainer.step_graph = trainer.step_graph, None
    if not fresh:
        steps(trainer, 1)  # an eager step first: the optimizer has state to keep
    before = copied(state(trainer))
    moved = []
    restore = step_graph.restore
    monkeypatch.setattr(step_graph, "restore", lambda t, saved: moved.append(
        not torch.equal(next(t.raw_model.parameters()), saved["tensors"][0])) or restore(t, saved))
    trainer.step_graph = graphed
    assert graphed.ready() and graphed.graph.calls == {"warm_up": 1, "capture": 1}
    assert moved == [True]  # the warm-up did train (and the capture, on the CPU, ran the step once more)
    after = state(trainer)
    if fresh:  # the optimizer's state, made by the warm-up, is as a first step finds it: zeros
        assert before["optimizer"]["state"] == {} and after["optimizer"]["state"]
        assert all(not v.any() for s in after["optimizer"]["state"].values() for v in s.values())
        before["optimizer"]["state"] = after["optimizer"]["state"]
    assert_same(before, after, "state")
    assert [type(g["lr"]) for g in trainer.optimizer.param_groups] == [float] * 3  # (the groups' floats are back)


@contextlib.contextmanager
def graphed_runs(monkeypatch):
    """Within: train.py's runs take the graph (decided on, Recorded for CUDA's graph)."""
    with monkeypatch.context() as m:
        m.setattr(step_graph, "decide", lambda *args: (True, None))
        m.setattr(step_graph, "CudaGraph", Recorded)
        yield


def test_resume_is_exact_graphed_and_from_graphed_to_eager_and_back(tmp_path, data_dir, monkeypatch):
    n = 2

    def run(out, graphed, **kw):
        args = tiny_train_args(data_dir, tmp_path / out, **SETTINGS | dict(optimizer="muon", eval_interval=100,
                                                                          ckpt_interval=0, max_iters=2 * n) | kw)
        with graphed_runs(monkeypatch) if graphed else contextlib.nullcontext():
            return train(*args)

    def resume(source, out, graphed):
        shutil.copytree(tmp_path / source, tmp_path / out)
        return run(out, graphed, init_from="resume")

    logs = {"eager": run("eager", False).stdout, "graphed": run("graphed_half", True, max_iters=n).stdout}
    run("eager_half", False, max_iters=n)
    logs["graphed, resumed graphed"] = resume("graphed_half", "graphed_graphed", True).stdout
    logs["graphed, resumed eagerly"] = resume("graphed_half", "graphed_eager", False).stdout
    logs["eager, resumed graphed"] = resume("eager_half", "eager_graphed", True).stdout
    expected = load_checkpoint(tmp_path / "eager" / "ckpt.pt")
    assert expected["iter_num"] == 2 * n
    for out in ("graphed_graphed", "graphed_eager", "eager_graphed"):
        got = load_checkpoint(tmp_path / out / "ckpt.pt")
        for key in ("model", "optimizer", "ranks"):
            assert_same(expected[key], got[key], f"{out}: {key}")
    # the log's lines as nanoGPT's, the same losses to the printed digit
    assert re.search(r"^iter 1: loss [\d.]+, time [\d.]+ms, tok/s [\d,]+$", logs["graphed"], re.M)
    graphed_iters = {k: v for k, v in logged_losses(logs["graphed"]).items() if k.startswith("iter")}
    assert len(graphed_iters) == n and graphed_iters.items() <= logged_losses(logs["eager"]).items()
    for name in ("graphed, resumed graphed", "graphed, resumed eagerly", "eager, resumed graphed"):
        resumed = logged_losses(logs[name])
        assert {f"iter {i}" for i in range(n + 1, 2 * n + 1)} <= resumed.keys()
        assert resumed.items() <= logged_losses(logs["eager"]).items(), name


def test_the_static_inputs_hold_each_steps_batches_and_alias_nothing(trainers):
    trainer = trainers(True, gradient_accumulation_steps=3)
    graphed, fetched = trainer.step_graph, []
    next_batch = trainer.next_batch
    trainer.next_batch = lambda: fetched.append(next_batch()) or fetched[-1]
    static = graphed.xs + graphed.ys
    assert len(static) == 6 and len({t.untyped_storage().data_ptr() for t in static}) == 6
    batch = trainer.next_batch()
    for step in range(3):
        _, batch = steps(trainer, 1, batch)
        batches = fetched[3 * step:3 * step + 3]  # this step's: the one given, and the 2 it fetched
        for (bx, by), sx, sy in zip(batches, graphed.xs, graphed.ys):
            assert torch.equal(sx, bx) and torch.equal(sy, by)
            assert {bx.untyped_storage().data_ptr(), by.untyped_storage().data_ptr()}.isdisjoint(
                t.untyped_storage().data_ptr() for t in static)
    assert not torch.equal(fetched[0][0], fetched[3][0])  # (refilled: other batches each step)
    assert batch[0] is fetched[-1][0]  # the next batch, fetched after the step's


def test_a_non_finite_loss_is_still_caught_when_graphed(trainers):
    trainer = trainers(True)
    _, batch = steps(trainer, 1)
    trainer.nonfinite.check()  # (finite so far)
    with torch.no_grad():
        trainer.raw_model.blocks[0].attn.qkv.weight[0, 0] = float("nan")  # in place: the graph reads it
    steps(trainer, 2, batch)
    with pytest.raises(UserError, match="the loss became NaN or infinite in iteration 2;"):
        trainer.nonfinite.check()


def test_a_host_sync_fails_the_capture_which_says_so_in_one_line_and_the_steps_run_eagerly(trainers, capsys):
    expected, _ = steps(eager := trainers(False, optimizer="muon"), 3)
    expected_state = copied(state(eager))
    graphed = trainers(True, optimizer="muon")
    micro_step = graphed.micro_step

    def reading_the_loss(x, y, iteration):  # what a loop that logs every micro-step might do
        loss = micro_step(x, y, iteration)
        loss.item()
        return loss

    graphed.micro_step = reading_the_loss
    capsys.readouterr()
    got, _ = steps(graphed, 3)
    assert capsys.readouterr().out == (f"{step_graph.EAGER_NOTE} (RuntimeError: aten._local_scalar_dense.default "
                                       f"reads a tensor's value on the host during the capture)\n")
    assert graphed.step_graph.failed and graphed.step_graph.graph.calls == {"warm_up": 1, "capture": 1}
    # the warm-up and the capture ran their steps, and left no trace: the eager steps are the eager run's
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_same(expected_state, state(graphed), "state")


# ---------------------------------------------------------------------- the decision


@pytest.mark.parametrize("asked", [None, True])
def test_the_graph_is_on_for_cuda_in_one_process_and_off_where_it_cannot_apply(asked):
    def decide(device_type="cuda", distributed=False, parallel="ddp", dtype="bfloat16", chat=False):
        return step_graph.decide(asked, device_type, distributed, parallel, dtype, chat)

    assert decide() == (True, None)
    assert decide(dtype="float32") == (True, None)
    for why, kwargs in (("under torchrun with --parallel=ddp: DDP", dict(distributed=True)),
                        ("under torchrun with --parallel=fsdp: FSDP", dict(distributed=True, parallel="fsdp")),
                        ("dtype float16: the GradScaler's skipped steps need a host sync", dict(dtype="float16")),
                        ("a chat dataset: its batches change shape", dict(chat=True))):
        on, note = decide(**kwargs)
        assert not on and note.startswith(f"{step_graph.EAGER_NOTE} ({why}") and "\n" not in note
    assert decide(device_type="cpu") == decide(device_type="mps") == (False, None)


def test_cuda_graph_false_is_off_and_says_nothing():
    assert step_graph.decide(False, "cuda", False, "ddp", "bfloat16", False) == (False, None)
    assert step_graph.decide(False, "cuda", True, "ddp", "float16", True) == (False, None)
    assert train_script.TrainConfig().cuda_graph is None


@pytest.mark.parametrize("distributed", [False, True])
def test_build_makes_the_graphed_step_or_logs_why_not(monkeypatch, distributed):
    from types import SimpleNamespace

    logged = []
    monkeypatch.setattr(step_graph, "GraphedStep", lambda trainer: ("graphed", trainer))
    trainer = SimpleNamespace(cfg=SimpleNamespace(cuda_graph=None, parallel="fsdp"), device_type="cuda",
                              world=SimpleNamespace(distributed=distributed), dtype="bfloat16", token_mean=None,
                              log=logged.append)
    if not distributed:
        assert step_graph.build(trainer) == ("graphed", trainer) and logged == []
        return
    assert step_graph.build(trainer) is None
    assert logged == [f"{step_graph.EAGER_NOTE} (under torchrun with --parallel=fsdp: FSDP gathers and frees its "
                      f"shards from the host)"]


def test_cuda_graph_true_off_cuda_is_refused_in_one_line(tmp_path, data_dir):
    proc = train(*tiny_train_args(data_dir, tmp_path / "out", cuda_graph=True), check=False)
    assert_one_error_line(proc, "cuda_graph needs a CUDA device (--device=cuda); this run is on cpu")
    assert not (tmp_path / "out").exists()
