"""
Structured outputs' figures (issue 59), printed as Markdown tables: `python -m benchmarks.grammars [--part=both]`
(--part=libraries needs `pip install xgrammar==0.2.8` too, which the project does not install: ~1 GB with triton).

libraries: llguidance against xgrammar on our three tokenizers (GPT-2 BPE with the chat format's special tokens, a
byte-level BPE learned with prepare.py's special tokens, characters): whether each is built from the tokens' raw
bytes with the end tokens kept special (inside a JSON string no special token is allowed, at its end only the end
tokens are), the time to build it, to compile SCHEMA, and to compute a mask for 1 and 32 rows (mid-reply).
engine: the engine's decoding (a random 6-layer, 384-wide model with GPT-2's vocabulary) with 1 and 32 rows, none /
half / all of them with a schema (LONG): tokens/s of a row, and the time grammar.masks takes a step.
"""

import argparse
import json
import os
import time

import numpy as np
import torch

from machinery.data import bpe, chat
from machinery.data.tokenizer import CharTokenizer
from machinery.generation import engine, grammar, packing
from machinery.generation.request import Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age", "address"], "additionalProperties": False}
LONG = {"type": "array", "items": {"type": "string"}, "minItems": 1000}  # a random model's reply never ends
REPLY = '{"name":"Ann Lee","age":42,"tags":["a","b"],"address":{"city":"Paris","zip":"75001"}}'
JSON_CHARS = sorted(set(REPLY + '{}[]":,.-+0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ\n'))


def tokenizers():
    text = open(os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare", "input.txt"), encoding="utf-8").read()
    return {"GPT-2 BPE + chat specials": chat.tokenizer(),
            "learned BPE (4,096, specials)": bpe.learn([text[:300_000] + REPLY * 50], 4096),
            "characters": CharTokenizer(JSON_CHARS)}


def timed(f, repeat=1):
    start = time.perf_counter()
    for _ in range(repeat):
        result = f()
    return result, (time.perf_counter() - start) / repeat


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        grammar.vocabulary.cache_clear()
        self.vocab = grammar.vocabulary(tokenizer)
        self.size = tokenizer.vocab_size

    def compile(self, schema):
        grammar._compiled.cache_clear()
        return grammar.compile_schema(self.vocab.tokenizer, schema)

    def start(self, compiled):
        return compiled.start(stop_tokens(self.vocab.tokenizer))

    def masks(self, states):
        return grammar.masks(states, self.size)

    def advance(self, state, token):
        state.advance(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.xgr, self.size = xgrammar, tokenizer.vocab_size
        specials = set(getattr(tokenizer, "specials", {}).values()) | {tokenizer.eot_token} - {None}
        ends = list(stop_tokens(tokenizer))
        vocab = [b"" if i in specials else tokenizer.token_bytes(i) for i in range(self.size)]  # "": special
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=self.size,
                                           stop_token_ids=ends or None)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(",", ":"))  # (compact, as ours)

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def masks(self, states):
        bits = self.xgr.allocate_token_bitmask(len(states), self.size)
        if len(states) == 1:
            states[0].fill_next_token_bitmask(bits, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(states, bits)
        return np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :self.size]

    def advance(self, state, token):
        assert state.accept_token(token)


def stop_tokens(tokenizer):
    """A chat reply's: the end of the assistant's turn where the tokenizer has it, and the end of text."""
    specials = getattr(tokenizer, "specials", {})
    return tuple(i for i in (specials.get(chat.end("assistant")), tokenizer.eot_token) if i is not None)


def walk(lib, compiled, reply):
    """The mean time of a mask along reply, a row alone."""
    state, spent = lib.start(compiled), 0.0
    for token in reply:
        spent += timed(lambda: lib.masks([state]))[1]
        lib.advance(state, token)
    return spent / len(reply)


