"""What only a machine with a CUDA GPU shows (skipped elsewhere: CI is CPU-only; the decisions themselves are
tested without a GPU in test_cuda_decisions.py): train.py on the GPU trains in bfloat16 autocast, a 1-process
torchrun job joins over NCCL, trains and resumes exactly, and Muon's compiled, stacked Newton-Schulz is the
iteration within bfloat16's rounding."""

import re

import pytest
import torch

from conftest import tiny_train_args
from machinery.configurator import parse
import optimizers
from test_distributed import ckpt, launch, max_weight_diff, ok, report, train_args
from test_optimizers import newton_schulz_by_hand
import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def data_dir(module_data):
    return module_data


def test_train_py_trains_in_bfloat16_autocast_on_cuda(tmp_path, data_dir, tf32_off):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 (dtype=auto picks float16 there)")
    trainer = train.Trainer(parse(train.TrainConfig, tiny_train_args(data_dir, tmp_path / "out", device="cuda",
                                                                     dtype="auto")))
    try:
        assert (trainer.device, trainer.dtype) == ("cuda", "bfloat16") and not trainer.scaler.is_enabled()
        assert isinstance(trainer.autocast, torch.autocast)
        assert (trainer.autocast.device, trainer.autocast.fast_dtype) == ("cuda", torch.bfloat16)
        qkv = trainer.raw_model.blocks[0].attn.qkv
        seen = []
        hook = qkv.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        loss, _, _ = trainer.optimizer_step(*trainer.next_batch())
        hook.remove()
        assert seen == [torch.bfloat16]  # the matrix products ran in bfloat16...
        assert qkv.weight.dtype == torch.float32 and qkv.weight.is_cuda  # ...on float32 weights, on the GPU
        assert torch.isfinite(loss).item()
    finally:
        trainer.out_dir_lock.release()


def test_a_one_process_nccl_job_trains_and_resumes_exactly(tmp_path, data_dir):
    """RANK/WORLD_SIZE set as torchrun sets them, 1 process: it joins over NCCL on cuda:0 and trains (Muon, whose
    Newton-Schulz runs in bfloat16 on CUDA); 2 steps, then a resume to 4, end where 4 steps in one go end, bit
    for bit. (float64 weights, no autocast: the attention then takes PyTorch's deterministic math kernel.)"""
    def args(out, **kw):
        return train_args(data_dir, out, device="cuda", optimizer="muon", **kw)

    whole, part = tmp_path / "whole", tmp_path / "part"
    ok(launch(args(whole, max_iters=4), tmp_path / "r0", nproc=1))
    ok(launch(args(part, max_iters=2), tmp_path / "r1", nproc=1))
    halfway = ckpt(part)
    proc = ok(launch(args(part, max_iters=4, init_from="resume"), tmp_path / "r2", nproc=1))
    assert f"resuming from {part}/ckpt.pt at iteration 2" in proc.stdout
    assert re.findall(r"^iter (\d+):", proc.stdout, re.M) == ["3", "4"]
    for r in ("r0", "r1", "r2"):
        assert (report(tmp_path / r, 0)["backend"], report(tmp_path / r, 0)["device"]) == ("nccl", "cuda:0")
    # the same micro-batches, 4 a step (each run also fetched the one after its last step: the resumed run fetches
    # it again)
    assert report(tmp_path / "r1", 0)["batches"][:8] + report(tmp_path / "r2", 0)["batches"] == \
        report(tmp_path / "r0", 0)["batches"]
    a, b = ckpt(whole), ckpt(part)
    assert a["iter_num"] == b["iter_num"] == 4
    assert max_weight_diff(a, b) == 0.0
    assert max_weight_diff(halfway, b) > 1e-3  # (and steps 3 and 4 did move the weights)


@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (48, 48)])  # wide, tall, square
def test_the_compiled_stacked_newton_schulz_is_the_iteration_within_bfloat16_rounding(shape, capsys):
    """As training runs it on CUDA: torch.compile'd, on a stack, in bfloat16. Each matrix within the bound of
    test_cuda_decisions' bfloat16 test, (2 + 3 * steps) * 2^-8 relative, of the float64 iteration."""
    m = torch.randn(4, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    ns = optimizers.compiled_or_eager(optimizers.newton_schulz)
    out = ns(m.cuda(), 5)
    assert capsys.readouterr().err == ""  # compiled: no fallback
    assert out.shape == m.shape and out.dtype == torch.float32
    for got, x in zip(out.cpu(), m):
        expected = newton_schulz_by_hand(x, 5)
        assert ((got.double() - expected).norm() / expected.norm()).item() < (2 + 3 * 5) * 2 ** -8
