"""
Draw the loss curves of one or several runs from their metrics logs (out_dir/metrics.jsonl):

    python plot.py out-shakespeare-char
    python plot.py out-baseline out-bigger-lr --out=compare.png --smoothing=0.95

One PNG, one colour per run (labelled by its out_dir), the loss by step and the same by tokens seen,
as wandb shows a run: the training loss of every log line, faint, and its smoothed curve, with the
evaluations' train and val loss (estimated on eval_iters batches each) drawn on top as points joined
by lines; and HellaSwag accuracy by step when any run measured it. matplotlib is needed only here:
pip install matplotlib==3.11.2.

The smoothing is TensorBoard's (and wandb's "exponential moving average"): with weight w, over the
logged losses y_1..y_n in order, s_n = ((1 - w) * sum_k w^(n-k) y_k) / (1 - w^n). The division
debiases it: without it the first points would be pulled towards 0, the value the average starts
from. A loss that is not finite (a diverged step) is drawn as it is and left out of the average.
"""

import math
import os
import sys
from dataclasses import dataclass

from machinery import configurator
from machinery.training import metrics
from machinery.configurator import setting
from machinery.errors import UserError, run_main
from machinery.fileio import atomic_write

PANEL_INCHES = (6.0, 4.5)  # each panel's width and height
DPI = 100  # so a panel is 600 x 450 pixels
LOGGED_ALPHA = 0.25  # the per-iteration loss, faint: its smoothed curve and the evaluations carry the figure
EVAL_ZORDER = 3  # the evaluations above the logged loss (matplotlib draws lines at zorder 2)
USAGE = "python plot.py OUT_DIR [OUT_DIR ...] [--out=FILE.png] [--smoothing=W]"


@dataclass
class PlotConfig:
    out: str = setting("loss.png", "the PNG file to write")
    smoothing: float = setting(0.9, "weight of the exponential moving average of the logged loss, in [0, 1) "
                                    "(0: no smoothing; closer to 1: smoother)")

    def validate(self):
        if not 0 <= self.smoothing < 1:
            raise UserError(f"smoothing must be in [0, 1), got {self.smoothing}")


def import_pyplot():
    """matplotlib's pyplot drawing into files (the Agg backend: no screen needed)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("plot.py needs matplotlib: pip install matplotlib==3.11.2") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_run(out_dir):
    """The records of the run in out_dir; a missing or empty log is an error naming out_dir."""
    path = os.path.join(out_dir, metrics.FILENAME)
    if not os.path.isfile(path):
        raise UserError(f"{out_dir} has no {metrics.FILENAME}; give the out_dir of a training run")
    records = [r for r in metrics.read(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if not records:
        raise UserError(f"{out_dir}/{metrics.FILENAME} holds no records yet; train (or wait) until the run has "
                        f"logged something")
    return records


def series(records, key, x="step"):
    """(xs, ys) of the records that have both x and key."""
    points = [(r[x], r[key]) for r in records if r.get(x) is not None and r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def smooth(ys, weight):
    """The debiased exponential moving average of ys (see the module's docstring), one value per y."""
    average, n, out = 0.0, 0, []
    for y in ys:
        if not math.isfinite(y):
            out.append(y)
            continue
        average, n = weight * average + (1 - weight) * y, n + 1
        out.append(average / (1 - weight ** n))
    return out


def logged_loss(records, x, weight):
    """(xs, losses, smoothed losses) of the log lines, by x. The average runs over every log line, whether
    or not it has x, so the curve by step and the curve by tokens are the same numbers."""
    logged = [r for r in records if r.get("loss") is not None]
    smoothed = smooth([r["loss"] for r in logged], weight)
    kept = [(r[x], r["loss"], s) for r, s in zip(logged, smoothed) if r.get(x) is not None]
    return [k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept]


def line(ax, xs_ys, **style):
    """A curve, unless there are no points (an empty one would still take a place in the legend)."""
    if xs_ys[0]:
        ax.plot(*xs_ys, **style)


def draw_losses(ax, name, records, x, colour, weight):
    """One run's losses by x on ax: as logged (faint), smoothed, and the evaluations on top."""
    xs, losses, smoothed = logged_loss(records, x, weight)
    line(ax, (xs, losses), color=colour, alpha=LOGGED_ALPHA, linewidth=0.8, label=f"{name} loss")
    line(ax, (xs, smoothed), color=colour, linewidth=1.2, label=f"{name} loss, smoothed")
    line(ax, series(records, "train_loss", x), color=colour, linestyle="--", marker="o", markersize=4,
         zorder=EVAL_ZORDER, label=f"{name} train (eval)")
    line(ax, series(records, "val_loss", x), color=colour, marker="s", markersize=4, linewidth=2,
         zorder=EVAL_ZORDER, label=f"{name} val (eval)")


def draw(plt, runs, smoothing=PlotConfig.smoothing):
    """The figure: loss by step, loss by tokens, and HellaSwag by step if any run has it."""
    has_hellaswag = any(series(records, "hellaswag_acc_norm")[0] for records in runs.values())
    n = 3 if has_hellaswag else 2
    fig, axes = plt.subplots(1, n, figsize=(PANEL_INCHES[0] * n, PANEL_INCHES[1]), dpi=DPI)
    for i, (out_dir, records) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        for ax, x in ((axes[0], "step"), (axes[1], "tokens")):
            draw_losses(ax, out_dir, records, x, colour, smoothing)
        if has_hellaswag:
            line(axes[2], series(records, "hellaswag_acc_norm"), color=colour, marker=".", label=out_dir)
    for ax, xlabel, ylabel in ((axes[0], "step", "loss"), (axes[1], "tokens seen", "loss")):
        ax.set(xlabel=xlabel, ylabel=ylabel)
    if has_hellaswag:
        axes[2].set(xlabel="step", ylabel="HellaSwag acc_norm")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()  # (moves the panels inside the figure; its size in pixels stays as set)
    return fig


def parse_args(argv):
    """The out_dirs (positional) and the settings (--key=value)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out_dirs = [a for a in argv if not a.startswith("-")]
    cfg = configurator.parse(PlotConfig, [a for a in argv if a.startswith("-")], usage=USAGE, extra_files_ok=False)
    cfg.validate()
    if not out_dirs:
        raise UserError(f"no run given; usage: {USAGE}")
    return out_dirs, cfg


def main(argv=None):
    out_dirs, cfg = parse_args(argv)
    runs = {out_dir: read_run(out_dir) for out_dir in out_dirs}  # every log read before anything is drawn
    plt = import_pyplot()
    fig = draw(plt, runs, cfg.smoothing)
    with atomic_write(cfg.out) as f:  # a failure leaves an earlier plot as it was
        fig.savefig(f, format="png")
    plt.close(fig)
    print(f"wrote {cfg.out} ({len(runs)} run(s))")


if __name__ == "__main__":
    run_main(main)
