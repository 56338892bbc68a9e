"""Structured outputs (machinery/generation/grammar.py, issue 59): replies constrained to a JSON schema parse and
validate, on every tokenizer the project makes, with the engine's guarantees (a row's tokens its own, the prefix
cache exact, a bad schema failing no one else); sample.py --json_schema and its refusals."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from conftest import assert_one_error_line, run_in_process
from machinery.data import bpe, chat
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from machinery.errors import UserError
from machinery.generation import engine, grammar, packing
from machinery.generation.request import Request
from model import GPT, GPTConfig

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                               "maxItems": 4},
                                      "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                                                 "ok": {"type": "boolean"}},
                                                "required": ["x", "ok"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 5},
    {"enum": ["red", "green", 3]},
    grammar.ANY_OBJECT,
]
SEEDS = 3  # each schema's rows in a batch
JSON_CHARS = sorted(set('{}[]":,.-+0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n\\/'))


def random_model(vocab_size, seed=0, block_size=128):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return packing.prepare(model, "cpu", "float32")


def learned_bpe():
    text = " ".join(json.dumps({"name": f"n{i}", "age": i, "tags": ["a", "bb"][: i % 3]}) for i in range(300))
    return bpe.learn([text], 256 + len(bpe.SPECIALS) + 40)


TOKENIZERS = {"gpt2": GPT2Tokenizer, "bpe": learned_bpe, "chars": lambda: CharTokenizer(JSON_CHARS)}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def setup(request):
    tokenizer = TOKENIZERS[request.param]()
    return tokenizer, random_model(tokenizer.vocab_size)


def stops(tokenizer):
    return (tokenizer.eot_token,) if tokenizer.eot_token is not None else ()


def generate(runner, tokenizer, schemas, seeds, max_tokens=96, prompt="{", **settings):
    """Each (schema, seed)'s generation, all at once."""
    ids = tokenizer.encode(prompt)
    gens = [runner.submit(Request(ids, max_tokens, seed=seed, stop_tokens=stops(tokenizer),
                                  grammar=None if schema is None else grammar.compile_schema(tokenizer, schema),
                                  **settings))
            for schema in schemas for seed in seeds]
    runner.run(gens)
    return gens


def accepts_prefix(tokenizer, schema, ids):
    state = grammar.compile_schema(tokenizer, schema).start()
    return all(state.matcher.consume_token(t) for t in ids)


def test_every_finished_reply_parses_and_validates_and_a_cut_one_is_a_prefix(setup):
    tokenizer, model = setup
    runner = engine.Engine(model, tokenizer, max_batch=len(SCHEMAS) * SEEDS)
    gens = generate(runner, tokenizer, SCHEMAS, range(SEEDS), max_tokens=64, temperature=1.0, top_k=None)
    finished = 0
    for i, g in enumerate(gens):
        schema, ids = SCHEMAS[i // SEEDS], g.ids[g.prompt_tokens:]
        assert g.finish_reason in ("stop", "length"), g.error
        if g.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(g.text.text), schema)
        else:
            assert len(ids) == 64 and accepts_prefix(tokenizer, schema, ids)
    assert finished >= len(gens) // 2


def test_special_tokens_are_never_spelled_and_end_tokens_come_exactly_where_the_grammar_may_end():
    tokenizer = chat.tokenizer()  # GPT-2 with the chat format's special tokens
    compiled = grammar.compile_schema(tokenizer, {"type": "object", "properties": {"s": {"type": "string"}}})
    row = compiled.start(stop_tokens=(chat.stop_token(tokenizer), tokenizer.eot_token))
    base = compiled.start(stop_tokens=(tokenizer.eot_token,))
    specials = sorted(tokenizer.specials.values()) + [tokenizer.eot_token]
    for text in ['{"s":"', "<|", "assistant_end", "|>"]:  # inside a string: a special token's text is text
        for state in (row, base):
            assert not grammar.masks([state], tokenizer.vocab_size)[0, specials].any()
            for t in tokenizer.encode(text):
                assert not state.advance(t)
    for t in tokenizer.encode('"}'):
        done = [state.advance(t) for state in (row, base)]
    assert done == [True, True]
    allowed = grammar.masks([row, base], tokenizer.vocab_size)
    assert np.flatnonzero(allowed[0]).tolist() == sorted([tokenizer.eot_token, chat.stop_token(tokenizer)])
    assert np.flatnonzero(allowed[1]).tolist() == [tokenizer.eot_token]  # not a chat request's end of turn


