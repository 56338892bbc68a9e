"""
Talking to a chat model: the prompt of the assistant's next reply within the model's context, the tokens that end a
reply (serve.py's /v1/chat/completions asks for those too), and sample.py --chat's conversation in the terminal.

A chat model is one trained on a chat format (machinery/data/chat.py; its data's metadata names the format). A reply is
generated after the conversation so far, encoded by chat.encode with its generation prompt, and ends at the
assistant's end of turn. In the terminal the whole conversation stays in the context, turn after turn; when the
next prompt would leave less than a reply's room in block_size, its oldest turns are dropped (a system message
stays), and that is said once. After each reply the conversation so far is encoded into the engine's prefix cache
(Engine.cache_tail), so the next turn encodes only its new message. With tools (sample.py --chat --tools), the
model sees them as serve.py shows them (chat.with_tools), a reply follows their grammar (a call, or a call or text),
and the line typed after a call is that tool's result.
"""

import contextlib
import itertools
import sys

from machinery.data import chat
from machinery.errors import UserError
from machinery.generation.request import Request
from machinery.data.tokenizer import end_of_text_stop

PROMPT = "> "  # shown before the user's line in a terminal


def require(tokenizer, chat_format, what):
    """A one-line error unless the model was tuned on a chat format (chat_format: its data's, or None)."""
    chat.require(tokenizer, what)
    if not chat_format:
        raise UserError(f"{what}: this model was not tuned on a chat format (its data records none); finetune it "
                        f"on conversations first (prepare.py chat, then train.py), or sample text without {what}")


def stop_tokens(tokenizer):
    """The tokens that end a reply: the assistant's end of turn, and <|endoftext|> (which begins a conversation)."""
    return (chat.stop_token(tokenizer), *end_of_text_stop(tokenizer))


class Conversation:
    """The messages so far (a system message, then turns: a user's message or a tool's result, and the assistant's
    reply) and the prompt of the next reply: the latest turns that leave `room` tokens of block_size for the reply
    (the system message always stays); tools: the functions listed to the model (chat.with_tools)."""

    def __init__(self, tokenizer, block_size, room, system=None, tools=()):
        self.tokenizer, self.block_size, self.room, self.tools = tokenizer, block_size, room, tools
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns = []  # [message, assistant message] pairs, oldest first
        self.dropped = 0  # turns dropped so far, for good

    def prompt(self, asked):
        """The ids of the conversation with a new message (asked: the user's, or a tool's result) and the generation
        prompt, its oldest turns dropped while it leaves less than room tokens for the reply. UserError when the
        message does not fit the context with the system message alone (nothing is kept of it)."""
        while True:
            messages = self.system + [m for turn in self.turns for m in turn] + [asked]
            ids, _ = chat.encode(self.tokenizer, chat.with_tools(messages, self.tools), add_generation_prompt=True)
            if len(ids) + self.room <= self.block_size or not self.turns:
                break
            self.turns.pop(0)
            self.dropped += 1
        if len(ids) >= self.block_size:
            raise UserError(f"that message makes a prompt of {len(ids)} tokens and this model reads "
                            f"{self.block_size} at most (block_size); say something shorter")
        self.turns.append([asked])
        return ids

    def answered(self, text, calls=False):
        """The assistant's reply to the last prompt; with calls (tools callable), a reply that is a whole call
        becomes that call. Returns the name of the function called, or None."""
        call = chat.parse_call(text) if calls else None
        self.turns[-1].append({"role": "assistant", "content": text} if call is None else
                              {"role": "assistant", "content": None, "calls": [(call["name"], call["arguments"])]})
        return call and call["name"]


def converse(cfg, runner, tokenizer, read=input, out=None, tools=(), grammar=None):
    """sample.py --chat: read the user's lines (read(): input() in a terminal, showing PROMPT) and print each reply
    as it is generated (cfg: sample.py's settings; reply i draws with seed + i), until an empty line, Ctrl-D or
    Ctrl-C at the prompt. Ctrl-C during a reply stops it there (what was said stays in the conversation). tools:
    the functions listed to the model, grammar: its replies' (a call, or a call or text); after a call, the line
    read is that function's result."""
    out = out or sys.stdout
    block_size = runner.block_size
    conversation = Conversation(tokenizer, block_size, min(cfg.max_new_tokens, block_size // 2), cfg.system, tools)
    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    print(f"a conversation with {cfg.name}: an empty line or Ctrl-D ends it", file=sys.stderr)
    said, called = False, None
    for i in itertools.count():
        try:
            text = read((f"{called} returned> " if called else PROMPT) if tty else "")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return
        if not text.strip():
            return
        try:
            ids = conversation.prompt({"role": "tool", "name": called, "content": text} if called else
                                      {"role": "user", "content": text})
        except UserError as e:
            print(f"note: {e}", file=sys.stderr)
            continue
        if conversation.dropped and not said:
            said = True
            print(f"note: the conversation is longer than this model's context leaves room for ({block_size} "
                  f"tokens, a reply's included): its oldest turns are dropped", file=sys.stderr)
        request = Request(ids, min(cfg.max_new_tokens, block_size - len(ids)), cfg.temperature, cfg.top_k,
                          cfg.top_p, seed=cfg.seed + i, stop=(cfg.stop,) if cfg.stop else (),
                          stop_tokens=stop_tokens(tokenizer), grammar=grammar)
        called = conversation.answered(reply(runner, request, cfg.stream, out), calls=grammar is not None)
        if called:
            print(f"note: a call of {called}; type what it returned", file=sys.stderr)
        while runner.cache_tail():  # (before the next line is read: the next turn then encodes only what is new)
            pass


def reply(runner, request, stream, out):
    """Generate one reply, printed as it comes (stream) or whole; return its text. Ctrl-C stops it there."""
    generation = runner.submit(request)
    show = (lambda text: print(text, end="", flush=True, file=out)) if stream else None
    try:
        runner.run([generation], show)
    except KeyboardInterrupt:
        generation.cancel()
        runner.run([generation], show)
    print("" if stream else generation.text.text, file=out, flush=True)
    if generation.finish_reason == "length":
        print(f"note: the reply was cut at {generation.completion_tokens} tokens (max_new_tokens, or the end of "
              f"the model's context)", file=sys.stderr)
    return generation.text.text
