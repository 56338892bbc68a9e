"""
A chat request's own fields, read and checked: those this server refuses or ignores (check_chat_fields), the messages
with past tool calls and their results (read_messages), response_format: plain text, any JSON object or JSON that
follows a schema (read_format), tools and tool_choice (read_tools), and so the grammar of the reply: a schema, a
call of a tool, or either a call or free text (reply_grammar), compiled by grammar.py off the event loop
(compile_grammar), a schema it cannot use a 400 naming why. What the server does not do is refused (400, code
unsupported), never ignored.
Not owned: the settings every request shares (openai_requests.py), the routes (openai_api.py), the answers and their
tool calls (openai_responses.py), grammars (grammar.py), how tools read in a prompt (chat.py).
"""

import asyncio
import json
import re

from machinery.data import chat
from machinery.errors import UserError, first_line
from machinery.generation import grammar
from machinery.serving.openai_requests import APIError, field

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> ours
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
# chat/completions fields of OpenAI's that this server does not do (the deprecated functions, audio, web search,
# reasoning): refused (400 unsupported) unless absent, null or one of the values that change nothing
CHAT_UNSUPPORTED = {"functions": ([],), "function_call": ("none",), "audio": (), "prediction": (),
                    "web_search_options": (), "reasoning_effort": (), "verbosity": (), "store": (False,),
                    "modalities": (["text"],), "service_tier": ("auto", "default")}
# ... and those that change nothing here (who the end user is, a caching hint, tags; parallel_tool_calls: a reply
# holds at most one call, which true allows and false asks): checked, then unused
CHAT_NO_OPS = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict,
               "parallel_tool_calls": bool}
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # a json_schema's (and a function's) name, as OpenAI checks it
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MAX_TOOLS = 128  # OpenAI's limit
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function's without any


def check_chat_fields(body):
    """Refuse the chat fields this server does not do (CHAT_UNSUPPORTED), check those that change nothing
    (CHAT_NO_OPS); return how many alternatives each token comes with: top_logprobs with logprobs true (0 without
    it), None without logprobs."""
    for name, no_ops in CHAT_UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in no_ops:
            raise APIError(400, f"{name} is not supported by this server; send the request without {name}"
                                + (" (tools and tool_choice call functions here)" if "function" in name else ""),
                           name, "unsupported")
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


async def compile_grammar(tokenizer, schema, or_text, param):
    """schema's grammar for tokenizer, compiled in a thread (the event loop serves the others meanwhile; a schema
    seen before comes from grammar.py's cache). 400 naming what is wrong with it: invalid, a feature llguidance does
    not support, a schema this model's vocabulary cannot write; no llguidance on this server."""
    try:
        return await asyncio.to_thread(grammar.compile_schema, tokenizer, schema, or_text)
    except ValueError as e:
        raise APIError(400, f"{param}: {first_line(e)}", param, "invalid_schema") from None
    except UserError as e:
        raise APIError(400, f"{param} is not supported by this server: {e}", param, "unsupported") from None


def read_tools(body):
    """(tools, choice, callables) of a chat request: its functions [{name, description, parameters}] (shown to the
    model), tool_choice ("none", "auto" or "required"; a function named: "required", it alone callable) and the
    [(name, parameters)] a reply may call. Without tools: ([], "none", [])."""
    tools = field(body, "tools", list, [], expect='a list of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools has {len(tools)} tools; this server takes {MAX_TOOLS} at most", "tools",
                       "limit_exceeded")
    functions = [read_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: two functions have the same name", "tools", "invalid_value")
    choice = body.get("tool_choice", None)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if choice is None:
        choice = "auto" if functions else "none"
    elif named is not None:
        if named not in names:
            raise APIError(400, f"tool_choice names the function {json.dumps(named)[:80]}, which is not among tools",
                           "tool_choice", "invalid_value")
        choice, names = "required", [named]
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            f'{{"name": ...}}}}, got {json.dumps(choice)[:80]}', "tool_choice", "invalid_value")
    if choice != "none" and not functions:
        raise APIError(400, f"tool_choice {choice} needs tools; send tools, or leave tool_choice out", "tool_choice",
                       "invalid_value")
    callables = [(f["name"], f["parameters"]) for f in functions if f["name"] in names] if choice != "none" else []
    return functions, choice, callables


