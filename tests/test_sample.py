"""sample.py: stop texts, stop tokens, streaming, long prompts and bad prompts, on small random checkpoints."""

import io
import itertools
import re
import sys
import types

import pytest
import torch

from conftest import assert_one_error_line, make_corpus, run_in_process
from machinery.generation import engine, packing
from machinery.weights import checkpoint
from machinery.errors import UserError
from machinery.data.meta import DatasetMeta
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from model import GPT, GPTConfig
import sample
from train import TrainConfig

BLOCK_SIZE = 32
SEPARATOR = "---------------\n"


def save_checkpoint(path, model, tokenizer):
    state = checkpoint.training_state(model.state_dict(), model.config, TrainConfig(), DatasetMeta.of(tokenizer),
                                      iter_num=0, best_val_loss=float("inf"))
    checkpoint.save(state, str(path))


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory):
    """best.pt of a random character-level model over make_corpus()'s characters."""
    tokenizer = CharTokenizer(sorted(set(make_corpus())))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK_SIZE, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)  # larger than GPT-2's init: varied text
    path = tmp_path_factory.mktemp("char") / "best.pt"
    save_checkpoint(path, model, tokenizer)
    return path


def sample_stdout(ckpt, *args):
    """Run sample.py's main in this process; return what it printed to stdout."""
    return run_sample(ckpt, *args).stdout


def run_sample(ckpt, *args, check=True):
    """Run sample.py's main in this process; return what it printed (.stdout and .stderr) and its exit status."""
    return run_in_process(sample.main, f"--out_dir={ckpt}", "--device=cpu", *args, check=check)


def notes(proc):
    """What sample.py wrote on stderr besides the line that says where it runs (hardware.describe), which it
    writes once, before the samples, and the decoding rate's, after them (when a sample had more than 2 tokens)."""
    lines = proc.stderr.splitlines(keepends=True)
    device = [line for line in lines if line.startswith("device ")]
    assert len(device) == 1 and re.fullmatch(r"device cpu \(.+ kind, dtype auto = .+; \d+ threads\), dtype \w+\n",
                                             device[0]), proc.stderr
    rate = [line for line in lines if line.startswith("decoded ")]
    assert len(rate) <= 1 and all(re.fullmatch(r"decoded [\d,]+ tokens in \d+\.\d{3} s: [\d,]+\.\d tokens/s "
                                                r"\(after each sample's first 2\)\n", line) for line in rate), rate
    return "".join(line for line in lines if line not in device + rate)


def split_samples(stdout):
    assert stdout.endswith(SEPARATOR)
    return [text[:-1] for text in stdout.split(SEPARATOR)[:-1]]  # print() added one newline to each


def test_streamed_output_equals_the_batch_output_and_generate(char_ckpt, cpu_bf16, monkeypatch):
    # sample.py's default dtype=auto: bfloat16 weights on a CPU that computes it natively, else float32
    # (both answers in turn, cpu_bf16); the reference runs model.generate in that precision
    used, prepare = [], packing.prepare
    monkeypatch.setattr(packing, "prepare", lambda model, device, dtype, **kw: used.append(dtype) or
                        prepare(model, device, dtype, **kw))
    common = ["--start=ROMEO:", "--max_new_tokens=60", "--temperature=0.9", "--top_k=20", "--seed=5"]
    streamed = sample_stdout(char_ckpt, *common, "--num_samples=3", "--stream=True")
    at_end = sample_stdout(char_ckpt, *common, "--num_samples=3", "--stream=False")
    assert streamed == at_end
    assert len(split_samples(streamed)) == 3

    # one sample, streamed, against model.generate with the same seed
    streamed = sample_stdout(char_ckpt, *common, "--num_samples=1")
    ckpt = checkpoint.load(str(char_ckpt))
    model, tokenizer = ckpt.build_model().eval(), ckpt.data_meta.make_tokenizer()
    assert isinstance(tokenizer, CharTokenizer)
    with torch.no_grad():
        out = model.to(cpu_bf16).generate(torch.tensor([tokenizer.encode("ROMEO:")]), 60, temperature=0.9, top_k=20,
                             generator=torch.Generator().manual_seed(5))
    assert streamed == tokenizer.decode(out[0].tolist()) + "\n" + SEPARATOR
    assert used == [str(cpu_bf16).removeprefix("torch.")] * 3  # what auto picked, each time


