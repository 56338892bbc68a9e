"""Exact resume: N iterations, then resume for N more, gives bit for bit what 2N iterations straight give."""

import json
import re

import torch

from conftest import assert_one_error_line, tiny_train_args, train

N = 6


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def logged_losses(stdout):
    """{'iter 3': '3.1234', 'step 4': 'train loss 3.2, val loss 3.3'} from the training log."""
    out = {f"iter {m[1]}": m[2] for m in re.finditer(r"^iter (\d+): loss ([^,]+),", stdout, re.M)}
    out.update({f"step {m[1]}": m[2] for m in re.finditer(r"^step (\d+): (train loss .*)$", stdout, re.M)})
    return out


def assert_same(a, b, where):
    """Exact equality of nested checkpoint data; tensors with torch.equal and the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_n_then_resume_n_equals_2n_straight(tmp_path, char_data):
    # dropout > 0 and 2 micro-steps, so dropout's RNG and the prefetched batch both have to be restored;
    # evaluations every 4 iterations, and the split run evaluates once more (at N, its end), so
    # evaluation must not disturb the training stream either
    def args(out, **kw):
        return tiny_train_args(char_data, tmp_path / out, dropout=0.2, gradient_accumulation_steps=2,
                               eval_interval=4, ckpt_interval=3, warmup_iters=2, lr_decay_iters=2 * N, **kw)

    straight = train(*args("straight", max_iters=2 * N))
    first = train(*args("split", max_iters=N))
    assert load(tmp_path / "split" / "ckpt.pt")["iter_num"] == N
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "ckpt.pt").write_bytes((tmp_path / "split" / "ckpt.pt").read_bytes())
    resumed = train(*args("split", max_iters=2 * N, init_from="resume"))
    assert f"resuming from {tmp_path / 'split'}/ckpt.pt at iteration {N}" in resumed.stdout

    a, b = load(tmp_path / "straight" / "ckpt.pt"), load(tmp_path / "split" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 2 * N
    assert a["optimizer"]["state"] and all(s["exp_avg"].any() for s in a["optimizer"]["state"].values())
    for key in ("model", "optimizer", "ranks", "scaler"):
        assert_same(a[key], b[key], key)

    # identical logged losses: every line of the straight run, to the printed digit
    straight_log = logged_losses(straight.stdout)
    split_log = {**logged_losses(first.stdout), **logged_losses(resumed.stdout)}
    assert set(straight_log) == {f"iter {i}" for i in range(1, 2 * N + 1)} | {"step 0", "step 4", "step 8", "step 12"}
    assert set(split_log) == set(straight_log) | {f"step {N}"}
    assert {k: split_log[k] for k in straight_log} == straight_log

    # metrics.jsonl: every step once, with the straight run's numbers (the split run also evaluated at N, its
    # end; tokens/s is a timing)
    def records(out):
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]

    split_records = records("split")
    assert [r for r in split_records if r["step"] != N or "loss" in r] == records("straight")
    assert [r["step"] for r in split_records if "val_loss" in r] == [0, 4, N, 8, 12]

    # control, so that the comparison above can fail: the same checkpoint with another dropout RNG
    # state resumes into different weights
    ckpt = load(tmp_path / "control" / "ckpt.pt")
    ckpt["ranks"][0]["rng"]["torch"] = torch.Generator().manual_seed(1).get_state()
    torch.save(ckpt, tmp_path / "control" / "ckpt.pt")
    train(*args("control", max_iters=2 * N, init_from="resume"))
    c = load(tmp_path / "control" / "ckpt.pt")
    assert not torch.equal(c["model"]["tok_emb.weight"], a["model"]["tok_emb.weight"])


def test_muon_resumes_exactly_and_refuses_another_optimizer(tmp_path, char_data):
    def args(out, **kw):
        return tiny_train_args(char_data, tmp_path / out, optimizer="muon", muon_lr=0.05, muon_momentum=0.9,
                               muon_momentum_warmup=N + 2, gradient_accumulation_steps=2, eval_interval=100, ckpt_interval=0,
                               lr_decay_iters=2 * N, **kw)

    train(*args("straight", max_iters=2 * N))
    train(*args("split", max_iters=N))
    refused = train(*args("split", max_iters=2 * N, init_from="resume"), "--optimizer=adamw", check=False)
    assert_one_error_line(refused, "optimizer=muon", "--optimizer=muon")
    train(*args("split", max_iters=2 * N, init_from="resume"))
    a, b = load(tmp_path / "straight" / "ckpt.pt"), load(tmp_path / "split" / "ckpt.pt")
    muon_state = a["optimizer"]["state"]["blocks.1.ffwd.fc.weight"]
    assert muon_state["momentum_buffer"].any() and muon_state["step"].item() == 2 * N
    assert [g["use_muon"] for g in a["optimizer"]["param_groups"]] == [True, False, False]
    assert a["optimizer"]["param_groups"][0]["momentum"] == 0.9
    for key in ("model", "optimizer", "ranks"):
        assert_same(a[key], b[key], key)


def test_wandb_offline_and_a_resumed_run_continues_the_wandb_run(tmp_path, char_data, monkeypatch):
    """wandb needs no login (offline mode); the run id goes into the checkpoint, and a resumed run
    continues the same wandb run."""
    out, wandb_dir = tmp_path / "out", tmp_path / "wandb"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(*tiny_train_args(char_data, out, max_iters=3, wandb_log=True, wandb_project="test"))
    run_id = load(out / "ckpt.pt")["wandb_run_id"]
    assert isinstance(run_id, str) and run_id
    train(*tiny_train_args(char_data, out, max_iters=5, wandb_log=True, wandb_project="test", init_from="resume"))
    assert load(out / "ckpt.pt")["wandb_run_id"] == run_id
    # wandb names each (offline) run's directory after the run id: both runs wrote to the same id
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith("-" + run_id) for run in runs), runs
    assert all(list(run.glob("*.wandb")) for run in runs)  # each run's log, to sync later with `wandb sync`
