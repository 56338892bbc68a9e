"""Shared test helpers: a small corpus each test writes itself, and running the scripts."""

import contextlib
import io
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the environment this test run started with, as a shell gives it to a command: the processes that tests start in a
# Zygote's way get it (not what imports in this process add to os.environ as the tests go: lm_eval's, torch's...)
START_ENV = dict(os.environ)

WORDS = ("the king queen lord lady speak night day love death sword crown heart blood fair sweet "
         "good my thy thou art hath doth what who where shall will come go see hear").split()


def make_corpus(n_lines=600, seed=0):
    """Deterministic Shakespeare-like text (~25k characters) with speakers and punctuation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        if rng.random() < 0.15:
            lines.append("")
            lines.append(rng.choice(["ROMEO:", "JULIET:", "KING HENRY:", "LADY MACBETH:"]))
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(lines) + "\n"


def run(script, *args, cwd=ROOT, timeout=300, env=None, check=False):
    """Run one of the repository's scripts in a new process (only where the process boundary is what a test
    is about: exit status, signals, torchrun); return the CompletedProcess. Never waits past timeout."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true")
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now (benchmarks/serve.py's: imported here only when asked, so
    that loading conftest does not import torch)."""
    from benchmarks.serve import free_port as product_free_port

    return product_free_port()


def descendants(pid):
    """The pids of every process that pid started, and they started, ... (read from /proc)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # (the command name may hold spaces)
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc):
    """SIGKILL proc (a Popen) and every process it started, found before any dies (torchrun's workers run in
    sessions of their own and are handed to init when torchrun dies: a process group would miss them). Once
    proc has been waited for, its pid may belong to another process: then nothing is killed."""
    if proc.poll() is not None:
        return
    for pid in [proc.pid] + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.fixture
def spawn():
    """spawn(argv, popen=subprocess.Popen, **popen_kwargs) -> Popen (or what popen made: a Zygote's Forked): a
    process that the test's end kills with all it started, however the test ends (a failed assertion, a timeout),
    so no test leaves a process behind."""
    started = []

    def start(argv, popen=subprocess.Popen, **kwargs):
        started.append(popen(argv, **kwargs))
        return started[-1]

    yield start
    for proc in started:
        kill_tree(proc)


def read_lines(proc):
    """Threads move proc's stdout lines into proc.lines (None at the end) and its stderr into proc.err, so that
    no read of a Popen made with text pipes can block past a timeout (wait_for_line, finish). Returns proc."""
    proc.lines, proc.err = queue.Queue(), []
    proc.readers = [threading.Thread(target=lambda: [proc.lines.put(line) for line in proc.stdout] +
                                     [proc.lines.put(None)], daemon=True),
                    threading.Thread(target=lambda: proc.err.extend(proc.stderr or ()), daemon=True)]
    for reader in proc.readers:
        reader.start()
    return proc


def finish(proc, timeout=120):
    """Wait for proc (read_lines) to end, killing it and what it started after timeout seconds; return (stdout
    not read yet, stderr)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)
    lines = []
    while (line := proc.lines.get(timeout=10)) is not None:
        lines.append(line)
    proc.readers[1].join(timeout=10)  # the stderr thread reads to the end of the pipe
    return "".join(lines), "".join(proc.err)


def wait_for_line(proc, pattern, timeout=120):
    """Read proc's stdout (read_lines) until a line matches pattern, for at most timeout seconds; return
    everything read. Kills proc and what it started if none comes."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    kill_tree(proc)
    raise AssertionError(f"no line matching {pattern!r}; got:\n{''.join(seen)}\n{''.join(proc.err)}")