def library_row(lib_class, label, tokenizer):
    lib, built = timed(lambda: lib_class(tokenizer))
    compiled, compile_s = timed(lambda: lib.compile(SCHEMA))
    reply = tokenizer.encode(REPLY)
    first, again = (walk(lib, compiled, reply) for _ in range(2))  # a new grammar's first reply, then the next
    states = [lib.start(compiled) for _ in range(32)]
    for i, state in enumerate(states):  # each row somewhere else in the reply
        for token in reply[:i * (len(reply) - 1) // 31]:
            lib.advance(state, token)
    _, many = timed(lambda: lib.masks(states), repeat=10)
    specials = sorted(set(getattr(tokenizer, "specials", {}).values()) | {tokenizer.eot_token} - {None})
    in_string = lib.start(compiled)
    for token in tokenizer.encode('{"name":"A'):
        lib.advance(in_string, token)
    kept = not lib.masks([in_string])[0, specials].any() if specials else "no specials"
    done = lib.start(compiled)
    for token in reply:
        lib.advance(done, token)
    ends = sorted(np.nonzero(lib.masks([done])[0])[0].tolist())
    print(f"| {lib.name} | {label} ({tokenizer.vocab_size:,}) | {built * 1e3:.0f} ms | {kept} | "
          f"{ends or 'none: ends by itself'} | {compile_s * 1e3:.1f} ms | {first * 1e6:.0f} / {again * 1e6:.0f} µs | "
          f"{many * 1e6:.0f} µs |")


def libraries():
    print("| library | tokenizer (tokens) | built from raw bytes | specials never inside a string | allowed at "
          "the end | compile SCHEMA | a mask, 1 row (first reply / next) | masks, 32 rows |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, tokenizer in tokenizers().items():
        for lib_class in (Llguidance, Xgrammar):
            library_row(lib_class, label, tokenizer)


def engine_rows(runner, tokenizer, rows, constrained, tokens):
    """Decode `tokens` tokens for `rows` rows, the first `constrained` of them with LONG; (seconds a step, seconds of
    it in grammar.masks, seconds of it in ModelRunner._constrain: the masks and their applying)."""
    spent = {"masks": 0.0, "constrain": 0.0}
    model_runner = runner.model_runner
    masks, constrain = grammar.masks, model_runner._constrain

    def timing(f, name):
        def timed_f(*args):
            start = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent[name] += time.perf_counter() - start
        return timed_f

    compiled = grammar.compile_schema(tokenizer, LONG)
    grammar.masks, model_runner._constrain = timing(masks, "masks"), timing(constrain, "constrain")
    try:
        prompt = tokenizer.encode("The list:")
        gens = [runner.submit(Request(prompt, tokens, temperature=1.0, seed=i, grammar=compiled if i < constrained
                                      else None)) for i in range(rows)]
        _, elapsed = timed(lambda: runner.run(gens))
    finally:
        grammar.masks, model_runner._constrain = masks, constrain
    assert all(g.completion_tokens == tokens for g in gens)
    return elapsed / tokens, spent["masks"] / tokens, spent["constrain"] / tokens


def engine_cost():
    from model import GPT, GPTConfig

    tokenizer = chat.tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=50304, n_layer=6, n_head=6, n_embd=384))
    model = packing.prepare(model, "cpu", "float32")
    print("| rows | with a schema | a step (median of 3) | of it: masks | masks and their applying | that share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (1, 32):
        runner = engine.Engine(model, tokenizer, max_batch=rows)
        engine_rows(runner, tokenizer, rows, rows, 8)  # (warm-up)
        runs = {n: [] for n in sorted({0, rows // 2, rows})}
        for _ in range(3):  # (interleaved: a machine shared with others changes speed as it goes)
            for constrained in runs:
                runs[constrained].append(engine_rows(runner, tokenizer, rows, constrained, 64))
        for constrained, measured in runs.items():
            step, masks, constrain = (float(np.median(column)) for column in zip(*measured))
            print(f"| {rows} | {constrained} | {step * 1e3:.1f} ms | {masks * 1e3:.2f} ms | {constrain * 1e3:.2f} ms | "
                  f"{constrain / step:.1%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--part", choices=["libraries", "engine", "both"], default="both")
    part = parser.parse_args().part
    if part in ("libraries", "both"):
        libraries()
    if part in ("engine", "both"):
        engine_cost()


if __name__ == "__main__":
    main()
