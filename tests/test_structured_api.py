"""serve.py's structured outputs (issue 59) as OpenAI's clients ask for them: response_format json_object and
json_schema, tools with each tool_choice, streamed and not, n choices and seeds, through the openai client against the
real server. Every finished reply parses (json.loads) and validates (jsonschema), a cut one says length, logprobs
are the model's own for the tokens chosen, and each refusal is a 400 after which the server still answers. One
server: a tiny GPT-2 BPE chat model taught TAUGHT_TOOLS (a call, a greeting, an answer after a tool's result), whose
text is nonsense elsewhere: that makes the guarantee visible."""

import io
import json
import sys

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import assert_one_error_line, run_in_process, teach_chat_model
from machinery.data import chat
from machinery.data.tokenizer import GPT2Tokenizer
from machinery.serving.openai_responses import Reply
from test_serve import TOL, bpe_ckpt_dir, client, reference_logprobs, serving  # noqa: F401
from test_structured import SCHEMAS

NAME = "tools"  # the served model's name: its out_dir's last part
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
             {"name": "add", "parameters": ADD}]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
PARAMETERS = {f["name"]: f["parameters"] for f in FUNCTIONS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"city": "Paris", "unit": "C"}
CALLED = ASK + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
HELLO = [{"role": "user", "content": "Hello"}]
# what the model is taught, in the prompts chat.with_tools writes (with the tools listed): a call, text, an answer
TAUGHT_TOOLS = [
    ASK + [{"role": "assistant", "content": "", "calls": [("get_weather", CALL)]}],
    HELLO + [{"role": "assistant", "content": "Hi there!"}],
    ASK + [{"role": "assistant", "content": "", "calls": [("get_weather", CALL)]},
           {"role": "tool", "name": "get_weather", "content": "21"}, {"role": "assistant", "content": "It is 21 C."}],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = teach_chat_model(tmp_path_factory.mktemp("tools") / NAME, TAUGHT_TOOLS,
                           lambda tok, messages: chat.encode(tok, chat.with_tools(messages, FUNCTIONS)),
                           block_size=256)
    with serving(out) as s:
        s.out = out
        yield s


def compact(value):
    return json.dumps(value, separators=(",", ":"))  # (JSON without whitespace, as the grammars write it)


def ask(server, messages=HELLO, **kw):
    return client(server).chat.completions.create(model=NAME, messages=messages, **kw)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def streamed(server, messages=HELLO, **kw):
    """Each choice's (content, tool call (id, name, arguments) or None, finish_reason) from a stream, joined by hand
    from its deltas as OpenAI's documentation joins them (a call's id, type and name come first, then arguments)."""
    got = {}
    for chunk in ask(server, messages, stream=True, **kw):
        for c in chunk.choices:
            content, call, finish = got.get(c.index, ("", None, None))
            content += c.delta.content or ""
            for part in c.delta.tool_calls or []:
                assert part.index == 0 and (call is None) == (part.id is not None)
                if call is None:
                    assert part.type == "function" and part.function.name and part.function.arguments == ""
                    call = (part.id, part.function.name, "")
                else:
                    assert part.function.name is None
                    call = (call[0], call[1], call[2] + part.function.arguments)
            got[c.index] = (content, call, c.finish_reason or finish)
    return [got[i] for i in sorted(got)]


def whole(choice):
    """A whole response's choice as streamed() gives a streamed one."""
    m = choice.message
    call = None if not m.tool_calls else (m.tool_calls[0].id, m.tool_calls[0].function.name,
                                          m.tool_calls[0].function.arguments)
    assert not m.tool_calls or (len(m.tool_calls) == 1 and m.tool_calls[0].type == "function" and m.content is None)
    return m.content or "", call, choice.finish_reason


def assert_valid(choice_parts, schema=None):
    """A finished choice's JSON validates (schema: its own; None: its call's tool's parameters); a cut one says
    length."""
    content, call, finish = choice_parts
    if finish == "length":
        return False
    if schema is None:
        assert finish == "tool_calls" and call[0].startswith("call_") and not content
        jsonschema.validate(json.loads(call[2]), PARAMETERS[call[1]])
    else:
        assert finish == "stop" and call is None
        jsonschema.validate(json.loads(content), schema)
    return True


# ---------------------------------------------------------------------- response_format


def test_json_schema_replies_validate_for_every_schema_choice_and_seed_streamed_and_not(server):
    finished = 0
    for schema in SCHEMAS:
        answer = ask(server, n=3, seed=7, temperature=1.0, max_tokens=48, response_format=schema_format(schema))
        parts = [whole(c) for c in answer.choices]
        finished += sum(assert_valid(p, schema) for p in parts)
        if schema is SCHEMAS[1]:  # (one schema's choices: each its seed's alone, and the same streamed)
            assert streamed(server, n=3, seed=7, temperature=1.0, max_tokens=48,
                            response_format=schema_format(schema)) == parts
            alone = ask(server, seed=8, temperature=1.0, max_tokens=48, response_format=schema_format(schema))
            assert whole(alone.choices[0]) == parts[1]
    assert finished >= len(SCHEMAS) * 3 // 2


def test_json_object_replies_are_objects_and_the_clients_parse_gives_a_pydantic_model(server):
    # (the tools shown, none callable: the taught call, an object, is what this model writes; and otherwise any)
    for extra in (dict(tools=TOOLS, tool_choice="none"), {}):
        answer = ask(server, ASK, n=4, seed=1, temperature=1.0, max_tokens=40, response_format={"type": "json_object"},
                     **extra)
        objects = [json.loads(c.message.content) for c in answer.choices if c.finish_reason == "stop"]
        assert all(isinstance(o, dict) for o in objects) and len(objects) >= (3 if extra else 0)
        assert all(c.finish_reason in ("stop", "length") for c in answer.choices)

    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=1000)
        capital: bool
        kind: str = Field(json_schema_extra={"enum": ["town", "city"]})

    for seed in range(3):
        parsed = client(server).chat.completions.parse(model=NAME, messages=ASK, response_format=City, seed=seed,
                                                       temperature=1.0, max_tokens=60)
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and parsed.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(parsed.choices[0].message.content), City.model_json_schema())


