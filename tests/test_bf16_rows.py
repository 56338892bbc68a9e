"""Our own kernel for decoding's bfloat16 products (machinery/generation/bf16_rows.py, bf16_rows.c): what it computes,
that a row's result does not depend on the other rows, that it reads only a weight laid out as it expects, how
it is built, and the engine decoding with it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from machinery.generation import bf16_rows, decode, engine, packing
from machinery.generation.request import Request
from model import GPT, GPTConfig
from test_engine import Tokens, scored, small_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = pytest.mark.skipif(bf16_rows.load() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                            reason="the kernel needs Linux on x86-64 with AVX-512 BF16, gcc, and oneDNN's bfloat16")
AMX = pytest.mark.skipif(not packing.uses_kernel("bfloat16") or not bf16_rows.load().amx,
                         reason="the engine decodes with the kernel only on a CPU with AMX (and with the kernel)")


def packed(weight):
    """weight packed by oneDNN in bfloat16, as PackedLinear packs it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), None)


def kernel_of(weight):
    if not bf16_rows.load().amx:
        pytest.skip("the kernel needs AMX, lent by Linux")
    kernel = bf16_rows.Kernel(packed(weight), weight)
    if kernel is None:
        pytest.skip("oneDNN packs bfloat16 otherwise on this CPU (another block or order): the kernel stays unused")
    return kernel


