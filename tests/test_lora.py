"""LoRA (train.py --lora_rank, machinery/weights/lora.py) against Hugging Face's peft, float32, on a tiny random GPT-2.

peft is the reference: its LoRA on transformers' GPT2LMHeadModel (Conv1D layers, fan_in_fan_out) starts as ours,
takes the same optimizer step on the same batch, and loads our adapter-only export; transformers loads the merged
export. The base is conftest's tiny perturbed GPT-2 (logits of std > 1) and the adapters are trained at a high
learning rate, so that the adapters move the logits by far more than any tolerance here (checked each time).
"""

import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2LMHeadModel

from conftest import assert_one_error_line, finetune_args, load_checkpoint, run_in_process
from conftest import tiny_train_args, train
import eval as evaluation
import export
import sample
import serve
import train as train_script
from machinery import configurator
from machinery.generation import loading
from machinery.weights import checkpoint, convert, lora
from machinery.data.meta import DatasetMeta
from model import GPT, GPTConfig
from optimizers import set_schedule

RANK, ALPHA = 4, 8
RUN_ARGS = dict(learning_rate=1e-2, max_iters=4, eval_interval=2, dropout=0.1)  # high lr: adapters far from zero
LORA_ARGS = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.1)
# our module in a block -> GPT-2's (Hugging Face's names, written here from GPT-2's own state dict, not lora.py's)
GPT2_MODULES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ffwd.fc": "mlp.c_fc", "ffwd.proj": "mlp.c_proj"}
SAME_CODE_TOL = 1e-5  # the same implementation on both sides (transformers, or ours): merging's rounding only
CROSS_TOL = 1e-4  # ours against transformers': other summation orders and tanh-GELU formula (as tests/test_hf.py)
GRAD_TOL, STEP_TOL = 1e-5, 1e-5  # (test_one_lora_step_...: measured, see there)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_dir, module_bpe_data):
    """A LoRA finetune of the tiny GPT-2 directory as a user runs it (4 steps, dropout and adapter dropout on); its
    out_dir and log."""
    out = tmp_path_factory.mktemp("lora-run") / "out"
    proc = train(*finetune_args(hf_dir[0], module_bpe_data, out, **RUN_ARGS, **LORA_ARGS))
    return out, proc.stdout