MIXED = [(SCHEMAS[0], dict(temperature=1.0)), (None, dict(temperature=1.0)), (SCHEMAS[2], dict(temperature=0.7, top_p=0.9)),
         (SCHEMAS[1], dict(temperature=0)), (None, dict(temperature=0.7, top_p=0.9))]  # (settings grouped in a draw)


def mixed(runner, tokenizer, which, seed):
    ids = tokenizer.encode("{")
    gens = [runner.submit(Request(ids, 24, seed=seed + i, stop_tokens=stops(tokenizer), **MIXED[i][1],
                                  grammar=MIXED[i][0] and grammar.compile_schema(tokenizer, MIXED[i][0])))
            for i in which]
    runner.run(gens)
    return [g.ids for g in gens]


def test_a_rows_tokens_are_its_own_with_schemas_mixed_in_the_batch(setup):
    tokenizer, model = setup
    runner = engine.Engine(model, tokenizer, max_batch=8)
    together = mixed(runner, tokenizer, range(len(MIXED)), seed=1)
    assert together == [mixed(runner, tokenizer, [i], seed=1)[0] for i in range(len(MIXED))]


def test_the_fixed_step_launched_ahead_gives_the_same_tokens_with_schemas_mixed_in():
    """A batch holding a row with a schema decodes on the plain path of the fixed step (its mask needs the host's
    token first); once those rows have ended, the others are launched ahead again: the same tokens either way."""
    tokenizer = CharTokenizer(JSON_CHARS)
    model = random_model(tokenizer.vocab_size)
    ahead, plain = (engine.Engine(model, tokenizer, max_batch=8, fixed=True, ahead=a) for a in (True, False))
    together = mixed(ahead, tokenizer, range(len(MIXED)), seed=5)
    assert together == mixed(plain, tokenizer, range(len(MIXED)), seed=5)
    assert together == [mixed(ahead, tokenizer, [i], seed=5)[0] for i in range(len(MIXED))]


def test_the_prefix_cache_stays_exact_with_schemas():
    tokenizer = CharTokenizer(JSON_CHARS)
    model = random_model(tokenizer.vocab_size)
    prompt = '{"a": 1, "b": [2, 3], "c": "some text here", "d": {"e": null}} '
    off = engine.Engine(model, tokenizer, max_batch=4, prefill_chunk=16)
    on = engine.Engine(model, tokenizer, max_batch=4, prefill_chunk=16, prefix_cache_mb=1)
    ask = dict(schemas=[SCHEMAS[0], SCHEMAS[1]], seeds=[3], max_tokens=32, prompt=prompt)
    expected = [g.ids for g in generate(off, tokenizer, **ask)]
    assert [g.ids for g in generate(on, tokenizer, **ask)] == expected
    assert [g.ids for g in generate(on, tokenizer, **ask)] == expected  # (its prompt from the cache now)
    assert on.cache_stats()["hits"] > 0


@pytest.mark.parametrize("schema, says", [
    ({"type": "nonsense"}, "cannot be used: Invalid type: nonsense"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"not": {"type": "string"}}, "not"),
    ({"$ref": "#/missing"}, "missing"),
    ([1, 2], "is a JSON object"),
])
def test_a_bad_schema_is_a_value_error_naming_it(schema, says):
    with pytest.raises(ValueError, match=says) as e:
        grammar.compile_schema(GPT2Tokenizer(), schema)
    assert "\n" not in str(e.value)