@KERNEL
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (100, 40), (65, 48), (7, 2), (300, 768)])
def test_products_are_exact_where_float32_sums_are(out_features, in_features):
    """Small integers (|w|, |x|, |bias| <= 8): every product and partial sum is an integer below 2**24, so exact
    in float32 whatever the order; the kernel gives the float64 product rounded to bfloat16 (to nearest even),
    with and without the bias, for 1 to 9 rows (a tile of 16 rows, padded) and 33 (two groups of 32 rows, the
    last padded to 16), where oneDNN pads the outputs (not a multiple of 32) and the inputs (40, 48, 2: not a
    multiple of 32)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 9, (out_features, in_features), generator=g).to(torch.bfloat16)
    bias = torch.randint(-8, 9, (out_features,), generator=g).to(torch.bfloat16)
    kernel = kernel_of(w)
    for rows in list(range(1, 10)) + [33]:
        x = torch.randint(-8, 9, (rows, in_features), generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T
        assert torch.equal(kernel(x, bias), (exact + bias.double()).to(torch.bfloat16))
        assert torch.equal(kernel(x), exact.to(torch.bfloat16))


@KERNEL
def test_a_product_is_within_float32_summing_of_the_exact_one_and_each_row_is_its_result_alone():
    """Random inputs to GPT-2's 3072 -> 768: each output is the exact (float64) product within what rounding
    to bfloat16 (half a unit in its last place) and 3072 float32 additions (3072 * 2**-24 of the sum of the
    terms' magnitudes) allow; and 40 rows computed together give each row, bit for bit, what it gets alone."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(768, 3072, generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.randn(768, generator=g).to(torch.bfloat16)
    x = torch.randn(40, 3072, generator=g).to(torch.bfloat16)
    kernel = kernel_of(w)
    together = kernel(x, bias)
    exact = x.double() @ w.double().T + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    allowed = exact.abs() * 2 ** -8 + magnitude * 3072 * 2 ** -24
    assert ((together.double() - exact).abs() <= allowed).all()
    for row in range(len(x)):
        assert torch.equal(kernel(x[row:row + 1], bias), together[row:row + 1])


@KERNEL
def test_a_weight_not_laid_out_as_the_kernel_reads_it_is_refused():
    """The kernel binds to a packed weight only where the packed memory holds that weight in its order: another
    weight's packing, or a float32 packing, gives None (the layer keeps oneDNN's product)."""
    w = torch.randn(64, 64)
    assert kernel_of(w) is not None
    assert bf16_rows.Kernel(packed(w), w.flip(0)) is None
    assert bf16_rows.Kernel(torch.ops.mkldnn._reorder_linear_weight(w, None), w) is None


BUILD = """
import json, os
from machinery.generation import bf16_rows
cache = os.path.join(os.environ["XDG_CACHE_HOME"], "nanogpt")
print(json.dumps([bf16_rows.load() is not None, sorted(os.listdir(cache)) if os.path.isdir(cache) else []]))
"""


@KERNEL
def test_the_kernel_is_built_once_into_the_cache_and_without_gcc_decoding_stays_with_onednn(tmp_path):
    """A fresh cache: the first process builds the library (one file, no leftovers), the next loads it without
    building (its time stamp unchanged); a process that finds no gcc (and nothing built) has no kernel."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=dict(env, **extra), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    built, files = run()
    assert built and len(files) == 1 and files[0].startswith("bf16_rows-") and files[0].endswith(".so")
    library = tmp_path / "cache" / "nanogpt" / files[0]
    stamp = library.stat().st_mtime_ns
    assert run() == [True, files] and library.stat().st_mtime_ns == stamp
    empty = tmp_path / "bin"
    empty.mkdir()
    assert run(XDG_CACHE_HOME=str(tmp_path / "other"), PATH=str(empty)) == [False, []]


@AMX
def test_the_engine_decodes_bfloat16_with_the_kernel():
    """prepare in bfloat16 gives every linear layer the kernel (KernelLinear, all bound where Linux lends AMX);
    float32 oneDNN's PackedLinear."""
    def kinds(dtype):
        model = packing.prepare(small_model(), "cpu", dtype)
        return {(type(m).__name__, getattr(m, "kernel", None) is not None) for m in model.modules()
                if isinstance(m, packing.RowsLinear)}

    assert kinds("bfloat16") == {("KernelLinear", bf16_rows.load().amx)}
    assert kinds("float32") == {("PackedLinear", False)}


@AMX
def test_with_the_kernel_a_requests_scores_do_not_depend_on_how_many_rows_decode_with_it():
    """The kernel decodes any number of rows correctly, each alone: 12 seeded requests decoding together in an
    engine of the kernel's model score bit for bit as each one alone, and calibrate lets a pass hold all 12; the
    prompts (more than one position a row) are oneDNN's products, the decoding passes the kernel's."""
    model = packing.prepare(small_model(n_embd=768, n_layer=1, vocab_size=300, block_size=64), "cpu", "bfloat16")
    runner = engine.Engine(model, Tokens(300), max_batch=12)
    assert runner.pass_rows == 12
    g = torch.Generator().manual_seed(2)
    requests = [Request(torch.randint(0, 300, (3 + i % 9,), generator=g).tolist(), max_tokens=6,
                        temperature=1.0, seed=i, logprobs=0) for i in range(12)]
    calls = []
    for m in model.modules():
        if isinstance(m, packing.KernelLinear):
            m.kernel = Counted(m.kernel, calls)
    together = scored(runner, requests)
    assert calls and set(calls) <= set(range(1, 13)) and max(calls) > 1
    assert [scored(runner, [r])[0] for r in requests] == together


class Counted:
    """A kernel that notes the rows of each call."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __call__(self, x, *args):
        self.calls.append(x.shape[0])
        return self.kernel(x, *args)


@AMX
def test_kernel_linear_runs_prompts_as_packed_linear_and_decoding_passes_with_the_kernel():
    """A prompt's chunk (one row, several positions) gives oneDNN's product bit for bit; decoding passes (rows
    of one position) give the kernel's."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(768, 2304).to(torch.bfloat16)
    ours, theirs = packing.KernelLinear(linear), packing.PackedLinear(linear)
    with torch.no_grad():
        prompt = torch.randn(1, 37, 768).to(torch.bfloat16)
        assert torch.equal(ours(prompt), theirs(prompt))
        rows = torch.randn(3, 1, 768).to(torch.bfloat16)
        assert torch.equal(ours(rows), ours.kernel(rows.view(3, 768), linear.bias).view(3, 1, 2304))


# ---------------------------------------------------------------------- one row's attention (bf16_attend)

ATTENDS = pytest.mark.skipif(not bf16_rows.attends(torch.bfloat16, 64, 1025),
                             reason="the attention kernel needs Linux on x86-64 with AVX-512 BF16 and gcc")


def float64_attention(q, keys, values, n):
    """softmax(q k^T / sqrt(size)) v over the first n positions, in float64: (heads, 1, size)."""
    q, k, v = q.double(), keys[:, :n].double(), values[:, :n].double()
    return torch.softmax(q @ k.transpose(1, 2) / q.size(-1) ** 0.5, dim=-1) @ v


@ATTENDS
@pytest.mark.parametrize("heads, size", [(12, 64), (2, 16), (3, 256)])
def test_attention_is_float64s_within_one_bfloat16_step_and_reads_only_n_positions(heads, size):
    """The new key and value are stored at position n - 1 first; each output is then float64's attention rounded
    to bfloat16, or the next bfloat16 (float32 sums are a few parts in 2^24 off: one step of 2^-8 only where
    float64's lies near a midpoint); one position gives its value exactly; what lies past the n positions (NaN
    here) is never read."""
    g = torch.Generator().manual_seed(size)
    keys, values = (torch.randn(heads, 1025, size, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(heads, 1, size, generator=g).to(torch.bfloat16)
    for n in (1, 2, 17, 300, 1025):
        expected = float64_attention(q, keys, values, n)
        k, v = keys.clone(), values.clone()
        k[:, n - 1:], v[:, n - 1:] = float("nan"), float("nan")  # (position n - 1: the new key and value's)
        got = bf16_rows.attend(q, keys[:, n - 1:n], values[:, n - 1:n], k, v, n)
        assert torch.equal(k[:, :n], keys[:, :n]) and torch.equal(v[:, :n], values[:, :n])
        assert got.shape == (1, heads, 1, size) and got.dtype == torch.bfloat16
        step = 2.0 ** (torch.floor(torch.log2(expected.abs())) - 7)  # one bfloat16 step at each output
        assert ((got[0].double() - expected).abs() <= step).all(), n
        if n == 1:
            assert torch.equal(got[0], values[:, :1])


@ATTENDS
def test_attention_with_equal_scores_is_the_exact_mean_of_the_values():
    """q = 0: every position weighs 1/n, and the mean of 16 small integers is exact in float32 and bfloat16."""
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-8, 9, (4, 40, 64), generator=g).to(torch.bfloat16)
    keys = torch.randn(4, 40, 64, generator=g).to(torch.bfloat16)
    got = bf16_rows.attend(torch.zeros(4, 1, 64, dtype=torch.bfloat16), keys[:, 15:16], values[:, 15:16], keys,
                           values, 16)
    assert torch.equal(got[0], values[:, :16].double().mean(dim=1, keepdim=True).to(torch.bfloat16))


@AMX
@ATTENDS
def test_a_bfloat16_engine_keeps_a_bfloat16_cache_and_decoding_rows_attend_with_the_kernel():
    """On the AMX kind a bfloat16 engine's KV cache is bfloat16 (its keys and values are bfloat16 already: none is
    rounded) and each decoding row attends with the kernel (where the Blocks are PyTorch's: with qk_norm, which
    the Block kernel does not take), a prompt's chunk with PyTorch's attention (Head); 6
    seeded requests score alone as together; float32, or an engine that compiles the model, keep float32's cache
    and PyTorch's attention."""
    torch.manual_seed(4)
    config = GPTConfig(block_size=64, vocab_size=300, n_layer=2, n_head=2, n_embd=128, qk_norm=True)
    model = packing.prepare(GPT(config), "cpu", "bfloat16")  # (2 heads of 64)
    assert {type(b).__name__ for b in model.blocks} == {"Block"}
    runner = engine.Engine(model, Tokens(300), max_batch=6)
    assert runner.slots.k[0].dtype == torch.bfloat16 and runner.slots.attend is bf16_rows.attend
    calls = []
    runner.slots.attend = lambda *args: calls.append(args[-1]) or bf16_rows.attend(*args)
    g = torch.Generator().manual_seed(4)
    requests = [Request(torch.randint(0, 300, (3 + 2 * i,), generator=g).tolist(), max_tokens=5,
                        temperature=1.0, seed=i, logprobs=0) for i in range(6)]
    together = scored(runner, requests)
    # each request's 4 decoding passes (its first token comes from its prompt's pass), in each of 2 layers
    assert sorted(calls) == sorted(n for i in range(6) for n in range(4 + 2 * i, 8 + 2 * i) for _ in range(2))
    assert [scored(runner, [r])[0] for r in requests] == together
    float32 = engine.Engine(packing.prepare(small_model(), "cpu", "float32"), Tokens(70))
    compiled = engine.Engine(packing.prepare(small_model(), "cpu", "bfloat16", compile=True), Tokens(70), compile=True)
    odd_heads = engine.Engine(packing.prepare(small_model(n_embd=72), "cpu", "bfloat16"), Tokens(70))
    for other in (float32, compiled, odd_heads):  # (heads of 36: not a multiple of 16)
        assert other.slots.k[0].dtype == torch.float32 and other.slots.attend is None
    long_rows = small_model(n_embd=32, n_layer=1, block_size=bf16_rows.POSITIONS).to(torch.bfloat16)
    assert decode.cache_dtype(long_rows, "cpu") == torch.float32  # (its scores would not fit a stack)


# ---------------------------------------------------------------------- a whole Block (bf16_block)

def gelu(x, approximate):
    y = torch.empty_like(x)
    bf16_rows.load().bf16_gelu(x.data_ptr(), y.data_ptr(), x.numel(), approximate == "tanh")
    return y


def layer_norm(x, norm):
    y = torch.empty_like(x)
    bf16_rows.load().bf16_layer_norm(x.data_ptr(), norm.weight.data_ptr(), None if norm.bias is None else
                                     norm.bias.data_ptr(), y.data_ptr(), x.numel() // x.size(-1), x.size(-1),
                                     norm.eps)
    return y


@KERNEL
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_float64s_rounded_to_bfloat16_for_every_bfloat16(approximate):
    """Every finite bfloat16 x (65,280 of them): GELU(x) computed in float64 (x Phi(x) through erfc, or tanh's
    approximation as x / (1 + e^(-2u)): neither cancels in a tail) and rounded to bfloat16 is exactly the kernel's,
    wherever it is a normal number (2^-126 or more); below, the kernel's is too."""
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[x.float().isfinite()].contiguous()
    d = x.double()
    if approximate == "none":
        expected = d * torch.special.erfc(-d / 2 ** 0.5) / 2
    else:
        expected = d / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (d + 0.044715 * d ** 3)))
    got, normal = gelu(x, approximate), expected.abs() >= 2.0 ** -126
    assert len(x) == 65280 and torch.equal(got[normal], expected[normal].to(torch.bfloat16))
    assert (got[~normal].float().abs() < 2.0 ** -126).all()


