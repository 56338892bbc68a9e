"""
Reading a request of serve.py's HTTP API: its JSON fields checked one by one (field), so that every mistake gets
OpenAI's error object and a 4xx status (APIError); the generation settings read into the engine's Requests, one per
choice (Requests); a completions request's prompts (prompts_of) and its response_format (JSON is chat's only). What
the server does not do is refused (400, code unsupported), never ignored.
Not owned: the chat's own fields: messages, response_format, tools (openai_chat.py); the routes and the server's state
(openai_api.py), the answers (openai_responses.py), the chat formats (chat.py).
"""

import json

from machinery.generation.request import Request
from machinery.data.tokenizer import end_of_text_stop

MAX_STOP_TEXTS = 4
MAX_LOGPROBS = 5  # completions' logprobs (OpenAI's legacy limit)
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a 64-bit signed integer, as OpenAI's and vLLM's seed


class APIError(Exception):
    """A request the API refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status, message, param=None, code=None, type="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers

    def body(self):
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


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


def required(body, name, kinds, expect):
    """body[name] as field reads it, which must be there (400, code missing, where absent or null)."""
    value = field(body, name, kinds, expect=expect)
    if value is None:
        raise APIError(400, f"{name} is required", name, "missing")
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
        self.grammar = None  # what the reply must follow (chat's response_format and tools: openai_chat.py)
        self.calls = False  # whether a reply may call a tool (chat's tool_choice)

    def choices(self, prompts):
        """The engine Requests: for each prompt, n choices (choice i with seed + i)."""
        if len(prompts) * self.n > self.server.limits.max_n:
            raise APIError(400, f"{len(prompts)} prompt(s) x n = {self.n} is more choices than this server's "
                                f"limit of {self.server.limits.max_n}", "n", "limit_exceeded")
        block_size = self.server.block_size
        return [Request(ids, self.max_tokens if self.max_tokens is not None else max(1, block_size - len(ids)),
                        self.temperature, self.top_k, self.top_p, None if self.seed is None else self.seed + i,
                        self.stop, self.stop_tokens, self.logprobs, self.echo, self.cache_salt, self.grammar)
                for ids in prompts for i in range(self.n)]


def refuse_response_format(body):
    """A completions request's response_format: OpenAI's completions API has none; {"type": "text"} (what it
    writes) is accepted, JSON output is refused: it is a chat completions field here, as at OpenAI."""
    kind = field(body, "response_format", dict, {"type": "text"}, expect='an object {"type": "text"}').get("type")
    if kind != "text":
        raise APIError(400, f"response_format {json.dumps(kind)[:80]} is not a field of /v1/completions (OpenAI's "
                            f"completions API has no response_format); ask /v1/chat/completions for JSON",
                       "response_format", "unsupported")


def prompts_of(server, prompt):
    """The prompts of a completions request as lists of token ids: a string, a list of ids, or a list of
    either (lm-evaluation-harness sends lists of ids)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of either",
                       "prompt", "invalid_type")
    return [server.check_ids(server.encode(p, "prompt") if isinstance(p, str) else p, "prompt") for p in prompt]


def is_id(value):
    return isinstance(value, int) and not isinstance(value, bool)
