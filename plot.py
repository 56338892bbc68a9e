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

What the heads of a trained model look at, in a text (machinery/generation/attention_maps.py measures it):

    python plot.py --attention=True --out_dir=out-shakespeare-char --text="ROMEO: Is the day so young?"

three PNGs: a grid of every head's attention weights (layers down, heads across), one head large with the tokens on
both axes (--head=LAYER,HEAD; else the strongest induction head), the cosine similarity of the position embeddings;
and a table of what each head does (python plot.py --attention=True --help: its settings).
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
ATTENTION_USAGE = "python plot.py --attention=True [--out_dir=DIR | --init_from=gpt2] --text=TEXT [--out=FILE.png]"
GRID_PANEL_INCHES = 1.8  # each head's square in the grid
COLOUR_INCHES = 1.2  # the colour scale beside a map
TITLE_INCHES = 0.6  # the grid's title above it
GRID_INCHES = 5.4  # the grid's least width (its title's)
LABEL_INCHES = 1.0  # the tokens beside the large head's map
SMALLEST_WEIGHT = 1e-4  # the bottom of the log colour scale (a weight below it takes its colour)
WEIGHT_LEGEND = ("attention weight, log scale: small ones stay visible", "(white: a later token, never seen)")
CJK_FONT_HINT = "apt install fonts-noto-cjk, then rm -rf ~/.cache/matplotlib"


@dataclass
class PlotConfig:
    out: str = setting("loss.png", "the PNG file to write")
    smoothing: float = setting(0.9, "weight of the exponential moving average of the logged loss, in [0, 1) "
                                    "(0: no smoothing; closer to 1: smoother)")
    attention: bool = setting(False, "True: draw what the heads of a model look at in a text, instead of runs' "
                                     "curves (python plot.py --attention=True --help: its settings)")

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
    out_dirs = [a for a in argv if not a.startswith("-")]
    cfg = configurator.parse(PlotConfig, [a for a in argv if a.startswith("-")], usage=USAGE, extra_files_ok=False)
    cfg.validate()
    if not out_dirs:
        raise UserError(f"no run given; usage: {USAGE}")
    return out_dirs, cfg


def font_for(labels):
    """(the name of an installed font that draws every character of labels, or None where matplotlib's default
    does; the characters no installed font draws, sorted). A CJK text needs a CJK font (DejaVu Sans has none)."""
    from matplotlib import font_manager, ft2font

    def missing(path):
        font = ft2font.FT2Font(path)
        return {ch for ch in "".join(labels) if not font.get_char_index(ord(ch))}

    lacking = missing(font_manager.findfont(font_manager.FontProperties()))
    if not lacking:
        return None, []
    for entry in font_manager.fontManager.ttflist:  # (not Last Resort: its every glyph is a box naming a script)
        if not entry.name.startswith("Last Resort") and not missing(entry.fname) & lacking:
            return entry.name, []
    return None, sorted(lacking)


def tick_labels(tokens):
    """The tokens as tick labels and their font: the tokens themselves where a font draws them, else their positions
    (said in one line, with how to get a font; the tokens printed by position), never boxes without a word."""
    font, lacking = font_for(tokens)
    if lacking:
        print(f"note: no installed font draws {''.join(lacking[:10])}; the tokens are labelled by position "
              f"(a font: {CJK_FONT_HINT})", file=sys.stderr)
        print("tokens: " + "  ".join(f"{i} {token}" for i, token in enumerate(tokens)))
        return [str(i) for i in range(len(tokens))], None
    return [token.replace("$", r"\$") for token in tokens], font  # ($: matplotlib's mathtext otherwise)