class Zygote:
    """The test's side of a tests/zygote.py process (see there): a Python that has imported modules once and
    forks scripts' processes from itself, without their start-up. close() kills it and every child it has."""

    def __init__(self, modules, env, runtime):
        self.proc = read_lines(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "zygote.py"), "--runtime=" + ",".join(sorted(runtime)), *modules],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
        self.ready, self.running, self.exited = False, set(), {}

    def _reply(self, deadline):
        """Take in the zygote's next line, if one comes by deadline (else False); the pid, if it started one."""
        try:
            line = self.proc.lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            return False
        if line is None or line.startswith("refused"):
            self.close()
            raise AssertionError(f"zygote: {line or 'ended'}\n{''.join(self.proc.err)}")
        kind, *values = line.split()
        if kind == "ready":
            self.ready = True
        elif kind == "exited":
            self.running.discard(int(values[0]))
            self.exited[int(values[0])] = int(values[1])
        else:  # started (an earlier child of that pid has been reported: its status goes)
            self.running.add(int(values[0]))
            self.exited.pop(int(values[0]), None)
            return int(values[0])

    def start(self, argv, env, stdout, stderr, timeout=120):
        """Fork `python *argv` (argv[0] a script) in env, its output into the files stdout and stderr (FIFOs
        opened for reading, or files it makes); its pid."""
        deadline = time.time() + timeout
        request = dict(argv=[str(a) for a in argv], env=env, cwd=str(ROOT), stdout=str(stdout), stderr=str(stderr))
        while not self.ready:
            self._expect(deadline, "ready")
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while (pid := self._expect(deadline, "started")) is None:
            pass
        return pid

    def _expect(self, deadline, what):
        """_reply, but the zygote is closed and the test fails if nothing comes by deadline."""
        if (reply := self._reply(deadline)) is False:
            self.close()
            raise AssertionError(f"zygote: no {what} in time\n{''.join(self.proc.err)}")
        return reply

    def wait(self, pid, timeout):
        """pid's exit status (Popen.returncode's), waiting at most timeout seconds (subprocess.TimeoutExpired)."""
        deadline = time.time() + timeout
        while pid not in self.exited:
            if self._reply(deadline) is False:
                raise subprocess.TimeoutExpired(f"pid {pid}", timeout)
        return self.exited.pop(pid)

    def popen(self, argv, env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True):
        """A Forked child, for the Popen(argv, ...) that spawn would make: output through pipes, as text."""
        assert argv[0] == sys.executable and Path(cwd) == ROOT and stdout == stderr == subprocess.PIPE and text
        fifos, pipes = Path(tempfile.mkdtemp()), []
        try:
            for name in ("stdout", "stderr"):
                os.mkfifo(fifos / name)
                pipes.append(os.open(fifos / name, os.O_RDONLY | os.O_NONBLOCK))  # (so that the zygote's open returns)
            pid = self.start(argv[1:], env, fifos / "stdout", fifos / "stderr")
        except BaseException:
            for fd in pipes:
                os.close(fd)
            raise
        finally:
            shutil.rmtree(fifos)
        for fd in pipes:
            os.set_blocking(fd, True)  # (its writer is there now: an end of file is the child's end)
        return Forked(self, pid, argv, *(open(fd) for fd in pipes))

    def kill(self, pid):
        """SIGKILL pid and what it started, unless it has ended."""
        if pid in self.running:
            for p in [pid] + descendants(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)

    def close(self):
        kill_tree(self.proc)  # (with its children; it has nothing to save, and a Python with torch takes ~1 s to exit)


class Forked:
    """A child of a Zygote, used as a Popen is (pid, args, stdout, stderr, poll, wait, send_signal, returncode),
    by spawn, read_lines, finish and kill_tree."""

    def __init__(self, zygote, pid, args, stdout, stderr):
        self.zygote, self.pid, self.args, self.stdout, self.stderr = zygote, pid, args, stdout, stderr
        self.returncode = None

    def wait(self, timeout):
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
        return self.returncode

    def poll(self):
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)


@pytest.fixture(scope="session")
def zygotes():
    """zygotes(modules, runtime, env, n) -> n Zygotes that imported modules (each its own Python, as separate
    processes are: its own hash seed) under env (START_ENV and settings) but for the variables in runtime (those a
    request may change, see tests/zygote.py), started the first time they are asked for and kept for the session."""
    pool = {}

    def get(modules, runtime, env, n):
        base = {k: v for k, v in env.items() if k not in runtime}
        zs = pool.setdefault((tuple(modules), tuple(sorted(runtime)), tuple(sorted(base.items()))), [])
        while len(zs) < n:
            zs.append(Zygote(modules, base, runtime))
        return zs[:n]

    yield get
    for zygote in [z for zs in pool.values() for z in zs]:
        zygote.close()


