"""
How the weights are updated: the optimizer (AdamW, or Muon for the hidden matrices with AdamW
for the rest) and the schedule of its learning rate and momentum (set_schedule).

    optimizer = build_optimizer(model, "muon", learning_rate, weight_decay, betas, device_type,
                                muon_lr=0.02, muon_momentum=0.95)

Either way it is ONE torch.optim.Optimizer, so the training loop, torch.amp.GradScaler and
torch.distributed.checkpoint's get/set_optimizer_state_dict treat it like AdamW. A step captured as a
CUDA graph (machinery/training/step_graph.py) reads the numbers a step computes with (step_numbers: the learning
rate, Muon's momentum and factors) from device tensors (DeviceNumbers) instead of the groups' floats.

One schedule drives every group: the loop sets group["lr"] to the schedule's AdamW learning rate
(learning_rate times a warmup/decay multiplier) on every group; a group then steps with
group["lr"] * group["lr_scale"]. The Muon group's lr_scale is muon_lr / learning_rate, the AdamW
groups' 1.0, so Muon's rate follows the same warmup and decay, scaled.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/): SGD momentum (Nesterov) whose
update, per matrix, is replaced by the nearest semi-orthogonal matrix (all singular values ~1),
computed by a few steps (muon_ns_steps, 5 by default) of a quintic Newton-Schulz iteration with
Polar Express's coefficients. It is meant for the 2-D weights inside
the transformer blocks; embeddings (the token embedding is also the output layer), LayerNorm
gains and biases stay on AdamW, as in modded-nanogpt. As there, the matrices of one shape are
orthogonalised together, stacked: a few batched products per shape instead of a few per matrix.
"""

import inspect
import math
import sys
from contextlib import contextmanager

import torch
from torch.optim.adam import adam

from machinery.errors import first_line

# The quintic Newton-Schulz step X <- aX + (bA + cA^2)X with one (a, b, c) per step: Polar Express (Amsel,
# Persson, Musco, Gower 2025, as modded-nanogpt uses it), where each step's polynomial is fitted to the range
# of singular values the previous steps leave. (torch.optim.Muon repeats Keller Jordan's (3.4445, -4.7750,
# 2.0315).) After 5 steps the singular values lie within ~0.86-1.14; after 3 only within ~0.16-1.9, yet
# the CPU speedrun learns as well with 3 as with 5, for 40 % less work (BENCHMARKS.md).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def build_optimizer(model, name, learning_rate, weight_decay, betas, device_type, muon_lr=0.02, muon_momentum=0.95,
                    muon_weight_decay=0.0, muon_ns_steps=5, compile=False):
    """AdamW ("adamw", as nanoGPT's configure_optimizers) or MuonAdamW ("muon"); the muon_ settings
    (Muon's rate, momentum, decoupled weight decay, Newton-Schulz steps) and compile (Newton-Schulz through
    torch.compile, where training compiles the model) only matter for "muon"."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # the fused kernel is the fastest on CUDA and on the CPU (there 3.5x faster than foreach for
    # the speedrun's model, BENCHMARKS.md); elsewhere the foreach (multi-tensor) one
    fused = device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
    kernel = {"fused": True} if fused else {"foreach": True}
    if name == "adamw":
        return torch.optim.AdamW(_adamw_groups(params.values(), weight_decay), lr=learning_rate,
                                 betas=betas, **kernel)
    if name != "muon":
        raise ValueError(f"unknown optimizer {name!r}; use adamw or muon")
    hidden = [p for n, p in params.items() if is_hidden_matrix(n, p)]
    rest = [p for n, p in params.items() if not is_hidden_matrix(n, p)]
    muon_group = {"params": hidden, "use_muon": True, "lr_scale": muon_lr / learning_rate,
                  "weight_decay": muon_weight_decay}
    groups = [muon_group] + _adamw_groups(rest, weight_decay)
    return MuonAdamW(groups, lr=learning_rate, betas=betas, momentum=muon_momentum, ns_steps=muon_ns_steps,
                     compile=compile, **kernel)


def is_hidden_matrix(name, param):
    """The 2-D weights inside the blocks (attention qkv/proj, MLP fc/proj): Muon's share."""
    return name.startswith("blocks.") and param.dim() == 2


