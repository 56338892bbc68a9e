"""
Sample text from a trained model:

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3
    python sample.py --init_from=gpt2-xl --start="What is the answer to life?"

The checkpoint (out_dir/best.pt, or ckpt.pt before any improvement) carries its
tokenizer, so the text is encoded and decoded the way the training data was.
nanoGPT's ckpt.pt carries none: its data/<dataset>/meta.json is used when there is
one, else GPT-2 BPE (--meta picks one). With --init_from, OpenAI's GPT-2 weights
(from the local Hugging Face cache) or a Hugging Face GPT-2 directory sample with
GPT-2 BPE.
The samples are generated together, by the generation engine (machinery/generation/engine.py,
the one serve.py uses: sample i draws with seed + i, and its text does not depend
on the others); the first one is printed as it is produced (--stream), the others
when they are done; stderr then says the decoding rate, after each sample's first two tokens
(the prompt's pass, and the first step, which captures CUDA's graph). A sample ends at --stop
(a text of any length; the text is cut where it begins), at <|endoftext|> for GPT-2 BPE
models, or after max_new_tokens.

A chat model (one finetuned on conversations: prepare.py chat) is talked to instead:

    python sample.py --out_dir=out-chat --chat [--system="You are terse."]

each line typed is the user's turn, the reply streams back, and the conversation stays in
the context (machinery/generation/talk.py: each turn encodes only its new message, the rest is
taken from the engine's prefix cache, --prefix_cache_mb); an empty line or Ctrl-D ends it.
With --tools=FILE (OpenAI's tools, as serve.py takes them) its replies may call them; the line
typed after a call is what the tool returned.
"""

import sys
import time
from dataclasses import dataclass
from typing import Optional

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)
from machinery import configurator
from machinery.data import chat
from machinery.generation import decode_attention, engine, grammar, loading, packing, talk
from machinery.generation.calibration_cache import CalibrationCache
from machinery.configurator import setting
from machinery.errors import UserError, exit_without_teardown, run_main
from machinery.fileio import read_json_object, read_text
from machinery.hardware import describe
from machinery.generation.request import Request
from machinery.serving import openai_chat, openai_requests
from machinery.data.tokenizer import end_of_text_stop

WARM_TOKENS = 2  # a sample's tokens before its decoding rate is timed: the prompt's pass, CUDA graph's capture


