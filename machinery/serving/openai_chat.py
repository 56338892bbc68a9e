"""
A chat request's own fields, read and checked: those this server refuses or ignores (check_chat_fields), the messages
(read_messages), and response_format: plain text, any JSON object, or JSON that follows a schema (read_format), its
grammar compiled by grammar.py off the event loop (compile_grammar), a schema it cannot use a 400 naming why. What
the server does not do is refused (400, code unsupported), never ignored.
Not owned: the settings every request shares (openai_requests.py), the routes (openai_api.py), the answers
(openai_responses.py), grammars (grammar.py), the chat formats (chat.py).
"""

import asyncio
import json
import re

from machinery.errors import UserError, first_line
from machinery.generation import grammar
from machinery.serving.openai_requests import APIError, field

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> ours
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
# chat/completions fields of OpenAI's that this server does not do (it writes plain text, with no tools, audio, web
# search or reasoning): refused (400 unsupported) unless absent, null or one of the values that change nothing
CHAT_UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
                    "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default")}
# ... and those that change nothing here (who the end user is, a caching hint, tags): checked, then unused
CHAT_NO_OPS = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict,
               "parallel_tool_calls": bool}
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # a json_schema's (and a function's) name, as OpenAI checks it
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


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


def read_format(body):
    """The JSON schema that response_format asks the reply to follow (grammar.ANY_OBJECT for json_object), or None
    for plain text. A json_schema's strict changes nothing: the reply follows its schema either way."""
    expect = 'an object {"type": "text" | "json_object" | "json_schema"}'
    given = field(body, "response_format", dict, {"type": "text"}, expect=expect)
    kind = given.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar.ANY_OBJECT
    if kind != "json_schema":
        raise APIError(400, f"response_format must be {expect}, got type {json.dumps(kind)[:80]}", "response_format",
                       "invalid_value")
    spec = given.get("json_schema")
    if not isinstance(spec, dict):
        refuse_format('response_format json_schema needs "json_schema": {"name", "schema", "strict"}')
    if not (isinstance(spec.get("name"), str) and NAME.fullmatch(spec["name"])):
        refuse_format("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -")
    if not isinstance(spec.get("schema"), dict):
        refuse_format("response_format.json_schema.schema must be a JSON schema (an object)")
    if spec.get("strict") not in (None, True, False) or not isinstance(spec.get("description", ""), str):
        refuse_format("response_format.json_schema's strict must be true or false, its description a string")
    if extra := sorted(set(spec) - JSON_SCHEMA_KEYS):
        refuse_format(f"response_format.json_schema.{extra[0]} is not a field of OpenAI's json_schema")
    return spec["schema"]


def refuse_format(message):
    raise APIError(400, message, "response_format", "invalid_value")


async def compile_grammar(tokenizer, schema, param):
    """schema's grammar for tokenizer, compiled in a thread (the event loop serves the others meanwhile; a schema
    seen before comes from grammar.py's cache). 400 naming what is wrong with it: invalid, a feature llguidance does
    not support, a schema this model's vocabulary cannot write; no llguidance on this server."""
    try:
        return await asyncio.to_thread(grammar.compile_schema, tokenizer, schema)
    except ValueError as e:
        raise APIError(400, f"{param}: {first_line(e)}", param, "invalid_schema") from None
    except UserError as e:
        raise APIError(400, f"{param} is not supported by this server: {e}", param, "unsupported") from None


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