def show_weights(ax, weights):
    """A head's weights (T, T) on ax, on the log colour scale (WEIGHT_LEGEND); returns the image."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm

    w = weights.clamp_min(SMALLEST_WEIGHT).numpy()
    future = np.triu(np.ones(w.shape, dtype=bool), k=1)  # a query never sees the tokens after it: white
    return ax.imshow(np.ma.masked_where(future, w), norm=LogNorm(SMALLEST_WEIGHT, 1.0), interpolation="nearest",
                     cmap=matplotlib.colormaps["viridis"].with_extremes(bad="white"))


def place(fig, left, right, top, bottom, **spacing):
    """The axes inside margins given in inches (the colour scale in the right one: colour_scale), so a figure is
    its size whatever its labels (matplotlib's layout engines measure every label: seconds a figure)."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                        **spacing)


def colour_scale(fig, image, label, top, bottom):
    """The colour scale of image in the figure's right margin (COLOUR_INCHES), between top and bottom (inches)."""
    width, height = fig.get_size_inches()
    scale = fig.add_axes((1 - 0.95 / width, bottom / height, 0.15 / width, 1 - (top + bottom) / height))
    fig.colorbar(image, cax=scale).set_label(label, fontsize=8)


def draw_grid(plt, found, text_note):
    """One small map a head: layers down, heads across, each with its token positions on the axes."""
    rows, cols, T = len(found.layers), len(found.heads), len(found.tokens)
    size = (max(cols * GRID_PANEL_INCHES, GRID_INCHES) + COLOUR_INCHES, rows * GRID_PANEL_INCHES + TITLE_INCHES)
    fig, axes = plt.subplots(rows, cols, figsize=size, dpi=DPI, squeeze=False)
    place(fig, 0.3, COLOUR_INCHES, TITLE_INCHES + 0.2, 0.2, wspace=0.3, hspace=0.35)
    ticks = sorted({0, T // 2, T - 1})
    for (r, layer), (c, head) in [(r, c) for r in enumerate(found.layers) for c in enumerate(found.heads)]:
        ax = axes[r][c]
        image = show_weights(ax, found.weight(layer, head))
        ax.set_title(f"layer {layer} head {head}", fontsize=8)
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.tick_params(labelsize=6)
    colour_scale(fig, image, "attention weight (log scale)", TITLE_INCHES + 0.2, 0.2)
    fig.suptitle(f"{text_note}: each row a token looking, each column one looked at, by position\n"
                 f"{' '.join(WEIGHT_LEGEND)}", fontsize=8)
    return fig


def draw_head(plt, found, layer, head, labels, font):
    """One head large, the tokens on both axes."""
    T = len(labels)
    side = min(max(5.0, 0.16 * T), 20.0)
    fig, ax = plt.subplots(figsize=(side + LABEL_INCHES + COLOUR_INCHES, side + LABEL_INCHES + 0.5), dpi=DPI)
    place(fig, LABEL_INCHES, COLOUR_INCHES, 0.5, LABEL_INCHES)
    image = show_weights(ax, found.weight(layer, head))
    style = dict(fontsize=max(5, min(10, 600 // T)), **(dict(fontfamily=font) if font else {}))
    ax.set_xticks(range(T), labels, rotation=90, **style)
    ax.set_yticks(range(T), labels, **style)
    stats = ", ".join(f"{kind} {found.stats[kind][layer, head].item():.2f}" for kind in ("previous", "first", "self",
                                                                                        "induction"))
    ax.set(xlabel="the token looked at", ylabel="the token looking", title=f"layer {layer}, head {head} ({stats})")
    colour_scale(fig, image, "\n".join(WEIGHT_LEGEND), 0.5, LABEL_INCHES)
    return fig


def draw_positions(plt, similarity):
    """The cosine similarity of every pair of learned position vectors."""
    fig, ax = plt.subplots(figsize=(5.0 + COLOUR_INCHES, 5.6), dpi=DPI)
    place(fig, 0.7, COLOUR_INCHES, 0.6, 0.5)
    image = ax.imshow(similarity.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax.set(xlabel="position", ylabel="position")
    ax.set_title("position embeddings: cosine similarity\n(the band along the diagonal: what 'nearby' means to the "
                 "model)", fontsize=10)
    colour_scale(fig, image, "cosine similarity", 0.6, 0.5)
    return fig


def beside(path, name):
    """The path of a PNG written beside path: attention.png -> attention_NAME.png."""
    return f"{path.removesuffix('.png')}_{name}.png"


def attention_main(argv):
    """plot.py --attention=True: the maps of one model for one text, drawn and measured."""
    from machinery.generation import attention_maps, loading  # (here: the curves need neither torch nor a model)

    cfg = configurator.parse(attention_maps.AttentionConfig, argv, usage=ATTENTION_USAGE, extra_files_ok=False)
    cfg.validate()
    text = cfg.read_text()
    plt = import_pyplot()
    loaded = loading.load(cfg)  # (on the CPU, in float32)
    found = attention_maps.maps(loaded.model, loaded.tokenizer, text, cfg.layers, cfg.heads)
    layer, head = attention_maps.large_head(found, cfg.head)
    labels, font = tick_labels(found.tokens)
    figures = {cfg.out: draw_grid(plt, found, f"{len(found.tokens)} tokens of {cfg.name}"),
               beside(cfg.out, "head"): draw_head(plt, found, layer, head, labels, font),
               beside(cfg.out, "positions"): draw_positions(plt, attention_maps.position_similarity(loaded.model))}
    print("\n".join(found.table()))
    for path, fig in figures.items():
        with atomic_write(path) as f:
            fig.savefig(f, format="png")
        plt.close(fig)
    if cfg.save:
        found.save(cfg.save)
    print(f"wrote {', '.join([*figures, *([cfg.save] if cfg.save else [])])}")


def attention_asked(argv):
    """Whether argv sets --attention=True (read as every True/False setting is)."""
    return configurator.parse(PlotConfig, [a for a in argv if a.split("=")[0] == "--attention"]).attention


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if attention_asked(argv):
        return attention_main(argv)
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
