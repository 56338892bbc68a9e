"""corpus.py and documents.py: documents from parquet / JSON lines / .txt files into GPT-2 shards, read back by hand;
the same bytes on 1 or 4 processes and after an interrupted run; a corpus under two shards split 10 % /
90 % with no flag, and trained from; bad input stops with one line."""

import gzip
import json
import math
import os
import random
import re
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import assert_one_error_line, assert_one_line, fake_hub, run_in_process, tiny_train_args, train
from machinery.data import corpus, documents
from machinery.errors import UserError
from machinery.data.tokenizer import gpt2_encoding
import prepare as prepare_script

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
    return corpus.prepare_corpus(documents.LocalSource(src), out, out.name, shard_tokens, num_proc, progress=False)


def files_bytes(out):
    """Every file's bytes, but for the modification times meta.json may record of the token files (another
    run, another time): those are left out, their sizes kept."""
    found = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    if "meta.json" in found:
        meta = json.loads(found["meta.json"])
        meta["files"] = {name: stamp[0] for name, stamp in (meta.get("files") or {}).items()}
        found["meta.json"] = json.dumps(meta).encode()
    return found


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
    assert_one_line(e, tmp_path / "in")
    assert_nothing_written(tmp_path / "out")


def test_parquet_without_text_column(tmp_path):
    src = write_parquet_dir(tmp_path / "in", make_docs(50), files=1)
    bad = src / "part_01.parquet"
    pq.write_table(pa.table({"content": ["a document"]}), bad)
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert_one_line(e, bad, "`text`")
    assert_nothing_written(tmp_path / "out")


def test_bad_json_line_and_too_small_corpus(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "no text"}\n', encoding="utf-8")
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert_one_line(e, f"{src} line 2")
    src.write_text('{"text": "fine"}\n', encoding="utf-8")  # <|endoftext|> fine: 2 tokens
    with pytest.raises(UserError) as e:
        prepare(src, tmp_path / "out" / "ds")
    assert_one_line(e, "only 2 tokens", "--shard_tokens 1 or less")
    for bad in (dict(shard_tokens=0), dict(num_proc=0)):
        with pytest.raises(UserError) as e:
            corpus.prepare_corpus(documents.LocalSource(src), tmp_path / "out" / "ds", "ds", **bad)
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
    docs = make_docs(40, seed=2)
    files = {"sample/10BT/001_00000.parquet": docs[20:], "sample/10BT/000_00000.parquet": docs[:20],
             "sample/100BT/000_00000.parquet": ["other subset"], "data/CC-MAIN-2024-10/000.parquet": ["a dump"]}
    fetched = fake_hub(monkeypatch, tmp_path, files)
    source = documents.HubSource(*corpus.HUB_CORPORA["fineweb_edu"])
    assert list(source.documents()) == docs
    assert fetched == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    # a resumed run fetches the files it skips again (hf_hub_download finds them in its cache) for their row counts
    assert list(source.documents(skip=25)) == docs[25:] and fetched[2:] == fetched[:2]
    assert list(documents.HubSource("HuggingFaceFW/fineweb-edu", "CC-MAIN-2024-10").documents()) == ["a dump"]


# ---------------------------------------------------------------------------- a corpus under two shards


def note(total, val, shard_words):
    """The line prepare prints for a corpus under two shards (the rule: validation gets the first 10 %)."""
    return (f"note: the corpus has {total:,} tokens, less than {shard_words}: validation gets the first 10 % "
            f"({val:,} tokens), train the rest ({total - val:,} tokens)")


@pytest.fixture(scope="module")
def small_prepared(tmp_path_factory, docs):
    """The 3000 documents (~78k tokens) through `prepare.py fineweb_edu --input DIR`, no shard flag:
    under one shard of the default 100M tokens. Returns (dataset directory, prepare's output)."""
    root = tmp_path_factory.mktemp("small")
    src = write_parquet_dir(root / "in", docs)
    proc = run_in_process(prepare_script.main, "fineweb_edu", "--input", src, "--data_dir", root / "data",
                          "--num_proc", "1", check=True)
    return root / "data" / "fineweb_edu", proc


def test_a_corpus_under_one_shard_needs_no_flag(small_prepared, docs, expected):
    out, proc = small_prepared
    total, val = len(expected), len(expected) // 10
    assert corpus.DEFAULT_SHARD_TOKENS == 100_000_000 > total
    assert proc.stdout.splitlines()[0] == note(total, val, "one shard of 100,000,000")
    files = shard_files(out)
    assert [p.name for p in files] == ["fineweb_edu_val_000000.bin", "fineweb_edu_train_000001.bin"]
    val_tokens, train_tokens = (read_shard(p) for p in files)
    assert val_tokens == expected[:val] and train_tokens == expected[val:]
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["val_tokens"], meta["train_tokens"], meta["shards"], meta["max_token_id"], meta["documents"]) == \
        (val, total - val, 2, max(expected), len(docs))


