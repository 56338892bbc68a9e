"""
The generation engine: every decoding of sample.py and serve.py goes through it.

A Request is a prompt (token ids) and its settings: max_tokens, temperature, top_k, top_p, a seed for its
own torch.Generator, stop texts and stop tokens, logprobs, echo. The engine keeps a batch of running
requests (rows), each in a row of its KV cache (a slot; see below for when it gives it up). Every step
runs the model once for all rows that have a token to feed, one new token per row, then encodes a chunk of
a waiting prompt (chunked prefill: a long prompt delays the running rows by one chunk per step, not by its
whole length). A Generation is a request's handle: its tokens arrive there as Token events, as they are
sampled, with the text they complete.

A request's tokens do not depend on what else runs, because every row is computed as if it were alone: its
prompt is encoded alone, in chunks of a fixed size; its sampling draws from its own generator; and a step
either (on the CPU) attends row by row over exactly each row's positions with oneDNN's prepacked matrix
products (PackedLinear), whose result for one row does not depend on the number of rows (on a CPU with AMX,
decoding's products by our own kernel, each row summed alone: KernelLinear), or (on CUDA:
fixed) runs every row of the cache in shapes that never change, as one CUDA graph (machinery/decode.py). There
each step is launched before the host reads the tokens of the one before (ahead: the tokens go from one step to the
next on the device), so the host's reading, streaming and stop texts overlap the device's work; a token drawn past a
request's end is discarded.

With a prefix cache (prefix_cache_mb; machinery/prefix_cache.py), a prompt's whole chunks are kept, and a
request that begins with them (the next turn of a conversation, a shared system prompt, the other choices of
a request) copies them into its row instead of encoding them: since a chunk is encoded alone, what it copies
is what it would compute, and its tokens are the same. When idle, the engine encodes finished generations
(prompt and reply) in chunks into the cache, for the next turn; and a paused generation (its reader does not
read) gives its slot to a waiting request, its row kept in the cache, and resumes where it was; so does, while
requests wait and every slot is busy, the row that has run longest since it joined (QUANTUM tokens at least):
rows that never end share the slots in turn instead of keeping a new request waiting.

A request that fails (an exception in its forward pass or its sampling) ends alone, with finish_reason
"error": the rows of a failed step are run again one by one, and only those that fail alone end. An
exception outside any request stops the engine (alive is then False: serve.py's /health answers 503).

Decoding runs at the speed of memory (BENCHMARKS.md): the model is converted to the run's dtype instead of
autocast re-casting its weights at every step; on the CPU the linear layers are prepacked for oneDNN (and
moved into huge pages once a run is long enough to gain the move back: HUGE_PAGES_AFTER, machinery/hugepages.py;
where the CPU has AMX, decoding reads them with our own kernel: KernelLinear), and the KV cache
stays in float32, where attention runs (where the CPU has AMX, a bfloat16 model's cache is bfloat16, half the
bytes, and a decoding row attends by our own kernel: decode.cache_dtype; with both, a decoding pass runs each
Block as one call of ours, without PyTorch's operations between the products: KernelBlock). Past block_size a
row goes on as nanoGPT's generate does: its last block_size tokens are encoded again for every new token, so it
sees exactly what the uncached model would.
"""

import collections
import math
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery import bf16_rows, decode, hardware, hugepages
from machinery import quantize as quantization
from machinery.calibration_cache import layer_key
from machinery.decode_attention import check as check_attention
from machinery.decode_attention import check_ahead
from machinery.errors import first_line
from machinery.prefix_cache import PrefixCache
from model import Block, attention_backends, sample_next

FINISHED = ("stop", "length", "abort", "error")  # why a generation ended: a stop text or token, max_tokens,
# cancelled, failed
QUANTUM = 16  # tokens a row samples, at least, each time it (re)joins the batch before a waiting request may take its
# slot (Engine._preempt): a new request waits a few quanta, not until rows that never end (clients that read slowly)
# have ended, and parking a row (a copy of its keys and values) stays a small part of the work it then does
HUGE_PAGES_AFTER = 128  # passes of the model (each reads every weight) that pay for moving the weights into huge
# pages on the CPU (machinery/hugepages.py: a token's products then take ~0.87-0.9 of their time). Where the running
# rows are to decode that many tokens more, the weights move at once, on every thread, before their next pass
# (0.13-0.16 s for GPT-2 124M in bfloat16 on BENCHMARKS.md's machine C, which 50-120 passes save). Otherwise they
# move in the background once the model has run that many passes (~0.4 s of a core beside the decoding, about what
# 128 passes then save): as in renting skis until the rent would have bought them, a run that ends sooner never
# pays it, and a longer one pays at most twice what moving at once would have


@dataclass
class Request:
    """What to generate. prompt: 1 to block_size token ids; temperature 0 is greedy; logprobs: how many
    alternatives to report with each token (None: no log-probabilities); echo: the prompt's tokens come back
    first, scored (their log-probabilities, the first token's None)."""

    prompt: list
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None  # None: a fresh random seed
    stop: tuple = ()  # texts that end the generation (cut from the text)
    stop_tokens: tuple = ()  # token ids that end it (not part of the text), e.g. <|endoftext|>
    logprobs: Optional[int] = None
    echo: bool = False
    cache_salt: Optional[str] = None  # prefixes are shared only between requests of the same salt


@dataclass
class Token:
    """One event of a generation: a token's id, the text it makes final (may be empty: a held-back UTF-8 byte
    or the start of a stop text), its log-probability under the model and the top alternatives (when asked),
    and, on the last event, why the generation ended (and, when it failed, the error's message)."""

    id: Optional[int]
    text: str = ""
    logprob: Optional[float] = None
    top: Optional[list] = None  # [(token id, logprob)], most likely first
    prompt: bool = False  # an echoed prompt token
    finish_reason: Optional[str] = None
    error: Optional[str] = None


