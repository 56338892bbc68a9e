"""
Whole training processes timed side by side on one machine and one dataset: `bench.py --mode=speedrun` (the
speedrun against nanoGPT's recipe run by our train.py) and, with --nanogpt=PATH/train.py, nanoGPT's own
train.py beside ours (`--mode=speedrun` and `--mode=train`).

Each run is a whole `python train.py` process (start-up, data, compilation, training, evaluation,
checkpoint): its wall time, and from its log the val loss of its last evaluation, ms/iter (the median of
the logged iterations after the first `warmup` steps), tokens/s and MFU (against the GPU's dense bfloat16
peak, machinery/hardware.py; none on a CPU). nanoGPT's train.py runs in a directory of its own that holds
what it reads relative to its working directory: its configurator.py, and data/DATASET (the prepared
train.bin and val.bin, and a meta.pkl with the vocabulary size our model has). It is given every setting
both scripts share, as our settings resolve them (device, dtype and compile included), so the two train
the same model on the same batches from the same seed.
"""

import math
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields

import torch

from machinery import configurator
from machinery.data import dataset, meta
from machinery.errors import UserError
from machinery.hardware import describe as describe_device
from machinery.hardware import peak_flops, pick_device, pick_dtype
from model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# nanoGPT's recipes through our train.py: its GPU config as it is (compiled, bfloat16 on CUDA), and its
# CPU recipe (its README) in float32, as nanoGPT runs it on a CPU
NANOGPT_RECIPES = {
    "gpu": ["config/train_shakespeare_char.py"],
    "cpu": ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
            "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
            "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0", "--dtype=float32"],
}
# the settings nanoGPT's train.py has under the same name and meaning (its globals), passed on from ours
NANOGPT_SETTINGS = ("eval_interval", "log_interval", "eval_iters", "eval_only", "always_save_checkpoint",
                    "gradient_accumulation_steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd",
                    "dropout", "bias", "learning_rate", "max_iters", "weight_decay", "beta1", "beta2", "grad_clip",
                    "decay_lr", "warmup_iters", "lr_decay_iters", "min_lr")
# ours that the bench sets for each run, or that do not change what is trained
OWN_SETTINGS = {"out_dir", "data_dir", "dataset", "device", "dtype", "compile", "wandb_log", "wandb_project",
                "wandb_run_name", "ckpt_interval", "seed"}


@dataclass
class Run:
    """One whole training process: its wall time and what its log says."""
    name: str
    seconds: float
    val_loss: float
    tokens_per_iter: int
    steps: list  # (step, ms, loss) of each logged iteration; step 0 is the first optimizer step
    model: GPT  # on the meta device: its FLOPs per token for MFU

    def ms_per_iter(self, warmup, until=None):
        """The median time of the logged steps from step `warmup` on (and before step `until`)."""
        times = [ms for step, ms, _ in self.steps if warmup <= step < (until or math.inf)] or \
            [ms for _, ms, _ in self.steps]
        return statistics.median(times) if times else math.nan


def parse_log(name, stdout, seconds, model, first_step):
    """A Run from a log in nanoGPT's shapes (ours and nanoGPT's own): `iter N: loss X, time Tms`, `step N: train
    loss X, val loss Y`. first_step: the N of the first optimizer step's line (ours 1, nanoGPT's 0)."""
    tokens = re.search(r"^tokens per iteration(?: will be)?: ([\d,]+)", stdout, re.M)
    vals = re.findall(r"^step \d+: train loss \S+, val loss (\S+)$", stdout, re.M)
    if not tokens or not vals:
        raise UserError(f"{name}: no `tokens per iteration` or `step N: ... val loss` line in its output")
    steps = [(int(n) - first_step, float(ms), float(loss))
             for n, loss, ms in re.findall(r"^iter (\d+): loss (\S+), time (\S+)ms", stdout, re.M)]
    return Run(name, seconds, float(vals[-1]), int(tokens[1].replace(",", "")), steps, model)


def setting_args(cfg, names):
    """--key=value for each of cfg's settings in names, written so that both configurators read back the same
    value and type (nanoGPT's literal_evals it and checks the type: floats keep their point, strings stay bare)."""
    return [f"--{name}={value if isinstance(value, str) else repr(value)}" for name in names
            if (value := getattr(cfg, name)) is not None]


def meta_model(cfg, data_dir):
    """The model cfg trains, on the meta device (no memory, no time): for its FLOPs per token."""
    vocab = cfg.vocab_size or meta.for_dataset(dataset.resolve(data_dir, cfg.dataset)).model_vocab_size
    with torch.device("meta"):
        return GPT(cfg.gpt_config(vocab))


def absolute_configs(args):
    """Config file arguments as absolute paths (relative ones: from the working directory, else the project's
    root, where the recipes' config/ lives), since train.py runs from the project's root."""
    return [a if a.startswith("--") or os.path.isabs(a) else
            os.path.abspath(a) if os.path.exists(a) else os.path.join(ROOT, a) for a in args]


