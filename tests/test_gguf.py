"""export.py --to=gguf (machinery/weights/gguf_export.py), checked by llama.cpp itself: the files are loaded with
llama-cpp-python (a test-only dependency, built from source at install time) and what llama.cpp computes is
compared with our model.

- f32: the logits within 1e-4 of ours, where GELU is computed as llama.cpp computes it (ggml looks GELU up in
  a table of float16 values, GGML_GELU_FP16: its float32 GELU is float16-accurate); within a stated bound
  of our exact model;
- f16: the same 100 greedy tokens as our float32 model, on a trained model;
- q8_0: the perplexity on held-out text within 1 % of our float32 model's;
- the tokenizer inside the file: llama.cpp's token ids are ours.
"""

import contextlib
import importlib.util
import io
import math
import os
import random
import signal
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import serve as bench_serve
from conftest import TAUGHT, WORDS, assert_one_error_line, perturb, run_in_process, tiny_train_args
from conftest import train as train_in_process
import export
import llama_side
from machinery.data import chat
from machinery.training import scoring
from machinery.weights import checkpoint, gguf_export, quantize
from machinery.data.meta import DatasetMeta
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from model import GPT, GPTConfig
from native import in_child
import train

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed: bash .ci/install-llama-cpp")

TEXTS = ["ROMEO: What light through yonder window breaks?", "héllo — 你好世界 🚀 café\u0301 нещо",
         "  \n\n\t  x   y\t\t\n   \n", "the end<|endoftext|>A new one <|endoftext|>\n"]


def in_llama(function, *args):
    """llama_side.function(*args), run by llama.cpp in a child process (a crash there fails this test alone)."""
    return in_child("llama.cpp (llama-cpp-python)", function, *args)


def checkpoint_of(model, out_dir, data_meta):
    out_dir.mkdir(parents=True)
    checkpoint.save(checkpoint.training_state(model.state_dict(), model.config, train.TrainConfig(), data_meta,
                                              iter_num=1, best_val_loss=3.0), str(out_dir / "best.pt"))
    return out_dir


def vectors_moved(model):
    """model with its vectors (LayerNorms, biases) moved well away from their initial values (a bias or gain written
    to the wrong place shows), and its final gain x4: logits of std ~0.45 from GPT-2's initial matrices."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        model.ln_f.weight.mul_(4)
    return model


class TableGELU(nn.Module):
    """GELU as llama.cpp computes it in float32 (ggml-cpu's ggml_vec_gelu_f32 under GGML_GELU_FP16): x rounded to
    float16, its tanh-approximated GELU rounded to float16; 0 below -10, x above 10."""

    def forward(self, x):
        y = F.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@needs_llama
@pytest.mark.parametrize("bias, mlp_ratio", [(True, 4), (False, 3)])
def test_f32_logits_are_ours_in_llama_cpp(tmp_path, bias, mlp_ratio):
    """A random model exported as a user does; every position's logits of a 48-token text. Its matrices keep
    GPT-2's initial scale and its vectors (LayerNorms, biases) are moved well away from theirs (a bias or gain
    written to the wrong place would show), the final gain x4 for logits of std ~0.45: GELU's inputs stay
    small, where ggml's float16 table is fine-grained (larger ones make its rounding jump at the float16
    boundaries, which no float32 reference can follow: up to ~3e-4 at weights of std 0.05). bias=False is
    written as zero biases (llama.cpp's GPT-2 has biases); a 3x MLP keeps its width (the converter writes 4x)."""
    torch.manual_seed(3)
    ours = GPT(GPTConfig(block_size=48, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, bias=bias, gelu="tanh",
                         mlp_ratio=mlp_ratio)).eval()
    vectors_moved(ours)
    out = checkpoint_of(ours, tmp_path / "out", DatasetMeta.gpt2())
    run_in_process(export.main, f"--out_dir={out}", "--to=gguf", "--outtype=f32", tmp_path / "m.gguf", check=True)
    idx = torch.randint(0, 50257, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    n_vocab, theirs = in_llama(llama_side.vocab_and_logits, tmp_path / "m.gguf", idx)
    assert n_vocab == 50304
    exact = assert_llama_logits(theirs, ours, idx)
    assert exact.std() > 0.4


def assert_llama_logits(theirs, model, idx):
    """llama.cpp's f32 logits (numpy) of every position of idx within 1e-4 of model's where GELU is computed as
    llama.cpp computes it, within 1e-3 of model's own; returns model's own (model's GELUs are replaced)."""
    theirs = torch.from_numpy(theirs)
    with torch.no_grad():
        exact = model(torch.tensor([idx]), every_position=True)[0][0]
        for block in model.blocks:
            block.ffwd.gelu = TableGELU()
        as_llama = model(torch.tensor([idx]), every_position=True)[0][0]
    torch.testing.assert_close(theirs, as_llama, atol=1e-4, rtol=0)
    # against our own GELU: ggml's float16 table is off by up to 4e-3 (near x = 8), 1e-3 of x (measured here:
    # at most 5e-5 with biases, 3.5e-4 without)
    torch.testing.assert_close(theirs, exact, atol=1e-3, rtol=0)
    return exact


@needs_llama
def test_the_tokenizer_inside_the_file_is_ours(tmp_path):
    """llama.cpp's tokenizer, read from the file, against tiktoken's GPT-2: Unicode, whitespace runs,
    <|endoftext|> (a special token where specials are parsed); and back to the same text."""
    torch.manual_seed(0)
    out = checkpoint_of(GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=1, n_embd=32)),
                        tmp_path / "out", DatasetMeta.gpt2())
    run_in_process(export.main, f"--out_dir={out}", "--to=gguf", tmp_path / "m.gguf", check=True)  # (f16)
    ours = GPT2Tokenizer()
    specials, plain, texts, eos, bos = in_llama(llama_side.tokenizer, tmp_path / "m.gguf", TEXTS,
                                                [ours.encode(text) for text in TEXTS])
    assert specials == [ours.encode_with_specials(text) for text in TEXTS]
    assert plain == [ours.encode(text) for text in TEXTS]
    assert texts == TEXTS
    assert eos == bos == 50256


