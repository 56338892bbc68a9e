"""
Decoding's matrix products on a CPU with AMX, by a small kernel of our own (bf16_rows.c): rows of bfloat16
inputs times a weight that oneDNN has packed, read in place by AMX's tiles; and, with it, one row's attention
(attend) and a decoding pass's whole Block (BlockKernel). Why: decoding reads every weight once a token, so its
speed is the memory's, which oneDNN's AMX kernel does not reach at a few rows (BENCHMARKS.md, machine C).

bf16_rows.c is compiled on first use by the system's gcc, against the OpenMP runtime PyTorch has loaded (so the
kernel's threads are PyTorch's own, not a second pool fighting it for the cores), into the cache directory (load).
Where the kernels cannot be built or run (no gcc, not Linux on x86-64, no AVX-512 BF16, no AMX lent), load() or
Kernel is None and decoding is oneDNN's. Not here: which layers use it (packing.py), prompts' chunks (oneDNN's).
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch

from machinery import hardware
from machinery.fileio import cache_path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bf16_rows.c")
BLOCK = 32  # outputs in a block of oneDNN's packed weight, as bf16_rows.c reads it


@functools.lru_cache(maxsize=None)
def load():
    """The kernels (bf16_rows.c, through ctypes; .amx: whether Linux lends this process AMX, which bf16_rows needs),
    built on the first call on this machine; None where they cannot be built or run here. The library is
    $XDG_CACHE_HOME (or ~/.cache) /nanogpt/bf16_rows-<hash>.so, named by the source, the compiler and the runtime:
    a later start only loads it."""
    if sys.platform != "linux" or platform.machine() != "x86_64" or not torch.cpu._is_avx512_bf16_supported():
        return None
    compiler, openmp = shutil.which("gcc"), _openmp()
    if compiler is None or openmp is None:
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    stat = os.stat(compiler)
    key = hashlib.sha256(source + f"{compiler} {stat.st_size} {stat.st_mtime_ns} {openmp}".encode()).hexdigest()
    path = cache_path(f"bf16_rows-{key[:16]}.so")
    try:
        if not os.path.exists(path):
            _build(compiler, openmp, path)
        library = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError):
        return None
    library.amx = torch.cpu._is_amx_tile_supported() and library.bf16_amx() == 0
    library.bf16_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_int]
    library.bf16_attend.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 4 + [ctypes.c_float, ctypes.c_int]
    library.bf16_layer_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float]
    library.bf16_gelu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_int]
    library.bf16_block.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long] + \
        [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int]
    for function in (library.bf16_attend, library.bf16_layer_norm, library.bf16_gelu):
        function.restype = None
    return library


def _openmp():
    """The OpenMP runtime (GNU's libgomp) that PyTorch has loaded into this process (the one in its wheel, where
    another is loaded too), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libgomp" in line}
    except OSError:
        return None
    return min(paths, key=lambda path: ("torch" not in path, path)) if paths else None


