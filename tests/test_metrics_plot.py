"""metrics.jsonl across a resume (each step once, in order) and plot.py's figure of several runs: what each
curve holds, read back from the figure, against the records the test wrote."""

import json
import math
import random
import struct
import sys
from types import SimpleNamespace

import matplotlib.image as mpimg
import numpy as np
from matplotlib.colors import to_rgba

from conftest import assert_one_error_line, run_in_process
from machinery.training import metrics
import plot

plt = plot.import_pyplot()  # pyplot on the Agg backend (no screen)


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


def write_run(out_dir, last_step, eval_every, seed, hellaswag=False, nan_at=None):
    """A run's metrics.jsonl as train.py writes it: an evaluation every eval_every steps from step 0 and a log
    line after each step (a noisy falling loss, not finite at step nan_at); returns the records written."""
    rng = random.Random(seed)
    records = []
    for step in range(last_step + 1):
        if step:
            loss = math.nan if step == nan_at else 4 - step / 50 + rng.uniform(-0.3, 0.3)
            records.append({"step": step, "loss": loss, "lr": 1e-3, "tokens": step * 512, "tokens_per_s": 900.0})
        if eval_every and step % eval_every == 0:
            record = {"step": step, "train_loss": 4 - step / 60, "val_loss": 4.1 - step / 70, "lr": 1e-3,
                      "tokens": step * 512}
            if hellaswag:
                record.update(hellaswag_acc_norm=0.25 + step / 10000, hellaswag_acc=0.25 + step / 20000)
            records.append(record)
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


def smoothed(losses, w):
    """TensorBoard's debiased exponential moving average, in closed form: after the finite losses y_1..y_n,
    (1 - w) * sum_k w^(n-k) y_k / (1 - w^n); a loss that is not finite stays as it is, out of the average."""
    finite, out = [], []
    for y in losses:
        if not math.isfinite(y):
            out.append(y)
            continue
        finite.append(y)
        n = len(finite)
        out.append((1 - w) * sum(w ** (n - k) * finite[k - 1] for k in range(1, n + 1)) / (1 - w ** n))
    return out


def column(records, key, x):
    """(xs, ys) of the records with key, in the order written."""
    kept = [r for r in records if key in r]
    return [r[x] for r in kept], [r[key] for r in kept]


def assert_run_drawn(ax, name, records, x, w):
    """ax shows, for the run written as records: every logged loss by x (faint), its smoothed curve
    (opaque), and the evaluations' train and val loss (above both); nothing else of it."""
    lines = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith(name + " ")}
    assert sorted(lines) == sorted(f"{name} {what}" for what in ("loss", "loss, smoothed", "train (eval)",
                                                                 "val (eval)"))
    xs, losses = column(records, "loss", x)
    for label, ys in ((f"{name} loss", losses), (f"{name} loss, smoothed", smoothed(losses, w))):
        assert list(lines[label].get_xdata()) == xs
        # (the sums in another order than an average updated point by point: float rounding only)
        np.testing.assert_allclose(lines[label].get_ydata(), ys, rtol=1e-12, atol=0)  # (NaN where NaN)
    for label, key in ((f"{name} train (eval)", "train_loss"), (f"{name} val (eval)", "val_loss")):
        assert (list(lines[label].get_xdata()), list(lines[label].get_ydata())) == column(records, key, x)
        assert lines[label].get_zorder() > max(lines[f"{name} loss"].get_zorder(),
                                               lines[f"{name} loss, smoothed"].get_zorder())
    assert lines[f"{name} loss"].get_alpha() <= 0.5 and lines[f"{name} loss, smoothed"].get_alpha() in (None, 1)
    assert len({to_rgba(line.get_color(), alpha=1) for line in lines.values()}) == 1  # one colour per run
    return to_rgba(lines[f"{name} loss"].get_color(), alpha=1)