# what the scripts whose processes tests start import (train.py, tests/faulty_train.py, serve.py): start_script
# forks them from a Zygote that has imported all of it
SCRIPT_IMPORTS = ("train", "faults", "torch._dynamo", "serve", "fastapi", "uvicorn")


@pytest.fixture
def start_script(spawn, zygotes):
    """start_script(script, *args) -> `python script args` in a process of its own (forked by a Zygote: what a
    signal or an exit status shows does not depend on how long its start took) in START_ENV, unbuffered, through
    spawn (killed with what it started when the test ends, however it ends), its output read by read_lines. numpy's
    BLAS on one thread (a thread of its own at import would not survive the fork; the scripts do no BLAS through
    numpy)."""

    def start(script, *args):
        env, zygote = script_zygote(zygotes)
        return read_lines(spawn([sys.executable, str(ROOT / script), *map(str, args)], popen=zygote.popen, cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    return start


def script_zygote(zygotes):
    """(the environment start_script runs a script in, the Zygote it forks it from), that Zygote started now if it
    is not yet (it then imports while the test goes on)."""
    env = dict(START_ENV, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
    return env, zygotes(SCRIPT_IMPORTS, (), env, 1)[0]


def runs(request, test_name):
    """Does this session run the test named test_name (of any module)?"""
    return any(item.name == test_name for item in request.session.items)


def tiny_train_args(data_dir, out_dir, **overrides):
    """Arguments for a training run of a few seconds on the CPU. The dtype is float32 unless a test says
    otherwise: dtype=auto is bfloat16 on some CPUs and float32 on others, and tests compare runs (the
    choice itself is tested under both answers: the cpu_bf16 fixture)."""
    args = dict(dataset="tiny", data_dir=data_dir, out_dir=out_dir, device="cpu", dtype="float32", compile=False,
                n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, gradient_accumulation_steps=1,
                max_iters=20, eval_interval=10, eval_iters=2, log_interval=1, warmup_iters=2,
                lr_decay_iters=20, learning_rate=1e-3, dropout=0.0)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def finetune_args(init_from, data_dir, out_dir, **overrides):
    """Arguments for config/finetune_shakespeare.py from a Hugging Face GPT-2 directory (init_from; or resume),
    made small enough for a few seconds on the CPU; float32 for the reason tiny_train_args gives."""
    args = dict(init_from=init_from, data_dir=data_dir, out_dir=out_dir, device="cpu", dtype="float32", compile=False,
                block_size=32, batch_size=2, gradient_accumulation_steps=1, max_iters=4, eval_interval=2,
                eval_iters=2, log_interval=1)
    args.update(overrides)
    return [str(ROOT / "config" / "finetune_shakespeare.py")] + [f"--{k}={v}" for k, v in args.items()]


@pytest.fixture
def eager_dynamo(monkeypatch):
    """torch.compile with dynamo's "eager" backend (what dynamo traces, recompiles and breaks does not depend on
    the backend; the test stays quick), from a fresh dynamo; yields dynamo's counters."""
    import functools

    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    try:
        yield counters
    finally:
        torch._dynamo.reset()


def fake_hub(monkeypatch, tmp_path, files, repo_id="HuggingFaceFW/fineweb-edu"):
    """huggingface_hub's two calls that documents.HubSource makes, faked (no network here): repo_id's dataset lists
    files ({name: texts}, beside a README.md), and hf_hub_download gives each as a local parquet file of a text
    column. Returns the names fetched, in the order asked."""
    import huggingface_hub as hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    local, fetched = {}, []
    for i, (name, texts) in enumerate(files.items()):
        local[name] = str(tmp_path / f"hub_{i}.parquet")
        pq.write_table(pa.table({"text": texts}), local[name])

    def download(repo, filename, repo_type=None, revision=None):
        assert (repo, repo_type, revision) == (repo_id, "dataset", None)
        fetched.append(filename)
        return local[filename]

    monkeypatch.setattr(hub.HfApi, "list_repo_files", lambda self, repo, repo_type=None, revision=None:
                        ["README.md", *files] if repo == repo_id else [])
    monkeypatch.setattr(hub, "hf_hub_download", download)
    return fetched


@pytest.fixture
def calibrations(monkeypatch):
    """The `most` of each measurement packing.calibrate makes (a layer shape each, _rows_alone), as they are made."""
    from machinery.generation import packing

    made, rows_alone = [], packing._rows_alone

    def counting(linear, most):
        made.append(most)
        return rows_alone(linear, most)
    monkeypatch.setattr(packing, "_rows_alone", counting)
    return made


@pytest.fixture
def tf32_off():
    """Both TF32 flags off (cudnn's is on by default), put back as they were after the test (train.py on CUDA turns
    them on for the whole process). By hand: the flags live behind __getattr__/__setattr__, not in a __dict__,
    and monkeypatch's undo would delete them."""
    import torch

    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = [flag.allow_tf32 for flag in flags]
    for flag in flags:
        flag.allow_tf32 = False
    yield
    for flag, value in zip(flags, saved):
        flag.allow_tf32 = value


@pytest.fixture(params=[False, True], ids=["cpu_emulates_bf16", "cpu_computes_bf16"])
def cpu_bf16(request, monkeypatch):
    """Each answer of hardware.cpu_native("bfloat16") in turn, whatever this CPU is: tests of what
    dtype=auto does on the CPU run under both, so the suite checks both CPU kinds on either kind.
    Returns the dtype auto must then pick (bfloat16 only where the CPU computes it natively)."""
    import torch

    from machinery import hardware

    real = hardware.cpu_native
    monkeypatch.setattr(hardware, "cpu_native", lambda dtype: request.param if dtype == "bfloat16" else real(dtype))
    return torch.bfloat16 if request.param else torch.float32


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(make_corpus(), encoding="utf-8")
    return path


@pytest.fixture
def char_data(tmp_path, corpus_file):
    """A prepared character-level dataset named `tiny`; returns its data_dir (parent of tiny/)."""
    from prepare import prepare

    data_dir = tmp_path / "data"
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(str(corpus_file), str(data_dir / "tiny"), "char")
    return data_dir


def prepare_once(tmp_path_factory, name, tokenizer):
    """The dataset `name` of make_corpus() in tokenizer (char or gpt2), in a new directory; returns its data_dir."""
    from prepare import prepare

    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text(make_corpus(), encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):
        prepare(str(root / "corpus.txt"), str(root / "data" / name), tokenizer)
    return root / "data"


@pytest.fixture(scope="module")
def module_data(tmp_path_factory):
    """The same dataset made once per test module (for module-scoped trained fixtures)."""
    return prepare_once(tmp_path_factory, "tiny", "char")


@pytest.fixture(scope="module")
def module_bpe_data(tmp_path_factory):
    """bpe_data's dataset (GPT-2 BPE, named shakespeare) made once per test module."""
    return prepare_once(tmp_path_factory, "shakespeare", "gpt2")


@pytest.fixture
def bpe_data(tmp_path, corpus_file):
    """A small Shakespeare-like dataset in GPT-2 BPE named `shakespeare`; returns its data_dir."""
    from prepare import prepare

    with contextlib.redirect_stdout(io.StringIO()):
        prepare(str(corpus_file), str(tmp_path / "data" / "shakespeare"), "gpt2")
    return tmp_path / "data"


def perturb(model, seed):
    """model's parameters moved well away from their initial values (LayerNorm gains 1, biases 0, small
    matrices), so that a mistake (an untransposed square matrix, a bias left out, the wrong GELU) moves
    the logits far more than a 1e-4 tolerance."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def hf_model(seed=0, **overrides):
    """A tiny random, perturbed GPT2LMHeadModel of `transformers` (pinned in requirements-dev.txt) with GPT-2's
    vocabulary, in eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    args = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    args.update(overrides)
    return perturb(GPT2LMHeadModel(GPT2Config(**args)), seed).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A saved random GPT-2 (save_pretrained: config.json + model.safetensors) and the model itself."""
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model = hf_model()
    model.save_pretrained(path)
    return path, model


def run_in_process(main, *args, check=False):
    """Run a script's main(argv) in this process as its `__main__` block does (under errors.run_main), with
    stdout and stderr captured; return (returncode, stdout, stderr) like run(). Much faster than a subprocess;
    an exception that run_main does not turn into `error: ...` fails the test, as a traceback would show."""
    from machinery.errors import run_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(lambda: main([str(a) for a in args]))
            returncode = 0
        except SystemExit as e:
            returncode = e.code
    proc = subprocess.CompletedProcess(args, returncode, out.getvalue(), err.getvalue())
    if check and returncode != 0:
        raise AssertionError(f"main({' '.join(map(str, args))}) exited {returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def train(*args, check=True):
    """train.py's main in this process; returns the CompletedProcess-like result (stdout: the log)."""
    import train as train_script

    return run_in_process(train_script.main, *args, check=check)


def assert_one_error_line(proc, *words):
    """Bad input: exit status 2, exactly one non-empty stderr line `error: ...` containing words, no traceback.
    Returns the line."""
    assert proc.returncode == 2, f"exit status {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def assert_one_line(excinfo, *words):
    """An error caught in this process (pytest.raises' excinfo): a message of one line containing words (what
    assert_one_error_line checks of a whole command, for a function called directly). Returns the message."""
    message = str(excinfo.value)
    assert "\n" not in message, message
    for word in words:
        assert str(word) in message, message
    return message


def load_checkpoint(path):
    """A checkpoint file as the dict on disk (read as sample.py and train.py read it: weights only)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


# what the tiny chat model of taught_chat_dir is taught to answer: greedy decoding gives these replies back
TAUGHT = [([{"role": "user", "content": "Hello"}], "Hi there!"),
          ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"}], "Goodbye.")]


@pytest.fixture(scope="session")
def taught_chat_dir(tmp_path_factory):
    """out_dir/best.pt of a tiny GPT-2 BPE chat model (block 64) taught TAUGHT's replies and to end them with the
    assistant's end of turn."""
    from machinery.data import chat

    return teach_chat_model(tmp_path_factory.mktemp("chat") / "taught",
                            [messages + [{"role": "assistant", "content": reply}] for messages, reply in TAUGHT],
                            lambda tok, messages: chat.encode(tok, messages))


def teach_chat_model(out, conversations, encode, block_size=64):
    """out/best.pt of a tiny GPT-2 BPE chat model taught conversations (encode(tokenizer, messages): their (ids,
    mask)): full-batch AdamW on the masked tokens (the assistant's) until it knows them; out."""
    import torch

    from machinery.data import chat
    from machinery.weights import checkpoint
    from machinery.data.meta import DatasetMeta
    from model import GPT, GPTConfig
    from train import TrainConfig

    tok = chat.tokenizer()
    rows = [encode(tok, messages) for messages in conversations]
    width = max(len(ids) for ids, _ in rows) - 1
    x = torch.tensor([ids[:-1] + [0] * (width - len(ids) + 1) for ids, _ in rows])
    y = torch.tensor([[t if m else -1 for t, m in zip(ids[1:], mask[1:])] + [-1] * (width - len(ids) + 1)
                      for ids, mask in rows])
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, n_layer=1, n_head=2, n_embd=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    head, taught = model.lm_head, y != -1

    class Taught(torch.nn.Module):  # the output layer where a token is taught alone (it is most of a step's work)
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, hidden):
            return self.head(hidden[taught])

    model.lm_head = Taught()
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(model(x, every_position=True)[0], y[taught])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:  # each taught token at probability ~0.99: greedy decoding gives it (~60 steps)
            break
    model.lm_head = head
    out.mkdir()
    state = checkpoint.training_state(model.state_dict(), model.config, TrainConfig(),
                                      DatasetMeta.gpt2(chat=chat.TEMPLATE), iter_num=0, best_val_loss=float("inf"))
    checkpoint.save(state, str(out / checkpoint.BEST))
    return out
