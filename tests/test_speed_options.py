"""Speed-related options: whole-split evaluation, skipping the first evaluation, the fused optimizer on
the CPU, signal checks that do not sync every step under DDP, and the CPU speedrun config."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_in_process, tiny_train_args
from machinery import configurator, distributed
from machinery.data.dataset import whole_split_batches
from machinery.data.dataset import load_split
from machinery.distributed import StopFlag
from model import GPT, GPTConfig
from optimizers import build_optimizer
import train


@pytest.mark.parametrize("n_tokens, block_size, batch_size", [(101, 10, 3), (100, 10, 4), (11, 10, 1)])
def test_whole_split_batches_cover_every_target_once_in_order(n_tokens, block_size, batch_size):
    data = np.arange(n_tokens, dtype=np.uint16) * 7 % 65
    batches = list(whole_split_batches(data, batch_size, block_size))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    n = (n_tokens - 1) // block_size  # windows of block_size + 1 tokens, overlapping by one
    assert x.shape == y.shape == (n, block_size)
    assert x.flatten().tolist() == data[:n * block_size].tolist()
    assert y.flatten().tolist() == data[1:n * block_size + 1].tolist()
    assert all(len(b[0]) == batch_size for b in batches[:-1]) and 0 < len(batches[-1][0]) <= batch_size


def test_whole_split_batches_are_shared_out_between_ranks():
    data = np.arange(1000, dtype=np.uint16)
    alone = [b[1] for b in whole_split_batches(data, 4, 16)]
    ranks = [[b[1] for b in whole_split_batches(data, 4, 16, rank=r, world_size=3)] for r in range(3)]
    # rank r takes batches r, r + 3, ...: together exactly the single-process batches, none twice
    assert sum(len(r) for r in ranks) == len(alone)
    for i, batch in enumerate(alone):
        assert torch.equal(ranks[i % 3][i // 3], batch)


def _trainer(data_dir, out_dir, **overrides):
    args = tiny_train_args(data_dir, out_dir, **overrides)
    return train.Trainer(configurator.parse(train.TrainConfig, args))


def test_eval_whole_val_is_the_mean_loss_over_every_val_token(tmp_path, char_data):
    trainer = _trainer(char_data, tmp_path / "out", eval_whole_val=True, batch_size=5, block_size=16)
    got = trainer.estimate_loss()["val"]

    # the same model, by hand: every target of the val split once (the tail shorter than a block left out)
    val = torch.from_numpy(load_split(char_data / "tiny", "val", 16).astype(np.int64))
    n = (len(val) - 1) // 16
    x, y = val[:n * 16].view(n, 16), val[1:n * 16 + 1].view(n, 16)
    trainer.raw_model.eval()
    with torch.no_grad():
        logits, _ = trainer.raw_model(x, y)
    expected = F.cross_entropy(logits.view(-1, logits.size(-1)).double(), y.flatten()).item()
    assert n % 5 != 0  # the last batch is smaller, so the weighting by batch size matters
    assert got == pytest.approx(expected, abs=1e-5)  # float32 logits in batches of 5 vs one batch
    assert trainer.estimate_loss()["val"] == got  # the same windows every time


def _nanogpt_get_batch(data, batch_size, block_size, generator=None):
    """nanoGPT's get_batch, written out: random starts from torch's stream, windows stacked one by one."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


