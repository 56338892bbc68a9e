"""Datasets from elsewhere, through the scripts: llm.c shards and nanoGPT's meta.pkl. Bad data stops
before the first step with one line (exit 2) and nothing written."""

import json
import os
import pickle

import numpy as np
import pytest

from conftest import assert_one_error_line, run_in_process, tiny_train_args
import prepare
import sample
from test_nanogpt_import import random_model, write_nanogpt_ckpt
import train


def write_shard(path, tokens, magic=20240520, version=1, count=None):
    """llm.c's format, written by hand: 256 int32 (magic, version, number of tokens, zeros), uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


def files_under(*dirs):
    return sorted(str(p) for d in dirs if d.exists() for p in d.rglob("*"))


@pytest.fixture
def shard_data(tmp_path):
    """A directory of good shards (ids < 65), without meta.json as llm.c's come: GPT-2 BPE, vocab_size 50304."""
    d = tmp_path / "shards"
    d.mkdir()
    rng = np.random.default_rng(0)
    write_shard(d / "x_val_000000.bin", rng.integers(0, 65, 500))
    write_shard(d / "x_train_000001.bin", rng.integers(0, 65, 3000))
    return d


def shard_train_args(tmp_path, shard_dir, **overrides):
    return tiny_train_args(tmp_path, tmp_path / "out", dataset=shard_dir, max_iters=2, **overrides)


@pytest.mark.parametrize("damage, words", [
    ("id_beyond_vocabulary", ["x_train_000001.bin holds token id 60000 at position 1234", "vocabulary of 50304"]),
    ("bad_magic", ["x_train_000001.bin is not a token shard (magic 12345"]),
    ("bad_version", ["x_train_000001.bin has shard version 2"]),
    ("truncated", ["x_train_000001.bin is", "header announces 3000 tokens"]),
])
def test_bad_shards_stop_before_the_first_step(tmp_path, shard_data, damage, words):
    path, tokens = shard_data / "x_train_000001.bin", np.random.default_rng(1).integers(0, 65, 3000)
    if damage == "id_beyond_vocabulary":
        tokens[1234] = 60000
        write_shard(path, tokens)
    elif damage == "truncated":
        write_shard(path, tokens)
        path.write_bytes(path.read_bytes()[:-100])
    else:
        write_shard(path, tokens, **{"magic" if damage == "bad_magic" else "version": 12345 if damage ==
                                     "bad_magic" else 2})
    before = files_under(shard_data)
    proc = run_in_process(train.main, *shard_train_args(tmp_path, shard_data))
    assert_one_error_line(proc, *words)
    assert files_under(shard_data) == before and not (tmp_path / "out").exists()


def test_a_recorded_largest_id_beyond_the_vocabulary_stops_naming_meta_json(tmp_path, char_data):
    meta_path = char_data / "tiny" / "meta.json"
    meta = json.loads(meta_path.read_text())
    ids = np.fromfile(char_data / "tiny" / "train.bin", dtype=np.uint16)
    assert meta["max_token_id"] == ids.max() == meta["vocab_size"] - 1 == 52  # recorded by prepare.py
    meta["max_token_id"] = 70  # a dataset whose ids go beyond the model's 53
    meta_path.write_text(json.dumps(meta))
    proc = run_in_process(train.main, *tiny_train_args(char_data, tmp_path / "out2"))
    assert_one_error_line(proc, "meta.json records token id 70", "vocabulary of 53")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("how", ["train.bin rewritten after prepare.py", "meta.json copied from another dataset"])
def test_ids_beyond_the_vocabulary_that_meta_json_does_not_know_stop_naming_the_file(tmp_path, char_data, how):
    """meta.json's max_token_id speaks only for the files it was written with: a train.bin made by hand
    afterwards (same size, ids up to 60) or a meta.json taken from another dataset does not describe these
    files, so the files themselves are read, and the first id beyond the model's 53 stops the run."""
    tiny = char_data / "tiny"
    ids = np.fromfile(tiny / "train.bin", dtype=np.uint16)
    bad = ids.copy()
    bad[777] = 60
    if how.startswith("train.bin"):
        (tiny / "train.bin").write_bytes(bad.astype("<u2").tobytes())
    else:  # another dataset, prepared with the same vocabulary, whose meta.json is copied over this one's
        other = tmp_path / "other"
        other.mkdir()
        (other / "train.bin").write_bytes(ids[:-1].astype("<u2").tobytes())
        (other / "val.bin").write_bytes((tiny / "val.bin").read_bytes())
        meta = json.loads((tiny / "meta.json").read_text())
        from machinery.data import meta as meta_module

        meta_module.write(meta_module.DatasetMeta(**meta), other)
        (tiny / "train.bin").write_bytes(bad.astype("<u2").tobytes())
        (tiny / "meta.json").write_bytes((other / "meta.json").read_bytes())
    assert json.loads((tiny / "meta.json").read_text())["max_token_id"] == 52  # it says nothing of id 60
    before = files_under(char_data)
    proc = run_in_process(train.main, *tiny_train_args(char_data, tmp_path / "out"))
    assert_one_error_line(proc, f"{tiny / 'train.bin'} holds token id 60 at position 777", "vocabulary of 53")
    assert files_under(char_data) == before and not (tmp_path / "out").exists()


