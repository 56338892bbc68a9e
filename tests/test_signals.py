"""Signals: SIGINT/SIGTERM save and exit 0; SIGKILL in the middle of a save leaves a loadable checkpoint."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT, tiny_train_args, train
from stopping import StopFlag


def start(script, *args):
    """Start a script; threads move its stdout lines into proc.lines and its stderr into proc.err, so
    that no read can block past a timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.lines, proc.err = queue.Queue(), []
    threading.Thread(target=lambda: [proc.lines.put(line) for line in proc.stdout] + [proc.lines.put(None)],
                     daemon=True).start()
    threading.Thread(target=lambda: proc.err.extend(proc.stderr), daemon=True).start()
    return proc


def finish(proc, timeout=120):
    """Wait for proc to end (killing it after timeout seconds); return (stdout not read yet, stderr)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    lines = []
    while (line := proc.lines.get(timeout=10)) is not None:
        lines.append(line)
    time.sleep(0.1)  # the stderr thread sees the end of the pipe
    return "".join(lines), "".join(proc.err)


def wait_for_line(proc, pattern, timeout=120):
    """Read proc's stdout until a line matches pattern (at most timeout seconds); return everything read."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"no line matching {pattern!r}; got:\n{''.join(seen)}\n{finish(proc)[1]}")


def wait_for_file(path, proc, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared:\n{finish(proc)}")
        time.sleep(0.05)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_resumes_at_the_right_iteration(tmp_path, char_data, sig):
    out = tmp_path / "out"

    def args(**kw):
        return tiny_train_args(char_data, out, eval_interval=10**9, ckpt_interval=0, warmup_iters=2,
                               lr_decay_iters=1000, dropout=0.1, **kw)

    proc = start("train.py", *args(max_iters=10**6))
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
    assert load(out / "ckpt.pt")["iter_num"] == k

    resumed = train(*args(max_iters=k + 3, init_from="resume"))
    assert f"resuming from {out}/ckpt.pt at iteration {k}" in resumed.stdout
    assert re.findall(r"^iter (\d+):", resumed.stdout, re.M) == [str(k + 1), str(k + 2), str(k + 3)]
    if sig == signal.SIGINT:
        return
    # and it continues exactly where it stopped: the same weights as a run of k + 3 iterations straight
    train(*tiny_train_args(char_data, tmp_path / "straight", eval_interval=10**9, ckpt_interval=0,
                           warmup_iters=2, lr_decay_iters=1000, dropout=0.1, max_iters=k + 3))
    a, b = load(out / "ckpt.pt")["model"], load(tmp_path / "straight" / "ckpt.pt")["model"]
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


def test_sigkill_while_saving_leaves_a_checkpoint_that_loads_and_resumes(tmp_path, char_data):
    out, flag = tmp_path / "out", tmp_path / "paused"
    args = tiny_train_args(char_data, out, max_iters=20, ckpt_interval=4, eval_interval=10**9)
    # save 1 writes ckpt.pt at iteration 4; save 2 (iteration 8) stops half way through its temporary file
    proc = start("tests/faulty_train.py", "pause_in_save=2", f"pause_flag={flag}", "--", *args)
    wait_for_file(flag, proc)
    temporary = [p for p in out.iterdir() if p.name not in ("ckpt.pt", "metrics.jsonl")]
    assert len(temporary) == 1 and temporary[0].stat().st_size > 0  # killed with a half-written file there
    proc.send_signal(signal.SIGKILL)
    finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGKILL

    ckpt = load(out / "ckpt.pt")  # the previous checkpoint, complete
    assert ckpt["iter_num"] == 4
    resumed = train(*tiny_train_args(char_data, out, max_iters=6, ckpt_interval=4, eval_interval=10**9,
                                     init_from="resume"))
    assert f"resuming from {out}/ckpt.pt at iteration 4" in resumed.stdout
    assert load(out / "ckpt.pt")["iter_num"] == 6
    # the killed run had logged iterations up to 8 in metrics.jsonl; the resumed run dropped 5..8 and
    # logged 5, 6: each step once (evaluations: at 0, and at the end, 6)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6]
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "ckpt.pt", "metrics.jsonl"]  # the stale temporary
    # file is gone