class Generation:
    """A request's handle: its Token events in order, the last with finish_reason set, waiting here for
    next_event() (or iteration). notify, when given, is called on the engine's thread after each event (e.g. to
    wake an asyncio loop). With max_backlog, the engine pauses the request while that many events wait unread
    (a client that does not read holds no more), and ends it ("abort") once nothing was read for stall_timeout
    seconds. cancel() ends it at the next step."""

    def __init__(self, request, text, notify=None, max_backlog=None):
        self.request, self.text, self.notify, self.max_backlog = request, text, notify, max_backlog
        self.events, self.ready = collections.deque(), threading.Condition()
        self.cancelled = False
        self.finish_reason, self.error = None, None
        self.prompt_tokens = len(request.prompt)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        self.last_read = time.monotonic()
        self.resume = None  # the engine's: called when a paused generation's reader takes events
        # decoding state (the engine's)
        self.ids = list(request.prompt)  # every token so far: the prompt, then each one sampled
        self.todo = list(request.prompt)  # what the model has not seen yet: the prompt, then the token sampled last
        self.slot = None  # its row of the engine's KV cache, while it runs
        self.parked = False  # its row's keys and values kept in the prefix cache, its slot given up (paused, or
        # preempted: Engine._preempt)
        self.run_tokens = 0  # tokens sampled since it last (re)joined the batch (Engine._preempt)
        self.length = 0  # positions of that row filled
        self.echoed = 0  # prompt tokens echoed so far (echo)
        self.generator = None

    def emit(self, token):
        """Deliver token, unless the generation has ended already (an abort can overtake the engine)."""
        with self.ready:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = token.finish_reason, token.error
            self.events.append(token)
            self.ready.notify_all()
        if self.notify is not None:
            self.notify()

    def next_event(self, timeout=None):
        """The next Token (waiting for it, at most timeout seconds: then None)."""
        with self.ready:
            if not self.events and not self.ready.wait_for(lambda: self.events, timeout):
                return None
        return self.take(1)[0]

    def take(self, n=None):
        """The Tokens that have arrived (at most n), without waiting."""
        with self.ready:
            paused = self.paused
            taken = [self.events.popleft() for _ in range(min(len(self.events), n or len(self.events)))]
            self.last_read = time.monotonic()
        if paused and self.resume is not None:
            self.resume()  # (outside self.ready: the engine takes its own lock, and calls emit while holding it)
        return taken

    def __iter__(self):
        while True:
            token = self.next_event()
            yield token
            if token.finish_reason:
                return

    def cancel(self):
        self.cancelled = True

    @property
    def done(self):
        return self.finish_reason is not None

    @property
    def paused(self):
        """Too many events wait unread (max_backlog): the engine does not run it until some are read."""
        return self.max_backlog is not None and len(self.events) >= self.max_backlog