def test_a_base_models_json_follows_its_schema_too(bpe_ckpt_dir):  # noqa: F811
    """A base model (GPT-2's BPE, never tuned to chat): its reply after chat.BASE_TEMPLATE's "Assistant:", ended by
    <|endoftext|> where the JSON may end."""
    with serving(bpe_ckpt_dir) as base:
        answer = client(base).chat.completions.create(model="bpe", messages=HELLO, n=4, seed=3, temperature=1.0,
                                                      max_tokens=40, response_format=schema_format(SCHEMAS[0]))
    assert sum(assert_valid(whole(c), SCHEMAS[0]) for c in answer.choices) >= 2


def test_max_tokens_cuts_the_json_and_the_call_with_length_streamed_and_not(server):
    cut = ask(server, max_tokens=3, temperature=0, response_format=schema_format(SCHEMAS[0]))
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert '{"name":"'.startswith(cut.choices[0].message.content[:9])  # (the schema's first key, compact)
    taught = compact({"name": "get_weather", "arguments": CALL})
    before_name = ask(server, ASK, max_tokens=3, temperature=0, tools=TOOLS)  # the name not whole: content
    assert whole(before_name.choices[0]) == (taught[:len(before_name.choices[0].message.content)], None, "length")
    assert len(before_name.choices[0].message.content) > 0
    mid = ask(server, ASK, max_tokens=14, temperature=0, tools=TOOLS)  # the arguments begun: a call, cut
    content, (_, name, arguments), finish = whole(mid.choices[0])
    assert (content, name, finish) == ("", "get_weather", "length")
    assert compact(CALL).startswith(arguments) and 0 < len(arguments) < len(compact(CALL))
    (s_content, (_, s_name, s_arguments), s_finish), = streamed(server, ASK, max_tokens=14, temperature=0,
                                                                 tools=TOOLS)
    assert (s_content, s_name, s_arguments, s_finish) == (content, name, arguments, finish)


def test_logprobs_are_the_models_own_for_the_tokens_chosen(server):
    tokenizer = GPT2Tokenizer()
    answer = ask(server, ASK, seed=3, temperature=1.0, max_tokens=40, logprobs=True, top_logprobs=2,
                 response_format=schema_format(WEATHER))
    choice = answer.choices[0]
    entries = choice.logprobs.content
    assert bytes(sum((e.bytes for e in entries), [])).decode() == choice.message.content
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    chosen = [tokenizer.ranks[bytes(e.bytes)] for e in entries]
    prompt, _ = chat.encode(chat.tokenizer(), ASK, add_generation_prompt=True)
    expected = reference_logprobs(server.out, prompt + chosen)[len(prompt) - 1:]
    # the model's log-probabilities, not the grammar's renormalised ones: what it thinks of the token chosen (within
    # float32's rounding over this taught model's larger logits)
    assert [e.logprob for e in entries] == pytest.approx([expected[j, t].item() for j, t in enumerate(chosen)],
                                                         abs=50 * TOL)
    call = ask(server, ASK, temperature=0, logprobs=True, tool_choice="required", tools=TOOLS).choices[0]
    assert bytes(sum((e.bytes for e in call.logprobs.content), [])).decode() == compact(
        {"name": "get_weather", "arguments": CALL})


# ---------------------------------------------------------------------- tools


