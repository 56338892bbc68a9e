"""
The answers of serve.py's HTTP API, as OpenAI writes them: a choice being generated from the engine's Token events
(Completion: its text, its logprobs as completions and chat write them, its end), a chat reply as a message: its
content or a tool call (Reply), a request's choices as their events arrive (Choices, woken from the engine's thread
by a Waker), the whole response (completion_body, usage) or its stream of server-sent events (stream): a chunk of
the tokens that arrived together (chat: a delta), then each choice's end (a chunk without text that carries finish_reason), usage when
asked, [DONE]; a choice that fails in the engine ends a stream with an error event. A client that hangs up cancels
its choices.
Not owned: reading the request (openai_requests.py, openai_chat.py), the routes (openai_api.py).
"""

import asyncio
import json
import threading
import time
import uuid

from machinery.data import chat
from machinery.errors import first_line
from machinery.serving.openai_requests import APIError


class Completion:
    """One choice being generated: its text, logprobs (as OpenAI writes them: completions' four lists, chat's
    content entries) and end, from Token events."""

    def __init__(self, server, generation, index, chat=False, calls=False):
        self.server, self.generation, self.index, self.chat, self.calls = server, generation, index, chat, calls
        self.reply = Reply(not server.chat_format, calls) if chat else None  # (a stream's)
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

    def extend(self, tokens):
        """Take Tokens that arrived together; return the text they add."""
        return "".join([self.add(token) for token in tokens])

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
        """This choice in a whole response (chat: its message, as Reply writes it)."""
        logprobs = self.logprobs if self.generation.request.logprobs is not None else None
        if self.chat:
            message, finish_reason = Reply(not self.server.chat_format, self.calls).message(self.text,
                                                                                           self.finish_reason)
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def parts(self, text, logprobs):
        """This choice's parts of stream chunks for text just added (and logprobs, of its tokens), then its end once
        it has ended, as OpenAI's streams end: a part of no text that carries finish_reason. Chat's parts are
        Reply's deltas, the logprobs with the first."""
        logprobs = logprobs if self.generation.request.logprobs is not None else None
        scored = bool(logprobs) and any(logprobs.values())
        if not self.chat:
            parts = [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}] \
                if text or scored else []
            return parts + ([{"index": self.index, "text": "", "logprobs": None, "finish_reason": self.finish_reason}]
                            if self.finish_reason else [])
        deltas, finish_reason = self.reply.feed(text), None
        if self.finish_reason:
            last, finish_reason = self.reply.end(self.finish_reason)
            deltas += last
        parts = [{"index": self.index, "delta": delta, "logprobs": logprobs if j == 0 else None,
                  "finish_reason": None} for j, delta in enumerate(deltas or ([{}] if scored else []))]
        return parts + ([{"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]
                        if finish_reason else [])


class Reply:
    """A chat choice's text as OpenAI's assistant message, as it comes (feed, then end: a stream's deltas) or whole
    (message). A base model's leading spaces are not content (they follow chat.BASE_TEMPLATE's "Assistant:"). Where a
    tool may be called (calls), a text that begins with "{" is a call (the grammar allows no other text so: CALL_START,
    the name, CALL_ARGUMENTS, the arguments, "}": chat.py), streamed as OpenAI streams one: its id, type and name once
    the name is whole, then the arguments' text as it comes, its last character held back (it may be the call's "}").
    A call cut before its name is whole (max_tokens) is content."""

    def __init__(self, lstrip, calls):
        self.lstrip, self.calls = lstrip, calls
        self.text, self.sent = "", 0  # the text so far; how much of it is handed out
        self.started = not lstrip  # content has begun (a base model's: past its leading spaces)
        self.name = self.id = None  # a call's, once its name is whole

    def feed(self, text):
        """The deltas ({"content"} or {"tool_calls"}) of text, the next piece of the reply."""
        self.text += text
        return self._call(len(self.text) - 1) if self.is_call else self._content()

    def end(self, finish_reason):
        """The last deltas, and the finish reason as OpenAI's ("tool_calls" for a call the grammar has ended)."""
        if not self.is_call:
            return self._content(), finish_reason
        whole = finish_reason == "stop" and chat.parse_call(self.text) is not None
        deltas = self._call(len(self.text) - whole)  # (whole: its last "}" is the call's, not its arguments')
        return (deltas, "tool_calls" if whole else finish_reason) if self.name else ([{"content": self.text}],
                                                                                    finish_reason)

    def message(self, text, finish_reason):
        """(the whole message of a text, its finish reason)."""
        deltas = self.feed(text)
        last, finish_reason = self.end(finish_reason)
        deltas += last
        if self.name is None:
            return {"role": "assistant", "content": "".join(d["content"] for d in deltas)}, finish_reason
        arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}]}, \
            finish_reason

    @property
    def is_call(self):
        return self.calls and self.text.startswith("{")

    def _content(self):
        new, self.sent = self.text[self.sent:], len(self.text)
        if not self.started:
            new = new.lstrip()
            self.started = bool(new)
        return [{"content": new}] if new else []

    def _call(self, upto):
        """The deltas of the call's text up to upto: its first fragment once the name is whole, then arguments."""
        deltas = []
        if self.name is None:
            at = self.text.find(chat.CALL_ARGUMENTS, len(chat.CALL_START))
            if at < 0:
                return deltas
            self.name, self.id = self.text[len(chat.CALL_START):at], f"call_{uuid.uuid4().hex[:24]}"
            self.sent = at + len(chat.CALL_ARGUMENTS)
            deltas.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                           "function": {"name": self.name, "arguments": ""}}]})
        if upto > self.sent:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:upto]}}]})
            self.sent = upto
        return deltas


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

    async def arrivals(self, hung_up=None):
        """The tokens as they arrive, a list of (Completion, its Tokens that arrived together) each time some have,
        until every choice has ended: a stream sends each list as one write, and under load, when a stream is
        read less often than its tokens come, in fewer and longer chunks (less work a token). hung_up: an async
        callable, asked twice a second; when it answers True the choices are cancelled and this ends."""
        asked = time.monotonic()
        while not all(c.finish_reason for c in self.completions):
            if hung_up is not None and time.monotonic() - asked > 0.5:
                if await hung_up():
                    self.cancel()
                    return
                asked = time.monotonic()
            self.wake.clear()  # (before taking: an event emitted after the take sets it again)
            arrived = [(c, tokens) for c in self.completions if (tokens := c.generation.take())]
            if arrived:
                yield arrived  # (the caller adds them to their choices before the loop asks whether all have ended)
            else:
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
    async for arrived in choices.arrivals(hung_up):
        for c, tokens in arrived:
            c.extend(tokens)


async def stream(server, choices, chat, include_usage):
    """Server-sent events: a chunk of each choice's text (or logprobs) as its tokens arrive (those that arrived
    together in one: Choices.arrivals), then each choice's end, then usage (when asked), then [DONE]; a choice that
    fails in the engine ends the stream with an error event instead. A client that hangs up cancels every choice."""
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
        async for arrived in choices.arrivals():
            sent, failed = [], False
            for c, tokens in arrived:
                before = {k: len(v) for k, v in c.logprobs.items()}
                text = c.extend(tokens)
                failed = c.finish_reason == "error"  # (an error ends its choice: its last token)
                if failed:
                    break
                sent += [chunk([part]) for part in c.parts(text, {k: v[before[k]:] for k, v in c.logprobs.items()})]
            if sent:
                yield "".join(sent)
            if failed:
                raise choices.failure()
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
