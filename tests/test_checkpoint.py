"""Checkpoints: atomic saves, safe loading, clear errors for bad files, best vs latest, NaN guard,
and saves that never wait for an evaluation."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from machinery import fileio
from machinery.weights import checkpoint
import faults
from conftest import assert_one_error_line, assert_one_line, load_checkpoint, run_in_process, tiny_train_args
from machinery.errors import UserError
import sample
import train


@pytest.fixture(scope="module")
def trained(module_data):
    """A small char dataset and a trained out_dir (ckpt.pt and best.pt), made once for this file."""
    root = module_data.parent
    run_in_process(train.main, *tiny_train_args(module_data, root / "out", max_iters=6, eval_interval=3), check=True)
    return root


def faulty_run(monkeypatch, args, **fault_settings):
    """train.py in this process with faults injected (tests/faults.py); returns the CompletedProcess-like."""
    faults.inject({k: str(v) for k, v in fault_settings.items()}, monkeypatch.setattr)
    return run_in_process(train.main, *args)



# ---------------------------------------------------------------------- safe loading


class RunsShellCommand:
    """Unpickling this would run a shell command: what a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


class RunsPython:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


@pytest.mark.parametrize("payload", [RunsShellCommand, RunsPython])
def test_checkpoint_that_would_run_code_is_refused(tmp_path, trained, payload):
    marker = tmp_path / "MARKER"
    out = tmp_path / "out"
    out.mkdir()
    ckpt = load_checkpoint(trained / "out" / "ckpt.pt")  # a real checkpoint, with one poisoned entry added
    ckpt["note"] = payload(marker)
    torch.save(ckpt, out / "ckpt.pt")
    shutil.copy(out / "ckpt.pt", out / "best.pt")
    before = (out / "ckpt.pt").read_bytes()

    proc = run_in_process(train.main, *tiny_train_args(trained / "data", out, init_from="resume"))
    assert_one_error_line(proc, "refusing to load", "ckpt.pt", "could run code")
    proc = run_in_process(sample.main, f"--out_dir={out}", "--device=cpu", "--max_new_tokens=5")
    assert_one_error_line(proc, "refusing to load", "best.pt", "could run code")
    assert not marker.exists()
    assert (out / "ckpt.pt").read_bytes() == before

    # the payload is live: an unsafe load (which this repository never does) runs it
    torch.load(out / "ckpt.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("damage, words", [
    ("missing", ["not found"]),
    ("directory", ["is a directory"]),
    ("truncated", ["truncated or corrupt"]),
    ("empty", ["truncated or corrupt"]),
    ("random", ["truncated or corrupt"]),
    ("text", ["truncated or corrupt"]),
    ("zip_with_bad_pickle", ["truncated or corrupt"]),
    ("not_a_dict", ["not a model checkpoint"]),
])
def test_damaged_checkpoint_gives_a_clear_error(tmp_path, trained, damage, words):
    good = (trained / "out" / "ckpt.pt").read_bytes()
    path = tmp_path / "ckpt.pt"
    if damage == "directory":
        path.mkdir()
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "random":
        path.write_bytes(os.urandom(len(good)))
    elif damage == "text":
        path.write_text("hello")
    elif damage == "zip_with_bad_pickle":  # intact zip directory, garbage where the pickle should be
        torch.save({"model": {}}, path)
        data = bytearray(path.read_bytes())
        start = data.index(b"\x80\x02")  # the pickle protocol header
        data[start + 2:start + 12] = b"\xff" * 10
        path.write_bytes(bytes(data))
    elif damage == "not_a_dict":
        torch.save([torch.zeros(2)], path)
    with pytest.raises(UserError) as e:
        checkpoint.load(str(path))
    assert_one_line(e, *words)


# ---------------------------------------------------------------------- atomic saves