def test_weights_and_batches_follow_nanogpts_random_stream(tmp_path, char_data):
    """nanoGPT seeds torch, builds the model, then draws every batch from torch's global stream: the first
    training batch, then the step-0 evaluation's train and val batches, then the next training batch...
    The trainer starts from the same weights and draws the same batches. (That GPT() initialises
    exactly as nanoGPT's model does is shown side by side in BENCHMARKS.md: the same loss curve.)"""
    trainer = _trainer(char_data, tmp_path / "out", eval_iters=3)
    cfg = trainer.cfg

    torch.manual_seed(cfg.seed)
    reference = GPT(trainer.model_config)
    for (name, a), b in zip(reference.state_dict().items(), trainer.raw_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    x, y = trainer.next_batch()
    ex, ey = _nanogpt_get_batch(trainer.dataset.train, cfg.batch_size, cfg.block_size)
    assert torch.equal(x, ex) and torch.equal(y, ey)

    trainer.raw_model.eval()
    expected = {}
    with torch.no_grad():
        for split, data in (("train", trainer.dataset.train), ("val", trainer.dataset.val)):
            batches = [_nanogpt_get_batch(data, cfg.batch_size, cfg.block_size) for _ in range(3)]
            expected[split] = sum(trainer.raw_model(bx, by)[1].item() for bx, by in batches) / 3
    got = trainer.estimate_loss()
    assert got["train"] == pytest.approx(expected["train"], abs=1e-6)  # float64 vs float32 averaging
    assert got["val"] == pytest.approx(expected["val"], abs=1e-6)
    x, y = trainer.next_batch()
    ex, ey = _nanogpt_get_batch(trainer.dataset.train, cfg.batch_size, cfg.block_size)
    assert torch.equal(x, ex) and torch.equal(y, ey)


def test_eval_at_start_false_skips_only_the_first_evaluation(tmp_path, char_data):
    args = tiny_train_args(char_data, tmp_path / "out", max_iters=20, eval_interval=10, eval_at_start=False)
    proc = run_in_process(train.main, *args)
    assert proc.returncode == 0, proc.stderr
    steps = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 10", "step 20"]

    args = tiny_train_args(char_data, tmp_path / "out2", max_iters=20, eval_interval=10)
    proc = run_in_process(train.main, *args)
    steps = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 0", "step 10", "step 20"]


def test_eval_at_start_false_still_evaluates_with_eval_only(tmp_path, char_data):
    args = tiny_train_args(char_data, tmp_path / "out", eval_only=True, eval_at_start=False)
    proc = run_in_process(train.main, *args)
    assert proc.returncode == 0, proc.stderr
    assert "step 0: train loss" in proc.stdout


def test_cpu_optimizer_is_fused_and_steps_like_foreach():
    # (no biases: the key bias gets a gradient of rounding noise only, which Adam's normalisation
    # turns into steps of either sign, so the two optimizers may disagree on it beyond any tolerance)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=16, bias=False))
    twin = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=16, bias=False))
    twin.load_state_dict(model.state_dict())
    fused = build_optimizer(model, "adamw", 1e-2, 0.1, (0.9, 0.95), "cpu")
    assert fused.defaults["fused"] is True
    params = list(twin.parameters())
    reference = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), foreach=True)
    x = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, opt in ((model, fused), (twin, reference)):
            m(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # same maths, other rounding


def test_bfloat16_attention_on_the_cpu_is_computed_in_float32():
    from model import Head

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g).bfloat16() for _ in range(3))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as in training with dtype=bfloat16
        got = Head(0.0)(q, k, v)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    # the cached-decoding paths too (one new position; several after a prefix)
    for Tq in (1, 3):
        mask = torch.ones(Tq, 7, dtype=torch.bool).tril(diagonal=7 - Tq)
        expected = F.scaled_dot_product_attention(q[:, :, -Tq:].float(), k.float(), v.float(), attn_mask=mask)
        assert torch.equal(Head(0.0)(q[:, :, -Tq:], k, v), expected.bfloat16())


def test_signal_under_ddp_counts_only_on_steps_that_ask_the_ranks():
    stop = StopFlag()
    try:
        stop.name = "SIGTERM"  # as the handler would set it
        world = distributed.World(distributed=True, size=1)  # no process group: all_reduce leaves the flag as it is
        assert stop.requested(world, "cpu", ask_ranks=False) is False  # no all_reduce, no sync on this step
        assert stop.requested(world, "cpu", ask_ranks=True) is True
        assert stop.requested(distributed.World(), "cpu", ask_ranks=False) is True  # one process: no one to ask
    finally:
        stop.restore()


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_speedrun_configs_parse_and_evaluate_the_whole_val_split_once(kind):
    cfg = configurator.parse(train.TrainConfig, [str(ROOT / f"config/speedrun_shakespeare_char_{kind}.py")])
    cfg.validate()
    assert cfg.dataset == "shakespeare_char" and cfg.device == ("cpu" if kind == "cpu" else "auto")
    assert cfg.dtype == "auto" and cfg.optimizer == "muon"
    assert cfg.eval_whole_val and not cfg.eval_at_start
    assert cfg.eval_interval >= cfg.max_iters  # one evaluation, at the end
    assert cfg.lr_decay_iters == cfg.max_iters  # the schedule ends with the run
