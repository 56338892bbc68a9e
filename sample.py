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
The samples are generated together as one batch; the first one is printed as it
is produced (--stream), the others when the batch is done. A sample ends at
--stop (a text of any length; the text is cut where it begins), at
<|endoftext|> for GPT-2 BPE models, or after max_new_tokens.
"""

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from machinery import configurator, loading
from machinery.configurator import setting
from machinery.errors import UserError, run_main


@dataclass
class SampleConfig(loading.RunSource):
    start: str = setting("\n", "prompt text, or FILE:path to read the prompt from a file")
    num_samples: int = setting(10, "samples to draw (generated together as one batch)")
    max_new_tokens: int = setting(500, "tokens to generate per sample")
    temperature: float = setting(0.8, "0: greedy (argmax); <1 sharper, >1 more random")
    top_k: Optional[int] = setting(200, "sample only among the k most likely tokens (None: all)")
    top_p: Optional[float] = setting(None, "nucleus sampling: the smallest set of tokens with probability >= top_p")
    stop: Optional[str] = setting(None, "end each sample where it first produces this text, of any length (a "
                                        "blank line: --stop=$'\\n\\n' in bash); the text is cut there. BPE models "
                                        "also stop at <|endoftext|>")
    seed: int = setting(1337, "random seed")
    compile: bool = setting(False, "torch.compile the model")
    use_cache: bool = setting(True, "KV cache (False: re-run the whole context for every token, as nanoGPT)")
    stream: bool = setting(True, "print the first sample as it is produced (the batch is generated together: "
                                 "the other samples are printed when it is done); False: print all at the end")

    def validate(self):
        super().validate()
        for name in ("num_samples", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise UserError(f"top_k must be positive, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.stop == "":
            raise UserError("--stop is empty; give the text that ends a sample, e.g. --stop=ROMEO:")


def read_prompt(start):
    if start.startswith("FILE:"):
        path = start[len("FILE:"):]
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the prompt file {path}: {getattr(e, 'strerror', None) or e}") from None
    return start


class SampleText:
    """The generated text of one sample as its tokens arrive.

    A sample is done at one of stop_tokens (not part of the text) or where stop_text
    first appears (the text is cut there). add() returns the text that has become
    final, for streaming: it holds back an incomplete UTF-8 character (BPE tokens can
    split one) and a tail that may turn out to be the start of stop_text, so what is
    streamed is always a prefix of the final text, and all of it once finish() is called.
    """

    def __init__(self, tokenizer, stop_text=None, stop_tokens=()):
        self.tokenizer = tokenizer
        self.stop_text = stop_text
        self.stop_tokens = set(stop_tokens)
        self.ids = []
        self.text = ""  # the decoded text, cut at stop_text
        self.done = False
        self.emitted = 0  # characters of text handed out so far

    def add(self, token_id):
        """Take the next token; return the newly final text."""
        if self.done:
            return ""
        if token_id in self.stop_tokens:
            return self.finish()
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids)
        cut = self.text.find(self.stop_text) if self.stop_text else -1
        if cut >= 0:
            self.text = self.text[:cut]
            return self.finish()
        return self._take(len(self.text) - self._undecided())

    def finish(self):
        """End the sample; return the text not handed out yet."""
        self.done = True
        return self._take(len(self.text))

    def _undecided(self):
        """Characters at the end of text that a later token may still change or cut."""
        text = self.text.rstrip("\ufffd")  # bytes of a character still to come
        held = len(self.text) - len(text)
        stop = self.stop_text or ""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):  # the longest tail that begins stop
            if text.endswith(stop[:n]):
                return held + n
        return held

    def _take(self, end):
        new = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return new


def encode(tokenizer, text, what):
    """Token ids of text; a character outside a char-level vocabulary is an error naming `what`."""
    try:
        return tokenizer.encode(text)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


def main(argv=None):
    cfg = configurator.parse(SampleConfig, argv, usage="python sample.py [--key=value ...]", extra_files_ok=False)
    cfg.validate()
    loaded = loading.load_run(cfg)
    model, tokenizer = loaded.model, loaded.tokenizer
    if cfg.compile:
        # in place, so that generate's calls to the model run compiled (torch.compile(model) would return
        # a wrapper whose generate calls the original); dynamic shapes: no recompile per prompt length
        model.compile(dynamic=True)
    prompt = read_prompt(cfg.start)
    if not prompt:
        raise UserError("the prompt is empty; give some text with --start")
    ids = encode(tokenizer, prompt, "--start")
    block_size = model.config.block_size
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids)} tokens; keeping its last {block_size} (block_size)", file=sys.stderr)
        ids = ids[-block_size:]
    if cfg.stop is not None:
        encode(tokenizer, cfg.stop, "--stop")  # text the model cannot produce would never stop a sample
    with torch.no_grad(), loaded.autocast:
        print_samples(cfg, model, tokenizer, prompt, torch.tensor(ids, dtype=torch.long, device=loaded.device))


def print_samples(cfg, model, tokenizer, prompt, ids):
    """Generate num_samples continuations of ids as one batch; stream the first, then print them all."""
    stop_tokens = [tokenizer.eot_token] if tokenizer.eot_token is not None else None
    torch.manual_seed(cfg.seed)
    generator = torch.Generator(device=ids.device).manual_seed(cfg.seed)
    samples = [SampleText(tokenizer, cfg.stop, stop_tokens or ()) for _ in range(cfg.num_samples)]
    if cfg.stream:
        print(prompt, end="", flush=True)
    for tok in model.generate_stream(ids[None].repeat(cfg.num_samples, 1), cfg.max_new_tokens, cfg.temperature,
                                     cfg.top_k, cfg.top_p, stop_tokens, generator, cfg.use_cache,
                                     vocab_size=tokenizer.vocab_size):
        pieces = [sample.add(t) for sample, t in zip(samples, tok.tolist())]
        if cfg.stream and pieces[0]:
            print(pieces[0], end="", flush=True)
        if all(sample.done for sample in samples):
            break  # every sample met its stop text (stop tokens end generate_stream itself)
    for i, sample in enumerate(samples):
        rest = sample.finish()
        print(rest if cfg.stream and i == 0 else prompt + sample.text)
        print("---------------")


if __name__ == "__main__":
    run_main(main)