# ---------------------------------------------------------------------- a trained model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small GPT-2 BPE model trained by train.py for 40 steps of one sequence (as users train: exact GELU, no
    biases) on lines that go through 30 words in one order (each word has one successor: after 40 steps it has
    half learned it, loss ~2.0, and greedy decoding goes through the words; one sequence a step, as GPT-2's
    50,257 logits a position are most of the fixture's time), and held-out text: (out_dir, model, token ids of
    the same cycle in lines that begin elsewhere)."""
    from prepare import prepare

    root = tmp_path_factory.mktemp("gguf")
    cycle = list(WORDS)
    random.Random(0).shuffle(cycle)
    (root / "corpus.txt").write_text((" ".join(cycle) + "\n") * 200, encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(str(root / "corpus.txt"), str(root / "data" / "shakespeare"), "gpt2")
    train_in_process(*tiny_train_args(root / "data", root / "out", dataset="shakespeare", block_size=128,
                                      batch_size=1, max_iters=40, eval_interval=40, lr_decay_iters=40, eval_iters=1,
                                      warmup_iters=5, learning_rate=1e-2))
    model = checkpoint.load(root / "out" / "best.pt").build_model().eval()
    assert model.config.gelu == "none" and not model.config.bias
    held_out = GPT2Tokenizer().encode((" ".join(cycle[7:] + cycle[:7]) + "\n") * 12)[:300]
    return root / "out", model, held_out


def export_gguf(out, outtype, path):
    run_in_process(export.main, f"--out_dir={out}", "--to=gguf", f"--outtype={outtype}", path, check=True)
    return path


@needs_llama
def test_f16_greedy_tokens_are_ours_for_100_steps(tmp_path, trained):
    """100 greedy tokens from a prompt (as bench.py --mode=serve decodes in llama.cpp: its default float16 KV
    cache), and the greedy choice at each of the 127 positions of held-out text: llama.cpp reading float16
    weights picks our float32 model's token every time (its logits within 1e-2)."""
    out, model, held_out = trained
    prompt = held_out[:3]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), 100, temperature=0)[0, len(prompt):].tolist()
        ours = model(torch.tensor([held_out[:128]]), every_position=True)[0][0]
    path = export_gguf(out, "f16", tmp_path / "m.gguf")
    greedy, theirs = in_llama(llama_side.greedy_and_logits, path, prompt, 100, held_out[:128])
    theirs = torch.from_numpy(theirs)[:, :model.config.vocab_size]
    assert len(set(expected)) > 20  # varied: the model goes through the cycle's words
    assert greedy == expected
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
    torch.testing.assert_close(theirs, ours, atol=1e-2, rtol=0)