@KERNEL
@pytest.mark.parametrize("C, bias", [(768, True), (100, False), (24, True)])
def test_layer_norm_is_float64s_within_rounding_and_float32s_error(C, bias):
    """Rows of various means and spreads: each output is float64's LayerNorm within half a bfloat16 step (the
    rounding) plus float32's error, a few parts in 2^24 of the terms' magnitudes ((|x| + |mean|) rstd |w| + |b|:
    2^-20 of them allowed), where an output near 0 is a difference of larger terms; all but a few in ten thousand
    are float64's rounded."""
    g = torch.Generator().manual_seed(C)
    x = (torch.randn(500, C, generator=g) * torch.rand(500, 1, generator=g) * 5 + torch.randn(500, 1, generator=g))
    norm = torch.nn.LayerNorm(C, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(C, generator=g) * 0.3 + 1)
        if bias:
            norm.bias.copy_(torch.randn(C, generator=g) * 0.1)
    x = x.to(torch.bfloat16)
    d, w, b = x.double(), norm.weight.double(), norm.bias.double() if bias else torch.zeros(C, dtype=torch.float64)
    mean, variance = d.mean(-1, keepdim=True), d.var(-1, unbiased=False, keepdim=True)
    rstd = 1 / (variance + norm.eps).sqrt()
    expected = (d - mean) * rstd * w + b
    terms = (d.abs() + mean.abs()) * rstd * w.abs() + b.abs()
    got = layer_norm(x, norm)
    half_step = 2.0 ** (torch.floor(torch.log2(expected.abs())) - 8)
    assert ((got.double() - expected).abs() <= half_step + terms * 2.0 ** -20).all()
    assert (got != expected.to(torch.bfloat16)).sum() <= x.numel() * 5e-4


