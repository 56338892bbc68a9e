"""
The generation engine: all decoding goes through it (sample.py, serve.py).

A Request is a prompt (token ids) and its settings: max_tokens, temperature, top_k, top_p, a seed for
its own torch.Generator, stop texts and stop tokens, logprobs, echo. The engine keeps a batch of
running requests (rows). Between two steps, waiting requests join it (each prompt is encoded alone,
into a KV cache of its own) and finished or cancelled ones leave; every step runs the model once for
all rows, one new token per row. A Generation is a request's handle: its tokens arrive there as
Token events, as they are sampled, with the text they complete.

A request's tokens do not depend on what else runs, because every row is computed as if it were
alone: its prompt is encoded alone; a step's attention runs row by row over exactly the row's own
positions (model.RowCaches); on the CPU the matrix products run as oneDNN's prepacked linear
(PackedLinear), whose result for one row is the same whatever the number of rows (PyTorch's default
float32 kernel picks another algorithm for 1, 2-3 and 4 or more rows: other rounding); and each row
samples with its own generator. (On a GPU, cuBLAS picks its kernels by the batch's size, so there a
row's rounding, and at a near-tie its token, may depend on the batch.)

Speed, batch 1 (BENCHMARKS.md): decoding reads every weight once per token, so it runs at the speed
of memory. The model is converted to the run's dtype (bfloat16 halves the bytes where the CPU
computes it natively: dtype=auto) instead of autocast re-casting the weights at every step; on the
CPU the linear layers are prepacked for oneDNN (about 1.5x PyTorch's default kernels at one row) and
the KV cache stays in float32, where attention runs, so that only the new token is cast. On a CPU
without native bfloat16 (AVX2), --dtype=float16 (or bfloat16) still halves the bytes of one stream:
PyTorch's matrix-vector kernel converts as it reads; but products of many rows (prompts, batches)
are then emulated, several times slower than float32, which dtype=auto keeps there.

Past block_size a row goes on as nanoGPT's generate does: the last block_size tokens are encoded
again for every new token (alone), so it sees exactly what the uncached model would.
"""

import collections
import secrets
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery import hardware
from machinery import quantize as quantization
from model import KVCache, RowCaches, sample_next

FINISHED = ("stop", "length", "abort")  # why a generation ended: a stop text or token, max_tokens, cancelled


@dataclass
class Request:
    """What to generate. prompt: token ids (the last block_size are kept); temperature 0 is greedy;
    logprobs: how many alternatives to report with each token (None: no log-probabilities); echo: the
    prompt's tokens come back first, scored (their log-probabilities, the first token's None)."""

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


@dataclass
class Token:
    """One token of a generation: its id, the text it makes final (may be empty: a held-back UTF-8 byte or
    the start of a stop text), its log-probability under the model and the top alternatives (when asked),
    and, on the last event, why the generation ended."""

    id: Optional[int]
    text: str = ""
    logprob: Optional[float] = None
    top: Optional[list] = None  # [(token id, logprob)], most likely first
    prompt: bool = False  # an echoed prompt token
    finish_reason: Optional[str] = None


class Generation:
    """A request's handle: its Token events in order, the last with finish_reason set. By default they wait
    here for next_event() (or iteration); a sink (a callable, e.g. one that hands them to an asyncio loop)
    receives them instead, on the engine's thread. cancel() ends it at the next step."""

    def __init__(self, request, text, sink=None):
        self.request, self.text, self.sink = request, text, sink
        self.events, self.ready = collections.deque(), threading.Condition()
        self.cancelled = False
        self.finish_reason = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # decoding state (the engine's)
        self.ids = list(request.prompt)
        self.cache = None
        self.generator = None
        self.pending = None  # the token sampled last, not fed to the model yet

    def emit(self, token):
        """Deliver token, unless the generation has ended already (an abort can overtake the engine)."""
        with self.ready:
            if self.finish_reason is not None:
                return
            self.finish_reason = token.finish_reason
            if self.sink is None:
                self.events.append(token)
                self.ready.notify_all()
        if self.sink is not None:
            self.sink(token)

    def next_event(self, timeout=None):
        """The next Token (waiting for it, at most timeout seconds: then None)."""
        with self.ready:
            if not self.events and not self.ready.wait_for(lambda: self.events, timeout):
                return None
            return self.events.popleft()

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


