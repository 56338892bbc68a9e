"""End to end: prepare -> train -> checkpoint -> sample, evaluation mode, --help of every script."""

import itertools
import os
import re
import types
from dataclasses import fields

import pytest
import torch

from conftest import ROOT, make_corpus, run_in_process, tiny_train_args, train
from machinery import configurator
import sample
from train import TrainConfig, Trainer

SEPARATOR = "---------------\n"


def iter_numbers(stdout):
    return [int(n) for n in re.findall(r"^iter (\d+): loss", stdout, flags=re.M)]


@pytest.fixture(scope="module")
def trained(module_data):
    """A checkpoint of 20 iterations on the tiny character corpus; returns (out_dir, training log)."""
    out = module_data.parent / "out"
    proc = train(*tiny_train_args(module_data, out))
    return out, proc.stdout


def test_training_logs_and_checkpoint_contents(trained):
    out, stdout = trained
    assert iter_numbers(stdout) == list(range(1, 21))
    assert re.search(r"^parameters: [\d.]+M; device cpu \((AMX|AVX-512 BF16|AVX-512|AVX2|other) kind, dtype auto = "
                     r"(bfloat16|float32)\b.*; \d+ threads\), dtype (float32|bfloat16)$", stdout, flags=re.M)
    assert re.search(r"^step 0: train loss \d+\.\d{4}, val loss \d+\.\d{4}$", stdout, flags=re.M)
    assert re.search(r"^step 20: train loss \d+\.\d{4}, val loss \d+\.\d{4}$", stdout, flags=re.M)
    assert re.search(r"^iter 20: loss \d+\.\d{4}, time \d+\.\d{2}ms, tok/s [\d,]+$", stdout, flags=re.M)
    losses = [float(v) for v in re.findall(r"val loss (\S+)", stdout)]
    assert losses[-1] < losses[0]  # it learned something

    # the file read by hand: plain data only (weights_only), the keys README promises
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scaler", "ranks", "model_config", "train_config", "iter_num", "best_val_loss",
            "meta", "wandb_run_id"} <= set(ckpt)
    assert ckpt["iter_num"] == 20
    assert ckpt["best_val_loss"] == pytest.approx(losses[-1], abs=1e-4)
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert ckpt["model_config"]["n_layer"] == 2 and ckpt["train_config"]["max_iters"] == 20
    assert ckpt["meta"]["tokenizer"] == "char" and ckpt["meta"]["chars"] == "".join(sorted(set(make_corpus())))
    best = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    assert best["iter_num"] == 20 and "optimizer" not in best


def test_sample_decodes_with_the_checkpoint_tokenizer(trained):
    out, _ = trained
    proc = run_in_process(sample.main, f"--out_dir={out}", "--num_samples=3", "--max_new_tokens=40",
                          "--device=cpu", "--start=ROMEO:", check=True)
    samples = proc.stdout.split(SEPARATOR)
    assert samples[-1] == "" and len(samples) == 4
    corpus_chars = set(make_corpus())
    for text in samples[:3]:
        assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40 + 1  # print's newline
        assert set(text) <= corpus_chars

    # greedy decoding: the checkpoint's weights (read by hand) and the corpus's sorted characters
    state = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(**state["model_config"])).eval()
    model.load_state_dict(state["model"], strict=False)
    chars = sorted(set(make_corpus()))
    ids = model.generate(torch.tensor([[chars.index(c) for c in "ROMEO:"]]), 40, temperature=0)[0].tolist()
    greedy = run_in_process(sample.main, f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=40",
                            "--device=cpu", "--dtype=float32", "--start=ROMEO:", "--temperature=0", check=True)
    assert greedy.stdout == "".join(chars[i] for i in ids) + "\n" + SEPARATOR


def test_evaluation_runs_in_eval_mode_and_restores_train_mode(tmp_path, char_data):
    args = tiny_train_args(char_data, tmp_path / "out", dropout=0.5)
    trainer = Trainer(configurator.parse(TrainConfig, args))
    model = trainer.raw_model
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, _: seen.append(m.training)) for m in model.modules()]
    model.train()
    batches = trainer.train_sampler.generator.get_state()  # evaluation draws from the training stream
    first = trainer.estimate_loss()
    assert seen and not any(seen)  # every module ran in eval mode
    assert all(m.training for m in model.modules())  # and train mode is back
    for h in hooks:
        h.remove()
    # dropout is 0.5 but off during evaluation: the same batches again give the same numbers
    trainer.train_sampler.generator.set_state(batches)
    assert trainer.estimate_loss() == first
    x, y = trainer.train_sampler.next()
    assert model(x, y)[1].item() != model(x, y)[1].item()  # dropout is active again in train mode


def test_a_log_lines_time_is_the_mean_since_the_last_line(tmp_path, char_data, monkeypatch):
    # train.py's clock, stood in for by one that moves 1 s each reading: reading it at each line (and after an
    # evaluation) alone, a line 4 iterations after the last says 1 s / 4. A captured CUDA step runs ahead of the host,
    # so a clock read at every step measured the host's launches (0.4 ms where the device took 11 on an H200).
    import train as train_script

    monkeypatch.setattr(train_script, "time", types.SimpleNamespace(time=itertools.count().__next__))
    stdout = train(*tiny_train_args(char_data, tmp_path / "out", max_iters=8, log_interval=4,
                                    eval_interval=100)).stdout
    assert re.findall(r"^iter (\d+): loss \S+, time (\S+)ms, tok/s (\S+)$", stdout, re.M) == \
        [("4", "250.00", "512"), ("8", "250.00", "512")]  # 4 x 32 tokens an iteration, in 0.25 s


def root_scripts():
    return sorted(p.name for p in ROOT.glob("*.py") if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8"))


def test_the_scripts_are_found():
    assert {"prepare.py", "train.py", "sample.py", "export.py", "bench.py"} <= set(root_scripts())


@pytest.mark.parametrize("script", root_scripts())
def test_every_script_answers_help_and_writes_nothing(tmp_path, monkeypatch, script):
    import importlib

    monkeypatch.chdir(tmp_path)
    proc = run_in_process(importlib.import_module(script[:-3]).main, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
    assert os.listdir(tmp_path) == []  # --help writes nothing
    if script == "train.py":
        for f in fields(TrainConfig):
            assert f"--{f.name}=" in proc.stdout
