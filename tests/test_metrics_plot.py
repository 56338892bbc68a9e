"""metrics.jsonl across a resume (each step once, in order) and plot.py's PNG of several runs."""

import json
import struct
import sys
from types import SimpleNamespace

import pytest

import metrics
import plot
from conftest import assert_one_error_line, run_in_process


def run_config(out_dir):
    return SimpleNamespace(out_dir=str(out_dir), eval_only=False, wandb_log=False)


def log_steps(m, first, last, eval_every=3):
    """What train.py records from iteration first to last: a log line after each optimizer step (the step
    that reaches s is logged as s), and an evaluation at every eval_every-th step, at first included."""
    for step in range(first, last + 1):
        if step > first:
            m.record(step, loss=5.0 - step / 10, lr=1e-3, tokens=step * 100, tokens_per_s=1000)
        if step % eval_every == 0:
            m.record(step, train_loss=5.0 - step / 10, val_loss=5.1 - step / 10, lr=1e-3, tokens=step * 100)


def test_a_resumed_run_logs_every_step_once_in_order(tmp_path):
    m = metrics.Metrics(run_config(tmp_path))
    log_steps(m, 0, 10)  # the run reached step 10, then was killed; its checkpoint is at step 6
    m.file.close()  # (killed: no close(); what was written was flushed)
    assert [r["step"] for r in metrics.read(tmp_path / "metrics.jsonl") if "loss" in r] == list(range(1, 11))
    m = metrics.Metrics(run_config(tmp_path), resume_step=6, redo_eval=True)  # resumes at 6, evaluates there again
    log_steps(m, 6, 12)
    m.close()
    records = metrics.read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6, 9, 12]
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)


def test_a_line_cut_short_by_a_kill_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo', encoding="utf-8")
    assert metrics.read(path) == [{"step": 1, "loss": 2.0}]


def write_run(out_dir, steps, hellaswag=False):
    out_dir.mkdir()
    with open(out_dir / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in steps:
            record = {"step": step, "train_loss": 4 - step / 100, "val_loss": 4.1 - step / 100, "tokens": step * 512}
            if hellaswag:
                record["hellaswag_acc_norm"] = 0.25 + step / 10000
            f.write(json.dumps(record) + "\n")
            f.write(json.dumps({"step": step + 1, "loss": 4 - step / 100, "tokens": (step + 1) * 512}) + "\n")
    return out_dir


def png_size(path):
    """Width and height from a PNG's bytes: the 8-byte signature, then the IHDR chunk (length, type, data)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_two_runs(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a", range(0, 100, 10)), write_run(tmp_path / "b", range(0, 50, 5))
    proc = run_in_process(plot.main, a, b, f"--out={tmp_path / 'runs.png'}", check=True)
    assert "runs.png" in proc.stdout
    assert png_size(tmp_path / "runs.png") == (1200, 450)  # two panels of 6 x 4.5 inches at 100 dpi
    c = write_run(tmp_path / "c", range(0, 50, 10), hellaswag=True)
    run_in_process(plot.main, a, c, f"--out={tmp_path / 'hs.png'}", check=True)
    assert png_size(tmp_path / "hs.png") == (1800, 450)  # and the HellaSwag panel


def test_plot_errors(tmp_path, monkeypatch):
    write_run(tmp_path / "a", range(3))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("", encoding="utf-8")
    for missing in ("nothere", "empty"):
        proc = run_in_process(plot.main, tmp_path / "a", tmp_path / missing, f"--out={tmp_path / 'x.png'}")
        assert_one_error_line(proc, str(tmp_path / missing))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    proc = run_in_process(plot.main, tmp_path / "a", f"--out={tmp_path / 'x.png'}")
    assert_one_error_line(proc)
    assert proc.stderr.strip() == "error: plot.py needs matplotlib: pip install matplotlib==3.11.2"
    assert not (tmp_path / "x.png").exists()