@needs_llama
def test_q8_0_perplexity_on_held_out_text_is_within_1_percent_of_float32(tmp_path, trained):
    """Over eval.py --text's windows (scoring.text_loss: 3 windows of the 300 held-out tokens), as bench.py
    --mode=serve measures llama.cpp's bits per byte."""
    out, model, held_out = trained
    nats, count = scoring.text_loss(model, held_out, "cpu")
    ours = math.exp(nats / count)
    paths = [export_gguf(out, outtype, tmp_path / f"{outtype}.gguf") for outtype in ("f32", "q8_0")]
    perplexities = dict(zip(("f32", "q8_0"), (math.exp(nats / count) for nats in
                                             in_llama(llama_side.text_losses, paths, held_out, 128))))
    assert ours < 100  # trained: far below the 50257 of a uniform guess
    assert abs(perplexities["f32"] / ours - 1) < 1e-4, (ours, perplexities)
    assert abs(perplexities["q8_0"] / ours - 1) < 0.01, (ours, perplexities)
    types = tensor_types(tmp_path / "q8_0.gguf")
    assert types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_up.bias"] == types["output_norm.weight"] == types["position_embd.weight"] == "F32"


# GGUF's value types (gguf.GGUFValueType) by number: the struct format of each fixed-size one; 8 is a string,
# 9 an array
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def tensor_types(path):
    """{tensor name: its ggml type's name}, read by hand from the file's header as GGUF's specification lays it
    out (gguf.GGUFReader takes seconds over the 100,000 strings of GPT-2's vocabulary and merges)."""
    data, at = Path(path).read_bytes(), 8  # (past the magic and the version)

    def take(fmt):
        nonlocal at
        values = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string():
        nonlocal at
        length = take("Q")
        at += length
        return data[at - length:at].decode()

    def skip(kind):
        nonlocal at
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = take("IQ")
            if inner in (8, 9):
                for _ in range(count):
                    skip(inner)
            else:
                at += count * struct.calcsize("<" + GGUF_SCALARS[inner])
        else:
            at += struct.calcsize("<" + GGUF_SCALARS[kind])

    n_tensors, n_values = take("QQ")
    for _ in range(n_values):
        string()  # the key
        skip(take("I"))
    types = {}
    for _ in range(n_tensors):
        name = string()
        take(f"{take('I')}Q")  # its dimensions
        types[name] = gguf.GGMLQuantizationType(take("I")).name
        take("Q")  # the offset of its data
    return types


def test_the_benchmarks_bytes_per_token_of_a_model_counted_by_hand():
    """bench.py --mode=serve's memory bound: the weights a decoding step reads. 1 layer, 32 wide, 100 tokens: the
    matrices 96x32, 32x32, 128x32 and 32x128, and the output layer 100x32 (the token embedding, tied)."""
    model = GPT(GPTConfig(block_size=8, vocab_size=100, n_layer=1, n_head=2, n_embd=32))
    weights, rows = 96 * 32 + 32 * 32 + 128 * 32 + 32 * 128 + 100 * 32, 96 + 32 + 128 + 32 + 100
    assert bench_serve.weight_bytes(model, "float32") == 4 * weights
    assert bench_serve.weight_bytes(model, "bfloat16") == 2 * weights
    assert bench_serve.weight_bytes(model, "int8") == weights + 2 * rows
    assert bench_serve.weight_bytes(model, "q8_0") == weights // 32 * 34


def test_the_benchmarks_int8_bound_runs_each_int8_product_of_a_step_once_per_token(monkeypatch):
    """bench.py --mode=serve's row of int8 products alone: per token, the 4 matrices of each block and the output
    layer, each once, on one row (and the model it measures is left as it was)."""
    model = GPT(GPTConfig(block_size=8, vocab_size=100, n_layer=2, n_head=2, n_embd=32))
    calls, forward = [], quantize.Int8Linear.forward

    def counted(self, x):
        calls.append((tuple(x.shape), self.out_features))
        return forward(self, x)
    monkeypatch.setattr(quantize.Int8Linear, "forward", counted)
    bench_serve.int8_products(model, 3)()
    step = [((1, 32), 96), ((1, 32), 32), ((1, 32), 128), ((1, 128), 32)] * 2 + [((1, 32), 100)]
    assert calls == step * 3
    assert not any(isinstance(m, quantize.Int8Linear) for m in model.modules())


# ---------------------------------------------------------------------- what cannot be written