def test_a_finished_small_corpus_is_already_prepared(small_prepared):
    out, _ = small_prepared
    before = files_bytes(out)
    proc = run_in_process(prepare_script.main, "fineweb_edu", "--input", out.parent.parent / "in",
                          "--data_dir", out.parent, "--num_proc", "1", check=True)
    assert proc.stdout == f"{out}: already prepared (2 shards)\n" and files_bytes(out) == before


def test_train_py_trains_from_a_small_corpus(small_prepared, tmp_path):
    out, _ = small_prepared
    proc = train(*tiny_train_args(tmp_path, tmp_path / "out", dataset=out, max_iters=2, eval_interval=2,
                                  lr_decay_iters=2, warmup_iters=1))
    losses = re.findall(r"^step (\d+): train loss (\S+), val loss (\S+)$", proc.stdout, re.M)
    assert [step for step, *_ in losses] == ["0", "2"], proc.stdout
    assert all(math.isfinite(float(x)) for _, *pair in losses for x in pair)
    assert (tmp_path / "out" / "ckpt.pt").is_file()


def test_openwebtext_from_a_directory_is_the_same_corpus_under_its_name(small_prepared, tmp_path):
    """`prepare.py openwebtext --input DIR` (the dataset of config/train_gpt2.py and train.py's default): the
    same shards as fineweb_edu's from the same documents, under its own name, and train.py finds them by it."""
    out, _ = small_prepared
    data = tmp_path / "data"
    run_in_process(prepare_script.main, "openwebtext", "--input", out.parent.parent / "in", "--data_dir", data,
                   "--num_proc", "1", check=True)
    files = shard_files(data / "openwebtext")
    assert [p.name for p in files] == ["openwebtext_val_000000.bin", "openwebtext_train_000001.bin"]
    assert [read_shard(p) for p in files] == [read_shard(p) for p in shard_files(out)]
    proc = train(*tiny_train_args(data, tmp_path / "out", dataset="openwebtext", max_iters=1, eval_interval=1,
                                  lr_decay_iters=1, warmup_iters=0))
    assert re.findall(r"^step (\d+): train loss", proc.stdout, re.M) == ["0", "1"], proc.stdout


@pytest.mark.parametrize("shard_of, lengths", [
    ((19, 20), lambda total, val, shard: [val, total - val]),  # train fits in one shard
    ((2, 3), lambda total, val, shard: [val, shard, total - val - shard]),  # train fills one and some
])
def test_between_one_and_two_shards_validation_gets_10_percent(tmp_path, capsys, docs, expected, shard_of, lengths):
    total, val = len(expected), len(expected) // 10
    shard = total * shard_of[0] // shard_of[1]
    src = write_parquet_dir(tmp_path / "in", docs)
    prepare(src, tmp_path / "out" / "web", shard_tokens=shard)
    assert capsys.readouterr().out.splitlines()[0] == note(total, val, f"two shards of {shard:,}")
    tokens = [read_shard(p) for p in shard_files(tmp_path / "out" / "web")]
    assert [len(t) for t in tokens] == lengths(total, val, shard)
    assert sum(tokens, []) == expected
    assert not [p for p in (tmp_path / "out" / "web").iterdir() if ".tmp." in p.name]


def interrupt(monkeypatch, shard_at=None, progress_at=None):
    """Ctrl-C at the first shard write (file names so far, this one last) or progress write (the state)
    for which the given test is true."""
    real_shard, real_json, names = corpus.shards.write_shard, corpus._write_json, []

    def write_shard(path, tokens):
        names.append(os.path.basename(path))
        if shard_at and shard_at(names):
            raise KeyboardInterrupt
        real_shard(path, tokens)

    def write_json(path, obj):
        if progress_at and progress_at(obj):
            raise KeyboardInterrupt
        real_json(path, obj)

    monkeypatch.setattr(corpus.shards, "write_shard", write_shard)
    monkeypatch.setattr(corpus, "_write_json", write_json)


STOPS = {  # where a run is stopped -> (shard size as a share of the corpus; None: the default), interruption
    # under one shard: with the validation shard written, as the train shard is due
    "train_shard_due": (None, dict(shard_at=lambda names: len(names) == 2)),
    # between one and two shards: the train shards cut again, as the validation shard is to be replaced
    "validation_cut_due": ((2, 3), dict(shard_at=lambda names: names.count("web_val_000000.bin") == 2)),
    # ... the validation shard replaced too, as the progress file is to say so
    "progress_due": ((2, 3), dict(progress_at=lambda state: len(state["shards"]) == 3 and not state["complete"])),
}


