"""
The generation engine's scheduler: every decoding of sample.py and serve.py goes through it. submit() queues a Request
(machinery/generation/request.py); a step admits waiting requests to free rows of the KV cache (slots), decodes a token for every
running row, then encodes a chunk of a waiting prompt (chunked prefill: a long prompt delays the running rows by one
chunk a step, not by its whole length). A row's tokens do not depend on what else runs: each is computed as if alone.
With a prefix cache (machinery/generation/prefix_cache.py) a prompt takes the whole chunks that it holds instead of encoding them,
the engine encodes finished conversations into it when idle, and a paused row (its reader does not read), or one that
has run QUANTUM tokens while requests wait, gives its slot up, its row kept there, and resumes where it was. A request
that fails ends alone ("error"); a fault outside any request stops the engine (alive False: /health answers 503).
Not owned: running the model (machinery/generation/model_runner.py), the model's CPU layers (machinery/generation/packing.py).
"""

import collections
import sys
import threading
import time

import torch

from machinery.generation import decode
from machinery.generation.decode_attention import check as check_attention
from machinery.generation.model_runner import ModelRunner, describe
from machinery.generation.packing import calibrate
from machinery.generation.prefix_cache import PrefixCache
from machinery.generation.request import Generation, QueueFull, Stopped, StreamText
from model import attention_backends

QUANTUM = 16  # tokens a row samples, at least, each time it (re)joins the batch before a waiting request may take its
# slot (Engine._preempt): a new request waits a few quanta, not until rows that never end (clients that read slowly)
# have ended, and parking a row (a copy of its keys and values) stays a small part of the work it then does


