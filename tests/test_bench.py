"""bench.py on tiny models and a tiny corpus: the modes run, read training config files, and report what they
measured."""

import dataclasses
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import bench
from conftest import ROOT, assert_one_error_line, make_corpus, run_in_process
from machinery import bench_prepare
from machinery.configurator import UserError
from machinery.tokenizer import gpt2_encoding
from model import GPT

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--device=cpu", "--warmup=1", "--repeats=3"]


def fake_clock(monkeypatch, durations):
    """bench.py's time.perf_counter replaced by a clock whose measured intervals (one pair of calls each, in
    order) last the given durations (binary fractions of 2 decimals at most: exact in floats and as printed),
    the real work still done in between; returns the list of readings taken, to count them."""
    readings, ticks = [], []
    now = 1000.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1  # (time between the intervals, unmeasured)
    ticks.reverse()
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: readings.append(ticks.pop()) or
                                                       readings[-1]))
    return readings


def test_sample_mode_reports_both_paths_and_identical_greedy_tokens(capsys, monkeypatch):
    # warm-up, then 3 measured runs, each path in turn: cached, uncached, cached, uncached, ...
    cached, uncached = [0.25, 0.5, 2.0, 1.0], [16.0, 4.0, 8.0, 2.0]
    readings = fake_clock(monkeypatch, [d for pair in zip(cached, uncached) for d in pair])
    generated, generate = [], GPT.generate  # each run's path and tokens
    monkeypatch.setattr(GPT, "generate", lambda self, idx, n, **kw: generated.append(
        (kw["use_cache"], generate(self, idx, n, **kw))) or generated[-1][1])
    # (float32: whether both paths give the same greedy tokens is not up to dtype=auto's choice on this CPU)
    rate, same = bench.main(["--mode=sample", "--vocab_size=65", "--max_new_tokens=20", "--prompt_len=3",
                             "--dtype=float32", *TINY])
    assert len(readings) == 16  # every run timed, and nothing else
    assert [use_cache for use_cache, _ in generated] == [True, False] * 4
    assert generated[0][1].shape == (1, 3 + 20) and all(torch.equal(out, generated[0][1]) for _, out in generated)
    # the medians of the measured runs alone (with the warm-up they would be 0.75 s and 6 s)
    assert rate == {True: 20 / 1.0, False: 20 / 4.0} and same is True
    out = capsys.readouterr().out
    assert "vocab 65" in out
    runs = re.findall(r"^  (warm-up|run \d) +(cached|uncached) +(\d+\.\d\d) s$", out, re.M)
    assert runs == [(name, path, f"{d:.2f}") for name, c, u in zip(["warm-up", "run 1", "run 2", "run 3"],
                                                                   cached, uncached)
                    for path, d in (("cached", c), ("uncached", u))]
    assert re.findall(r"^(cached|uncached) +(\S+)$", out, re.M) == [("cached", "20.0"), ("uncached", "5.0")]
    assert out.endswith("speed-up with the KV cache: 4.0x; greedy tokens identical: yes\n")


def test_train_mode_reads_a_training_config_file(capsys, monkeypatch):
    steps = [8.0, 0.25, 1.0, 0.5]  # a warm-up, then 3 measured iterations
    readings = fake_clock(monkeypatch, steps)
    median = bench.main([str(ROOT / "config/train_shakespeare_char.py"), "--mode=train", "--batch_size=2",
                         "--compile=False", *TINY])
    out = capsys.readouterr().out
    assert len(readings) == 8 and median == 0.5  # the measured iterations' median (with the warm-up: 0.75)
    assert "1 micro-steps x batch 2 x 16 tokens = 32 tokens" in out  # gradient_accumulation_steps from the file
    assert re.findall(r"^  (warm-up|iter \d) +(\S+) ms$", out, re.M) == \
        [("warm-up", "8000.0"), ("iter 1", "250.0"), ("iter 2", "1000.0"), ("iter 3", "500.0")]
    # ms/iter, and tokens/s = 32 tokens / seconds per iteration; no MFU on a CPU (no known peak)
    assert re.findall(r"^(median|min|max) +(\S+) +(\S+) +(\S+)$", out, re.M) == \
        [("median", "500.0", "64", "-"), ("min", "250.0", "128", "-"), ("max", "1000.0", "32", "-")]


