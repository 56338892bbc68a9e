"""serve.py's API where OpenAI's clients rely on its exact shape: chat logprobs, developer messages, a model by its
id, how streams end, and the fields this server refuses rather than ignores. Through the openai client (as users
call it) and raw HTTP where the client hides the difference (a "usage": null against none), on test_serve.py's
small random character-level model, whose plain float32 forward gives the expected log-probabilities."""

import json

import openai
import pytest
import torch

from machinery.serving import openai_responses
from machinery.data.tokenizer import GPT2Tokenizer
from test_serve import HTTP, NAME, TOL, ckpt_dir, client, post, reference_logprobs, serving  # noqa: F401

MESSAGES = [{"role": "system", "content": "A play."}, {"role": "user", "content": "Who art thou?"}]
TEMPLATE = "A play.\n\nUser: Who art thou?\nAssistant:"  # CHAT_TEMPLATE of MESSAGES, written out by hand


@pytest.fixture(scope="module")
def server(ckpt_dir):  # noqa: F811
    with serving(ckpt_dir) as s:
        yield s


def raw_stream(server, path, body):
    """The JSON objects of a stream's data lines, and whether it ended with [DONE]."""
    with HTTP.stream("POST", f"{server.url}{path}", json=dict(body, stream=True), timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line]
    return [json.loads(line) for line in lines[:-1]], lines[-1] == "[DONE]"


def test_chat_logprobs_are_the_models_log_softmax_with_bytes_and_top_alternatives_streamed_and_not(server, ckpt_dir):
    tokenizer = server.tokenizer
    args = dict(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    answer = client(server).chat.completions.create(**args)
    entries = answer.choices[0].logprobs.content
    generated = [tokenizer.stoi[e.token] for e in entries]  # (one character a token)
    assert len(entries) == 6 and "".join(e.token for e in entries).lstrip() == answer.choices[0].message.content
    prompt = tokenizer.encode(TEMPLATE)
    expected = reference_logprobs(ckpt_dir, prompt + generated)[len(prompt) - 1:]
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(expected[j, generated[j]].item(), abs=TOL)
        assert e.bytes == list(e.token.encode("utf-8"))
        top = torch.topk(expected[j], 3)
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
        assert [t.bytes for t in e.top_logprobs] == [list(t.token.encode("utf-8")) for t in e.top_logprobs]
    chunks = list(client(server).chat.completions.create(stream=True, **args))
    streamed = [e for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=TOL)
    plain = client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_bytes_of_a_bpe_token_that_splits_a_character_are_its_own():
    tokenizer = GPT2Tokenizer()
    ids = tokenizer.encode("日本")  # (GPT-2's BPE splits these characters' UTF-8 bytes among tokens)
    pieces = [openai_responses.scored(tokenizer, i, -1.0) for i in ids]
    assert len(ids) > 2 and sum((p["bytes"] for p in pieces), []) == list("日本".encode("utf-8"))


@pytest.mark.parametrize("extra, param, code", [
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs: true, as OpenAI refuses it
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"logprobs": 3}, "logprobs", "invalid_type"),  # (chat's is true or false, not completions' count)
    ({"response_format": {"type": "sound"}}, "response_format", "invalid_value"),
    ({"response_format": "text"}, "response_format", "invalid_type"),
    # (this character-level model's vocabulary has no "{": it cannot write a JSON object, and says so)
    ({"response_format": {"type": "json_object"}}, "response_format", "invalid_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid_schema"),
    ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop", "unsupported"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools", "unsupported"),  # (functions only)
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "invalid_value"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),  # (without tools)
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_value"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "1"}]}, "messages", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported"),
    ({"function_call": "auto"}, "function_call", "unsupported"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported"),
    ({"store": True}, "store", "unsupported"),
    ({"user": 5}, "user", "invalid_type"),
    ({"messages": [dict(MESSAGES[1], name="Hamlet")]}, "messages", "unsupported"),  # (extra_body's replace them)
])
def test_chat_fields_this_server_does_not_do_are_refused_with_openais_error(server, extra, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, extra_body=extra)
    error = refused.value.body
    assert (refused.value.status_code, error["param"], error["code"]) == (400, param, code), error
    assert set(refused.value.response.json()["error"]) == {"message", "type", "param", "code"}


def test_fields_that_change_nothing_are_accepted_and_json_output_is_refused_on_completions_too(server):
    replied = {"role": "assistant", "content": "Hamlet.", "refusal": None, "tool_calls": None, "annotations": []}
    answer = client(server).chat.completions.create(model=NAME, messages=MESSAGES + [replied], max_tokens=1,
                                                    response_format={"type": "text"}, tool_choice="none",
                                                    user="u1", parallel_tool_calls=False, metadata={"a": "b"})
    assert answer.choices[0].finish_reason == "length"
    r = post(server, "/v1/completions", {"prompt": "KING", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"


def test_a_developer_message_is_the_system_message(server):
    as_system = client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    as_developer = client(server).chat.completions.create(model=NAME, max_tokens=8, temperature=0,
                                                          messages=[dict(MESSAGES[0], role="developer"), MESSAGES[1]])
    assert as_developer.usage.prompt_tokens == len(TEMPLATE)  # rendered as the system message is
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_a_model_is_served_by_its_id_and_another_id_is_404(server):
    model = client(server).models.retrieve(NAME)
    assert model.model_dump() == client(server).models.list().data[0].model_dump()
    assert (model.id, model.object) == (NAME, "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client(server).models.retrieve("gpt-4o")
    assert (missing.value.body["param"], missing.value.body["code"]) == ("model", "model_not_found")
    assert set(missing.value.response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "KING"}),
])
def test_streams_end_as_openais_with_a_chunk_of_no_text_and_usage_null_until_the_usage_chunk(server, path, body):
    body = dict(body, model=NAME, max_tokens=5, seed=1, stream_options={"include_usage": True})
    chunks, done = raw_stream(server, path, body)
    whole = post(server, path, body).json()["choices"][0]
    chat = "messages" in body
    *text_chunks, end, last = chunks
    assert done and last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks)
    assert end["choices"][0]["finish_reason"] == "length"
    if chat:
        assert text_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert end["choices"][0]["delta"] == {}
        text = "".join(c["choices"][0]["delta"]["content"] for c in text_chunks)
        assert text == whole["message"]["content"]
    else:
        assert end["choices"][0]["text"] == ""
        assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["text"]
