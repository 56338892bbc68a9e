"""optimizers.build_optimizer: which parameter gets which update, the updates themselves (checked
against values computed here by hand, or against torch's AdamW), checkpoint round trips, GradScaler."""

import copy

import pytest
import torch

import optimizers
from model import GPT, GPTConfig
from optimizers import build_optimizer, newton_schulz, set_schedule

LR, MUON_LR, WD, BETAS = 1e-3, 0.02, 0.1, (0.9, 0.99)
HIDDEN = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "ffwd.fc", "ffwd.proj")}


def tiny_model(bias=False):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8, bias=bias))


def loss_step(model, opt, seed, scaler=None):
    """One forward/backward on a fixed random batch, then the optimizer step."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(11, (3, 8), generator=g), torch.randint(11, (3, 8), generator=g)
    _, loss = model(x, y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def names_of(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("bias", [False, True])
def test_muon_takes_the_hidden_matrices_adamw_the_rest(bias):
    model = tiny_model(bias)
    opt = build_optimizer(model, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
    muon, decay, no_decay = opt.param_groups
    assert muon["use_muon"] and not decay["use_muon"] and not no_decay["use_muon"]
    assert names_of(model, muon["params"]) == HIDDEN
    assert names_of(model, decay["params"]) == {"tok_emb.weight", "pos_emb.weight"}  # tok_emb is lm_head too
    expected_1d = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert names_of(model, no_decay["params"]) == expected_1d and (len(expected_1d) > 5 if bias else True)
    assert (muon["weight_decay"], decay["weight_decay"], no_decay["weight_decay"]) == (0.0, WD, 0.0)
    assert (muon["lr_scale"], decay["lr_scale"], no_decay["lr_scale"]) == (MUON_LR / LR, 1.0, 1.0)


@pytest.mark.parametrize("bias", [True, False])
def test_adamw_decays_exactly_the_matrices(bias):
    model = tiny_model(bias)
    opt = build_optimizer(model, "adamw", 3e-4, 0.1, (0.9, 0.95), "cpu")
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    decay = [g for g in opt.param_groups if g["weight_decay"] == 0.1]
    no_decay = [g for g in opt.param_groups if g["weight_decay"] == 0.0]
    assert len(decay) == 1 and len(no_decay) == 1
    assert names_of(model, decay[0]["params"]) == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert names_of(model, no_decay[0]["params"]) == {n for n, p in model.named_parameters() if p.dim() < 2}
    assert len(no_decay[0]["params"]) > 0  # LayerNorm gains at least
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)


def test_adamw_groups_get_exactly_adamws_update():
    a, b = tiny_model(), tiny_model()
    opt = build_optimizer(a, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
    # the reference: torch's fused AdamW alone on the same non-hidden parameters, same groups
    rest = [p for n, p in b.named_parameters() if n not in HIDDEN]
    ref = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, fused=True)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(a.parameters(), b.parameters()):  # the same gradients for both
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        for group in opt.param_groups + ref.param_groups:
            group["lr"] = LR * (step + 1) / 3
        opt.step()
        ref.step()
    for n, p in a.named_parameters():
        if n not in HIDDEN:
            assert torch.equal(p, dict(b.named_parameters())[n]), n


# Polar Express's coefficients (Amsel, Persson, Musco, Gower 2025), as modded-nanogpt lists them
PAPER_COEFFICIENTS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def newton_schulz_by_hand(m, steps=5):
    """The quintic iteration X <- aX + (bA + cA^2)X, A = XX^T, with step k's coefficients, in float64,
    from X = M / (1.02 |M|_F) (on the wide orientation)."""
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (1.02 * x.norm())
    for a, b, c in PAPER_COEFFICIENTS[:steps]:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def test_muon_update_is_the_orthogonalised_nesterov_momentum():
    model = tiny_model()
    opt = build_optimizer(model, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR, muon_momentum=0.9,
                          muon_weight_decay=0.5)
    w = model.blocks[0].ffwd.fc.weight  # 32 x 8: tall, so the update is scaled by sqrt(32 / 8) = 2
    grads = [torch.randn(32, 8, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    expected, buf = w.detach().double().clone(), torch.zeros(32, 8, dtype=torch.float64)
    lr_mult = [1.0, 0.5]  # a schedule multiplier, applied to group["lr"] as train.py does
    for g, mult in zip(grads, lr_mult):
        for group in opt.param_groups:
            group["lr"] = LR * mult
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        w.grad = g.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * g.double()  # torch.optim.Muon's momentum: buf.lerp_(g, 1 - momentum)
        nesterov = g.double() + 0.9 * (buf - g.double())  # g.lerp(buf, momentum)
        lr = MUON_LR * mult
        expected = expected * (1 - lr * 0.5) - lr * 2.0 * newton_schulz_by_hand(nesterov)
        torch.testing.assert_close(w.detach().double(), expected, rtol=0, atol=2e-6)
    # and the orthogonalised matrix has its singular values near 1
    s = torch.linalg.svdvals(newton_schulz_by_hand(grads[0]))
    assert s.min() > 0.6 and s.max() < 1.25


@pytest.mark.parametrize("steps", [5, 3])
@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (48, 48)])  # wide (computed on 24 x 24), tall, square
def test_newton_schulz_is_the_iteration_written_out(shape, steps):
    m = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    torch.testing.assert_close(newton_schulz(m, steps).double(), newton_schulz_by_hand(m, steps), rtol=0, atol=2e-6)
    if steps == 5:  # the point of the iteration: the singular values end up near 1 (measured 0.86-1.14)
        s = torch.linalg.svdvals(newton_schulz(m, steps).double())
        assert s.min() > 0.8 and s.max() < 1.2
    with pytest.raises(ValueError, match="1 to 5"):
        newton_schulz(m, 6)


def test_state_dict_round_trip_gives_identical_steps():
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    a = tiny_model()
    opt_a = build_optimizer(a, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
    for step in range(2):
        loss_step(a, opt_a, step)
    for how in ("plain", "dcp"):
        b = copy.deepcopy(a)
        opt_b = build_optimizer(b, "muon", 5e-4, 0.0, (0.8, 0.9), "cpu", muon_lr=0.1)  # all overwritten
        if how == "plain":
            opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        else:
            options = StateDictOptions(full_state_dict=True)
            state = get_optimizer_state_dict(a, opt_a, options=options)
            set_optimizer_state_dict(b, opt_b, copy.deepcopy(state), options=options)
            for group in opt_b.param_groups:  # as train.py does after the round trip
                group["betas"] = tuple(group["betas"])
        for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
            assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
        a2, opt_a2 = copy.deepcopy(a), None
        opt_a2 = build_optimizer(a2, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
        opt_a2.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        for step in range(2, 4):
            loss_step(a2, opt_a2, step)
            loss_step(b, opt_b, step)
        for (n, p), q in zip(a2.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (how, n)


def test_grad_scaler_unscales_and_skips_bad_steps():
    a, b = tiny_model(), tiny_model()
    opt_a = build_optimizer(a, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
    opt_b = build_optimizer(b, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # a power of 2: unscaling is exact
    for step in range(2):
        loss_step(a, opt_a, step)
        loss_step(b, opt_b, step, scaler)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # an infinite gradient: the scaler skips the step and halves its scale
    before = [p.detach().clone() for p in b.parameters()]
    _, loss = b(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    scaler.scale(loss).backward()
    b.blocks[0].attn.qkv.weight.grad[0, 0] = float("inf")
    scaler.step(opt_b)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
    assert scaler.get_scale() == 2.0 ** 9


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer(tiny_model(), "sgd", LR, WD, BETAS, "cpu")
    with pytest.raises(TypeError, match="muon_lrr"):
        build_optimizer(tiny_model(), "muon", LR, WD, BETAS, "cpu", muon_lrr=0.1)


def test_schedule_sets_every_groups_lr_and_warms_muons_momentum_up():
    from types import SimpleNamespace

    cfg = SimpleNamespace(decay_lr=True, learning_rate=1e-3, min_lr=1e-4, warmup_iters=0, lr_decay_iters=100,
                          muon_momentum=0.95, muon_momentum_warmup=300)
    opt = build_optimizer(tiny_model(), "muon", 1e-3, WD, BETAS, "cpu", muon_lr=MUON_LR)
    for it, momentum in ((0, 0.85), (150, 0.90), (300, 0.95), (1000, 0.95)):
        lr = set_schedule(opt, it, cfg)
        assert [g["lr"] for g in opt.param_groups] == [lr] * 3
        assert opt.param_groups[0]["momentum"] == pytest.approx(momentum, abs=1e-12)
    assert lr == 1e-4  # past lr_decay_iters
    cfg.muon_momentum_warmup = 0
    set_schedule(opt, 0, cfg)
    assert opt.param_groups[0]["momentum"] == 0.95


# ---------------------------------------------------------------------- matrices of one shape stacked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])  # bfloat16: CUDA's choice
@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (48, 48)])  # wide, tall, square
def test_newton_schulz_of_a_stack_is_each_matrix_alone_exactly(shape, dtype):
    """Exact, not close: each matrix of the stack gets the same products (a batched product computes each
    matrix's as one product would; checked bit for bit on AVX-512 and AVX2 CPUs, 1 and 2 threads) and the
    same norm."""
    m = torch.randn(3, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    for steps in (5, 3):
        stacked = newton_schulz(m, steps, dtype=dtype)
        assert stacked.shape == m.shape
        assert torch.equal(stacked, torch.stack([newton_schulz(x, steps, dtype=dtype) for x in m]))


@torch.no_grad()
def muon_step_matrix_by_matrix(params, buffers, lr, momentum, weight_decay, ns_steps):
    """Muon's step one matrix at a time (as optimizers.py did before it stacked them): torch.optim.Muon's Nesterov
    momentum, Newton-Schulz of that matrix alone, decoupled weight decay, the update scaled by sqrt(rows / cols)."""
    for p, buf in zip(params, buffers):
        buf.lerp_(p.grad, 1 - momentum)
        update = newton_schulz(p.grad.lerp(buf, momentum), ns_steps)
        p.mul_(1 - lr * weight_decay)
        p.add_(update, alpha=-lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ns_steps", [5, 3])
def test_the_stacked_muon_step_is_the_step_matrix_by_matrix_exactly(dtype, ns_steps):
    a, b = tiny_model().to(dtype), tiny_model().to(dtype)
    opt = build_optimizer(a, "muon", LR, WD, BETAS, "cpu", muon_lr=MUON_LR, muon_weight_decay=0.3,
                          muon_ns_steps=ns_steps)
    hidden = [p for n, p in b.named_parameters() if n in HIDDEN]
    buffers = [torch.zeros_like(p) for p in hidden]
    muon = opt.param_groups[0]["params"]
    # 4 shapes, 2 layers: 4 stacks of 2 matrices (qkv 24 x 8, proj 8 x 8, fc 32 x 8, proj 8 x 32)
    assert sorted(len(same) for same in optimizers.same_shape(muon)) == [2, 2, 2, 2]
    for step, (mult, momentum) in enumerate([(1.0, 0.85), (0.5, 0.9), (0.25, 0.95)]):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(a.parameters(), b.parameters()):
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            q.grad = p.grad.clone()
        for group in opt.param_groups:  # the schedule, as set_schedule sets it
            group["lr"] = LR * mult
        opt.param_groups[0]["momentum"] = momentum
        opt.step()
        muon_step_matrix_by_matrix(hidden, buffers, MUON_LR * mult, momentum, 0.3, ns_steps)
    for n, p in a.named_parameters():
        if n in HIDDEN:
            assert torch.equal(p, dict(b.named_parameters())[n]), n
            assert torch.equal(opt.state[p]["momentum_buffer"], buffers[[id(q) for q in muon].index(id(p))])


def test_compile_puts_newton_schulz_through_torch_compile(monkeypatch):
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((fn, kwargs))
        return lambda x, *args: (x.dim(), fn(x, *args))[1] if compiled.append(x.shape) is None else None

    monkeypatch.setattr(torch, "compile", fake_compile)
    build_optimizer(tiny_model(), "muon", LR, WD, BETAS, "cpu")  # (compile=False: torch.compile not asked)
    assert compiled == []
    model = tiny_model()
    opt = build_optimizer(model, "muon", LR, WD, BETAS, "cpu", compile=True)
    assert compiled == [(newton_schulz, {"dynamic": False})]
    loss_step(model, opt, 0)
    # one call per shape, each with the stack of that shape's 2 matrices
    assert sorted(compiled[1:]) == sorted([(2, 24, 8), (2, 8, 8), (2, 32, 8), (2, 8, 32)])


def test_a_failing_compilation_warns_once_and_steps_uncompiled(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no C compiler\nmore details")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    a, b = tiny_model(), tiny_model()
    opt_a = build_optimizer(a, "muon", LR, WD, BETAS, "cpu", compile=True)
    opt_b = build_optimizer(b, "muon", LR, WD, BETAS, "cpu")
    for step in range(2):
        loss_step(a, opt_a, step)
        loss_step(b, opt_b, step)
    assert capsys.readouterr().err == ("warning: torch.compile of newton_schulz failed (RuntimeError: no C compiler); "
                                       "running it uncompiled\n")
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("compile, compiled", [("True", True), ("False", False), ("None", False)])  # None: on CUDA
def test_train_py_compiles_newton_schulz_where_it_compiles_the_model(tmp_path, char_data, monkeypatch, compile,
                                                                    compiled):
    import train
    from conftest import tiny_train_args
    from machinery.configurator import parse

    asked, wrapped = [], []
    real = train.build_optimizer
    # (recorded, then built uncompiled: compiling is tested above)
    monkeypatch.setattr(train, "build_optimizer", lambda *a, **kw: asked.append(kw["compile"])
                        or real(*a, **kw | {"compile": False}))
    monkeypatch.setattr(train.compile_trial, "compiled_or_eager", lambda model, *args: wrapped.append(model) or model)
    train.Trainer(parse(train.TrainConfig, tiny_train_args(char_data, tmp_path / "out", optimizer="muon",
                                                           compile=compile)))
    assert asked == [compiled] and len(wrapped) == int(compiled)
