"""
serve.py's HTTP API: the FastAPI application (create_app) and its routes, OpenAI's and vLLM's: GET / (the web page,
chat.html beside this file: no CDN, works offline), /health (503 once the engine cannot serve), /metrics (the prefix
cache's counters, Prometheus's format), /v1/models and /v1/models/{name}; POST /v1/completions,
/v1/chat/completions and /v1/attention (attention_route.py); the tokenizer over HTTP as vLLM serves it
(GET /tokenizer_info, POST /tokenize, /detokenize).
Server: the state the routes share (the engine, the tokenizer, the limits), a request's prompt and the start of its
choices on the engine. With an API key every route but / and /health needs it (401); a POST takes JSON only (415),
its body within max_body (413: BodyLimit). README's serve.py section says what each route does.
Not owned: reading a request (openai_requests.py, openai_chat.py), the answers and streams (openai_responses.py), the
chat formats (chat.py), generation (engine.py).
"""

import asyncio
import hmac
import json
import math
import os
from dataclasses import dataclass

from machinery.data import chat
from machinery.generation import talk
from machinery.errors import UserError, first_line
from machinery.serving import attention_route
from machinery.serving.openai_chat import (check_chat_fields, compile_grammar, read_format, read_messages, read_tools,
                                           reply_grammar)
from machinery.serving.openai_requests import (APIError, Requests, field, is_id, prompts_of, refuse_response_format,
                                               required)
from machinery.serving.openai_responses import Choices, Completion, Waker, collect, completion_body, stream
from machinery.generation.request import QueueFull, Stopped

# events a stream may leave unread before its generation pauses (Generation.max_backlog): few, as a reader that keeps
# up takes each step's events at once, and the connection's own buffers (serve.py's SEND_BUFFER) hold its next chunks
STREAM_BACKLOG = 16
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")


@dataclass
class Limits:
    """What one server takes on: beyond them a request is answered 400 (413 for the body)."""

    max_tokens: int = 1024  # tokens a request may ask to generate, per choice
    max_n: int = 8  # choices per request (prompts x n)
    max_body: int = 1 << 20  # bytes of a request's body


class Server:
    """The state the routes share: the engine, the tokenizer, the model's name and the limits; chat_format: the
    chat format the model was tuned on (its data's, chat.py's TEMPLATE), or None for a base model; source: the
    loading.ModelSource the model was loaded from (the attention route loads its own copy from it), or None."""

    def __init__(self, engine, tokenizer, name, limits, api_key=None, chat_format=None, source=None):
        self.engine, self.tokenizer, self.name, self.limits, self.api_key = engine, tokenizer, name, limits, api_key
        self.chat_format, self.source = chat_format, source
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
        if not all(is_id(t) and 0 <= t < vocab for t in ids):
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

    def chat_prompt(self, messages, requests, tools=()):
        """The prompt ids of a chat request's messages (and tools: chat.with_tools), the reply's stops added to its
        requests: a chat model's own format, the reply ending at its end of turn; a base model's chat.BASE_TEMPLATE,
        the reply ending where a next "User:" line would begin."""
        messages = chat.with_tools(read_messages(messages), tools)
        if self.chat_format:
            ids, _ = chat.encode(self.tokenizer, messages, add_generation_prompt=True)
            requests.stop_tokens = talk.stop_tokens(self.tokenizer)
        else:
            ids = self.encode(chat.base_template().render(messages=messages, add_generation_prompt=True), "messages")
            requests.stop = requests.stop + (chat.BASE_STOP,)
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

    def submit(self, requests, chat=False, stream=False, calls=False):
        """Start every choice on the engine; a Choices that follows them (calls: a chat reply may call a tool)."""
        loop, wake = asyncio.get_running_loop(), asyncio.Event()
        if self.waker is None or self.waker.loop is not loop:
            self.waker = Waker(loop)
        waker = self.waker
        completions = []
        try:
            for i, request in enumerate(requests):
                generation = self.engine.submit(request, notify=lambda: waker.wake(wake),
                                                max_backlog=STREAM_BACKLOG if stream else None)
                completions.append(Completion(self, generation, i, chat, calls))
        except (QueueFull, Stopped) as e:
            for c in completions:
                c.generation.cancel()
            if isinstance(e, Stopped):
                raise APIError(503, f"the server cannot generate: {e}", None, "engine_stopped",
                               "server_error") from None
            raise APIError(429, f"the server is busy: {e}; try again later", None, "queue_full",
                           "rate_limit_error", headers={"Retry-After": "1"}) from None
        return Choices(completions, wake)


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
    attention_route.add_route(app, server, body_of)
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

    choices = server.submit(requests.choices(prompts), chat, requests.stream, requests.calls)
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
        refuse_response_format(body)
        requests = Requests(server, body)
        prompts = [server.prompt_ids(ids, "prompt") for ids in prompts_of(server, body["prompt"])]
        return await answer(server, request, prompts, requests, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await body_of(server, request)
        server.check_model(body)
        requests, prompt = await chat_request(server, body)
        return await answer(server, request, [prompt], requests, chat=True)


async def chat_request(server, body):
    """(Requests, prompt ids) of a chat request: its settings, messages and the grammar its reply follows."""
    logprobs = check_chat_fields(body)
    if body.get("echo") not in (None, False):
        raise APIError(400, "echo is not supported for chat completions", "echo", "unsupported")
    # (chat's logprobs is true or false, not the completions' count that Requests reads)
    requests = Requests(server, {k: v for k, v in body.items() if k != "logprobs"}, max_tokens=None)
    requests.logprobs = logprobs
    tools, choice, callables = read_tools(body)
    spec = reply_grammar(read_format(body), choice, callables, requests)
    prompt = server.chat_prompt(body.get("messages"), requests, tools)
    if spec is not None:
        requests.grammar = await compile_grammar(server.tokenizer, *spec)
    requests.calls = choice != "none"
    return requests, prompt


def add_tokenizer_routes(app, server):
    """The tokenizer over HTTP, as vLLM serves it (lm-evaluation-harness's tokenizer_backend=remote)."""
    from fastapi import Request as HTTPRequest

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        """A chat model's template (chat.py's, in Jinja) begins with bos_token: <|endoftext|> there."""
        await body_of(server, request)
        tokenizer = server.tokenizer
        template, bos = (chat.jinja_template(), tokenizer.eos_text) if server.chat_format else \
            (chat.BASE_TEMPLATE, None)
        return {"tokenizer_class": tokenizer.kind, "eos_token": tokenizer.eos_text, "bos_token": bos,
                "pad_token": None, "chat_template": template, "model_max_length": server.block_size,
                "vocab_size": tokenizer.vocab_size}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = await body_of(server, request)
        field(body, "add_special_tokens", bool, True, expect="true or false")  # (no BOS here to add)
        tokens = server.encode(required(body, "prompt", str, "a string"), "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.block_size}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = await body_of(server, request)
        tokens = required(body, "tokens", list, "a list of token ids")
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