@dataclass
class SampleConfig(loading.EngineSource):
    start: str = setting("\n", "prompt text, or FILE:path to read the prompt from a file")
    num_samples: int = setting(10, "samples to draw (generated together)")
    max_new_tokens: int = setting(500, "tokens to generate per sample")
    temperature: float = setting(0.8, "0: greedy (argmax); <1 sharper, >1 more random")
    top_k: Optional[int] = setting(200, "sample only among the k most likely tokens (None: all)")
    top_p: Optional[float] = setting(None, "nucleus sampling: the smallest set of tokens with probability >= top_p")
    stop: Optional[str] = setting(None, "end each sample where it first produces this text, of any length (a "
                                        "blank line: --stop=$'\\n\\n' in bash); the text is cut there. BPE models "
                                        "also stop at <|endoftext|>")
    seed: int = setting(1337, "random seed")
    use_cache: bool = setting(True, "KV cache (False: re-run the whole context for every token, as nanoGPT)")
    stream: bool = setting(True, "print the first sample as it is produced (the batch is generated together: "
                                 "the other samples are printed when it is done); False: print all at the end")
    chat: bool = setting(False, "talk with a chat model in the terminal: a line typed is your turn, the reply "
                                "streams back, the conversation stays in the context (its oldest turns dropped "
                                "when it is full); an empty line or Ctrl-D ends it")
    system: Optional[str] = setting(None, "--chat: the system message the conversation begins with")
    tools: Optional[str] = setting(None, "--chat: a JSON file of the tools the model may call, as OpenAI's API takes "
                                         "them ([{\"type\": \"function\", \"function\": {\"name\", "
                                         "\"description\", \"parameters\"}}]); a call is compact JSON by "
                                         "constrained decoding (needs llguidance), and the line you type after it "
                                         "is what the tool returned")
    tool_choice: str = setting("auto", "--tools: auto (a call or text), required (a call), none, or a function's "
                                       "name (a call of it), as OpenAI's tool_choice")
    json_schema: Optional[str] = setting(None, "each sample is JSON that follows the JSON schema in this file (or "
                                               "'object': any JSON object), compact, by constrained decoding "
                                               "(needs llguidance)")

    def validate(self):
        super().validate()
        configurator.check_positive(self, "num_samples", "max_new_tokens", "top_k")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.stop == "":
            raise UserError("--stop is empty; give the text that ends a sample, e.g. --stop=ROMEO:")
        given = configurator.given(self)
        if self.chat and given & {"start", "num_samples"}:
            raise UserError(f"--{min(given & {'start', 'num_samples'})} does not apply to --chat (you type the "
                            f"user's turns, one reply each); leave it out")
        if self.system is not None and not self.chat:
            raise UserError("--system is the system message of a conversation; add --chat")
        if (self.tools is not None or "tool_choice" in given) and not self.chat:
            raise UserError("--tools and --tool_choice are for a conversation's replies; add --chat")
        if "tool_choice" in given and self.tools is None:
            raise UserError("--tool_choice needs --tools (a JSON file of the tools the model may call)")
        if self.tools is not None and self.stop is not None and self.tool_choice != "none":
            raise UserError("--stop cannot be combined with --tools: a stop text inside a call's JSON would cut it "
                            "(a call ends by itself); leave one out")
        if self.json_schema is not None and self.chat:
            raise UserError("--json_schema does not apply to --chat yet; sample without --chat")


def read_prompt(start):
    if start.startswith("FILE:"):
        return read_text(start[len("FILE:"):], "the prompt file", "give a UTF-8 text file after --start=FILE:")
    return start


def encode(tokenizer, text, what):
    """Token ids of text; a character outside a char-level vocabulary is an error naming `what`."""
    try:
        return tokenizer.encode(text)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


def main(argv=None):
    cfg = configurator.parse(SampleConfig, argv, usage="python sample.py [--key=value ...]", extra_files_ok=False)
    cfg.validate()
    tools, choice, callables = read_tools(cfg.tools, cfg.tool_choice)  # (before the model: a bad file fails first)
    loaded = loading.load_run(cfg)
    tokenizer = loaded.tokenizer
    if cfg.chat:
        talk.require(tokenizer, loaded.data_meta.chat, "--chat")
    else:
        prompt, ids = read_start(cfg, tokenizer, loaded.model.config.block_size)
    if cfg.stop is not None:
        encode(tokenizer, cfg.stop, "--stop")  # text the model cannot produce would never stop a sample
    schema = read_schema(cfg.json_schema, tokenizer) if cfg.json_schema is not None else None
    rows = 1 if cfg.chat else cfg.num_samples  # (decoded together: the engine's rows)
    model = packing.prepare(loaded.model, loaded.device, loaded.dtype, compile=cfg.compile, quantize=cfg.quantize)
    print(describe(loaded.device, loaded.dtype), file=sys.stderr)  # (stdout is the samples' alone)
    runner = engine.Engine(model, tokenizer, loaded.device, max_batch=rows,
                           use_cache=cfg.use_cache, compile=cfg.compile, prefix_cache_mb=cfg.prefix_cache_mb,
                           calibration=CalibrationCache(), ahead=cfg.decode_ahead,
                           decode_attention=decode_attention.default(cfg.decode_attention, loaded.device, False))
    if cfg.chat:
        talk.converse(cfg, runner, tokenizer, tools=tools, grammar=reply_grammar(tokenizer, choice, callables))
    else:
        print_samples(cfg, runner, tokenizer, prompt, ids, schema)


