"""What a command does before its first token, made cheap without changing what it computes: a model about to be
loaded is built without drawing initial weights (GPT.with_weights), and GPT-2's BPE comes from a cache file in
tiktoken's own format instead of being rebuilt from its BPE files at every start."""

import hashlib
import inspect
import re
import subprocess
import sys

import pytest
import tiktoken
import tiktoken_ext.openai_public
import torch

from conftest import ROOT, perturb
from machinery import tokenizer
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