class Engine:
    """Continuous batching over one model (see the module's docstring). submit() from any thread; step() runs one step
    (sample.py calls it in a loop); start() runs steps in a thread of its own while there is work (serve.py).
    max_batch: running rows at most (the KV cache's rows); max_waiting: requests waiting to join, at most;
    prefill_chunk: prompt tokens encoded in one pass, at most; stall_timeout: seconds a paused generation (see
    Generation) may wait for its reader; use_cache=False encodes each row's whole window again for every token, as
    nanoGPT does (the same tokens, slower); fixed: decode every row of the cache at every step, in shapes that never
    change (machinery/generation/decode.py; None: on CUDA, where it runs as a CUDA graph); decode_attention: how the fixed
    step's rows attend (full or flex: machinery/generation/decode_attention.py); ahead: launch each fixed step before the host
    reads the tokens of the one before (None: wherever fixed; ModelRunner.land); compile: torch.compile the fixed
    step (one graph), else the model in place (dynamic shapes); prefix_cache_mb: the prefix cache's budget (0: none),
    which also keeps the rows that give their slots up; calibration: a CalibrationCache that calibrate's measurements
    are taken from and kept in (None: measured)."""

    def __init__(self, model, tokenizer, device="cpu", max_batch=32, max_waiting=256, use_cache=True,
                 prefill_chunk=64, stall_timeout=60.0, fixed=None, compile=False, prefix_cache_mb=0,
                 calibration=None, decode_attention="full", ahead=None):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.block_size = model.config.block_size
        fixed = self.device.type == "cuda" if fixed is None else fixed
        check_attention(decode_attention, fixed)
        self.slots = decode.Slots(model.config, max_batch, decode.cache_dtype(model, self.device, fixed, compile),
                                  self.device, fixed, decode_attention)
        self.cache = PrefixCache(self.slots, prefill_chunk, prefix_cache_mb) if prefix_cache_mb and use_cache else None
        if self.cache is not None and not self.cache.blocks:
            self.cache = None  # (a budget under one chunk's keys and values)
        self.tails = collections.deque(maxlen=max_batch)  # (salt, ids) of finished generations, to cache when idle
        self.model_runner = ModelRunner(model, tokenizer, self.slots, self.cache, fixed, compile, decode_attention,
                                        ahead, use_cache, lambda: self.rows, self._steady, self.tails)
        self.max_batch, self.max_waiting, self.use_cache = max_batch, max_waiting, use_cache
        # the rows one decoding pass may hold (more are decoded in several passes): every row's result its own
        self.pass_rows = max_batch if fixed else calibrate(model, max_batch, calibration)
        self.prefill_chunk, self.stall_timeout = prefill_chunk, stall_timeout
        self.waiting, self.rows = collections.deque(), []
        self.parked = []  # paused generations that gave their slots to waiting requests
        self.lock = threading.Condition()
        self.thread, self.stopping, self.failure = None, False, None

    def submit(self, request, notify=None, max_backlog=None):
        """Queue request; its Generation (notify, max_backlog: see Generation). ValueError for a prompt that is
        empty or longer than block_size; QueueFull when max_waiting requests wait; Stopped once the engine has
        stopped."""
        if not 0 < len(request.prompt) <= self.block_size:
            raise ValueError(f"a prompt must have 1 to {self.block_size} tokens, not {len(request.prompt)}")
        generation = Generation(request, StreamText(self.tokenizer, request.stop, request.stop_tokens), notify,
                                max_backlog, resume=self._wake)
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
            g.end(reason, error)

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

    def run(self, generations, show=None, until=None):
        """Step in this thread (no start()) until every one of generations is done, or until() is true; show(text),
        when given, gets the first one's text piece by piece as it becomes final (sample.py's and talk.py's
        streaming)."""
        while True:
            while show and (token := generations[0].next_event(timeout=0)) is not None:
                show(token.text)
            if all(g.done for g in generations) or (until is not None and until()):
                return
            self.step()

    @torch.inference_mode()
    def step(self):
        """One step: admit waiting requests; one token for every running row that has one to feed; then a chunk
        of the waiting prompts (one chunk while rows are decoding, one for each prompt when none is). With a fixed
        step in flight (ahead), the step is its landing instead (ModelRunner.land)."""
        runner = self.model_runner
        if runner.flight is not None:
            with attention_backends(self.device):
                runner.land(runner.flight)
            return
        ready = [g for g in self._admit() if not g.done and not g.paused]
        decoding = [g for g in ready if len(g.todo) == 1]
        with attention_backends(self.device):
            for i in range(0, len(decoding), self.pass_rows):
                runner.decode(decoding[i:i + self.pass_rows])
            prompts = self._prompts([g for g in ready if len(g.todo) > 1 and not g.done])
            for g in prompts[:1] if decoding else prompts:
                runner.feed([g], min(len(g.todo), self.prefill_chunk))
        runner.move_weights(self.rows)

    def _admit(self):
        """Drop the rows that ended (their slots are free again), end cancelled and stalled ones, and let waiting
        requests join while there are free slots; the running rows."""
        now = time.monotonic()
        with self.lock:
            for g in self.rows + list(self.waiting) + self.parked:
                if g.cancelled or g.paused and now - g.last_read > self.stall_timeout:
                    g.end("abort")
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
        """A row's first step (ModelRunner.begin); a parked row is back: its keys and values as it left them."""
        g.run_tokens = 0
        if g.parked:
            self.cache.unpark(g, g.slot)
            g.parked = False
            return
        self.model_runner.begin(g)

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
                self.model_runner.encode(ids[have:have + C], slot, have)
                self.cache.store(salt, ids[:have + C], slot)
            finally:
                with self.lock:
                    self.slots.free.append(slot)
            return True
        return False

    def _steady(self, rows):
        """Whether the next fixed step may be launched before rows' tokens (their step's) are read: every running row
        is one of them (no prompt to encode, none paused, no request waiting or parked: those need a step of their
        own first) and none changes course at that token but by ending (a stop text or token, max_tokens: its next
        token is then discarded): none at block_size (its window is encoded again) or cancelled."""
        if self.waiting or self.parked or len(rows) != sum(not g.done for g in self.rows):
            return False
        return self.use_cache and all(not g.cancelled and not g.paused and g.length < self.block_size for g in rows)