class StreamText:
    """The generated text of one request as its tokens arrive.

    It is done at one of stop_tokens (not part of the text) or where one of the stop texts first
    appears (the text is cut there). add() returns the text that has become final, for streaming: it
    holds back an incomplete UTF-8 character (BPE tokens can split one) and a tail that may turn out
    to be the start of a stop text, so what is streamed is always a prefix of the final text, and all
    of it once finish() is called.

    A token costs the same however long the text is: only the ids after the last complete character are decoded
    again (the text of bytes that end a character is the text of their start followed by the rest's), and stop
    texts are looked for where the new text may hold one.
    """

    def __init__(self, tokenizer, stop=(), stop_tokens=()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_tokens = set(stop_tokens)
        self.ids = []
        self.text = ""  # the decoded text, cut at a stop text
        self.settled, self.settled_ids = "", 0  # the text of ids[:settled_ids], ending with a complete character
        self.done = False
        self.emitted = 0  # characters of text handed out so far

    def add(self, token_id):
        """Take the next token; return the newly final text (done is set when it ends the text)."""
        if self.done:
            return ""
        if token_id in self.stop_tokens:
            return self.finish()
        self.ids.append(token_id)
        new = len(self.settled)  # the text may change from here on (a character completed), not before it
        tail = self.tokenizer.decode(self.ids[self.settled_ids:])
        self.text = self.settled + tail
        cuts = [i for i in (self.text.find(s, max(0, new - len(s) + 1)) for s in self.stop) if i >= 0]
        if cuts:
            self.text = self.text[:min(cuts)]
            return self.finish()
        if not tail.endswith("\ufffd"):  # (an incomplete character decodes as U+FFFD)
            self.settled, self.settled_ids = self.text, len(self.ids)
        return self._take(len(self.text) - self._undecided())

    def finish(self):
        """End the text; return what was not handed out yet."""
        self.done = True
        return self._take(len(self.text))

    def _undecided(self):
        """Characters at the end of text that a later token may still change or cut."""
        text = self.text.rstrip("\ufffd")  # bytes of a character still to come
        held = len(self.text) - len(text)
        tails = [n for stop in self.stop for n in range(min(len(stop) - 1, len(text)), 0, -1)
                 if text.endswith(stop[:n])]  # the longest tail that begins a stop text
        return held + max(tails, default=0)

    def _take(self, end):
        new = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return new


class RowsLinear(nn.Module):
    """An nn.Linear as the engine runs it on the CPU, where a kernel may take another algorithm for fewer rows
    (another rounding: oneDNN's float32 product of a single row of 3072 -> 768, float16's of one row where the
    CPU has AVX-512 FP16): fewer than min_rows rows are computed as the first rows of min_rows. min_rows is
    MIN_ROWS unless calibrate() measured that a lone row gives the same result unpadded."""

    MIN_ROWS = 4

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight  # (tied to the token embedding in lm_head)
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape
        self.min_rows = self.MIN_ROWS

    @property
    def dtype(self):
        return self.weight.dtype

    def weight_rows(self, n):
        """The weight's first n rows (n outputs'), as a plain tensor."""
        return self.weight.detach()[:n]

    def memory(self):
        """(address, bytes) of the weight's memory."""
        storage = self.weight.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def product(self, x):
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        rows = x.shape[:-1].numel()
        if rows >= self.min_rows:
            return self.product(x)
        padded = torch.cat([x.reshape(rows, -1), x.new_zeros(self.min_rows - rows, x.size(-1))])
        return self.product(padded)[:rows].reshape(*x.shape[:-1], -1)


class PackedLinear(RowsLinear):
    """A RowsLinear whose weight is prepacked for oneDNN (the CPU's inference format): the same products, faster
    at the few rows of decoding (BENCHMARKS.md), and oneDNN's kernel is fastest at 4 rows (measured on AMD:
    bfloat16 16.5 ms against 19.3 for one row, float32 25.5 against 30.5, GPT-2 124M's matrices; where the CPU
    has AMX a bfloat16 row alone is as fast, and calibrate leaves it unpadded: a millisecond a token). The weight
    is packed in dtype (linear's own by default) and only the packed copy is kept (prepare converts each matrix
    and packs it in turn, so the model is never held unpacked in dtype as well: 170 MB for GPT-2 124M)."""

    def __init__(self, linear, dtype=None):
        super().__init__(linear)
        del self.weight  # only the packed copy is kept
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(_contiguous(weight.to(dtype or weight.dtype)), None)

    @property
    def dtype(self):
        return self.packed.dtype

    def weight_rows(self, n):
        return self.packed.to_dense()[:n]  # (oneDNN's reorder back: calibrate's, once a shape)

    def memory(self):
        return torch.ops.mkldnn.data_ptr(self.packed), torch.ops.mkldnn._nbytes(self.packed)

    def product(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class KernelLinear(PackedLinear):
    """A PackedLinear whose decoding passes (one position a row: x of shape (rows, 1, in)) run our own kernel over
    the packed weight (machinery/bf16_rows.py: on a CPU with AMX, 0.4-0.6 of oneDNN's time at 1-32 rows), every
    row summed alone, so unpadded and whatever the number of rows; prompts' chunks run oneDNN's AMX kernel, as in
    a PackedLinear. bfloat16 only; a weight that the kernel cannot read (bf16_rows.Kernel) keeps oneDNN's product
    in every pass."""

    def __init__(self, linear, dtype=None):
        super().__init__(linear, dtype)
        self.kernel = bf16_rows.Kernel(self.packed, linear.weight.detach())

    def forward(self, x):
        if self.kernel is not None and x.dim() == 3 and x.shape[1] == 1 and x.dtype == torch.bfloat16:
            return self.kernel(x, self.bias)
        return super().forward(x)


class KernelBlock(Block):
    """A Block whose decoding passes (one position a row, over a KV cache that our attention kernel reads: an
    engine's every such pass, or none) run as one call of our own (bf16_rows.BlockKernel: LayerNorms, products,
    attention, GELU and residuals, each row alone, rounded where PyTorch rounds); prompts' chunks run the Block's
    own modules, which it shares (the same parameters, the same names)."""

    def __init__(self, block, kernel):
        nn.Module.__init__(self)
        self.ln1, self.attn, self.ln2, self.ffwd = block.ln1, block.attn, block.ln2, block.ffwd
        self.kernel = kernel

    def forward(self, x, kv_cache=None, layer=0):
        rows = getattr(kv_cache, "kernel_rows", None)  # (decode.Rows's; model.generate's own cache has none)
        caches = rows(layer) if rows is not None and x.size(1) == 1 and x.dtype == torch.bfloat16 else None
        return self.kernel(x, caches) if caches is not None else super().forward(x, kv_cache, layer)


def _fuse(model):
    """Each of model's Blocks that bf16_rows.BlockKernel can bind made a KernelBlock."""
    for i, block in enumerate(model.blocks):
        kernel = bf16_rows.BlockKernel(block)
        if kernel is not None:
            model.blocks[i] = KernelBlock(block, kernel)


def _contiguous(weight):
    """weight in row-major order, as oneDNN packs it. A Hugging Face GPT-2's matrices load transposed (its
    Conv1D layout, in x out), and PyTorch copies a transposed matrix in one thread, block by block; seen as 3-d
    (groups of 16 rows), the same copy is split over the threads (BENCHMARKS.md), where there are several (in
    one, the blocked copy is the faster: prepare's workers)."""
    rows, cols = weight.shape
    if weight.is_contiguous() or rows % 16 or torch.get_num_threads() == 1:
        return weight.contiguous()
    return weight.view(rows // 16, 16, cols).contiguous().view(rows, cols)


@torch.inference_mode()
def calibrate(model, most, cache=None):
    """The most rows (up to most) that one decoding pass of model may hold on this CPU with each row's result
    the one it gets alone, measured on the model's RowsLinear layers; each one's min_rows set on the way.
    oneDNN blocks a product by its number of rows, and blockings round differently: on a CPU with AMX, its AMX
    kernel computes GPT-2's bfloat16 products one way up to 32 rows and another beyond; with AVX-512 BF16 and no
    AMX, GPT-2's 3072 -> 768 rounds a lone row otherwise than 12 to 31 rows (a lone row padded to 4 rows, as
    they do). A product of n probe rows (_probe_rows) is compared with each of its rows alone. Shapes are
    measured once each; a few milliseconds a shape and row count. cache: a CalibrationCache, whose
    measurements of this machine are taken instead of measuring again, and which keeps the new ones."""
    limit, measured = most, {}
    for m in model.modules():
        if isinstance(m, RowsLinear):
            key = layer_key(m)
            if key not in measured:
                measured[key] = cache.get(m, most) if cache else None
                if measured[key] is None:
                    measured[key] = _rows_alone(m, most)
                    if cache:
                        cache.put(m, most, *measured[key])
            m.min_rows = measured[key][0]
            limit = min(limit, measured[key][1])
    if cache:
        cache.save()
    return limit


PROBED = 256  # outputs of a layer whose sums its calibration rows nearly cancel (_probe_rows)
PROBES = 512  # probed outputs in each comparison of calibrate's (one other output counts 1/200 of one: measured)
PROBE_ROWS = 16  # rows at most (a small layer's: cheap products, but so many of them)


def _rows_alone(linear, most):
    """(min_rows, the most rows up to most whose product gives each row its result alone) of a RowsLinear."""
    probe = _probe_rows(linear)[:, None]  # each row as a decoding pass holds it: one position

    def each_alone(min_rows):  # each probe row's product alone, a lone row padded to min_rows
        linear.min_rows = min_rows
        return torch.cat([linear(row) for row in probe.split(1)])

    alone = each_alone(RowsLinear.MIN_ROWS)
    if not torch.equal(each_alone(1), alone):
        linear.min_rows = RowsLinear.MIN_ROWS
    for n in range(2, most + 1):
        # n rows at a time, each probe row in one product at least (n > len(probe): the probes over again)
        order = torch.arange(-(-max(n, len(probe)) // n) * n) % len(probe)
        if any(not torch.equal(linear(probe[rows]), alone[rows]) for rows in order.split(n)):
            return linear.min_rows, n - 1
    return linear.min_rows, most


def _probe_rows(linear):
    """Rows of inputs to linear whose outputs nearly cancel in its first PROBED outputs, bias included: each
    is a small difference of large terms there, so two orders of summing it round otherwise about 2 % of the
    time, against 0.01 % for random rows' outputs (measured, bfloat16: BENCHMARKS.md): a few such rows show
    a difference that random rows would need thousands of to show. As many rows as make PROBES probed
    outputs, up to PROBE_ROWS. Random rows where the weights leave no such rows (too few inputs, a singular
    block)."""
    out_features, in_features = linear.out_features, linear.in_features
    probed = min(PROBED, out_features, in_features // 3)
    g = torch.Generator().manual_seed(0)
    rows = min(math.ceil(PROBES / (probed + (out_features - probed) / 200)), PROBE_ROWS)
    x = torch.randn(rows, in_features, generator=g, dtype=torch.float64)
    if probed:
        w = linear.weight_rows(probed).double()
        bias = linear.bias.detach()[:probed, None].double() if linear.bias is not None else 0
        # the first 2 * probed inputs solved for (the least such, for a well-conditioned system), the others
        # random: the first `probed` outputs 0 before x is rounded to the dtype
        a = w[:, :2 * probed]
        solved = (a.T @ torch.linalg.solve_ex(a @ a.T, -(w[:, 2 * probed:] @ x[:, 2 * probed:].T) - bias)[0]).T
        if solved.isfinite().all() and solved.abs().max() < 2 ** 8:
            x[:, :2 * probed] = solved
    return x.to(linear.dtype)


def prepare(model, device, dtype, compile=False, quantize=None):
    """The model ready to decode on device in dtype ("float32", "bfloat16", "float16"): in eval mode, its
    weights in dtype, and on the CPU its linear layers RowsLinear, prepacked where that is faster (can_pack),
    which the Engine calibrates (how many rows a pass may hold, whether a lone row is padded); on a CPU with AMX,
    bfloat16 decoding passes run our own kernel (KernelLinear), whatever their rows. compile: the engine will
    compile it (Engine(compile=True)), so nothing is prepacked: inductor packs weights itself (whether a row's
    result then depends on the others is up to its kernels). quantize="int8": int8 weights for the linear layers
    that take them (machinery/quantize.py), before either."""
    on_cpu, model = torch.device(device).type == "cpu", model.eval()
    packs = on_cpu and can_pack(dtype)
    packed = KernelLinear if packs and uses_kernel(dtype) else PackedLinear
    if packs and not compile and not quantize:
        _pack(model, packed, hardware.DTYPES[dtype])  # before the rest is converted: no unpacked copy of them all
    model = quantization.quantize(model.to(device=device, dtype=hardware.DTYPES[dtype]), quantize)
    if compile:
        return model
    if on_cpu:
        rows_linear = packed if packs else RowsLinear
        for module, name, linear in _linear_layers(model):
            setattr(module, name, rows_linear(linear))
        if rows_linear is KernelLinear:
            _fuse(model)
    return model


def uses_kernel(dtype):
    """Do decoding passes in dtype run our own kernel (KernelLinear) here: bfloat16, on a CPU with AMX (where it
    was measured faster: BENCHMARKS.md), where it can be built? (A layer whose weight it cannot read, or where Linux
    does not lend AMX, keeps oneDNN's product: bf16_rows.Kernel.)"""
    return dtype == "bfloat16" and bf16_rows.chosen()


def _pack(model, packed, dtype):
    """model's linear layers packed (PackedLinear or KernelLinear) in dtype, each matrix converted and packed on its
    own, the layers shared out among the threads (each copying and packing a whole layer alone: 0.28 against 0.35 s
    for GPT-2 124M's 48 block matrices, where each layer's copies were split over the threads; BENCHMARKS.md). Not
    the output layer, whose matrix is the token embedding's: it is packed after the model's conversion, from the
    converted matrix."""
    layers, threads = _linear_layers(model, shared=False), torch.get_num_threads()
    torch.set_num_threads(1)  # (read by each worker's first parallel operation)
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(lambda layer: packed(layer[2], dtype), layers))
    finally:
        torch.set_num_threads(threads)
    for (module, name, _), layer in zip(layers, done):
        setattr(module, name, layer)


def _linear_layers(model, shared=True):
    """(parent, name, layer) of model's nn.Linear layers; shared=False: not those whose weight is also another
    module's (an output layer tied to the token embedding)."""
    holders = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if type(child) is nn.Linear and (shared or holders[id(child.weight)] == 1)]


def can_pack(dtype):
    """Are the linear layers of dtype prepacked for oneDNN on this CPU? float32 on every x86 CPU; bfloat16 where
    the CPU computes it natively (AVX-512 BF16, AMX). Elsewhere PyTorch's own bfloat16 kernel is the faster one
    at a few rows: one matrix-vector product per row, converting as it reads, whose result for one row does
    not depend on the other rows either (tests/test_engine.py)."""
    if not torch.backends.mkldnn.is_available() or dtype not in ("float32", "bfloat16"):
        return False
    # packing bfloat16 needs oneDNN's support (any AVX-512 CPU), and gains only where the CPU computes it natively
    return dtype == "float32" or hardware.cpu_native("bfloat16") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Engine:
    """Continuous batching over one model (see the module's docstring). submit() from any thread; step() runs
    one step (sample.py calls it in a loop); start() runs steps in a thread of its own while there is work
    (serve.py). max_batch: running rows at most (the KV cache's rows); max_waiting: requests waiting to join, at
    most; prefill_chunk: prompt tokens encoded in one pass, at most; stall_timeout: seconds a paused
    generation (see Generation) may wait for its reader; use_cache=False encodes each row's whole window again
    for every token, as nanoGPT does (the same tokens, slower); fixed: decode every row of the cache at every
    step, in shapes that never change (machinery/decode.py; None: on CUDA, where it runs as a CUDA graph);
    decode_attention: how the fixed step's rows attend (machinery/decode_attention.py: full or flex; flex needs fixed);
    ahead: launch each fixed step before the host reads the tokens of the one before (None: wherever fixed; see
    _land), so that the host's work (reading, streaming, stop texts) overlaps the device's next step;
    compile: torch.compile the fixed step (static shapes: one graph), else the model in place (dynamic shapes);
    prefix_cache_mb: the prefix cache's budget (machinery/prefix_cache.py; 0: none), which also keeps the rows of
    paused generations, and of rows that have run a quantum, while waiting requests take their slots;
    calibration: a CalibrationCache that calibrate's measurements are taken from and kept in (None: measured)."""

    def __init__(self, model, tokenizer, device="cpu", max_batch=32, max_waiting=256, use_cache=True,
                 prefill_chunk=64, stall_timeout=60.0, fixed=None, compile=False, prefix_cache_mb=0,
                 calibration=None, decode_attention="full", ahead=None):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.vocab = tokenizer.vocab_size  # the tokenizer's ids: a padded vocabulary's extra rows are never drawn
        self.block_size = model.config.block_size
        self.fixed = self.device.type == "cuda" if fixed is None else fixed
        check_attention(decode_attention, self.fixed)
        self.slots = decode.Slots(model.config, max_batch, decode.cache_dtype(model, self.device, self.fixed, compile),
                                  self.device, self.fixed, decode_attention)
        self.fixed_step = decode.FixedStep(model, self.slots, compile, decode_attention) if self.fixed else None
        self.ahead = self.fixed if ahead is None else ahead  # launch a fixed step before reading the last's tokens
        check_ahead(self.ahead, self.fixed)
        self.flight = None  # a fixed step launched, its tokens not read yet (Flight)
        if compile and not self.fixed:
            model.compile(dynamic=True)  # in place: the engine's calls to the model run compiled
        self.max_batch, self.max_waiting, self.use_cache = max_batch, max_waiting, use_cache
        # the rows one decoding pass may hold (more are decoded in several passes): every row's result its own
        self.pass_rows = max_batch if self.fixed else calibrate(model, max_batch, calibration)
        self.prefill_chunk, self.stall_timeout = prefill_chunk, stall_timeout
        self.waiting, self.rows = collections.deque(), []
        self.cache = PrefixCache(self.slots, prefill_chunk, prefix_cache_mb) if prefix_cache_mb and use_cache else None
        if self.cache is not None and not self.cache.blocks:
            self.cache = None  # (a budget under one chunk's keys and values)
        self.parked = []  # paused generations that gave their slots to waiting requests
        self.tails = collections.deque(maxlen=max_batch)  # (salt, ids) of finished generations, to cache when idle
        self.lock = threading.Condition()
        self.thread, self.stopping, self.failure = None, False, None
        self.passes, self.huge_pages = 0, None  # the model's passes; the thread that moves the weights to huge pages

    # ------------------------------------------------------------------ submitting

    def submit(self, request, notify=None, max_backlog=None):
        """Queue request; its Generation (notify, max_backlog: see Generation). ValueError for a prompt that is
        empty or longer than block_size; QueueFull when max_waiting requests wait; Stopped once the engine has
        stopped."""
        if not 0 < len(request.prompt) <= self.block_size:
            raise ValueError(f"a prompt must have 1 to {self.block_size} tokens, not {len(request.prompt)}")
        generation = Generation(request, StreamText(self.tokenizer, request.stop, request.stop_tokens), notify,
                                max_backlog)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        generation.generator = torch.Generator().manual_seed(seed)  # (on the host: see draw)
        generation.resume = self._wake
        with self.lock:
            if self.failure is not None or self.stopping:
                raise Stopped(f"the generation engine has stopped{': ' + self.failure if self.failure else ''}")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (max_waiting)")
            self.waiting.append(generation)
            self.lock.notify_all()
        return generation

    @property
    def load(self):
        """(running, waiting) requests (a row that has just ended is not running, though it leaves the batch
        only at the next step)."""
        with self.lock:
            return sum(not g.done for g in self.rows + self.parked), len(self.waiting)

    def cache_stats(self):
        """The prefix cache's statistics (PrefixCache.stats), or None without one."""
        return None if self.cache is None else self.cache.stats()

    @property
    def alive(self):
        """Can the engine serve requests? (Not once its thread has died or an error outside a request stopped it.)"""
        running = self.thread is None or self.thread.is_alive()
        return running and self.failure is None and not self.stopping

    # ------------------------------------------------------------------ running

    def start(self):
        """Run steps in a background thread, sleeping while there is no work, until stop()."""
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def stop(self):
        """End every generation (finish_reason abort) and the background thread."""
        self.abort_all()
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)

    def abort_all(self, reason="abort", error=None):
        """End every waiting and running generation now: for shutting down (abort), or failing (error)."""
        with self.lock:
            everyone = list(self.waiting) + list(self.rows) + list(self.parked)
            self.waiting.clear()
        for g in everyone:
            g.cancel()
            self._finish(g, reason, error)

    def _wake(self):
        with self.lock:
            self.lock.notify_all()

    def _busy(self):
        return self.waiting or any(not g.paused for g in self.rows + self.parked)

    def _run(self):
        try:
            while True:
                with self.lock:
                    idle = bool(self.tails) and not self._busy()
                    if not idle:  # paused rows only (clients that do not read): wake now and then to end the stalled
                        self.lock.wait_for(lambda: self.stopping or self._busy(),
                                           timeout=0.5 if self.rows or self.parked else None)
                    if self.stopping:
                        return
                if idle:
                    if not self.cache_tail():
                        self.tails.clear()  # (no free row for them: every slot is a paused stream's)
                else:
                    self.step()
        except BaseException as e:  # a fault outside any request (each request's own are caught in step)
            self.failure = describe(e)
            print(f"engine: stopped by {self.failure}", file=sys.stderr, flush=True)
            self.abort_all("error", f"the server's generation engine failed ({self.failure})")

    def run(self, generations, show=None):
        """Step in this thread (no start()) until every one of generations is done; show(text), when given, gets
        the first one's text piece by piece as it becomes final (sample.py's and talk.py's streaming)."""
        while True:
            while show and (token := generations[0].next_event(timeout=0)) is not None:
                show(token.text)
            if all(g.done for g in generations):
                return
            self.step()

    @torch.inference_mode()
    def step(self):
        """One step: admit waiting requests; one token for every running row that has one to feed; then a chunk
        of the waiting prompts (one chunk while rows are decoding, one for each prompt when none is). With a fixed
        step in flight (ahead), the step is its landing instead (_land)."""
        if self.flight is not None:
            with attention_backends(self.device):
                self._land(self.flight)
            return
        ready = [g for g in self._admit() if not g.done and not g.paused]
        decoding = [g for g in ready if len(g.todo) == 1]
        with attention_backends(self.device):
            for i in range(0, len(decoding), self.pass_rows):
                self._decode(decoding[i:i + self.pass_rows])
            prompts = self._prompts([g for g in ready if len(g.todo) > 1 and not g.done])
            for g in prompts[:1] if decoding else prompts:
                self._feed([g], min(len(g.todo), self.prefill_chunk))
        self._huge_pages()

    def _huge_pages(self):
        """Move the weights into huge pages on the CPU, once (HUGE_PAGES_AFTER says when); self.huge_pages: how it
        went (the move's thread, or the bytes moved at once). At the end of a step: a new request's prompt has been
        encoded, its decoding not begun."""
        if self.huge_pages is not None or self.device.type != "cpu":
            return
        at_once = max((g.request.max_tokens - g.completion_tokens for g in self.rows), default=0) >= HUGE_PAGES_AFTER
        if not at_once and self.passes < HUGE_PAGES_AFTER:
            return  # (every step until then: nothing more is looked at)
        regions = [layer.memory() for layer in self.model.modules() if isinstance(layer, RowsLinear)]
        if at_once:
            self.huge_pages = hugepages.collapse(regions, torch.get_num_threads())
        else:
            self.huge_pages = hugepages.collapse_in_background(regions)

    def _admit(self):
        """Drop the rows that ended (their slots are free again), end cancelled and stalled ones, and let waiting
        requests join while there are free slots; the running rows."""
        now = time.monotonic()
        with self.lock:
            for g in self.rows + list(self.waiting) + self.parked:
                if g.cancelled or g.paused and now - g.last_read > self.stall_timeout:
                    self._finish(g, "abort")
            for g in self.rows:
                if g.done:
                    self.slots.free.append(g.slot)
            for g in self.parked + list(self.waiting):
                if g.done and g.parked:  # (a parked row back in line may end there: cancelled, stalled)
                    self.cache.drop(g)
            self.rows = [g for g in self.rows if not g.done]
            self.parked = [g for g in self.parked if not g.done]
            self.waiting = collections.deque(g for g in self.waiting if not g.done)
            self._park()
            joining = []
            while self.waiting and self.slots.free:
                joining.append(self.waiting.popleft())
                joining[-1].slot = self.slots.free.pop()
            self.rows += joining
            rows = list(self.rows)
        for g in joining:
            self._begin(g)
        return rows

    def _park(self):
        """Paused rows give their slots to waiting requests, their keys and values kept in the prefix cache (while
        it has room); parked rows whose readers have read again wait first in line for a slot; then the rows that
        have run longest give theirs to the requests that still wait (_preempt)."""
        if self.cache is None:
            return
        for g in [g for g in self.rows if g.paused]:
            if len(self.waiting) <= len(self.slots.free) or not self._park_row(g):
                break
            self.parked.append(g)
        back = [g for g in self.parked if not g.paused]
        self.parked = [g for g in self.parked if g.paused]
        self.waiting.extendleft(reversed(back))
        self._preempt()

    def _preempt(self):
        """For each request that waits with no slot free for it, the running row that has sampled the most tokens
        since it (re)joined, QUANTUM at least, is parked and waits in line behind it: rows share the slots in
        turn, and a new request joins within a few quanta however long the others run. Parked, a row resumes
        exactly where it was (its keys and values as they were, its generator's state its own)."""
        wanted = len(self.waiting) - len(self.slots.free)
        if wanted <= 0:
            return
        longest = sorted((g for g in self.rows if g.run_tokens >= QUANTUM and not g.paused and not g.done),
                         key=lambda g: g.run_tokens, reverse=True)
        for g in longest[:wanted]:
            if not self._park_row(g):
                return
            self.waiting.append(g)

    def _park_row(self, g):
        """Keep g's row in the prefix cache and give its slot up; False when the cache has no room for it."""
        if not self.cache.park(g, g.slot, g.length):
            return False
        self.rows.remove(g)
        self.slots.free.append(g.slot)
        g.slot, g.parked = None, True
        return True

    def _begin(self, g):
        """A row's first step: echo its first prompt token (nothing predicts it); max_tokens 0 without echo ends
        at once (no prompt pass). A parked row is back: its keys and values as it left them."""
        g.run_tokens = 0
        if g.parked:
            self.cache.unpark(g, g.slot)
            g.parked = False
            return
        if g.request.echo:
            g.echoed = 1
            g.emit(Token(g.ids[0], self.tokenizer.decode(g.ids[:1]), prompt=True))
        if g.request.max_tokens == 0 and not g.request.echo:
            self._finish(g, "length")

    def _reusable(self, g):
        """The prompt tokens of g that it may take from the prefix cache (none with echo: its log-probabilities
        need every position's logits): its whole chunks but the one that ends it, whose logits it needs."""
        if self.cache is None or g.completion_tokens or g.request.echo:
            return 0
        return (g.prompt_tokens - 1) // self.prefill_chunk * self.prefill_chunk

    def _reuse(self, g):
        """Copy into g's row what the prefix cache has of its prompt after what it holds."""
        most = self._reusable(g)
        if g.length < most and g.length % self.prefill_chunk == 0:
            got = self.cache.take(g.request.cache_salt, g.ids, g.length, most, g.slot)
            g.length += got
            del g.todo[:got]
            g.cached_tokens += got

    def _prompts(self, rows):
        """Of rows with a prompt to encode, those that encode a chunk now: each first takes what the prefix cache
        has of its prompt; of rows about to encode the same chunk after the same tokens (a request's choices, one
        system prompt), the first alone does (the others take it from the cache at the next step); a row left with
        one token decodes it at the next step, as it would have without the cache."""
        if self.cache is None:
            return rows
        chosen, encoding = [], set()
        for g in rows:
            self._reuse(g)
            end = g.length + self.prefill_chunk
            key = (g.request.cache_salt, tuple(g.ids[:end])) if end <= self._reusable(g) else None
            if len(g.todo) > 1 and (key is None or key not in encoding):
                chosen.append(g)
                encoding.add(key)
        return chosen

    @torch.inference_mode()
    def cache_tail(self):
        """While idle: encode the next whole chunk of a finished generation's tokens (prompt and reply) that the
        prefix cache lacks, in a free row, so that the next turn of its conversation finds it (False: nothing to
        do). A reply's own keys and values were computed token by token (another rounding); chunks are what a
        prompt's encoding gives."""
        C = self.prefill_chunk
        if self.cache is not None and self.tails:
            self._admit()  # (the rows that ended give their slots back)
        while self.cache is not None and self.tails:
            salt, ids = self.tails[0]
            have, end = self.cache.cached(salt, ids, len(ids)), len(ids) // C * C
            if have >= end:
                self.tails.popleft()
                continue
            with self.lock:
                if not self.slots.free:
                    return False
                slot = self.slots.free.pop()
            try:
                self.cache.take(salt, ids, 0, have, slot, count=False)
                with attention_backends(self.device):
                    self.model(torch.tensor([ids[have:have + C]], device=self.device),
                               kv_cache=decode.Rows(self.slots, [(slot, have)]))
                self.cache.store(salt, ids[:have + C], slot)
            finally:
                with self.lock:
                    self.slots.free.append(slot)
            return True
        return False

    def _feed(self, rows, n):
        """Run the model on the next n tokens of each row, then take each row's logits. When the pass fails, the
        rows are run again one by one and only those that fail alone end (finish_reason error)."""
        try:
            logits = self._forward(rows, n)
        except Exception as e:
            if len(rows) == 1:
                self._fail(rows[0], e)
                return
            for g in rows:
                self._feed([g], n)
            return
        sampling = []  # (the rows that sample next, by their index in rows)
        for i, (g, row) in enumerate(zip(rows, logits)):
            try:
                if self._took(g, n, row):
                    sampling.append(i)
            except Exception as e:
                self._fail(g, e)
        last = logits[:, -1]
        if len(sampling) < len(rows):
            last = last.index_select(0, to_device(sampling, logits.device))
        self._sample([rows[i] for i in sampling], last)

    def _forward(self, rows, n):
        """The model's float32 logits (B, n or 1, vocab) for the next n tokens of each row (every position's when
        the row's prompt is echoed); one token per row decodes in a fixed step where the engine has one (the
        rows taken out of its logits)."""
        self.passes += 1
        if self.fixed and n == 1:
            logits = self._fixed_logits(rows, [g.todo[0] for g in rows])
        else:
            idx = torch.tensor([g.todo[:n] for g in rows], device=self.device)
            every = any(g.request.echo and g.echoed < g.prompt_tokens for g in rows)
            logits, _ = self.model(idx, kv_cache=decode.Rows(self.slots, [(g.slot, g.length) for g in rows]),
                                   every_position=every)
        return logits[:, :, :self.vocab].float()

    def _fixed_logits(self, rows, tokens):
        """The fixed step's logits (B, 1, V) for rows, each fed one token: tokens, host ids or a device tensor (the
        tokens a step before drew, in rows' order: they never come to the host first). Every input is copied from
        pinned memory (to_device), so the host never waits for the device's queue here."""
        pos = torch.zeros(self.slots.rows, dtype=torch.long)
        for g in self.rows:  # (a row not decoding writes at its next position, which it writes again later)
            pos[g.slot] = min(g.length, self.slots.length - 1)
        index = to_device([g.slot for g in rows], self.device)
        if torch.is_tensor(tokens):
            idx = torch.zeros(self.slots.rows, 1, dtype=torch.long, device=self.device)
            idx[index, 0] = tokens
        else:
            idx = torch.zeros(self.slots.rows, 1, dtype=torch.long)
            idx[[g.slot for g in rows], 0] = torch.tensor(tokens, dtype=torch.long)
            idx = to_device(idx, self.device)
        return self.fixed_step(idx, to_device(pos, self.device)).index_select(0, index)

    def _decode(self, rows):
        """One token for each of rows, which decode: the plain pass (_feed), or with ahead the fixed step launched
        and landed (_land: the next one may be launched before its tokens are read). A launch that fails runs the
        plain pass instead, whose failures end only the rows that fail alone."""
        if not self.ahead:
            self._feed(rows, 1)
            return
        try:
            flight = self._launch(rows, [g.todo[0] for g in rows])
        except Exception:
            self._feed(rows, 1)
            return
        self._land(flight)

    def _launch(self, rows, tokens):
        """The fixed step for rows (each fed one of tokens: see _fixed_logits) and each row's next token drawn on
        the device, booked (_took) once both are queued: a Flight, its tokens on their way to the host."""
        self.passes += 1
        logits = self._fixed_logits(rows, tokens)[:, -1, :self.vocab].float()
        drawn = draw(rows, logits)
        for g in rows:
            self._took(g, 1, None)
        return Flight(rows, drawn, logits)

    def _land(self, flight):
        """Read flight's tokens and take them, after launching the next step where the batch is steady (_steady): fed
        the tokens still on the device, it runs while the host reads, streams and looks for stop texts. A row that
        ends at one of them (a stop text or token) was fed it all the same: the next step's token for it is then
        discarded when that lands (its generator drew one number more, which no token of it ever uses). The next
        step stays in flight (self.flight) until the next call of step()."""
        self.flight = None
        live = [i for i, g in enumerate(flight.rows) if not g.done]  # (ended at the token before: discarded)
        if live and self._steady([flight.rows[i] for i in live]):
            tokens = flight.tokens if len(live) == len(flight.rows) else \
                flight.tokens.index_select(0, to_device(live, self.device))
            try:
                self.flight = self._launch([flight.rows[i] for i in live], tokens)
            except Exception:
                self.flight = None  # (the plain pass runs them at the next step)
        for g, token, logits in zip(flight.rows, flight.read(), flight.logits):
            if g.done:
                continue
            try:
                self._emit(g, token, logits, fed=self.flight is not None)
            except Exception as e:
                self._fail(g, e)

    def _steady(self, rows):
        """Whether the next fixed step may be launched before rows' tokens (their step's) are read: every running row
        is one of them (no prompt to encode, none paused, no request waiting or parked: those need a step of their
        own first) and none changes course at that token but by ending (a stop text or token, max_tokens: its next
        token is then discarded): none at block_size (its window is encoded again) or cancelled."""
        if self.waiting or self.parked or len(rows) != sum(not g.done for g in self.rows):
            return False
        return self.use_cache and all(not g.cancelled and not g.paused and g.length < self.block_size for g in rows)

    def _took(self, g, n, logits):
        """Book n tokens fed to g with their logits (n or 1, V): echo the prompt's; whether g samples next."""
        start = g.length
        g.length += n
        del g.todo[:n]
        if self.cache is not None and not g.completion_tokens and n == self.prefill_chunk and not start % n:
            self.cache.store(g.request.cache_salt, g.ids[:g.length], g.slot)  # a whole chunk of the prompt
        if g.request.echo and g.echoed < g.prompt_tokens:
            self._echo(g, start, logits)
        if g.todo:
            return False  # more of the prompt (or window) to encode first
        if g.request.max_tokens == 0:
            self._finish(g, "length")
            return False
        return True

    def _echo(self, g, start, logits):
        """The prompt's tokens predicted by positions start.. as Token events: each one's log-probability given
        those before, and the top alternatives."""
        k = g.request.logprobs
        logprobs = F.log_softmax(logits, dim=-1) if k is not None else None
        while g.echoed < g.prompt_tokens and g.echoed - 1 - start < logits.size(0):
            token = g.ids[g.echoed]
            event = Token(token, self.tokenizer.decode([token]), prompt=True)
            if logprobs is not None:
                event.logprob, event.top = scores(logprobs[g.echoed - 1 - start], token, k)
            g.emit(event)
            g.echoed += 1

    def _sample(self, rows, logits):
        """Draw the next token of each row from its logits (B, V) on the device (rows with the same settings
        together, each with its own generator), then emit them; a failure ends only the rows that fail alone."""
        if not rows:
            return
        try:
            tokens = draw(rows, logits).tolist()  # the one synchronisation of the step
        except Exception as e:
            if len(rows) == 1:
                self._fail(rows[0], e)
                return
            for i, g in enumerate(rows):
                self._sample([g], logits[i:i + 1])
            return
        for g, token, row in zip(rows, tokens, logits):
            try:
                self._emit(g, token, row)
            except Exception as e:
                self._fail(g, e)

    def _emit(self, g, token, logits, fed=False):
        """Take g's new token: its event (with its log-probabilities when asked), and the end of g when done. fed: the
        token is in the model already (a step launched ahead: _land), so there is nothing left to feed."""
        request = g.request
        event = Token(token, g.text.add(token))
        if request.logprobs is not None:
            event.logprob, event.top = scores(F.log_softmax(logits, dim=-1), token, request.logprobs)
        g.completion_tokens += 1
        g.run_tokens += 1
        g.ids.append(token)
        g.todo = [] if fed else [token]
        if not fed and (not self.use_cache or g.length >= self.block_size):  # (fed: _steady saw room for it)
            g.length, g.todo = 0, g.ids[-self.block_size:]  # the window encoded again: no cache, or it slid
        if g.text.done:
            event.finish_reason = "stop"
        elif g.completion_tokens >= request.max_tokens:
            event.text += g.text.finish()
            event.finish_reason = "length"
        if event.finish_reason and self.cache is not None and len(g.ids) <= self.block_size:
            self.tails.append((request.cache_salt, list(g.ids)))  # the conversation's next turn may begin with it
        g.emit(event)

    def _fail(self, g, e):
        message = describe(e)
        print(f"engine: a request failed: {message}", file=sys.stderr, flush=True)
        self._finish(g, "error", f"generation failed: {message}")

    def _finish(self, g, reason, error=None):
        if not g.done:
            g.emit(Token(None, g.text.finish(), finish_reason=reason, error=error))


def draw(rows, logits):
    """The next token of each row (a Generation) from its logits (B, V): the rows with the same settings drawn
    together (model.sample_next), each with a uniform number from its own generator, so that a row draws what
    it would draw alone. The generators are the host's: on a GPU a row's number costs no kernel of its own, and
    a seed draws the same numbers on every device."""
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    groups = collections.defaultdict(list)
    for i, g in enumerate(rows):
        groups[(g.request.temperature, g.request.top_k, g.request.top_p)].append(i)
    for (temperature, top_k, top_p), members in groups.items():
        u = None
        if temperature >= torch.finfo(torch.float32).tiny:  # (sample_next's greedy draws nothing)
            u = to_device(torch.cat([torch.rand(1, 1, generator=rows[i].generator) for i in members]), logits.device)
        if len(members) == len(rows):  # (one group: every row, no copy of the logits)
            return sample_next(logits, temperature, top_k, top_p, u=u)
        index = to_device(members, logits.device)
        tokens[index] = sample_next(logits[index], temperature, top_k, top_p, u=u)
    return tokens


class Flight:
    """A fixed step launched and not yet read: its rows, their logits (float32, their own copy: the next step's
    graph overwrites its output) and the tokens drawn from them on the device, on their way to the host into pinned
    memory (read() waits for them alone, not for a step launched after)."""

    def __init__(self, rows, tokens, logits):
        self.rows, self.tokens, self.logits = rows, tokens, logits
        self.host, self.done = tokens, None
        if tokens.is_cuda:
            self.host = tokens.to("cpu", non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self):
        """The rows' tokens as ints (the host's one wait of a step)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def to_device(values, device):
    """A CPU tensor (or a list of ints: a long tensor) on device, without making the host wait for it: a list that
    indexes a CUDA tensor, or a tensor made from one on it, is copied from pageable memory, which waits for every
    kernel queued before (the whole decoding step); from pinned memory the copy is queued behind them instead."""
    values = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def scores(logprobs, token, k):
    """A token's log-probability (from logprobs (V,)) and the k most likely tokens with theirs."""
    top = torch.topk(logprobs, k) if k else None
    alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if k else []
    return logprobs[token].item(), alternatives


def describe(e):
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {first_line(e)}"


class QueueFull(Exception):
    """More requests than the engine is configured to hold (max_waiting)."""


class Stopped(Exception):
    """The engine does not run any more (stopped, or failed outside a request)."""
