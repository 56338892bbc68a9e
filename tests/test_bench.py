"""bench.py on tiny models and a tiny corpus: the modes run, read training config files, and report what they
measured."""

import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

import bench
from benchmarks import chat as bench_chat
from benchmarks import prepare as bench_prepare
from benchmarks import runs as bench_runs
from benchmarks import serve as bench_serve
from conftest import ROOT, assert_one_error_line, make_corpus, run_in_process
from machinery import configurator
from machinery.data import chat, meta
from machinery.configurator import UserError
from machinery.hardware import pick_dtype
from machinery.data.tokenizer import gpt2_encoding
from model import GPT, GPTConfig

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--device=cpu", "--warmup=1", "--repeats=3"]


def fake_clock(monkeypatch, durations, module=bench):
    """module's (bench.py's) time.perf_counter replaced by a clock whose measured intervals (one pair of calls each, in
    order) last the given durations (binary fractions of 2 decimals at most: exact in floats and as printed),
    the real work still done in between; returns the list of readings taken, to count them."""
    readings, ticks = [], []
    now = 1000.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1  # (time between the intervals, unmeasured)
    ticks.reverse()
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: readings.append(ticks.pop()) or
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


def test_sample_py_is_timed_as_users_run_it_by_the_rate_it_says(hf_dir, monkeypatch):
    """bench.py --mode=serve's row "sample.py, whole process": greedy sample.py processes asked for SAMPLE_FEW + n
    new tokens, each saying on stderr the rate of the n after its first SAMPLE_FEW; the median of the runs'; the
    text it printed is transformers' greedy continuation of the same prompt."""
    from transformers import GPT2LMHeadModel

    path, _ = hf_dir
    n, few = 5, bench_serve.SAMPLE_FEW
    rate, text = bench_serve.sample_command(str(path), "cpu", "float32", n, repeats=1)
    assert rate > 0
    enc = gpt2_encoding()
    prompt = torch.tensor([enc.encode(bench_serve.SAMPLE_START)])
    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        ids = hf.generate(prompt, max_new_tokens=few + n, do_sample=False, pad_token_id=50256)[0, prompt.size(1):]
    assert 50256 not in ids.tolist() and text == enc.decode(ids.tolist())
    assert bench_serve.sample_text(str(path), "cpu", "float32", n) == text  # the engine's, in-process

    def says(*lines):  # sample.py stood in for: runs whose stderr holds these lines, in turn
        runs = iter(lines)
        monkeypatch.setattr(bench_serve.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
            a, 0, f"{bench_serve.SAMPLE_START} x\n---------------\n", next(runs)))
    line = "decoded {} tokens in 1.000 s: {} tokens/s (after each sample's first 2)\n"
    says(line.format(5, "1,250.5"), line.format(5, "10.0"), line.format(5, "300.0"))
    assert bench_serve.sample_command(str(path), "cuda", "bfloat16", n, repeats=3) == (300.0, " x")  # the median
    # fewer tokens than asked (it stopped early), or no line: an error, not a figure
    for stderr in (line.format(4, "300.0"), "device cuda\n"):
        says(stderr)
        with pytest.raises(RuntimeError, match=f"sample.py did not say it decoded {n} tokens after its first 2"):
            bench_serve.sample_command(str(path), "cuda", "bfloat16", n, repeats=1)
    # a run whose CUDA graph failed to capture (the fixed step's note on stderr) is an error, not an eager figure
    from machinery.generation import decode

    says(f"{decode.EAGER_NOTE} (RuntimeError: operation not permitted when stream is capturing)\n" + line.format(5, 1))
    with pytest.raises(RuntimeError, match="sample.py's CUDA graph was not captured: note: the decoding step"):
        bench_serve.sample_command(str(path), "cuda", "bfloat16", n, repeats=1)


def test_the_prompt_table_times_each_length_on_each_dtype_in_turn_and_says_whether_auto_keeps_up(monkeypatch, capsys):
    """bench.py --mode=serve's prompt table with serve.py and its clock stood in for: a server at the dtype and one
    at float32, each length's prompt (the first tokens of one random prompt) to each in turn, a warm-up round
    not counted, the median of the rounds after; and the verdict line."""
    started, asked = [], []
    monkeypatch.setattr(bench_serve, "free_port", lambda: 9000 + len(started))
    monkeypatch.setattr(bench_serve, "start_server", lambda hf_dir, dtype, port, *settings:
                        started.append((dtype, port, settings)) or SimpleNamespace(terminate=lambda: None,
                                                                                   wait=lambda timeout: 0))
    took = {9000: [9, 9, 1, 3, 2, 4], 9001: [9, 9, 2, 4, 3, 4]}  # quarters of a second: (warm-up), 2, 5, 2, 5
    monkeypatch.setattr(bench_serve, "one_token_after", lambda url, prompt: asked.append((url, prompt)) or
                        took[int(url.split(":")[2].split("/")[0])].pop(0) / 4)
    medians = bench_serve.prompt_times("DIR", "cpu", "bfloat16", [2, 5], repeats=2)
    assert started == [("bfloat16", 9000, ("--device=cpu",)), ("float32", 9001, ("--device=cpu",))]
    assert [len(prompt) for _, prompt in asked] == [2, 2, 5, 5] * 3 and asked[1][1] == asked[2][1][:2]
    assert [url for url, _ in asked[:2]] == [f"http://127.0.0.1:{p}/v1/completions" for p in (9000, 9001)]
    assert medians == {"bfloat16": {2: 0.375, 5: 0.875}, "float32": {2: 0.625, 5: 1.0}}
    assert "bfloat16 no slower than float32 at every length: yes" in capsys.readouterr().out
    started.clear()
    took = {9000: [9, 9, 3, 3, 3, 3], 9001: [9, 9, 2, 4, 2, 4]}  # the dtype slower at the short prompt
    bench_serve.prompt_times("DIR", "cpu", "bfloat16", [2, 5], repeats=2)
    assert "bfloat16 no slower than float32 at every length: NO" in capsys.readouterr().out


def test_sample_py_row_refuses_a_model_that_stops_early(tmp_path):
    """A greedy decode that reaches <|endoftext|> before SAMPLE_FEW + n tokens would time fewer tokens than it
    claims: the row stops with the reason."""
    from conftest import hf_model

    model = hf_model()
    with torch.no_grad():  # the last LayerNorm's output, whatever its input: <|endoftext|>'s embedding, so it wins
        model.transformer.wte.weight[50256] *= 10
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(model.transformer.wte.weight[50256])
    model.save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match=r"greedy decoding ends after [01] tokens \(<\|endoftext\|>\), not 7"):
        bench_serve.sample_text(str(tmp_path), "cpu", "float32", 5)


