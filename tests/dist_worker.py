"""
train.py with instruments, for tests/test_distributed.py. Under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py --dataset=... ...

or in the test's own process for single-process references: instrumented_run(argv, Instruments(...)).

Settings (under torchrun through the environment, which torchrun passes on to every rank):

  REPORT_DIR      each rank writes REPORT_DIR/rank{R}.json when training returns: the batches it trained on,
                  the val losses it computed, per iteration the gradient exchanges (DDP: calls of a counting
                  communication hook, one per all-reduce; FSDP: calls of its reduce-scatter of a parameter
                  group), the gradient norm of every optimizer step, its device and process group backend, and
                  every file it opened for writing
  SHARED_BATCHES  "1": all ranks draw one global stream of micro-batches and rank r trains on the r-th
                  slice of each optimizer step's gradient_accumulation_steps batches, so a run with any
                  number of processes sees the same global batches as a single-process run
  FAIL_RANK, FAIL_ITER   that rank raises a UserError when it fetches a batch at iteration FAIL_ITER
  SIGTERM_RANK, SIGTERM_ITER   that rank sends itself a SIGTERM when it fetches a batch at iteration SIGTERM_ITER
  SETUP_PAUSE     at most that many seconds, every rank waits at the end of its setup (after joining the job,
                  before training), having printed "setup paused", until its launcher (its parent when it
                  started: torchrun's agent) has died: a test can kill torchrun's agent there, sure that the
                  ranks are still in their setup then and without waiting longer than that takes
  FLOAT64         "1": the model is built in float64 (torch's default dtype), so that runs compare up to
                  float64 rounding only (with dtype=float32 nothing is autocast)
"""

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from machinery.errors import UserError, run_main  # noqa: E402
import train  # noqa: E402


@dataclass
class Instruments:
    shared: bool = False
    float64: bool = False
    fail_rank: int = -1
    fail_iter: int = 0
    sigterm_rank: int = -1
    sigterm_iter: int = 0
    setup_pause: float = 0.0
    parent: int = field(default_factory=os.getppid)  # (the process that started this one: torchrun's agent)
    # what is recorded (kept apart from the trainer: train.main frees the trainer before it leaves the
    # process group, and a reference from here would keep the DDP model alive until exit)
    batches: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    exchanges: Counter = field(default_factory=Counter)
    step: int = 0  # the optimizer step in progress (next_batch is called before each micro-step's backward)
    iter_num: int = 0
    device: str = ""  # the device this rank trained on, and its process group's backend (None: no group)
    backend: str = None

    def pause_in_setup(self, rank):
        """SETUP_PAUSE's wait: until this process's parent has died, for at most setup_pause seconds."""
        print(f"setup paused (rank {rank})", flush=True)
        deadline = time.time() + self.setup_pause
        while os.getppid() == self.parent and time.time() < deadline:
            time.sleep(0.02)

    def report(self):
        return {"batches": self.batches, "losses": self.losses, "grad_norms": self.grad_norms,
                "exchanges": {str(k): v for k, v in sorted(self.exchanges.items())}, "iter_num": self.iter_num,
                "device": self.device, "backend": self.backend}