def test_plot_draws_the_logged_loss_smoothed_and_the_evaluations_by_step_and_tokens(tmp_path):
    a = write_run(tmp_path / "a", 40, eval_every=10, seed=1)
    b = write_run(tmp_path / "b", 25, eval_every=5, seed=2, nan_at=7)  # a step that diverged, then recovered
    runs = {"a": plot.read_run(tmp_path / "a"), "b": plot.read_run(tmp_path / "b")}
    for w in (0.9, 0.6, 0.0):
        fig = plot.draw(plt, runs, w)
        assert len(fig.axes) == 2
        for ax, x, xlabel in zip(fig.axes, ("step", "tokens"), ("step", "tokens seen")):
            assert ax.get_xlabel() == xlabel and ax.get_ylabel() == "loss"
            colours = [assert_run_drawn(ax, name, records, x, w) for name, records in (("a", a), ("b", b))]
            assert colours[0] != colours[1]
            assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in ax.get_lines()]
        plt.close(fig)
    # (the helper itself, on two points: no smoothing, and the mean of 1 and 3 weighted 0.5 and 1)
    assert smoothed([1.0, 3.0], 0.0) == [1.0, 3.0] and smoothed([1.0, 3.0], 0.5) == [1.0, (0.5 * 1 + 3) / 1.5]


def test_plot_leaves_out_what_a_run_did_not_log(tmp_path):
    write_run(tmp_path / "a", 12, eval_every=0, seed=3)  # log lines only (no evaluation yet)
    fig = plot.draw(plt, {"a": plot.read_run(tmp_path / "a")})
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a loss", "a loss, smoothed"]
    plt.close(fig)


def png_size(path):
    """Width and height from a PNG's bytes: the 8-byte signature, then the IHDR chunk (length, type, data)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_two_runs(tmp_path, monkeypatch):
    drawn, draw = [], plot.draw
    monkeypatch.setattr(plot, "draw", lambda *args: drawn.append(draw(*args)) or drawn[-1])
    a = write_run(tmp_path / "a", 30, eval_every=10, seed=4)
    b = write_run(tmp_path / "b", 20, eval_every=5, seed=5)
    proc = run_in_process(plot.main, tmp_path / "a", tmp_path / "b", f"--out={tmp_path / 'runs.png'}", check=True)
    assert proc.stdout == f"wrote {tmp_path / 'runs.png'} (2 run(s))\n"
    assert png_size(tmp_path / "runs.png") == (1200, 450)  # two panels of 6 x 4.5 inches at 100 dpi
    assert mpimg.imread(tmp_path / "runs.png").shape == (450, 1200, 4)  # a PNG that decodes
    for name, records in ((str(tmp_path / "a"), a), (str(tmp_path / "b"), b)):
        assert_run_drawn(drawn[-1].axes[0], name, records, "step", 0.9)  # the default smoothing: 0.9
        assert_run_drawn(drawn[-1].axes[1], name, records, "tokens", 0.9)

    c = write_run(tmp_path / "c", 20, eval_every=10, seed=6, hellaswag=True)
    run_in_process(plot.main, tmp_path / "a", tmp_path / "c", "--smoothing=0.5", f"--out={tmp_path / 'hs.png'}",
                   check=True)
    assert png_size(tmp_path / "hs.png") == (1800, 450)  # and the HellaSwag panel
    fig = drawn[-1]
    assert_run_drawn(fig.axes[0], str(tmp_path / "c"), c, "step", 0.5)
    hellaswag = fig.axes[2]
    assert (hellaswag.get_xlabel(), hellaswag.get_ylabel()) == ("step", "HellaSwag acc_norm")
    assert [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in hellaswag.get_lines()] \
        == [(str(tmp_path / "c"), *column(c, "hellaswag_acc_norm", "step"))]  # (none for a, which measured none)


def test_plot_errors(tmp_path, monkeypatch):
    write_run(tmp_path / "a", 3, eval_every=2, seed=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("", encoding="utf-8")
    for missing in ("nothere", "empty"):
        proc = run_in_process(plot.main, tmp_path / "a", tmp_path / missing, f"--out={tmp_path / 'x.png'}")
        assert_one_error_line(proc, str(tmp_path / missing))
    for smoothing in ("1", "-0.1"):
        proc = run_in_process(plot.main, tmp_path / "a", f"--smoothing={smoothing}", f"--out={tmp_path / 'x.png'}")
        assert_one_error_line(proc, "smoothing must be in [0, 1)", smoothing)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    proc = run_in_process(plot.main, tmp_path / "a", f"--out={tmp_path / 'x.png'}")
    assert_one_error_line(proc)
    assert proc.stderr.strip() == "error: plot.py needs matplotlib: pip install matplotlib==3.11.2"
    assert not (tmp_path / "x.png").exists()