def clock_readings(monkeypatch, readings, module=bench):
    """module's time.perf_counter replaced by one that returns readings in turn; returns those left unread."""
    left = list(reversed(readings))
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: left.pop()))
    return left


def test_train_mode_reads_a_training_config_file(capsys, monkeypatch):
    # a warm-up timed alone (8 s: two readings), then the measured iterations on one clock: marks after each
    left = clock_readings(monkeypatch, [100.0, 108.0, 200.0, 200.25, 201.25, 201.75])
    median = bench.main([str(ROOT / "config/train_shakespeare_char.py"), "--mode=train", "--batch_size=2",
                         "--compile=False", *TINY])
    out = capsys.readouterr().out
    assert left == [] and median == 0.5  # the measured iterations' median (with the warm-up: 0.75)
    assert "1 micro-steps x batch 2 x 16 tokens = 32 tokens" in out  # gradient_accumulation_steps from the file
    assert "the loss read every 10 (log_interval)" in out  # (the file's log_interval)
    assert re.findall(r"^  (warm-up|iter \d) +(\S+) ms$", out, re.M) == \
        [("warm-up", "8000.0"), ("iter 1", "250.0"), ("iter 2", "1000.0"), ("iter 3", "500.0")]
    # ms/iter, and tokens/s = 32 tokens / seconds per iteration; no MFU on a CPU (no known peak)
    assert re.findall(r"^(median|min|max) +(\S+) +(\S+) +(\S+)$", out, re.M) == \
        [("median", "500.0", "64", "-"), ("min", "250.0", "128", "-"), ("max", "1000.0", "32", "-")]


def test_train_mode_waits_for_the_device_only_where_train_py_does(monkeypatch):
    """The measured iterations run back to back as in train.py's loop: the loss is read (the host waits for the
    device) after every warm-up iteration, then only every log_interval iterations; so is nothing else."""
    import train

    reads, step = [], train.Trainer.optimizer_step

    class Loss:
        def __init__(self, loss):
            self.loss = loss

        def item(self):
            reads.append(len(steps))
            return self.loss.item()

    def counted(self, x, y):
        steps.append(1)
        loss, x, y = step(self, x, y)
        return Loss(loss), x, y

    steps = []
    monkeypatch.setattr(train.Trainer, "optimizer_step", counted)
    monkeypatch.setattr(bench, "sync", lambda device: reads.append(("sync", len(steps))))
    bench.main(["--mode=train", "--batch_size=2", "--compile=False", "--log_interval=3", "--vocab_size=65",
                *TINY[:-2], "--warmup=2", "--repeats=7"])
    # warm-ups: synced before, read after; then the clock's start (synced), reads at iterations 3 and 6 of the 7
    # measured (steps 5 and 8 in all), the clock's end (synced)
    assert reads == [("sync", 0), 1, ("sync", 1), 2, ("sync", 2), 5, 8, ("sync", 9)]


@pytest.mark.parametrize("arg,message", [("--mode=fast", "mode must be sample, train, speedrun, prepare, "
                                                        "serve, faults, chat, gpu, tokenizers or conversation, got 'fast'"),
                                         ("--chat_sft_iters=0", "chat_sft_iters must be positive"),
                                         ("--prompt_len=17", "prompt_len .17. must be at most block_size"),
                                         ("--num_proc=-1", "num_proc must not be negative"),
                                         ("--corpus_mb=0", "corpus_mb must be positive"),
                                         ("--recipe=tpu", "recipe must be cpu or gpu, got 'tpu'"),
                                         ("--parts=tests,bench", "parts must be some of tests,sample,decode,serve,"
                                                                 "train,speedrun separated by commas, got "
                                                                 "'tests,bench'"),
                                         ("--mode=serve", "prompt_lens must be numbers of tokens from 1 to "
                                                          "block_size .16. separated by commas, got '64,256")])
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


# ---------------------------------------------------------------------- beside nanoGPT's train.py

# nanoGPT's configurator.py (github.com/karpathy/nanoGPT), its logic as it is: config files are executed, then each
# --key=value must name one of train.py's globals and literal_eval to a value of the same type
NANOGPT_CONFIGURATOR = '''
import sys
from ast import literal_eval
for arg in sys.argv[1:]:
    if '=' not in arg:
        exec(open(arg).read())
    else:
        assert arg.startswith('--')
        key, val = arg.split('=')
        key = key[2:]
        if key in globals():
            try:
                attempt = literal_eval(val)
            except (SyntaxError, ValueError):
                attempt = val
            assert type(attempt) == type(globals()[key]), (key, attempt)
            globals()[key] = attempt
        else:
            raise ValueError(f"Unknown config key: {key}")
'''
# a stand-in for nanoGPT's train.py (no torch, nothing trained): its globals and their defaults, its configurator
# run from the working directory, its data read from data/DATASET, and its log lines (each step's time from
# FAKE_TIMES, the loss 4 - step / 10, val loss 3.5), in its order (eval, then the step; steps 0 to max_iters);
# what it was given goes to FAKE_REPORT
NANOGPT_TRAIN = '''
import json, os, pickle
out_dir = 'out'; eval_interval = 2000; log_interval = 1; eval_iters = 200; eval_only = False
always_save_checkpoint = True; init_from = 'scratch'; wandb_log = False; wandb_project = 'owt'
wandb_run_name = 'gpt2'; dataset = 'openwebtext'; gradient_accumulation_steps = 5 * 8; batch_size = 12
block_size = 1024; n_layer = 12; n_head = 12; n_embd = 768; dropout = 0.0; bias = False; learning_rate = 6e-4
max_iters = 600000; weight_decay = 1e-1; beta1 = 0.9; beta2 = 0.95; grad_clip = 1.0; decay_lr = True
warmup_iters = 2000; lr_decay_iters = 600000; min_lr = 6e-5; backend = 'nccl'; device = 'cuda'
dtype = 'bfloat16'; compile = True
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open('configurator.py').read())
data_dir = os.path.join('data', dataset)
with open(os.path.join(data_dir, 'meta.pkl'), 'rb') as f:
    vocab_size = pickle.load(f)['vocab_size']
tokens = os.path.getsize(os.path.join(data_dir, 'train.bin')) // 2
with open(os.environ['FAKE_REPORT'], 'w') as f:
    json.dump({k: globals()[k] for k in config_keys} | {'vocab_size': vocab_size, 'train_tokens': tokens}, f)
print(f"tokens per iteration will be: {gradient_accumulation_steps * batch_size * block_size:,}")
times = [float(t) for t in os.environ['FAKE_TIMES'].split(',')]
for it in range(max_iters + 1):
    if it % eval_interval == 0:
        print(f"step {it}: train loss 3.4000, val loss 3.5000")
    print(f"iter {it}: loss {4 - it / 10:.4f}, time {times[it]:.2f}ms, mfu -100.00%")
'''


