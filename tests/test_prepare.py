"""prepare.py: exact round trips, the 90/10 split, nanoGPT's uint16 format, meta.json, and bad input."""

import builtins
import json

import numpy as np
import pytest

from conftest import assert_one_error_line, assert_one_line, make_corpus, run, run_in_process
from machinery import fileio
from machinery.data import meta as dataset_meta
from machinery.errors import UserError
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
import prepare

# Speakers and punctuation, non-ASCII (2-, 3- and 4-byte UTF-8), a CRLF line and a tab:
# a round trip must give back every byte.
TEXT = make_corpus(n_lines=120, seed=3) + "Café naïve — “quoted” 日本語 🎭\r\nTab\there.\n"


def read_tokens(path):
    return np.memmap(path, dtype=np.uint16, mode="r")


def write(path, text):
    path.write_bytes(text.encode("utf-8"))  # bytes, so that \r\n stays as written
    return path


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_round_trip_is_exact_and_split_90_10_by_characters(tmp_path, kind):
    src = write(tmp_path / "input.txt", TEXT)
    out = tmp_path / "data" / "ds"
    meta = prepare.prepare(str(src), str(out), kind)

    train, val = read_tokens(out / "train.bin"), read_tokens(out / "val.bin")
    assert dataset_meta.read(out) == meta  # what prepare returns is what meta.json holds
    tok = meta.make_tokenizer()
    train_text, val_text = tok.decode(train.tolist()), tok.decode(val.tolist())
    assert train_text + val_text == TEXT
    split_at = int(len(TEXT) * 0.9)  # characters, not bytes or tokens
    assert train_text == TEXT[:split_at] and val_text == TEXT[split_at:]
    # the files hold exactly the tokens of each part: raw uint16, no header
    assert train.tolist() == tok.encode(TEXT[:split_at]) and val.tolist() == tok.encode(TEXT[split_at:])
    assert (out / "train.bin").stat().st_size == 2 * len(train)
    assert meta.train_tokens == len(train) and meta.val_tokens == len(val)


def test_char_meta_json(tmp_path):
    src = write(tmp_path / "input.txt", TEXT)
    out = tmp_path / "ds"
    prepare.prepare(str(src), str(out), "char")
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    chars = "".join(sorted(set(TEXT)))
    assert meta["tokenizer"] == "char"
    assert meta["chars"] == chars and meta["vocab_size"] == len(chars)
    assert meta["source"] == str(src.resolve())
    # ids are positions in the sorted vocabulary, as nanoGPT's stoi
    ids = read_tokens(out / "train.bin")
    assert [chars[i] for i in ids[:50]] == list(TEXT[:50])
    assert not list(out.glob("*.pkl")) and not list(out.glob("*.tmp"))


def test_gpt2_meta_json_and_token_ids(tmp_path):
    src = write(tmp_path / "input.txt", "Hello world, hello GPT-2.\n" * 10)
    out = tmp_path / "ds"
    prepare.prepare(str(src), str(out), "gpt2")
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and "chars" not in meta
    # GPT-2's well-known ids: "Hello" = 15496, " world" = 995, "," = 11
    assert read_tokens(out / "train.bin")[:3].tolist() == [15496, 995, 11]


def test_read_in_chunks_gives_the_same_dataset(tmp_path, monkeypatch):
    """A big file is read in chunks of whole lines; the result must not depend on the chunk size."""
    src = write(tmp_path / "input.txt", TEXT)
    prepare.prepare(str(src), str(tmp_path / "whole"), "char")
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 200)  # ~30 chunks
    assert len(list(prepare.read_chunks(str(src), progress=False))) > 10
    prepare.prepare(str(src), str(tmp_path / "chunked"), "char")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes()
    # gpt2 in chunks: token boundaries may differ, the text may not
    prepare.prepare(str(src), str(tmp_path / "bpe"), "gpt2")
    tok = GPT2Tokenizer()
    text = tok.decode(read_tokens(tmp_path / "bpe" / "train.bin").tolist()) + \
        tok.decode(read_tokens(tmp_path / "bpe" / "val.bin").tolist())
    assert text == TEXT