def test_meta_json_describes_the_files_prepare_wrote_and_no_others(tmp_path, char_data):
    from machinery.data import meta

    tiny = char_data / "tiny"
    recorded = meta.read(tiny)
    stat = {name: os.stat(tiny / name) for name in ("train.bin", "val.bin")}
    assert recorded.files == {name: [st.st_size, st.st_mtime_ns] for name, st in stat.items()}
    assert recorded.describes(tiny)
    # so training trusts its max_token_id and reads no token to check them
    proc = run_in_process(train.main, *tiny_train_args(char_data, tmp_path / "out", max_iters=1), check=True)
    assert "checked every token id" not in proc.stdout
    os.utime(tiny / "val.bin", ns=(stat["val.bin"].st_atime_ns, stat["val.bin"].st_mtime_ns + 1))
    assert not recorded.describes(tiny)  # touched since: the same bytes, perhaps, but not known to be
    os.utime(tiny / "val.bin", ns=(stat["val.bin"].st_atime_ns, stat["val.bin"].st_mtime_ns))
    (tiny / "extra_train_000001.bin").write_bytes(b"")
    assert not recorded.describes(tiny)  # a token file it does not know
    (tiny / "extra_train_000001.bin").unlink()
    assert recorded.describes(tiny)
    proc = run_in_process(train.main, *tiny_train_args(char_data, tmp_path / "out2", max_iters=1), check=True)
    assert "checked every token id" not in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["text", "--input", "{tmp}/in.txt", "--name", "../x"], ["--name '../x' must be a plain name"]),
    (["text", "--input", "{tmp}/in.txt", "--name", "a/b"], ["--name 'a/b' must be a plain name"]),
    (["fineweb_edu", "--input", "{tmp}/empty", "--name", "fw"], ["empty"]),
])
def test_prepare_refuses_paths_as_names_and_empty_inputs(tmp_path, args, words):
    (tmp_path / "in.txt").write_text("some text\n" * 100)
    (tmp_path / "empty").mkdir()
    before = files_under(tmp_path)
    proc = run_in_process(prepare.main, *[a.format(tmp=tmp_path) for a in args], "--data_dir", tmp_path / "data")
    assert_one_error_line(proc, *words)
    assert files_under(tmp_path) == before  # nothing written, inside data_dir or outside it


NANOGPT_CHARS = sorted(set("ROMEO:\nJuliet, the king! abcdefgho"))


def nanogpt_out_dir(tmp_path, meta_pkl_bytes):
    """nanoGPT's layout: out/ckpt.pt naming dataset `shakespeare_char`, data/shakespeare_char/meta.pkl."""
    write_nanogpt_ckpt(random_model(len(NANOGPT_CHARS)), tmp_path / "out", dataset="shakespeare_char")
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare_char" / "meta.pkl").write_bytes(meta_pkl_bytes)


def test_nanogpt_out_dir_with_its_meta_pkl_samples_with_no_flags(tmp_path, monkeypatch):
    # what nanoGPT's data/shakespeare_char/prepare.py pickles
    meta = {"vocab_size": len(NANOGPT_CHARS), "itos": dict(enumerate(NANOGPT_CHARS)),
            "stoi": {c: i for i, c in enumerate(NANOGPT_CHARS)}}
    nanogpt_out_dir(tmp_path, pickle.dumps(meta))
    monkeypatch.chdir(tmp_path)  # nanoGPT's sample.py looks in data/<dataset>/ from where it runs
    proc = run_in_process(sample.main, "--out_dir=out", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=30",
                          "--device=cpu", check=True)
    assert "data/shakespeare_char/meta.pkl" in proc.stderr
    samples = proc.stdout.split("---------------\n")[:2]
    assert all(s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 30 + 1 and set(s) <= set(NANOGPT_CHARS) | {"\n"}
               for s in samples), proc.stdout


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_meta_pkl_that_would_run_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    nanogpt_out_dir(tmp_path, pickle.dumps({"vocab_size": len(NANOGPT_CHARS), "itos": RunsCode(marker)}))
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(sample.main, "--out_dir=out", "--device=cpu", "--max_new_tokens=5")
    assert_one_error_line(proc, "refusing to load data/shakespeare_char/meta.pkl", "system")
    assert not marker.exists()
