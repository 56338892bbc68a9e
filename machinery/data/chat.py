"""
The chat formats: how a conversation ({"role": "system" | "user" | "assistant", "content": text} messages, as OpenAI's
API, TRL and the hub's datasets write them) becomes token ids, and which of them a model learns to write. A chat
model's format (TEMPLATE, GPT-2 BPE): <|endoftext|>, then each message's content between its role's two special
tokens (spare ids of GPT-2's padded vocabulary, or the top of a BPE learned here: machinery/data/bpe.py), the content
encoded as ordinary text (a user cannot write the assistant's turn); the loss mask is 1 on the assistant's content
and its <|assistant_end|>, where a reply ends. A base model's (BASE_TEMPLATE, for serve.py's chat): the messages as a
plain dialogue, the reply ending where the next "User:" line would begin. Tools, in either (with_tools): listed in the
system message, a call the assistant's reply as compact JSON, a result a user message. The one place that writes
either: prepare.py, train.py, sample.py, serve.py and export.py (jinja_template, for apply_chat_template) ask it.
Not owned: a reply's prompt within the context and its stop tokens (machinery/generation/talk.py).
"""

import json

from machinery.errors import UserError
from machinery.data.tokenizer import GPT2_VOCAB_SIZE, GPT2Tokenizer

TEMPLATE = "gpt2-chat-1"  # the format's name, recorded in a chat dataset's metadata and its models' checkpoints
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = {f"<|{role}_{edge}|>": GPT2_VOCAB_SIZE + 2 * i + j
                  for i, role in enumerate(ROLES) for j, edge in enumerate(("start", "end"))}


def start(role):
    return f"<|{role}_start|>"


def end(role):
    return f"<|{role}_end|>"


def tokenizer(template=TEMPLATE):
    """The tokenizer of a chat model: GPT-2 BPE and the format's special tokens."""
    if template != TEMPLATE:
        raise UserError(f"unknown chat template {template!r} (this version knows {TEMPLATE}); update this code")
    return GPT2Tokenizer(SPECIAL_TOKENS)


def require(tok, what):
    """A one-line error unless tok (a tokenizer) can carry the format: a character-level vocabulary cannot."""
    if tok.kind not in ("gpt2", "bpe"):
        raise UserError(f"{what}: a chat format needs GPT-2 BPE or a BPE learned by prepare.py (its special tokens "
                        f"live in their vocabularies); this is a {tok.kind}-level tokenizer")


def check(messages, where="messages"):
    """messages, when they are a conversation: a non-empty list of {role, content} with a known role and a string
    content; else ValueError naming what is wrong (the caller says where: a file's line, a request's field)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}[{i}] has role {m.get('role') if isinstance(m, dict) else None!r}; "
                             f"a message's role is one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}] ({m['role']}) has a content that is not a string")
    return messages


def encode(tok, messages, add_generation_prompt=False):
    """(ids, mask) of a conversation: the token ids, and 1 where the model learns to write (the assistant's content
    and its end token), 0 elsewhere. add_generation_prompt: end with <|assistant_start|>, for a reply."""
    ids, mask = [tok.eot_token], [0]
    for m in check(messages):
        content = tok.encode(m["content"])  # ordinary text: a special token's text stays text
        learned = int(m["role"] == "assistant")
        ids += [tok.specials[start(m["role"])], *content, tok.specials[end(m["role"])]]
        mask += [0] + [learned] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(tok.specials[start("assistant")])
        mask.append(0)
    return ids, mask


def special_ids(template):
    """The ids of a chat format's special tokens (template: a dataset's chat format, or None: none)."""
    return sorted(tokenizer(template).specials.values()) if template else []


def stop_token(tok=None):
    """The token that ends a reply (tok: the tokenizer; None: GPT-2's)."""
    return (tok.specials if tok is not None else SPECIAL_TOKENS)[end("assistant")]


def jinja_template(mask=True):
    """The format as a Jinja chat template: Hugging Face's (tokenizer_config.json's chat_template), whose
    apply_chat_template gives encode's ids and, through its {% generation %} block, return_assistant_tokens_mask's
    mask; mask=False: without that block, which only transformers knows (plain Jinja, as llama.cpp's, refuses it)."""
    reply = "{{ message['content'] }}<|assistant_end|>"
    if mask:
        reply = "{% generation %}" + reply + "{% endgeneration %}"
    return ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant_start|>"
            + reply + "{% else %}{{ '<|' + message['role'] + '_start|>' + message['content'] + '<|' + "
            "message['role'] + '_end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant_start|>"
            "{% endif %}")


# The chat template of base models (never trained on a chat format; a chat model has its own, TEMPLATE): the messages
# as a plain dialogue, and the answer stops where the next turn would begin (BASE_STOP)
BASE_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
                 "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
BASE_STOP = "\nUser:"
_base_template = None


def base_template():
    """BASE_TEMPLATE compiled, in Jinja's sandbox (a request's messages are rendered by it)."""
    global _base_template
    if _base_template is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _base_template = ImmutableSandboxedEnvironment().from_string(BASE_TEMPLATE)
    return _base_template


# Tools (OpenAI's function calling), in either format, as text: the tools are listed at the end of the system message,
# one compact JSON line each; a call is the assistant's reply {"name":...,"arguments":...} (compact JSON, name first:
# CALL_START, the name, CALL_ARGUMENTS, the arguments, "}"); a tool's result is a user message (TOOL_RESULT)
TOOLS_INTRO = 'To call one of these tools, reply with only {"name": its name, "arguments": its arguments} as JSON:'
CALL_START, CALL_ARGUMENTS = '{"name":"', '","arguments":'
TOOL_RESULT = "The tool {name} returned: {content}"


def compact(value):
    """value as compact JSON (no whitespace: as a grammar of grammar.py writes it)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def call_schema(tools):
    """The JSON schema of one call of one of tools ([(name, parameters' JSON schema)]): its name, then its
    arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def calls_grammar(choice, tools):
    """(the JSON schema, or_text) of a reply under tool_choice `choice` (OpenAI's: none, auto, required, or a
    function's name, whose tools are then that one): a call of one of tools, or for auto a call or free text; None
    for none (plain text)."""
    return None if choice == "none" else (call_schema(tools), choice == "auto")


def parse_call(text):
    """The call that text is, whole, as call_schema's grammar writes it ({"name", "arguments"}), or None."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    return call if isinstance(call, dict) and set(call) == {"name", "arguments"} else None


def with_tools(messages, tools=()):
    """messages with tools as the formats take them ({role, content}, roles of ROLES): tools ([{name, description,
    parameters}]) listed after TOOLS_INTRO at the end of the system message (one is made where there is none), an
    assistant's calls ("calls": [(name, arguments)]) its content's lines after its text, a tool's result
    ({"role": "tool", "name", "content"}) a user message (TOOL_RESULT)."""
    plain = []
    for m in messages:
        if m["role"] == "tool":
            plain.append({"role": "user", "content": TOOL_RESULT.format(name=m["name"], content=m["content"])})
        elif m.get("calls"):
            lines = [m["content"]] if m["content"] else []
            plain.append({"role": m["role"], "content": "\n".join(
                lines + [compact({"name": name, "arguments": arguments}) for name, arguments in m["calls"]])})
        else:
            plain.append({"role": m["role"], "content": m["content"]})
    if tools:
        listed = "\n".join([TOOLS_INTRO] + [compact(tool) for tool in tools])
        if plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{listed}"}
        else:
            plain.insert(0, {"role": "system", "content": listed})
    return plain
