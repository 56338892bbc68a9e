"""
Judge a model: HellaSwag accuracy, and the loss on any text file.

    python eval.py --out_dir=out-owt                       # HellaSwag of a checkpoint (best.pt)
    python eval.py --init_from=gpt2 --hellaswag=hellaswag_val.jsonl
    python eval.py --out_dir=out-shakespeare-char --text=input.txt --json

HellaSwag: the validation split (10,042 examples), each ending scored as a continuation of the context;
acc picks the ending with the lowest summed loss, acc_norm the lowest mean loss per token (machinery/
scoring.py says exactly how). Give a local copy of rowanz's hellaswag_val.jsonl with --hellaswag=FILE,
or it is downloaded once into data/hellaswag/. Only GPT-2 BPE models can take it.

--text=FILE: the loss (mean next-token cross-entropy, in nats), perplexity and bits per byte of
the model on a UTF-8 text (see scoring.text_loss for the windows). Bits per byte divides by the text's
size in bytes instead of its tokens, so models with different tokenizers compare.

Under torchrun the examples (and text windows) are split over the processes and the counts summed.
"""

import json
import math
import sys
from dataclasses import dataclass
from typing import Optional

import machinery.torch_import  # noqa: F401  (first: torch imported with the collector paused, a faster start)
from machinery import configurator, distributed
from machinery.generation import loading
from machinery.training import scoring
from machinery.configurator import setting
from machinery.errors import UserError, run_main
from machinery.fileio import read_text
from machinery.weights.quantize import quantize


@dataclass
class EvalConfig(loading.RunSource):
    hellaswag: Optional[str] = setting(None, "HellaSwag data: a hellaswag_val.jsonl, or auto (downloaded once "
                                             f"into {scoring.HELLASWAG_CACHE}); None: auto unless --text is given")
    limit: Optional[int] = setting(None, "evaluate only the first N HellaSwag examples (None: all)")
    text: Optional[str] = setting(None, "a UTF-8 text file: report the model's loss, perplexity and bits per "
                                        "byte on it")
    batch_size: int = setting(8, "text windows per forward pass (--text)")
    json: bool = setting(False, "print one JSON object instead of one line per figure")

    def validate(self):
        super().validate()
        configurator.check_positive(self, "limit", "batch_size")

    @property
    def runs_hellaswag(self):
        return self.hellaswag is not None or self.text is None


def text_figures(loaded, path, batch_size, world):
    """Loss, perplexity and bits per byte of the model on the text file at path."""
    text = read_text(path, "--text", "give a UTF-8 text file")
    try:
        ids = loaded.tokenizer.encode(text)
    except UserError as e:  # a character outside a char-level model's vocabulary
        raise UserError(f"--text {path}: {e}") from None
    if len(ids) < 2:
        raise UserError(f"--text {path} has {len(ids)} token(s): nothing to predict; give a longer text")
    nats, predicted = scoring.text_loss(loaded.model, ids, loaded.device, loaded.autocast, batch_size, world)
    n_bytes = len(text.encode("utf-8"))
    # bits per byte: every byte of the text counts, those of the first (unpredicted) token too
    return {"loss": nats / predicted, "perplexity": math.exp(nats / predicted),
            "bits_per_byte": nats / math.log(2) / n_bytes, "tokens": len(ids), "predicted": predicted,
            "bytes": n_bytes}


# ---------------------------------------------------------------------- the script


def evaluate(cfg, world, device):
    """The figures cfg asks for, as a dict: {"hellaswag": {...}, "text": {...}}."""
    loaded = loading.load(cfg, device, cfg.dtype)
    quantize(loaded.model, cfg.quantize)  # --quantize=int8: the int8 weights that decoding runs with
    results = {"model": cfg.name, "dtype": loaded.dtype}
    if cfg.runs_hellaswag:
        scoring.require_gpt2(loaded.tokenizer.kind, "this model", "evaluate it with --text=FILE instead")
        examples = scoring.load_hellaswag(scoring.hellaswag_path(cfg.hellaswag))[:cfg.limit]
        results["hellaswag"] = scoring.hellaswag_accuracy(loaded.model, loaded.tokenizer.encode, examples,
                                                          loaded.device, loaded.autocast, world)
    if cfg.text is not None:
        results["text"] = text_figures(loaded, cfg.text, cfg.batch_size, world)
    return results


def report(results, as_json):
    if as_json:
        print(json.dumps(results))
        return
    if "hellaswag" in results:
        h = results["hellaswag"]
        print(f"hellaswag acc_norm {h['acc_norm']:.4f} ({h['correct_norm']}/{h['total']}), "
              f"acc {h['acc']:.4f} ({h['correct']}/{h['total']})")
    if "text" in results:
        t = results["text"]
        print(f"text loss {t['loss']:.4f}, perplexity {t['perplexity']:.2f}, bits per byte "
              f"{t['bits_per_byte']:.4f} ({t['tokens']} tokens, {t['bytes']} bytes)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # `--json` alone asks for JSON, as scripts expect (the configurator takes --key=value only)
    argv = ["--json=True" if a == "--json" else a for a in argv]
    cfg = configurator.parse(EvalConfig, argv, usage="python eval.py [config_file ...] [--key=value ...] [--json]")
    cfg.validate()
    world, device = distributed.setup(cfg.device)
    finished = False
    try:
        results = evaluate(cfg, world, device)
        finished = True
    finally:
        distributed.teardown(finished)
    if world.is_master:
        report(results, cfg.json)


if __name__ == "__main__":
    run_main(main)