def test_sample_py_prints_the_first_sample_while_the_batch_is_generated(monkeypatch, char_ckpt):
    """Before each step of the engine, stdout already holds the prompt and every character sample 0 has
    generated so far (a character model: one character per token)."""
    stdout, printed = io.StringIO(), []
    step = engine.Engine.step

    def spy(runner):
        first = runner.rows[0] if runner.rows else None
        printed.append((stdout.getvalue(), first.completion_tokens if first else 0))
        step(runner)

    monkeypatch.setattr(engine.Engine, "step", spy)
    monkeypatch.setattr(sys, "stdout", stdout)
    sample.main([f"--out_dir={char_ckpt}", "--device=cpu", "--start=KING", "--max_new_tokens=25", "--num_samples=2"])
    first = split_samples(stdout.getvalue())[0]
    assert len(printed) >= 12 and printed[-1][1] >= 23  # printed along the way, nearly to the end
    for text, tokens in printed:
        assert text == first[:len("KING") + tokens]


def test_sample_py_says_its_decoding_rate_after_each_samples_first_two_tokens(char_ckpt, monkeypatch):
    """stderr's last line: the tokens decoded after each sample's first two (the prompt's pass and the first
    decoding step, where CUDA's graph is captured) and their rate, on sample.py's clock (stood in for: one
    reading before them, one after, 2 s apart): 3 x (25 - 2) tokens."""
    monkeypatch.setattr(sample, "time", types.SimpleNamespace(perf_counter=itertools.count(5, 2).__next__))
    proc = run_sample(char_ckpt, "--start=KING", "--max_new_tokens=25", "--num_samples=3", "--seed=3")
    assert proc.stderr.splitlines()[-1] == "decoded 69 tokens in 2.000 s: 34.5 tokens/s (after each sample's first 2)"
    texts = split_samples(proc.stdout)  # a character model: a character a token
    assert [len(t) - len("KING") for t in texts] == [25, 25, 25]
    # two tokens a sample: nothing timed, no line
    proc = run_sample(char_ckpt, "--start=KING", "--max_new_tokens=2", "--num_samples=2")
    assert [len(t) for t in split_samples(proc.stdout)] == [6, 6] and notes(proc) == ""


def test_a_multi_token_stop_text_cuts_each_sample_at_its_first_occurrence(char_ckpt):
    common = ["--start=ROMEO:", "--max_new_tokens=80", "--num_samples=2", "--seed=3"]
    free = [text[len("ROMEO:"):] for text in split_samples(sample_stdout(char_ckpt, *common))]
    stop = free[0][20:23]  # three characters (three tokens) that sample 0 produces
    stopped = split_samples(sample_stdout(char_ckpt, *common, f"--stop={stop}"))
    for text, full in zip(stopped, free):
        cut = full.find(stop)
        assert text == "ROMEO:" + (full[:cut] if cut >= 0 else full)
    assert len(stopped[0]) < len("ROMEO:") + 23


def test_temperature_zero_is_the_same_whatever_the_seed(char_ckpt):
    texts = [sample_stdout(char_ckpt, "--start=KING", "--max_new_tokens=30", "--num_samples=2",
                           "--temperature=0", f"--seed={seed}") for seed in (1, 2)]
    assert texts[0] == texts[1]
    first, second = split_samples(texts[0])
    assert first == second


def test_a_prompt_longer_than_block_size_keeps_its_last_block_size_tokens(char_ckpt):
    long = make_corpus()[:90]
    tail = long[-BLOCK_SIZE:]
    args = ["--max_new_tokens=20", "--num_samples=1", "--temperature=0"]
    from_long = run_sample(char_ckpt, f"--start={long}", *args)
    assert notes(from_long) == f"note: the prompt has 90 tokens; keeping its last {BLOCK_SIZE} (block_size)\n"
    from_tail = run_sample(char_ckpt, f"--start={tail}", *args)
    assert notes(from_tail) == ""
    assert from_long.stdout == long + from_tail.stdout[len(tail):]  # the continuation of the last 32 characters


def test_a_prompt_outside_the_character_vocabulary_exits_2_naming_the_characters(char_ckpt):
    proc = run_sample(char_ckpt, "--start=Héllo wörld", "--max_new_tokens=5", check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --start:")
    assert "'é' 'ö'" in lines[0]


# ---------------------------------------------------------------------- --start=FILE:path


def test_a_prompt_from_a_file_gives_the_same_output_as_the_same_text_inline(tmp_path, char_ckpt):
    text = "ROMEO:\nGood night, sweet lady!\n"  # lines, ending in a newline; shorter than block_size
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode("utf-8"))
    args = ["--max_new_tokens=30", "--num_samples=2", "--temperature=0.9", "--seed=4"]
    from_file = run_sample(char_ckpt, f"--start=FILE:{path}", *args)
    inline = run_sample(char_ckpt, f"--start={text}", *args)
    assert from_file.stdout == inline.stdout and notes(from_file) == notes(inline) == ""
    assert all(s.startswith(text) for s in split_samples(from_file.stdout))


