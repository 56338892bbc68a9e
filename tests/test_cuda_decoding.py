"""Decoding on CUDA (skipped without a GPU; CI is CPU-only): the engine's fixed step, captured as a CUDA graph,
gives the uncached model's greedy tokens in bfloat16 and float32, a request's tokens alone and among 31 others
are the same, and serve.py answers."""

import pytest
import torch

from machinery import engine
from test_engine import Tokens, run, small_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_decoding_gives_the_uncached_greedy_tokens(dtype):
    prompt = [1, 5, 9, 2, 7]
    model = small_model(block_size=32).to("cuda", getattr(torch, dtype)).eval()
    expected = model.generate(torch.tensor([prompt], device="cuda"), 60, temperature=0,
                              use_cache=False)[0, 5:].tolist()
    runner = engine.Engine(engine.prepare(small_model(block_size=32), "cuda", dtype), Tokens(70), "cuda")
    assert runner.fixed and runner.slots.device.type == "cuda"
    assert run(runner, [engine.Request(prompt, max_tokens=60, temperature=0)]) == [expected]
    assert runner.fixed_step.graph is not None  # it ran as a captured graph


def test_a_requests_tokens_are_the_same_alone_and_among_31_others():
    runner = engine.Engine(engine.prepare(small_model(n_embd=256, block_size=64), "cuda", "bfloat16"), Tokens(70),
                           "cuda", max_batch=32)
    g = torch.Generator().manual_seed(0)
    requests = [engine.Request(torch.randint(0, 70, (1 + i % 7,), generator=g).tolist(), max_tokens=24,
                               temperature=1.0, seed=i) for i in range(32)]
    together = run(runner, requests)
    assert run(runner, [requests[5]]) == [together[5]] and run(runner, [requests[30]]) == [together[30]]


def test_serve_py_answers_on_cuda(tmp_path):
    import httpx

    import test_serve
    from machinery import checkpoint
    from machinery.meta import DatasetMeta
    from machinery.tokenizer import CharTokenizer
    from model import GPT, GPTConfig
    from train import TrainConfig

    tokenizer = CharTokenizer(sorted(set("abcdefgh ")))
    model = GPT(GPTConfig(block_size=32, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32))
    out = tmp_path / "tiny"
    out.mkdir()
    checkpoint.save(checkpoint.training_state(model.state_dict(), model.config, TrainConfig(),
                                              DatasetMeta.of(tokenizer), iter_num=0, best_val_loss=float("inf")),
                    str(out / checkpoint.BEST))
    with test_serve.serving(out, device="cuda") as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 5}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 5