class StreamText:
    """The generated text of one request as its tokens arrive.

    It is done at one of stop_tokens (not part of the text) or where one of the stop texts first
    appears (the text is cut there). add() returns the text that has become final, for streaming: it
    holds back an incomplete UTF-8 character (BPE tokens can split one) and a tail that may turn out
    to be the start of a stop text, so what is streamed is always a prefix of the final text, and all
    of it once finish() is called.
    """

    def __init__(self, tokenizer, stop=(), stop_tokens=()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_tokens = set(stop_tokens)
        self.ids = []
        self.text = ""  # the decoded text, cut at a stop text
        self.done = False
        self.emitted = 0  # characters of text handed out so far

    def add(self, token_id):
        """Take the next token; return the newly final text (done is set when it ends the text)."""
        if self.done:
            return ""
        if token_id in self.stop_tokens:
            return self.finish()
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids)
        cuts = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.text = self.text[:min(cuts)]
            return self.finish()
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


class PackedLinear(nn.Module):
    """An nn.Linear whose weight is prepacked for oneDNN (the CPU's inference format): the same products,
    faster at the few rows of decoding (BENCHMARKS.md), and a row's result does not depend on the other rows.
    Fewer than MIN_ROWS rows are computed as the first rows of MIN_ROWS: oneDNN takes another algorithm for
    a single row (other rounding, e.g. for GPT-2's 3072 -> 768), and its kernel is fastest at 4 rows
    (measured: bfloat16 16.5 ms against 19.3 for one row, float32 25.5 against 30.5, GPT-2 124M's matrices)."""

    MIN_ROWS = 4

    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight  # (kept for its dtype and shape; tied to the token embedding in lm_head)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x):
        rows = x.shape[:-1].numel()
        if rows >= self.MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        padded = torch.cat([x.reshape(rows, -1), x.new_zeros(self.MIN_ROWS - rows, x.size(-1))])
        y = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], -1)


