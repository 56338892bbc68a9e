"""
A request to the generation engine and what comes back: Request (a prompt and its settings), Generation (its handle,
where its events wait for the reader, pausing the request while too many wait unread), Token (one event: a token, the
text it makes final, its log-probabilities, why the generation ended), StreamText (the text as the tokens arrive, a
stop text cut and a split UTF-8 character held back), FINISHED, and the engine's refusals (QueueFull, Stopped).
Not owned: which rows run when (machinery/generation/engine.py), running the model (machinery/generation/model_runner.py).
"""

import collections
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

FINISHED = ("stop", "length", "abort", "error")  # why a generation ended: a stop text or token, max_tokens,
# cancelled, failed


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
    grammar: Optional[object] = None  # a compiled schema the reply must follow (grammar.compile_schema)


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

    def __init__(self, request, text, notify=None, max_backlog=None, resume=None):
        self.request, self.text, self.notify, self.max_backlog = request, text, notify, max_backlog
        self.events, self.ready = collections.deque(), threading.Condition()
        self.cancelled = False
        self.finish_reason, self.error = None, None
        self.prompt_tokens = len(request.prompt)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        self.last_read = time.monotonic()
        self.resume = resume  # the engine's: called when a paused generation's reader takes events
        # decoding state (the engine's)
        self.ids = list(request.prompt)  # every token so far: the prompt, then each one sampled
        self.todo = list(request.prompt)  # what the model has not seen yet: the prompt, then the token sampled last
        self.slot = None  # its row of the engine's KV cache, while it runs
        self.parked = False  # its row's keys and values kept in the prefix cache, its slot given up (paused, or
        # preempted: Engine._preempt)
        self.run_tokens = 0  # tokens sampled since it last (re)joined the batch (Engine._preempt)
        self.length = 0  # positions of that row filled
        self.echoed = 0  # prompt tokens echoed so far (echo)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed)  # its own draws (on the host: model_runner.draw)
        self.grammar = None if request.grammar is None else request.grammar.start(request.stop_tokens)  # its state

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

    def end(self, reason, error=None):
        """End it now (reason: one of FINISHED), its text not handed out yet in the last event; not once ended."""
        if not self.done:
            self.emit(Token(None, self.text.finish(), finish_reason=reason, error=error))

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


class QueueFull(Exception):
    """More requests than the engine is configured to hold (max_waiting)."""


class Stopped(Exception):
    """The engine does not run any more (stopped, or failed outside a request)."""
