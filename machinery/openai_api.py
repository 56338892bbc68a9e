"""
The HTTP API of serve.py: OpenAI's completions and chat completions over the generation engine, the
tokenizer over HTTP as vLLM serves it, and a web page. FastAPI routes; the requests are checked here,
field by field, so that every mistake gets OpenAI's error object and a 4xx status.

    GET  /                      the web page (chat.html beside this file: no CDN, works offline)
    GET  /health                {"status": "ok", "running": N, "waiting": M}; 503 once the engine cannot serve
    GET  /v1/models             the one model, by name, and its context length (max_model_len)
    GET  /v1/models/{name}      that model (404 for another name)
    GET  /metrics               the prefix cache's lookups, hits, tokens saved, evictions, bytes held (Prometheus)
    POST /v1/completions        prompt: a string, a list of token ids, or a list of either; max_tokens (16),
                                temperature (1), top_p, top_k (an extension), n, stop, seed, stream, echo,
                                logprobs (0-5), stream_options.include_usage
    POST /v1/chat/completions   messages, in the model's chat format (chat.py) or, for a base model, rendered by
                                CHAT_TEMPLATE (a developer message is the system message); max_tokens /
                                max_completion_tokens (default: up to the context), logprobs (true/false),
                                top_logprobs (0-20); the other settings as above. response_format {"type": "text"}
                                only; tools, JSON output, audio and the like are refused (CHAT_UNSUPPORTED)
    GET  /tokenizer_info        eos / bos / pad tokens, the chat template (Jinja), model_max_length
    POST /tokenize              {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize            {"tokens"} -> {"prompt"}

Semantics worth knowing:
- A prompt longer than block_size is refused (400, code context_length_exceeded), as OpenAI and vLLM do:
  cutting it would change its log-likelihoods silently. Generation past block_size slides the window, as
  nanoGPT's generate does. An empty prompt starts from <|endoftext|> (GPT-2's unconditional samples), where
  the model has one; elsewhere it is refused.
- Generation stops at <|endoftext|> for GPT-2 BPE models (as OpenAI's models stop at theirs), at a stop
  text (cut from the text), or after max_tokens (finish_reason "stop" or "length"; "abort" when the
  server shuts down mid-generation). A chat model's reply stops at the assistant's end of turn (talk.py).
- logprobs are the model's own log-probabilities (log-softmax of its logits, whatever the temperature),
  for every token sampled, the stop token included; with echo the prompt's tokens come first, the first
  one's None. top_logprobs: the `logprobs` most likely tokens at each position, by their text. Chat's:
  choices[].logprobs.content, an entry {token, logprob, bytes, top_logprobs} a token of the reply (its end
  of turn is none).
- Streams end as OpenAI's: the text in chunks whose finish_reason is null, then a chunk without text (chat:
  delta {}) that carries it; a chat stream's first chunk says role "assistant". With
  stream_options.include_usage every chunk says "usage": null but the last, whose choices are [].
- Prompt caching: a prompt that begins as an earlier one did (the same system prompt, the conversation so far)
  takes its whole prefill chunks from the engine's prefix cache instead of encoding them, with the same results
  (machinery/prefix_cache.py); usage.prompt_tokens_details.cached_tokens says how many. cache_salt (a string,
  vLLM's field) keeps requests of different salts from sharing anything.
- seed: choice i of a request draws with seed + i (its own torch.Generator), so the same seeded request
  gives the same text alone or among others (machinery/engine.py). Without a seed, a random one.
- With an API key, every route but / and /health needs `Authorization: Bearer KEY` (401 without). POST routes
  take `Content-Type: application/json` only (415): a web page elsewhere cannot post a form to them.
- A client's mistake is a 4xx with OpenAI's error object; a limit of this server is 400 naming the field; 429
  (with Retry-After) only when the queue is full; a request that fails inside the engine ends alone with a
  500 (or, streamed, an error event and [DONE]); a client that hangs up or stops reading frees its row.
"""

import asyncio
import hmac
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass

from machinery import chat, talk
from machinery.request import QueueFull, Request, Stopped
from machinery.errors import UserError, first_line
from machinery.tokenizer import end_of_text_stop