@pytest.fixture
def nanogpt(tmp_path, monkeypatch):
    """A clone of nanoGPT as --nanogpt wants it (train.py beside configurator.py and model.py), with the stand-in
    train.py; returns (its train.py, the file its report goes to)."""
    clone = tmp_path / "nanoGPT"
    clone.mkdir()
    (clone / "train.py").write_text(NANOGPT_TRAIN)
    (clone / "configurator.py").write_text(NANOGPT_CONFIGURATOR)
    (clone / "model.py").write_text("")
    monkeypatch.setenv("FAKE_REPORT", str(tmp_path / "nanogpt.json"))
    return clone / "train.py", tmp_path / "nanogpt.json"


def scripts_in_process(monkeypatch, scripts):
    """`python SCRIPT ...` processes of the benchmarks (subprocess.run) run in this process instead when SCRIPT is
    one of ours (in ROOT) named by a key of scripts (its main); others (nanoGPT's train.py) run as they are.
    Returns the argument lists each got."""
    real, calls = subprocess.run, {name: [] for name in scripts}

    def run(argv, cwd=None, **kwargs):
        path = os.path.join(cwd or os.getcwd(), argv[1]) if len(argv) > 1 else ""
        name = os.path.basename(path)
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(ROOT) or name not in scripts:
            return real(argv, cwd=cwd, **kwargs)
        calls[name].append(argv[2:])
        proc = run_in_process(scripts[name], *argv[2:])
        return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout, proc.stderr)

    monkeypatch.setattr(subprocess, "run", run)  # (the benchmarks' modules share this one subprocess module)
    return calls


@pytest.fixture
def train_in_process(monkeypatch):
    """Our train.py's runs (`python train.py ...` processes in the benchmark) in this process instead (faster; what
    is tested is what the benchmark makes of them); other processes (nanoGPT's) run as they are. Returns the
    argument lists our train.py was given."""
    import train

    return scripts_in_process(monkeypatch, {"train.py": train.main})["train.py"]


def parse(log, first_step):
    return bench_runs.parse_log("run", log, 1.0, None, first_step)


def test_logs_are_read_step_by_step_whoever_numbers_them():
    # ours numbers a step's line after it (iter 1 is the first step), nanoGPT's before it (iter 0)
    ours = parse("tokens per iteration: 2,048 (1 process(es) x ...)\niter 1: loss 2.0000, time 10.00ms, tok/s 1\n"
                 "iter 2: loss 1.5000, time 30.00ms, tok/s 1\niter 3: loss 1.2500, time 20.00ms, tok/s 1\n"
                 "step 3: train loss 1.3000, val loss 1.4000\n", first_step=1)
    theirs = parse("tokens per iteration will be: 2,048\nstep 0: train loss 4.1, val loss 4.2000\n"
                   "iter 0: loss 2.0200, time 99.00ms, mfu -100.00%\niter 1: loss 1.5000, time 5.00ms, mfu 1.00%\n"
                   "step 2: train loss 1.1000, val loss 1.2000\n", first_step=0)
    assert ours.steps == [(0, 10.0, 2.0), (1, 30.0, 1.5), (2, 20.0, 1.25)] and ours.tokens_per_iter == 2048
    assert (ours.val_loss, theirs.val_loss) == (1.4, 1.2)  # the last evaluation's
    assert theirs.steps == [(0, 99.0, 2.02), (1, 5.0, 1.5)]
    assert ours.ms_per_iter(warmup=1) == 25.0 and theirs.ms_per_iter(warmup=1) == 5.0  # steps 1 and 2 / step 1
    assert ours.ms_per_iter(warmup=0, until=2) == 20.0  # steps 0 and 1
    # steps 0 and 1 in both: 2.0 against 2.02 is 0.99 % of 2.02
    assert bench_runs.loss_gap(ours, theirs) == (2, pytest.approx(0.02 / 2.02, rel=1e-12))
    with pytest.raises(UserError, match="no `tokens per iteration` or `step N: ... val loss` line"):
        parse("iter 1: loss 2.0, time 1.0ms\n", first_step=1)


def test_settings_are_written_as_both_configurators_read_them_back():
    cfg = bench.BenchConfig(dropout=0.0, learning_rate=1e-3, bias=False, dtype="float32", max_iters=5, compile=None)
    args = bench_runs.setting_args(cfg, ["dropout", "learning_rate", "bias", "dtype", "max_iters", "compile"])
    assert args == ["--dropout=0.0", "--learning_rate=0.001", "--bias=False", "--dtype=float32", "--max_iters=5"]
    assert dataclasses.asdict(configurator.parse(bench.BenchConfig, args)) == dataclasses.asdict(cfg)


def test_a_bad_nanogpt_path_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text("")  # no configurator.py beside it
    for path in (tmp_path / "train.py", tmp_path / "none.py"):
        proc = run_in_process(bench.main, "--mode=train", f"--nanogpt={path}", *TINY)
        assert_one_error_line(proc, "--nanogpt must be the path of nanoGPT's train.py", str(path))
    with pytest.raises(UserError, match="nanogpt is a setting of mode=train and mode=speedrun, not mode=sample"):
        bench.main(["--mode=sample", f"--nanogpt={tmp_path / 'train.py'}", *TINY])