def instrumented_trainer(instruments):
    """A train.Trainer subclass that records into instruments."""
    rec = instruments

    class InstrumentedTrainer(train.Trainer):
        def __init__(self, cfg):
            self.pending, self.signalled = [], False
            super().__init__(cfg)
            rec.device = self.device
            rec.backend = torch.distributed.get_backend() if self.world.distributed else None
            if rec.shared and self.iter_num == 0:  # (a resumed run restored the shared stream's state)
                self.train_sampler.generator.manual_seed(cfg.seed)  # the same stream on every rank

        def train(self):
            try:
                super().train()
            finally:
                rec.iter_num = self.iter_num

        def next_batch(self):
            rank, rec.step = self.world.rank, self.iter_num
            if rank == rec.fail_rank and self.iter_num >= rec.fail_iter:
                raise UserError(f"simulated failure on rank {rank} at iteration {self.iter_num}")
            if rank == rec.sigterm_rank and self.iter_num == rec.sigterm_iter and not self.signalled:
                self.signalled = True
                os.kill(os.getpid(), signal.SIGTERM)
            if not rec.shared:
                x, y = super().next_batch()
            else:
                if not self.pending:  # the first micro-step of an optimizer step: draw all its batches
                    self.batch_state = self.train_sampler.state_dict()
                    batches = [self.train_sampler.next() for _ in range(self.cfg.gradient_accumulation_steps)]
                    self.pending = batches[rank * self.accum:(rank + 1) * self.accum]
                x, y = self.pending.pop(0)
            rec.batches.append(hashlib.sha1(x.cpu().numpy().tobytes()).hexdigest())
            return x, y

        def estimate_loss(self):
            # evaluation draws its batches from the training stream, and each of 2 ranks draws half as many as
            # one process: with the shared stream, leave it where it was so that training batches still match
            state = self.train_sampler.generator.get_state() if rec.shared else None
            losses = super().estimate_loss()
            if rec.shared:
                self.train_sampler.generator.set_state(state)
            rec.losses.append([self.iter_num, losses])
            return losses

        def _wrap(self, model):
            if rec.setup_pause:
                rec.pause_in_setup(self.world.rank)
            model = super()._wrap(model)
            ddp = getattr(model, "_orig_mod", model)  # under torch.compile
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                def counting_allreduce(state, bucket):
                    rec.exchanges[self.iter_num] += 1
                    return allreduce_hook(None, bucket)

                ddp.register_comm_hook(None, counting_allreduce)
            return model

    return InstrumentedTrainer


def instrumented_run(argv, instruments):
    """train.main(argv) with the instruments in place (restored afterwards); returns the instruments."""
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, **kwargs):
        """torch.nn.utils.clip_grad_norm_, also recording the norm before clipping."""
        norm = real_clip(parameters, max_norm, **kwargs)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
        instruments.grad_norms.append(full.item())
        return norm

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(train, "Trainer", instrumented_trainer(instruments)))
        patches.enter_context(mock.patch.object(torch.nn.utils, "clip_grad_norm_", clip_grad_norm_))
        if "--parallel=fsdp" in argv:  # (only then: importing FSDP's module costs a worker ~1 s of start-up)
            import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
            real_reduce = fsdp_param_group.foreach_reduce

            def foreach_reduce(*args, **kwargs):
                """FSDP's gradient reduce-scatter of one parameter group (skipped under
                requires_gradient_sync=False)."""
                instruments.exchanges[instruments.step] += 1
                return real_reduce(*args, **kwargs)

            patches.enter_context(mock.patch.object(fsdp_param_group, "foreach_reduce", foreach_reduce))
        default_dtype = torch.get_default_dtype()
        if instruments.float64:
            torch.set_default_dtype(torch.float64)
        try:
            train.main(argv)
        finally:
            torch.set_default_dtype(default_dtype)
    return instruments


def main():
    report_dir = Path(os.environ["REPORT_DIR"])
    rank = int(os.environ.get("RANK", 0))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"pid{rank}").write_text(str(os.getpid()))  # so that a test can tell whether it still runs
    writes = []  # paths this process opened for writing

    def audit(event, args):
        if event == "open" and args[0] is not None and not str(args[0]).startswith(str(report_dir)):
            path, mode, flags = args
            if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & (os.O_WRONLY | os.O_RDWR)):
                writes.append(str(path))
        elif event in ("os.rename", "os.mkdir", "os.remove"):
            writes.append(str(args[1] if event == "os.rename" else args[0]))

    sys.addaudithook(audit)
    env = {k: int(os.environ.get(k.upper(), default)) for k, default in
           (("fail_rank", -1), ("fail_iter", 0), ("sigterm_rank", -1), ("sigterm_iter", 0))}
    instruments = Instruments(shared=os.environ.get("SHARED_BATCHES") == "1", float64=os.environ.get("FLOAT64") == "1",
                              setup_pause=float(os.environ.get("SETUP_PAUSE", 0)), **env)
    run_main(lambda: instrumented_run(sys.argv[1:], instruments))
    (report_dir / f"rank{rank}.json").write_text(json.dumps(dict(instruments.report(), writes=writes)))


if __name__ == "__main__":
    main()
