"""Data-parallel training under torchrun: 2 CPU processes over gloo, a tiny model, a few steps.

The runs go through tests/dist_worker.py, which is train.py with instruments: each rank reports the
batches it trained on, its val losses, its gradient exchanges (DDP all-reduces, FSDP reduce-scatters)
and the files it wrote; with
SHARED_BATCHES=1 the ranks split one global stream of micro-batches, so a 2-process run must
reproduce a single-process run that accumulates the same global batch.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (ROOT, START_ENV, descendants, finish, free_port, kill_tree, read_lines, run_in_process,
                      tiny_train_args, wait_for_line)
from dist_worker import Instruments, instrumented_run
from machinery import distributed
from machinery.data import meta
from machinery.errors import UserError
import train

WORKER = "tests/dist_worker.py"
# Every run here computes in float64 (weights and activations: FLOAT64=1, dtype=float32 so no autocast), since
# the point is the algorithm, not the rounding, and float64 rounds alike on every CPU (no bfloat16 choice).
# 2 processes then differ from 1 only by adding the same gradients in another order: a relative change of a few
# units of 2^-53 (~1e-15). An update moves it at most: AdamW's step g / (sqrt(v) + eps) by lr (1e-2) times that
# relative change; Muon's Newton-Schulz multiplies a perturbation of the normalised update by at most the
# product of its steps' linear coefficients (Polar Express: ~988, in the weakest directions), times muon_lr
# (0.02) and its shape scale (<= 2); a few steps of such drift stay below 1e-10. A real fault (a micro-batch
# trained twice or on the wrong rank, a gradient not averaged, a wrong shard) moves weights by ~lr = 1e-2.
TOL = 1e-9


def train_args(data_dir, out_dir, **overrides):
    """4 global micro-batches per step (2 per rank), clipping active, lr high enough for visible steps."""
    settings = dict(gradient_accumulation_steps=4, learning_rate=1e-2, grad_clip=0.5, eval_interval=1000,
                    lr_decay_iters=20, ckpt_interval=0, dtype="float32")  # (float32: no autocast; see TOL)
    settings.update(overrides)
    return tiny_train_args(data_dir, out_dir, **settings)


def worker_env(report_dir, **extra):
    # one thread per process, like torchrun: the machine's cores are shared by the test runs
    return {"REPORT_DIR": str(report_dir), "OMP_NUM_THREADS": "1", "FLOAT64": "1",
            **{k: str(v) for k, v in extra.items()}}


def job_env(report_dir, **extra):
    """The environment of a job's processes (but for torchrun's RANK and the rest, which it sets for each rank):
    the test run's own (conftest.START_ENV) and the settings."""
    return dict(START_ENV, PYTHONUNBUFFERED="1", WANDB_MODE="offline", **worker_env(report_dir, **extra))


def torchrun_argv(script, args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
            *map(str, args)]


# The processes a test starts for a job (a launch's ranks; torchrun's agent, whose workers it starts itself, as new
# processes) are forked (tests/zygote.py) from Pythons that have imported what they import before they train (the
# agent: before it starts its workers); the variables that differ between jobs and ranks are read when they run.
JOB_IMPORTS = ("dist_worker", "torch._dynamo", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
               "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing.errors",
               "torch.distributed.elastic.rendezvous.utils", "torch.numa.binding")