def _build(compiler, openmp, path):
    """Compile bf16_rows.c into the shared library path (written whole or not at all: a build beside it in
    another process finds one or the other, never half)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as work:
        obj, lib = os.path.join(work, "bf16_rows.o"), os.path.join(work, "bf16_rows.so")
        # -fopenmp only to compile: linked so, gcc would add the system's libgomp, a second runtime beside PyTorch's
        for command in ([compiler, "-O3", "-fPIC", "-fopenmp", "-c", SOURCE, "-o", obj],
                        [compiler, "-shared", obj, openmp, "-lm", "-o", lib]):
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(lib, path)


class Kernel:
    """The kernel bound to a weight packed by oneDNN in bfloat16 (torch.ops.mkldnn._reorder_linear_weight of
    weight, out x in, converted), where its packed memory is laid out as bf16_rows.c reads it and Linux lends
    the process AMX; else None (new). The weight stays where oneDNN packed it (no second copy); one packed
    otherwise (another oneDNN, another CPU) keeps oneDNN's product."""

    def __new__(cls, packed, weight):
        library = load()
        if library is None or not library.amx:
            return None
        out_features, in_features = weight.shape
        blocks = -(-out_features // BLOCK)
        size = torch.ops.mkldnn._nbytes(packed)
        padded, rest = divmod(size, blocks * BLOCK * 2)  # inputs a block holds, zeros after in_features
        if in_features % 2 or rest or padded % 2 or padded < in_features or packed.dtype != torch.bfloat16:
            return None
        memory = torch.frombuffer((ctypes.c_uint16 * (size // 2)).from_address(torch.ops.mkldnn.data_ptr(packed)),
                                  dtype=torch.bfloat16)  # (the packed memory itself, not a copy)
        laid = memory.view(blocks, padded // 2, BLOCK, 2)
        for b in sorted({0, blocks // 2, blocks - 1}):  # a layout is the same in every block: three suffice
            rows = weight[b * BLOCK:(b + 1) * BLOCK].to(torch.bfloat16)
            block = laid[b].transpose(0, 1).reshape(BLOCK, padded)  # (a copy of this block alone)
            if not torch.equal(block[:len(rows), :in_features], rows):
                return None
        self = super().__new__(cls)
        self.function, self.packed, self.padded = library.bf16_rows, packed, padded
        self.address, self.out_features, self.in_features = torch.ops.mkldnn.data_ptr(packed), out_features, in_features
        return self

    def __call__(self, x, bias=None):
        """x (..., in) bfloat16 times the weight, plus bias (out, bfloat16, or None): (..., out) bfloat16. (Decoding
        calls it 49 times a token for GPT-2: what it does around the kernel is kept to a few microseconds.)"""
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            bias = bias.to(torch.bfloat16).contiguous()  # (held: the kernel reads it)
        y = x.new_empty(x.shape[:-1] + (self.out_features,))
        if self.function(self.address, x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                         x.numel() // self.in_features, self.out_features, self.in_features, self.padded,
                         torch.get_num_threads()):
            raise MemoryError("bf16_rows could not allocate its padded rows")
        return y


def chosen():
    """Do the engine's decoding passes run these kernels here: built, on a CPU with AMX (where they were measured
    faster than oneDNN's and PyTorch's: BENCHMARKS.md)?"""
    return hardware.cpu_kind() == "AMX" and load() is not None


POSITIONS = 1 << 16  # positions a row may hold at most for attend(): its scores live on a thread's stack (256 KB)


def attends(dtype, head_size, positions):
    """Can attend() run one row's attention over a KV cache of dtype, heads of head_size, rows of up to positions
    positions, here?"""
    return dtype == torch.bfloat16 and head_size % 16 == 0 and head_size <= 256 and positions <= POSITIONS \
        and load() is not None


def attend(q, k, v, keys, values, n):
    """One row's attention (bf16_rows.c's bf16_attend), in float32 as PyTorch's CPU attention computes it from
    bfloat16 inputs (Head), without its conversions: the new key and value k, v (heads, 1, size) stored at
    position n - 1 of keys and values (heads, length, size, contiguous: a row of the KV cache), then q (heads, 1,
    size) over their first n positions, all bfloat16 (attends() says where); the heads' outputs (1, heads, 1,
    size), bfloat16. (Decoding calls it once a layer and row.)"""
    heads, length, size = keys.shape
    q, k, v = (t if t.dtype == torch.bfloat16 and t.is_contiguous() else t.to(torch.bfloat16).contiguous()
               for t in (q, k, v))
    out = q.new_empty(1, heads, 1, size)
    load().bf16_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
                       out.data_ptr(), heads, n, size, length * size, size ** -0.5, torch.get_num_threads())
    return out


class BlockKernel:
    """bf16_rows.c's bf16_block bound to one of model.py's Blocks whose four products are bound Kernels
    (KernelLinear's), its LayerNorms and biases bfloat16, without qk_norm, heads that attend() takes; else None
    (new). Called on a decoding pass, it is the whole Block in one call (BENCHMARKS.md)."""

    def __new__(cls, block):
        attn, ffwd, ln1, ln2 = block.attn, block.ffwd, block.ln1, block.ln2
        qkv, proj, fc, mlp_proj = attn.qkv, attn.proj, ffwd.fc, ffwd.proj
        kernels = [getattr(p, "kernel", None) for p in (qkv, proj, fc, mlp_proj)]
        C, hidden = qkv.in_features, fc.out_features
        bound = (ln1.weight, ln1.bias, kernels[0], qkv.bias, kernels[1], proj.bias,
                 ln2.weight, ln2.bias, kernels[2], fc.bias, kernels[3], mlp_proj.bias)  # (bf16_block's order)
        tensors = [t for t in bound if isinstance(t, torch.Tensor)]
        if any(k is None for k in kernels) or attn.qk_norm or ffwd.gelu.approximate not in ("none", "tanh") \
                or any(n.normalized_shape != (C,) or n.weight is None or n.eps != ln1.eps for n in (ln1, ln2)) \
                or any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors) \
                or not attends(torch.bfloat16, attn.head_size, 1):
            return None
        self = super().__new__(cls)
        pointers = [None if t is None else t.address if isinstance(t, Kernel) else t.data_ptr() for t in bound]
        self.tensors = tensors  # (held: the kernel reads them)
        self.pointers = (ctypes.c_void_p * 12)(*pointers)
        self.dims = (ctypes.c_long * 9)(C, hidden, attn.n_head, attn.head_size, *(k.padded for k in kernels),
                                        ffwd.gelu.approximate == "tanh")
        self.eps, self.function = ln1.eps, load().bf16_block
        return self

    def __call__(self, x, caches):
        """The Block's output for x (rows, 1, C), bfloat16, each row's new key and value stored in its cache:
        caches [(keys, values, n)], a row's keys and values (heads, length, size), n its positions after this one."""
        out, rows = x.clone(memory_format=torch.contiguous_format), len(caches)
        keys = (ctypes.c_void_p * rows)(*[k.data_ptr() for k, _, _ in caches])
        values = (ctypes.c_void_p * rows)(*[v.data_ptr() for _, v, _ in caches])
        n = (ctypes.c_long * rows)(*[n for _, _, n in caches])
        if self.function(self.pointers, self.dims, self.eps, out.data_ptr(), rows, keys, values, n,
                         caches[0][0].stride(0), torch.get_num_threads()):
            raise MemoryError("bf16_block could not allocate its activations")
        return out
