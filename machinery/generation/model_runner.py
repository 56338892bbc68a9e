"""
The engine's model runner: the model run for the rows that the scheduler (machinery/generation/engine.py) picks, and its logits
made each row's next token and events. A prompt's chunk or a plain decoding pass runs the model over the rows of the
KV cache (decode.Rows); a fixed step runs every row of the cache in shapes that never change (decode.FixedStep: a
CUDA graph), launched ahead, before the host reads the last step's tokens (Flight), where the batch is steady and no
row has a grammar. A row draws with its own generator (draw), so it draws what it would alone, a grammar's row among
the tokens its grammar allows (grammar.py); a pass that fails runs again row by row, and only the rows that fail alone
end. On the CPU the weights move into huge pages once a run has used them enough.
Not owned: which rows run, the queue, the prefix cache's policy (machinery/generation/engine.py); the layers (packing.py).
"""

import collections
import sys

import numpy as np
import torch
import torch.nn.functional as F

from machinery.generation import decode, grammar, hugepages
from machinery.generation.decode_attention import check_ahead
from machinery.errors import first_line
from machinery.generation.packing import RowsLinear
from machinery.generation.request import Token
from model import attention_backends, sample_next

HUGE_PAGES_AFTER = 128  # passes of the model (each reads every weight) that pay for moving them into huge pages