def test_a_non_ascii_prompt_file_is_read_as_utf8(tmp_path, bpe_ckpt):
    path = tmp_path / "prompt.txt"
    path.write_bytes("Café — 日本".encode("utf-8"))
    out = sample_stdout(bpe_ckpt, f"--start=FILE:{path}", "--max_new_tokens=3", "--num_samples=1")
    assert out == "Café — 日本\n" + SEPARATOR


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "missing.txt", "missing.txt"),
    (lambda d: d, "cannot read the prompt file"),  # a directory
    (lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9 ROMEO\n") and d / "latin1.txt", "latin1.txt"),
    (lambda d: (d / "empty.txt").write_bytes(b"") or d / "empty.txt", "prompt is empty"),
])
def test_bad_prompt_files_exit_2_with_one_line(tmp_path, char_ckpt, make, says):
    path = make(tmp_path)
    proc = run_sample(char_ckpt, f"--start=FILE:{path}", "--max_new_tokens=5", check=False)
    assert_one_error_line(proc, says)
    assert proc.stdout == ""


def test_a_stop_text_outside_the_vocabulary_is_an_error(char_ckpt):
    with pytest.raises(UserError, match=r"--stop: .*'€'"):
        sample.main([f"--out_dir={char_ckpt}", "--device=cpu", "--stop=€"])


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    """A GPT-2 BPE model whose most likely tokens are always the padding ids 50257..50303 (which GPT-2's
    tokenizer cannot decode), then <|endoftext|>: the output layer (tied to the token embedding) sees a
    constant vector, the final LayerNorm's bias, and those tokens' embeddings point along it."""
    tokenizer = GPT2Tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        model.tok_emb.weight[tokenizer.vocab_size:] = 20.0
        model.tok_emb.weight[tokenizer.eot_token] = 10.0
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
    path = tmp_path_factory.mktemp("bpe") / "best.pt"
    save_checkpoint(path, model, tokenizer)
    return path


def test_bpe_samples_stop_at_endoftext_and_never_produce_padding_ids(bpe_ckpt):
    out = sample_stdout(bpe_ckpt, "--start=Hello there", "--max_new_tokens=20", "--num_samples=2")
    assert out == ("Hello there\n" + SEPARATOR) * 2
    model = checkpoint.load(str(bpe_ckpt)).build_model().eval()
    assert model.generate(torch.tensor([[15496]]), 2, temperature=0).tolist() == [[15496, 50257, 50257]]
    assert model.generate(torch.tensor([[15496]]), 2, temperature=0, vocab_size=50257).tolist() == \
        [[15496, 50256, 50256]]


def test_compile_true_samples_through_the_compiled_model(char_ckpt, monkeypatch):
    """--compile compiles the model in place (nn.Module.compile; the engine's calls then run compiled) instead
    of prepacking its weights: the same greedy text. (dynamo's "eager" backend: the graphs are captured and
    run, without inductor's C++ compilation, ~25 s from a cold cache.)"""
    import torch.nn as nn

    calls, real = [], nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append(kw) or real(self, backend="eager", **kw))
    args = ["--start=ROMEO:", "--max_new_tokens=20", "--num_samples=2", "--temperature=0", "--dtype=float32"]
    torch._dynamo.reset()
    try:
        compiled = sample_stdout(char_ckpt, *args, "--compile=True")
    finally:
        torch._dynamo.reset()
    assert calls == [{"dynamic": True}]
    assert compiled == sample_stdout(char_ckpt, *args)


def test_sample_py_measures_the_kernels_at_its_first_start_and_reads_them_after(char_ckpt, tmp_path, monkeypatch,
                                                                                  calibrations):
    """The first start calibrates its 5 layer shapes and keeps what it measured in the cache directory; the next
    start measures nothing (the file answers) and prints the same samples."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = calibrations
    args = ("--num_samples=3", "--max_new_tokens=12", "--dtype=float32")
    first = sample_stdout(char_ckpt, *args)
    assert measured == [3] * 5 and (tmp_path / "nanogpt" / "calibration.json").exists()
    measured.clear()
    assert sample_stdout(char_ckpt, *args) == first and measured == []