def tiny_model_flops_per_token(vocab, n_layer=1, n_embd=16, n_head=2, block_size=16):
    """6N + 12 L H Q T (the PaLM paper's FLOPs per token) for a GPT without biases: N counts the token embedding
    (it is the output layer too) and, per block, two LayerNorm gains and 12 n_embd^2 of matrices, and the final
    LayerNorm's gain (not the position embedding)."""
    n = vocab * n_embd + n_layer * (12 * n_embd ** 2 + 2 * n_embd) + n_embd
    return 6 * n + 12 * n_layer * n_head * (n_embd // n_head) * block_size


def test_train_mode_runs_ours_and_nanogpts_train_py_side_by_side(capsys, monkeypatch, module_data, nanogpt,
                                                                   train_in_process):
    fake, report = nanogpt
    # nanoGPT's 5 steps (0-4, one more than ours): step 0 unmeasured, then 30, 10, 25 ms: median 25 ms; step 4
    # (after its last evaluation, which its time includes) left out
    monkeypatch.setenv("FAKE_TIMES", "500,30,10,25,900")
    monkeypatch.setattr(bench_runs, "peak_flops", lambda device: 1e9)  # as if on a GPU of 1 GFLOP/s
    ours, theirs = bench_runs.bench_beside_nanogpt(
        configurator.parse(bench.BenchConfig, ["--mode=train", f"--nanogpt={fake}", f"--data_dir={module_data}",
                                               "--dataset=tiny", "--batch_size=2", "--gradient_accumulation_steps=3",
                                               "--eval_iters=2", "--dropout=0.0",
                                               "--compile=False", "--dtype=float32", "--learning_rate=1e-3",
                                               *TINY]),
        str(module_data.parent), bench.TrainConfig)
    given = json.loads(report.read_text())
    # every setting both scripts have, as ours resolved it, in the type nanoGPT's configurator insists on
    vocab = meta.read(module_data / "tiny").vocab_size
    assert given | {"out_dir": None} == {
        "out_dir": None, "eval_interval": 4, "log_interval": 1, "eval_iters": 2, "eval_only": False,
        "always_save_checkpoint": True, "init_from": "scratch", "wandb_log": False, "wandb_project": "owt",
        "wandb_run_name": "gpt2", "dataset": "bench", "gradient_accumulation_steps": 3, "batch_size": 2,
        "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.0, "bias": False,
        "learning_rate": 1e-3, "max_iters": 4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
        "decay_lr": True, "warmup_iters": 2000, "lr_decay_iters": 600000, "min_lr": 6e-5, "backend": "nccl",
        "device": "cpu", "dtype": "float32", "compile": False, "vocab_size": vocab,
        "train_tokens": os.path.getsize(module_data / "tiny" / "train.bin") // 2}
    # ours: the same settings, 4 steps, a line each
    assert len(train_in_process) == 1 and "--max_iters=4" in train_in_process[0]
    assert [step for step, _, _ in ours.steps] == [0, 1, 2, 3] and theirs.val_loss == 3.5
    out = capsys.readouterr().out
    tokens = 3 * 2 * 16
    mfu = tiny_model_flops_per_token(vocab) * tokens / 0.025 / 1e9
    row = re.search(r"^nanoGPT's train.py +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", out, re.M)
    assert row.groups()[1:] == ("3.5000", "25.00", f"{tokens / 0.025:,.0f}", f"{mfu:.1%}")
    assert re.search(r"^our train.py +\S+ +\d\.\d{4} +\S+ +\S+ +\S+%$", out, re.M)
    # nanoGPT's losses 4.0, 3.9, ... against ours (about 3.6 here, the log of the vocabulary size)
    gap = max(abs(loss - (4 - step / 10)) / (4 - step / 10) for step, _, loss in ours.steps)
    assert f"training losses of the same 4 steps: at most {gap:.3%} apart" in out


def test_speedrun_mode_runs_the_recipe_through_nanogpts_train_py_too(capsys, monkeypatch, module_data, tmp_path,
                                                                     nanogpt, train_in_process):
    # a speedrun and a recipe of a few steps on the tiny corpus (the real ones train for minutes)
    tiny = dict(dataset="tiny", n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2,
                gradient_accumulation_steps=1, eval_iters=2, device="cpu", compile=False, dtype="float32", dropout=0.0,
                warmup_iters=1, lr_decay_iters=3)
    monkeypatch.setitem(bench_runs.NANOGPT_RECIPES, "cpu", [f"--{k}={v}" for k, v in tiny.items()]
                        + ["--max_iters=3", "--eval_interval=3"])
    speedrun = tmp_path / "speedrun.py"
    speedrun.write_text("".join(f"{k} = {v!r}\n" for k, v in (tiny | dict(max_iters=2, eval_interval=2,
                                                                          optimizer="muon")).items()))
    fake, report = nanogpt
    monkeypatch.setenv("FAKE_TIMES", "90,30,10,20")  # nanoGPT's 4 steps (0-3); step 0 unmeasured: median 20 ms
    # wall times of the runs in order: speedrun, recipe (ours), recipe (nanoGPT's); twice
    fake_clock(monkeypatch, [2.0, 8.0, 16.0, 4.0, 8.0, 12.0], module=bench_runs)
    ratio = bench.main(["--mode=speedrun", "--repeats=2", f"--speedrun={speedrun}", f"--nanogpt={fake}",
                        f"--data_dir={module_data}"])
    assert ratio == 0.375  # the median of 2 / 8 and 4 / 8
    assert [args[0] for args in train_in_process] == [str(speedrun), "--dataset=tiny"] * 2
    assert json.loads(report.read_text())["max_iters"] == 3  # the recipe's settings
    out = capsys.readouterr().out
    assert re.findall(r"^pair (\d): speedrun (\S+) s .* nanoGPT's recipe (\S+) s .* ratio (\S+); nanoGPT's "
                      r"train.py (\S+) s \(val 3.5000\)$", out, re.M) == \
        [("1", "2.0", "8.0", "0.250", "16.0"), ("2", "4.0", "8.0", "0.500", "12.0")]
    assert re.search(r"^median: speedrun 3.0 s \(val \S+\), nanoGPT's recipe 8.0 s \(val \S+\), ratio 0.375$", out,
                     re.M)
    rows = re.findall(r"^(speedrun|recipe, our train.py|recipe, nanoGPT's train.py) +(\S+) +\S+ +(\S+) +\S+ +-$",
                      out, re.M)
    assert [(name, wall) for name, wall, _ in rows] == [("speedrun", "3.0"), ("recipe, our train.py", "8.0"),
                                                       ("recipe, nanoGPT's train.py", "14.0")]
    assert rows[2][2] == "20.00"  # ms/iter: steps 1-3 (warmup 1)


# ---------------------------------------------------------------------- chat finetuning (issue 28)

# the replies the task's questions ask for, written out here: W is the list as the user gave it
COUNT = {0: "None.", 1: "One.", 2: "Two.", 3: "Three."}
REPLIES = {"How many of them are animals?": lambda w: COUNT[len(set(w) & set(bench_chat.ANIMALS))],
           "Is the first word an animal?": lambda w: "Yes." if w[0] in bench_chat.ANIMALS else "No.",
           "Is the last word an animal?": lambda w: "Yes." if w[2] in bench_chat.ANIMALS else "No.",
           "Which word came first?": lambda w: f"The first word is {w[0]}."}


def listed_words(messages):
    """The words of a conversation's list, as its first user message gives them."""
    return re.fullmatch(r"Here are some words: ([a-z ]+)\. .*", messages[1]["content"])[1].split()


def test_the_chat_task_holds_out_word_sets_never_trained_on():
    train, heldout = bench_chat.make_task(seed=5, n_train=600, n_heldout=150)
    assert (train, heldout) == bench_chat.make_task(seed=5, n_train=600, n_heldout=150)  # from the seed alone
    assert bench_chat.make_task(seed=6, n_train=600, n_heldout=150)[1] != heldout
    trained = {frozenset(listed_words(messages)) for messages in train}
    # the base model's pretraining text: the training conversations' contents, line by line, and nothing else
    text = "\n\n".join("\n".join(m["content"] for m in messages[1:]) for messages in train[:2]) + "\n"
    assert bench_chat.plain_text(train[:2]) == text
    held = {frozenset(listed_words(messages)) for messages in heldout}
    assert len(held) == 150 and not held & trained  # distinct, and none of them ever trained on
    tok, enc = chat.tokenizer(), gpt2_encoding()
    assert all(len(enc.encode_ordinary(" " + word)) == 1 for word in bench_chat.WORDS)  # a word is a token
    assert len(set(bench_chat.ANIMALS)) == len(set(bench_chat.THINGS)) == 25 and len(set(bench_chat.WORDS)) == 50
    kinds = set()
    for messages in train + heldout:
        words = listed_words(messages)
        assert len(words) == 3 and len(set(words)) == 3
        assert messages[0] == {"role": "system", "content": bench_chat.SYSTEM}
        turns = list(zip(messages[1::2], messages[2::2]))
        assert len(turns) in (2, 3) and len(messages) == 1 + 2 * len(turns)
        asked = [user["content"].removeprefix(f"Here are some words: {' '.join(words)}. ") for user, _ in turns]
        assert len(set(asked)) == len(asked)  # a question once a conversation
        assert [(user["role"], reply["role"]) for user, reply in turns] == [("user", "assistant")] * len(turns)
        assert [reply["content"] for _, reply in turns] == [REPLIES[q](words) for q in asked]
        assert len(chat.encode(tok, messages)[0]) <= 128  # within the benchmark's block_size
        kinds |= {(len(words), i > 0, q) for i, q in enumerate(asked)}
    # every question, in the first turn and in later ones
    assert kinds == {(3, later, q) for later in (False, True) for q in REPLIES}


def test_the_masked_loss_is_the_mean_over_every_assistant_token(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=128, vocab_size=50304)).eval()
    tok = chat.tokenizer()
    conversations = bench_chat.make_task(seed=1, n_train=0, n_heldout=3)[1]  # of different lengths: padded
    bench_chat.write_jsonl(conversations, tmp_path / "heldout.jsonl")
    split = bench_chat.heldout_split(str(tmp_path / "heldout.jsonl"), tok)
    total, count = 0.0, 0
    for messages in conversations:  # each alone: -log p of each assistant token (content and end), written out
        ids, mask = chat.encode(tok, messages)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]), every_position=True)
        logp = torch.log_softmax(logits[0].double(), dim=-1)
        for t in range(1, len(ids)):
            if mask[t]:
                total, count = total - logp[t - 1, ids[t]].item(), count + 1
    assert count == sum(len(tok.encode(m["content"])) + 1 for c in conversations for m in c
                        if m["role"] == "assistant")
    assert bench_chat.masked_loss(model, split, "cpu", batch_size=2) == \
        pytest.approx(total / count, rel=1e-5)  # (float32 logits against float64 sums)