@pytest.mark.parametrize("arg,message", [("--mode=fast", "mode must be sample, train, speedrun, prepare, serve or faults, got 'fast'"),
                                         ("--prompt_len=17", "prompt_len .17. must be at most block_size"),
                                         ("--num_proc=-1", "num_proc must not be negative"),
                                         ("--corpus_mb=0", "corpus_mb must be positive"),
                                         ("--recipe=tpu", "recipe must be cpu or gpu, got 'tpu'")])
def test_bad_settings_are_one_line_errors(arg, message):
    with pytest.raises(UserError, match=message):
        bench.main([*TINY, arg])


def test_gpu_speedrun_without_a_gpu_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="recipe=gpu needs a CUDA GPU"):
        bench.main(["--mode=speedrun", "--recipe=gpu"])


def test_prepare_mode_counts_the_same_tokens_as_tiktoken(tmp_path):
    docs = [make_corpus(n_lines=12, seed=i) for i in range(300)] + ["", "naïve café, 東京 <|endoftext|> as text"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="utf-8")
    enc = gpt2_encoding()  # built here once: the forked processes of the benchmark inherit it
    expected = sum(1 + len(enc.encode_ordinary(doc)) for doc in docs)
    proc = run_in_process(bench.main, "--mode=prepare", f"--input={path}", "--num_proc=2", check=True)
    reported = re.findall(r"^(tiktoken|prepare_corpus)\b.*?: ([\d,]+) tokens, ([\d,]+) documents, .* Mtok/s, (.*)$",
                          proc.stdout, re.M)
    assert [(name, int(tokens.replace(",", "")), int(n.replace(",", ""))) for name, tokens, n, _ in reported] == \
        [("tiktoken", expected, len(docs)), ("prepare_corpus", expected, len(docs))]
    if bench_prepare.memory_measurable():
        assert all(re.fullmatch(r"peak Rss [\d,]+ MiB, Pss [\d,]+ MiB", memory) for *_, memory in reported)
    assert re.search(r"^prepare_corpus / tiktoken: \d+\.\d+ of tiktoken's tokens/s", proc.stdout, re.M)
    assert proc.stdout.startswith("machine: ")


def test_counts_that_disagree_stop_the_benchmark():
    tiktoken = bench_prepare.Measurement("tiktoken", 1000, 10, 1.0, "encode calls only")
    for ours in (dataclasses.replace(tiktoken, tokens=999), dataclasses.replace(tiktoken, documents=11)):
        with pytest.raises(RuntimeError, match="did not encode the same text"):
            bench_prepare.check_same_text(tiktoken, ours)


def test_the_synthetic_corpus_is_the_text_shuffled_copy_by_copy(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text(make_corpus(), encoding="utf-8")
    out = tmp_path / "corpus.jsonl"
    documents = bench_prepare.write_synthetic_corpus(source, out, megabytes=1)
    docs = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(docs) == documents and 1 << 20 <= os.path.getsize(out) < (1 << 20) + 4000
    parts = -(-len(make_corpus().split("\n")) // bench_prepare.SYNTHETIC_DOC_LINES)
    first, second = docs[0], docs[parts]  # the same part of copies 0 and 1
    assert first.startswith("Copy 0, part 0. ") and second.startswith("Copy 1, part 0. ")
    assert first[16:] != second[16:] and sorted(first[16:].split(" ")) == sorted(second[16:].split(" "))


def test_a_missing_text_source_is_one_line(tmp_path):
    proc = run_in_process(bench.main, "--mode=prepare", f"--text_source={tmp_path / 'none.txt'}")
    assert_one_error_line(proc, "--text_source", "none.txt")
