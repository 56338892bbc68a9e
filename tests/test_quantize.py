"""--quantize=int8 (machinery/weights/quantize.py): weight-only int8 per output channel through PyTorch's
_weight_int8pack_mm; its error against float32, and the generation engine's invariants under it (greedy
decoding as the uncached path, a request's tokens independent of the batch, seeded determinism), as
tests/test_engine.py checks them for the other dtypes."""

import json

import pytest
import torch
import torch.nn as nn

from conftest import assert_one_error_line, run_in_process
import test_engine
from test_engine import Tokens, run  # (the engine's own tests' helpers: a tokenizer of ids, run to the end)
import eval as eval_script
from machinery.generation import engine, packing
from machinery.weights import checkpoint, quantize
from machinery.data.meta import DatasetMeta
from machinery.weights.quantize import Int8Linear
from machinery.generation.request import Request
from machinery.data.tokenizer import CharTokenizer
from model import GPT, GPTConfig
import sample
import serve
import train


def model_of(n_embd=64, n_layer=2, vocab_size=70, block_size=32, std=0.3, seed=0):
    """A random GPT whose matrices have std `std` (peaked distributions: varied text, clear greedy choices)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_embd=n_embd))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


# ---------------------------------------------------------------------- the layer


def test_an_int8_layer_computes_the_int8_weights_product_rounded_to_bfloat16():
    """The expected values from the maths: per row the scale max|w| / 127 (in bfloat16, the kernel's type), the
    weights round(w / scale) in [-127, 127], the product of the bfloat16-rounded input with them in float64;
    the kernel accumulates in float32 and rounds its result to bfloat16 (2^-9 of it, twice for safety), then
    the bias is added. Each weight is off by at most half its row's step."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.normal_()
    x = torch.randn(5, 3, 96)
    w = linear.weight.detach().double()
    scale = (w.abs().amax(dim=1) / 127).to(torch.bfloat16).double()
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    assert ((q * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-12).all()
    product = x.to(torch.bfloat16).double() @ (q * scale[:, None]).t()
    layer = Int8Linear(linear)
    assert layer.weight_int8.dtype == torch.int8 and torch.equal(layer.weight_int8.double(), q)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (5, 3, 40) and y.dtype == torch.float32
    error = (y.double() - linear.bias.detach().double() - product).abs()
    assert (error <= 2 ** -8 * product.abs() + 1e-6).all(), error.max()
    assert product.std() > 1.0
    # bfloat16 rows that do not start where an allocation does (the kernel's aligned loads): copied first
    store = torch.randn(15 * 96 + 8).to(torch.bfloat16)
    shifted = store[8:].view(15, 96)
    assert shifted.data_ptr() % 32 and torch.equal(layer(shifted), layer(shifted.clone()))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """The engine's rows: each one's result bitwise the same alone as among 1 to 12 rows."""
    torch.manual_seed(1)
    layer = Int8Linear(nn.Linear(768, 3072))
    x = torch.randn(12, 768)
    with torch.no_grad():
        alone = [layer(x[i:i + 1]) for i in range(12)]
        for rows in range(1, 13):
            together = layer(x[:rows])
            assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows)), rows


def test_quantize_replaces_the_linear_layers_the_kernel_can_take():
    """Every linear layer and the output head where in_features is a multiple of 32 (the kernel's aligned loads);
    n_embd=48: only the MLP's second layer (192 wide). The token embedding stays float (it was tied to the
    head: only the head's copy is int8)."""
    model = quantize.quantize(model_of(n_embd=32), "int8")
    linears = {name: type(m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, Int8Linear))}
    assert set(linears.values()) == {Int8Linear} and len(linears) == 2 * 4 + 1
    assert model.tok_emb.weight.dtype == torch.float32
    model = quantize.quantize(model_of(n_embd=48), "int8")
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Int8Linear)) == ["blocks.0.ffwd.proj",
                                                                                        "blocks.1.ffwd.proj"]