# The chat template of base models (which were never trained on a chat format; a chat model has its own,
# chat.py's): the messages as a plain dialogue, and the answer stops where the next turn would begin.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
                 "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
CHAT_STOP = "\nUser:"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> ours
MAX_STOP_TEXTS = 4
MAX_LOGPROBS = 5  # completions' logprobs (OpenAI's legacy limit)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
# chat/completions fields of OpenAI's that this server does not do (it writes plain text, with no tools, audio, web
# search or reasoning): refused (400 unsupported) unless absent, null or one of the values that change nothing
CHAT_UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
                    "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default")}
# ... and those that change nothing here (who the end user is, a caching hint, tags): checked, then unused
CHAT_NO_OPS = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict,
               "parallel_tool_calls": bool}
# events a stream may leave unread before its generation pauses (Generation.max_backlog): few, as a reader that keeps
# up takes each step's events at once, and the connection's own buffers (serve.py's SEND_BUFFER) hold its next chunks
STREAM_BACKLOG = 16
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a 64-bit signed integer, as OpenAI's and vLLM's seed
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")


@dataclass
class Limits:
    """What one server takes on: beyond them a request is answered 400 (413 for the body)."""

    max_tokens: int = 1024  # tokens a request may ask to generate, per choice
    max_n: int = 8  # choices per request (prompts x n)
    max_body: int = 1 << 20  # bytes of a request's body


class APIError(Exception):
    """A request the API refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status, message, param=None, code=None, type="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers

    def body(self):
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- reading a request


def field(body, name, kinds, default=None, check=None, expect=""):
    """body[name] (default when absent or null), of one of kinds (bool is not a number), passing check."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {expect}, got {json.dumps(value)[:80]}", name, "invalid_type")
    if check is not None and not check(value):
        raise APIError(400, f"{name} must be {expect}, got {json.dumps(value)[:80]}", name, "invalid_value")
    return value


