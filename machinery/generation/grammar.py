"""
Structured outputs' grammars (issue 59), through llguidance: a tokenizer's vocabulary as llguidance sees it (each
token's raw bytes, its special tokens special, never spelled), a JSON schema (or any JSON object) compiled once per
tokenizer and kept (LRU), and a row's State: the mask of the tokens its grammar allows next, advanced on the token
chosen. JSON is compact (no whitespace between tokens: small models loop on free whitespace). The end-of-text and
end-of-turn tokens are allowed exactly where the grammar may end. llguidance is optional: asking for a schema
without it is a one-line error with its install hint.
Not owned: applying the masks to a batch's logits (machinery/generation/model_runner.py); reading a schema from a
file or a request (sample.py, the API).
"""

import functools
import json
import threading

import numpy as np

from machinery.data import chat
from machinery.errors import UserError, first_line

LLGUIDANCE = "llguidance==1.9.1"
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object
COMPACT = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
CACHED = 64  # compiled schemas kept, per process (the least recently used goes first)


_llguidance = None


def library():
    """The llguidance module; a one-line UserError with its install hint where it is missing."""
    global _llguidance
    if _llguidance is None:
        try:
            import llguidance  # (not llguidance.torch: importing it imports TorchDynamo, seconds)
        except ImportError:
            raise UserError(f"structured outputs (a JSON schema) need llguidance: pip install {LLGUIDANCE}") \
                from None
        _llguidance = llguidance
    return _llguidance


class Vocabulary:
    """A tokenizer as llguidance sees it: every token's raw bytes (a byte-level BPE token may be part of a UTF-8
    character; a BPE's given as its tiktoken ranks, which llguidance also tokenizes with, natively), the special
    tokens marked special (they never spell text), and the ends: the end-of-text token and a chat format's end of
    the assistant's turn. A vocabulary with no end token (characters) gets one after its own ids, which is never
    drawn: its grammar ends where it stops (State.done)."""

    def __init__(self, tokenizer):
        llguidance = library()
        self.tokenizer, self.size = tokenizer, tokenizer.vocab_size
        specials = dict(getattr(tokenizer, "specials", {}))
        if tokenizer.eot_token is not None:
            specials.setdefault("<|endoftext|>", tokenizer.eot_token)
        ends = [i for text, i in specials.items() if i == tokenizer.eot_token or text == chat.end("assistant")]
        self.ends, self.words = frozenset(ends), (self.size + (not ends) + 31) // 32
        if hasattr(tokenizer, "enc"):  # a byte-level BPE: tiktoken's ranks {bytes: id} and special tokens
            self.lltokenizer = llguidance.LLTokenizer.from_tiktoken(
                encoder=tokenizer.ranks, special_tokens=specials, pattern=tokenizer.pattern,
                eos_token=ends, n_vocab=self.size)
            return
        self.tokens = [tokenizer.token_bytes(i) for i in range(self.size)] + [b"<|end|>"]  # (the end added)
        self.eos_token_id, self.bos_token_id, self.special_token_ids = self.size, None, [self.size]
        self.is_tokenizer_wrapper = True  # (llguidance's TokenizerWrapper's attributes and __call__)
        self.lltokenizer = llguidance.LLTokenizer(self, n_vocab=self.size + 1, eos_token=self.size)

    def __call__(self, text):
        """A character vocabulary's tokens of a text that llguidance forces (a character outside it is left out: no
        token spells it, so no mask allows it)."""
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return [self.tokenizer.stoi[c] for c in text if c in self.tokenizer.stoi]


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer):
    """tokenizer's Vocabulary, built once (GPT-2's takes a while: BENCHMARKS.md, *Structured outputs*)."""
    return Vocabulary(tokenizer)


def compile_schema(tokenizer, schema, or_text=False):
    """The Grammar of a JSON schema (a dict; ANY_OBJECT for any JSON object) for tokenizer's tokens, compiled once
    and kept (CACHED); or_text: JSON that follows it, or free text that does not begin with "{" (a reply that may
    call a tool or talk: serve.py's tool_choice auto). ValueError naming what is wrong: an invalid schema, or a
    feature llguidance does not support; UserError without llguidance."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
    return _compiled(vocabulary(tokenizer), json.dumps(schema), or_text)  # (its keys in order: properties come in it)


@functools.lru_cache(maxsize=CACHED)
def _compiled(vocab, schema, or_text):
    llguidance = library()
    try:
        if or_text:  # (Lark: the JSON sub-grammar takes its options in the schema; TEXT may be empty)
            options = json.dumps({**json.loads(schema), "x-guidance": COMPACT})
            grammar = llguidance.LLMatcher.grammar_from_lark(
                f'start: json | TEXT\njson: %json {options}\nTEXT: /[^{{](?s:.*)/ | ""\n')
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid: {first_line(e)}") from None
    matcher = llguidance.LLMatcher(vocab.lltokenizer, grammar, log_level=0)
    if matcher.is_error():  # (an invalid schema, or a feature llguidance lacks: its message says which)
        raise ValueError(f"the JSON schema cannot be used: {' '.join(matcher.get_error().split())[:300]}")
    compiled = Grammar(vocab, matcher)
    if not masks([compiled.start(vocab.ends)], vocab.size).any():
        raise ValueError("the JSON schema cannot be used: no token of this model's vocabulary can begin it")
    return compiled


class Grammar:
    """A compiled schema: start() gives a row its own State at the beginning of the reply."""

    def __init__(self, vocab, matcher):
        self.vocab, self.matcher = vocab, matcher

    def start(self, stop_tokens=()):
        """A row's State; of the vocabulary's ends, only those among stop_tokens (the row's) may be drawn."""
        return State(self.vocab, self.matcher.deep_copy(), self.vocab.ends.intersection(stop_tokens))


class State:
    """Where one row is in its grammar: masks() gives the tokens allowed next, advance() takes the one chosen."""

    def __init__(self, vocab, matcher, ends):
        self.vocab, self.matcher = vocab, matcher
        self.barred = sorted(vocab.ends - ends)  # end tokens that this row may not draw (not its stop tokens)

    def advance(self, token):
        """Take the token drawn (one its mask allowed); whether the grammar is now complete (nothing may follow
        but an end token)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is outside the grammar ({first_line(self.matcher.get_error())})")
        return self.done

    @property
    def done(self):
        return self.matcher.is_stopped()


_executor, _lock = None, threading.Lock()


def masks(states, vocab_size):
    """The tokens each of states allows next: a numpy bool array (len(states), vocab_size), computed in llguidance's
    threads (its Rust code, outside the interpreter's lock)."""
    global _executor
    llguidance = library()
    words = states[0].vocab.words
    bits = np.empty((len(states), words), dtype=np.int32)
    if len(states) == 1:
        states[0].matcher.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
    else:
        with _lock:
            _executor = _executor or llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bits.ctypes.data, words * 4,
                                          len(states))
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(np.bool_)  # (0 or 1)
    for i, state in enumerate(states):
        allowed[i, state.barred] = False
    return allowed[:, :vocab_size]