def run_ours(name, args, train_config, workdir, data_dir):
    """Time a whole `python train.py ARGS` process (our train.py, in a fresh out_dir)."""
    args = absolute_configs(args)
    out_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *args, f"--data_dir={data_dir}", f"--out_dir={out_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise UserError(f"train.py {' '.join(args)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    cfg = configurator.parse(train_config, args)
    return parse_log(name, proc.stdout, seconds, meta_model(cfg, data_dir), first_step=1)


def check_nanogpt(path):
    """nanoGPT's train.py, as --nanogpt names it: a train.py beside its configurator.py and model.py."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) != "train.py" or not all(
            os.path.isfile(os.path.join(folder, f)) for f in ("train.py", "configurator.py", "model.py")):
        raise UserError(f"--nanogpt must be the path of nanoGPT's train.py, beside its configurator.py and "
                        f"model.py (a clone of github.com/karpathy/nanoGPT); got {path!r}")
    return os.path.abspath(path)


def nanogpt_args(cfg, data_dir, workdir):
    """A working directory for nanoGPT's train.py (its configurator.py, data/NAME with our prepared files and a
    meta.pkl of our model's vocabulary size) and its arguments: cfg's settings as ours resolve them."""
    source = dataset.resolve(data_dir, cfg.dataset)
    if not all(os.path.isfile(os.path.join(source, f"{split}.bin")) for split in ("train", "val")):
        raise UserError(f"nanoGPT's train.py reads train.bin and val.bin, and {source} has none; prepare the "
                        f"dataset with prepare.py (not as shards)")
    if cfg.init_from != "scratch":
        raise UserError(f"side by side with nanoGPT, init_from must be scratch, got {cfg.init_from!r}")
    run_dir = tempfile.mkdtemp(prefix="nanogpt-", dir=workdir)
    data = os.path.join(run_dir, "data", "bench")
    os.makedirs(data)
    for split in ("train", "val"):
        os.symlink(os.path.join(os.path.abspath(source), f"{split}.bin"), os.path.join(data, f"{split}.bin"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:  # (written for nanoGPT, which reads only vocab_size)
        pickle.dump({"vocab_size": meta_model(cfg, data_dir).config.vocab_size}, f)
    device = pick_device(cfg.device)
    device_type = device.split(":")[0]
    compile = cfg.compile if cfg.compile is not None else device_type == "cuda"
    system = [f"--device={device}", f"--dtype={pick_dtype(cfg.dtype, device)}", f"--compile={compile}",
              "--dataset=bench", "--wandb_log=False", f"--out_dir={os.path.join(run_dir, 'out')}"]
    return run_dir, system + setting_args(cfg, NANOGPT_SETTINGS)


def run_nanogpt(train_py, cfg, workdir, data_dir):
    """Time a whole `python nanoGPT/train.py` process with cfg's settings."""
    run_dir, args = nanogpt_args(cfg, data_dir, workdir)
    os.symlink(os.path.join(os.path.dirname(train_py), "configurator.py"), os.path.join(run_dir, "configurator.py"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, train_py, *args], cwd=run_dir, capture_output=True, text=True,
                          timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise UserError(f"nanoGPT's train.py failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return parse_log("nanoGPT's train.py", proc.stdout, seconds, meta_model(cfg, data_dir), first_step=0)


def print_table(runs, warmup, peak, until=None):
    """The runs' medians side by side (each entry of runs: a name and its repeats)."""
    print(f"{'':34} {'wall s':>8} {'val loss':>9} {'ms/iter':>9} {'tokens/s':>11} {'MFU':>7}")
    for name, repeats in runs:
        ms = statistics.median(r.ms_per_iter(warmup, until) for r in repeats)
        mfu = repeats[0].model.estimate_mfu(repeats[0].tokens_per_iter / repeats[0].model.config.block_size,
                                            ms / 1000, peak) if peak else None
        print(f"{name:34} {statistics.median(r.seconds for r in repeats):8.1f} "
              f"{statistics.median(r.val_loss for r in repeats):9.4f} {ms:9.2f} "
              f"{repeats[0].tokens_per_iter / (ms / 1000):11,.0f} {f'{mfu:.1%}' if mfu else '-':>7}")


def bench_speedrun(cfg, workdir, train_config):
    """The speedrun against nanoGPT's recipe run by our train.py, in turn, `repeats` pairs; with cfg.nanogpt the
    recipe also through nanoGPT's train.py. Returns the median ratio of the wall times (speedrun / recipe)."""
    data_dir = os.path.abspath(cfg.data_dir)
    speedrun = cfg.speedrun or f"config/speedrun_shakespeare_char_{cfg.recipe}.py"
    recipe = NANOGPT_RECIPES[cfg.recipe]
    nanogpt = check_nanogpt(cfg.nanogpt) if cfg.nanogpt else None
    device = "cuda" if cfg.recipe == "gpu" else "cpu"
    print(f"speedrun ({speedrun}) against nanoGPT's {cfg.recipe.upper()} recipe, {cfg.repeats} pair(s), one after the "
          f"other{', and the recipe through ' + nanogpt if nanogpt else ''}; "
          f"{describe_device(device, pick_dtype('auto', device))} with dtype=auto")
    runs = {"speedrun": [], "recipe, our train.py": [], "recipe, nanoGPT's train.py": []}
    for i in range(cfg.repeats):
        fast = run_ours("speedrun", [speedrun], train_config, workdir, data_dir)
        slow = run_ours("nanoGPT's recipe", recipe, train_config, workdir, data_dir)
        runs["speedrun"].append(fast)
        runs["recipe, our train.py"].append(slow)
        line = (f"pair {i + 1}: speedrun {fast.seconds:.1f} s (val {fast.val_loss:.4f}), nanoGPT's recipe "
                f"{slow.seconds:.1f} s (val {slow.val_loss:.4f}), ratio {fast.seconds / slow.seconds:.3f}")
        if nanogpt:
            theirs = run_nanogpt(nanogpt, configurator.parse(train_config, absolute_configs(recipe)), workdir,
                                 data_dir)
            runs["recipe, nanoGPT's train.py"].append(theirs)
            line += f"; nanoGPT's train.py {theirs.seconds:.1f} s (val {theirs.val_loss:.4f})"
        print(line, flush=True)
    fast, slow = runs["speedrun"], runs["recipe, our train.py"]
    ratio = statistics.median(f.seconds / s.seconds for f, s in zip(fast, slow))
    seconds, val = ({k: statistics.median(getattr(r, field) for r in runs[k]) for k in runs if runs[k]}
                    for field in ("seconds", "val_loss"))
    print(f"median: speedrun {seconds['speedrun']:.1f} s (val {val['speedrun']:.4f}), nanoGPT's recipe "
          f"{seconds['recipe, our train.py']:.1f} s (val {val['recipe, our train.py']:.4f}), ratio {ratio:.3f}")
    print_table([(name, r) for name, r in runs.items() if r], cfg.warmup, peak_flops(device))
    return ratio


def bench_beside_nanogpt(cfg, workdir, train_config):
    """--mode=train --nanogpt=PATH: our train.py and nanoGPT's with cfg's settings, whole processes, `warmup` +
    `repeats` steps each, a log line every step, evaluations at the start and the end; their figures side by
    side and how far apart their losses are, step by step (nanoGPT trains one step more: it stops after the step
    it numbers max_iters, counting from 0). Returns (ours, nanoGPT's) Runs."""
    nanogpt = check_nanogpt(cfg.nanogpt)
    data_dir = os.path.abspath(cfg.data_dir)
    steps = cfg.warmup + cfg.repeats
    names = [f.name for f in fields(train_config)]
    run_cfg = configurator.parse(train_config, setting_args(cfg, [n for n in names if n in configurator.given(cfg)])
                                 + [f"--max_iters={steps}", f"--eval_interval={steps}", "--log_interval=1"])
    only_ours = sorted(configurator.given(run_cfg) - set(NANOGPT_SETTINGS) - OWN_SETTINGS)
    device = pick_device(cfg.device)
    print(f"our train.py and nanoGPT's ({nanogpt}) in turn, {steps} steps each (ms/iter: the median after "
          f"{cfg.warmup}); {describe_device(device, pick_dtype(cfg.dtype, device))}"
          + (f"; settings only ours takes: {', '.join(only_ours)}" if only_ours else ""), flush=True)
    ours_args = setting_args(run_cfg, [n for n in names if n in configurator.given(run_cfg)
                                       and n not in ("data_dir", "out_dir")]) + ["--wandb_log=False"]
    ours = run_ours("our train.py", ours_args, train_config, workdir, data_dir)
    theirs = run_nanogpt(nanogpt, run_cfg, workdir, data_dir)
    # (nanoGPT's extra last step follows its final evaluation, which its time includes: left out)
    print_table([(r.name, [r]) for r in (ours, theirs)], cfg.warmup, peak_flops(device), until=steps)
    print(f"wall time, ours / nanoGPT's: {ours.seconds / theirs.seconds:.3f}; ms/iter: "
          f"{ours.ms_per_iter(cfg.warmup, steps) / theirs.ms_per_iter(cfg.warmup, steps):.3f}")
    compared, gap = loss_gap(ours, theirs)
    if compared:
        print(f"training losses of the same {compared} steps: at most {gap:.3%} apart")
    return ours, theirs


def loss_gap(ours, theirs):
    """How many optimizer steps both runs logged, and the largest relative difference of their losses there."""
    theirs_loss = {step: loss for step, _, loss in theirs.steps}
    pairs = [(loss, theirs_loss[step]) for step, _, loss in ours.steps if step in theirs_loss]
    return len(pairs), max((abs(a - b) / abs(b) for a, b in pairs), default=0.0)
