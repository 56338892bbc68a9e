"""
A run's numbers, where tools read them: out_dir/metrics.jsonl (always) and Weights & Biases
(wandb_log=True). The log lines for people (nanoGPT's `step N: ...` and `iter N: ...`) stay in
train.py; only rank 0 records.

metrics.jsonl holds one JSON object per line, in order:

    {"step": 250, "train_loss": 1.96, "val_loss": 2.06, "lr": 0.001, "tokens": 4096000}   an evaluation
    {"step": 260, "loss": 1.91, "lr": 0.001, "tokens": 4259840, "tokens_per_s": 24758}  a log line

(and "hellaswag_acc_norm", "hellaswag_acc" in the evaluations that measured them). A resumed run
first drops what the interrupted run wrote after its checkpoint, so every step appears once however
often a run is resumed; a run from scratch starts the file anew. plot.py draws it.
"""

import json
import os
from dataclasses import asdict

from machinery.fileio import atomic_write

FILENAME = "metrics.jsonl"


class Metrics:
    """Where one run's numbers go (rank 0); `record(...)` for each evaluation and log line."""

    def __init__(self, cfg, resume_step=None, redo_eval=True, wandb_run_id=None):
        """resume_step: the checkpoint's iteration when resuming (None for a new run); redo_eval: whether the
        resumed run evaluates again at that step (then the interrupted run's evaluation there goes)."""
        self.path, self.file = os.path.join(cfg.out_dir, FILENAME), None
        if not cfg.eval_only:  # (evaluating a checkpoint once is not part of its run)
            kept = []
            if resume_step is not None:
                kept = [r for r in read(self.path, missing_ok=True) if r["step"] < resume_step
                        or r["step"] == resume_step and not ("val_loss" in r and redo_eval)]
            with atomic_write(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            self.file = open(self.path, "a", encoding="utf-8")
        self.wandb = _start_wandb(cfg, wandb_run_id) if cfg.wandb_log else None

    @property
    def wandb_run_id(self):
        return self.wandb.id if self.wandb else None

    def record(self, step, **values):
        """One evaluation (train_loss, val_loss, ...) or log line (loss, ...) at step; flushed at once, so
        that a killed run keeps what it recorded."""
        if self.file:
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
        if self.wandb:
            names = {"train_loss": "train/loss", "val_loss": "val/loss", "loss": "train/loss_step"}
            self.wandb.log({"iter": step, **{names.get(k, k): v for k, v in values.items()}}, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


def _start_wandb(cfg, run_id):
    import wandb

    # a resumed run passes the id from its checkpoint and continues that wandb run; a new run gets a fresh
    # id from wandb, which goes into every checkpoint from now on
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, id=run_id, resume="allow",
                      config=asdict(cfg))


def read(path, missing_ok=False):
    """The records of a metrics.jsonl; a line cut short by a kill at the end is left out."""
    if missing_ok and not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                break  # the last line of a killed run, half written
    return records
