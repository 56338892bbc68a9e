"""
The model made ready to decode (prepare): in eval mode, its weights in the run's dtype (int8 where asked); on the CPU
its linear layers RowsLinear, prepacked for oneDNN where that is faster (PackedLinear), read by our own AMX kernel
where the CPU has it (KernelLinear; a whole Block a call: KernelBlock). calibrate measures how many rows one decoding
pass may hold with each row's result the one it gets alone, and whether a lone row must be padded.
Not owned: the kernels (machinery/generation/bf16_rows.py), int8 weights (machinery/weights/quantize.py), calibrate's file
(machinery/generation/calibration_cache.py), the passes (machinery/generation/model_runner.py).
"""

import collections
import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery import hardware
from machinery.generation import bf16_rows
from machinery.weights import quantize as quantization
from machinery.generation.calibration_cache import layer_key
from model import Block


class RowsLinear(nn.Module):
    """An nn.Linear as the engine runs it on the CPU, where a kernel may take another algorithm for fewer rows
    (another rounding: oneDNN's float32 product of a single row of 3072 -> 768, float16's of one row where the
    CPU has AVX-512 FP16): fewer than min_rows rows are computed as the first rows of min_rows. min_rows is
    MIN_ROWS unless calibrate() measured that a lone row gives the same result unpadded."""

    MIN_ROWS = 4

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight  # (tied to the token embedding in lm_head)
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape
        self.min_rows = self.MIN_ROWS

    @property
    def dtype(self):
        return self.weight.dtype

    def weight_rows(self, n):
        """The weight's first n rows (n outputs'), as a plain tensor."""
        return self.weight.detach()[:n]

    def memory(self):
        """(address, bytes) of the weight's memory."""
        storage = self.weight.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def product(self, x):
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        rows = x.shape[:-1].numel()
        if rows >= self.min_rows:
            return self.product(x)
        padded = torch.cat([x.reshape(rows, -1), x.new_zeros(self.min_rows - rows, x.size(-1))])
        return self.product(padded)[:rows].reshape(*x.shape[:-1], -1)