def test_chat_mode_runs_end_to_end(capsys):
    threads = torch.get_num_threads()
    try:  # (one thread: a tiny model's small operations run faster alone on 2 cores that other jobs share)
        results = bench.main(["--mode=chat", "--chat_pretrain_iters=1",
                              "--chat_sft_iters=6", "--chat_train=40", "--chat_heldout=2", "--n_layer=1",
                              "--n_head=2", "--n_embd=32", "--batch_size=1", "--eval_iters=1", "--device=cpu",
                              "--dtype=float32", "--threads=1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert [(r.name, r.lora, r.loss_on, r.steps) for r in results] == [
        ("pretrained, no finetuning", False, "-", 1), ("full", False, "assistant", 6),
        ("full, all tokens", False, "all", 6), ("LoRA", True, "assistant", 6), ("LoRA, all tokens", True, "all", 6)]
    # each model answered every assistant turn of the 2 held-out conversations
    replies = sum(len(m) // 2 for m in bench_chat.make_task(1337, 40, 2)[1])
    counted = re.findall(r"^(.+): (\S+)% of (\d+) held-out replies exact, (\S+)% end with", out, re.M)
    assert [(name, int(n)) for name, _, n, _ in counted] == [(r.name, replies) for r in results]
    assert all(0 <= r.accuracy <= 1 and 0 <= r.ended <= 1 and r.loss > 0 for r in results)
    assert results[0].accuracy == 0  # a model of one step cannot answer
    # a model that learned nothing fails here: each finetuning lowers the held-out masked loss (what masked
    # finetuning minimises) below the untaught model's, ln of the vocabulary. Reached at 6 steps: 10.83 untaught,
    # 8.97 full, 9.21 full on all tokens, 10.31 and 10.49 LoRA; asserted with about half of each drop to spare
    # (exact replies, the majority's "Yes."/"No.", would take ~20 steps of a 64-wide model: ~6 s more)
    untaught, full, full_all, lora, lora_all = (r.loss for r in results)
    assert untaught > 10.5 and full < untaught - 1.0 and full_all < untaught - 0.8
    assert lora < untaught - 0.25 and lora_all < untaught - 0.15
    assert all(set(r.by_question) <= set(bench_chat.QUESTIONS) for r in results)
    # the runs, as a user types them
    assert len(re.findall(r"^\$ python train.py .*--init_from=\S+pretrained-hf --dataset=chat", out, re.M)) == 4
    assert re.search(r"^\$ python train.py .*--lora_rank=8 .*--chat_loss=all", out, re.M)
    table = out[out.index("command: `python bench.py"):]
    assert "--mode=chat" in table.splitlines()[0] and "torch " + torch.__version__ in table.splitlines()[1]
    rows = re.findall(r"^\| (.+?) \| (\S+) \| (\d+) \| \d+ s \| (\S+)% \| (\S+)% \| (\S+) \|$", table, re.M)
    assert [(name, on, int(steps), float(loss)) for name, on, steps, _, _, loss in rows] == \
        [(r.name, r.loss_on, r.steps, round(r.loss, 4)) for r in results]


def test_chat_mode_without_its_text_is_one_line(tmp_path):
    proc = run_in_process(bench.main, "--mode=chat", "--chat_pretrain=text", f"--text_source={tmp_path / 'none.txt'}")
    assert_one_error_line(proc, "--text_source", "none.txt")


DECODE_LEVERS = [f"decoding lever: decode_attention={a}, compile={c}, decode_ahead={d}"
                 for a, c, d in (("full", False, False), ("full", False, True), ("flex", False, True),
                                 ("full", True, True), ("flex", True, True))]
GPU_LINES = ["CUDA tests", "sample.py bfloat16, ", "sample.py float32, ", *DECODE_LEVERS,
             "serve.py's engine, one request", "serve.py ",
             "serve.py, one client", "serve.py, 8 seeded requests", "Muon's step against AdamW's",
             "GPT-2 124M training step", "training lever: speedrun model, muon, cuda_graph=False",
             "training lever: speedrun model, adamw, cuda_graph=False",
             "training lever: speedrun model, muon, compile=True",
             "training lever: GPT-2 124M, sdpa_backend=flash", "training lever: GPT-2 124M, sdpa_backend=cudnn",
             "training lever: GPT-2 124M, batch_size=2 gradient_accumulation_steps=2",
             "GPU speedrun against nanoGPT's recipe"]


def test_gpu_mode_runs_its_quick_form_on_a_cpu_and_prints_every_line(capsys, monkeypatch):
    # the real parts, small: serve.py and the CUDA tests' pytest as processes; sample.py's, train.py's and
    # prepare.py's runs in this process (tests of their own above time them as processes); the CUDA test files
    # cut to one (the suite runs them all anyway)
    import prepare
    import sample
    import train
    from benchmarks import gpu

    calls = scripts_in_process(monkeypatch, {"sample.py": sample.main, "train.py": train.main,
                                             "prepare.py": prepare.main})
    monkeypatch.setattr(gpu, "CUDA_TESTS", ["tests/test_cuda_decoding.py"])
    points = bench.main(["--mode=gpu", "--device=cpu"])
    out = capsys.readouterr().out
    assert len(points) == len(GPU_LINES) and all(p.name.startswith(n) for p, n in zip(points, GPU_LINES)), points
    # on a CPU no goal is judged and no lever chooses: every figure is "not measured" but the one that holds anywhere
    assert [p.verdict for p in points] == ["not measured"] * 11 + ["PASS"] + ["not measured"] * 9, points
    assert out.startswith("machine: no GPU: device cpu")
    # each line printed as it was measured, before the report repeats them (a command stopped at a lent GPU's time
    # limit keeps what it measured)
    measuring = out.split("; this command took")[0]
    assert all(measuring.count(p.line()) == 1 for p in points), measuring
    assert out.index(points[3].line()) < out.index("top kernels per decoded token, batch 1") < \
        out.index(points[4].line())  # (a decoding lever's row, then its kernels, then the next lever's)
    assert out.index(points[12].line()) < out.index("speedrun model, muon, top kernels") < out.index(points[14].line())
    table = re.findall(r"^\| (.+) \| (.+) \| (PASS|FAIL|not measured) \|$", out, re.M)
    assert [name for name, _, _ in table] == [p.name for p in points]
    measured = [figure for name, figure, verdict in table[1:] if verdict != "PASS" and "compile=True" not in name
                and "cuda_graph=True" not in name and "cudnn" not in name
                and "decode_attention=flex" not in name]
    assert all(figure.endswith("(CPU quick form)") for figure in measured), measured
    # each decoding lever's rates, each training lever's against its model's defaults
    assert all(re.search(r"batch 1: [\d,]+ tokens/s; 4 rows: [\d,]+ tokens/s", p.figure) for p in points[3:5])
    assert points[5].figure.startswith("the quick form leaves flex out")
    assert re.fullmatch(r"max_batch 32: stepped here [\d,]+, in its thread with a reader [\d,]+; max_batch 1: "
                        r"stepped here [\d,]+, in its thread with a reader [\d,]+ \(CPU quick form\)", points[8].figure)
    assert all(re.search(r"ms/iter; at the defaults [\d,.]+ \([\d.]+x\)", p.figure)
               for p in points[14:16] + points[17:18] + points[19:20])
    # a kernel this CPU has not: train.py's one-line refusal
    assert points[18].figure.startswith("train.py refuses it here: sdpa_backend=cudnn cannot run"), points[18]
    # the profile sections: the top operators per decoded token (batch 1 of each lever measured, 4 rows at the
    # defaults) and of a training iteration of each model
    titles = re.findall(r"^(top kernels per decoded token, .+|.+, top kernels of one iteration): [\d,.]+ µs a "
                        r"(token|iter) in all$", out, re.M)
    dtype = pick_dtype("auto", "cpu")  # (the engine's, as users run it: float32, or bfloat16 where it is native)
    assert [t for t, _ in titles] == ["top kernels per decoded token, " + title.replace("decoding lever: ", "")
                                      for title in (f"batch 1, {dtype}, {DECODE_LEVERS[0]}",
                                                    f"4 rows, {dtype}, {DECODE_LEVERS[0]}",
                                                    f"batch 1, {dtype}, {DECODE_LEVERS[1]}")] + [
                                      "speedrun model, muon, top kernels of one iteration",
                                      "GPT-2 124M, top kernels of one iteration"], titles
    # the training part's models as train.py trains them: the speedrun model with shakespeare_char's 65 characters
    # (bench.py's random tokens would take GPT-2's vocabulary where that dataset is not prepared), GPT-2's padded
    assert re.findall(r"^model: .*, vocab (\d+)\)", out, re.M) == ["65"] * 2 + ["50304"] + ["65"] * 2 + \
        ["50304"] * 2, out
    assert [os.path.basename(args[0]) for args in calls["train.py"]] == ["speedrun_shakespeare_char_gpu.py",
                                                                         "train_shakespeare_char.py"]
    assert len(calls["sample.py"]) == 1  # (float32 only, one run: repeats 1)


def test_gpu_mode_runs_the_parts_asked_for(capsys, monkeypatch):
    from benchmarks import gpu

    ran = []
    for name in ("cuda_tests", "decoding", "decode_levers", "serving", "training_steps", "speedrun"):
        monkeypatch.setattr(gpu, name, lambda *args, name=name: ran.append(name) or [])
    monkeypatch.setattr(gpu.serve, "gpt2_shaped", lambda cfg, directory: None)
    bench.main(["--mode=gpu", "--device=cpu", "--parts=train,tests"])
    assert ran == ["cuda_tests", "training_steps"]  # in the report's order, whatever the order asked


def test_gpu_mode_judges_a_gpus_figures_by_the_goals_and_a_failed_part_does_not_stop_the_rest(monkeypatch, capsys):
    # a GPU stood in for: each part's figures made up, the verdicts by the goals (2,000 tokens/s; 15,000 and 6,000
    # tokens/s at 32 and 8 clients, 1,500 for one); a part that raises is one FAIL line; no time left: no speedrun
    from benchmarks import gpu

    rates = {"bfloat16": 1900.0, "float32": 600.0}
    monkeypatch.setattr(gpu, "pick_device", lambda device: "cuda")
    monkeypatch.setattr(gpu, "pick_dtype", lambda dtype, device: "bfloat16")  # (an H100's auto)
    monkeypatch.setattr(gpu, "machine", lambda device: "machine: a stand-in GPU")
    monkeypatch.setattr(gpu.serve, "gpt2_shaped", lambda cfg, directory: None)
    monkeypatch.setattr(gpu, "cuda_tests", lambda on_gpu: [gpu.Point("CUDA tests", "12 passed", "PASS")])
    monkeypatch.setattr(gpu.serve, "sample_text", lambda *args: "text")
    monkeypatch.setattr(gpu.serve, "sample_command", lambda hf_dir, device, dtype, n, repeats: (rates[dtype], "text"))
    monkeypatch.setattr(gpu.serve, "transformers_greedy", lambda hf_dir, device, dtype, prompt, n: dtype)
    monkeypatch.setattr(gpu, "timings", lambda run, repeats: [500 / {"bfloat16": 250, "float32": 100}[run]] * 3)
    monkeypatch.setattr(gpu, "decode_levers", lambda hf_dir, on_gpu, size: [gpu.lever("decoding lever: one",
                                                                                      "2,500 tokens/s", on_gpu)])
    monkeypatch.setattr(gpu.serve, "server", lambda *args: contextlib.nullcontext(args[3:]))
    monkeypatch.setattr(gpu, "one_client_parts", lambda *args: [])
    clients = {1: 1600.0, 8: 6000.0, 32: 14000.0}
    monkeypatch.setattr(gpu.serve, "stream_rate",
                        lambda url, n, tokens: (clients[n] if not url else 700.0, [], []))
    monkeypatch.setattr(gpu.serve, "seeded_same", lambda url, tokens: (4000.0, 900.0, True))
    monkeypatch.setattr(gpu, "training_steps", lambda on_gpu, size, step: 1 / 0)
    points = bench.main(["--mode=gpu", "--budget_s=100"])
    verdicts = [(p.name.split(",")[0].split(" (")[0], p.verdict) for p in points]
    assert verdicts == [("CUDA tests", "PASS"),
                        ("sample.py bfloat16", "FAIL"),  # 1,900 tokens/s
                        ("sample.py float32", "PASS"),
                        ("decoding lever: one", "lever"),  # a lever's row: judged by no goal
                        ("serve.py bfloat16", "FAIL"),  # 14,000 at 32 clients
                        ("serve.py", "PASS"),  # one client: 1,600 (700 at max_batch 1)
                        ("serve.py", "PASS"),  # seeded: the same
                        ("train", "FAIL"),  # the part that raised
                        ("GPU speedrun against nanoGPT's recipe", "not measured")]  # 100 s budget
    assert "ZeroDivisionError" in points[7].figure and "1,600 at max_batch 32, 700 at max_batch 1" in points[5].figure
    rates["bfloat16"], clients[32] = 2000.0, 15000.0
    judged = bench.main(["--mode=gpu", "--budget_s=100"])
    assert judged[1].verdict == judged[4].verdict == "PASS"
    clients[8] = 5999.0
    assert bench.main(["--mode=gpu", "--budget_s=100"])[4].verdict == "FAIL"
    assert "| sample.py bfloat16" in capsys.readouterr().out


# ---------------------------------------------------------------------- mode=tokenizers

# Du Fu's 春望, whose title, poet and first line are the mode's sample prompt: the verse of the test's corpus
SPRING_VIEW = ["國破山河在，城春草木深。", "感時花濺淚，恨別鳥驚心。", "烽火連三月，家書抵萬金。", "白頭搔更短，渾欲不勝簪。"]
# a model the size of the test's (the mode's MODEL less its wall-time stop: its runs end at max_iters here)
TOKENIZERS_MODEL = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2",
                    "--gradient_accumulation_steps=1", "--dropout=0.0", "--learning_rate=1e-3", "--decay_lr=False",
                    "--warmup_iters=1", "--eval_interval=1000000", "--eval_iters=1", "--log_interval=1",
                    "--max_iters=3", "--compile=False", "--device=cpu"]


def tokenizers_corpus(n_lines=2000, seed=0):
    """n_lines lines of 12 characters each (a multiple of 10 lines: prepare.py's validation split, the last tenth of
    the characters, starts a line, so the splits' tokens are the whole text's): 春望's lines, lines of its
    characters and of its title's and poet's at random, and lines of English words."""
    import random

    from conftest import WORDS

    rng = random.Random(seed)
    chars = sorted(set("".join(SPRING_VIEW) + "春望杜甫") - set("，。"))
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.2:
            lines.append(rng.choice(SPRING_VIEW))
        elif kind < 0.6:
            lines.append("".join(rng.choice(chars) for _ in range(5)) + "，" +
                         "".join(rng.choice(chars) for _ in range(5)) + "。")
        else:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(4))[:11].ljust(11) + ".")
    return "".join(line + "\n" for line in lines)


