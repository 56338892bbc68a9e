"""End to end: prepare -> train -> checkpoint -> sample, resume, evaluation mode, wandb offline, --help."""

import re
from dataclasses import fields

import pytest
import torch

import checkpoint
import configurator
from conftest import ROOT, make_corpus, run, tiny_train_args
from tokenizer import from_meta
from train import TrainConfig, Trainer

SEPARATOR = "---------------\n"


def iter_numbers(stdout):
    return [int(n) for n in re.findall(r"^iter (\d+): loss", stdout, flags=re.M)]


def iter_losses(stdout):
    return dict((int(i), loss) for i, loss in re.findall(r"^iter (\d+): loss (\S+),", stdout, flags=re.M))


@pytest.fixture
def trained(tmp_path, char_data):
    """A checkpoint of 20 iterations on the tiny character corpus; returns (out_dir, stdout)."""
    out = tmp_path / "out"
    proc = run("train.py", *tiny_train_args(char_data, out), check=True)
    return out, proc.stdout


def test_training_logs_and_checkpoint_contents(trained):
    out, stdout = trained
    assert iter_numbers(stdout) == list(range(1, 21))
    assert re.search(r"^step 0: train loss \d+\.\d{4}, val loss \d+\.\d{4}$", stdout, flags=re.M)
    assert re.search(r"^step 20: train loss \d+\.\d{4}, val loss \d+\.\d{4}$", stdout, flags=re.M)
    assert re.search(r"^iter 20: loss \d+\.\d{4}, time \d+\.\d{2}ms, tok/s [\d,]+$", stdout, flags=re.M)
    losses = [float(v) for v in re.findall(r"val loss (\S+)", stdout)]
    assert losses[-1] < losses[0]  # it learned something

    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)  # no pickled objects
    assert {"model", "optimizer", "model_config", "train_config", "iter_num", "best_val_loss",
            "tokenizer"} <= set(ckpt)
    assert ckpt["iter_num"] == 20
    assert ckpt["best_val_loss"] == pytest.approx(losses[-1], abs=1e-4)
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert ckpt["model_config"]["n_layer"] == 2 and ckpt["train_config"]["max_iters"] == 20
    assert ckpt["tokenizer"]["tokenizer"] == "char" and ckpt["tokenizer"]["chars"] == "".join(sorted(set(make_corpus())))
    best = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    assert best["iter_num"] == 20 and "optimizer" not in best


def test_sample_decodes_with_the_checkpoint_tokenizer(trained):
    out, _ = trained
    proc = run("sample.py", f"--out_dir={out}", "--num_samples=3", "--max_new_tokens=40", "--device=cpu",
               "--start=ROMEO:", check=True)
    samples = proc.stdout.split(SEPARATOR)
    assert samples[-1] == "" and len(samples) == 4
    corpus_chars = set(make_corpus())
    for sample in samples[:3]:
        assert sample.startswith("ROMEO:") and len(sample) == len("ROMEO:") + 40 + 1  # print's newline
        assert set(sample) <= corpus_chars

    # greedy decoding: exactly what the checkpoint's model and tokenizer give in this process
    ckpt = checkpoint.load(str(out / checkpoint.BEST))
    model, tok = checkpoint.build_model(ckpt).eval(), from_meta(ckpt["tokenizer"])
    ids = model.generate(torch.tensor([tok.encode("ROMEO:")]), 40, temperature=0)[0].tolist()
    greedy = run("sample.py", f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=40", "--device=cpu",
                 "--start=ROMEO:", "--temperature=0", check=True)
    assert greedy.stdout == tok.decode(ids) + "\n" + SEPARATOR


def test_resume_continues_from_the_saved_iteration(tmp_path, char_data):
    """10 iterations, then resume to 20: the resumed run logs iterations 11..20 with exactly the
    losses of an uninterrupted 20-iteration run (same batches, same optimizer state)."""
    full = run("train.py", *tiny_train_args(char_data, tmp_path / "full"), check=True)
    part = tmp_path / "part"
    first = run("train.py", *tiny_train_args(char_data, part, max_iters=10), check=True)
    assert iter_numbers(first.stdout) == list(range(1, 11))
    assert torch.load(part / "ckpt.pt", weights_only=True)["iter_num"] == 10

    resumed = run("train.py", *tiny_train_args(char_data, part, init_from="resume"), check=True)
    assert f"resuming from {part}/ckpt.pt at iteration 10" in resumed.stdout
    assert iter_numbers(resumed.stdout) == list(range(11, 21))
    assert "step 0:" not in resumed.stdout
    assert torch.load(part / "ckpt.pt", weights_only=True)["iter_num"] == 20
    expected = {i: loss for i, loss in iter_losses(full.stdout).items() if i > 10}
    assert iter_losses(resumed.stdout) == expected


def test_resume_refuses_a_different_model(tmp_path, trained, char_data):
    out, _ = trained
    proc = run("train.py", *tiny_train_args(char_data, out, init_from="resume", n_layer=3, max_iters=30))
    assert proc.returncode == 2 and "n_layer" in proc.stderr and "Traceback" not in proc.stderr


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


def test_wandb_offline(tmp_path, char_data, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)  # runs go to ./wandb
    proc = run("train.py", *tiny_train_args(char_data, tmp_path / "out", max_iters=4, eval_interval=2),
               "--wandb_log=True", "--wandb_project=test", "--wandb_run_name=tiny", cwd=tmp_path,
               env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir()) if (tmp_path / "wandb").exists() else None
    assert list(runs[0].glob("*.wandb"))  # the run's log, to sync later with `wandb sync`
    # the run id is kept in the checkpoint, so that a resumed run continues the same wandb run
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["wandb_run_id"] and runs[0].name.endswith(ckpt["wandb_run_id"])


def root_scripts():
    return sorted(p.name for p in ROOT.glob("*.py") if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8"))


def test_the_scripts_are_found():
    assert {"prepare.py", "train.py", "sample.py"} <= set(root_scripts())


@pytest.mark.parametrize("script", root_scripts())
def test_every_script_answers_help(tmp_path, script):
    proc = run(script, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # --help writes nothing
    if script == "train.py":
        for f in fields(TrainConfig):
            assert f"--{f.name}=" in proc.stdout
