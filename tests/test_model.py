"""The model: causal, the batched attention is the textbook formula, GPT-2's init and API, and it learns."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, Head, MultiHeadAttention


def tiny_config(**overrides):
    cfg = dict(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    cfg.update(overrides)
    return GPTConfig(**cfg)


def all_logits(model, idx):
    """Logits at every position: with targets the model computes them all (without, only the last)."""
    logits, _ = model(idx, torch.zeros_like(idx))
    return logits


def test_without_targets_only_the_last_position_is_computed():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(65, (2, 9))
    last, loss = model(idx)
    assert loss is None and last.shape == (2, 1, 65)
    torch.testing.assert_close(last[:, 0], all_logits(model, idx)[:, -1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_changing_token_t_never_changes_earlier_logits(bias):
    torch.manual_seed(0)
    model = GPT(tiny_config(bias=bias)).eval()
    T = model.config.block_size
    idx = torch.randint(65, (3, T))
    with torch.no_grad():
        base = all_logits(model, idx)
        for t in range(T):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.arange(3)) % 65  # a different token in every row
            out = all_logits(model, changed)
            # positions before t see exactly the same inputs: bit-for-bit the same logits
            assert torch.equal(out[:, :t], base[:, :t]), f"changing token {t} changed an earlier position"
            # and the change is seen from t on (the test would pass vacuously otherwise)
            assert not torch.equal(out[:, t], base[:, t])


def reference_attention(mha, x, qk_norm=False):
    """softmax(Q K^T / sqrt(d)) V with an explicit causal mask, one head at a time from the module's
    own weights, the heads concatenated and projected by W_O. No scaled_dot_product_attention.
    With qk_norm, each query and key row is first normalised: minus its mean, divided by its standard
    deviation (the biased one, plus LayerNorm's eps 1e-5 under the root)."""
    B, T, C = x.shape
    n_head = mha.n_head
    d = C // n_head
    W, b = mha.qkv.weight, mha.qkv.bias  # rows: all heads' W_Q, then W_K, then W_V
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    heads = []
    for h in range(n_head):
        rows = slice(h * d, (h + 1) * d)
        Wq, Wk, Wv = W[rows], W[C:][rows], W[2 * C:][rows]
        bq, bk, bv = (b[rows], b[C:][rows], b[2 * C:][rows]) if b is not None else (0, 0, 0)
        q, k, v = x @ Wq.T + bq, x @ Wk.T + bk, x @ Wv.T + bv  # (B, T, d)
        if qk_norm:
            q, k = ((t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, unbiased=False, keepdim=True) + 1e-5)
                    for t in (q, k))
        scores = q @ k.transpose(1, 2) / math.sqrt(d)  # (B, T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    y = torch.cat(heads, dim=-1)  # (B, T, C)
    return y @ mha.proj.weight.T + (mha.proj.bias if mha.proj.bias is not None else 0)


@pytest.mark.parametrize("bias,qk_norm", [(True, False), (False, False), (True, True)])
def test_batched_attention_equals_per_head_formula(bias, qk_norm):
    torch.manual_seed(0)
    mha = MultiHeadAttention(tiny_config(bias=bias, n_embd=48, n_head=6, qk_norm=qk_norm)).eval()
    if bias:  # nonzero biases, so that they are checked too
        for p in (mha.qkv.bias, mha.proj.bias):
            torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 11, 48)
    with torch.no_grad():
        diff = (mha(x) - reference_attention(mha, x, qk_norm)).abs().max().item()
    assert diff < 1e-5


def test_the_model_runs_these_modules_with_all_heads_in_one_call():
    """The equivalence above matters only if the blocks really run MultiHeadAttention, and its
    Head once per layer on every head at once (no Python loop over heads)."""
    model = GPT(tiny_config()).eval()
    assert all(isinstance(block.attn, MultiHeadAttention) for block in model.blocks)
    shapes = []
    for block in model.blocks:
        assert isinstance(block.attn.heads, Head)
        block.attn.heads.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
    model(torch.randint(65, (2, 5)))
    assert shapes == [(2, 4, 5, 8)] * 2  # (B, n_head, T, head_size), once per layer


def test_initial_loss_is_about_log_vocab_size():
    # With GPT-2's small init the logits are nearly uniform, so cross-entropy on random targets
    # is ln(vocab_size) plus a little: measured 4.21 for ln(65) = 4.17. Tolerance 0.1.
    torch.manual_seed(0)
    for vocab in (65, 500):
        model = GPT(tiny_config(vocab_size=vocab, n_embd=64)).eval()
        idx = torch.randint(vocab, (8, 16))
        targets = torch.randint(vocab, (8, 16))
        with torch.no_grad():
            _, loss = model(idx, targets)
        assert abs(loss.item() - math.log(vocab)) < 0.1, (vocab, loss.item())


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.randint(65, (4, 16))
    targets = torch.randint(65, (4, 16))  # random targets: only memorising can fit them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    first = None
    for _ in range(80):  # measured: 0.009 after 50 steps, 0.004 after 75
        _, loss = model(idx, targets)
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert first > 4.0  # about ln(65) = 4.17 at the start
    assert loss.item() < 0.05