def block_by_steps(block, x, caches):
    """What bf16_block computes, step by step from the parts tested on their own: LayerNorm, the q/k/v product,
    each row's attention (storing its key and value), W_O, the residual (PyTorch's bfloat16 addition: float32,
    rounded), LayerNorm, the MLP's product, GELU, its projection, the residual."""
    attn, ffwd = block.attn, block.ffwd
    rows, _, C = x.shape
    qkv = attn.qkv.kernel(layer_norm(x, block.ln1), attn.qkv.bias).view(rows, 3, attn.n_head, 1, attn.head_size)
    heads = torch.cat([bf16_rows.attend(qkv[i, 0], qkv[i, 1], qkv[i, 2], keys, values, n)
                       for i, (keys, values, n) in enumerate(caches)]).view(rows, 1, C)
    x = x + attn.proj.kernel(heads, attn.proj.bias)
    hidden = gelu(ffwd.fc.kernel(layer_norm(x, block.ln2), ffwd.fc.bias), ffwd.gelu.approximate)
    return x + ffwd.proj.kernel(hidden, ffwd.proj.bias)


@AMX
@ATTENDS
@pytest.mark.parametrize("bias, approximate, n_embd, n_head, mlp_ratio",
                         [(True, "tanh", 128, 2, 4), (False, "none", 128, 2, 4), (True, "none", 80, 5, 3)])
