"""Signals: SIGINT/SIGTERM save and exit 0; SIGKILL in the middle of a save leaves a loadable checkpoint; one
run at a time in an out_dir."""

import json
import os
import re
import signal
import time

import socket

import pytest
import torch

from conftest import assert_one_error_line, finish, kill_tree, load_checkpoint, tiny_train_args, train, wait_for_line
from machinery.distributed import StopFlag


def wait_for_file(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc)
            raise AssertionError(f"{path} never appeared:\n{finish(proc)}")
        time.sleep(0.05)



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_resumes_at_the_right_iteration(tmp_path, char_data, sig, start_script):
    out = tmp_path / "out"

    def args(**kw):
        return tiny_train_args(char_data, out, eval_interval=10**9, ckpt_interval=0, warmup_iters=2,
                               lr_decay_iters=1000, dropout=0.1, **kw)

    proc = start_script("train.py", *args(max_iters=10**6))
    before = wait_for_line(proc, r"^iter 3: loss")
    proc.send_signal(sig)
    stdout, stderr = finish(proc)
    stdout = before + stdout
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    m = re.search(rf"stopped by {sig.name} at iteration (\d+); checkpoint saved in (\S+)\. "
                  rf"Resume with the same command and --init_from=resume", stdout)
    assert m, stdout[-2000:]
    k = int(m[1])
    assert m[2] == f"{out}/ckpt.pt"
    assert re.findall(r"^iter (\d+):", stdout, re.M)[-1] == str(k)  # the step in progress was finished
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == k

    resumed = train(*args(max_iters=k + 3, init_from="resume"))
    assert f"resuming from {out}/ckpt.pt at iteration {k}" in resumed.stdout
    assert re.findall(r"^iter (\d+):", resumed.stdout, re.M) == [str(k + 1), str(k + 2), str(k + 3)]
    if sig == signal.SIGINT:
        return
    # and it continues exactly where it stopped: the same weights as a run of k + 3 iterations straight
    train(*tiny_train_args(char_data, tmp_path / "straight", eval_interval=10**9, ckpt_interval=0,
                           warmup_iters=2, lr_decay_iters=1000, dropout=0.1, max_iters=k + 3))
    a, b = load_checkpoint(out / "ckpt.pt")["model"], load_checkpoint(tmp_path / "straight" / "ckpt.pt")["model"]
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_second_signal_acts_as_usual():
    """Ctrl-C twice interrupts at once (the atomic save keeps the previous checkpoint whole)."""
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        stop = StopFlag()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.name == "SIGTERM" and calls == []  # the first one only asks the loop to stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # the second one goes to the handler that was there before
        stop.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigkill_while_saving_leaves_a_checkpoint_that_loads_and_resumes(tmp_path, char_data, start_script):
    out, flag = tmp_path / "out", tmp_path / "paused"
    args = tiny_train_args(char_data, out, max_iters=20, ckpt_interval=4, eval_interval=10**9)
    # save 1 writes ckpt.pt at iteration 4; save 2 (iteration 8) stops half way through its temporary file
    proc = start_script("tests/faulty_train.py", "pause_in_save=2", f"pause_flag={flag}", "--", *args)
    wait_for_file(flag, proc)
    temporary = [p for p in out.iterdir() if p.name not in ("ckpt.pt", "metrics.jsonl", "train.lock")]
    assert len(temporary) == 1 and temporary[0].stat().st_size > 0  # killed with a half-written file there
    proc.send_signal(signal.SIGKILL)
    finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGKILL

    ckpt = load_checkpoint(out / "ckpt.pt")  # the previous checkpoint, complete
    assert ckpt["iter_num"] == 4
    resumed = train(*tiny_train_args(char_data, out, max_iters=6, ckpt_interval=4, eval_interval=10**9,
                                     init_from="resume"))
    assert f"resuming from {out}/ckpt.pt at iteration 4" in resumed.stdout
    assert load_checkpoint(out / "ckpt.pt")["iter_num"] == 6
    # the killed run had logged iterations up to 8 in metrics.jsonl; the resumed run dropped 5..8 and
    # logged 5, 6: each step once (evaluations: at 0, and at the end, 6)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6]
    # the stale temporary file is gone
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "ckpt.pt", "metrics.jsonl", "train.lock"]


def test_a_second_run_on_an_out_dir_in_use_stops_naming_the_first_and_writes_nothing(tmp_path, char_data,
                                                                                     start_script):
    out = tmp_path / "out"
    first = start_script("train.py", *tiny_train_args(char_data, out, max_iters=10**6, eval_interval=10**9))
    wait_for_line(first, r"^iter 2: loss")
    first.send_signal(signal.SIGSTOP)  # frozen, holding its lock: what changes in out_dir now is the second's doing
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    second = train(*tiny_train_args(char_data, out, max_iters=5), check=False)
    assert_one_error_line(second, f"out_dir {out} is in use by another training run (pid {first.pid} on "
                                  f"{socket.gethostname()}, started ", "train.py", "pick another --out_dir")
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before  # nothing written
    first.send_signal(signal.SIGKILL)  # the kernel releases a dead run's lock: the next run starts
    finish(first)
    third = train(*tiny_train_args(char_data, out, max_iters=5))
    assert "iter 5: loss" in third.stdout
    assert json.loads((out / "train.lock").read_text())["pid"] == os.getpid()  # (the last holder's pid)


def test_the_lock_is_released_when_a_run_ends_in_this_process(tmp_path, char_data, monkeypatch):
    from machinery.training import outdir
    import train as train_script
    from machinery.errors import UserError

    out = tmp_path / "out"
    held = outdir.claim(str(out))  # another holder (flock: another open file, even in this process)
    proc = train(*tiny_train_args(char_data, out, max_iters=2), check=False)
    assert_one_error_line(proc, f"pid {os.getpid()}")
    held.release()
    train(*tiny_train_args(char_data, out, max_iters=2))  # a finished run leaves it free
    with monkeypatch.context() as m:
        m.setattr(train_script.Trainer, "optimizer_step", lambda *a: (_ for _ in ()).throw(UserError("boom")))
        assert_one_error_line(train(*tiny_train_args(char_data, out, max_iters=4, init_from="resume"),
                                    check=False), "boom")
    train(*tiny_train_args(char_data, out, max_iters=4, init_from="resume"))  # so does one that failed