def test_tool_choice_auto_calls_or_talks_as_taught_and_a_tools_result_is_answered(server):
    called = ask(server, ASK, temperature=0, tools=TOOLS)
    content, (_, name, arguments), finish = whole(called.choices[0])
    assert (content, name, json.loads(arguments), finish) == ("", "get_weather", CALL, "tool_calls")
    talked = ask(server, HELLO, temperature=0, tools=TOOLS)
    assert whole(talked.choices[0]) == ("Hi there!", None, "stop")
    answered = ask(server, CALLED, temperature=0, tools=TOOLS)
    assert whole(answered.choices[0]) == ("It is 21 C.", None, "stop")
    named = ask(server, CALLED[:2] + [dict(CALLED[2], name="get_weather")], temperature=0, tools=TOOLS)
    assert whole(named.choices[0]) == whole(answered.choices[0])  # (a result's name, as some clients send it)
    # the prompt, written out here by hand: the tools at the end of a system message, the call as the assistant's
    # compact JSON, the result a user message; each message between its two special tokens, after <|endoftext|>
    lines = [compact(f) for f in FUNCTIONS]
    system = ('To call one of these tools, reply with only {"name": its name, "arguments": its arguments} as JSON:\n'
              + "\n".join(lines))
    texts = [system, "Weather in Paris?", '{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}',
             "The tool get_weather returned: 21"]
    encode = GPT2Tokenizer().encode
    assert answered.usage.prompt_tokens == 1 + sum(2 + len(encode(t)) for t in texts) + 1
    # none: no call, whatever the text (this model writes its call's JSON as plain content)
    plain = ask(server, ASK, temperature=0, tools=TOOLS, tool_choice="none", max_tokens=30)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == texts[2]


def test_sample_py_chat_calls_the_tools_as_the_server_does_and_reads_each_result_typed(server, tmp_path, monkeypatch):
    import sample
    from machinery.generation import engine

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    prompts, submit = [], engine.Engine.submit
    monkeypatch.setattr(engine.Engine, "submit", lambda runner, r, *a, **kw: prompts.append(r.prompt) or
                        submit(runner, r, *a, **kw))

    def chat_in_terminal(lines, *args):
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        return run_in_process(sample.main, f"--out_dir={server.out}", "--device=cpu", "--dtype=float32", "--chat",
                              "--temperature=0", "--max_new_tokens=40", *args, check=False)
    # auto: the question is answered with the call the server makes; the line typed then is its result, answered
    # as the server answers it; a greeting is text (the model is taught one-question conversations)
    proc = chat_in_terminal("Weather in Paris?\n21\n", f"--tools={tools}")
    call = '{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}'
    assert proc.returncode == 0 and proc.stdout == f"{call}\nIt is 21 C.\n\n", proc.stderr
    assert chat_in_terminal("Hello\n", f"--tools={tools}").stdout == "Hi there!\n\n"
    assert "note: a call of get_weather; type what it returned" in proc.stderr
    # the second prompt: the tools listed, the call as the assistant's JSON, the result typed a user message, as
    # the server's (its prompt tokens counted by hand in the test above)
    lines = "\n".join(compact(f) for f in FUNCTIONS)
    texts = [f'To call one of these tools, reply with only {{"name": its name, "arguments": its arguments}} as JSON:'
             f"\n{lines}", "Weather in Paris?", call, "The tool get_weather returned: 21"]
    encode = GPT2Tokenizer().encode
    assert len(prompts[1]) == 1 + sum(2 + len(encode(t)) for t in texts) + 1 == \
        ask(server, CALLED, temperature=0, tools=TOOLS).usage.prompt_tokens
    ids = [encode(t) for t in texts]  # (each text whole in the prompt, in order)
    at = [next(i for i in range(len(prompts[1])) if prompts[1][i:i + len(t)] == t) for t in ids]
    assert at == sorted(at)
    # none: text, however much it looks like a call; required and a named function: calls
    assert chat_in_terminal("Weather in Paris?\n", f"--tools={tools}", "--tool_choice=none").stdout == f"{call}\n\n"
    named = chat_in_terminal("Hello\n", f"--tools={tools}", "--tool_choice=add")
    assert json.loads(named.stdout)["name"] == "add" and "a call of add" in named.stderr
    # mistakes: one line each, exit 2
    (tmp_path / "object.json").write_text("{}")
    for args, says in [([f"--tools={tmp_path / 'object.json'}"], "does not hold a JSON list"),
                       ([f"--tools={tools}", "--tool_choice=weather"], "not among tools"),
                       (["--tool_choice=required"], "--tool_choice needs --tools"),
                       ([f"--tools={tools}", "--stop=}"], "--stop cannot be combined with --tools")]:
        assert_one_error_line(chat_in_terminal("Hello\n", *args), says)
    proc = run_in_process(sample.main, f"--out_dir={server.out}", f"--tools={tools}", check=False)
    assert_one_error_line(proc, "--tools", "--chat")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_validate_for_every_choice_and_seed_streamed_and_not(server, choice):
    for messages in (HELLO, ASK):
        answer = ask(server, messages, n=4, seed=5, temperature=1.0, max_tokens=40, tools=TOOLS, tool_choice=choice)
        parts = [whole(c) for c in answer.choices]
        assert all(assert_valid(p) for p in parts)  # (every argument is bounded: each call ends)
        assert len({p[1][0] for p in parts}) == 4  # (an id each)
        if isinstance(choice, dict):
            assert {p[1][1] for p in parts} == {"add"}
        stream = streamed(server, messages, n=4, seed=5, temperature=1.0, max_tokens=40, tools=TOOLS,
                          tool_choice=choice)
        assert [(c, t[1:], f) for c, t, f in stream] == [(c, t[1:], f) for c, t, f in parts]


