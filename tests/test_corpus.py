"""corpus.py: documents from parquet / JSON lines / .txt files into GPT-2 shards, read back by hand;
the same bytes on 1 or 4 processes and after an interrupted run; bad input stops with one line."""

import gzip
import json
import random
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import corpus
from errors import UserError
from tokenizer import gpt2_encoding

EOT = 50256
SHARD = 20_000


def make_docs(n, seed=0):
    """Short documents with non-ASCII text, an empty one, and a literal <|endoftext|> (ordinary text here)."""
    rng = random.Random(seed)
    words = "the king queen night day love sword crown heart Café naïve — 日本語 🎭 \n".split(" ")
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    docs[5], docs[9] = "", "see <|endoftext|> here"
    return docs


@pytest.fixture(scope="module")
def docs():
    return make_docs(3000)


@pytest.fixture(scope="module")
def expected(docs):
    enc = gpt2_encoding()
    return sum([[EOT] + enc.encode_ordinary(doc) for doc in docs], [])


def write_parquet_dir(path, docs, files=3):
    path.mkdir()
    per = -(-len(docs) // files)
    for k in range(files):  # small row groups, so a resumed run skips some unread
        pq.write_table(pa.table({"id": list(range(k * per, min(len(docs), (k + 1) * per))),
                                 "text": docs[k * per:(k + 1) * per]}), path / f"part_{k:02d}.parquet",
                       row_group_size=256)
    return path


def read_shard(path):
    raw = path.read_bytes()
    magic, version, n = struct.unpack("<3i", raw[:12])
    assert (magic, version) == (20240520, 1) and len(raw) == 1024 + 2 * n
    return np.frombuffer(raw[1024:], dtype="<u2").tolist()


def shard_files(out):
    return sorted(out.glob("*_val_*.bin")) + sorted(out.glob("*_train_*.bin"))


def prepare(src, out, num_proc=1, shard_tokens=SHARD):
    return corpus.prepare_corpus(corpus.LocalSource(src), out, out.name, shard_tokens, num_proc, progress=False)


def files_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_parquet_corpus_to_shards_in_document_order(tmp_path, docs, expected):
    src = write_parquet_dir(tmp_path / "in", docs)
    out = tmp_path / "data" / "web"
    prepare(src, out)
    files = shard_files(out)
    assert [p.name for p in files][:3] == ["web_val_000000.bin", "web_train_000001.bin", "web_train_000002.bin"]
    assert len(files) == -(-len(expected) // SHARD) >= 4
    tokens = [read_shard(p) for p in files]
    assert all(len(t) == SHARD for t in tokens[:-1]) and 0 < len(tokens[-1]) <= SHARD
    assert sum(tokens, []) == expected
    meta = json.loads((out / "meta.json").read_text())  # read by hand
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["shards"] == len(files)
    assert meta["val_tokens"] == SHARD and meta["train_tokens"] == len(expected) - SHARD
    assert meta["documents"] == len(docs) and meta["max_token_id"] == max(expected)
    assert not [p for p in out.iterdir() if ".tmp." in p.name]


def test_same_bytes_on_one_and_four_processes(tmp_path, docs):
    src = write_parquet_dir(tmp_path / "in", docs)
    prepare(src, tmp_path / "a" / "web", num_proc=1)
    prepare(src, tmp_path / "b" / "web", num_proc=4)
    assert files_bytes(tmp_path / "a" / "web") == files_bytes(tmp_path / "b" / "web")


@pytest.mark.parametrize("num_proc", [1, 2])
def test_interrupted_run_continues_to_the_same_bytes(tmp_path, monkeypatch, docs, num_proc):
    src = write_parquet_dir(tmp_path / "in", docs)
    prepare(src, tmp_path / "whole" / "web")
    out = tmp_path / "cut" / "web"
    real_write, written = corpus.shards.write_shard, []

    def write_two_then_fail(path, tokens):
        if len(written) == 2:
            raise KeyboardInterrupt  # as if stopped with Ctrl-C while the third shard is due
        written.append(path)
        real_write(path, tokens)

    monkeypatch.setattr(corpus.shards, "write_shard", write_two_then_fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(src, out, num_proc)
    monkeypatch.undo()
    progress = json.loads((out / corpus.PROGRESS_FILE).read_text())
    assert len(progress["shards"]) == 2 and not progress["complete"] and not (out / "meta.json").exists()
    assert progress["shards"][-1]["end_offset"] > 0  # it stopped inside a document
    (out / ".web_train_000002.bin.tmp.12345").write_bytes(b"half a shard")  # as a kill mid-write leaves
    prepare(src, out, num_proc)
    assert files_bytes(out) == files_bytes(tmp_path / "whole" / "web")
    # and a run over a finished dataset changes nothing
    prepare(src, out, num_proc)
    assert files_bytes(out) == files_bytes(tmp_path / "whole" / "web")


def test_json_lines_and_txt_files_give_the_same_shards(tmp_path):
    docs = make_docs(300, seed=1)
    write_parquet_dir(tmp_path / "parquet", docs, files=2)
    (tmp_path / "jsonl").mkdir()
    lines = [json.dumps({"text": d, "url": "u"}) + "\n" for d in docs]
    (tmp_path / "jsonl" / "a.jsonl").write_text("".join(lines[:100]), encoding="utf-8")
    with gzip.open(tmp_path / "jsonl" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(lines[100:]))
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"doc_{i:04d}.txt").write_bytes(d.encode("utf-8"))
    outs = {}
    for kind in ("parquet", "jsonl", "txt"):
        prepare(tmp_path / kind, tmp_path / "out" / kind / "ds", shard_tokens=1000)
        outs[kind] = {k: v for k, v in files_bytes(tmp_path / "out" / kind / "ds").items()
                      if k.endswith(".bin")}
    assert len(outs["txt"]) >= 3
    assert outs["parquet"] == outs["jsonl"] == outs["txt"]


def assert_nothing_written(out):
    assert not out.exists()


def test_empty_input_directory(tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(UserError) as e:
        prepare(tmp_path / "in", tmp_path / "out" / "ds")
    assert "\n" not in str(e.value) and str(tmp_path / "in") in str(e.value)
    assert_nothing_written(tmp_path / "out")


def test_parquet_without_text_column(tmp_path):
    src = write_parquet_dir(tmp_path / "in", make_docs(50), files=1)
    bad = src / "part_01.parquet"
    pq.write_table(pa.table({"content": ["a document"]}), bad)
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert "\n" not in str(e.value) and str(bad) in str(e.value) and "`text`" in str(e.value)
    assert_nothing_written(tmp_path / "out")


def test_bad_json_line_and_too_small_corpus(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "no text"}\n', encoding="utf-8")
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert "\n" not in str(e.value) and f"{src} line 2" in str(e.value)
    src.write_text('{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert "--shard_tokens" in str(e.value)
    for bad in (dict(shard_tokens=0), dict(num_proc=0)):
        with pytest.raises(UserError) as e:
            corpus.prepare_corpus(corpus.LocalSource(src), tmp_path / "out" / "ds", "ds", **bad)
        assert f"--{next(iter(bad))}" in str(e.value)
    assert_nothing_written(tmp_path / "out")


def test_other_options_or_foreign_shards_are_not_overwritten(tmp_path, docs):
    src = write_parquet_dir(tmp_path / "in", docs[:1000])
    out = tmp_path / "out" / "web"
    prepare(src, out, shard_tokens=5000)
    before = files_bytes(out)
    with pytest.raises(UserError) as e:
        prepare(src, out, shard_tokens=4000)
    assert "shard_tokens" in str(e.value)
    (out / corpus.PROGRESS_FILE).unlink()
    with pytest.raises(UserError) as e:
        prepare(src, out)
    assert "already holds a dataset" in str(e.value)
    before.pop(corpus.PROGRESS_FILE)
    assert files_bytes(out) == before


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", "a\\b", "x..y"])
def test_dataset_names_must_be_plain(tmp_path, name):
    with pytest.raises(UserError) as e:
        corpus.prepare_from_cli("text", str(tmp_path), name=name, input_path=str(tmp_path))
    assert "--name" in str(e.value)


def test_hub_source_reads_the_subset_files_in_order(tmp_path, monkeypatch):
    """The hub path with huggingface_hub's two calls faked (no network here): the subset's parquet files
    are listed, fetched one by one and read in name order; other subsets and files are left alone."""
    import huggingface_hub as hub
    docs = make_docs(40, seed=2)
    files = {"sample/10BT/001_00000.parquet": docs[20:], "sample/10BT/000_00000.parquet": docs[:20],
             "sample/100BT/000_00000.parquet": ["other subset"], "data/CC-MAIN-2024-10/000.parquet": ["a dump"]}
    for i, (name, texts) in enumerate(files.items()):
        pq.write_table(pa.table({"text": texts}), tmp_path / f"{i}.parquet")
    local = {name: str(tmp_path / f"{i}.parquet") for i, name in enumerate(files)}
    fetched = []

    def download(repo_id, filename, repo_type=None, revision=None):
        assert (repo_id, repo_type, revision) == ("HuggingFaceFW/fineweb-edu", "dataset", None)
        fetched.append(filename)
        return local[filename]

    monkeypatch.setattr(hub.HfApi, "list_repo_files", lambda self, repo_id, repo_type=None, revision=None:
                        ["README.md", *files])
    monkeypatch.setattr(hub, "hf_hub_download", download)
    source = corpus.HubSource(*corpus.HUB_DATASETS["fineweb_edu"])
    assert list(source.documents()) == docs
    assert fetched == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    # a resumed run fetches the files it skips again (hf_hub_download finds them in its cache) for their row counts
    assert list(source.documents(skip=25)) == docs[25:] and fetched[2:] == fetched[:2]
    assert list(corpus.HubSource("HuggingFaceFW/fineweb-edu", "CC-MAIN-2024-10").documents()) == ["a dump"]
