"""
Data-parallel training under torchrun: joining the job, wrapping the model (DDP replicates
it, FSDP shards it), skipping the gradient sync on all but the last micro-step, each rank's
seeds, the few collectives the training loop needs (and a resume's check that every rank
resumed together), and stopping every rank together (StopFlag). A single process is rank 0
of 1: no collective, nothing to wrap, but StopFlag's Ctrl-C.

    torchrun --standalone --nproc_per_node=8 train.py ...   (NCCL on GPUs, gloo on CPUs)
"""

import gc
import os
import random
import signal
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from machinery.errors import UserError
from machinery.hardware import pick_device


@dataclass
class World:
    """This process's place among the training processes (a single process: rank 0 of 1)."""
    distributed: bool = False
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    launcher: int = 0  # under torchrun: the pid of its agent, this process's parent when the job began

    @property
    def is_master(self):
        """Rank 0 writes checkpoints, logs and wandb."""
        return self.rank == 0


def setup(device_name):
    """Join the torchrun job if there is one (env:// rendezvous); pick this process's device."""
    device = pick_device(device_name)
    if "RANK" not in os.environ:
        return World(), device
    import torch.distributed as dist

    launcher = os.getppid()  # first: the agent may die during the setup that follows (StopFlag)
    rank, local_rank, size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "mps":
        raise UserError("torchrun on mps is not supported (no collective backend for it); train in one process, "
                        "or add --device=cpu")
    backend = "gloo"
    if device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"process {local_rank} on this node has no GPU of its own ({torch.cuda.device_count()} "
                            f"GPUs here); start at most that many with torchrun --nproc_per_node")
        device, backend = f"cuda:{local_rank}", "nccl"  # one process per GPU
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, device_id=torch.device(device) if backend == "nccl" else None)
    return World(True, rank, local_rank, size, launcher), device


def teardown(finished):
    """Leave the process group, if any. After a normal end, first wait until every rank is done: gloo
    aborts a process whose peer hangs up while it is still exchanging data. After an error, leave at
    once (the other ranks then fail on their next collective, or torchrun stops them)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # free the model (and DDP's reducer, which uses the group) first: it sits in a reference cycle, and
        # destroyed later, at exit, it aborted 3 of 60 2-rank gloo runs (0 of 60 so). (Only here: a collection
        # costs a process full of objects, such as the test suite's, tenths of a second.)
        gc.collect()
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def micro_steps(gradient_accumulation_steps, world):
    """This rank's share of the global micro-batches per optimizer step."""
    if gradient_accumulation_steps % world.size:
        raise UserError(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be divisible by "
                        f"the number of processes ({world.size})")
    return gradient_accumulation_steps // world.size


def seed_rank(seed, world):
    """Every RNG of this process seeded for its rank (after the model's initialisation): dropout differs between
    ranks."""
    torch.manual_seed(seed + world.rank)
    random.seed(seed + world.rank)
    np.random.seed(seed + world.rank)


def check_resumed_together(iter_num, written_by, world, path, log):
    """After a resume from the checkpoint at path: every rank resumed it at the same iteration (a one-line error
    otherwise), and a note where another number of processes wrote it (written_by; None: it does not say)."""
    if written_by is not None and written_by != world.size:
        log(f"note: checkpoint was written by {written_by} processes, now {world.size}: data order and dropout are "
            f"reseeded")
    starts = gather_objects(iter_num, world)
    if len(set(starts)) > 1:
        raise UserError(f"the processes resumed from different checkpoints (iterations {starts}); out_dir must be one "
                        f"shared directory, or hold the same {os.path.basename(path)}, on every node")


def all_reduce(tensor, op="sum"):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def gather_objects(obj, world):
    """A list with every rank's obj (just [obj] in a single process)."""
    if not world.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def shard(model):
    """FSDP: each block's parameters (then the rest) are split across the ranks, on the device the model
    is on. Call it before building the optimizer, which must see the sharded parameters.

    The mesh is named, not left to fully_shard: its default is a mesh of the machine's accelerator, so on a
    machine with a GPU a --device=cpu job (gloo) got a CUDA mesh, which puts each rank on GPU LOCAL_RANK
    (rank 1 of 2 on a 1-GPU machine failed while rank 0 waited for it: the hang in docs/benchmarks-history.md,
    *GPU (issue 32)*) and the shards there."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def replicate(model, world, device_type):
    """DDP: every rank holds the whole model; gradients are all-reduced in backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[world.local_rank] if device_type == "cuda" else None)


def gradient_sync(model, raw_model, world, parallel, sync):
    """The context for one micro-step's backward: with sync=False the gradients stay local (DDP's
    no_sync, FSDP's requires_gradient_sync), so they are exchanged once per optimizer step."""
    if sync or not world.distributed:
        return nullcontext()
    if parallel == "fsdp":
        return _fsdp_no_sync(raw_model)
    return model.no_sync()  # a compiled model forwards this to the DDP module it wraps


@contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------- stopping cleanly
#
# Ctrl-C or SIGTERM (a cluster's preemption, `kill`, torchrun passing one on) asks the loop to finish its step,
# save and exit 0. A second signal acts as usual, so Ctrl-C twice interrupts at once (the atomic save leaves the
# previous checkpoint whole). Under torchrun, the death of the launcher does the same: torchrun starts its workers
# in sessions of their own, so when its agent is killed with SIGKILL (which it cannot pass on) they would go on
# training, unseen, into the out_dir the next launch uses; a worker notices that its parent process is no longer
# the one it had when it joined the job (World.launcher, taken before the setup, which may be long: a token scan, a
# compilation), and the job saves and stops.


class StopFlag:
    """Catches SIGINT and SIGTERM until restore(); requested() says whether the loop should stop."""

    def __init__(self, launcher=None):
        self.name = None
        self.launcher = launcher  # under torchrun: its agent's pid (World.launcher)
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name
        self.restore()

    def requested(self, world, device, ask_ranks=True):
        """Has a signal come? Under torchrun every rank must stop at the same step, so a signal counts
        only on steps with ask_ranks (the same on every rank), where any rank's signal stops them all."""
        if not world.distributed:
            return self.name is not None
        if not ask_ranks:
            return False
        self._check_launcher()
        flag = all_reduce(torch.tensor([1.0 if self.name else 0.0], device=device), op="max").item() > 0
        if flag and self.name is None:
            self._check_launcher()  # (the launcher may have died after this rank looked, before another did)
            self.name = self.name or "a signal on another rank"
        return flag

    def _check_launcher(self):
        if self.name is None and self.launcher and os.getppid() != self.launcher:
            self.name = "the death of its launcher"  # (this process was handed to another parent, e.g. init)

    def restore(self):
        for sig, handler in self.previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)
