"""nanoGPT's ckpt.pt loads here: sampling, init_from=resume (optimizer state included), exact logits.

The test writes a checkpoint the way nanoGPT's train.py does: {"model", "optimizer", "model_args",
"iter_num", "best_val_loss" (a 0-d tensor), "config"}, weights under nanoGPT's names in its module
order, `_orig_mod.` prefixes from torch.compile, lm_head saved tied to wte, and the causal-mask
buffers nanoGPT registers when flash attention is missing. The name table below is written out from
nanoGPT's model.py, independently of convert.py.
"""

import pytest
import torch

from conftest import run_in_process, tiny_train_args
from machinery.data import meta
from machinery.weights import checkpoint
from machinery.configurator import parse
from machinery.errors import UserError
from model import GPT, GPTConfig
import sample
import train

# our module -> nanoGPT's, inside a block, in nanoGPT's registration order (ln_1, attn, ln_2, mlp)
BLOCK = [("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("ln2", "ln_2"),
         ("ffwd.fc", "mlp.c_fc"), ("ffwd.proj", "mlp.c_proj")]


def parameter_names(n_layer, bias):
    """(nanoGPT name, our name) of every parameter, in the order of nanoGPT's named_parameters()."""
    params = ("weight", "bias") if bias else ("weight",)
    names = [("transformer.wte.weight", "tok_emb.weight"), ("transformer.wpe.weight", "pos_emb.weight")]
    for i in range(n_layer):
        names += [(f"transformer.h.{i}.{theirs}.{p}", f"blocks.{i}.{ours}.{p}")
                  for ours, theirs in BLOCK for p in params]
    names += [(f"transformer.ln_f.{p}", f"ln_f.{p}") for p in params]
    return names


def random_model(vocab_size, bias=True, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=32, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, bias=bias))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def write_nanogpt_ckpt(model, out_dir, dataset="tiny", iter_num=10, compiled=True):
    """Save model as nanoGPT's train.py would; return {nanoGPT name: its AdamW state}."""
    cfg = model.config
    names = parameter_names(cfg.n_layer, cfg.bias)
    ours = model.state_dict()
    state = {theirs: ours[o].clone() for theirs, o in names}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, saved under both names
    for i in range(cfg.n_layer):  # nanoGPT's causal mask buffer (without flash attention)
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    if compiled:
        state = {"_orig_mod." + k: v for k, v in state.items()}

    # nanoGPT's configure_optimizers: two groups over named_parameters(), matrices then vectors
    params = {theirs: torch.nn.Parameter(ours[o].clone()) for theirs, o in names}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      bias=cfg.bias, vocab_size=cfg.vocab_size, dropout=0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state, "optimizer": opt.state_dict(), "model_args": model_args, "iter_num": iter_num,
                "best_val_loss": torch.tensor(2.5), "config": {"dataset": dataset, "batch_size": 4}},
               out_dir / "ckpt.pt")
    return {theirs: opt.state[p] for theirs, p in params.items()}


@torch.no_grad()
def logits(model, idx):
    return model.eval()(idx, idx)[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_nanogpt_checkpoint_gives_the_same_logits(tmp_path, bias, compiled):
    model = random_model(vocab_size=96, bias=bias)
    write_nanogpt_ckpt(model, tmp_path / "out", compiled=compiled)
    ckpt = checkpoint.load(tmp_path / "out" / "ckpt.pt")
    assert ckpt.model_config.gelu == "none" and ckpt.best_val_loss == 2.5 and ckpt.iter_num == 10
    assert ckpt.data_meta is None and ckpt.dataset == "tiny"  # nanoGPT records no tokenizer, only its dataset
    loaded = ckpt.build_model()
    assert loaded.config == model.config
    idx = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(loaded, idx), logits(model, idx))  # the same weights, the same computation