def tokenizers_scripts_in_process(monkeypatch):
    """The mode's `python SCRIPT ...` processes of ours run in this process instead (SCRIPT's main: faster; train.py
    then ends at its max_iters, where the mode's run() would stop a process --train_s seconds after its start: tested
    below on a process); `python -c` (the two learners) still as processes. Returns the (args, stop_after) of each."""
    import eval as eval_script
    import prepare
    import sample
    import train
    from benchmarks import tokenizers

    mains = {"prepare.py": prepare.main, "train.py": train.main, "eval.py": eval_script.main, "sample.py": sample.main}
    real, calls = tokenizers.run, []

    def run(args, stop_after=None):
        calls.append((args, stop_after))
        if args[0] not in mains:
            return real(args, stop_after)
        return run_in_process(mains[args[0]], *args[1:], check=True).stdout, 0.0

    monkeypatch.setattr(tokenizers, "run", run)
    monkeypatch.setattr(tokenizers, "BPE_SIZES", (320, 512))
    monkeypatch.setattr(tokenizers, "COMPARED", 512)
    monkeypatch.setattr(tokenizers, "MODEL", TOKENIZERS_MODEL)
    monkeypatch.setattr(tokenizers, "EVAL_CHARS", 520)  # of the 2,600 of the validation split
    return calls


