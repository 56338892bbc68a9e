"""
train.py's whole training step as one CUDA graph, replayed every step: a small model's step is bound by launching
its kernels from Python (hundreds a micro-step, the optimizer's too), not by the GPU's arithmetic. Owned here:
- check_setting() and decide(): whether the graph applies (--cuda_graph; CUDA, one process, no float16, batches of
  one shape), and why not, in one line;
- GraphedStep: the static inputs each step's batches are copied into, the step's numbers (the learning rate, Muon's
  momentum: optimizers.DeviceNumbers) filled in place, and the graph of Trainer.micro_step for every micro-batch,
  then Trainer.update, captured at the first step after a warm-up (lazy state, compilation, cuBLAS's workspaces);
- snapshot/restore, which put back what the warm-up and capture changed (the weights, the optimizer's state, the
  non-finite mark, every RNG, the batch sampler): a graphed run computes exactly the steps an eager run computes.
A capture that fails says so in one line and training goes on eagerly, as machinery/generation/decode.py's FixedStep does.
"""

import torch

from machinery.weights import checkpoint
from machinery.errors import UserError, first_line
from machinery.hardware import pick_device
from optimizers import DeviceNumbers

# what a run says when its step runs without the graph (a failed capture, or where the graph cannot apply)
EAGER_NOTE = "note: the training step runs eagerly, without a CUDA graph"
WARMUP_STEPS = 2  # the first makes the lazy state (optimizer, compilation, workspaces), the second runs with it


def decide(asked, device_type, distributed, parallel, dtype, chat):
    """Whether train.py's step runs as one CUDA graph, from the setting cuda_graph (asked: None for auto, True,
    False) and the run. Returns (on, note): note is the one line to log where the graph cannot apply on CUDA; None
    when it is on, off as asked, or off CUDA (where True is refused by check_setting)."""
    if asked is False or device_type != "cuda":
        return False, None
    why = None
    if distributed:
        why = f"under torchrun with --parallel={parallel}: " + (
            "FSDP gathers and frees its shards from the host" if parallel == "fsdp" else
            "DDP's gradient hooks and no_sync run on the host")
    elif dtype == "float16":
        why = "dtype float16: the GradScaler's skipped steps need a host sync (bfloat16 needs none)"
    elif chat:
        why = "a chat dataset: its batches change shape, each padded to its longest conversation"
    return why is None, why and f"{EAGER_NOTE} ({why})"


def check_setting(cfg):
    """cuda_graph=True refused in one line off CUDA (TrainConfig.validate, before anything starts)."""
    if cfg.cuda_graph and not (device := pick_device(cfg.device)).startswith("cuda"):
        raise UserError(f"cuda_graph needs a CUDA device (--device=cuda); this run is on {device}")


def build(trainer):
    """The trainer's GraphedStep where decide() allows it, else None (and the reason logged, where there is one)."""
    on, note = decide(trainer.cfg.cuda_graph, trainer.device_type, trainer.world.distributed, trainer.cfg.parallel,
                      trainer.dtype, trainer.token_mean is not None)
    if note:
        trainer.log(note)
    return GraphedStep(trainer) if on else None


class CudaGraph:
    """torch.cuda.CUDAGraph as PyTorch's whole-network capture makes one: warmed up on a side stream, captured on
    that stream, replayed on the current one. (Tests on the CPU stand in for it: tests/test_step_graph.py.)"""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream, self.graph = torch.cuda.Stream(self.device), torch.cuda.CUDAGraph()

    def warm_up(self, fn, times):
        with torch.cuda.device(self.device):  # (the thread's current GPU may be another: cuda:N)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(times):
                    fn()
            torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn):
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(self.graph, stream=self.stream):
                    fn()
            finally:
                torch.cuda.set_stream(stream)  # a failed capture can leave its stream current

    def replay(self):
        self.graph.replay()