def read_function(tool, i):
    """tools[i] as {name, description, parameters}: a function's (OpenAI's other kinds of tool are refused)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"{where} is of type {json.dumps(kind)[:40]}: this server calls functions only "
                            f'({{"type": "function", "function": {{"name", "description", "parameters"}}}})', "tools",
                       "unsupported" if isinstance(kind, str) else "invalid_value")
    function = tool.get("function")
    if not (isinstance(function, dict) and isinstance(function.get("name"), str) and NAME.fullmatch(function["name"])):
        raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ or -", "tools",
                       "invalid_value")
    if extra := sorted(set(function) - FUNCTION_KEYS):
        raise APIError(400, f"{where}.function.{extra[0]} is not a field of OpenAI's functions", "tools",
                       "invalid_value")
    parameters, description = function.get("parameters"), function.get("description")
    if not isinstance(parameters, (dict, type(None))) or not isinstance(description, (str, type(None))) \
            or function.get("strict") not in (None, True, False):
        raise APIError(400, f"{where}.function's parameters must be a JSON schema (an object), its description a "
                            f"string, its strict true or false", "tools", "invalid_value")
    return {"name": function["name"], **({"description": description} if description is not None else {}),
            "parameters": NO_PARAMETERS if parameters is None else parameters}


def reply_grammar(format, choice, callables, requests):
    """(the JSON schema the reply follows, or_text, the field it comes from), or None for plain text: the calls of
    callables for tool_choice required or auto (auto: or free text), else response_format's. Refused: both at once,
    and stop texts with either (a stop text could cut the JSON)."""
    if choice != "none" and format is not None:
        raise APIError(400, "response_format JSON with tools is not supported: send tool_choice none, or leave "
                            "response_format out", "response_format", "unsupported")
    calls = chat.calls_grammar(choice, callables)
    spec = (*calls, "tools") if calls is not None else (format, False, "response_format") if format is not None \
        else None
    if spec is not None and requests.stop:
        raise APIError(400, f"stop cannot be combined with {spec[2]}: a stop text inside the JSON would cut it (the "
                            f"JSON ends by itself); send one or the other", "stop", "unsupported")
    return spec


def read_messages(messages):
    """The messages of a chat request as chat.with_tools takes them: {role, content} with a string content (an
    assistant's "calls": [(name, arguments)] too, a tool's result {"role": "tool", "name", "content"}). A message's
    content is a string or a list of text parts ([{"type": "text", "text": ...}], as many chat UIs send it), joined by
    newlines. A developer message is the system message (OpenAI's name for it with newer models); a message's other
    fields are refused unless null or empty (as a client sends back a reply it was given)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages",
                       "invalid_type")
    read, called = [], {}  # (called: each earlier call's id -> its function's name)
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        content = text_of(m.get("content") if isinstance(m, dict) else None)
        if role == "tool":
            read.append(tool_result(m, i, content, called))
            continue
        calls = read_calls(m, i, called) if role == "assistant" else []
        if not (role in ROLES and (isinstance(content, str) or (calls and content is None))):
            raise APIError(400, "each message must be {\"role\": \"system\" | \"developer\" | \"user\" | "
                                "\"assistant\" | \"tool\", \"content\": a string or a list of text parts}",
                           "messages", "invalid_value")
        allowed = ("role", "content", "tool_calls") if role == "assistant" else ("role", "content")
        extra = next((k for k, v in m.items() if k not in allowed and v not in (None, [])), None)
        if extra is not None:  # a speaker's name, audio: what this server's prompts cannot say
            raise APIError(400, f"a message's {extra} is not supported by this server; send role and content only",
                           "messages", "unsupported")
        read.append({"role": ROLES[role], "content": content or "", **({"calls": calls} if calls else {})})
    return read


def text_of(content):
    """A message's content as a string: text parts joined by newlines (anything else as it is)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def read_calls(m, i, called):
    """An assistant message's tool_calls as [(name, arguments)], each call's id kept in called."""
    calls = []
    for call in m.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)):
            raise APIError(400, f"messages[{i}].tool_calls: each is {{\"id\", \"type\": \"function\", "
                                f"\"function\": {{\"name\", \"arguments\": a JSON string}}}}", "messages",
                           "invalid_value")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise APIError(400, f"messages[{i}].tool_calls: the arguments of {call['id']} are not JSON", "messages",
                           "invalid_value") from None
        called[call["id"]] = function["name"]
        calls.append((function["name"], arguments))
    return calls


def tool_result(m, i, content, called):
    """A tool message as {"role": "tool", "name", "content"}: the result of an earlier call, by its id."""
    if not isinstance(content, str) or not isinstance(m.get("tool_call_id"), str):
        raise APIError(400, f"messages[{i}]: a tool message is {{\"role\": \"tool\", \"tool_call_id\", "
                            f"\"content\": a string or a list of text parts}}", "messages", "invalid_value")
    if m["tool_call_id"] not in called:
        raise APIError(400, f"messages[{i}]: tool_call_id {json.dumps(m['tool_call_id'])[:80]} answers no earlier "
                            f"assistant message's tool call", "messages", "invalid_value")
    name = called.get(m["tool_call_id"])  # (a name, as some clients send, must be the call's)
    if extra := sorted(k for k, v in m.items() if k not in ("role", "content", "tool_call_id") and v is not None
                       and not (k == "name" and v == name)):
        raise APIError(400, f"messages[{i}]: a tool message's {extra[0]} is not supported by this server", "messages",
                       "unsupported")
    return {"role": "tool", "name": called[m["tool_call_id"]], "content": content}