def read_start(cfg, tokenizer, block_size):
    """The prompt (--start) and its ids, the last block_size of them (said on stderr when it is longer)."""
    prompt = read_prompt(cfg.start)
    if not prompt:
        raise UserError("the prompt is empty; give some text with --start")
    ids = encode(tokenizer, prompt, "--start")
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids)} tokens; keeping its last {block_size} (block_size)", file=sys.stderr)
        ids = ids[-block_size:]
    return prompt, ids


def read_schema(path, tokenizer):
    """--json_schema's grammar: the JSON schema in the file at path ('object': any JSON object), compiled; a
    one-line error for a file that is not one, or a schema that is invalid or needs what llguidance lacks."""
    schema = grammar.ANY_OBJECT if path == "object" else \
        read_json_object(path, "; give a JSON schema file after --json_schema=, or 'object' (any JSON object)")
    try:
        return grammar.compile_schema(tokenizer, schema)
    except ValueError as e:
        raise UserError(f"--json_schema: {e}") from None


def read_tools(path, choice):
    """--tools and --tool_choice as serve.py reads a chat request's (openai_chat.read_tools): (the functions shown to
    the model, tool_choice, the [(name, parameters)] a reply may call); ([], "none", []) without --tools. A one-line
    error for a file or a choice that is not one."""
    if path is None:
        return [], "none", []
    tools = read_json_object(path, '; give --tools a JSON file of a list of {"type": "function", "function": {...}}',
                             kind=list)
    named = {"type": "function", "function": {"name": choice}} if choice not in ("auto", "required", "none") \
        else choice
    try:
        return openai_chat.read_tools({"tools": tools, "tool_choice": named})
    except openai_requests.APIError as e:
        raise UserError(f"--tools: {e}") from None


def reply_grammar(tokenizer, choice, callables):
    """The grammar of a reply that may call callables: a call (tool_choice required), a call or text (auto); None
    for none. A one-line error for a function's parameters that are no schema llguidance takes."""
    spec = chat.calls_grammar(choice, callables)
    if spec is None:
        return None
    try:
        return grammar.compile_schema(tokenizer, *spec)
    except ValueError as e:
        raise UserError(f"--tools: a function's parameters: {e}") from None


def print_samples(cfg, runner, tokenizer, prompt, ids, schema=None):
    """Generate num_samples continuations of ids together (sample i with seed + i), each following schema (a
    grammar) when given; stream the first as its text becomes final, then print the others."""
    stop, stop_tokens = (cfg.stop,) if cfg.stop else (), end_of_text_stop(tokenizer)
    samples = [runner.submit(Request(ids, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                     seed=cfg.seed + i, stop=stop, stop_tokens=stop_tokens, grammar=schema))
               for i in range(cfg.num_samples)]
    if cfg.stream:
        print(prompt, end="", flush=True)
    show = (lambda text: print(text, end="", flush=True)) if cfg.stream else None
    # the prompt's pass, then the first decoding step (CUDA's graph captured): not timed
    runner.run(samples, show, until=lambda: all(g.done or g.completion_tokens >= WARM_TOKENS for g in samples))
    warm, t0 = sum(g.completion_tokens for g in samples), time.perf_counter()
    runner.run(samples, show)
    seconds, decoded = time.perf_counter() - t0, sum(g.completion_tokens for g in samples) - warm
    for i, sample in enumerate(samples):
        print("" if cfg.stream and i == 0 else prompt + sample.text.text)
        print("---------------")
    for i, sample in enumerate(samples):
        if sample.error:  # (a schema that the vocabulary cannot finish)
            print(f"note: sample {i + 1} ended early: {sample.error}", file=sys.stderr)
    if decoded > 0:
        print(f"decoded {decoded:,} tokens in {seconds:.3f} s: {decoded / seconds:,.1f} tokens/s (after each "
              f"sample's first {WARM_TOKENS})", file=sys.stderr)
    cut = [str(i + 1) for i, sample in enumerate(samples) if schema is not None and sample.finish_reason == "length"]
    if cut:
        print(f"note: sample {', '.join(cut)} reached max_new_tokens before its JSON was complete", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
    exit_without_teardown()  # (0.4 s of Python's teardown of torch, for a command that is done)