def test_the_clients_stream_helper_and_parse_read_our_tool_calls(server):
    with client(server).chat.completions.stream(model=NAME, messages=ASK, temperature=0, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", CALL)
    assert final.choices[0].finish_reason == "tool_calls"

    class Add(BaseModel):
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    parsed = client(server).chat.completions.parse(model=NAME, messages=HELLO, seed=2, temperature=1.0,
                                                   tools=[openai.pydantic_function_tool(Add)], tool_choice="required")
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, Add)


def test_a_reply_streamed_in_any_pieces_is_the_reply_whole():
    call = compact({"name": "add", "arguments": {"a": 1, "b": 22}})
    for text, lstrip, calls, finish in [(call, False, True, "stop"), (call[:20], False, True, "length"),
                                        (call[:5], False, True, "length"), ("  Hi {x}", True, True, "stop"),
                                        (call, True, False, "stop"), (" \n ", True, False, "length")]:
        expected = Reply(lstrip, calls).message(text, finish)
        for step in (1, 2, 7):
            reply, deltas = Reply(lstrip, calls), []
            for i in range(0, len(text), step):
                deltas += reply.feed(text[i:i + step])
            last, finish_reason = reply.end(finish)
            deltas += last
            content = "".join(d.get("content", "") for d in deltas)
            arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
            message = expected[0]
            assert finish_reason == expected[1]
            if message.get("tool_calls"):
                assert arguments == message["tool_calls"][0]["function"]["arguments"] and not content
            else:
                assert content == message["content"] and not arguments
    assert Reply(True, True).message("  Hi {x}", "stop") == ({"role": "assistant", "content": "Hi {x}"}, "stop")
    assert Reply(False, True).message(call, "stop")[0]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a":1,"b":22}'}
    assert Reply(False, True).message(call, "stop")[1] == "tool_calls"


# ---------------------------------------------------------------------- refusals


def function(parameters, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("extra, param, code, says", [
    ({"response_format": schema_format({"type": "nonsense"})}, "response_format", "invalid_schema", "nonsense"),
    ({"response_format": schema_format({"not": {"type": "string"}})}, "response_format", "invalid_schema", "not"),
    ({"response_format": schema_format({"type": "string", "pattern": "(?<=a)b"})}, "response_format",
     "invalid_schema", "look-around"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format",
     "invalid_value", "name"),
    ({"tools": [function({"type": "nonsense"})]}, "tools", "invalid_schema", "nonsense"),
    ({"tools": [function([1])]}, "tools", "invalid_value", "parameters"),
    ({"tools": [function(ADD), function(ADD)]}, "tools", "invalid_value", "same name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value", "sometimes"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "unsupported", "tools"),
    ({"tools": TOOLS, "stop": ["}"]}, "stop", "unsupported", "cut"),
    ({"messages": CALLED[:1] + [{"role": "tool", "tool_call_id": "call_9", "content": "21"}]}, "messages",
     "invalid_value", "call_9"),
    ({"messages": [dict(CALLED[1], tool_calls=[{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{oops"}}])]},
     "messages", "invalid_value", "not JSON"),
    ({"messages": [dict(HELLO[0], tool_calls=[{"id": "c"}])]}, "messages", "unsupported", "tool_calls"),
    ({"messages": CALLED[:2] + [dict(CALLED[2], name="add")]}, "messages", "unsupported", "name"),
])
def test_bad_schemas_and_tools_are_400s_naming_them_and_the_server_still_answers(server, extra, param, code, says):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(model=NAME, messages=HELLO, max_tokens=5, extra_body=extra)
    error = refused.value.body
    assert (refused.value.status_code, error["param"], error["code"]) == (400, param, code), error
    assert says in error["message"] and "\n" not in error["message"]
    answer = ask(server, ASK, temperature=0, tools=TOOLS, tool_choice="required")
    assert assert_valid(whole(answer.choices[0]))
