"""
Faults injected into training, for tests of what happens when things go wrong. In-process tests apply
them with pytest's monkeypatch; tests/faulty_train.py applies them in a subprocess (for SIGKILL).

    save_log=PATH      after every checkpoint save, append {"file", "iter_num", "sha256"} as a JSON line to PATH
    pause_in_save=K    in the K-th checkpoint save, write half of the temporary file, then write the
                       checkpoint's path into the file pause_flag=PATH and sleep, so a test can kill it there
    pause_flag=PATH    see pause_in_save
    nan_from=K         the training loss is NaN from the K-th optimizer step on (1-based, as in `iter K:` logs)
    nan_grads_at=K     the gradients of the K-th optimizer step are NaN (an overflow) while its loss is finite
    eval_crash=K       the K-th evaluation raises RuntimeError, as an out-of-memory evaluation would

Only these test helpers patch the product code; it has no test hooks of its own.
"""

import hashlib
import io
import json
import os
import time
from pathlib import Path

import torch

from machinery.weights import checkpoint
from model import GPT
import train


def inject(faults, patch=setattr):
    """Apply faults ({name: value}); patch(obj, name, value) replaces an attribute (monkeypatch.setattr)."""
    if "save_log" in faults or "pause_in_save" in faults:
        real_save, saves = checkpoint.save, [0]

        def save(state, path):
            saves[0] += 1
            if saves[0] == int(faults.get("pause_in_save", 0)):
                pause_inside_save(faults["pause_flag"], path, patch)
            real_save(state, path)
            if "save_log" in faults:
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                iter_num = torch.load(path, weights_only=True)["iter_num"]  # the file read back, by hand
                with open(faults["save_log"], "a") as f:
                    f.write(json.dumps({"file": os.path.basename(path), "iter_num": iter_num, "sha256": digest}) + "\n")

        patch(checkpoint, "save", save)
    if "nan_from" in faults:
        real_forward, steps = GPT.forward, [0]

        def forward(self, idx, targets=None, *args, **kwargs):
            logits, loss = real_forward(self, idx, targets, *args, **kwargs)
            if self.training and loss is not None:
                steps[0] += 1  # one forward per optimizer step (tests use gradient_accumulation_steps=1)
                if steps[0] >= int(faults["nan_from"]):
                    loss = loss * float("nan")
            return logits, loss

        patch(GPT, "forward", forward)
    if "nan_grads_at" in faults:
        real_clip, clips = torch.nn.utils.clip_grad_norm_, [0]

        def clip_grad_norm_(parameters, *args, **kwargs):
            parameters = list(parameters)
            clips[0] += 1  # called once per optimizer step (tests keep grad_clip > 0)
            if clips[0] == int(faults["nan_grads_at"]):
                for p in parameters:
                    p.grad.fill_(float("nan"))
            return real_clip(parameters, *args, **kwargs)

        patch(torch.nn.utils, "clip_grad_norm_", clip_grad_norm_)
    if "eval_crash" in faults:
        real_estimate, evals = train.Trainer.estimate_loss, [0]

        def estimate_loss(self):
            evals[0] += 1
            if evals[0] == int(faults["eval_crash"]):
                raise RuntimeError("injected evaluation crash")
            return real_estimate(self)

        patch(train.Trainer, "estimate_loss", estimate_loss)


def pause_inside_save(flag, path, patch):
    """Do what checkpoint.save does up to the middle of writing the temporary file, then wait to be killed."""
    real_torch_save = torch.save

    def half_save(obj, f):
        buffer = io.BytesIO()
        real_torch_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        Path(flag).write_text(str(path))
        time.sleep(600)

    patch(torch, "save", half_save)
