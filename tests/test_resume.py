"""Exact resume: N iterations, then resume for N more, gives bit for bit what 2N iterations straight give."""

import json
import re
import shutil

import torch

import conftest
from conftest import assert_one_error_line, load_checkpoint, tiny_train_args, train
from machinery.configurator import parse
import train as train_script

N = 6



def logged_losses(stdout):
    """{'iter 3': '3.1234', 'step 4': 'train loss 3.2, val loss 3.3'} from the training log."""
    out = {f"iter {m[1]}": m[2] for m in re.finditer(r"^iter (\d+): loss ([^,]+),", stdout, re.M)}
    out.update({f"step {m[1]}": m[2] for m in re.finditer(r"^step (\d+): (train loss .*)$", stdout, re.M)})
    return out


def assert_same(a, b, where):
    """Exact equality of nested checkpoint data; tensors with torch.equal and the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_n_then_resume_n_equals_2n_straight(tmp_path, char_data):
    # dropout > 0 and 2 micro-steps, so dropout's RNG and the prefetched batch both have to be restored;
    # evaluations every 4 iterations, and the split run evaluates once more (at N, its end), so
    # evaluation must not disturb the training stream either
    def args(out, **kw):
        return tiny_train_args(char_data, tmp_path / out, dropout=0.2, gradient_accumulation_steps=2,
                               eval_interval=4, ckpt_interval=3, warmup_iters=2, lr_decay_iters=2 * N, **kw)

    straight = train(*args("straight", max_iters=2 * N))
    first = train(*args("split", max_iters=N))
    assert load_checkpoint(tmp_path / "split" / "ckpt.pt")["iter_num"] == N
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "ckpt.pt").write_bytes((tmp_path / "split" / "ckpt.pt").read_bytes())
    resumed = train(*args("split", max_iters=2 * N, init_from="resume"))
    assert f"resuming from {tmp_path / 'split'}/ckpt.pt at iteration {N}" in resumed.stdout

    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 2 * N
    assert a["optimizer"]["state"] and all(s["exp_avg"].any() for s in a["optimizer"]["state"].values())
    for key in ("model", "optimizer", "ranks", "scaler"):
        assert_same(a[key], b[key], key)

    # identical logged losses: every line of the straight run, to the printed digit
    straight_log = logged_losses(straight.stdout)
    split_log = {**logged_losses(first.stdout), **logged_losses(resumed.stdout)}
    assert set(straight_log) == {f"iter {i}" for i in range(1, 2 * N + 1)} | {"step 0", "step 4", "step 8", "step 12"}
    assert set(split_log) == set(straight_log) | {f"step {N}"}
    assert {k: split_log[k] for k in straight_log} == straight_log

    # metrics.jsonl: every step once, with the straight run's numbers (the split run also evaluated at N, its
    # end; tokens/s is a timing)
    def records(out):
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]

    split_records = records("split")
    assert [r for r in split_records if r["step"] != N or "loss" in r] == records("straight")
    assert [r["step"] for r in split_records if "val_loss" in r] == [0, 4, N, 8, 12]

    # control, so that the comparison above can fail: the same checkpoint with another dropout RNG
    # state resumes into different weights
    ckpt = load_checkpoint(tmp_path / "control" / "ckpt.pt")
    ckpt["ranks"][0]["rng"]["torch"] = torch.Generator().manual_seed(1).get_state()
    torch.save(ckpt, tmp_path / "control" / "ckpt.pt")
    train(*args("control", max_iters=2 * N, init_from="resume"))
    c = load_checkpoint(tmp_path / "control" / "ckpt.pt")
    assert not torch.equal(c["model"]["tok_emb.weight"], a["model"]["tok_emb.weight"])


def test_muon_resumes_exactly_and_refuses_another_optimizer(tmp_path, char_data):
    def args(out, **kw):
        return tiny_train_args(char_data, tmp_path / out, optimizer="muon", muon_lr=0.05, muon_momentum=0.9,
                               muon_momentum_warmup=N + 2, gradient_accumulation_steps=2, eval_interval=100, ckpt_interval=0,
                               lr_decay_iters=2 * N, **kw)

    train(*args("straight", max_iters=2 * N))
    train(*args("split", max_iters=N))
    refused = train(*args("split", max_iters=2 * N, init_from="resume"), "--optimizer=adamw", check=False)
    assert_one_error_line(refused, "optimizer=muon", "--optimizer=muon")
    train(*args("split", max_iters=2 * N, init_from="resume"))
    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    muon_state = a["optimizer"]["state"]["blocks.1.ffwd.fc.weight"]
    assert muon_state["momentum_buffer"].any() and muon_state["step"].item() == 2 * N
    assert [g["use_muon"] for g in a["optimizer"]["param_groups"]] == [True, False, False]
    assert a["optimizer"]["param_groups"][0]["momentum"] == 0.9
    for key in ("model", "optimizer", "ranks"):
        assert_same(a[key], b[key], key)


def test_wandb_offline_and_a_resumed_run_continues_the_wandb_run(tmp_path, char_data, monkeypatch):
    """wandb needs no login (offline mode); the run id goes into the checkpoint, and a resumed run
    continues the same wandb run."""
    out, wandb_dir = tmp_path / "out", tmp_path / "wandb"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(*tiny_train_args(char_data, out, max_iters=3, wandb_log=True, wandb_project="test"))
    run_id = load_checkpoint(out / "ckpt.pt")["wandb_run_id"]
    assert isinstance(run_id, str) and run_id
    train(*tiny_train_args(char_data, out, max_iters=5, wandb_log=True, wandb_project="test", init_from="resume"))
    assert load_checkpoint(out / "ckpt.pt")["wandb_run_id"] == run_id
    # wandb names each (offline) run's directory after its start time and the run id (with "-1" added when both
    # started within the same second): both runs wrote to the same id
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", run.name) for run in runs), runs
    assert all(list(run.glob("*.wandb")) for run in runs)  # each run's log, to sync later with `wandb sync`


# ---------------------------------------------------------------------- resuming a GPT-2 finetune

M = 2  # finetuning steps before the interruption


def finetune_args(init_from, data_dir, out_dir, **overrides):
    """conftest's finetune with this module's sizes: M steps of 2 micro-batches, evaluated (and saved) at M."""
    small = dict(block_size=16, gradient_accumulation_steps=2, max_iters=M, eval_interval=M, eval_iters=1,
                 learning_rate=1e-3)
    return conftest.finetune_args(init_from, data_dir, out_dir, **(small | overrides))


def resume_args(data_dir, out_dir, **overrides):
    """The same command with --init_from=resume, as a user resumes a GPT-2 finetune: no model sizes (the
    checkpoint's 2 layers, not the defaults' 12, are what resumes) and gelu at its default, auto (the model's
    own)."""
    return finetune_args("resume", data_dir, out_dir, **overrides)


def test_gpt2_finetune_resumes_exactly_with_its_tanh_gelu(tmp_path, hf_dir, bpe_data):
    path, _ = hf_dir
    straight = train(*finetune_args(path, bpe_data, tmp_path / "straight", max_iters=2 * M))
    first = train(*finetune_args(path, bpe_data, tmp_path / "split", max_iters=M))
    split = load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert split["iter_num"] == M and split["model_config"]["gelu"] == "tanh"  # GPT-2's activation (gelu_new)
    (tmp_path / "control").mkdir()
    shutil.copy(tmp_path / "split" / "ckpt.pt", tmp_path / "control" / "ckpt.pt")
    resumed = train(*resume_args(bpe_data, tmp_path / "split", max_iters=2 * M))
    assert f"resuming from {tmp_path / 'split'}/ckpt.pt at iteration {M}" in resumed.stdout

    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 2 * M
    assert b["model_config"] == a["model_config"] and b["model_config"]["gelu"] == "tanh"
    for key in ("model", "optimizer", "ranks"):
        assert_same(a[key], b[key], key)
    straight_log = logged_losses(straight.stdout)
    split_log = {**logged_losses(first.stdout), **logged_losses(resumed.stdout)}
    assert set(straight_log) == {f"iter {i}" for i in range(1, 2 * M + 1)} | {f"step {i}" for i in (0, M, 2 * M)}
    assert {k: split_log[k] for k in straight_log} == straight_log

    # control, so that the comparison can tell the GELUs apart: the same checkpoint saying gelu "none" resumes
    # (gelu is left to the checkpoint when the settings do not give it) into other weights
    ckpt = load_checkpoint(tmp_path / "control" / "ckpt.pt")
    ckpt["model_config"]["gelu"] = "none"
    torch.save(ckpt, tmp_path / "control" / "ckpt.pt")
    train(*resume_args(bpe_data, tmp_path / "control", max_iters=2 * M))
    c = load_checkpoint(tmp_path / "control" / "ckpt.pt")
    assert not torch.equal(c["model"]["tok_emb.weight"], a["model"]["tok_emb.weight"])


def test_gpt2_finetune_resumes_with_another_dropout_but_not_another_n_layer(tmp_path, hf_dir, bpe_data):
    out, control, inspected = tmp_path / "out", tmp_path / "control", tmp_path / "inspected"
    train(*finetune_args(hf_dir[0], bpe_data, out))
    saved = (out / "ckpt.pt").read_bytes()
    refused = train(*resume_args(bpe_data, out, max_iters=M + 1, n_layer=1), check=False)
    assert_one_error_line(refused, "n_layer=2", "asks for 1")
    # gelu left out takes the checkpoint's (tanh); given, it must be the checkpoint's
    refused = train(*resume_args(bpe_data, out, max_iters=M + 1, gelu="none"), check=False)
    assert_one_error_line(refused, "gelu=tanh", "asks for none")
    assert (out / "ckpt.pt").read_bytes() == saved
    for copy in (control, inspected):
        copy.mkdir()
        (copy / "ckpt.pt").write_bytes(saved)

    # the resumed model has dropout 0.1 in every dropout layer (and attention), and GPT-2's GELU (a Trainer of
    # its own out_dir: the Trainer claims it)
    cfg = parse(train_script.TrainConfig, resume_args(bpe_data, inspected, max_iters=M + 1, dropout=0.1))
    cfg.validate()
    assert cfg.gelu == "auto"  # as the user left it
    model = train_script.Trainer(cfg).raw_model
    assert model.config.dropout == 0.1 and model.config.gelu == "tanh"
    assert cfg.gelu == "tanh" and cfg.dropout == 0.1  # the settings it records now say what it trains
    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.1] * (1 + 2 * 2)  # the embeddings', and 2 in each of the 2 blocks
    assert [block.attn.heads.dropout for block in model.blocks] == [0.1, 0.1]
    assert all(block.ffwd.gelu.approximate == "tanh" for block in model.blocks)

    with_dropout = train(*resume_args(bpe_data, out, max_iters=M + 1, dropout=0.1))
    without = train(*resume_args(bpe_data, control, max_iters=M + 1))  # dropout 0, as it was finetuned
    assert "resuming from" in with_dropout.stdout
    a, b = logged_losses(with_dropout.stdout), logged_losses(without.stdout)
    # the same weights and batches: the same evaluation at the resumed step (dropout is off there), another
    # training loss at the first resumed step (dropout is on there)
    assert a[f"step {M}"] == b[f"step {M}"] and a[f"iter {M + 1}"] != b[f"iter {M + 1}"]
    with_ckpt, without_ckpt = load_checkpoint(out / "ckpt.pt"), load_checkpoint(control / "ckpt.pt")
    assert with_ckpt["model_config"]["dropout"] == 0.1 and without_ckpt["model_config"]["dropout"] == 0.0
    assert with_ckpt["model_config"]["gelu"] == "tanh"
    assert not torch.equal(with_ckpt["model"]["tok_emb.weight"], without_ckpt["model"]["tok_emb.weight"])