class Requests:
    """Reads the generation settings of a request body into engine Requests, one per choice. max_tokens None
    (chat's default) generates up to the context: block_size minus the prompt's tokens."""

    def __init__(self, server, body, max_tokens=16):
        self.server = server
        tokenizer, limits = server.tokenizer, server.limits
        names = ("max_completion_tokens", "max_tokens") if max_tokens is None else ("max_tokens",)  # chat: both
        given = [name for name in names if body.get(name) is not None]
        self.max_tokens_param = given[0] if given else names[-1]
        self.max_tokens = field(body, self.max_tokens_param, int, max_tokens, lambda v: v >= 0, "an integer >= 0")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            raise APIError(400, f"{self.max_tokens_param} {self.max_tokens} is more than this server's limit of "
                                f"{limits.max_tokens}", self.max_tokens_param, "limit_exceeded")
        self.temperature = field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2,
                                 "a number from 0 to 2")
        self.top_p = field(body, "top_p", (int, float), None, lambda v: 0 <= v <= 1, "a number from 0 to 1")
        self.top_k = field(body, "top_k", int, None, lambda v: v > 0 or v == -1, "a positive integer (-1: off)")
        self.top_k = None if self.top_k == -1 else self.top_k
        self.n = field(body, "n", int, 1, lambda v: v >= 1, "an integer >= 1")
        self.seed = field(body, "seed", int, None, lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1] - 64,
                          "a 64-bit signed integer")
        stop = field(body, "stop", (str, list), (), expect="a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > MAX_STOP_TEXTS or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_TEXTS}",
                           "stop", "invalid_value")
        self.stop = tuple(stop)
        self.logprobs = field(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS,
                              f"an integer from 0 to {MAX_LOGPROBS}")
        self.echo = field(body, "echo", bool, False, expect="true or false")
        self.cache_salt = field(body, "cache_salt", str, None, expect="a string")
        self.stream = field(body, "stream", bool, False, expect="true or false")
        options = field(body, "stream_options", dict, {}, expect="an object")
        self.include_usage = field(options, "include_usage", bool, False, expect="true or false")
        self.stop_tokens = end_of_text_stop(tokenizer)
        for name, neutral in (("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0), ("suffix", None),
                              ("logit_bias", {})):
            if body.get(name) not in (None, neutral):
                raise APIError(400, f"{name} is not supported by this server", name, "unsupported")
        check_response_format(body)

    def choices(self, prompts):
        """The engine Requests: for each prompt, n choices (choice i with seed + i)."""
        if len(prompts) * self.n > self.server.limits.max_n:
            raise APIError(400, f"{len(prompts)} prompt(s) x n = {self.n} is more choices than this server's "
                                f"limit of {self.server.limits.max_n}", "n", "limit_exceeded")
        block_size = self.server.block_size
        return [Request(ids, self.max_tokens if self.max_tokens is not None else max(1, block_size - len(ids)),
                        self.temperature, self.top_k, self.top_p, None if self.seed is None else self.seed + i,
                        self.stop, self.stop_tokens, self.logprobs, self.echo, self.cache_salt)
                for ids in prompts for i in range(self.n)]


def check_response_format(body):
    """A request's response_format: {"type": "text"} (or none) is what this server writes; JSON output is refused, as
    it has no constrained decoding to guarantee it."""
    expect = 'an object {"type": "text"}'
    kind = field(body, "response_format", dict, {"type": "text"}, expect=expect).get("type")
    if kind in ("json_object", "json_schema"):
        raise APIError(400, f"response_format {kind} is not supported by this server (it cannot constrain its output "
                            f'to JSON); send {{"type": "text"}} or leave it out', "response_format", "unsupported")
    if kind != "text":
        raise APIError(400, f"response_format must be {expect}, got type {json.dumps(kind)[:80]}", "response_format",
                       "invalid_value")


def check_chat_fields(body):
    """Refuse the chat fields this server does not do (CHAT_UNSUPPORTED), check those that change nothing
    (CHAT_NO_OPS); return how many alternatives each token comes with: top_logprobs with logprobs true (0 without
    it), None without logprobs."""
    for name, no_ops in CHAT_UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in no_ops:
            raise APIError(400, f"{name} is not supported by this server: it writes plain text only; send the "
                                f"request without {name}", name, "unsupported")
    for name, kind in CHAT_NO_OPS.items():
        field(body, name, kind, expect={str: "a string", dict: "an object", bool: "true or false"}[kind])
    wanted = field(body, "logprobs", bool, False, expect="true or false")
    top = field(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true; send both, or neither", "top_logprobs",
                       "invalid_value")
    return (top or 0) if wanted else None


def prompts_of(server, prompt):
    """The prompts of a completions request as lists of token ids: a string, a list of ids, or a list of
    either (lm-evaluation-harness sends lists of ids)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of either",
                       "prompt", "invalid_type")
    return [server.check_ids(server.encode(p, "prompt") if isinstance(p, str) else p, "prompt") for p in prompt]


def _is_id(value):
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------- the answers


class Completion:
    """One choice being generated: its text, logprobs (as OpenAI writes them: completions' four lists, chat's
    content entries) and end, from Token events."""

    def __init__(self, server, generation, index, chat=False):
        self.server, self.generation, self.index, self.chat = server, generation, index, chat
        self.text, self.finish_reason = "", None
        self.logprobs = {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                      "text_offset": []}
        self.prompt_ids, self.offset = [], 0

    def add(self, token):
        """Take a Token; return the text it adds to the choice (with echo: the prompt's, at its last token)."""
        tokenizer, request = self.server.tokenizer, self.generation.request
        added = token.text
        if token.prompt:  # the echoed prompt, decoded whole when complete (BPE tokens can split characters)
            self.prompt_ids.append(token.id)
            added = tokenizer.decode(self.prompt_ids) if len(self.prompt_ids) == self.generation.prompt_tokens else ""
        if token.id is not None and request.logprobs is not None:
            self.score(token, request)
        self.text += added
        self.finish_reason = token.finish_reason
        return added

    def score(self, token, request):
        """Add token's log-probability and its top alternatives. Chat's entries are the reply's tokens: an end of
        turn (a stop token, not part of the text) is not one, as in OpenAI's."""
        tokenizer = self.server.tokenizer
        if self.chat:
            if not (token.finish_reason == "stop" and token.id in request.stop_tokens):
                entry = scored(tokenizer, token.id, token.logprob)
                entry["top_logprobs"] = [scored(tokenizer, i, lp) for i, lp in token.top]
                self.logprobs["content"].append(entry)
            return
        piece = tokenizer.decode([token.id])
        top = {tokenizer.decode([i]): lp for i, lp in token.top} if token.top is not None else None
        for key, value in (("tokens", piece), ("token_logprobs", token.logprob), ("top_logprobs", top),
                           ("text_offset", self.offset)):
            self.logprobs[key].append(value)
        self.offset += len(piece)

    def choice(self):
        """This choice in a whole response. A base model's reply loses the spaces that follow CHAT_TEMPLATE's
        "Assistant:"; a chat model's is its text as written."""
        logprobs = self.logprobs if self.generation.request.logprobs is not None else None
        if self.chat:
            content = self.text if self.server.chat_format else self.text.lstrip()
            return {"index": self.index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                    "finish_reason": self.finish_reason}
        return {"index": self.index, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def delta(self, text, logprobs=None):
        """This choice in a stream chunk: text and the logprobs of its tokens, or (text None) its end, as OpenAI's
        streams end: a chunk of no text that carries finish_reason."""
        logprobs = logprobs if text is not None and self.generation.request.logprobs is not None else None
        finish_reason = self.finish_reason if text is None else None
        if self.chat:
            return {"index": self.index, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def scored(tokenizer, token_id, logprob):
    """A token in chat's logprobs: its text, log-probability and UTF-8 bytes (a byte-level BPE token can be part of
    a character: its text alone is U+FFFD, its bytes are what the client joins)."""
    return {"token": tokenizer.decode([token_id]), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}


def usage(completions):
    prompt = sum(c.generation.prompt_tokens for c in completions)
    done = sum(c.generation.completion_tokens for c in completions)
    cached = sum(c.generation.cached_tokens for c in completions)  # taken from the prefix cache, not encoded
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Server:
    """The state the routes share: the engine, the tokenizer, the model's name and the limits; chat_format: the
    chat format the model was tuned on (its data's, chat.py's TEMPLATE), or None for a base model."""

    def __init__(self, engine, tokenizer, name, limits, api_key=None, chat_format=None):
        self.engine, self.tokenizer, self.name, self.limits, self.api_key = engine, tokenizer, name, limits, api_key
        self.chat_format = chat_format
        self.block_size = engine.block_size
        self.waker = None  # (the Waker of the loop that serves; made at the first request)

    def encode(self, text, param):
        try:
            return self.tokenizer.encode_with_specials(text)
        except (UserError, UnicodeError) as e:  # a character outside a character-level vocabulary, a lone surrogate
            raise APIError(400, f"{param}: {first_line(e)}", param, "invalid_value") from None

    def check_ids(self, ids, param):
        """ids, when every one is a token id of this model's vocabulary."""
        vocab = self.tokenizer.vocab_size
        if not all(_is_id(t) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be integers from 0 to {vocab - 1} (this model's "
                                f"vocabulary)", param, "invalid_value")
        return ids

    def prompt_ids(self, ids, param):
        """A prompt's ids as the engine takes them: an empty prompt starts from <|endoftext|> (where the model has
        one), a prompt longer than the context is refused."""
        if not ids:
            if self.tokenizer.eot_token is None:
                raise APIError(400, f"{param} is empty, and this model has no <|endoftext|> token to start from; "
                                    f"give some text", param, "invalid_value")
            return [self.tokenizer.eot_token]
        if len(ids) > self.block_size:
            raise APIError(400, f"This model's maximum context length is {self.block_size} tokens, but the "
                                f"{param} has {len(ids)} tokens; shorten it", param, "context_length_exceeded")
        return ids

    def chat_prompt(self, messages, requests):
        """The prompt ids of a chat request's messages, the reply's stops added to its requests: a chat model's
        own format, the reply ending at its end of turn; a base model's CHAT_TEMPLATE, the reply ending where a
        next "User:" line would begin."""
        messages = read_messages(messages)
        if self.chat_format:
            ids, _ = chat.encode(self.tokenizer, messages, add_generation_prompt=True)
            requests.stop_tokens = talk.stop_tokens(self.tokenizer)
        else:
            ids = self.encode(chat_template().render(messages=messages, add_generation_prompt=True), "messages")
            requests.stop = requests.stop + (CHAT_STOP,)
        return self.prompt_ids(ids, "messages")

    def model_card(self):
        """The served model as OpenAI's API describes one (an item of /v1/models), with its context length."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "gpt", "max_model_len": self.block_size,
                "chat_format": self.chat_format}

    def check_model(self, body):
        model = field(body, "model", str, self.name, expect="a string")
        if model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {self.name!r}", "model",
                           "model_not_found")

    def submit(self, requests, chat=False, stream=False):
        """Start every choice on the engine; a Choices that follows them."""
        loop, wake = asyncio.get_running_loop(), asyncio.Event()
        if self.waker is None or self.waker.loop is not loop:
            self.waker = Waker(loop)
        waker = self.waker
        completions = []
        try:
            for i, request in enumerate(requests):
                generation = self.engine.submit(request, notify=lambda: waker.wake(wake),
                                                max_backlog=STREAM_BACKLOG if stream else None)
                completions.append(Completion(self, generation, i, chat))
        except (QueueFull, Stopped) as e:
            for c in completions:
                c.generation.cancel()
            if isinstance(e, Stopped):
                raise APIError(503, f"the server cannot generate: {e}", None, "engine_stopped",
                               "server_error") from None
            raise APIError(429, f"the server is busy: {e}; try again later", None, "queue_full",
                           "rate_limit_error", headers={"Retry-After": "1"}) from None
        return Choices(completions, wake)


class Waker:
    """Sets asyncio Events of one loop from the engine's thread. The events of one engine step (one for each running
    request) take one call into the loop (a write to its wake-up pipe, and the GIL handed over), not one each."""

    def __init__(self, loop):
        self.loop, self.lock, self.pending, self.scheduled = loop, threading.Lock(), [], False

    def wake(self, event):
        with self.lock:
            self.pending.append(event)
            if self.scheduled:
                return  # (the loop has yet to run the call scheduled for those before: it sets this one too)
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop has closed (the server stops): no later event waits for this one
            with self.lock:
                self.scheduled = False
            raise

    def _set(self):
        with self.lock:
            events, self.pending, self.scheduled = self.pending, [], False
        for event in events:
            event.set()


class Choices:
    """The choices of one request as they are generated: their Completions, and their Tokens as they arrive."""

    def __init__(self, completions, wake):
        self.completions, self.wake = completions, wake

    async def events(self, hung_up=None):
        """(Completion, Token) as they arrive, until every choice has ended. hung_up: an async callable, asked
        twice a second; when it answers True the choices are cancelled and this ends."""
        asked = time.monotonic()
        while not all(c.finish_reason for c in self.completions):
            if hung_up is not None and time.monotonic() - asked > 0.5:
                if await hung_up():
                    self.cancel()
                    return
                asked = time.monotonic()
            self.wake.clear()  # (before taking: an event emitted after the take sets it again)
            arrived = [(c, token) for c in self.completions for token in c.generation.take()]
            for c, token in arrived:
                yield c, token  # (the caller adds it to c before the loop asks whether every choice has ended)
            if not arrived:
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5 if hung_up else None)
                except asyncio.TimeoutError:
                    pass

    def failure(self):
        """The APIError of the first choice that failed in the engine, or None."""
        failed = next((c for c in self.completions if c.finish_reason == "error"), None)
        return None if failed is None else APIError(500, failed.generation.error, None, "generation_failed",
                                                    "server_error")

    def cancel(self):
        for c in self.completions:
            c.generation.cancel()


def response_id(chat):
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


async def collect(choices, hung_up):
    """Wait until every choice has ended (or the client has hung up: then they are cancelled)."""
    async for c, token in choices.events(hung_up):
        c.add(token)


async def stream(server, choices, chat, include_usage):
    """Server-sent events: a chunk per token text (or logprobs) of any choice as it arrives, then each
    choice's end, then usage (when asked), then [DONE]; a choice that fails in the engine ends the stream with
    an error event instead. A client that hangs up cancels every choice."""
    rid, created, completions = response_id(chat), int(time.time()), choices.completions
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, **extra):  # (with include_usage, every chunk but the last says "usage": null, as OpenAI's)
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": server.name,
                                      "choices": choices, **({"usage": None} if include_usage else {}),
                                      **extra}) + "\n\n"

    try:
        if chat:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in completions])
        started = [False] * len(completions)
        async for c, token in choices.events():
            before = {k: len(v) for k, v in c.logprobs.items()}
            text = c.add(token)
            if token.finish_reason == "error":
                raise choices.failure()
            if chat and not server.chat_format and not started[c.index]:  # (as Completion.choice)
                text = text.lstrip()
                started[c.index] = bool(text)
            logprobs = {k: v[before[k]:] for k, v in c.logprobs.items()}
            if text or any(logprobs.values()):
                yield chunk([c.delta(text, logprobs)])
            if c.finish_reason:
                yield chunk([c.delta(None)])
        if include_usage:
            yield chunk([], usage=usage(completions))
    except Exception as e:  # the status line is sent already: the error goes in the stream, which still ends
        error = e if isinstance(e, APIError) else APIError(500, f"the server failed: {first_line(e)}", None,
                                                           "internal_error", "server_error")
        yield "data: " + json.dumps(error.body()) + "\n\n"
    finally:
        choices.cancel()
    yield "data: [DONE]\n\n"


def completion_body(server, completions, chat):
    return {"id": response_id(chat), "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": server.name, "choices": [c.choice() for c in completions],
            "usage": usage(completions)}


def read_messages(messages):
    """The messages of a chat request as {role, content} with a string content. A message's content is a string or
    a list of text parts ([{"type": "text", "text": ...}], as many chat UIs send it), joined by newlines. A
    developer message is the system message (OpenAI's name for it with newer models); a message's other fields are
    refused unless null or empty (as a client sends back a reply it was given)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages",
                       "invalid_type")
    plain = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(content, str)):
            raise APIError(400, "each message must be {\"role\": \"system\" | \"developer\" | \"user\" | "
                                "\"assistant\", \"content\": a string or a list of text parts}", "messages",
                           "invalid_value")
        extra = next((k for k, v in m.items() if k not in ("role", "content") and v not in (None, [])), None)
        if extra is not None:  # a speaker's name, tool calls, audio: what this server's prompts cannot say
            raise APIError(400, f"a message's {extra} is not supported by this server; send role and content only",
                           "messages", "unsupported")
        plain.append({"role": ROLES[m["role"]], "content": content})
    return plain


_template = None


def chat_template():
    global _template
    if _template is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _template = ImmutableSandboxedEnvironment().from_string(CHAT_TEMPLATE)
    return _template


# ---------------------------------------------------------------------- the application


def create_app(server):
    """The FastAPI application of a Server (serve.py runs it with uvicorn)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="gpt serve.py", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=server.limits.max_body)

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_fault(request, e):  # a fault of the server, not of the request: the same JSON shape
        return JSONResponse(APIError(500, f"the server failed: {first_line(e)}", None, "internal_error",
                                     "server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):  # unknown routes (404), wrong methods (405)
        code = "not_found" if e.status_code == 404 else "method_not_allowed" if e.status_code == 405 else None
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                     code=code).body(), status_code=e.status_code)

    add_generation_routes(app, server)
    add_tokenizer_routes(app, server)
    return app


def check_key(server, request):
    """401 unless the request carries the server's API key (when it has one): `Authorization: Bearer KEY`, the
    scheme in any case, the key compared in constant time."""
    if server.api_key is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), server.api_key.encode())):
        raise APIError(401, "missing or wrong API key; send Authorization: Bearer KEY", None, "invalid_api_key")


async def body_of(server, request):
    """The request's JSON object, after the API key (when the server has one). A POST must say it is JSON (a form
    that a page on another site posts cannot); NaN, infinities, invalid UTF-8 and nesting too deep to read are
    not JSON."""
    check_key(server, request)
    if request.method != "POST":
        return {}
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the body must be sent as Content-Type: application/json, not {media_type or 'none'}",
                       None, "unsupported_media_type")
    try:
        body = json.loads(await request.body(), parse_constant=_not_json, parse_float=_finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON ({first_line(e, 100)})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def _not_json(constant):
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large a number")
    return value


async def answer(server, request, prompts, requests, chat):
    """Run the choices; a stream of server-sent events, or the whole response (not when the client has hung up
    meanwhile: then the choices are cancelled, and nothing is sent)."""
    from fastapi.responses import StreamingResponse

    choices = server.submit(requests.choices(prompts), chat, requests.stream)
    if requests.stream:
        return StreamingResponse(stream(server, choices, chat, requests.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        await collect(choices, request.is_disconnected)
    finally:
        choices.cancel()
    if (failure := choices.failure()) is not None:
        raise failure
    return completion_body(server, choices.completions, chat)


def add_generation_routes(app, server):
    """The page, health, models, completions and chat completions."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        running, waiting = server.engine.load
        if not server.engine.alive:  # 503: a supervisor (systemd, Kubernetes) restarts the server
            return JSONResponse({"status": "error", "error": server.engine.failure or "the engine has stopped",
                                 "running": running, "waiting": waiting}, status_code=503)
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def metrics(request: HTTPRequest):  # (Prometheus's text format)
        await body_of(server, request)
        stats = server.engine.cache_stats() or {}
        return PlainTextResponse("".join(f"prefix_cache_{name} {value}\n" for name, value in stats.items()))

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        await body_of(server, request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")  # (path: a served name may hold a slash, as Hugging Face's do)
    async def model_card(model: str, request: HTTPRequest):
        await body_of(server, request)
        server.check_model({"model": model})
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await body_of(server, request)
        server.check_model(body)
        if "prompt" not in body:
            raise APIError(400, "prompt is required", "prompt", "missing")
        requests = Requests(server, body)
        prompts = [server.prompt_ids(ids, "prompt") for ids in prompts_of(server, body["prompt"])]
        return await answer(server, request, prompts, requests, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await body_of(server, request)
        server.check_model(body)
        logprobs = check_chat_fields(body)
        if body.get("echo") not in (None, False):
            raise APIError(400, "echo is not supported for chat completions", "echo", "unsupported")
        # (chat's logprobs is true or false, not the completions' count that Requests reads)
        requests = Requests(server, {k: v for k, v in body.items() if k != "logprobs"}, max_tokens=None)
        requests.logprobs = logprobs
        prompt = server.chat_prompt(body.get("messages"), requests)
        return await answer(server, request, [prompt], requests, chat=True)


def add_tokenizer_routes(app, server):
    """The tokenizer over HTTP, as vLLM serves it (lm-evaluation-harness's tokenizer_backend=remote)."""
    from fastapi import Request as HTTPRequest

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        """A chat model's template (chat.py's, in Jinja) begins with bos_token: <|endoftext|> there."""
        await body_of(server, request)
        tokenizer = server.tokenizer
        template, bos = (chat.jinja_template(), tokenizer.eos_text) if server.chat_format else (CHAT_TEMPLATE, None)
        return {"tokenizer_class": tokenizer.kind, "eos_token": tokenizer.eos_text, "bos_token": bos,
                "pad_token": None, "chat_template": template, "model_max_length": server.block_size,
                "vocab_size": tokenizer.vocab_size}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = await body_of(server, request)
        field(body, "add_special_tokens", bool, True, expect="true or false")  # (no BOS here to add)
        prompt = field(body, "prompt", str, None, expect="a string")
        if prompt is None:
            raise APIError(400, "prompt is required", "prompt", "missing")
        tokens = server.encode(prompt, "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.block_size}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = await body_of(server, request)
        tokens = field(body, "tokens", list, None, expect="a list of token ids")
        if tokens is None:
            raise APIError(400, "tokens is required", "tokens", "missing")
        return {"prompt": server.tokenizer.decode(server.check_ids(tokens, "tokens"))}


class BodyLimit:
    """ASGI middleware: a request body over limit bytes is answered 413 without being read whole."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self.refuse(send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self.refuse(send)

    async def refuse(self, send):
        body = json.dumps(APIError(413, f"the request body is larger than this server's limit of {self.limit} "
                                        f"bytes", None, "body_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