class GraphedStep:
    """Trainer.optimizer_step as one graph: ready() captures it at the first step, step(x, y) replays it."""

    def __init__(self, trainer, graph=None):
        self.trainer = trainer
        cfg, device = trainer.cfg, trainer.device
        # the graph's inputs, one x and one y per micro-step, of their own (no sampler's tensor is ever one of them)
        self.xs, self.ys = ([torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long, device=device)
                             for _ in range(trainer.accum)] for _ in "xy")
        self.numbers = DeviceNumbers(trainer.optimizer, device)
        self.iteration = torch.zeros((), dtype=torch.long, device=device)  # the step's number (the non-finite mark)
        self.loss = torch.zeros((), device=device)  # the step's loss, written by the graph
        self.graph = graph or CudaGraph(device)
        self.captured = self.failed = False

    def ready(self):
        """Whether the step runs as the graph: captured at the first call; False from then on if that failed (said
        in one line: the step then runs eagerly, from the state the capture found)."""
        if not (self.captured or self.failed):
            try:
                self._capture()
                self.captured = True
            except Exception as e:  # kernels that cannot be captured, a host sync, a compiler that failed, ...
                self.failed = True
                self.trainer.optimizer.zero_grad(set_to_none=True)  # (the eager step begins without gradients)
                self.trainer.log(f"{EAGER_NOTE} ({type(e).__name__}: {first_line(e)})")
        return self.captured

    def step(self, x, y):
        """Trainer.optimizer_step's step, replayed: (x, y) and the accum - 1 batches after it copied into the static
        inputs, this step's numbers filled in; returns (loss, next x, next y) as the eager step does."""
        t = self.trainer
        batches = [(x, y)] + [t.next_batch() for _ in range(t.accum - 1)]  # (the eager step draws them in this order)
        for (x, y), static_x, static_y in zip(batches, self.xs, self.ys):
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
        self.numbers.fill()  # the learning rate and momentum that set_schedule set for this step
        self.iteration.fill_(t.iter_num + 1)  # numbered as the `iter N:` log line of this step
        self.graph.replay()
        return self.loss.clone(), *t.next_batch()  # (the next batch is fetched while the device works)

    def _capture(self):
        """Warm up, then capture; whatever happens, the state of training is put back as it was before (restore)."""
        t = self.trainer
        saved = snapshot(t)
        try:
            self.iteration.fill_(t.iter_num + 1)
            self.numbers.fill()  # (before read(): from the groups' floats)
            with self.numbers.read():
                self.graph.warm_up(self._warm_up_step, WARMUP_STEPS)
            t.optimizer.zero_grad(set_to_none=True)  # the captured backward makes the gradients, in the graph's memory
            with self.numbers.read(capturing=True):
                self.graph.capture(self._run)
        finally:
            restore(t, saved)

    def _warm_up_step(self):
        self._run()
        self.trainer.optimizer.zero_grad(set_to_none=True)  # each begins as the captured step does: no gradients

    def _run(self):
        """What the graph holds: every micro-step on the static inputs, then the update; its loss into self.loss.
        (One process: no gradient synchronisation to skip.)"""
        t = self.trainer
        for x, y in zip(self.xs, self.ys):
            loss = t.micro_step(x, y, self.iteration)
        self.loss.copy_(t.update(loss).detach())


def snapshot(trainer):
    """Copies of what a step changes that training keeps: the weights (and buffers), the optimizer's state, the
    non-finite mark, every RNG and the batch sampler (checkpoint.rank_state)."""
    model = trainer.raw_model
    return {"tensors": [t.detach().clone() for t in (*model.parameters(), *model.buffers())],
            "optimizer": {p: {key: value.clone() for key, value in state.items()}
                          for p, state in trainer.optimizer.state.items()},
            "nonfinite_at": trainer.nonfinite.at.clone(),
            "rank": checkpoint.rank_state(trainer.train_sampler.state_dict())}


@torch.no_grad()
def restore(trainer, saved):
    """Put back what snapshot() copied, in place (the graph reads and writes these very tensors). Optimizer state
    that the warm-up made (a new optimizer's) is zeroed: AdamW's and Muon's lazy state (moments, momentum, step
    counts) starts at zero."""
    model = trainer.raw_model
    for tensor, before in zip((*model.parameters(), *model.buffers()), saved["tensors"]):
        tensor.copy_(before)
    for p, state in trainer.optimizer.state.items():
        before = saved["optimizer"].get(p, {})
        for key, value in state.items():
            if key in before:
                value.copy_(before[key])
            else:
                value.zero_()
    trainer.nonfinite.at.copy_(saved["nonfinite_at"])
    checkpoint.restore_rank_state(saved["rank"], trainer.train_sampler)