RUNTIME_VARIABLES = ("REPORT_DIR", "SHARED_BATCHES", "FLOAT64", "FAIL_RANK", "FAIL_ITER", "SIGTERM_RANK",
                     "SIGTERM_ITER", "SETUP_PAUSE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_zygotes(zygotes, n, **env):
    """The first n Zygotes a job's processes of job_env(..., **env) are forked from (started now, those that are not
    yet: they then import while the test goes on)."""
    return zygotes(JOB_IMPORTS, RUNTIME_VARIABLES, job_env("", **env), n)


def torchrun(args, report_dir, zygotes, spawn, nproc=2, **env):
    """tests/dist_worker.py under torchrun (its agent through spawn: the agent and its workers, which run in
    sessions of their own, are killed when the test ends, however it ends); the agent, read by read_lines."""
    full_env = job_env(report_dir, **env)
    zygote, = job_zygotes(zygotes, 1, **env)
    return read_lines(spawn(torchrun_argv(WORKER, args, nproc), popen=zygote.popen, cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def launch(args, report_dir, nproc=2, timeout=300, zygotes=None, **env):
    """tests/dist_worker.py as nproc processes joined as torchrun's would be (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT: env:// rendezvous), started directly: the equivalence tests need the processes, not
    torchrun's agent (which costs a Python and torch start-up per launch); with zygotes (conftest's fixture) each
    rank is forked from a Python of its own that has already imported torch and train.py (no start-up at all).
    The CompletedProcess: rank 0's stdout, every rank's stderr, the first non-zero exit status. Every process is
    killed on the way out."""
    port = free_port()
    envs = [dict(job_env(report_dir, **env), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for rank in range(nproc)]
    if zygotes is not None:
        return launch_forked(args, report_dir, envs, timeout, zygotes)
    procs = []
    try:
        for rank_env in envs:
            procs.append(subprocess.Popen([sys.executable, WORKER, *map(str, args)], cwd=ROOT, env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    status = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(WORKER, status, outputs[0][0], "".join(err for _, err in outputs))


def launch_forked(args, report_dir, envs, timeout, zygotes):
    """launch()'s ranks forked from zygotes, rank r from the r-th (output through files in report_dir)."""
    pool = job_zygotes(zygotes, len(envs))
    report_dir.mkdir(parents=True, exist_ok=True)
    files = [(report_dir / f"stdout{rank}", report_dir / f"stderr{rank}") for rank in range(len(envs))]
    pids, deadline = [], time.time() + timeout
    try:
        for zygote, rank_env, (out, err) in zip(pool, envs, files):
            pids.append(zygote.start([WORKER, *args], rank_env, out, err))
        statuses = [zygote.wait(pid, deadline - time.time()) for zygote, pid in zip(pool, pids)]
    finally:
        for zygote, pid in zip(pool, pids):
            zygote.kill(pid)
    return subprocess.CompletedProcess(WORKER, next((s for s in statuses if s), 0), files[0][0].read_text(),
                                       "".join(err.read_text() for _, err in files))


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def report(report_dir, rank):
    return json.loads((report_dir / f"rank{rank}.json").read_text())


def ckpt(out_dir):
    return torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)


def max_weight_diff(a, b):
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


@pytest.fixture(scope="module")
def data_dir(module_data):
    return module_data


@pytest.fixture(scope="module")
def single(data_dir, tmp_path_factory):
    """single(n): (checkpoint, report) of a 1-process run of n steps on the shared batch stream, in this process."""
    done = {}

    def get(max_iters, dataset="tiny", optimizer="adamw", **model):
        key = (max_iters, dataset, optimizer, *sorted(model.items()))
        if key not in done:
            out = tmp_path_factory.mktemp(f"single{max_iters}") / "out"
            args = [str(a) for a in train_args(data_dir, out, max_iters=max_iters, dataset=dataset,
                                               optimizer=optimizer, **model)]
            instruments = Instruments(shared=True, float64=True)
            run_in_process(lambda argv: instrumented_run(argv, instruments), *args, check=True)
            done[key] = ckpt(out), instruments.report()
        return done[key]

    return get


def check_steps_equal_single_process(out, rep, single, steps):
    """After `steps` optimizer steps on 2 ranks, the state of 1 process accumulating the same 4 micro-batches
    per step."""
    ref_ckpt, ref = single(steps)
    ranks = [report(rep, 0), report(rep, 1)]
    for k in range(steps):  # rank 0 trained on the first 2 of each step's 4 global micro-batches, rank 1 on the last 2
        assert ranks[0]["batches"][2 * k:2 * k + 2] + ranks[1]["batches"][2 * k:2 * k + 2] == \
            ref["batches"][4 * k:4 * k + 4]
    # the gradient that was clipped is the same mean over 4 micro-batches (scale included: Adam hides it)
    assert ref["grad_norms"][0] > 0.5  # the clipping was active
    for r in ranks:
        assert r["grad_norms"][:steps] == pytest.approx(ref["grad_norms"][:steps], rel=TOL)
    state = ckpt(out)
    assert state["iter_num"] == steps
    assert max_weight_diff(state, ref_ckpt) < TOL


def test_ddp_steps_equal_single_process_with_one_allreduce_each_and_sigterm_on_one_rank_stops_both(
        tmp_path, data_dir, single, zygotes):
    # (resuming: the llm.c shards test below, DDP then FSDP)
    out, rep = tmp_path / "out", tmp_path / "r1"
    # rank 1 gets a SIGTERM while it fetches a batch of iteration 2; both ranks stop after that step
    proc = ok(launch(train_args(data_dir, out, max_iters=100, eval_interval=2), rep, SHARED_BATCHES=1,
                     SIGTERM_RANK=1, SIGTERM_ITER=2, zygotes=zygotes))
    assert "(2 process(es) x 2 micro-steps x 4 x 32)" in proc.stdout
    assert "stopped by a signal on another rank at iteration 3" in proc.stdout
    assert report(rep, 1)["iter_num"] == 3
    check_steps_equal_single_process(out, rep, single, 3)
    ranks = [report(rep, 0), report(rep, 1)]
    for r in ranks:
        # 4 global micro-steps on 2 ranks: no_sync on the first of each rank's 2, one all-reduce on the
        # last (the model is far smaller than a DDP bucket, so one all-reduce is one hook call)
        assert r["exchanges"] == {"0": 1, "1": 1, "2": 1}
    # evaluation is split over the ranks and all-reduced: both hold the same numbers
    assert [it for it, _ in ranks[0]["losses"]] == [0, 2]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    ours = [p for p in ranks[0]["writes"] if p.startswith(str(tmp_path))]
    assert str(out / "ckpt.pt") in ours and str(out / "best.pt") in ours and str(out / "metrics.jsonl") in ours
    assert [p for p in ranks[1]["writes"] if p.startswith(str(tmp_path))] == []  # only rank 0 writes
    assert sorted(os.listdir(out)) == ["best.pt", "ckpt.pt", "metrics.jsonl", "train.lock"]


@pytest.fixture(scope="module")
def shard_dir(data_dir, tmp_path_factory):
    """The tiny corpus as llm.c shards written here by hand (a header of 256 int32: 20240520, 1, the number of
    tokens; then the tokens as uint16): val, then train in two shards; and the character dataset's meta.json
    (llm.c's come without: GPT-2 BPE, a vocabulary of 50304 that would make every step here 50 times slower)."""
    out = tmp_path_factory.mktemp("shards") / "tiny_shards"
    out.mkdir()
    train = np.fromfile(data_dir / "tiny" / "train.bin", dtype=np.uint16)
    val = np.fromfile(data_dir / "tiny" / "val.bin", dtype=np.uint16)
    for name, tokens in (("tiny_val_000000.bin", val), ("tiny_train_000001.bin", train[:len(train) // 2]),
                         ("tiny_train_000002.bin", train[len(train) // 2:])):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240520, 1, len(tokens))
        (out / name).write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    meta.write(meta.DatasetMeta.of(meta.read(data_dir / "tiny").make_tokenizer()), out)
    return out


def test_llm_c_shards_on_2_ranks_with_muon_equal_one_process_under_ddp_and_resume_exactly_under_fsdp(
        tmp_path, shard_dir, single, zygotes):
    # --dataset=DIR of llm.c shards, --optimizer=muon: 2 steps under DDP, then resumed under FSDP (whose Muon
    # step gathers the shards of each shape's matrices whole, stacked, for Newton-Schulz and keeps its own shard
    # of each result) to 4. 33 wide, 3 heads: the matrices' 33 and 99 rows split unevenly over 2 ranks (17 + 16)
    out, dataset, model = tmp_path / "out", str(shard_dir), dict(n_embd=33, n_head=3)

    def args(**kw):
        return train_args(shard_dir, out, dataset=dataset, optimizer="muon", **model, **kw)

    ok(launch(args(max_iters=2), tmp_path / "r1", SHARED_BATCHES=1, zygotes=zygotes))
    ranks = [report(tmp_path / "r1", r)["batches"] for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])  # every rank trains on other windows
    ref_ckpt, ref = single(2, dataset, "muon", **model)
    assert ranks[0][:2] + ranks[1][:2] == ref["batches"][:4]  # the one-process run's global batch, split
    assert max_weight_diff(ckpt(out), ref_ckpt) < TOL

    proc = ok(launch(args(max_iters=4, parallel="fsdp", init_from="resume"), tmp_path / "r2", SHARED_BATCHES=1,
                     zygotes=zygotes))
    assert f"resuming from {out}/ckpt.pt at iteration 2" in proc.stdout
    assert re.findall(r"^iter (\d+):", proc.stdout, re.M) == ["3", "4"]
    # one reduce-scatter per FSDP group (2 blocks and the root) per step, as in the AdamW test below
    assert report(tmp_path / "r2", 1)["exchanges"] == {"2": 3, "3": 3}
    muon_state = ckpt(out)["optimizer"]["state"]["blocks.0.attn.qkv.weight"]
    assert set(muon_state) == {"momentum_buffer", "step"} and muon_state["step"].item() == 4  # Muon's, not AdamW's
    assert max_weight_diff(ckpt(out), single(4, dataset, "muon", **model)[0]) < TOL  # the uninterrupted run's


def test_fsdp_step_equals_single_process_and_its_checkpoint_samples_in_one_process(tmp_path, data_dir, single,
                                                                                   zygotes):
    # (resuming under FSDP: the shards test above)
    out = tmp_path / "out"
    ok(launch(train_args(data_dir, out, max_iters=1, parallel="fsdp"), tmp_path / "r1", SHARED_BATCHES=1,
              zygotes=zygotes))
    check_steps_equal_single_process(out, tmp_path / "r1", single, 1)
    # one reduce-scatter per FSDP group (2 blocks and the root) per step: the first of each rank's 2
    # micro-steps keeps its gradients local (without that, 6)
    assert report(tmp_path / "r1", 0)["exchanges"] == report(tmp_path / "r1", 1)["exchanges"] == {"0": 3}
    state = ckpt(out)
    assert state["model"]["tok_emb.weight"].shape == (state["model_config"]["vocab_size"], 32)  # not a shard
    import sample as sample_script

    sample = run_in_process(sample_script.main, f"--out_dir={out}", "--ckpt=latest", "--num_samples=2",
                            "--max_new_tokens=10", "--device=cpu", check=True)
    assert sample.stdout.count("---------------") == 2


def alive(pid):
    """Is pid a process that has not ended (a zombie, ended but not yet reaped by its new parent, has)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_failure_on_one_rank_ends_the_job(tmp_path, data_dir, zygotes, spawn):
    out, rep = tmp_path / "out", tmp_path / "report"
    agent = torchrun(train_args(data_dir, out, max_iters=100), rep, zygotes, spawn, FAIL_RANK=1, FAIL_ITER=2)
    _, stderr = finish(agent, timeout=120)
    assert agent.returncode != 0
    assert "error: simulated failure on rank 1 at iteration 2" in stderr
    assert not (rep / "rank0.json").exists()  # rank 0 did not finish training either...
    assert not any(alive(int((rep / f"pid{r}").read_text())) for r in (0, 1))  # ...nor is it still at it


@pytest.fixture
def orphans():
    """A list to put pids in that the test's end kills, however it ends: torchrun's workers, once its agent is
    dead, are no one's descendants (spawn cannot find them), and a failed test must not leave them training."""
    pids = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["training", "setup"])
def test_sigkill_to_torchrun_stops_its_workers_and_the_next_launch_resumes(tmp_path, data_dir, spawn, zygotes,
                                                                           orphans, when):
    """torchrun starts its workers in sessions of their own, so SIGKILL to its agent (which cannot pass it on)
    used to leave them training into out_dir. They notice that their launcher died and stop as on SIGTERM,
    within seconds: killed while training (after step 3), or during their setup (which may be long: a token
    scan, a compilation; here a pause that lasts until the agent is dead), when they stop at their first step.
    (The workers draw their own batches here, as train.py's ranks do: all different.)"""
    out, rep = tmp_path / "out", tmp_path / "report"
    args = train_args(data_dir, out, max_iters=10**6, gradient_accumulation_steps=2)
    agent = torchrun(args, rep, zygotes, spawn, **({"SETUP_PAUSE": 60} if when == "setup" else {}))
    wait_for_line(agent, r"^iter 3: loss" if when == "training" else r"^setup paused")
    orphans += [pid for pid in descendants(agent.pid) if WORKER in open(f"/proc/{pid}/cmdline").read()]
    assert len(orphans) == 2
    os.kill(agent.pid, signal.SIGKILL)
    # a few seconds: the end of the setup pause (at the agent's death), then one step; or one step of this tiny model
    deadline = time.time() + 10
    while any(alive(pid) for pid in orphans) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in orphans), "workers still running seconds after their launcher died"
    stopped = wait_for_line(agent, r"^stopped by ", timeout=10)  # (their output still comes through the pipe)
    # (rank 0 says why it stopped: its launcher's death, or, if only rank 1 had seen it yet, a stop there)
    k = int(re.search(r"^stopped by (the death of its launcher|a signal on another rank) at iteration (\d+); "
                      r"checkpoint saved", stopped, re.M)[2])
    assert k == 1 if when == "setup" else k >= 3  # (log_interval 1: ranks look at every step)
    assert ckpt(out)["iter_num"] == k
    ranks = [report(rep, 0), report(rep, 1)]
    assert ranks[0]["iter_num"] == ranks[1]["iter_num"] == k
    assert not set(ranks[0]["batches"]) & set(ranks[1]["batches"])  # every rank trains on other windows
    # the next launch (here in one process: a checkpoint resumes under any number) finds out_dir free
    resumed = run_in_process(train.main, *train_args(data_dir, out, max_iters=k + 2, init_from="resume",
                                                     gradient_accumulation_steps=2), check=True)
    assert f"resuming from {out}/ckpt.pt at iteration {k}" in resumed.stdout
    assert re.findall(r"^iter (\d+):", resumed.stdout, re.M) == [str(k + 1), str(k + 2)]


def test_accumulation_must_divide_by_world_size():
    assert distributed.micro_steps(8, distributed.World(True, 1, 1, 4)) == 2  # 8 global micro-steps on 4 ranks
    with pytest.raises(UserError, match=r"gradient_accumulation_steps \(3\) must be divisible by the number of "
                                        r"processes \(2\)"):
        distributed.micro_steps(3, distributed.World(True, 0, 0, 2))
