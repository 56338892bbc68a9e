"""train.py's optimizer step against the same step written out here: the initial weights, the batches, gradient
accumulation, clipping, AdamW's two groups and the warmup learning rate, each from its definition (torch.optim.AdamW
and torch's RNG, not train.py, optimizers.py or dataset.py)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_train_args, train
from model import GPT, GPTConfig

SEED, K, B, T = 7, 3, 4, 32  # K micro-batches of B windows of T tokens per optimizer step
LR, WARMUP, WD, BETAS, CLIP = 1.5e-2, 2, 1.0, (0.9, 0.95), 0.1
# AdamW weight decay 1.0 (not nanoGPT's 0.1): the decay then moves a matrix entry by lr * WD * |w| ~ 1e-4, far above
# the tolerance, so a decay on the wrong group, or none, shows. No biases (train.py's default): the attention key's
# bias gets a gradient of rounding noise only, which Adam turns into steps of either sign.
# Tolerance: float32 on both sides, and the same model code on the same batches, so the first step's gradients are
# the same; then train.py steps with the fused CPU AdamW kernel, the reference with the foreach one, after a clipping
# norm summed here in float64: the same maths, other rounding. A weight near 1 (LayerNorm gains) then differs by an
# ulp (6e-8) after one step, a little more after two (the second step's gradients come from weights that differ by
# that); measured at most 1.5e-7 (AVX-512 and AVX2 kernels). A mistake moves some weight by 4e-4 or more (CONTROLS).
RTOL, ATOL = 1e-5, 1e-6


def lr_at(it):
    """train.py's schedule during warmup (decay_lr's cosine starts at WARMUP): linear, never 0 at step 0."""
    assert it < WARMUP
    return LR * (it + 1) / (WARMUP + 1)


def reference(data_dir, steps, clip=True, decay="matrices", warmup=True, accumulate=True, seed=SEED):
    """`steps` optimizer steps written out; returns the model, the optimizer and the gradient norm of each step."""
    vocab = json.loads((data_dir / "tiny" / "meta.json").read_text())["vocab_size"]
    tokens = np.fromfile(data_dir / "tiny" / "train.bin", dtype=np.uint16).astype(np.int64)
    torch.manual_seed(seed)  # nanoGPT: the seed, then the model's initialisation
    model = GPT(GPTConfig(block_size=T, vocab_size=vocab, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False))
    # the batches continue torch's random stream from right after the initialisation (nanoGPT's get_batch)
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    params = list(model.parameters())  # (the tied lm_head / tok_emb weight once)
    decayed = {"matrices": [p for p in params if p.dim() >= 2], "all": params, "none": []}[decay]
    groups = [{"params": decayed, "weight_decay": WD},
              {"params": [p for p in params if all(p is not q for q in decayed)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=BETAS, foreach=True)
    norms = []
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it) if warmup else LR
        for micro in range(K):
            starts = torch.randint(len(tokens) - T, (B,), generator=generator).tolist()
            x = torch.tensor(np.stack([tokens[s:s + T] for s in starts]))
            y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in starts]))
            logits, _ = model(x, y)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            if accumulate or micro == K - 1:
                (loss / K).backward()  # the mean over the micro-batches
        norm = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))  # global L2 norm
        norms.append(norm)
        if clip and norm > CLIP:
            for p in params:
                p.grad.mul_(CLIP / (norm + 1e-6))  # (clip_grad_norm_'s 1e-6)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, norms


def max_diff(state, model):
    return max((state[name] - p).abs().max().item() for name, p in model.state_dict().items())


# a mistake in any one part of the step, and what it does to the weights
CONTROLS = {"no clipping": dict(clip=False), "weight decay on every parameter": dict(decay="all"),
            "no weight decay": dict(decay="none"), "no warmup": dict(warmup=False),
            "the last micro-batch only": dict(accumulate=False), "another seed": dict(seed=SEED + 1)}


@pytest.mark.parametrize("steps", [1, 2])
def test_train_steps_equal_the_steps_written_out(tmp_path, char_data, monkeypatch, steps):
    # 2 steps: AdamW's moments and step count carry over into the second, at the second warmup rate
    seen_norms = []  # the gradient norms train.py clipped at (clip_grad_norm_ returns the norm before clipping)
    clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def spy(*args, **kwargs):
        norm = clip_grad_norm(*args, **kwargs)
        seen_norms.append(norm.item())
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    out = tmp_path / "out"
    # no evaluation before the first step: it would draw its batches from the training stream first
    train(*tiny_train_args(char_data, out, seed=SEED, max_iters=steps, gradient_accumulation_steps=K, batch_size=B,
                           block_size=T, learning_rate=LR, warmup_iters=WARMUP, lr_decay_iters=20, min_lr=0.0,
                           weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], grad_clip=CLIP, eval_at_start=False,
                           dtype="float32", dropout=0.0, bias=False))
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["iter_num"] == steps

    model, optimizer, norms = reference(char_data, steps)
    assert all(norm > 5 * CLIP for norm in norms), norms  # clipping is active (scaling by < 0.2) on every step
    state = ckpt["model"]
    assert state.keys() == model.state_dict().keys()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=RTOL, atol=ATOL, msg=name)
    # AdamW's state: the moments (equal after one step; after two, the second gradients differ by the weights'
    # rounding: a tolerance relative to each tensor's scale) and the step counts
    names = dict(zip(map(id, model.parameters()), (n for n, _ in model.named_parameters())))
    saved = ckpt["optimizer"]["state"]
    assert set(saved) == set(names.values())
    for p, s in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = s[key].abs().max().item()
            torch.testing.assert_close(saved[names[id(p)]][key], s[key], rtol=1e-4, atol=1e-5 * scale,
                                       msg=f"{names[id(p)]} {key}")
        assert saved[names[id(p)]]["step"].item() == steps
    assert [g["weight_decay"] for g in ckpt["optimizer"]["param_groups"]] == [WD, 0.0]
    # train.py clipped at the same norms (the sum of squares in float32 there, in float64 here). This is also where
    # the mean over the micro-batches (loss / K) shows: once clipped, a gradient scaled by K gives the same weights
    assert seen_norms == pytest.approx(norms, rel=1e-5)

    # each mistake moves the weights a hundred times the tolerance or more: the comparison above can fail
    for mistake, kwargs in CONTROLS.items():
        wrong = reference(char_data, steps, **kwargs)[0]
        assert max_diff(state, wrong) > 100 * ATOL, mistake
