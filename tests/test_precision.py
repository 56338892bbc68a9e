"""Precision and compilation: dtype=auto picks what the CPU computes natively, half precisions train end
to end on the CPU (bfloat16 autocast; float16 with its GradScaler, whose state resumes exactly), and
compile=True trains compiled, or warns once and trains uncompiled when compilation fails."""

import re

import pytest
import torch

from conftest import load_checkpoint, tiny_train_args, train
from machinery import hardware
from model import GPT

# a tiny run; dtype and compile set by each test
ARGS = dict(max_iters=6, eval_interval=3, eval_iters=2, n_layer=1, n_embd=16, block_size=16)


def native(monkeypatch, bf16, fp16=False, amx=False, converts_bf16=None):
    """Pretend this CPU has (or not) AVX-512 BF16, AMX, AVX-512 FP16; converts_bf16: what oneDNN's own test
    says (true on any AVX-512 CPU, BF16 or not; false where ONEDNN_MAX_CPU_ISA caps it; default: as bf16)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported",
                        lambda: bf16 or amx if converts_bf16 is None else converts_bf16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16)


def val_losses(stdout):
    return [float(v) for v in re.findall(r"val loss (\S+)", stdout)]


@pytest.mark.parametrize("cpu, expected", [
    (dict(bf16=True), "bfloat16"),  # AVX-512 BF16 (Cooper Lake, Zen 4 and later)
    (dict(bf16=False, amx=True), "bfloat16"),  # AMX (Sapphire Rapids and later)
    (dict(bf16=False, converts_bf16=True), "float32"),  # AVX-512 without BF16 (Skylake-X): oneDNN only converts
    (dict(bf16=True, converts_bf16=False), "float32"),  # AVX-512 BF16 with oneDNN capped: ONEDNN_MAX_CPU_ISA=AVX2
    (dict(bf16=False), "float32"),  # AVX2
])
def test_auto_dtype_on_the_cpu_is_bfloat16_only_where_it_is_native(monkeypatch, capsys, cpu, expected):
    native(monkeypatch, **cpu)
    assert hardware.pick_dtype("auto", "cpu") == expected
    assert hardware.pick_dtype("float32", "cpu") == "float32"
    assert capsys.readouterr().err == ""  # nothing to warn about


@pytest.mark.parametrize("cpu, capability, cap, kind", [
    (dict(bf16=True, amx=True), "AVX512", None, "AMX"),  # Sapphire Rapids and later
    (dict(bf16=True, amx=True), "AVX512", "AVX512_CORE_AMX", "AMX"),
    (dict(bf16=True, amx=True), "AVX512", "AVX512_CORE_BF16", "AVX-512 BF16"),  # oneDNN told to leave AMX out
    (dict(bf16=True), "AVX512", None, "AVX-512 BF16"),  # Zen 4, Cooper Lake
    (dict(bf16=False, converts_bf16=True), "AVX512", None, "AVX-512"),  # Skylake-X
    (dict(bf16=True, converts_bf16=False), "AVX2", "AVX2", "AVX2"),  # the suite's AVX2 emulation
    (dict(bf16=False), "AVX2", None, "AVX2"),  # Zen 3
    (dict(bf16=False), "DEFAULT", None, "other"),
])
def test_each_cpu_kind_is_named_with_the_dtype_auto_picks_there(monkeypatch, cpu, capability, cap, kind):
    """hardware.cpu_kind names the kind (ONEDNN_MAX_CPU_ISA's cap included), and the line every command prints
    names it with the dtype that auto then picks."""
    native(monkeypatch, **cpu)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert hardware.cpu_kind() == kind
    auto = hardware.pick_dtype("auto", "cpu")
    assert hardware.CPU_KINDS[kind].startswith(auto)
    assert hardware.describe("cpu", "float32").startswith(f"device cpu ({kind} kind, dtype auto = {auto}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forcing_an_emulated_half_precision_warns_once_in_one_line(tmp_path, char_data, monkeypatch, dtype):
    native(monkeypatch, bf16=False, fp16=False)
    proc = train(*tiny_train_args(char_data, tmp_path / "out", dtype=dtype, **ARGS))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"no native {dtype}" in warnings[0] and "slower" in warnings[0], proc.stderr
    assert f"dtype {dtype}" in proc.stdout
    native(monkeypatch, bf16=True, fp16=True)
    proc = train(*tiny_train_args(char_data, tmp_path / "out2", dtype=dtype, **ARGS))
    assert "warning" not in proc.stderr


def test_bfloat16_trains_end_to_end_close_to_float32(tmp_path, char_data, monkeypatch):
    real_linear, seen = torch.nn.Linear.forward, {"float32": set(), "bfloat16": set()}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: seen[dtype].add(
            (out := real_linear(self, x)).dtype) or out)
        runs[dtype] = train(*tiny_train_args(char_data, tmp_path / dtype, dtype=dtype, **ARGS)).stdout
    assert seen == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}  # the matmuls ran in bfloat16
    assert "dtype bfloat16" in runs["bfloat16"]
    fp32, bf16 = val_losses(runs["float32"]), val_losses(runs["bfloat16"])
    assert len(bf16) == 3 and bf16[-1] < bf16[0]
    # the same batches and initial weights; bfloat16 matmuls keep 8 bits of mantissa: losses within 0.02
    assert bf16 == pytest.approx(fp32, abs=0.02)
    state = load_checkpoint(tmp_path / "bfloat16" / "ckpt.pt")
    assert all(v.dtype == torch.float32 for v in state["model"].values())  # autocast: fp32 master weights


def test_float16_trains_with_a_grad_scaler_that_skips_overflows_and_resumes_exactly(tmp_path, char_data,
                                                                                     monkeypatch):
    """float16 autocast works on the CPU in this torch: the GradScaler path runs. An overflowing step (an
    infinite loss at the 3rd step) is skipped and halves the scale instead of stopping training, and the
    scaler's state goes through a checkpoint: 3 steps + resume 3 give exactly 6 straight."""
    real_forward, steps = GPT.forward, {"done": 0, "overflow_at": 3}

    def forward(self, idx, targets=None, *args, **kwargs):
        logits, loss = real_forward(self, idx, targets, *args, **kwargs)
        if self.training and loss is not None:  # one training forward per step (no accumulation here)
            steps["done"] += 1
            if steps["done"] == steps["overflow_at"]:
                loss = loss * float("inf")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    args = dict(ARGS, dtype="float16", eval_interval=100, ckpt_interval=0)
    straight = train(*tiny_train_args(char_data, tmp_path / "straight", **args))
    scaler = load_checkpoint(tmp_path / "straight" / "ckpt.pt")["scaler"]
    assert scaler["scale"] == 65536.0 / 2  # torch's initial scale, halved once by the skipped step
    assert "NaN" not in straight.stdout + straight.stderr

    steps["done"] = 0
    train(*tiny_train_args(char_data, tmp_path / "split", **dict(args, max_iters=3)))
    assert load_checkpoint(tmp_path / "split" / "ckpt.pt")["scaler"]["scale"] == 65536.0 / 2
    steps["overflow_at"] = None  # the resumed run's steps 4..6 are those of the straight run: no overflow
    train(*tiny_train_args(char_data, tmp_path / "split", init_from="resume", **args))
    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert a["scaler"] == b["scaler"]
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name


def counting_backend(calls, name="aot_eager"):
    """A torch.compile backend (by default aot_eager: dynamo's graph capture and AOTAutograd's compiled
    backward, without inductor's C++ code generation, which costs ~25 s from a cold cache on a fresh machine;
    its kernels are PyTorch's to test), with every call of the compiled graphs counted in calls: "forward"
    with gradients, "backward" (the compiled backward, counted by a hook on its autograd node, which runs
    after it), "no_grad" (evaluation)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(graph, example_inputs):
        compiled = inner(graph, example_inputs)

        def run(*args):
            outputs = compiled(*args)
            if not torch.is_grad_enabled():
                calls["no_grad"] += 1
                return outputs
            calls["forward"] += 1
            node = next(o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None)
            node.register_hook(lambda *_: calls.update(backward=calls["backward"] + 1))
            return outputs

        return run

    return backend


def test_compile_true_trains_compiled_on_the_cpu(tmp_path, char_data, monkeypatch):
    """torch.compile, as train.py calls it, runs every forward and backward of training through the compiled
    graph, and trains to the uncompiled run's losses within rounding; the checkpoint's weight names carry no
    `_orig_mod.` prefix."""
    args = dict(ARGS, max_iters=2, eval_interval=100, eval_at_start=False, eval_iters=1)
    eager = train(*tiny_train_args(char_data, tmp_path / "eager", **args))
    calls, real_compile = {"forward": 0, "backward": 0, "no_grad": 0}, torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(
        model, backend=counting_backend(calls), **kwargs))
    torch._dynamo.reset()  # compile afresh, with this backend
    try:
        compiled = train(*tiny_train_args(char_data, tmp_path / "compiled", **dict(args, compile=True)))
    finally:
        torch._dynamo.reset()  # drop the compiled code that holds the counting backend
    assert "warning" not in compiled.stdout + compiled.stderr
    # the model compiles whole (one graph, no break): one call per forward. Training: the trial step of
    # compile_trial, then max_iters steps of gradient_accumulation_steps (1) micro-steps; the final evaluation:
    # eval_iters (1) batches of each split. Handing the eager model back after the trial would count 1 and 1.
    assert calls == {"forward": 1 + 2, "backward": 1 + 2, "no_grad": 2}
    assert val_losses(compiled.stdout) == pytest.approx(val_losses(eager.stdout), abs=1e-4)
    state = load_checkpoint(tmp_path / "compiled" / "ckpt.pt")
    assert not any(k.startswith("_orig_mod.") for k in state["model"])


def test_a_failing_compile_warns_once_and_trains_uncompiled(tmp_path, char_data, monkeypatch):
    def broken_compile(model, **kwargs):
        def fails(*args, **kwargs):
            raise RuntimeError("C++ compiler not found\nmore details")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    args = dict(ARGS, max_iters=4, eval_interval=2)
    fallback = train(*tiny_train_args(char_data, tmp_path / "fallback", compile=True, **args))
    warnings = [line for line in fallback.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: torch.compile failed (RuntimeError: C++ compiler not found); training without it"]
    # the trial step left no trace: the same run as without compile, to the last digit
    eager = train(*tiny_train_args(char_data, tmp_path / "eager", compile=False, **args))
    assert re.findall(r"^(?:iter|step) .*loss [\d.]+", fallback.stdout, re.M) == \
        re.findall(r"^(?:iter|step) .*loss [\d.]+", eager.stdout, re.M)


def test_train_py_with_dtype_auto_trains_in_what_the_cpu_computes_natively(tmp_path, char_data, cpu_bf16,
                                                                            monkeypatch):
    """train.py's default dtype=auto under both answers of hardware.cpu_native (cpu_bf16): bfloat16 autocast
    where the CPU computes it natively, float32 elsewhere; the matrix products run in that dtype."""
    real_linear, seen = torch.nn.Linear.forward, set()
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: seen.add((out := real_linear(self, x)).dtype)
                        or out)
    proc = train(*tiny_train_args(char_data, tmp_path / "out", dtype="auto", **(ARGS | dict(max_iters=2,
                                                                                           eval_interval=2))))
    assert f"dtype {str(cpu_bf16).removeprefix('torch.')}" in proc.stdout and seen == {cpu_bf16}
