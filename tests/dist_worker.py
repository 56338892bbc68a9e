"""
train.py with instruments, for tests/test_distributed.py; run it like train.py, alone or under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py --dataset=... ...

Set through the environment (torchrun passes it on to every rank):

  REPORT_DIR      each rank writes REPORT_DIR/rank{R}.pid when it starts and REPORT_DIR/rank{R}.json when
                  training returns: the batches it trained on, the val losses it computed, the gradient
                  all-reduces per iteration (a counting DDP communication hook), the gradient norm of every
                  optimizer step, and every file it opened for writing (an audit hook)
  SHARED_BATCHES  "1": all ranks draw one global stream of micro-batches and rank r trains on the r-th
                  slice of each optimizer step's gradient_accumulation_steps batches, so a run with any
                  number of processes sees the same global batches as a single-process run
  FAIL_RANK, FAIL_ITER   that rank raises a UserError when it fetches a batch at iteration FAIL_ITER
  SIGTERM_RANK, SIGTERM_ITER   that rank sends itself a SIGTERM when it fetches a batch at iteration SIGTERM_ITER
"""

import hashlib
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import configurator  # noqa: E402
import train  # noqa: E402

RANK = int(os.environ.get("RANK", 0))
REPORT_DIR = Path(os.environ["REPORT_DIR"])
SHARED = os.environ.get("SHARED_BATCHES") == "1"
FAIL_RANK, FAIL_ITER = int(os.environ.get("FAIL_RANK", -1)), int(os.environ.get("FAIL_ITER", 0))
SIGTERM_RANK, SIGTERM_ITER = int(os.environ.get("SIGTERM_RANK", -1)), int(os.environ.get("SIGTERM_ITER", 0))

writes = []  # paths this process opened for writing
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def audit(event, args):
    if event == "open" and args[0] is not None and not str(args[0]).startswith(str(REPORT_DIR)):
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & (os.O_WRONLY | os.O_RDWR)):
            writes.append(str(path))
    elif event in ("os.rename", "os.mkdir", "os.remove"):
        writes.append(str(args[1] if event == "os.rename" else args[0]))


class InstrumentedTrainer(train.Trainer):
    # what the report needs, kept apart from the trainer: train.main frees the trainer before it leaves
    # the process group, and a reference from here would keep the DDP model alive until exit
    record = None

    def __init__(self, cfg):
        self.batches, self.losses, self.grad_norms = [], [], []
        self.allreduces = Counter()
        InstrumentedTrainer.record = {"batches": self.batches, "losses": self.losses,
                                      "grad_norms": self.grad_norms, "allreduces": self.allreduces, "iter_num": 0}
        self.pending = []
        self.signalled = False
        super().__init__(cfg)
        if SHARED and self.iter_num == 0:  # (a resumed run restored the shared stream's state)
            self.train_sampler.generator.manual_seed(cfg.seed)  # the same stream on every rank

    def train(self):
        try:
            super().train()
        finally:
            InstrumentedTrainer.record["iter_num"] = self.iter_num

    def next_batch(self):
        if self.ddp.rank == FAIL_RANK and self.iter_num >= FAIL_ITER:
            raise configurator.UserError(f"simulated failure on rank {self.ddp.rank} at iteration {self.iter_num}")
        if self.ddp.rank == SIGTERM_RANK and self.iter_num == SIGTERM_ITER and not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        if not SHARED:
            x, y = super().next_batch()
        else:
            if not self.pending:  # the first micro-step of an optimizer step: draw all its batches
                self.batch_state = self.train_sampler.state_dict()
                batches = [self.train_sampler.next() for _ in range(self.cfg.gradient_accumulation_steps)]
                self.pending = batches[self.ddp.rank * self.accum:(self.ddp.rank + 1) * self.accum]
            x, y = self.pending.pop(0)
        self.batches.append(hashlib.sha1(x.cpu().numpy().tobytes()).hexdigest())
        return x, y

    def estimate_loss(self):
        # evaluation draws its batches from the training stream, and each of 2 ranks draws half as many as
        # one process: with the shared stream, leave it where it was so that training batches still match
        state = self.train_sampler.generator.get_state() if SHARED else None
        losses = super().estimate_loss()
        if SHARED:
            self.train_sampler.generator.set_state(state)
        self.losses.append([self.iter_num, losses])
        return losses

    def _wrap(self, model):
        model = super()._wrap(model)
        ddp = getattr(model, "_orig_mod", model)  # under torch.compile
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_allreduce(state, bucket):
                self.allreduces[self.iter_num] += 1
                return allreduce_hook(None, bucket)

            ddp.register_comm_hook(None, counting_allreduce)
        return model


def recording_clip_grad_norm(parameters, max_norm, **kwargs):
    """torch.nn.utils.clip_grad_norm_, also recording the norm before clipping."""
    norm = clip_grad_norm(parameters, max_norm, **kwargs)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    InstrumentedTrainer.record["grad_norms"].append(full.item())
    return norm


def main():
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / f"rank{RANK}.pid").write_text(str(os.getpid()))
    sys.addaudithook(audit)
    train.Trainer = InstrumentedTrainer
    torch.nn.utils.clip_grad_norm_ = recording_clip_grad_norm
    configurator.run_main(train.main)
    r = InstrumentedTrainer.record
    report = {"batches": r["batches"], "losses": r["losses"], "grad_norms": r["grad_norms"], "writes": list(writes),
              "allreduces": {str(k): v for k, v in sorted(r["allreduces"].items())}, "iter_num": r["iter_num"]}
    (REPORT_DIR / f"rank{RANK}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
