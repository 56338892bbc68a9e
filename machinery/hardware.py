"""
Device and precision: which device to run on, which dtype, and the autocast context.

    device: auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    dtype:  auto | float32 | bfloat16 | float16

dtype=auto picks bfloat16 on CUDA GPUs that support it (else float16, trained with a GradScaler), and on the CPU
bfloat16 only where the CPU computes it natively (cpu_native: AVX-512 BF16 or AMX), float32 elsewhere; a
half-precision dtype that the CPU only emulates still runs, with a one-line warning. cpu_kind names the CPU's
kind, and CPU_KINDS what is chosen on each (measured: BENCHMARKS.md).
Not here: the kernels themselves (generation/: packing.py, bf16_rows.py) and how many threads (the commands).
"""

import os
import sys
from contextlib import nullcontext

import torch

from machinery.configurator import setting
from machinery.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_setting():
    """The --device setting of every command that runs a model (one declaration: train, sample, eval, serve)."""
    return setting("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")


def dtype_setting():
    """The --dtype setting of every command that runs a model."""
    return setting("auto", "auto (bfloat16 where the GPU or CPU computes it natively, float16 on older GPUs, else "
                           "float32), float32, bfloat16, float16")


def pick_device(name="auto"):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if _mps_available() else "cpu"
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda", "mps") or (kind != "cuda" and ":" in name):
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name} asked for, but this machine has no usable CUDA GPU; use --device=cpu")
        index = name.split(":")[1] if ":" in name else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise UserError(f"device {name} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not _mps_available():
        raise UserError("device mps asked for, but MPS is not available here; use --device=cpu")
    return name


def _mps_available():
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def cpu_native(dtype):
    """Does this CPU compute dtype (bfloat16 or float16) natively: instructions that multiply it (AVX-512 BF16,
    AVX-512 FP16, AMX), not only convert it, and oneDNN allowed to use them (ONEDNN_MAX_CPU_ISA=AVX2 makes an
    AVX-512 machine behave as an AVX2 one)? Elsewhere a CPU emulates bfloat16 products, many times slower than
    float32 (BENCHMARKS.md), so dtype=auto picks float32 there."""
    if dtype == "bfloat16":
        return (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()) \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # (alone, true where AVX-512 only converts)
    if dtype == "float16":
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()  # AVX-512 FP16 or AMX-FP16, as oneDNN reports
    return True


# What dtype=auto and the engine choose on each kind of CPU. On AMX: oneDNN's AMX kernels for prompts, at every
# number of rows (they block, and so round, otherwise beyond some number of rows: packing.calibrate); decoding's
# products, a row's attention over a bfloat16 KV cache and a decoding pass's whole Block our own kernels
# (generation/bf16_rows.py). On every kind the engine measures at start which rows its products compute alike
# (packing.calibrate, kept by generation/calibration_cache.py). llama.cpp, which the tests and benchmarks run, is
# built for the kind at hand without its AMX kernels (.ci/install-llama-cpp). On AVX2, --dtype=float16 is the
# choice for one fast stream (docs/benchmarks-history.md, issue 22).
CPU_KINDS = {
    "AMX": "bfloat16: oneDNN's AMX kernels for prompts; decoding our own kernels, attention ours, a Block one call "
           "(where gcc builds them)",
    "AVX-512 BF16": "bfloat16: AVX-512 BF16",
    "AVX-512": "float32: bfloat16 is only converted",
    "AVX2": "float32: bfloat16 is emulated",
    "other": "float32",
}


def cpu_kind():
    """This CPU's kind, as oneDNN may use it (ONEDNN_MAX_CPU_ISA caps it: AVX2 makes any x86 CPU the AVX2
    kind): AMX, AVX-512 BF16, AVX-512, AVX2 or other (a key of CPU_KINDS)."""
    if cpu_native("bfloat16"):
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        amx = torch.cpu._is_amx_tile_supported() and ("AMX" in cap or cap in ("ALL", "DEFAULT"))
        return "AMX" if amx else "AVX-512 BF16"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "AVX-512"
    return "AVX2" if capability.startswith("AVX") else "other"


def pick_dtype(name, device):
    device_type = device.split(":")[0]
    if name == "auto":
        if device_type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        if device_type == "cpu" and cpu_native("bfloat16"):
            return "bfloat16"
        return "float32"
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    if device_type == "cpu" and not cpu_native(name):
        print(f"warning: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {name}: it emulates "
              f"it, and products of many rows (training, prompts, batches) run many times slower than float32 "
              f"(--dtype=auto picks float32 here)", file=sys.stderr)
    return name


def autocast(device, dtype):
    """Mixed precision for the forward pass; plain fp32 needs no context."""
    device_type = device.split(":")[0]
    if dtype == "float32" or device_type == "mps":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def grad_scaler(device_type, dtype):
    """float16 gradients can underflow: its GradScaler scales the loss up, and skips steps whose gradients
    overflow. Every other dtype gets a disabled one (a no-op)."""
    return torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))


def enable_tf32(device_type):
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa, as nanoGPT
    does); elsewhere leave the flags alone."""
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def describe(device, dtype):
    """One line for logs: where it runs and in which precision (on the CPU: its capability and threads)."""
    if device.startswith("cuda"):
        return f"device {device} ({torch.cuda.get_device_name(device)}), dtype {dtype}"
    if device == "cpu":
        kind = cpu_kind()
        return (f"device cpu ({kind} kind, dtype auto = {CPU_KINDS[kind]}; {torch.get_num_threads()} threads), "
                f"dtype {dtype}")
    return f"device {device}, dtype {dtype}"


def peak_flops(device):
    """Dense bf16 peak FLOP/s of the GPU, for MFU; None where we do not know it."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    # the first key found in the name wins, so longer names come before their prefixes (L40S before L4)
    for key, flops in (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12),
                       ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("4090", 165e12),
                       ("3090", 71e12)):
        if key in name:
            return flops
    return 312e12  # unknown GPU: report against an A100, as nanoGPT does