def tokens(seed=0, T=32):
    return torch.randint(0, 50257, (2, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours(model, idx):
    return model.eval()(idx, every_position=True)[0]


@torch.no_grad()
def theirs(model, idx):
    return model.eval()(idx).logits


def peft_model(path, dropout=0.0):
    """peft's LoRA on transformers' GPT-2 from path, on every layer ours targets by default."""
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, fan_in_fan_out=True,
                        target_modules=sorted(GPT2_MODULES.values()))
    return get_peft_model(GPT2LMHeadModel.from_pretrained(path), config)


def peft_pairs(ours_model, theirs_model):
    """(our adapter, peft's) of every targeted layer, as Parameters: lora_A, then lora_B."""
    named = dict(theirs_model.named_parameters())
    for i in range(ours_model.config.n_layer):
        for mine, gpt2 in GPT2_MODULES.items():
            layer = ours_model.blocks[i].get_submodule(mine)
            for ab in ("A", "B"):
                theirs_name = f"base_model.model.transformer.h.{i}.{gpt2}.lora_{ab}.default.weight"
                yield getattr(layer, f"lora_{ab}"), named[theirs_name]


def lora_model(run_dir, which=checkpoint.LATEST):
    """Our model with the run's adapters applied, unmerged (as a resumed run has it)."""
    ckpt = checkpoint.load(run_dir / which)
    model = GPT(ckpt.model_config)
    ckpt.load_weights(model)
    return model


# ---------------------------------------------------------------------- settings and initialisation


@pytest.mark.parametrize("setting, words", [
    (dict(lora_rank=-1), ["lora_rank", "-1"]),
    (dict(lora_targets="attn,qkv"), ["lora_targets", "attn, proj, mlp", "'attn,qkv'"]),
    (dict(lora_targets="mlp,mlp"), ["lora_targets", "each once"]),
    (dict(lora_alpha=0), ["lora_alpha", "positive"]),
    (dict(lora_dropout=1.0), ["lora_dropout", "[0, 1)"]),
])
def test_bad_lora_settings_are_one_line_errors_and_write_nothing(tmp_path, hf_dir, module_bpe_data, setting, words):
    out = tmp_path / "out"
    proc = train(*finetune_args(hf_dir[0], module_bpe_data, out, **{"lora_rank": RANK, **setting}), check=False)
    assert_one_error_line(proc, *words)
    assert not out.exists()


def test_adapters_start_as_peft_s_and_only_they_train(hf_dir):
    """A: kaiming_uniform(a=sqrt(5)), i.e. uniform in +-1/sqrt(fan_in) (gain sqrt(2/(1+5)) times sqrt(3/fan_in)), B:
    zero, as peft's; the model is then exactly its base, every base weight frozen."""
    path, _ = hf_dir
    base = convert.load_hf(str(path))
    model = lora.apply(convert.load_hf(str(path)), lora.LoRASettings(RANK, ALPHA, 0.0, ("attn", "proj", "mlp")))
    reference = peft_model(path)
    for mine, peft_param in peft_pairs(model, reference):
        assert mine.shape == peft_param.shape
        if mine.shape[0] == RANK:  # A: (rank, in)
            bound = 1 / math.sqrt(mine.shape[1])
            for a in (mine, peft_param):
                assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.std() > 0.5 * bound / math.sqrt(3)
        else:
            assert not mine.any() and not peft_param.any()
    idx = tokens()
    assert torch.equal(ours(model, idx), ours(base, idx))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.{m}.lora_{ab}" for i in range(2) for m in GPT2_MODULES for ab in "AB"}
    assert {n for n, p in reference.named_parameters() if p.requires_grad} == {
        f"base_model.model.transformer.h.{i}.{m}.lora_{ab}.default.weight"
        for i in range(2) for m in GPT2_MODULES.values() for ab in "AB"}


def test_one_lora_step_of_train_py_equals_peft_s_and_leaves_the_base_untouched(tmp_path, hf_dir, module_bpe_data):
    """train.py's own step (its Trainer: loss, clipping, AdamW with weight decay, the schedule's learning rate) and
    peft's with the same adapters (B made non-zero, so that A's gradient is too) on the same batch: the same loss,
    the same gradients (AdamW's first moment after one step: (1 - beta1) times the clipped gradient) and the same
    adapters after the step. Tolerances: the forward passes differ as ours and transformers' do (summation orders,
    the tanh-GELU formula), so the gradients agree to float32 rounding, not bit for bit: measured within 7e-7 of
    each tensor's largest entry (GRAD_TOL: 1e-5 of it). Adam's first step moves an entry by lr * g / (|g| + eps),
    about lr whatever those last bits, except where |g| is near eps: measured at most 1.1e-6 apart (STEP_TOL 1e-5),
    while a weight decay or learning rate of its own would move entries by 1e-4 or more (lr * wd * |A| ~ 2e-4).
    """
    path, _ = hf_dir
    args = dict(RUN_ARGS, dropout=0.0, **dict(LORA_ARGS, lora_dropout=0.0))  # (no dropout: the same on both sides)
    cfg = configurator.parse(train_script.TrainConfig, finetune_args(path, module_bpe_data, tmp_path / "out", **args))
    cfg.validate()
    trainer = train_script.Trainer(cfg)
    try:
        model, reference = trainer.raw_model, peft_model(path)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for mine, peft_param in peft_pairs(model, reference):
                if mine.shape[1] == RANK:  # B
                    mine.copy_(torch.randn(mine.shape, generator=g) * 0.05)
                peft_param.copy_(mine)
        before = [mine.detach().clone() for mine, _ in peft_pairs(model, reference)]
        x, y = trainer.next_batch()
        lr = set_schedule(trainer.optimizer, 0, cfg)
        loss, _, _ = trainer.optimizer_step(x, y)
    finally:
        trainer.out_dir_lock.release()

    reference.eval()  # (transformers' GPT-2 has dropout 0.1; ours finetunes with 0)
    logits = reference(input_ids=x).logits
    expected = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=CROSS_TOL)
    params = [p for p in reference.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                                  fused=True)
    optimizer.step()
    moved = 0.0
    for (mine, peft_param), old in zip(peft_pairs(model, reference), before):
        gradient, expected_gradient = trainer.optimizer.state[mine]["exp_avg"], optimizer.state[peft_param]["exp_avg"]
        torch.testing.assert_close(gradient, expected_gradient, atol=GRAD_TOL * expected_gradient.abs().max(), rtol=0)
        torch.testing.assert_close(mine.detach(), peft_param.detach(), atol=STEP_TOL, rtol=0)
        moved = max(moved, (mine - old).abs().max().item())
    assert moved > 0.5 * lr  # the step did move the adapters
    # the base: bit for bit GPT-2's weights still (AdamW's weight decay would have moved any it held)
    fresh = convert.load_hf(str(path))
    fresh.crop_block_size(cfg.block_size)
    fresh = fresh.state_dict()
    assert all(torch.equal(p, fresh[n]) for n, p in model.state_dict().items() if not lora.is_adapter(n))


