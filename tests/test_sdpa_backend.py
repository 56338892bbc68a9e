"""train.py's --sdpa_backend on the CPU (machinery/training/sdpa_backend.py): each kernel PyTorch has here trains, the one
asked is the one every training and evaluation forward runs, auto is PyTorch's own choice and the log names it, and
a kernel that cannot run this training's attention is refused in one line before anything is written. (The GPU's
kernels, cuDNN's and the memory-efficient one, run in tests/test_cuda.py.)"""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_one_error_line, tiny_train_args, train
from machinery.training import metrics, sdpa_backend

RUN = dict(max_iters=6, eval_interval=3, lr_decay_iters=6)


def run(data_dir, out, **settings):
    """A short training run; its log, and the losses it recorded (recorded_losses)."""
    proc = train(*tiny_train_args(data_dir, out, **RUN | settings))
    return proc.stdout, recorded_losses(out)


def recorded_losses(out):
    """The losses a run in out recorded: each step's, and each evaluation's (train, val)."""
    records = metrics.read(out / "metrics.jsonl")
    return ([r["loss"] for r in records if "loss" in r],
            [r[k] for r in records for k in ("train_loss", "val_loss") if k in r])


def attention_line(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("attention: ")]
    assert len(lines) == 1, stdout  # said once
    return lines[0]


@pytest.fixture
def kernels_run(monkeypatch):
    """The kernel PyTorch's dispatch picks at each call of scaled_dot_product_attention (training's forwards: those
    with dropout where the model has some; evaluation's), and the call's dropout, recorded while the call runs as it
    would."""
    real, seen = F.scaled_dot_product_attention, []

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal), dropout_p))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_math_and_flash_train_the_same_losses_and_auto_is_flash_bit_for_bit(tmp_path, char_data, kernels_run):
    """float32: the CPU's flash kernel sums each row's softmax in blocks (online softmax), math in one pass: the same
    maths, other rounding. Measured: the losses of 20 steps within 1.3e-7 relative (a few ulps); bounded at 1e-5
    (attention without its causal mask, or over the wrong keys, moves them by 1e-2 or more). auto picks flash here
    (no dropout): the very same run."""
    got = {}
    for name in ("math", "flash", "auto"):
        kernels_run.clear()
        log, got[name] = run(char_data, tmp_path / name, sdpa_backend=name)
        assert attention_line(log) == {"math": "attention: math", "flash": "attention: flash",
                                       "auto": "attention: flash (sdpa_backend=auto: PyTorch's choice)"}[name]
        kernel = sdpa_backend.BACKENDS["math" if name == "math" else "flash"]
        # every forward ran the kernel asked for: 6 steps and 3 evaluations of 2 batches a split, 2 layers each
        assert kernels_run == [(int(kernel), 0.0)] * 2 * (6 + 3 * 2 * 2)
    steps, evaluations = got["math"]
    assert (len(steps), len(evaluations)) == (6, 3 * 2)
    assert got["flash"][0] == pytest.approx(steps, rel=1e-5, abs=0)
    assert got["flash"][1] == pytest.approx(evaluations, rel=1e-5, abs=0)
    assert got["auto"] == got["flash"]


def test_with_dropout_auto_is_the_math_kernel_and_flash_is_refused(tmp_path, char_data, kernels_run):
    """The CPU's flash kernel has no dropout: auto then trains with math (each step's loss bit for bit
    --sdpa_backend=math's, dropout drawn alike; its evaluations, without dropout, are flash's), and flash asked for
    is refused, naming what can run."""
    log_auto, auto = run(char_data, tmp_path / "auto", dropout=0.1)
    assert attention_line(log_auto) == "attention: math (sdpa_backend=auto: PyTorch's choice)"
    math, flash = int(sdpa_backend.BACKENDS["math"]), int(sdpa_backend.BACKENDS["flash"])
    assert kernels_run == [(flash, 0.0)] * 2 * 2 * 2 + ([(math, 0.1)] * 2 * 3 + [(flash, 0.0)] * 2 * 2 * 2) * 2
    _, with_math = run(char_data, tmp_path / "math", dropout=0.1, sdpa_backend="math")
    assert auto[0] == with_math[0]
    assert auto[1] == pytest.approx(with_math[1], rel=1e-5, abs=0)
    proc = train(*tiny_train_args(char_data, tmp_path / "flash", dropout=0.1, sdpa_backend="flash"), check=False)
    assert_one_error_line(proc, "sdpa_backend=flash cannot run this training's attention on cpu", "dropout 0.1",
                          "what can: math, auto")
    assert not (tmp_path / "flash").exists()


@pytest.mark.parametrize("name", ["cudnn", "efficient"])
def test_a_kernel_the_cpu_has_not_is_refused_in_one_line_and_nothing_is_written(tmp_path, char_data, name):
    proc = train(*tiny_train_args(char_data, tmp_path / "out", sdpa_backend=name), check=False)
    assert_one_error_line(proc, f"sdpa_backend={name} cannot run this training's attention on cpu (float32, 2 heads "
                                f"of size 16 over 32 positions, dropout 0.0); what can: flash, math, auto")
    assert not (tmp_path / "out").exists() and proc.stdout == ""


def test_an_unknown_kernel_is_refused_in_one_line_before_anything_starts(tmp_path, char_data):
    proc = train(*tiny_train_args(char_data, tmp_path / "out", sdpa_backend="fast"), check=False)
    assert_one_error_line(proc, "sdpa_backend must be one of auto, flash, cudnn, efficient, math, got 'fast'")
    assert not (tmp_path / "out").exists() and proc.stdout == ""


def test_picked_is_pytorchs_dispatch_and_the_context_leaves_the_flags_as_they_were():
    shape = (4, 2, 32, 16)
    assert sdpa_backend.picked("auto", shape, "cpu", torch.float32, 0.0) == "flash"
    assert sdpa_backend.picked("auto", shape, "cpu", torch.float32, 0.1) == "math"
    assert sdpa_backend.picked("math", shape, "cpu", torch.float32, 0.0) == "math"
    assert sdpa_backend.picked("cudnn", shape, "cpu", torch.float32, 0.0) is None
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    attention = sdpa_backend.Attention("math")
    for _ in range(2):  # (entered at every micro-step)
        with attention:
            assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == flags
