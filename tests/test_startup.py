"""What a command does before its first token, made cheap without changing what it computes: a model about to be
loaded is built without drawing initial weights (GPT.with_weights), and GPT-2's BPE comes from a cache file in
tiktoken's own format instead of being rebuilt from its BPE files at every start."""

import hashlib
import inspect
import json
import re
import subprocess
import sys

import pytest
import tiktoken
import tiktoken_ext.openai_public
import torch

from conftest import ROOT, perturb
from machinery.data import tokenizer
from machinery.generation import calibration_cache, engine, packing
from machinery.generation.calibration_cache import CalibrationCache
from model import GPT, GPTConfig

CONFIG = dict(block_size=16, vocab_size=70, n_layer=2, n_head=2, n_embd=32, bias=True)


def test_with_weights_is_the_model_that_loading_a_state_dict_makes_and_draws_no_random_numbers():
    """The same parameters as GPT(config) + load_weights (every one, the tied output layer included, which is the
    token embedding's tensor), the same logits, and torch's random stream left exactly where it was."""
    torch.manual_seed(0)
    state = perturb(GPT(GPTConfig(**CONFIG)), 1).state_dict()
    loaded = GPT(GPTConfig(**CONFIG))
    loaded.load_weights(state)
    before = torch.get_rng_state()
    built = GPT.with_weights(GPTConfig(**CONFIG), state)
    assert torch.equal(torch.get_rng_state(), before)
    assert built.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in loaded.state_dict().items():
        assert built.state_dict()[name].device.type == "cpu" and torch.equal(built.state_dict()[name], tensor), name
    assert built.lm_head.weight is built.tok_emb.weight
    idx = torch.randint(0, 70, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(built.eval()(idx)[0], loaded.eval()(idx)[0])


def test_with_weights_takes_bfloat16_weights_as_float32_and_refuses_weights_that_do_not_fit():
    torch.manual_seed(0)
    state = GPT(GPTConfig(**CONFIG)).state_dict()
    half = GPT.with_weights(GPTConfig(**CONFIG), {k: v.bfloat16() for k, v in state.items()})
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    assert torch.equal(half.tok_emb.weight, state["tok_emb.weight"].bfloat16().float())
    with pytest.raises(ValueError, match="missing.*ln_f.weight"):
        GPT.with_weights(GPTConfig(**CONFIG), {k: v for k, v in state.items() if k != "ln_f.weight"})
    with pytest.raises(ValueError, match="do not fit"):
        GPT.with_weights(GPTConfig(**{**CONFIG, "n_embd": 64}), state)


@pytest.fixture
def fresh_gpt2(tmp_path, monkeypatch):
    """GPT-2's encoding built anew (the module's own built encoding forgotten), with the cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tokenizer, "_gpt2", None)
    return tmp_path / "nanogpt" / "gpt2.tiktoken"


TEXT = "ROMEO: What light through yonder window breaks? héllo 你好 🚀<|endoftext|>  \n\t x"


def test_gpt2_bpe_is_cached_as_tiktoken_s_own_r50k_file_and_loads_from_it_alone(fresh_gpt2, monkeypatch):
    """The first start writes the cache: byte for byte the file tiktoken publishes as r50k_base (GPT-2's ranks),
    whose sha256 is read here from tiktoken's own source; the next start encodes from it alone (GPT-2's BPE files
    and tiktoken's download both made unavailable) and gives the same ids, special token included."""
    first = tokenizer.gpt2_encoding()
    published = re.search(r'r50k_base\.tiktoken",\s*expected_hash="([0-9a-f]{64})"',
                          inspect.getsource(tiktoken_ext.openai_public)).group(1)
    assert hashlib.sha256(fresh_gpt2.read_bytes()).hexdigest() == published
    monkeypatch.setattr(tokenizer, "_gpt2", None)
    monkeypatch.setattr(tokenizer, "_local_gpt2_files", lambda: None)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("the cache was not used"))
    second = tokenizer.gpt2_encoding()
    assert second is not first
    assert second.encode(TEXT, allowed_special="all") == first.encode(TEXT, allowed_special="all")
    assert second._mergeable_ranks == first._mergeable_ranks and second.n_vocab == 50257


def test_a_damaged_gpt2_cache_is_built_again_from_the_bpe_files(fresh_gpt2):
    expected = tokenizer.gpt2_encoding().encode_ordinary(TEXT)
    good = fresh_gpt2.read_bytes()
    damaged = good.replace(b" 300\n", b" 301\n", 1)  # one rank changed
    assert damaged != good
    fresh_gpt2.write_bytes(damaged)
    tokenizer._gpt2 = None
    assert tokenizer.gpt2_encoding().encode_ordinary(TEXT) == expected
    assert fresh_gpt2.read_bytes() == good


def test_torch_is_imported_with_the_collector_paused_and_the_collector_runs_again_after():
    """In a fresh Python (this one has torch already): importing machinery.torch_import imports torch with no
    collection while torch's modules run (gc.callbacks count those whose stack is in torch's files: a plain
    `import torch` has hundreds), and afterwards the collector is on and collects as before."""
    code = ("import gc, os, sys\n"
            "inside, after = [], []\n"
            "def seen(phase, info):\n"
            "    frame = sys._getframe(1)\n"
            "    while frame and os.sep + 'torch' + os.sep not in frame.f_code.co_filename:\n"
            "        frame = frame.f_back\n"
            "    (inside if frame else after).append(phase)\n"
            "gc.callbacks.append(seen)\n"
            "import machinery.torch_import\n"
            "after.clear()\n"
            "cycles = [[] for _ in range(10000)]\n"
            "for c in cycles: c.append(c)\n"
            "print(len(inside), 'torch' in sys.modules, gc.isenabled(), len(after) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "True", "True"]


def calibrated_engine(cache, max_batch):
    """An Engine over a small model, packed on this CPU (float32), calibrated with cache."""
    from test_engine import Tokens, small_model

    return engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70), max_batch=max_batch,
                         calibration=cache)