# ---------------------------------------------------------------------- checkpoints


def adapter_numbers(n_layer=2, n_embd=32):
    """How many numbers the adapters hold: rank * (in + out) for each of the 4 layers of each block."""
    shapes = [(n_embd, 3 * n_embd), (n_embd, n_embd), (n_embd, 4 * n_embd), (4 * n_embd, n_embd)]
    return n_layer * sum(RANK * (i + o) for i, o in shapes)


def test_the_checkpoints_hold_the_adapters_their_optimizer_state_and_name_their_base(lora_run, hf_dir):
    out, log = lora_run
    names = {f"blocks.{i}.{m}.lora_{ab}" for i in range(2) for m in GPT2_MODULES for ab in "AB"}
    latest, best = load_checkpoint(out / "ckpt.pt"), load_checkpoint(out / "best.pt")
    for state in (latest, best):
        assert set(state["model"]) == names
        assert state["lora"]["base"]["init_from"] == os.path.abspath(hf_dir[0])
        assert re.fullmatch(r"[0-9a-f]{64}", state["lora"]["base"]["sha256"])
        assert {k: state["lora"][k] for k in ("rank", "alpha", "dropout", "targets")} == {
            "rank": RANK, "alpha": ALPHA, "dropout": 0.1, "targets": ["attn", "proj", "mlp"]}
    assert set(latest["optimizer"]["state"]) == names  # AdamW's moments of the adapters only
    # sizes: 4 bytes a number; ckpt.pt the adapters and Adam's two moments; a few kB of settings and RNG states
    # besides (the base alone would be 6.6 MB: its 50257 x 32 embedding)
    numbers = adapter_numbers()
    assert 3 * 4 * numbers < os.path.getsize(out / "ckpt.pt") < 3 * 4 * numbers + 60_000
    assert 4 * numbers < os.path.getsize(out / "best.pt") < 4 * numbers + 20_000
    assert f"saved {out}/ckpt.pt: {os.path.getsize(out / 'ckpt.pt') / 1e6:.2f} MB" in log
    assert f"LoRA rank 4 (alpha 8, dropout 0.1) on attn,proj,mlp: {adapter_numbers():,} trainable parameters" in log


def test_a_lora_run_resumes_exactly_and_keeps_its_lora_settings(tmp_path, lora_run, hf_dir, module_bpe_data):
    """4 steps straight (lora_run), and 2 + resume 2 (dropout and adapter dropout on): the same adapters, optimizer
    state and RNG states, bit for bit. A resume that asks for other LoRA settings is refused, nothing written."""
    straight, _ = lora_run
    train(*finetune_args(hf_dir[0], module_bpe_data, tmp_path / "split", **dict(RUN_ARGS, max_iters=2), **LORA_ARGS))
    saved = (tmp_path / "split" / "ckpt.pt").read_bytes()
    refused = train(*finetune_args("resume", module_bpe_data, tmp_path / "split", **RUN_ARGS, lora_rank=8), check=False)
    assert_one_error_line(refused, "lora_rank=4", "asks for 8")
    assert (tmp_path / "split" / "ckpt.pt").read_bytes() == saved
    # the same command with --init_from=resume, the LoRA settings left out: the checkpoint's
    resumed = train(*finetune_args("resume", module_bpe_data, tmp_path / "split", **RUN_ARGS))
    assert "resuming from" in resumed.stdout and "LoRA rank 4 (alpha 8, dropout 0.1)" in resumed.stdout
    a, b = load_checkpoint(straight / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 4 and a["lora"] == b["lora"]
    assert b["train_config"]["lora_rank"] == RANK  # (the settings it records say what it trained)
    torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=0)  # (nested dicts of tensors: exact)
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=0, atol=0)
    assert b["optimizer"]["param_groups"] == a["optimizer"]["param_groups"]
    assert torch.equal(a["ranks"][0]["rng"]["torch"], b["ranks"][0]["rng"]["torch"])


