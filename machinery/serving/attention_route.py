"""
serve.py's POST /v1/attention, the web page's Attention view: {"text", "layers"?, "heads"?} (lists of indices; null:
all) answered with the tokens' labels and ids, each picked layer's and head's weights (row i: what token i attends to,
its i + 1 weights, to DIGITS significant digits) and each picked head's statistics (attention_maps.maps). A text of
0, 1 or over attention_maps.MAX_TOKENS tokens, or a layer or head not in the model, is refused (400). The maps come
from the route's own float32 copy of the model on the CPU (loaded as plot.py loads it, at the first request), never
from the engine's. Not owned: the maps and the statistics (attention_maps.py), reading the body (openai_api.py).
"""

import asyncio
import threading

import torch

from machinery.errors import UserError, first_line
from machinery.generation import attention_maps, loading
from machinery.serving.openai_requests import APIError, field, is_id, required

DIGITS = 4  # significant digits of a weight in the answer: small weights stay readable (a log scale shows them)
SMALLEST = 1e-6  # weights under it are written 0: no colour scale of the page tells them from 0
STATS = ("previous", "first", "self", "entropy", "induction")  # each head's, as attention_maps.maps measures them


class AttentionMaps:
    """The route's model (its own copy: see load) and the lock that has one request at a time run it."""

    def __init__(self, source):
        self.source, self.loaded, self.lock = source, None, threading.Lock()

    def load(self):
        """The copy, loaded once. Its own: the engine's thread runs the engine's model at every step, and a Head
        whose keep_weights were set there would take the explicit path for the engine's rows too (and keep their
        weights, not this text's); the copy runs under self.lock, so nothing races on its Heads."""
        if self.source is None:
            raise APIError(501, "this server was started without its model's source: no attention maps", None,
                           "unsupported")
        if self.loaded is None:
            self.loaded = loading.load(self.source)  # (on the CPU, in float32)
        return self.loaded

    def answer(self, text, layers, heads):
        """The answer's body (a thread's work: one forward pass of the text and one of the induction test)."""
        with self.lock:
            loaded = self.load()
            try:
                found = attention_maps.maps(loaded.model, loaded.tokenizer, text, layers, heads)
            except (UserError, UnicodeError) as e:  # too short or long, a character outside the vocabulary
                raise APIError(400, f"text: {first_line(e)}", "text", "invalid_value") from None
        return {"object": "attention", "tokens": found.tokens, "ids": found.ids, "layers": found.layers,
                "heads": found.heads, "max_tokens": attention_maps.most_tokens(loaded.model.config),
                "attention": [[rows(w[0, h]) for h in range(len(found.heads))] for w in found.weights],
                "stats": {name: [[round(value, 4) for value in found.stats[name][layer, found.heads].tolist()]
                                 for layer in found.layers] for name in STATS}}


def rows(weights):
    """(T, T) causal weights as T rows, row i its i + 1 weights (those above the diagonal are 0), each rounded to
    DIGITS significant digits (an integer over a power of ten: JSON writes it short)."""
    w = weights.double()
    power = 10.0 ** (DIGITS - 1 - torch.floor(torch.log10(w.clamp_min(SMALLEST))))
    w = torch.where(w < SMALLEST, 0.0, torch.round(w * power) / power)
    return [w[i, :i + 1].tolist() for i in range(len(w))]


def indices(body, name, count):
    """The layers or heads a request picks: a list of distinct indices from 0 to count - 1 (None: all)."""
    expect = f"a list of distinct {name} from 0 to {count - 1} (this model has {count}), or null for all"
    picked = field(body, name, list, None, expect=expect)
    if picked is not None and not (picked and all(is_id(i) and 0 <= i < count for i in picked)
                                   and len(set(picked)) == len(picked)):
        raise APIError(400, f"{name} must be {expect}, got {picked}"[:200], name, "invalid_value")
    return None if picked is None else ",".join(map(str, picked))


def add_route(app, server, read_body):
    """POST /v1/attention on app, its body read (the API key, JSON) by read_body(server, request)."""
    from fastapi import Request as HTTPRequest

    maps = AttentionMaps(server.source)

    @app.post("/v1/attention")
    async def attention(request: HTTPRequest):
        body = await read_body(server, request)
        text = required(body, "text", str, "a string")
        config = server.engine.model.config
        layers, heads = indices(body, "layers", config.n_layer), indices(body, "heads", config.n_head)
        # (in a thread: the event loop goes on serving the streams meanwhile)
        return await asyncio.to_thread(maps.answer, text, layers, heads)