def test_targets_of_minus_one_are_ignored():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(65, (2, 8))
    targets = torch.randint(65, (2, 8))
    masked = targets.clone()
    masked[:, :4] = -1
    with torch.no_grad():
        logits, loss = model(idx, masked)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 65), targets[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_gpt2_initialisation():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(block_size=256, vocab_size=1000, n_layer=n_layer, n_head=4, n_embd=128, bias=True))
    resid_std = 0.02 / math.sqrt(2 * n_layer)
    checked = 0
    for name, p in model.named_parameters():
        if p.dim() < 2:
            # biases start at 0, LayerNorm gains at 1
            is_gain = name.split(".")[-2].startswith("ln") and name.endswith(".weight")
            expected = 1.0 if is_gain else 0.0
            assert torch.all(p == expected), name
            continue
        std = resid_std if name.endswith(("attn.proj.weight", "ffwd.proj.weight")) else 0.02
        # each tensor has >= 16k entries: the sample std is within ~1.1% of the true one (3 sigma)
        assert p.mean().abs().item() < 0.1 * std, name
        assert abs(p.std().item() - std) < 0.03 * std, (name, p.std().item(), std)
        checked += 1
    # token and position embeddings, and per layer qkv, attn.proj, fc, ffwd.proj
    assert checked == 2 + 4 * n_layer


def test_lm_head_is_tied_to_the_token_embedding():
    model = GPT(tiny_config())
    assert model.lm_head.weight is model.tok_emb.weight
    assert isinstance(model.pos_emb, torch.nn.Embedding) and model.pos_emb.weight.shape == (16, 32)
    # one tensor, counted once
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("bias, mlp_ratio", [(True, 4), (False, 4), (True, 3)])
def test_get_num_params(bias, mlp_ratio):
    V, T, L, C, H = 65, 16, 2, 32, mlp_ratio * 32  # H: the MLP's hidden width
    model = GPT(tiny_config(bias=bias, mlp_ratio=mlp_ratio))
    ln = 2 * C if bias else C  # LayerNorm gain (and bias)
    per_block = (2 * ln + C * 3 * C + C * C + C * H + H * C
                 + (3 * C + C + H + C if bias else 0))
    total = V * C + T * C + L * per_block + ln  # embeddings, blocks, ln_f; lm_head is tok_emb
    assert model.get_num_params(non_embedding=False) == total
    assert model.get_num_params() == total - T * C  # without the position embedding


def test_estimate_mfu_formula():
    model = GPT(tiny_config())
    cfg = model.config
    N = model.get_num_params()
    # PaLM appendix B: 6N + 12 L H Q T FLOPs per token, T tokens per sequence
    flops_per_iter = (6 * N + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size) \
        * cfg.block_size * 10
    assert model.estimate_mfu(10, 0.5, peak_flops=1e9) == pytest.approx(flops_per_iter / 0.5 / 1e9, rel=1e-12)
    # default peak: an A100's 312 TFLOP/s in bf16, as nanoGPT
    assert model.estimate_mfu(10, 0.5) == pytest.approx(flops_per_iter / 0.5 / 312e12, rel=1e-12)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_head"):
        GPT(tiny_config(n_embd=30, n_head=4))
    with pytest.raises(ValueError, match="vocab_size must be a positive integer, got 0"):
        GPT(tiny_config(vocab_size=0))
    with pytest.raises(ValueError, match="mlp_ratio must be a positive integer, got 0"):
        GPT(tiny_config(mlp_ratio=0))


def test_load_weights_names_what_does_not_fit():
    """load_weights (checkpoints, GPT.from_pretrained): a weight of another shape, or a missing or unknown one, is a
    ValueError that names it; a compiled model's `_orig_mod.` prefixes and the tied lm_head are accepted."""
    model = GPT(tiny_config())
    state = GPT(tiny_config()).state_dict()
    model.load_weights({f"_orig_mod.{k}": v for k, v in state.items() if k != "lm_head.weight"})
    assert torch.equal(model.tok_emb.weight, state["tok_emb.weight"]) and model.lm_head.weight is model.tok_emb.weight
    longer = GPT(tiny_config(block_size=24)).state_dict()
    with pytest.raises(ValueError, match=r"do not fit the model: size mismatch for pos_emb\.weight: .*\[24, 32\]"
                                         r".*\[16, 32\]"):
        model.load_weights(longer)
    with pytest.raises(ValueError, match=r"do not match the model: missing \['ln_f.weight'\], unexpected \['x'\]"):
        model.load_weights({k: v for k, v in state.items() if k != "ln_f.weight"} | {"x": torch.zeros(1)})