def prepare(model, device, dtype, compile=False, quantize=None):
    """The model ready to decode on device in dtype ("float32", "bfloat16", "float16"): in eval mode, its
    weights in dtype, and on the CPU its linear layers prepacked where that is faster (can_pack). compile:
    torch.compile it in place instead (inductor chooses its own kernels, and packs weights itself; whether a
    row's result then depends on the others is up to them). quantize="int8": int8 weights for the linear
    layers that take them (machinery/quantize.py), before either."""
    model = quantization.quantize(model.eval().to(device=device, dtype=hardware.DTYPES[dtype]), quantize)
    if compile:
        model.compile(dynamic=True)  # in place: the engine's calls to the model run compiled
        return model
    if torch.device(device).type == "cpu" and can_pack(dtype):
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child))
    return model


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
    (serve.py). max_batch: running rows at most; max_waiting: requests waiting to join, at most; use_cache=False
    encodes each row's whole window again for every token, as nanoGPT does (the same tokens, slower)."""

    def __init__(self, model, tokenizer, device="cpu", max_batch=32, max_waiting=256, use_cache=True):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.vocab = tokenizer.vocab_size  # the tokenizer's ids: a padded vocabulary's extra rows are never drawn
        self.block_size = model.config.block_size
        self.cache_dtype = model.cache_dtype(self.device)
        self.max_batch, self.max_waiting, self.use_cache = max_batch, max_waiting, use_cache
        self.waiting, self.rows = collections.deque(), []
        self.lock = threading.Condition()
        self.thread, self.stopping = None, False

    # ------------------------------------------------------------------ submitting

    def submit(self, request, sink=None):
        """Queue request; its Generation (sink: see Generation). QueueFull when max_waiting requests wait."""
        generation = Generation(request, StreamText(self.tokenizer, request.stop, request.stop_tokens), sink)
        generation.ids = list(request.prompt)[-self.block_size:]
        generation.prompt_tokens = len(generation.ids)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        generation.generator = torch.Generator(device=self.device).manual_seed(seed)
        with self.lock:
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
            return sum(not g.done for g in self.rows), len(self.waiting)

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

    def abort_all(self):
        """End every waiting and running generation now (finish_reason abort): for shutting down."""
        with self.lock:
            everyone = list(self.waiting) + list(self.rows)
            self.waiting.clear()
        for g in everyone:
            g.cancel()
            self._finish(g, "abort")

    def _run(self):
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.waiting or self.rows or self.stopping)
                if self.stopping:
                    return
            self.step()

    @torch.inference_mode()
    def step(self):
        """Admit waiting requests (each prompt encoded alone), then one token for every running row."""
        with self.lock:
            for g in [g for g in self.rows if g.cancelled and not g.done]:
                self._finish(g, "abort")
            self.rows = [g for g in self.rows if not g.done]
            while self.waiting and len(self.rows) < self.max_batch:
                self.rows.append(self.waiting.popleft())
            rows = list(self.rows)
        for g in rows:
            if g.cache is None and not g.done:
                self._start(g)
        batch = [g for g in rows if not g.done and g.pending is not None]
        # past block_size (or without the cache: always, as nanoGPT): the window encoded again, alone
        full = [g for g in batch if g.cache.pos >= self.block_size or not self.use_cache]
        for g in full:
            self._window(g)
        batch = [g for g in batch if g not in full]
        if batch:
            idx = torch.tensor([[g.pending] for g in batch], device=self.device)
            logits, _ = self.model(idx, kv_cache=RowCaches([g.cache for g in batch]))
            for g, row in zip(batch, logits[:, -1, :self.vocab].float()):
                self._sample(g, row)

    def _start(self, g):
        """Encode the prompt alone into its own cache; echo its tokens if asked; sample the first token."""
        g.cache = KVCache(self.model.config, 1, self.cache_dtype, self.device)
        request = g.request
        idx = torch.tensor([g.ids], device=self.device)
        logits, _ = self.model(idx, kv_cache=g.cache, every_position=request.echo)
        logits = logits[0, :, :self.vocab].float()
        if request.echo:
            self._echo(g, logits)
        if request.max_tokens == 0:
            self._finish(g, "length")
            return
        self._sample(g, logits[-1])

    def _window(self, g):
        """A row past block_size: its last block_size tokens (the newest sampled included) encoded again."""
        g.cache.pos = 0
        g.ids.append(g.pending)
        idx = torch.tensor([g.ids[-self.block_size:]], device=self.device)
        logits, _ = self.model(idx, kv_cache=g.cache)
        self._sample(g, logits[0, -1, :self.vocab].float(), fed=True)

    def _echo(self, g, logits):
        """The prompt's tokens as Token events: each one's log-probability given those before (None for the
        first), and the top alternatives."""
        logprobs = F.log_softmax(logits, dim=-1) if g.request.logprobs is not None else None
        for i, token in enumerate(g.ids):
            event = Token(token, self.tokenizer.decode([token]), prompt=True)
            if logprobs is not None and i > 0:
                event.logprob, event.top = self._scores(logprobs[i - 1], token, g.request.logprobs)
            g.emit(event)

    def _scores(self, logprobs, token, k):
        top = torch.topk(logprobs, k) if k else None
        alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if k else []
        return logprobs[token].item(), alternatives

    def _sample(self, g, logits, fed=False):
        """Draw the next token of g from its logits (V,) and emit it; end g when it is done."""
        request = g.request
        if g.cancelled:
            self._finish(g, "abort")
            return
        if g.pending is not None and not fed:
            g.ids.append(g.pending)
        token = sample_next(logits[None], request.temperature, request.top_k, request.top_p, g.generator).item()
        event = Token(token, g.text.add(token))
        if request.logprobs is not None:
            event.logprob, event.top = self._scores(F.log_softmax(logits, dim=-1), token, request.logprobs)
        g.completion_tokens += 1
        g.pending = token
        if g.text.done:
            event.finish_reason = "stop"
        elif g.completion_tokens >= request.max_tokens:
            event.text += g.text.finish()
            event.finish_reason = "length"
        g.emit(event)

    def _finish(self, g, reason):
        if not g.done:
            g.emit(Token(None, g.text.finish(), finish_reason=reason))


class QueueFull(Exception):
    """More requests than the engine is configured to hold (max_waiting)."""