def test_lora_on_a_new_model_with_muon_resumes_exactly(tmp_path, char_data):
    """init_from=scratch (the base rebuilt from its seed on resume) and optimizer=muon (Muon on the adapters: the
    optimizer then has no AdamW parameters at all): 4 steps straight equal 2 + resume 2."""
    args = dict(max_iters=4, eval_interval=2, optimizer="muon", dropout=0.1)
    train(*tiny_train_args(char_data, tmp_path / "straight", **args, lora_rank=2, lora_dropout=0.1))
    train(*tiny_train_args(char_data, tmp_path / "split", **dict(args, max_iters=2), lora_rank=2, lora_dropout=0.1))
    train(*tiny_train_args(char_data, tmp_path / "split", **args, init_from="resume"))
    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 4 and a["lora"] == b["lora"] and a["lora"]["base"]["seed"] == 1337
    torch.testing.assert_close(b["model"], a["model"], rtol=0, atol=0)
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], rtol=0, atol=0)


# ---------------------------------------------------------------------- exports, against peft and transformers


def test_merged_and_adapter_only_exports_equal_peft(tmp_path, lora_run, hf_dir):
    out, _ = lora_run
    path, hf_base = hf_dir
    run_in_process(export.main, f"--out_dir={out}", tmp_path / "merged", check=True)
    proc = run_in_process(export.main, f"--out_dir={out}", "--adapter_only", tmp_path / "adapter", check=True)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(path)
    assert f"base: {os.path.abspath(path)}" in proc.stdout
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == ("LORA", 4, 8, True)
    assert sorted(config["target_modules"]) == sorted(GPT2_MODULES.values())

    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in keys and len(keys) == 16
    with_peft = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(path), tmp_path / "adapter")
    merged = GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    idx = tokens(1)
    expected = theirs(with_peft, idx)
    assert (expected - theirs(hf_base, idx)).abs().max() > 1e-2  # the adapters matter, far above the tolerances
    torch.testing.assert_close(theirs(merged, idx), expected, atol=SAME_CODE_TOL, rtol=0)
    torch.testing.assert_close(ours(lora_model(out, checkpoint.BEST), idx), expected, atol=CROSS_TOL, rtol=0)


def test_adapter_only_export_refuses_what_peft_cannot_take(tmp_path, lora_run, char_data):
    out, _ = lora_run
    refused = run_in_process(export.main, f"--out_dir={out}", "--adapter_only", "--to=gguf", tmp_path / "a.gguf")
    assert_one_error_line(refused, "--adapter_only")
    # a whole model's checkpoint has no adapters
    whole = tmp_path / "whole"
    whole.mkdir()
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    checkpoint.save(checkpoint.training_state(model.state_dict(), model.config, train_script.TrainConfig(),
                                              DatasetMeta.gpt2(), 0, float("inf")), str(whole / checkpoint.BEST))
    refused = run_in_process(export.main, f"--out_dir={whole}", "--adapter_only", tmp_path / "a")
    assert_one_error_line(refused, "whole model", "--lora_rank")
    # LoRA on a new model (init_from=scratch) of an architecture GPT-2's names cannot say (QK-norm): refused; the
    # same without QK-norm still has a base that no Hugging Face directory holds
    scratch = tmp_path / "scratch"
    train(*tiny_train_args(char_data, scratch, max_iters=2, eval_interval=2, qk_norm=True, lora_rank=2))
    refused = run_in_process(export.main, f"--out_dir={scratch}", "--adapter_only", tmp_path / "a")
    assert_one_error_line(refused, "qk_norm=True")
    saved = checkpoint.find(str(scratch))  # (best.pt, or ckpt.pt if the evaluation did not improve)
    state = load_checkpoint(saved)
    state["model_config"]["qk_norm"] = False
    torch.save(state, saved)
    refused = run_in_process(export.main, f"--out_dir={scratch}", "--adapter_only", tmp_path / "a")
    assert_one_error_line(refused, "init_from=scratch", "drop --adapter_only")
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.gguf").exists()