def test_cli_text_gpt2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = write(tmp_path / "corpus.txt", TEXT)
    proc = run_in_process(prepare.main, "text", "--input", src, "--name", "mine", "--tokenizer", "gpt2")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "data" / "mine"  # the default data_dir, relative to the working directory
    tok = GPT2Tokenizer()
    assert tok.decode(read_tokens(out / "train.bin").tolist()) + tok.decode(read_tokens(out / "val.bin").tolist()) \
        == TEXT
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "gpt2"


def test_cli_shakespeare_char_with_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = write(tmp_path / "input.txt", TEXT)
    proc = run_in_process(prepare.main, "shakespeare_char", "--input", src, "--data_dir", tmp_path / "d")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "d" / "shakespeare_char" / "meta.json").read_text(encoding="utf-8"))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(set(TEXT))



@pytest.mark.parametrize("bad, says", [
    (b"", "empty"),
    (b"fine text\n" * 50 + b"caf\xe9 in latin-1\n" + b"more text\n" * 50, "not UTF-8"),
])
def test_bad_input_exits_2_and_leaves_the_dataset_alone(tmp_path, monkeypatch, bad, says):
    monkeypatch.chdir(tmp_path)
    good = write(tmp_path / "good.txt", TEXT)
    run_in_process(prepare.main, "text", "--input", good, "--name", "ds", check=True)
    out = tmp_path / "data" / "ds"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"train.bin", "val.bin", "meta.json"}

    src = tmp_path / "bad.txt"
    src.write_bytes(bad)
    line = assert_one_error_line(run_in_process(prepare.main, "text", "--input", src, "--name", "ds"))
    assert says in line and "bad.txt" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_failure_while_writing_leaves_the_dataset_alone(tmp_path, monkeypatch):
    """A full disk: every file prepare writes goes to /dev/full (writes fail with ENOSPC). The error is one
    line naming the dataset directory and the cause; the old dataset is byte for byte what it was and no
    temporary file is left; through prepare.py's main it is `error: ...`, exit status 2, no traceback."""
    monkeypatch.chdir(tmp_path)
    src = write(tmp_path / "input.txt", TEXT)
    out = tmp_path / "data" / "ds"
    prepare.prepare(str(src), str(out), "char")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"train.bin", "val.bin", "meta.json"}

    opened = []

    def full_disk(file, mode, **kwargs):
        opened.append(file)
        return builtins.open("/dev/full", mode, **kwargs)

    monkeypatch.setattr(fileio, "open", full_disk, raising=False)  # atomic_write's open of its temporary file
    with pytest.raises(UserError) as e:
        prepare.prepare(str(src), str(out), "char")
    assert_one_line(e, f"cannot write the dataset in {out}", "No space left on device")
    assert opened and all(".tmp." in name for name in opened)  # the failure was in writing, not elsewhere
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # unchanged, and no temporary files

    proc = run_in_process(prepare.main, "text", "--input", src, "--name", "ds")
    assert_one_error_line(proc, "cannot write the dataset in", "No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("args, says", [
    (["text", "--name", "x"], "--input"),
    (["text", "--input", "missing.txt", "--name", "x"], "missing.txt"),
    (["text", "--input", "x", "--name", "x", "--tokenizer", "wordpiece"], "--tokenizer"),
    (["nonsense"], "corpus"),
])
def test_cli_mistakes_exit_2_with_one_line(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    line = assert_one_error_line(run_in_process(prepare.main, *args))
    assert says in line
    assert not (tmp_path / "data" / "x").exists()


def test_char_tokenizer_refuses_unknown_characters():
    tok = CharTokenizer("abc")
    assert tok.decode(tok.encode("cab")) == "cab"
    with pytest.raises(UserError, match="'z'"):
        tok.encode("abz")


def test_no_network_names_input(tmp_path, monkeypatch):
    import urllib.error

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(prepare.urllib.request, "urlopen", offline)
    with pytest.raises(UserError) as e:
        prepare.main(["shakespeare_char", "--data_dir", str(tmp_path / "d")])
    assert_one_line(e, "--input")
    assert not list((tmp_path / "d").rglob("*.*"))  # no partial download, no dataset


def test_prepare_py_as_a_process_exits_2_with_one_line(tmp_path):
    """The one subprocess here: the script's own __main__ block turns a mistake into `error: ...` and exit 2."""
    line = assert_one_error_line(run("prepare.py", "text", "--name", "x", cwd=tmp_path))
    assert "--input" in line
    assert not (tmp_path / "data").exists()