@pytest.mark.parametrize("stop", STOPS)
def test_interrupted_small_corpus_continues_to_the_same_bytes(tmp_path, monkeypatch, docs, expected, stop):
    share, where = STOPS[stop]
    shard = corpus.DEFAULT_SHARD_TOKENS if share is None else len(expected) * share[0] // share[1]
    src = write_parquet_dir(tmp_path / "in", docs)
    prepare(src, tmp_path / "whole" / "web", shard_tokens=shard)
    out = tmp_path / "cut" / "web"
    interrupt(monkeypatch, **where)
    with pytest.raises(KeyboardInterrupt):
        prepare(src, out, shard_tokens=shard)
    monkeypatch.undo()
    progress = json.loads((out / corpus.PROGRESS_FILE).read_text())
    # what was left: the validation shard of the first cut (10 % of the corpus, or a whole shard before the
    # second cut; the progress file still says so once it has been replaced)
    assert [r["tokens"] for r in progress["shards"]] == [len(expected) // 10 if share is None else shard]
    assert not progress["complete"] and not (out / "meta.json").exists()
    assert read_shard(out / "web_val_000000.bin") == expected[:len(expected) // 10 if stop != "validation_cut_due"
                                                              else shard]
    prepare(src, out, shard_tokens=shard)
    assert files_bytes(out) == files_bytes(tmp_path / "whole" / "web")


@pytest.mark.parametrize("share, lost", [(None, "web_train_000001.bin"), ((2, 3), "web_train_000001.bin"),
                                            ((2, 3), "web_train_000002.bin")])
def test_a_lost_shard_of_a_small_corpus_is_made_again(tmp_path, docs, expected, share, lost):
    """A run over a finished dataset with a shard deleted continues from where the progress file says the
    shard before it ended (inside a document, here): the same bytes again, so those positions are right."""
    shard = corpus.DEFAULT_SHARD_TOKENS if share is None else len(expected) * share[0] // share[1]
    src = write_parquet_dir(tmp_path / "in", docs)
    out = tmp_path / "out" / "web"
    prepare(src, out, shard_tokens=shard)
    whole = files_bytes(out)
    progress = json.loads((out / corpus.PROGRESS_FILE).read_text())
    assert all(r["end_offset"] > 0 for r in progress["shards"][:-1])  # cuts inside documents, here
    (out / lost).unlink()
    prepare(src, out, shard_tokens=shard)
    assert files_bytes(out) == whole


def test_stream_position_counts_documents_by_their_first_token():
    # the stream: documents 0..1 = [EOT 1 2] [EOT 3 ...], a piece from its start
    tokens = np.array([EOT, 1, 2, EOT, 3], dtype=np.uint16)
    assert [corpus.stream_position(tokens, q, (0, 0)) for q in range(5)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    # a piece that begins inside document 5 (2 of its tokens before it), document 6 starting at its third token
    tokens = np.array([7, 8, EOT, 9], dtype=np.uint16)
    assert [corpus.stream_position(tokens, q, (5, 2)) for q in range(4)] == [(5, 2), (5, 3), (6, 0), (6, 1)]


def words_corpus(tmp_path, n_tokens):
    """.txt documents of `n_tokens` GPT-2 tokens in all (counted by tiktoken): "the the ...", 1000 words each."""
    enc, src = gpt2_encoding(), tmp_path / f"in_{n_tokens}"
    src.mkdir()
    sizes = [1000] * ((n_tokens - 1) // 1001) + [(n_tokens - 1) % 1001]  # each + <|endoftext|>
    texts = [" ".join(["the"] * n) for n in sizes]
    for i, text in enumerate(texts):
        (src / f"doc_{i}.txt").write_text(text, encoding="utf-8")
    assert sum(1 + len(enc.encode_ordinary(t)) for t in texts) == n_tokens
    return src


def test_too_few_tokens_for_two_windows_is_one_line(tmp_path):
    """Validation and train need one GPT-2 window each (1024 + 1 tokens): 2049 tokens is too few, 2050 is
    enough, validation then taking 1025 tokens rather than 10 %."""
    data = tmp_path / "data"
    proc = run_in_process(prepare_script.main, "text", "--input", words_corpus(tmp_path, 2049), "--name", "few",
                          "--data_dir", data)
    # (the progress bar of the tokenizing before it aside)
    proc.stderr = "\n".join(line for line in re.split(r"[\r\n]", proc.stderr) if not line.startswith("tokenizing few"))
    assert_one_error_line(proc, "gives only 2,049 tokens", "1,025 tokens each", "add documents",
                          "--shard_tokens 1024 or less")
    assert not data.exists()
    proc = run_in_process(prepare_script.main, "text", "--input", words_corpus(tmp_path, 2050), "--name", "few",
                          "--data_dir", data, check=True)
    assert proc.stdout.startswith("note: the corpus has 2,050 tokens, less than one shard of 100,000,000: "
                                  "validation gets the first 1,025 tokens, as 10 % would hold less than one "
                                  "GPT-2 window (1,025 tokens), train the rest (1,025 tokens)\n")
    assert [len(read_shard(p)) for p in shard_files(data / "few")] == [1025, 1025]
