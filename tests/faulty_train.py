"""
train.py with faults injected, for tests of what happens when things go wrong:

    python tests/faulty_train.py FAULT=VALUE ... -- --key=value ...   (train.py's own arguments after --)

Faults (each optional):
    save_log=PATH      after every checkpoint save, append {"file", "iter_num", "sha256"} as a JSON line to PATH
    pause_in_save=K    in the K-th checkpoint save, write half of the temporary file, then write the
                       checkpoint's path into the file pause_flag=PATH and sleep, so a test can kill it there
    pause_flag=PATH    see pause_in_save
    nan_from=K         the training loss is NaN from the K-th optimizer step on (1-based, as in `iter K:` logs)
    nan_grads_at=K     the gradients of the K-th optimizer step are NaN (an overflow) while its loss is finite
    eval_crash=K       the K-th evaluation raises RuntimeError, as an out-of-memory evaluation would

Only this test helper patches train.py; train.py itself has no test hooks.
"""

import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import checkpoint  # noqa: E402
import configurator  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402


def inject(faults):
    if "save_log" in faults or "pause_in_save" in faults:
        real_save, saves = checkpoint.save, [0]

        def save(state, path):
            saves[0] += 1
            if saves[0] == int(faults.get("pause_in_save", 0)):
                pause_inside_save(state, path, faults["pause_flag"])
            real_save(state, path)
            if "save_log" in faults:
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                with open(faults["save_log"], "a") as f:
                    f.write(json.dumps({"file": os.path.basename(path), "iter_num": state["iter_num"],
                                        "sha256": digest}) + "\n")

        checkpoint.save = save

    if "nan_from" in faults:
        real_forward, steps = GPT.forward, [0]

        def forward(self, idx, targets=None, *args, **kwargs):
            logits, loss = real_forward(self, idx, targets, *args, **kwargs)
            if self.training and loss is not None:
                steps[0] += 1  # one forward per optimizer step (tests use gradient_accumulation_steps=1)
                if steps[0] >= int(faults["nan_from"]):
                    loss = loss * float("nan")
            return logits, loss

        GPT.forward = forward

    if "nan_grads_at" in faults:
        real_clip, clips = torch.nn.utils.clip_grad_norm_, [0]

        def clip_grad_norm_(parameters, *args, **kwargs):
            parameters = list(parameters)
            clips[0] += 1  # called once per optimizer step (tests keep grad_clip > 0)
            if clips[0] == int(faults["nan_grads_at"]):
                for p in parameters:
                    p.grad.fill_(float("nan"))
            return real_clip(parameters, *args, **kwargs)

        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

    if "eval_crash" in faults:
        real_estimate, evals = train.Trainer.estimate_loss, [0]

        def estimate_loss(self):
            evals[0] += 1
            if evals[0] == int(faults["eval_crash"]):
                raise RuntimeError("injected evaluation crash")
            return real_estimate(self)

        train.Trainer.estimate_loss = estimate_loss


def pause_inside_save(state, path, flag):
    """Do what checkpoint.save does up to the middle of writing the temporary file, then wait to be killed."""
    real_torch_save = torch.save

    def half_save(obj, f):
        buffer = io.BytesIO()
        real_torch_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        Path(flag).write_text(path)
        time.sleep(600)

    torch.save = half_save


if __name__ == "__main__":
    split = sys.argv.index("--")
    faults = dict(arg.split("=", 1) for arg in sys.argv[1:split])
    inject(faults)
    configurator.run_main(lambda: train.main(sys.argv[split + 1:]))
