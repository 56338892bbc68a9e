"""
Draw the loss curves of one or several runs from their metrics logs (out_dir/metrics.jsonl):

    python plot.py out-shakespeare-char
    python plot.py out-baseline out-bigger-lr --out=compare.png

One PNG, one colour per run (labelled by its out_dir): train and val loss by step, the same by
tokens seen, and HellaSwag accuracy by step when any run measured it. The train curve is the
evaluations' train loss (estimated on eval_iters batches, as val), or, for a run that has none,
the loss of its log lines. matplotlib is needed only here: pip install matplotlib==3.11.2.
"""

import os
import sys
from dataclasses import dataclass

import configurator
import metrics
from configurator import setting
from errors import UserError, run_main
from fileio import atomic_write

PANEL_INCHES = (6.0, 4.5)  # each panel's width and height
DPI = 100  # so a panel is 600 x 450 pixels


@dataclass
class PlotConfig:
    out: str = setting("loss.png", "the PNG file to write")


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


def line(ax, xs_ys, **style):
    """A curve, unless there are no points (an empty one would still take a place in the legend)."""
    if xs_ys[0]:
        ax.plot(*xs_ys, **style)


def draw(plt, runs):
    """The figure: loss by step, loss by tokens, and HellaSwag by step if any run has it."""
    has_hellaswag = any(series(records, "hellaswag_acc_norm")[0] for records in runs.values())
    n = 3 if has_hellaswag else 2
    fig, axes = plt.subplots(1, n, figsize=(PANEL_INCHES[0] * n, PANEL_INCHES[1]), dpi=DPI)
    for i, (out_dir, records) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        train_key = "train_loss" if series(records, "train_loss")[0] else "loss"
        for ax, x in ((axes[0], "step"), (axes[1], "tokens")):
            line(ax, series(records, train_key, x), color=colour, linestyle="--", alpha=0.7, label=f"{out_dir} train")
            line(ax, series(records, "val_loss", x), color=colour, label=f"{out_dir} val")
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
    cfg = configurator.parse(PlotConfig, [a for a in argv if a.startswith("-")],
                             usage="python plot.py OUT_DIR [OUT_DIR ...] [--out=FILE.png]", extra_files_ok=False)
    if not out_dirs:
        raise UserError("no run given; usage: python plot.py OUT_DIR [OUT_DIR ...] [--out=FILE.png]")
    return out_dirs, cfg


def main(argv=None):
    out_dirs, cfg = parse_args(argv)
    runs = {out_dir: read_run(out_dir) for out_dir in out_dirs}  # every log read before anything is drawn
    plt = import_pyplot()
    fig = draw(plt, runs)
    with atomic_write(cfg.out) as f:  # a failure leaves an earlier plot as it was
        fig.savefig(f, format="png")
    plt.close(fig)
    print(f"wrote {cfg.out} ({len(runs)} run(s))")


if __name__ == "__main__":
    run_main(main)