def test_a_block_kernel_is_the_blocks_steps_in_order_each_row_alone(bias, approximate, n_embd, n_head, mlp_ratio):
    """1, 3, 4, 9 and 40 rows (a tile of 16, padded; two groups of 32), each after its own number of positions:
    bf16_block's output and the keys and values it stores are bit for bit those of the Block's steps taken one by
    one (block_by_steps), with and without biases, either GELU, and widths that are not a multiple of 32 (80:
    oneDNN pads the outputs; 240)."""
    torch.manual_seed(5)
    config = GPTConfig(block_size=64, vocab_size=80, n_layer=1, n_head=n_head, n_embd=n_embd, bias=bias,
                       gelu=approximate, mlp_ratio=mlp_ratio)
    block = packing.prepare(GPT(config), "cpu", "bfloat16").blocks[0]
    assert isinstance(block, packing.KernelBlock)
    size = n_embd // n_head
    for count in (1, 3, 4, 9, 40):
        x = torch.randn(count, 1, n_embd).to(torch.bfloat16)
        caches = [(torch.randn(n_head, 65, size).to(torch.bfloat16), torch.randn(n_head, 65, size).to(torch.bfloat16),
                   1 + i % 60) for i in range(count)]
        twins = [(k.clone(), v.clone(), n) for k, v, n in caches]
        got = block.kernel(x, caches)
        assert torch.equal(got, block_by_steps(block, x, twins))
        assert all(torch.equal(a, b) for (k, v, _), (k2, v2, _) in zip(caches, twins) for a, b in ((k, k2), (v, v2)))


@AMX
@ATTENDS
def test_an_engine_of_the_kernels_decodes_every_block_with_one_call_each_row_alone():
    """prepare in bfloat16 makes every Block a KernelBlock (not in float32, or with qk_norm); in an engine its
    decoding passes run the kernel (prompts PyTorch's Block) and 9 seeded requests (passes of up to 9 rows) score
    together as each one alone."""
    def blocks(dtype, **options):
        model = packing.prepare(small_model(n_embd=128, **options), "cpu", dtype)
        return model, {type(b).__name__ for b in model.blocks}

    assert blocks("float32")[1] == {"Block"}
    qk = packing.prepare(GPT(GPTConfig(block_size=32, vocab_size=70, n_layer=1, n_head=2, n_embd=128, qk_norm=True)),
                         "cpu", "bfloat16")
    assert {type(b).__name__ for b in qk.blocks} == {"Block"}
    model, kinds = blocks("bfloat16", vocab_size=300, block_size=64)
    assert kinds == {"KernelBlock"}
    calls = []
    for block in model.blocks:
        block.kernel = Counted(block.kernel, calls)
    runner = engine.Engine(model, Tokens(300), max_batch=9)
    g = torch.Generator().manual_seed(6)
    requests = [Request(torch.randint(0, 300, (2 + i,), generator=g).tolist(), max_tokens=5,
                        temperature=1.0, seed=i, logprobs=0) for i in range(9)]
    together = scored(runner, requests)
    assert calls and max(calls) > 1 and set(calls) <= set(range(1, 10))
    assert [scored(runner, [r])[0] for r in requests] == together
