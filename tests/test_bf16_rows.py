"""Our own kernel for decoding's bfloat16 products (machinery/bf16_rows.py, bf16_rows.c): what it computes,
that a row's result does not depend on the other rows, that it reads only a weight laid out as it expects, how
it is built, and the engine decoding with it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from machinery import bf16_rows, engine
from test_engine import Tokens, scored, small_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = pytest.mark.skipif(bf16_rows.load() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                            reason="the kernel needs Linux on x86-64 with AVX-512 BF16, gcc, and oneDNN's bfloat16")
AMX = pytest.mark.skipif(not engine.uses_kernel("bfloat16", 1),
                         reason="the engine decodes with the kernel only on a CPU with AMX (and with the kernel)")


def packed(weight):
    """weight packed by oneDNN in bfloat16, as PackedLinear packs it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), None)


def kernel_of(weight):
    kernel = bf16_rows.Kernel(packed(weight), weight)
    if kernel is None:
        pytest.skip("oneDNN packs bfloat16 otherwise on this CPU (another block or order): the kernel stays unused")
    return kernel


@KERNEL
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (100, 40), (65, 48), (7, 2), (300, 768)])
def test_products_are_exact_where_float32_sums_are(out_features, in_features):
    """Small integers (|w|, |x|, |bias| <= 8): every product and partial sum is an integer below 2**24, so exact
    in float32 whatever the order; the kernel gives the float64 product rounded to bfloat16 (to nearest even),
    with and without the bias, for 1 to 9 rows (a group of 4, and the rest), where oneDNN pads the outputs
    (not a multiple of 32) and the inputs (40, 48, 2: not a multiple of 32)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 9, (out_features, in_features), generator=g).to(torch.bfloat16)
    bias = torch.randint(-8, 9, (out_features,), generator=g).to(torch.bfloat16)
    kernel = kernel_of(w)
    for rows in range(1, 10):
        x = torch.randint(-8, 9, (rows, in_features), generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T
        assert torch.equal(kernel(x, bias), (exact + bias.double()).to(torch.bfloat16))
        assert torch.equal(kernel(x), exact.to(torch.bfloat16))


@KERNEL
def test_a_product_is_within_float32_summing_of_the_exact_one_and_each_row_is_its_result_alone():
    """Random inputs to GPT-2's 3072 -> 768: each output is the exact (float64) product within what rounding
    to bfloat16 (half a unit in its last place) and 3072 float32 additions (3072 * 2**-24 of the sum of the
    terms' magnitudes) allow; and 7 rows computed together give each row, bit for bit, what it gets alone."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(768, 3072, generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.randn(768, generator=g).to(torch.bfloat16)
    x = torch.randn(7, 3072, generator=g).to(torch.bfloat16)
    kernel = kernel_of(w)
    together = kernel(x, bias)
    exact = x.double() @ w.double().T + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    allowed = exact.abs() * 2 ** -8 + magnitude * 3072 * 2 ** -24
    assert ((together.double() - exact).abs() <= allowed).all()
    for row in range(7):
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
from machinery import bf16_rows
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
def test_the_engine_decodes_with_the_kernel_only_where_a_pass_holds_few_rows():
    """prepare(rows=1) gives every linear layer the kernel (KernelLinear, all bound); rows past
    bf16_rows.ROWS, or not known, or float32, give oneDNN's PackedLinear, as before."""
    def kinds(dtype, rows):
        model = engine.prepare(small_model(), "cpu", dtype, rows=rows)
        return {(type(m).__name__, getattr(m, "kernel", None) is not None) for m in model.modules()
                if isinstance(m, engine.RowsLinear)}

    assert kinds("bfloat16", 1) == kinds("bfloat16", bf16_rows.ROWS) == {("KernelLinear", True)}
    assert kinds("bfloat16", bf16_rows.ROWS + 1) == kinds("bfloat16", None) == {("PackedLinear", False)}
    assert kinds("float32", 1) == {("PackedLinear", False)}


@AMX
def test_with_the_kernel_a_requests_scores_do_not_depend_on_how_many_rows_decode_with_it():
    """The kernel decodes any number of rows correctly, each alone: 12 seeded requests decoding together in an
    engine of the kernel's model score bit for bit as each one alone, and calibrate lets a pass hold all 12; the
    prompts (more than one position a row) are oneDNN's products, the decoding passes the kernel's."""
    model = engine.prepare(small_model(n_embd=768, n_layer=1, vocab_size=300, block_size=64), "cpu", "bfloat16",
                           rows=1)
    runner = engine.Engine(model, Tokens(300), max_batch=12)
    assert runner.pass_rows == 12
    g = torch.Generator().manual_seed(2)
    requests = [engine.Request(torch.randint(0, 300, (3 + i % 9,), generator=g).tolist(), max_tokens=6,
                               temperature=1.0, seed=i, logprobs=0) for i in range(12)]
    calls = []
    for m in model.modules():
        if isinstance(m, engine.KernelLinear):
            m.kernel = Counted(m.kernel, calls)
    together = scored(runner, requests)
    assert calls and set(calls) <= set(range(1, 13)) and max(calls) > 1
    assert [scored(runner, [r])[0] for r in requests] == together


class Counted:
    """A kernel that notes the rows of each product it computes."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __call__(self, x, bias=None):
        self.calls.append(x.shape[0])
        return self.kernel(x, bias)


@AMX
def test_kernel_linear_runs_prompts_as_packed_linear_and_decoding_passes_with_the_kernel():
    """A prompt's chunk (one row, several positions) gives oneDNN's product bit for bit; decoding passes (rows
    of one position) give the kernel's."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(768, 2304).to(torch.bfloat16)
    ours, theirs = engine.KernelLinear(linear), engine.PackedLinear(linear)
    with torch.no_grad():
        prompt = torch.randn(1, 37, 768).to(torch.bfloat16)
        assert torch.equal(ours(prompt), theirs(prompt))
        rows = torch.randn(3, 1, 768).to(torch.bfloat16)
        assert torch.equal(ours(rows), ours.kernel(rows.view(3, 768), linear.bias).view(3, 1, 2304))