def test_tokenizers_mode_runs_end_to_end_and_counts_what_tiktoken_counts(tmp_path, monkeypatch):
    import ast
    import resource

    from benchmarks import tokenizers

    text = tokenizers_corpus()
    path = tmp_path / "verse.txt"
    path.write_text(text, encoding="utf-8")
    calls = tokenizers_scripts_in_process(monkeypatch)
    out = run_in_process(bench.main, "--mode=tokenizers", f"--input={path}", "--train_s=1", check=True).stdout
    n_chars, n_bytes = len(text), len(text.encode("utf-8"))
    assert f"verse.txt: {n_chars:,} characters, {n_bytes:,} bytes" in out.splitlines()
    # compression: char is a token a character, GPT-2 tiktoken's tokens, the learned BPEs the vocabularies asked for
    rows = re.findall(r"^\| (\S+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+|-) \| [\d.]+ \|$", out,
                      re.M)
    figures = {name: (int(vocab.replace(",", "")), int(tokens.replace(",", "")), float(cpt), float(bpt), learned)
               for name, vocab, tokens, cpt, bpt, learned in rows}
    assert list(figures) == ["char", "gpt2", "bpe320", "bpe512"]
    gpt2_tokens = len(gpt2_encoding().encode_ordinary(text))
    for name, vocab, tokens in (("char", len(set(text)), n_chars), ("gpt2", 50257, gpt2_tokens)):
        assert figures[name][:2] == (vocab, tokens), name
        assert figures[name][2:4] == (pytest.approx(n_chars / tokens, abs=5e-4),
                                      pytest.approx(n_bytes / tokens, abs=5e-3)), name
    for name, size in (("bpe320", 320), ("bpe512", 512)):
        vocab, tokens, cpt, bpt, learned = figures[name]
        assert vocab == size and learned != "-" and tokens < n_bytes, name
        assert (cpt, bpt) == (pytest.approx(n_chars / tokens, abs=5e-4), pytest.approx(n_bytes / tokens, abs=5e-3))
    # the two learners, each a process of its own, at the compared size
    learners = re.findall(r"^\| (rustbpe|HF tokenizers) \| [\d.]+ \| (\d+) \| ([\d.]+) \|$", out, re.M)
    assert [name for name, _, _ in learners] == ["rustbpe", "HF tokenizers"]
    # each learner's own peak memory: not that of the process it was started from (this one, with torch: more)
    assert all(0 < int(peak) < resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 for _, peak, _ in learners)
    assert "| learner (0.5k, training split) |" in out
    # equal time: each model stopped --train_s after its start (here: at max_iters), its bits per byte and sample
    assert [stop for args, stop in calls if args[0] == "train.py"] == [1, 1, 1]
    assert all(stop is None for args, stop in calls if args[0] != "train.py")
    assert "Equal wall time: 1 s of train.py each" in out and "on the first 520 characters of the validation" in out
    trained = re.findall(r"^\| (\S+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ('.*') \|$", out, re.M)
    assert [(name, int(iters)) for name, iters, *_ in trained] == [("char", 3), ("gpt2", 3), ("bpe512", 3)]
    assert all(float(loss) > 0 and float(bpb) > 0 for _, _, loss, bpb, _ in trained)
    samples = {name: ast.literal_eval(sample) for name, *_, sample in trained}
    assert len(samples["char"]) == tokenizers.SAMPLE_CHARS and set(samples["char"]) <= set(text)
    for name in ("char", "gpt2", "bpe320", "bpe512", "rustbpe", "HF tokenizers"):  # each figure's line as it comes
        assert re.search(rf"^{name}: {{", out, re.M), name


