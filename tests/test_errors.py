"""Bad input: one line `error: ...` naming the problem and the fix, exit status 2, no traceback,
and nothing already in out_dir or the data directory changed."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, assert_one_error_line, make_corpus, run, run_in_process, tiny_train_args, train as train_in_process
import prepare
import sample
import train


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Datasets (tiny; short: too few tokens; wide: more characters; other: as many, but different ones)
    and a trained out_dir, made once; each test works on its own copy."""
    root = tmp_path_factory.mktemp("world")
    text = make_corpus()
    for name, corpus in (("tiny", text), ("short", "to be or not to be\n"),
                         ("wide", text + "0123456789\n"), ("other", text.replace("?", "#"))):
        (root / f"{name}.txt").write_text(corpus, encoding="utf-8")
        run_in_process(prepare.main, "text", "--input", root / f"{name}.txt", "--name", name,
                       "--data_dir", root / "data", check=True)
    train_in_process(*tiny_train_args(root / "data", root / "out", max_iters=4, eval_interval=2))
    (root / "out" / "notes.txt").write_text("the user's own file\n")
    return root


@pytest.fixture
def copy(world, tmp_path):
    shutil.copytree(world / "data", tmp_path / "data")
    shutil.copytree(world / "out", tmp_path / "out")
    return tmp_path


def snapshot(*dirs):
    """Every file under dirs with its bytes and modification time."""
    files = {}
    for d in dirs:
        for parent, _, names in os.walk(d):
            for name in names:
                path = os.path.join(parent, name)
                with open(path, "rb") as f:
                    files[path] = (f.read(), os.stat(path).st_mtime_ns)
    return files