class PackedLinear(RowsLinear):
    """A RowsLinear whose weight is prepacked for oneDNN (the CPU's inference format): the same products, faster
    at the few rows of decoding, and fastest at 4 rows, so a lone row is padded to 4 (where the CPU has AMX a
    bfloat16 row alone is as fast, and calibrate leaves it unpadded; docs/benchmarks-history.md has the figures).
    The weight is packed in dtype (linear's own by default) and only the packed copy is kept (prepare converts each
    matrix and packs it in turn, so the model is never held unpacked in dtype as well)."""

    def __init__(self, linear, dtype=None):
        super().__init__(linear)
        del self.weight  # only the packed copy is kept
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(_contiguous(weight.to(dtype or weight.dtype)), None)

    @property
    def dtype(self):
        return self.packed.dtype

    def weight_rows(self, n):
        return self.packed.to_dense()[:n]  # (oneDNN's reorder back: calibrate's, once a shape)

    def memory(self):
        return torch.ops.mkldnn.data_ptr(self.packed), torch.ops.mkldnn._nbytes(self.packed)

    def product(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class KernelLinear(PackedLinear):
    """A PackedLinear whose decoding passes (one position a row: x of shape (rows, 1, in)) run our own kernel over
    the packed weight (machinery/generation/bf16_rows.py: on a CPU with AMX, faster than oneDNN's at 1-32 rows), every
    row summed alone, so unpadded and whatever the number of rows; prompts' chunks run oneDNN's AMX kernel, as in
    a PackedLinear. bfloat16 only; a weight that the kernel cannot read (bf16_rows.Kernel) keeps oneDNN's product
    in every pass."""

    def __init__(self, linear, dtype=None):
        super().__init__(linear, dtype)
        self.kernel = bf16_rows.Kernel(self.packed, linear.weight.detach())

    def forward(self, x):
        if self.kernel is not None and x.dim() == 3 and x.shape[1] == 1 and x.dtype == torch.bfloat16:
            return self.kernel(x, self.bias)
        return super().forward(x)


class KernelBlock(Block):
    """A Block whose decoding passes (one position a row, over a KV cache that our attention kernel reads: an
    engine's every such pass, or none) run as one call of our own (bf16_rows.BlockKernel: LayerNorms, products,
    attention, GELU and residuals, each row alone, rounded where PyTorch rounds); prompts' chunks run the Block's
    own modules, which it shares (the same parameters, the same names)."""

    def __init__(self, block, kernel):
        nn.Module.__init__(self)
        self.ln1, self.attn, self.ln2, self.ffwd = block.ln1, block.attn, block.ln2, block.ffwd
        self.kernel = kernel

    def forward(self, x, kv_cache=None, layer=0):
        rows = getattr(kv_cache, "kernel_rows", None)  # (decode.Rows's; model.generate's own cache has none)
        caches = rows(layer) if rows is not None and x.size(1) == 1 and x.dtype == torch.bfloat16 else None
        return self.kernel(x, caches) if caches is not None else super().forward(x, kv_cache, layer)


def _fuse(model):
    """Each of model's Blocks that bf16_rows.BlockKernel can bind made a KernelBlock."""
    for i, block in enumerate(model.blocks):
        kernel = bf16_rows.BlockKernel(block)
        if kernel is not None:
            model.blocks[i] = KernelBlock(block, kernel)


def _contiguous(weight):
    """weight in row-major order, as oneDNN packs it. A Hugging Face GPT-2's matrices load transposed (its
    Conv1D layout, in x out), and PyTorch copies a transposed matrix in one thread, block by block; seen as 3-d
    (groups of 16 rows), the same copy is split over the threads (BENCHMARKS.md), where there are several (in
    one, the blocked copy is the faster: prepare's workers)."""
    rows, cols = weight.shape
    if weight.is_contiguous() or rows % 16 or torch.get_num_threads() == 1:
        return weight.contiguous()
    return weight.view(rows // 16, 16, cols).contiguous().view(rows, cols)


@torch.inference_mode()
def calibrate(model, most, cache=None):
    """The most rows (up to most) that one decoding pass of model may hold on this CPU with each row's result
    the one it gets alone, measured on the model's RowsLinear layers; each one's min_rows set on the way.
    oneDNN blocks a product by its number of rows, and blockings round differently: on a CPU with AMX, its AMX
    kernel computes GPT-2's bfloat16 products one way up to 32 rows and another beyond; with AVX-512 BF16 and no
    AMX, GPT-2's 3072 -> 768 rounds a lone row otherwise than 12 to 31 rows (a lone row padded to 4 rows, as
    they do). A product of n probe rows (_probe_rows) is compared with each of its rows alone. Shapes are
    measured once each; a few milliseconds a shape and row count. cache: a CalibrationCache, whose
    measurements of this machine are taken instead of measuring again, and which keeps the new ones."""
    limit, measured = most, {}
    for m in model.modules():
        if isinstance(m, RowsLinear):
            key = layer_key(m)
            if key not in measured:
                measured[key] = cache.get(m, most) if cache else None
                if measured[key] is None:
                    measured[key] = _rows_alone(m, most)
                    if cache:
                        cache.put(m, most, *measured[key])
            m.min_rows = measured[key][0]
            limit = min(limit, measured[key][1])
    if cache:
        cache.save()
    return limit


PROBED = 256  # outputs of a layer whose sums its calibration rows nearly cancel (_probe_rows)
PROBES = 512  # probed outputs in each comparison of calibrate's (one other output counts 1/200 of one: measured)
PROBE_ROWS = 16  # rows at most (a small layer's: cheap products, but so many of them)


def _rows_alone(linear, most):
    """(min_rows, the most rows up to most whose product gives each row its result alone) of a RowsLinear."""
    probe = _probe_rows(linear)[:, None]  # each row as a decoding pass holds it: one position

    def each_alone(min_rows):  # each probe row's product alone, a lone row padded to min_rows
        linear.min_rows = min_rows
        return torch.cat([linear(row) for row in probe.split(1)])

    alone = each_alone(RowsLinear.MIN_ROWS)
    if not torch.equal(each_alone(1), alone):
        linear.min_rows = RowsLinear.MIN_ROWS
    for n in range(2, most + 1):
        # n rows at a time, each probe row in one product at least (n > len(probe): the probes over again)
        order = torch.arange(-(-max(n, len(probe)) // n) * n) % len(probe)
        if any(not torch.equal(linear(probe[rows]), alone[rows]) for rows in order.split(n)):
            return linear.min_rows, n - 1
    return linear.min_rows, most


def _probe_rows(linear):
    """Rows of inputs to linear whose outputs nearly cancel in its first PROBED outputs, bias included: each
    is a small difference of large terms there, so two orders of summing it round otherwise far more often than
    random rows' outputs do (bfloat16: docs/benchmarks-history.md): a few such rows show a difference that random
    rows would need thousands of to show. As many rows as make PROBES probed
    outputs, up to PROBE_ROWS. Random rows where the weights leave no such rows (too few inputs, a singular
    block)."""
    out_features, in_features = linear.out_features, linear.in_features
    probed = min(PROBED, out_features, in_features // 3)
    g = torch.Generator().manual_seed(0)
    rows = min(math.ceil(PROBES / (probed + (out_features - probed) / 200)), PROBE_ROWS)
    x = torch.randn(rows, in_features, generator=g, dtype=torch.float64)
    if probed:
        w = linear.weight_rows(probed).double()
        bias = linear.bias.detach()[:probed, None].double() if linear.bias is not None else 0
        # the first 2 * probed inputs solved for (the least such, for a well-conditioned system), the others
        # random: the first `probed` outputs 0 before x is rounded to the dtype
        a = w[:, :2 * probed]
        solved = (a.T @ torch.linalg.solve_ex(a @ a.T, -(w[:, 2 * probed:] @ x[:, 2 * probed:].T) - bias)[0]).T
        if solved.isfinite().all() and solved.abs().max() < 2 ** 8:
            x[:, :2 * probed] = solved
    return x.to(linear.dtype)


def prepare(model, device, dtype, compile=False, quantize=None):
    """The model ready to decode on device in dtype ("float32", "bfloat16", "float16"): in eval mode, its
    weights in dtype, and on the CPU its linear layers RowsLinear, prepacked where that is faster (can_pack),
    which the Engine calibrates (how many rows a pass may hold, whether a lone row is padded); on a CPU with AMX,
    bfloat16 decoding passes run our own kernel (KernelLinear), whatever their rows. compile: the engine will
    compile it (Engine(compile=True)), so nothing is prepacked: inductor packs weights itself (whether a row's
    result then depends on the others is up to its kernels). quantize="int8": int8 weights for the linear layers
    that take them (machinery/weights/quantize.py), before either."""
    on_cpu, model = torch.device(device).type == "cpu", model.eval()
    packs = on_cpu and can_pack(dtype)
    packed = KernelLinear if packs and uses_kernel(dtype) else PackedLinear
    if packs and not compile and not quantize:
        _pack(model, packed, hardware.DTYPES[dtype])  # before the rest is converted: no unpacked copy of them all
    model = quantization.quantize(model.to(device=device, dtype=hardware.DTYPES[dtype]), quantize)
    if compile:
        return model
    if on_cpu:
        rows_linear = packed if packs else RowsLinear
        for module, name, linear in _linear_layers(model):
            setattr(module, name, rows_linear(linear))
        if rows_linear is KernelLinear:
            _fuse(model)
    return model


def uses_kernel(dtype):
    """Do decoding passes in dtype run our own kernel (KernelLinear) here: bfloat16, on a CPU with AMX (where it
    was measured faster: BENCHMARKS.md), where it can be built? (A layer whose weight it cannot read, or where Linux
    does not lend AMX, keeps oneDNN's product: bf16_rows.Kernel.)"""
    return dtype == "bfloat16" and bf16_rows.chosen()


def _pack(model, packed, dtype):
    """model's linear layers packed (PackedLinear or KernelLinear) in dtype, each matrix converted and packed on its
    own, the layers shared out among the threads (each copying and packing a whole layer alone: faster than each
    layer's copies split over the threads; docs/benchmarks-history.md). Not the output layer, whose matrix is the
    token embedding's: it is packed after the model's conversion, from the converted matrix."""
    layers, threads = _linear_layers(model, shared=False), torch.get_num_threads()
    torch.set_num_threads(1)  # (read by each worker's first parallel operation)
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(lambda layer: packed(layer[2], dtype), layers))
    finally:
        torch.set_num_threads(threads)
    for (module, name, _), layer in zip(layers, done):
        setattr(module, name, layer)


def _linear_layers(model, shared=True):
    """(parent, name, layer) of model's nn.Linear layers; shared=False: not those whose weight is also another
    module's (an output layer tied to the token embedding)."""
    holders = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if type(child) is nn.Linear and (shared or holders[id(child.weight)] == 1)]


def can_pack(dtype):
    """Are the linear layers of dtype prepacked for oneDNN on this CPU? float32 on every x86 CPU; bfloat16 where
    the CPU computes it natively (AVX-512 BF16, AMX). Elsewhere PyTorch's own bfloat16 kernel is the faster one
    at a few rows: one matrix-vector product per row, converting as it reads, whose result for one row does
    not depend on the other rows either (tests/test_engine.py)."""
    if not torch.backends.mkldnn.is_available() or dtype not in ("float32", "bfloat16"):
        return False
    # packing bfloat16 needs oneDNN's support (any AVX-512 CPU), and gains only where the CPU computes it natively
    return dtype == "float32" or hardware.cpu_native("bfloat16") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