def test_tokenizers_mode_without_its_text_is_one_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    for path, what in ((tmp_path / "none.txt", "none.txt is not a file"), (empty, "empty.txt is empty")):
        proc = run_in_process(bench.main, "--mode=tokenizers", f"--input={path}")
        assert_one_error_line(proc, "mode=tokenizers", what, "--input")
        assert proc.stdout == "" and sorted(os.listdir(tmp_path)) == ["empty.txt"]  # no figure, no file


def test_tokenizers_mode_stops_a_process_when_asked_and_its_failure_is_one_line():
    # a process that only a signal ends: run() sends SIGTERM stop_after seconds after its start and returns what it
    # printed (as train.py saves and exits 0); blocked here until its handler is set (the mask is inherited)
    import signal

    from benchmarks import tokenizers
    from conftest import assert_one_line

    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (print('stopped'), sys.exit(0)))\n"
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
            "print('started', flush=True)\n"
            "time.sleep(60)")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        out, seconds = tokenizers.run(["-c", code], stop_after=0.2)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert out == "started\nstopped\n" and seconds >= 0.2
    # a learner's code of several lines that fails: one line, its last line of stderr, not the code
    with pytest.raises(UserError) as excinfo:
        tokenizers.run(["-c", "import sys\nprint('a first line', file=sys.stderr)\nsys.exit('no learner here')"])
    assert assert_one_line(excinfo, "python -c failed (exit 1): no learner here") == \
        "python -c failed (exit 1): no learner here"