def test_a_scratch_lora_run_loads_on_its_rebuilt_base(tmp_path, char_data):
    """init_from=scratch: the base is the model the seed drew, rebuilt (and checked) when loaded; the merged model
    computes what the adapters on that base do."""
    out = tmp_path / "out"
    train(*tiny_train_args(char_data, out, max_iters=4, eval_interval=2, learning_rate=3e-2, lora_rank=2))
    assert set(load_checkpoint(out / "ckpt.pt")["model"]) == {
        f"blocks.{i}.{m}.lora_{ab}" for i in range(2) for m in GPT2_MODULES for ab in "AB"}
    loaded = loading.load(configurator.parse(loading.ModelSource, [f"--out_dir={out}", "--ckpt=latest"]))
    unmerged = lora_model(out)
    torch.manual_seed(1337)  # the run's seed: its base, drawn as train.py draws a new model
    base = GPT(unmerged.config)
    idx = torch.randint(0, unmerged.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    expected = ours(unmerged, idx)
    assert (expected - ours(base, idx)).abs().max() > 1e-2
    torch.testing.assert_close(ours(loaded.model, idx), expected, atol=SAME_CODE_TOL, rtol=0)
    base = base.state_dict()
    assert all(torch.equal(p, base[n]) for n, p in unmerged.state_dict().items() if not lora.is_adapter(n))


# ---------------------------------------------------------------------- sample, serve and eval load it merged


def test_sample_serve_and_eval_load_a_lora_checkpoint_on_its_base(tmp_path, lora_run, hf_dir):
    out, _ = lora_run
    unmerged = lora_model(out, checkpoint.BEST)
    idx = tokens(2)
    loaded = loading.load(configurator.parse(loading.ModelSource, [f"--out_dir={out}"]))
    torch.testing.assert_close(ours(loaded.model, idx), ours(unmerged, idx), atol=SAME_CODE_TOL, rtol=0)
    assert not any(isinstance(m, lora.LoRALinear) for m in loaded.model.modules())  # merged: a plain GPT

    prompt = "The king"
    start = torch.tensor([loaded.tokenizer.encode(prompt)])
    greedy = unmerged.generate(start, 8, temperature=0)[0, start.size(1):].tolist()
    proc = run_in_process(sample.main, f"--out_dir={out}", f"--start={prompt}", "--num_samples=1",
                          "--max_new_tokens=8", "--temperature=0", "--device=cpu", "--dtype=float32", check=True)
    assert prompt + loaded.tokenizer.decode(greedy) in proc.stdout

    cfg = configurator.parse(serve.ServeConfig, [f"--out_dir={out}", "--device=cpu", "--dtype=float32"])
    cfg.validate()
    _, served = serve.build(cfg)
    torch.testing.assert_close(ours(served.model, idx), ours(unmerged, idx), atol=SAME_CODE_TOL, rtol=0)

    text = "The king speaks of love and night, and the queen hears."
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    ids = torch.tensor([loaded.tokenizer.encode(text)])
    assert ids.size(1) <= unmerged.config.block_size  # one window: every token predicted from all before it
    logits = ours(unmerged, ids[:, :-1])
    nats = F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
    proc = run_in_process(evaluation.main, f"--out_dir={out}", f"--text={tmp_path / 't.txt'}", "--device=cpu",
                          "--dtype=float32", "--json", check=True)
    assert json.loads(proc.stdout)["text"]["loss"] == pytest.approx(nats / (ids.size(1) - 1), abs=SAME_CODE_TOL)


def test_a_base_that_changed_or_went_away_is_refused_in_one_line(tmp_path, lora_run):
    out, _ = lora_run
    for i, (change, words) in enumerate([(dict(sha256="0" * 64), ["differ", "sha256"]),
                                          (dict(init_from=str(tmp_path / "gone")), ["gone", "does not load"])]):
        moved = tmp_path / f"out{i}"
        moved.mkdir()
        state = load_checkpoint(out / "best.pt")
        state["lora"]["base"].update(change)
        torch.save(state, moved / "best.pt")
        proc = run_in_process(sample.main, f"--out_dir={moved}", "--num_samples=1", "--max_new_tokens=2",
                              "--device=cpu")
        assert_one_error_line(proc, *words)