def half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# id: (change to the copied files, train.py settings over tiny_train_args, words the error must contain)
TRAIN_CASES = {
    "dataset_dir_missing": (None, {"dataset": "nope"}, ["dataset directory", "nope", "prepare.py"]),
    "bin_missing": (lambda t: (t / "data" / "tiny" / "val.bin").unlink(), {}, ["val.bin is missing", "prepare.py"]),
    "dataset_too_short": (None, {"dataset": "short"}, ["fewer than block_size + 1 = 33", "--block_size"]),
    "checkpoint_missing": (lambda t: [(t / "out" / f).unlink() for f in ("ckpt.pt", "best.pt")],
                           {"init_from": "resume"}, ["ckpt.pt not found"]),
    "checkpoint_truncated": (lambda t: half(t / "out" / "ckpt.pt"), {"init_from": "resume"},
                             ["ckpt.pt is truncated or corrupt"]),
    "checkpoint_corrupt": (lambda t: (t / "out" / "ckpt.pt").write_bytes(os.urandom(5000)), {"init_from": "resume"},
                           ["ckpt.pt is truncated or corrupt"]),
    "resume_other_model_shape": (None, {"init_from": "resume", "n_layer": 3},
                                 ["n_layer=2 but the config asks for 3", "same model settings"]),
    "resume_other_attention": (None, {"init_from": "resume", "qk_norm": True},
                               ["qk_norm=False but the config asks for True", "same model settings"]),
    "resume_other_mlp_width": (None, {"init_from": "resume", "mlp_ratio": 3},
                               ["mlp_ratio=4 but the config asks for 3", "same model settings"]),
    "resume_larger_vocabulary": (None, {"init_from": "resume", "dataset": "wide"},
                                 ["vocab_size=53 but dataset wide needs 63", "dataset it was trained on"]),
    "resume_other_characters": (None, {"init_from": "resume", "dataset": "other"},
                                ["different character vocabulary", "dataset it was trained on"]),
    "out_dir_is_a_file": (None, {"out_dir": "{out}/notes.txt"}, ["notes.txt is a file", "--out_dir"]),
    "out_dir_not_writable": (None, {"out_dir": "{out}/notes.txt/sub"}, ["not writable", "--out_dir"]),
    "n_embd_not_divisible": (None, {"n_embd": 30, "n_head": 4}, ["n_embd (30) must be divisible by n_head (4)"]),
    "batch_size_zero": (None, {"batch_size": 0}, ["batch_size must be positive, got 0"]),
    "block_size_negative": (None, {"block_size": -1}, ["block_size must be a positive integer, got -1"]),
    "n_layer_zero": (None, {"n_layer": 0}, ["n_layer must be a positive integer, got 0"]),
    "mlp_ratio_zero": (None, {"mlp_ratio": 0}, ["mlp_ratio must be a positive integer, got 0"]),
    "dropout_one": (None, {"dropout": 1.0}, ["dropout must be in [0, 1), got 1.0"]),
    "vocab_below_the_datasets": (None, {"vocab_size": 10}, ["vocab_size 10 is smaller than the dataset's"]),
    "resume_other_vocab_size": (None, {"init_from": "resume", "vocab_size": 70},
                                ["vocab_size=53 but the config asks for 70"]),
    "muon_ns_steps_too_many": (None, {"muon_ns_steps": 6}, ["muon_ns_steps must be one of 1, 2, 3, 4, 5, got 6"]),
    "max_iters_negative": (None, {"max_iters": -5}, ["max_iters must not be negative, got -5"]),
    "learning_rate_zero": (None, {"learning_rate": 0.0}, ["learning_rate must be positive"]),
    "learning_rate_negative": (None, {"learning_rate": -1e-3}, ["learning_rate must be positive"]),
    "unknown_device": (None, {"device": "tpu"}, ["unknown device 'tpu'", "cpu"]),
    "unknown_dtype": (None, {"dtype": "float8"}, ["unknown dtype 'float8'", "float32"]),
    "cuda_where_there_is_none": (None, {"device": "cuda"}, ["no usable CUDA GPU", "--device=cpu"]),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_bad_input(copy, capsys, case):
    change, settings, words = TRAIN_CASES[case]
    if case == "cuda_where_there_is_none" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if change:
        change(copy)
    settings = {k: v.format(out=copy / "out") if isinstance(v, str) else v for k, v in settings.items()}
    out_dir = settings.pop("out_dir", copy / "out")
    before = snapshot(copy / "data", copy / "out")
    proc = run_in_process(train.main, *tiny_train_args(copy / "data", out_dir, **settings))
    assert_one_error_line(proc, *words)
    assert snapshot(copy / "data", copy / "out") == before


@pytest.mark.parametrize("content, words", [
    (b"", ["is empty"]),
    ("ROMEO: café\n".encode("latin-1"), ["is not UTF-8 text (bad byte at offset 10)", "convert it to UTF-8"]),
])
def test_prepare_bad_input_file(copy, content, words):
    (copy / "input.txt").write_bytes(content)
    before = snapshot(copy / "data")
    # the output name is an existing dataset: it must survive the failed run
    proc = run_in_process(prepare.main, "text", "--input", copy / "input.txt", "--name", "tiny",
                          "--data_dir", copy / "data")
    assert_one_error_line(proc, *words)
    assert snapshot(copy / "data") == before


def test_sample_prompt_outside_the_vocabulary(copy):
    before = snapshot(copy / "out")
    proc = run_in_process(sample.main, f"--out_dir={copy / 'out'}", "--device=cpu", "--start=ROMEO: ☃ 1")
    assert_one_error_line(proc, "outside this model's character vocabulary", "'1' '☃'")
    assert snapshot(copy / "out") == before


@pytest.mark.parametrize("script, args, words", [
    ("train.py", ["--dataset=nope", "--device=cpu"], ["dataset directory data/nope does not exist"]),
    ("sample.py", ["--out_dir={tmp}/out", "--device=cpu", "--start=☃"], ["outside this model's character"]),
])
def test_scripts_report_errors_the_same_way(copy, script, args, words):
    """The tests above call main() in-process; the scripts themselves, in a process of their own, exit
    with status 2 and print the same one line."""
    before = snapshot(copy / "data", copy / "out")
    proc = run(script, *[a.format(tmp=copy) for a in args], cwd=copy)
    assert_one_error_line(proc, *words)
    assert snapshot(copy / "data", copy / "out") == before


def test_a_command_that_ends_without_teardown_still_delivers_its_output_and_status():
    """sample.py's exit_without_teardown: what was printed but still in the buffers of a pipe (unflushed, no
    newline) reaches the reader, on both streams, and the status is the one given."""
    code = ("import sys; from machinery.errors import exit_without_teardown; print('out', end=''); "
            "print('err', end='', file=sys.stderr); exit_without_teardown(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (buffered, as users run it)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out", "err")