def test_int8_logits_are_within_the_stated_error_of_float32():
    """GPT-2's width (768) and initialisation, 2 layers: the int8 model's logits against float32's. Each weight
    is off by up to 1/254 of its row's largest, about 0.75 % of the weights' RMS for Gaussian rows (and bfloat16
    rounds the inputs and outputs); through 9 products the logits' error is measured at 2.0 % of their standard
    deviation (RMS): bounded at 3 %, and 4 % of their range at most."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=1000, n_layer=2, n_head=12, n_embd=768)).eval()
    idx = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(idx, every_position=True)[0]
        int8 = quantize.quantize(model, "int8")(idx, every_position=True)[0]
    error = int8 - ref
    assert error.pow(2).mean().sqrt() < 0.03 * ref.std()
    assert error.abs().max() < 0.04 * (ref.max() - ref.min())
    assert (int8.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


# ---------------------------------------------------------------------- the engine under int8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_under_int8_are_the_uncached_paths(dtype):
    """The engine decoding an int8 model (cached, uncached, past block_size) gives model.generate's tokens of the
    same int8 model re-running the whole window for every token (nanoGPT's way)."""
    prompt = [1, 5, 9, 2, 7]
    reference = quantize.quantize(model_of(block_size=16).to(getattr(torch, dtype)), "int8")
    expected = reference.generate(torch.tensor([prompt]), 30, temperature=0, use_cache=False)[0, 5:].tolist()
    prepared = packing.prepare(model_of(block_size=16), "cpu", dtype, quantize="int8")
    assert isinstance(prepared.lm_head, Int8Linear)
    for use_cache in (True, False):
        runner = engine.Engine(prepared, Tokens(70), use_cache=use_cache)
        assert run(runner, [Request(prompt, max_tokens=30, temperature=0)]) == [expected]


def test_under_int8_a_requests_tokens_do_not_depend_on_the_batch(monkeypatch):
    """tests/test_engine.py's own test of it (8 seeded requests together, each as alone; GPT-2's width), its
    engine's model prepared with int8 weights."""
    prepare, prepared = packing.prepare, []
    monkeypatch.setattr(packing, "prepare", lambda *args, **kw: prepared.append(prepare(*args, **kw, quantize="int8"))
                        or prepared[-1])
    test_engine.test_a_requests_tokens_do_not_depend_on_what_else_runs("float32")
    assert isinstance(prepared[0].blocks[0].ffwd.fc, Int8Linear) and isinstance(prepared[0].lm_head, Int8Linear)


def test_under_int8_a_seed_gives_the_same_tokens_again():
    runner = engine.Engine(packing.prepare(model_of(), "cpu", "float32", quantize="int8"), Tokens(70))
    requests = [Request([3, 4, 5], max_tokens=16, temperature=1.0, seed=seed) for seed in (7, 7, 8)]
    first, again, other = run(runner, requests)
    assert first == again != other and run(runner, requests[:1]) == [first]


def test_a_compiled_int8_model_decodes_in_whole_graphs(eager_dynamo):
    """Engine(compile=True) on an int8 model (sample.py --compile --quantize=int8 on the CPU): dynamo traces each
    forward whole, without a graph break (an int8 layer's alignment check asked for a data pointer, which splits
    the graph: dynamo then compiled the attention once per layer, up to its recompile limit), and the tokens are
    the eager engine's; two graphs serve every prompt length (one for a pass of T >= 2 tokens, T symbolic; one for a
    single token), not one per length. The "eager" backend keeps the test quick: graph breaks are dynamo's, whatever
    the backend. In bfloat16, whose activations the kernel takes as they are (float32 ones are converted first)."""
    prompts = [[1, 5, 9, 2, 7], [3], [4, 4, 8, 1, 1, 6, 2, 9, 3]]  # one at a time: several prompt lengths
    eager = engine.Engine(packing.prepare(model_of(block_size=16), "cpu", "bfloat16", quantize="int8"), Tokens(70))
    expected = [run(eager, [Request(p, max_tokens=12, temperature=0)]) for p in prompts]
    model = packing.prepare(model_of(block_size=16), "cpu", "bfloat16", compile=True, quantize="int8")
    runner = engine.Engine(model, Tokens(70), compile=True)
    assert [run(runner, [Request(p, max_tokens=12, temperature=0)]) for p in prompts] == expected
    assert isinstance(model.lm_head, Int8Linear) and eager_dynamo["stats"]["unique_graphs"] == 2
    # every frame dynamo met compiled whole: nothing it could not trace (a graph break) and no frame left over
    assert not eager_dynamo["unimplemented"] and eager_dynamo["frames"]["total"] == eager_dynamo["frames"]["ok"], \
        {k: dict(v) for k, v in eager_dynamo.items()}


# ---------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    """A small character-level model saved as a checkpoint (n_embd 64: its layers take int8), and a text in its
    vocabulary."""
    text = "ROMEO: But soft, what light through yonder window breaks?\n" * 4
    tok = CharTokenizer(sorted(set(text)))
    model = model_of(vocab_size=tok.vocab_size, block_size=64, std=0.1)
    out = tmp_path_factory.mktemp("int8") / "out"
    out.mkdir()
    checkpoint.save(checkpoint.training_state(model.state_dict(), model.config, train.TrainConfig(),
                                              DatasetMeta.of(tok), iter_num=1, best_val_loss=3.0),
                    str(out / checkpoint.BEST))
    (out.parent / "text.txt").write_text(text)
    return out, model, tok


def test_sample_and_serve_decode_with_int8_weights(char_checkpoint, monkeypatch):
    out, model, tok = char_checkpoint
    prompt = "ROMEO:"
    expected_model = quantize.quantize(model_of(vocab_size=tok.vocab_size, block_size=64, std=0.1), "int8")
    ids = expected_model.generate(torch.tensor([tok.encode(prompt)]), 20, temperature=0)[0].tolist()
    proc = run_in_process(sample.main, f"--out_dir={out}", "--quantize=int8", "--dtype=float32", "--device=cpu",
                          f"--start={prompt}", "--max_new_tokens=20", "--temperature=0", "--num_samples=1", check=True)
    assert proc.stdout == tok.decode(ids) + "\n---------------\n"
    cfg = serve.ServeConfig(out_dir=str(out), quantize="int8", device="cpu", dtype="float32")
    cfg.validate()
    server, _ = serve.build(cfg)
    assert isinstance(server.engine.model.lm_head, Int8Linear)


def test_eval_text_with_int8_weights_is_close_to_float32(char_checkpoint):
    out, _, _ = char_checkpoint
    figures = {}
    for extra in ([], ["--quantize=int8"]):
        proc = run_in_process(eval_script.main, f"--out_dir={out}", f"--text={out.parent / 'text.txt'}", "--json",
                              "--device=cpu", "--dtype=float32", *extra, check=True)
        figures[bool(extra)] = json.loads(proc.stdout)["text"]["bits_per_byte"]
    assert figures[False] != figures[True] and abs(figures[True] / figures[False] - 1) < 0.01


@pytest.mark.parametrize("args, words", [(["--quantize=int4"], "quantize must be int8"),
                                         (["--quantize=int8", "--device=cuda"], "runs on the CPU only")])
def test_bad_quantize_settings_are_one_line_and_exit_2(char_checkpoint, args, words):
    out, _, _ = char_checkpoint
    for main in (sample.main, eval_script.main):
        assert_one_error_line(run_in_process(main, f"--out_dir={out}", *args), *words.split(" or "))