class ModelRunner:
    """Runs the model for rows (Generations holding rows of slots, the KV cache) and takes each row's next token:
    begin (a request's first event), feed (a chunk of prompts, or one plain decoding pass), decode (a decoding pass,
    launched ahead where it may be), land (a pass in flight), encode (a chunk into a row, for the prefix cache).
    fixed, compile, decode_attention, ahead: as the Engine's; cache: the prefix cache (None: none), which keeps each
    whole chunk of a prompt; running: a callable, every row that holds a slot (the fixed step writes each at its
    position); steady: a callable, whether the next step for rows may be launched before their tokens are read
    (Engine._steady); tails: where a finished generation's ids go, for the engine to encode into the prefix cache
    when idle."""

    def __init__(self, model, tokenizer, slots, cache, fixed, compile, decode_attention, ahead, use_cache, running,
                 steady, tails):
        self.model, self.tokenizer, self.slots, self.cache, self.device = model, tokenizer, slots, cache, slots.device
        self.vocab = tokenizer.vocab_size  # the tokenizer's ids: a padded vocabulary's extra rows are never drawn
        self.block_size, self.use_cache = model.config.block_size, use_cache
        self.fixed_step = decode.FixedStep(model, slots, compile, decode_attention) if fixed else None
        self.ahead = fixed if ahead is None else ahead  # launch a fixed step before reading the last's tokens
        check_ahead(self.ahead, fixed)
        self.flight = None  # a fixed step launched, its tokens not read yet (Flight)
        if compile and not fixed:
            model.compile(dynamic=True)  # in place: the engine's calls to the model run compiled
        self.running, self.steady, self.tails = running, steady, tails
        self.passes, self.huge_pages = 0, None  # the model's passes; the thread that moves the weights to huge pages

    def feed(self, rows, n):
        """Run the model on the next n tokens of each row, then take each row's logits. When the pass fails, the
        rows are run again one by one and only those that fail alone end (finish_reason error)."""
        try:
            logits = self._forward(rows, n)
        except Exception as e:
            if len(rows) == 1:
                self._fail(rows[0], e)
                return
            for g in rows:
                self.feed([g], n)
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

    def begin(self, g):
        """A request's first event, before any pass: its first prompt token when echoed (nothing predicts it);
        max_tokens 0 without echo ends it at once (no prompt pass)."""
        if g.request.echo:
            g.echoed = 1
            g.emit(Token(g.ids[0], self.tokenizer.decode(g.ids[:1]), prompt=True))
        if g.request.max_tokens == 0 and not g.request.echo:
            g.end("length")

    def encode(self, ids, slot, length):
        """Run the model on ids in slot's row after its first length positions (no logits taken: a chunk that the
        prefix cache keeps)."""
        with attention_backends(self.device):
            self.model(torch.tensor([ids], device=self.device), kv_cache=decode.Rows(self.slots, [(slot, length)]))

    def _forward(self, rows, n):
        """The model's float32 logits (B, n or 1, vocab) for the next n tokens of each row (every position's when
        the row's prompt is echoed); one token per row decodes in a fixed step where there is one (the rows taken
        out of its logits)."""
        self.passes += 1
        if self.fixed_step is not None and n == 1:
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
        for g in self.running():  # (a row not decoding writes at its next position, which it writes again later)
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

    def decode(self, rows):
        """One token for each of rows, which decode: the plain pass (feed), or with ahead the fixed step launched
        and landed (land: the next one may be launched before its tokens are read). A launch that fails runs the
        plain pass instead, whose failures end only the rows that fail alone."""
        if not self.ahead or any(g.grammar is not None for g in rows):  # (a grammar's mask needs the host first)
            self.feed(rows, 1)
            return
        try:
            flight = self._launch(rows, [g.todo[0] for g in rows])
        except Exception:
            self.feed(rows, 1)
            return
        self.land(flight)

    def _launch(self, rows, tokens):
        """The fixed step for rows (each fed one of tokens: see _fixed_logits) and each row's next token drawn on
        the device, booked (_took) once both are queued: a Flight, its tokens on their way to the host."""
        self.passes += 1
        logits = self._fixed_logits(rows, tokens)[:, -1, :self.vocab].float()
        drawn = draw(rows, logits)
        for g in rows:
            self._took(g, 1, None)
        return Flight(rows, drawn, logits)

    def land(self, flight):
        """Read flight's tokens and take them, after launching the next step where the batch is steady (steady): fed
        the tokens still on the device, it runs while the host reads, streams and looks for stop texts. A row that
        ends at one of them (a stop text or token) was fed it all the same: the next step's token for it is then
        discarded when that lands (its generator drew one number more, which no token of it ever uses). The next
        step stays in flight (self.flight) until the engine's next step."""
        self.flight = None
        live = [i for i, g in enumerate(flight.rows) if not g.done]  # (ended at the token before: discarded)
        if live and self.steady([flight.rows[i] for i in live]):
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

    def _took(self, g, n, logits):
        """Book n tokens fed to g with their logits (n or 1, V): echo the prompt's; whether g samples next."""
        start = g.length
        g.length += n
        del g.todo[:n]
        if self.cache is not None and not g.completion_tokens and n == self.cache.chunk and not start % n:
            self.cache.store(g.request.cache_salt, g.ids[:g.length], g.slot)  # a whole chunk of the prompt
        if g.request.echo and g.echoed < g.prompt_tokens:
            self._echo(g, start, logits)
        if g.todo:
            return False  # more of the prompt (or window) to encode first
        if g.request.max_tokens == 0:
            g.end("length")
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
        rows, logits, allowed = self._constrain(rows, logits)
        if not rows:
            return
        try:
            tokens = draw(rows, allowed).tolist()  # the one synchronisation of the step
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

    def _constrain(self, rows, logits):
        """(rows, logits, the logits drawn from): a grammar's row has -inf outside the tokens its grammar allows
        (in a copy: log-probabilities stay the model's); a row whose grammar allows none of the vocabulary's tokens
        ends (error). Rows without a grammar cost nothing here; the host's work is numpy's, one masked_fill on the
        device (small torch operations cost more than their arithmetic)."""
        constrained = [i for i, g in enumerate(rows) if g.grammar is not None]
        if not constrained:
            return rows, logits, logits
        try:
            allowed = grammar.masks([rows[i].grammar for i in constrained], self.vocab)
        except Exception as e:
            for i in constrained:
                self._fail(rows[i], e)
            allowed = np.zeros((len(constrained), self.vocab), dtype=np.bool_)
        if len(constrained) == len(rows):
            banned = ~allowed
        else:
            banned = np.zeros((len(rows), self.vocab), dtype=np.bool_)
            banned[constrained] = ~allowed
        dead = [constrained[i] for i in np.flatnonzero(~allowed.any(axis=1))]
        for i in dead:
            if not rows[i].done:
                self._fail(rows[i], ValueError("the JSON schema allows no token of this model's vocabulary here"))
        masked = logits.masked_fill(to_device(torch.from_numpy(banned), logits.device), float("-inf"))
        if dead:
            kept = [i for i in range(len(rows)) if i not in dead]
            index = to_device(kept, logits.device)
            return [rows[i] for i in kept], logits[index], masked[index]
        return rows, logits, masked

    def _emit(self, g, token, logits, fed=False):
        """Take g's new token: its event (with its log-probabilities when asked), and the end of g when done. fed: the
        token is in the model already (a step launched ahead: land), so there is nothing left to feed. Past
        block_size a row goes on as nanoGPT's generate does: its last block_size tokens are encoded again."""
        request = g.request
        complete = g.grammar is not None and g.grammar.advance(token)  # (first: a token outside it fails the row)
        event = Token(token, g.text.add(token))
        if request.logprobs is not None:
            event.logprob, event.top = scores(F.log_softmax(logits, dim=-1), token, request.logprobs)
        g.completion_tokens += 1
        g.run_tokens += 1
        g.ids.append(token)
        g.todo = [] if fed else [token]
        if not fed and (not self.use_cache or g.length >= self.block_size):  # (fed: steady saw room for it)
            g.length, g.todo = 0, g.ids[-self.block_size:]  # the window encoded again: no cache, or it slid
        if g.text.done:
            event.finish_reason = "stop"
        elif complete:  # (only an end token may follow)
            event.text += g.text.finish()
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
        g.end("error", f"generation failed: {message}")

    def move_weights(self, rows):
        """Move the weights into huge pages on the CPU, once; self.huge_pages: how it went (the move's thread, or the
        bytes moved at once). At once, on every thread, where rows (the running ones) are to decode HUGE_PAGES_AFTER
        tokens more; else in the background once the model has run that many passes: as in renting skis until the
        rent would have bought them, a run that ends sooner never pays, and a longer one pays at most twice what
        moving at once would have. Called at the end of a step: a new request's prompt encoded, its decoding not
        begun."""
        if self.huge_pages is not None or self.device.type != "cpu":
            return
        at_once = max((g.request.max_tokens - g.completion_tokens for g in rows), default=0) >= HUGE_PAGES_AFTER
        if not at_once and self.passes < HUGE_PAGES_AFTER:
            return  # (every step until then: nothing more is looked at)
        regions = [layer.memory() for layer in self.model.modules() if isinstance(layer, RowsLinear)]
        if at_once:
            self.huge_pages = hugepages.collapse(regions, torch.get_num_threads())
        else:
            self.huge_pages = hugepages.collapse_in_background(regions)


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
