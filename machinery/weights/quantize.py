"""
int8 weights for decoding on the CPU (--quantize=int8 of sample.py, serve.py and eval.py): weight-only
int8, one scale per output channel, for the linear layers and the output head, through PyTorch's own
kernel, torch.ops.aten._weight_int8pack_mm (no hand-written matmul, no other package).

Why: decoding one token reads every weight once, so on a CPU its speed is memory's, and int8 weights are a quarter
of float32's bytes and half of bfloat16's (BENCHMARKS.md). A row's result does not depend on the other rows (each
output is one dot product, accumulated in the same order), so the engine's batch-independence holds. The error
against float32 (bounded in tests/test_quantize.py): each weight off by at most half its row's step
(max|row| / 254), each activation and each output by bfloat16's rounding (2^-9).
Not here: which layers the engine packs otherwise (generation/packing.py), GGUF's Q8_0 (gguf_export.py).
"""

import torch
import torch.nn as nn

from machinery.errors import UserError

KINDS = ("int8",)
ALIGN = 32  # in_features must be a multiple of this (the kernel's aligned vector loads)


def check(kind, device):
    """A one-line error for a --quantize the model cannot run with (None: no quantization)."""
    if kind is None:
        return
    if kind not in KINDS:
        raise UserError(f"quantize must be int8 (weight-only int8 on the CPU), got {kind!r}")
    if device is not None and device.split(":")[0] != "cpu":
        raise UserError(f"--quantize={kind} runs on the CPU only; use --device=cpu or leave --quantize out")


def int8_per_channel(weight):
    """(int8 weights, bfloat16 scales) of a float matrix (out, in): per row, scale = max|row| / 127 (rounded
    to bfloat16, the kernel's type) and the weights round(w / scale) in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-30) / 127).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    """An nn.Linear with weight-only int8 weights (int8_per_channel), computed by _weight_int8pack_mm: bfloat16
    activations times them, accumulated in float32, the result rounded to bfloat16, cast back to the model's dtype
    and the bias (kept in that dtype) added."""

    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = int8_per_channel(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x):
        rows = x.shape[:-1]
        xb = x.reshape(-1, self.in_features)
        # the kernel's aligned loads need contiguous rows that start where an allocation does. Under torch.compile
        # there is no data pointer to look at (asking for it would split the graph, and dynamo would then compile
        # the attention once per layer): a copy is always a fresh allocation, and at decoding's few rows cheap
        if torch.compiler.is_compiling() or xb.dtype != torch.bfloat16 or not xb.is_contiguous() or xb.data_ptr() % 64:
            # bfloat16 on every CPU: the kernel is vectorised for it alone (float32 or float16: a scalar loop, far
            # slower) and only converts it, so AVX2 runs it too
            xb = xb.to(torch.bfloat16, memory_format=torch.contiguous_format, copy=True)
        y = torch.ops.aten._weight_int8pack_mm(xb, self.weight_int8, self.scale.to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)  # (y is this call's own tensor)
        return y.view(*rows, self.out_features)


def quantize(model, kind):
    """Replace model's linear layers (output head included) by their kind (int8) versions, in place, where the
    kernel can take them; returns model."""
    if kind is None:
        return model
    check(kind, next(model.parameters()).device.type)  # (--device=auto may have picked a GPU)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.in_features % ALIGN == 0:  # (others keep their weights)
                setattr(module, name, Int8Linear(child))
    return model