def test_what_gguf_cannot_hold_is_refused_in_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    torch.manual_seed(0)
    config = dict(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)
    qk = checkpoint_of(perturb(GPT(GPTConfig(**config, qk_norm=True)), 0), tmp_path / "qk", DatasetMeta.gpt2())
    char = checkpoint_of(GPT(GPTConfig(**config)), tmp_path / "char", DatasetMeta.of(CharTokenizer("abc \n")))
    good = checkpoint_of(GPT(GPTConfig(**config)), tmp_path / "good", DatasetMeta.gpt2())
    (tmp_path / "taken.gguf").write_text("mine")
    cases = [([f"--out_dir={qk}", "--to=gguf"], "cannot express qk_norm=True"),
             ([f"--out_dir={char}", "--to=gguf"], "char tokenizer"),
             ([f"--out_dir={good}", "--to=gguf", "--outtype=q4_0"], "outtype must be one of f32, f16, q8_0"),
             ([f"--out_dir={good}", "--outtype=f16"], "--outtype is for --to=gguf"),
             ([f"--out_dir={good}", "--to=onnx"], "--to must be hf (Hugging Face GPT-2) or gguf")]
    for args, words in cases:
        assert_one_error_line(run_in_process(export.main, *args, tmp_path / "new.gguf"), words)
    assert_one_error_line(run_in_process(export.main, f"--out_dir={good}", "--to=gguf", tmp_path / "taken.gguf"),
                          "already exists")
    assert (tmp_path / "taken.gguf").read_text() == "mine"
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    assert_one_error_line(run_in_process(export.main, f"--out_dir={good}", "--to=gguf", tmp_path / "new.gguf"),
                          gguf_export.INSTALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["char", "good", "qk", "taken.gguf"]  # no temporaries


@needs_llama
def test_a_chat_model_answers_in_llama_cpp_through_its_template_and_stops_at_its_end_of_turn(tmp_path,
                                                                                            taught_chat_dir):
    """A chat model's file holds its format: the special tokens (control tokens: tokenized as ours where specials
    are parsed), its template (plain Jinja, which llama.cpp's chat renders) and the assistant's end of turn as
    llama.cpp's end of generation. llama-cpp-python's chat completion, which builds the prompt from the file's
    template alone, answers what the model was taught (TAUGHT, greedy) and stops there."""
    path = tmp_path / "chat.gguf"
    run_in_process(export.main, f"--out_dir={taught_chat_dir}", "--to=gguf", "--outtype=f32", path, check=True)
    tok = chat.tokenizer()
    whole = [chat.encode(tok, messages + [{"role": "assistant", "content": reply}])[0] for messages, reply in TAUGHT]
    template, end_of_turn, tokenized, answers = in_llama(llama_side.chat, path, 64, [tok.decode(ids) for ids in whole],
                                                         [messages for messages, _ in TAUGHT])
    assert template == chat.jinja_template(mask=False)
    assert end_of_turn == chat.stop_token()
    assert tokenized == whole
    assert answers == [(reply, "stop") for _, reply in TAUGHT]


# ---------------------------------------------------------------------- a crash in llama.cpp

CRASHES = """
import ctypes
import os
import signal

from native import in_child


def illegal_instruction():  # as llama.cpp's AMX kernels die on a CPU that will not run them
    os.kill(os.getpid(), signal.SIGILL)


def null_pointer():  # a real fault inside native code: libc reads address 0
    return ctypes.string_at(0)


def raises():
    raise ValueError("a bad file")


def answers():
    return [1, 2, 3]


def test_sigill():
    in_child("llama.cpp (llama-cpp-python)", illegal_instruction)


def test_segfault():
    in_child("llama.cpp (llama-cpp-python)", null_pointer)


def test_an_exception():
    in_child("llama.cpp (llama-cpp-python)", raises)


def test_the_next_one():
    assert in_child("llama.cpp (llama-cpp-python)", answers) == [1, 2, 3]
"""


def test_a_crash_in_llama_cpp_fails_its_test_in_one_line_naming_the_signal_and_the_suite_goes_on(tmp_path):
    """A pytest run of tests whose llama.cpp side dies of SIGILL, of SIGSEGV (a real fault in native code) or
    raises: each fails alone (the crashes with one line naming the library and the signal, the exception with
    the child's traceback), and the test after them runs and passes."""
    (tmp_path / "test_crashes.py").write_text(CRASHES)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), COLUMNS="1000")  # (summary lines uncut)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_crashes.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert proc.stdout.splitlines()[-1].startswith("3 failed, 1 passed"), proc.stdout + proc.stderr
    assert summary[:2] == [
        "FAILED test_crashes.py::test_sigill - Failed: llama.cpp (llama-cpp-python) crashed the process it ran in: "
        f"killed by SIGILL ({signal.strsignal(signal.SIGILL)})",
        "FAILED test_crashes.py::test_segfault - Failed: llama.cpp (llama-cpp-python) crashed the process it ran in: "
        f"killed by SIGSEGV ({signal.strsignal(signal.SIGSEGV)})"], proc.stdout
    assert summary[2].startswith("FAILED test_crashes.py::test_an_exception - RuntimeError: llama.cpp"), proc.stdout
    assert "ValueError: a bad file" in proc.stdout