def test_calibration_is_measured_once_on_a_machine_and_read_from_its_file_after(tmp_path, calibrations):
    """The first engine measures its model's five shapes (64 -> 192, 64 -> 64, 64 -> 256, 256 -> 64 and the output
    layer's 64 -> 70) and writes them; the next engines, for as many rows or fewer, measure nothing
    and get the same answers; one that may hold more rows than were measured measures again."""
    path = tmp_path / "calibration.json"
    first = calibrated_engine(CalibrationCache(path), 8)
    assert len(calibrations) == 5 and path.exists()
    rows = {k: v["min_rows"] for k, v in json.loads(path.read_text())["layers"].items()}
    calibrations.clear()
    for max_batch in (8, 3):
        again = calibrated_engine(CalibrationCache(path), max_batch)
        assert calibrations == [] and again.pass_rows == min(first.pass_rows, max_batch)
        assert {calibration_cache.layer_key(m): m.min_rows for m in again.model.modules()
                if isinstance(m, packing.RowsLinear)} == rows
    calibrated_engine(CalibrationCache(path), 12)
    assert len(calibrations) == 5


def test_what_the_file_says_is_what_the_engine_takes(tmp_path, calibrations):
    """A file written here by hand (this machine, each shape rounding otherwise beyond 3 rows, a lone row padded
    to 4) decides the engine's passes without a measurement; a file of another machine (a thread more), or a
    damaged one, is measured again and written anew."""
    path = tmp_path / "calibration.json"
    probe = calibrated_engine(None, 2)
    keys = {calibration_cache.layer_key(m) for m in probe.model.modules() if isinstance(m, packing.RowsLinear)}
    layers = {key: {"min_rows": 4, "limit": 3, "measured": 8} for key in keys}
    path.write_text(json.dumps({"machine": calibration_cache.machine(), "layers": layers}))
    calibrations.clear()
    runner = calibrated_engine(CalibrationCache(path), 32)
    assert calibrations == [] and runner.pass_rows == 3
    assert {m.min_rows for m in runner.model.modules() if isinstance(m, packing.RowsLinear)} == {4}
    other = dict(calibration_cache.machine(), threads=torch.get_num_threads() + 1)
    damaged = (json.dumps({"machine": other, "layers": layers}), "{not json", json.dumps({"machine": 1}),
               json.dumps({"machine": calibration_cache.machine(), "layers": [1]}),
               json.dumps({"machine": calibration_cache.machine(), "layers": {k: {"min_rows": 0, "limit": "3",
                                                                                   "measured": 8} for k in keys}}))
    for text in damaged:
        path.write_text(text)
        calibrations.clear()
        assert calibrated_engine(CalibrationCache(path), 4).pass_rows == 4 and len(calibrations) == 5
        assert json.loads(path.read_text())["machine"] == calibration_cache.machine()


def test_the_machine_is_named_by_the_cpu_the_build_the_threads_and_the_kernel_settings(monkeypatch):
    here = calibration_cache.machine()
    assert here["torch"] == torch.__version__ and here["threads"] == torch.get_num_threads()
    assert here["cpu"]["flags"] == next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(
        ":", 1)[1].strip()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert calibration_cache.machine() == dict(here, environment={**here["environment"], "ONEDNN_MAX_CPU_ISA": "AVX2"})


def test_a_calibration_that_cannot_be_written_is_measured_again_next_time(tmp_path, calibrations):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "calibration.json"  # (its directory is a file: nothing can be written there)
    assert calibrated_engine(CalibrationCache(path), 4).pass_rows == 4
    assert len(calibrations) == 5 and not path.exists()
    calibrations.clear()
    calibrated_engine(CalibrationCache(path), 4)
    assert len(calibrations) == 5
