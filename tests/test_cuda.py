"""What only a machine with a CUDA GPU shows (skipped elsewhere: CI is CPU-only; the decisions themselves are
tested without a GPU in test_cuda_decisions.py): train.py on the GPU trains in bfloat16 autocast, a 1-process
torchrun job joins over NCCL, trains and resumes exactly, Muon's compiled, stacked Newton-Schulz is the
iteration within bfloat16's rounding, the training step captured as one CUDA graph is the eager step bit for bit
(where float32 holds the learning rates; else within a stated bound) and syncs nothing with the host, and each
attention kernel of the GPU (--sdpa_backend) trains as the math kernel does."""

import re

import pytest
import torch

from conftest import run_in_process, tiny_train_args
from machinery.training import sdpa_backend
from machinery.configurator import parse
import optimizers
from test_distributed import ckpt, launch, max_weight_diff, ok, report, train_args
from test_optimizers import newton_schulz_by_hand
from test_sdpa_backend import RUN, kernels_run, recorded_losses  # noqa: F401 (kernels_run: a fixture)
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
        # the matrix products ran in bfloat16 (the step is a CUDA graph: its warm-up and capture ran it too)...
        assert seen and set(seen) == {torch.bfloat16}
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


# float32's own numbers: the learning rates of every step (warmup 2^-10, 2^-9, 3 * 2^-10, then min_lr 2^-9) and
# Muon's (x 8)
EXACT_RATES = dict(learning_rate=2 ** -8, warmup_iters=3, lr_decay_iters=3, min_lr=2 ** -9, muon_lr=2 ** -5)


def graphed_or_eager_steps(data_dir, out, graphed, n, **settings):
    """n of train.py's steps on the GPU in float32 (TF32 off), eager or as the CUDA graph (each replay under
    sync_debug_mode "error": a host sync would raise); the losses and copies of what training keeps."""
    from machinery.weights import checkpoint
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = tiny_train_args(data_dir, out, device="cuda", dtype="float32", gradient_accumulation_steps=2, dropout=0.1,
                           grad_clip=0.1, muon_momentum_warmup=4, eval_at_start=False, cuda_graph=graphed, **settings)
    trainer = train.Trainer(parse(train.TrainConfig, args))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # (the Trainer turned them on)
    losses = []
    try:
        # PyTorch's math attention: its backward is deterministic (the efficient kernel's need not be)
        with sdpa_kernel(SDPBackend.MATH):
            assert (trainer.step_graph is not None) == graphed and (not graphed or trainer.step_graph.ready())
            x, y = trainer.next_batch()
            for _ in range(n):
                optimizers.set_schedule(trainer.optimizer, trainer.iter_num, trainer.cfg)
                torch.cuda.set_sync_debug_mode("error" if graphed else "default")
                try:
                    loss, x, y = trainer.optimizer_step(x, y)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                trainer.iter_num += 1
                losses.append(loss.detach().clone())
        kept = {"model": trainer.raw_model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "rank": checkpoint.rank_state(trainer.train_sampler.state_dict())}
        return torch.stack(losses).cpu(), torch.utils._pytree.tree_map(
            lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v, kept)
    finally:
        trainer.out_dir_lock.release()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_cuda_graph_step_is_the_eager_step_bit_for_bit_and_syncs_nothing(tmp_path, data_dir, tf32_off, optimizer):
    """The step captured as one CUDA graph (machinery/training/step_graph.py) against train.py's eager step: 5 steps of a
    changing learning rate and Muon momentum, 2 micro-batches, dropout, clipping. Bit for bit where the learning
    rates are float32 numbers. Other rates: torch's fused CUDA AdamW reads a tensor lr as a float but computes
    with a Python float lr as a double, so the graphed step's AdamW rate is the schedule's rounded to float32
    (relative error under 2^-24); each update then differs by under 2^-24 of itself, and a weight by an ulp where
    that rounds it the other way, a few ulps after 5 steps: bounded at 1e-6 (weights of order 1 at most)."""
    from test_resume import assert_same

    for name, rates in (("exact", EXACT_RATES), ("other", dict(learning_rate=3e-3, warmup_iters=2, lr_decay_iters=6,
                                                                 min_lr=3e-4))):
        expected, eager = graphed_or_eager_steps(data_dir, tmp_path / f"eager_{name}", False, 5, optimizer=optimizer,
                                                 **rates)
        got, graphed = graphed_or_eager_steps(data_dir, tmp_path / f"graphed_{name}", True, 5, optimizer=optimizer,
                                              **rates)
        if name == "exact":
            assert torch.equal(expected, got), (expected, got)
            assert_same(eager, graphed, "state")
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
            for key, value in eager["model"].items():
                assert (graphed["model"][key] - value).abs().max().item() <= 1e-6, key


def test_each_attention_kernel_of_this_gpu_trains_as_the_math_kernel_does(tmp_path, data_dir, kernels_run):
    """--sdpa_backend with each kernel: those PyTorch has for this GPU and shape train (flash and math at least:
    cuDNN's depends on its version), every forward running the one asked for, the log naming it, inside the step's
    CUDA graph (bfloat16, one process: it applies); those it has not are refused in one line. bfloat16 attention
    rounds each kernel's way (8 bits: 2^-8 a rounding, 4e-3 relative): each step's loss within 2e-2 of math's."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 (flash and cuDNN attention compute in 16 bits)")
    losses, refused = {}, []
    for name, kernel in sdpa_backend.BACKENDS.items():
        kernels_run.clear()
        args = tiny_train_args(data_dir, tmp_path / name, device="cuda", dtype="bfloat16", sdpa_backend=name, **RUN)
        proc = run_in_process(train.main, *args)
        if proc.returncode == 2 and "cannot run this training's attention on cuda" in proc.stderr:
            refused.append(name)
            continue
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"\nattention: {name}\n" in proc.stdout
        assert kernels_run and {choice for choice, _ in kernels_run} == {int(kernel)}
        losses[name] = recorded_losses(tmp_path / name)
    assert {"flash", "math"} <= set(losses), refused
    for name, (steps, evaluations) in losses.items():
        assert steps == pytest.approx(losses["math"][0], rel=2e-2, abs=0), name
        assert evaluations == pytest.approx(losses["math"][1], rel=2e-2, abs=0), name