def test_sample_nanogpt_out_dir_with_the_datasets_meta_json(tmp_path, char_data, monkeypatch):
    # char_data is tmp_path/data/tiny, where nanoGPT looks (data/<dataset>/) when run from tmp_path
    chars = meta.read(char_data / "tiny").chars
    write_nanogpt_ckpt(random_model(len(chars)), tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(sample.main, "--out_dir=out", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=30",
                          "--device=cpu", check=True)
    out, err = proc.stdout, proc.stderr
    assert "data/tiny/meta.json" in err
    samples = out.split("---------------\n")[:2]
    assert all(s.startswith("ROMEO:") and set(s) <= set(chars) for s in samples), out

    # from elsewhere there is no data/tiny: GPT-2 BPE does not fit a model of 30-odd tokens
    monkeypatch.chdir(char_data)
    with pytest.raises(UserError, match="give its meta.json with --meta"):
        sample.main([f"--out_dir={tmp_path / 'out'}", "--device=cpu"])
    proc = run_in_process(sample.main, f"--out_dir={tmp_path / 'out'}", f"--meta={char_data / 'tiny' / 'meta.json'}",
                          "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=5", "--device=cpu", check=True)
    assert proc.stdout.startswith("ROMEO:")


def test_sample_nanogpt_out_dir_without_meta_uses_gpt2_bpe(tmp_path, monkeypatch):
    write_nanogpt_ckpt(random_model(50304), tmp_path / "out", dataset="openwebtext")
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(sample.main, "--out_dir=out", "--start=Hello", "--num_samples=1", "--max_new_tokens=5",
                          "--device=cpu", check=True)
    assert "GPT-2 BPE" in proc.stderr and proc.stdout.startswith("Hello")


def test_resume_a_nanogpt_out_dir_with_its_optimizer_state(tmp_path, char_data, capsys):
    out = tmp_path / "out"
    model = random_model(meta.read(char_data / "tiny").vocab_size)
    nano_state = write_nanogpt_ckpt(model, out, iter_num=10)
    cfg = parse(train.TrainConfig, tiny_train_args(char_data, out, init_from="resume", max_iters=12,
                                                   eval_interval=2, bias=True))
    cfg.validate()
    trainer = train.Trainer(cfg)
    assert trainer.iter_num == 10 and trainer.best_val_loss == 2.5
    params = dict(trainer.raw_model.named_parameters())
    for theirs, ours in parameter_names(2, bias=True):
        assert torch.equal(params[ours].detach(), model.state_dict()[ours]), ours
        mine = trainer.optimizer.state[params[ours]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(mine[key], nano_state[theirs][key]), (ours, key)
    trainer.train()
    assert "resuming from" in capsys.readouterr().out
    saved = torch.load(out / "ckpt.pt", weights_only=True)  # now in this repository's format
    assert saved["iter_num"] == 12 and "model_config" in saved and "model_args" not in saved
    ckpt = checkpoint.load(out / "ckpt.pt")
    assert ckpt.iter_num == 12 and ckpt.data_meta.same_tokens(meta.read(char_data / "tiny"))


@pytest.mark.parametrize("spoil, message", [
    (lambda c: c["model_args"].update(use_rmsnorm=True), "settings nanoGPT's GPT does not"),
    (lambda c: c["model_args"].pop("n_embd"), "model_args must hold"),
    (lambda c: c["model"].update({"_orig_mod.lm_head.weight": torch.zeros(96, 32)}), "lm_head"),
    (lambda c: c["model"].update({"_orig_mod.transformer.h.0.mlp.gate.weight": torch.zeros(1)}), "mlp.gate"),
])
def test_modified_nanogpt_checkpoints_are_refused(tmp_path, spoil, message):
    write_nanogpt_ckpt(random_model(96), tmp_path / "out")
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    spoil(ckpt)
    torch.save(ckpt, tmp_path / "out" / "ckpt.pt")
    with pytest.raises(UserError, match=message):
        checkpoint.load(tmp_path / "out" / "ckpt.pt")