def test_failed_save_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save({"model": {"w": torch.ones(3)}}, str(path))
    before = path.read_bytes()

    # a full disk: the temporary file is written to /dev/full, which fails with ENOSPC
    real_open = open
    monkeypatch.setattr(fileio, "open", lambda file, mode, **kw: real_open("/dev/full", mode, **kw), raising=False)
    with pytest.raises(UserError, match="cannot write checkpoint .*ckpt.pt .*No space left on device.*intact"):
        checkpoint.save({"model": {"w": torch.zeros(1000)}}, str(path))
    monkeypatch.undo()
    # and a failure half way through serialising (an object torch.save cannot write)
    with pytest.raises(AttributeError, match="Can't (pickle|get local object)"):
        checkpoint.save({"model": {"w": torch.zeros(1000)}, "bad": lambda: 0}, str(path))

    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(3))


def test_saves_never_wait_for_an_evaluation(tmp_path, trained, monkeypatch):
    """ckpt_interval and the final save work with evaluations that never come, or that crash."""
    out, log = tmp_path / "out", tmp_path / "saves.jsonl"
    args = tiny_train_args(trained / "data", out, max_iters=7, ckpt_interval=3, eval_interval=10**9)
    # evaluation 1 is at iteration 0; evaluation 2, after the last step, crashes
    with pytest.raises(RuntimeError, match="injected evaluation crash"):
        faulty_run(monkeypatch, args, eval_crash=2, save_log=log)
    saves = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(s["file"], s["iter_num"]) for s in saves] == [("ckpt.pt", 3), ("ckpt.pt", 6), ("ckpt.pt", 7)]
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 7


# ---------------------------------------------------------------------- non-finite loss


@pytest.mark.parametrize("fault, log_interval, message", [
    # caught when the loss is logged, right after the step
    ("nan_from=5", 1, "the loss became NaN or infinite in iteration 5"),
    # logged rarely: caught by the save at iteration 6, which refuses to write
    ("nan_from=5", 10, "the loss became NaN or infinite in iteration 5"),
    # a finite loss with overflowing gradients: the weights are NaN, so the save at 6 refuses
    ("nan_grads_at=6", 1, "the weights became NaN or infinite by iteration 6"),
])
def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, trained, monkeypatch, fault,
                                                                 log_interval, message):
    out, log = tmp_path / "out", tmp_path / "saves.jsonl"
    args = tiny_train_args(trained / "data", out, max_iters=12, ckpt_interval=2, eval_interval=10**9,
                           log_interval=log_interval)
    name, value = fault.split("=")
    proc = faulty_run(monkeypatch, args, save_log=log, **{name: value})
    assert_one_error_line(proc, message, "stopping without saving", "untouched")
    saves = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(s["file"], s["iter_num"]) for s in saves] == [("ckpt.pt", 2), ("ckpt.pt", 4)]
    assert hashlib.sha256((out / "ckpt.pt").read_bytes()).hexdigest() == saves[-1]["sha256"]  # byte-identical
    assert all(torch.isfinite(v).all() for v in load_checkpoint(out / "ckpt.pt")["model"].values())


# ---------------------------------------------------------------------- best vs latest


def test_sample_uses_best_by_default_and_latest_on_request(tmp_path, trained):
    out = tmp_path / "out"
    out.mkdir()
    latest = load_checkpoint(trained / "out" / "ckpt.pt")
    best = dict(latest, model={k: v * 0.5 for k, v in latest["model"].items()})  # other weights, other text
    torch.save(best, out / "best.pt")
    torch.save(latest, out / "ckpt.pt")

    def generate(target, *extra):
        proc = run_in_process(sample.main, f"--out_dir={target}", "--device=cpu", "--num_samples=1",
                              "--max_new_tokens=40", "--start=ROMEO:", *extra)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    from_best, from_latest = generate(out / "best.pt"), generate(out / "ckpt.pt")
    assert from_best != from_latest
    assert generate(out) == from_best
    assert generate(out, "--ckpt=latest") == from_latest
    # before any improvement there is no best.pt: the default falls back to ckpt.pt
    (out / "best.pt").unlink()
    assert checkpoint.find(str(out)) == str(out / "ckpt.pt")
