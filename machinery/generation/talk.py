"""
Talking to a chat model: the prompt of the assistant's next reply within the model's context, the tokens that end a
reply (serve.py's /v1/chat/completions asks for those too), and sample.py --chat's conversation in the terminal.

A chat model is one trained on a chat format (machinery/data/chat.py; its data's metadata names the format). A reply is
generated after the conversation so far, encoded by chat.encode with its generation prompt, and ends at the
assistant's end of turn. In the terminal the whole conversation stays in the context, turn after turn; when the
next prompt would leave less than a reply's room in block_size, its oldest turns are dropped (a system message
stays), and that is said once. After each reply the conversation so far is encoded into the engine's prefix cache
(Engine.cache_tail), so the next turn encodes only its new message.
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
    """The messages so far (a system message, then user and assistant turns) and the prompt of the next reply:
    the latest turns that leave `room` tokens of block_size for the reply (the system message always stays)."""

    def __init__(self, tokenizer, block_size, room, system=None):
        self.tokenizer, self.block_size, self.room = tokenizer, block_size, room
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns = []  # [user message, assistant message] pairs, oldest first
        self.dropped = 0  # turns dropped so far, for good

    def prompt(self, text):
        """The ids of the conversation with a new user message (text) and the generation prompt, its oldest turns
        dropped while it leaves less than room tokens for the reply. UserError when the message does not fit the
        context with the system message alone (nothing is kept of it)."""
        asked = {"role": "user", "content": text}
        while True:
            messages = self.system + [m for turn in self.turns for m in turn] + [asked]
            ids, _ = chat.encode(self.tokenizer, messages, add_generation_prompt=True)
            if len(ids) + self.room <= self.block_size or not self.turns:
                break
            self.turns.pop(0)
            self.dropped += 1
        if len(ids) >= self.block_size:
            raise UserError(f"that message makes a prompt of {len(ids)} tokens and this model reads "
                            f"{self.block_size} at most (block_size); say something shorter")
        self.turns.append([asked])
        return ids

    def answered(self, text):
        """The assistant's reply to the last prompt."""
        self.turns[-1].append({"role": "assistant", "content": text})


def converse(cfg, runner, tokenizer, read=input, out=None):
    """sample.py --chat: read the user's lines (read(): input() in a terminal, showing PROMPT) and print each reply
    as it is generated (cfg: sample.py's settings; reply i draws with seed + i), until an empty line, Ctrl-D or
    Ctrl-C at the prompt. Ctrl-C during a reply stops it there (what was said stays in the conversation)."""
    out = out or sys.stdout
    block_size = runner.block_size
    conversation = Conversation(tokenizer, block_size, min(cfg.max_new_tokens, block_size // 2), cfg.system)
    shown = PROMPT if sys.stdin.isatty() else ""
    if shown:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    print(f"a conversation with {cfg.name}: an empty line or Ctrl-D ends it", file=sys.stderr)
    said = False
    for i in itertools.count():
        try:
            text = read(shown)
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return
        if not text.strip():
            return
        try:
            ids = conversation.prompt(text)
        except UserError as e:
            print(f"note: {e}", file=sys.stderr)
            continue
        if conversation.dropped and not said:
            said = True
            print(f"note: the conversation is longer than this model's context leaves room for ({block_size} "
                  f"tokens, a reply's included): its oldest turns are dropped", file=sys.stderr)
        request = Request(ids, min(cfg.max_new_tokens, block_size - len(ids)), cfg.temperature, cfg.top_k,
                          cfg.top_p, seed=cfg.seed + i, stop=(cfg.stop,) if cfg.stop else (),
                          stop_tokens=stop_tokens(tokenizer))
        conversation.answered(reply(runner, request, cfg.stream, out))
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