def test_a_schema_the_vocabulary_cannot_begin_is_refused_and_one_it_cannot_finish_fails_its_row_alone():
    tokenizer = CharTokenizer(sorted(set('{"abc xyz')))  # no digit, no "q"
    with pytest.raises(ValueError, match="no token of this model's vocabulary can begin it"):
        grammar.compile_schema(tokenizer, {"type": "integer"})
    runner = engine.Engine(random_model(tokenizer.vocab_size), tokenizer, max_batch=4)
    needs_q = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    bad, good = generate(runner, tokenizer, [needs_q, None], [0], max_tokens=8, prompt="a")
    assert bad.finish_reason == "error" and "grammar" in bad.error and bad.text.text == '{"'  # (what it accepted)
    assert good.finish_reason == "length" and good.completion_tokens == 8


def test_max_tokens_cuts_a_reply_with_length_and_a_prefix_the_grammar_accepts():
    tokenizer = GPT2Tokenizer()
    runner = engine.Engine(random_model(tokenizer.vocab_size), tokenizer)
    for g in generate(runner, tokenizer, [SCHEMAS[1]], range(4), max_tokens=5):
        assert g.finish_reason == "length" and g.completion_tokens == 5
        assert accepts_prefix(tokenizer, SCHEMAS[1], g.ids[g.prompt_tokens:])


def test_without_llguidance_a_schema_is_a_one_line_error_with_the_install_hint(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    monkeypatch.setattr(grammar, "_llguidance", None)
    with pytest.raises(UserError, match=f"pip install {grammar.LLGUIDANCE}"):
        grammar.library()


# ---------------------------------------------------------------------- sample.py --json_schema

@pytest.fixture(scope="module")
def char_json_ckpt(tmp_path_factory):
    from test_sample import save_checkpoint

    tokenizer = CharTokenizer(JSON_CHARS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("json") / "best.pt"
    save_checkpoint(path, model, tokenizer)
    return path


def sample(ckpt, *args, check=True):
    import sample as sample_py

    return run_in_process(sample_py.main, f"--out_dir={ckpt}", "--device=cpu", "--start=x", "--stream=False",
                          "--max_new_tokens=40", *args, check=check)


def test_sample_py_json_schema_samples_parse_and_validate_or_are_said_to_be_cut(char_json_ckpt, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMAS[0]))
    for setting, schema in [(str(path), SCHEMAS[0]), ("object", grammar.ANY_OBJECT)]:
        proc = sample(char_json_ckpt, f"--json_schema={setting}", "--num_samples=4")
        replies = [s[len("x"):].rstrip("\n") for s in proc.stdout.split("---------------\n")[:-1]]
        assert len(replies) == 4
        cut = re.findall(r"note: sample ([\d, ]+) reached max_new_tokens", proc.stderr)
        cut = [int(i) for i in cut[0].split(", ")] if cut else []
        assert schema is grammar.ANY_OBJECT or not cut  # (its strings and numbers are bounded)
        for i, reply in enumerate(replies):
            if i + 1 not in cut:
                jsonschema.validate(json.loads(reply), schema)


@pytest.mark.parametrize("make, says", [
    (lambda p: None, "No such file"),
    (lambda p: p.write_text("{not json"), "is not valid JSON"),
    (lambda p: p.write_text("[1]"), "does not hold a JSON object"),
    (lambda p: p.write_text('{"type": "nonsense"}'), "cannot be used: Invalid type"),
    (lambda p: p.write_text('{"type": "string", "not": {}}'), "Unimplemented keys"),
])
def test_sample_py_refuses_a_bad_schema_file_with_one_line_and_exit_2(char_json_ckpt, tmp_path, make, says):
    path = tmp_path / "schema.json"
    make(path)
    proc = sample(char_json_ckpt, f"--json_schema={path}", check=False)
    assert proc.stdout == ""
    assert_one_error_line(proc, "--json_schema", says)


def test_sample_py_refuses_json_schema_with_chat(char_json_ckpt):
    proc = run_in_process(__import__("sample").main, f"--out_dir={char_json_ckpt}", "--chat",
                          "--json_schema=object", check=False)
    assert_one_error_line(proc, "--json_schema", "--chat")