def _adamw_groups(params, weight_decay):
    """Weight decay on matrices and embeddings (>= 2-D) only, not on biases and LayerNorm gains. A group left empty
    (LoRA trains matrices only) is left out: torch's checkpoint functions refuse more than one empty group."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.AdamW):
    """AdamW, except that groups with use_muon=True take Muon's update; every group steps with
    lr * lr_scale. Being an AdamW subclass, the AdamW groups run torch's own AdamW code (bit-identical
    to torch.optim.AdamW) and every group carries the same keys, which checkpoint round trips keep.
    With compile=True (where training compiles the model) the Newton-Schulz iteration is compiled too."""

    def __init__(self, params, lr, betas, momentum=0.95, ns_steps=5, compile=False, **adamw_kwargs):
        super().__init__(params, lr=lr, betas=betas, **adamw_kwargs)
        for group in self.param_groups:
            group.setdefault("use_muon", False)
            group.setdefault("lr_scale", 1.0)
            group.setdefault("momentum", momentum)
            group.setdefault("ns_steps", ns_steps)
            if group["use_muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D matrices only")
        # GradScaler then unscales, checks for inf/NaN and skips the step itself (the fused AdamW
        # kernel could do that inside, but the Muon update could not)
        self._step_supports_amp_scaling = False
        self.newton_schulz = compiled_or_eager(newton_schulz) if compile else newton_schulz
        self.numbers = None  # a captured step's (DeviceNumbers): each group's step_numbers as device tensors

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            numbers = self.numbers[i] if self.numbers is not None else step_numbers(group)
            if group["use_muon"]:
                self._muon_step(group, numbers)
            else:
                self._adamw_step(group, numbers["lr"])
        return loss

    def _adamw_step(self, group, lr):
        """torch.optim.Adam.step for one group (decoupled weight decay: AdamW), at lr (lr * lr_scale)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
             foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
             fused=group["fused"], grad_scale=None, found_inf=None,
             decoupled_weight_decay=group["decoupled_weight_decay"])

    def _muon_step(self, group, numbers):
        """torch.optim.Muon's update (Nesterov momentum, Newton-Schulz, decoupled weight decay), with
        Polar Express's coefficients. The matrices of one shape are orthogonalised together, stacked: one
        batched iteration per shape (a GPU runs each product of all the layers as one kernel instead of one
        per layer, as modded-nanogpt does), each matrix getting the same products as alone; the elementwise
        work runs as multi-tensor (foreach) kernels. numbers: step_numbers(group), floats or device tensors."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        buffers, steps = [], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                # a step count, as AdamW's state has (Adam's load_state_dict expects one in every state), where
                # AdamW keeps it: on the device when fused or capturable (a captured step counts there), else the CPU
                on_device = group["fused"] or group["capturable"]
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            buffers.append(state["momentum_buffer"])
            steps.append(state["step"])
        torch._foreach_add_(steps, 1)
        grads = [p.grad for p in params]
        _lerp_(buffers, grads, numbers["1 - momentum"])  # buf = momentum * buf + (1 - momentum) * grad
        # grad + momentum * (buf - grad), in place on a copy: torch 2.11's FSDP (DTensor) has no out-of-place lerp
        nesterov = [g.clone() for g in grads]
        _lerp_(nesterov, buffers, numbers["momentum"])
        for same in same_shape(params):
            updates = self._orthogonalize([nesterov[i] for i in same], group["ns_steps"])
            matrices = [params[i] for i in same]
            torch._foreach_mul_(matrices, numbers["decay"])
            _add_scaled_(matrices, updates, numbers[tuple(matrices[0].shape)])

    def _orthogonalize(self, updates, ns_steps):
        """Newton-Schulz of each whole matrix of a list of same-shape ones, as one stack. Under FSDP2 a
        parameter, its grad and the momentum are DTensors sharded on dim 0, and the iteration needs whole
        matrices: the stack of this rank's shards is gathered (one all-gather per shape), orthogonalised on
        every rank (the same input gives the same result), and each rank keeps its shard of each result
        (distribute_tensor with src_data_rank=None slices locally, no communication)."""
        if not hasattr(updates[0], "full_tensor"):  # plain tensors (one process, or DDP)
            return list(self.newton_schulz(torch.stack(updates), ns_steps).unbind(0))
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        first = updates[0]
        shape = (len(updates), *first.shape)
        stacked = DTensor.from_local(torch.stack([u.to_local() for u in updates]), first.device_mesh,
                                     [Shard(p.dim + 1) if p.is_shard() else p for p in first.placements],
                                     shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        full = self.newton_schulz(stacked.full_tensor(), ns_steps)
        return [distribute_tensor(m, first.device_mesh, first.placements, src_data_rank=None) for m in full.unbind(0)]


def same_shape(params):
    """The indices of params grouped by shape, dtype, device and sharding (the matrices that stack), in order."""
    groups = {}
    for i, p in enumerate(params):
        groups.setdefault((p.shape, p.dtype, p.device, getattr(p, "placements", None)), []).append(i)
    return list(groups.values())


def step_numbers(group):
    """The numbers one step of a group computes with, from its floats (the schedule's lr and momentum) as Python
    computes them: AdamW's rate ("lr", lr * lr_scale); Muon's weight-decay factor, its two lerp weights and, per
    matrix shape (rows, cols), the update's scale. The eager step uses them as they are; a captured one reads them
    from device tensors filled with them (DeviceNumbers), so both compute with the same numbers."""
    lr = group["lr"] * group.get("lr_scale", 1.0)  # (torch.optim.AdamW's groups: no lr_scale)
    if not group.get("use_muon"):
        return {"lr": lr}
    momentum = group["momentum"]
    numbers = {"decay": 1 - lr * group["weight_decay"], "1 - momentum": 1 - momentum, "momentum": momentum}
    for rows, cols in {tuple(p.shape) for p in group["params"]}:
        # torch.optim.Muon's scaling: the update's RMS does not depend on the aspect ratio
        numbers[(rows, cols)] = -lr * math.sqrt(max(1.0, rows / cols))
    return numbers


class DeviceNumbers:
    """The step_numbers of every group of an optimizer as 0-d tensors on a device, for a step captured as a CUDA
    graph: the graph reads them where it runs, and fill() writes each step's values into them, in place, before it
    is replayed. Muon's in float32, what its kernels compute with for train.py's float32 weights (they round a
    Python float to it: the same numbers). AdamW's lr in what torch's fused kernel reads of a tensor: a double on
    the CPU (exact); on CUDA a float, though it computes with a Python float as a double: there the captured
    step's rate is the schedule's rounded to float32, within 2^-24 (tests/test_cuda.py)."""

    def __init__(self, optimizer, device):
        self.optimizer = optimizer
        lr_dtype = torch.float32 if torch.device(device).type == "cuda" else torch.float64
        self.tensors = [{name: torch.zeros((), dtype=lr_dtype if name == "lr" else torch.float32, device=device)
                         for name in step_numbers(group)} for group in optimizer.param_groups]

    def fill(self):
        """This step's numbers, from the groups' floats (set_schedule's), into the tensors."""
        for group, tensors in zip(self.optimizer.param_groups, self.tensors):
            for name, value in step_numbers(group).items():
                tensors[name].fill_(value)

    @contextmanager
    def read(self, capturing=False):
        """Within: the optimizer's step reads these tensors instead of its groups' floats (what a capture records,
        so that every replay reads them); with capturing, torch's capturable flag too (AdamW checks it then).
        After: the groups as they were, floats that checkpoints save and set_schedule sets."""
        groups = self.optimizer.param_groups
        saved = [(group["lr"], group["capturable"]) for group in groups]
        if isinstance(self.optimizer, MuonAdamW):
            self.optimizer.numbers = self.tensors
        else:  # torch's AdamW: its step takes a tensor lr
            for group, tensors in zip(groups, self.tensors):
                group["lr"] = tensors["lr"]
        for group in groups:
            group["capturable"] = capturing
        try:
            yield
        finally:
            for group, (lr, capturable) in zip(groups, saved):
                group["lr"], group["capturable"] = lr, capturable
            if isinstance(self.optimizer, MuonAdamW):
                self.optimizer.numbers = None


def _lerp_(tensors, ends, weight):
    """tensors += weight * (ends - tensors) (torch's lerp), by a float or by a 0-d tensor (a captured step's), whose
    kernel computes the same formula (bit for bit: tests/test_step_graph.py on the CPU, tests/test_cuda.py)."""
    torch._foreach_lerp_(tensors, ends, [weight.expand_as(t) for t in tensors] if torch.is_tensor(weight) else weight)


def _add_scaled_(tensors, others, scale):
    """tensors += scale * others: with a float, add's alpha; with a 0-d tensor (a captured step's), addcmul by it,
    which rounds as add with that alpha does (each one multiply-add; bit for bit: tests/test_step_graph.py on the
    CPU, tests/test_cuda.py)."""
    if torch.is_tensor(scale):
        torch._foreach_addcmul_(tensors, others, [scale.expand_as(t) for t in tensors])
    else:
        torch._foreach_add_(tensors, others, alpha=scale)


def compiled_or_eager(fn):
    """fn through torch.compile; if compiling fails (compilers fail in many ways: a missing toolchain, an
    unsupported GPU), a one-line warning and fn itself from then on."""
    compiled = torch.compile(fn, dynamic=False)

    def run(*args, **kwargs):
        nonlocal compiled
        if compiled is not None:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:
                print(f"warning: torch.compile of {fn.__name__} failed ({type(e).__name__}: {first_line(e)}); "
                      f"running it uncompiled", file=sys.stderr)
                compiled = None
        return fn(*args, **kwargs)

    return run


def working_dtype(g):
    """Newton-Schulz's dtype for g: bfloat16 on CUDA, as Muon's authors run it; elsewhere float32 (CPUs
    without native bf16, AVX2, emulate it many times slower), or float64 for a float64 gradient (never
    narrower than what it is given)."""
    return torch.bfloat16 if g.is_cuda else torch.promote_types(g.dtype, torch.float32)


def newton_schulz(g, steps=5, eps=1e-7, dtype=None):
    """About U V^T for G = U S V^T (singular values pushed near 1): X <- aX + (bA + cA^2)X with A = XX^T,
    for the first `steps` of POLAR_EXPRESS's coefficients, from X = G / (1.02 |G|) (the Frobenius norm is
    at least the spectral norm, so singular values start below 1, with 2 % to spare for rounding). G is a
    matrix or a stack of matrices (batch, rows, cols), each orthogonalised on its own with the same products
    as alone. In dtype, by default working_dtype(g) (bfloat16 on CUDA); the result in g's dtype."""
    if not 1 <= steps <= len(POLAR_EXPRESS):
        raise ValueError(f"Newton-Schulz steps must be 1 to {len(POLAR_EXPRESS)}, got {steps}")
    coefficients = POLAR_EXPRESS[:steps]
    dtype = dtype or working_dtype(g)
    x = g.to(dtype)
    # (normalised before the transpose: a stack's norm is then a reduction over contiguous memory, the same sum)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02).clamp(min=eps)
    tall = g.size(-2) > g.size(-1)
    if tall:  # work on the wide orientation: A is then the smaller Gram matrix
        x = x.mT
    if dtype != torch.bfloat16 and x.size(-2) < x.size(-1):  # (bfloat16, as on CUDA: the plain iteration)
        x = _newton_schulz_small(x, coefficients)
    else:
        for a, b, c in coefficients:
            gram = x @ x.mT
            x = _addmm(x, _addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.to(g.dtype)


def _newton_schulz_small(x, coefficients):
    """The same iteration for a wide x (rows < cols), computed on rows x rows matrices only. Every
    iterate is X_k = Q_k X_0: Q_0 = I, Q_k+1 = (aI + bA_k + cA_k^2) Q_k, and A_k = X_k X_k^T = Q_k G Q_k^T
    with G = X_0 X_0^T. So X_0 is multiplied twice (G, and Q X_0 at the end) instead of twice per step:
    for the speedrun's 128 x 512 matrices a third fewer FLOPs (BENCHMARKS.md), the same matrix up to
    float32 rounding. (In bfloat16, as on CUDA, the plain iteration stays: it is what Muon is run with there.)"""
    gram = x @ x.mT
    q = None
    for a, b, c in coefficients:
        A = gram if q is None else q @ gram @ q.mT
        poly = _addmm(A, A, A, beta=b, alpha=c)  # bA + cA^2
        if q is None:
            q = poly
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = _addmm(q, poly, q, beta=a)
    return q @ x


def _addmm(input, m1, m2, beta, alpha=1.0):
    """beta * input + alpha * m1 @ m2 as one product: addmm for matrices, baddbmm for stacks of them."""
    return (torch.addmm if m1.dim() == 2 else torch.baddbmm)(input, m1, m2, beta=beta, alpha=alpha)


def set_schedule(optimizer, it, cfg):
    """Set step it's learning rate on every group (get_lr) and Muon's momentum; returns the learning rate."""
    lr = get_lr(it, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
        if group.get("use_muon"):
            group["momentum"] = muon_momentum(it, cfg)
    return lr


def muon_momentum(it, cfg):
    """Muon's momentum at step it: from 0.85 to muon_momentum over muon_momentum_warmup steps, as in
    modded-nanogpt (less momentum while the gradients change fast at the start), then constant."""
    if it >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = it / cfg.muon_momentum_warmup
    return (1 - frac) * 0.85 + frac * cfg.muon_momentum


def get_lr(it, cfg):
    """The schedule (of the AdamW rate; Muon's follows it, scaled): linear warmup (never 0 at step 0),
    then cosine decay to min_lr at lr_decay_iters."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)
