"""eval.py: HellaSwag and the loss on a text, checked against transformers' GPT2LMHeadModel on the same
weights (a tiny random GPT-2, its parameters perturbed so that the logits are far from flat), offline.

The references below score each ending on its own (no batching, no padding), with log_softmax of
transformers' logits, so they share with eval.py only the task's definition written out here."""

import json
import math
import random
import re

import pytest
import torch

from conftest import assert_one_error_line, hf_model, run_in_process, tiny_train_args, train
import eval as evaluation
from machinery import distributed
from machinery.data import meta
from machinery.generation import loading
from machinery.training import metrics, scoring
from machinery.data.tokenizer import GPT2Tokenizer

BLOCK = 64  # n_positions of the test model
TOL = 1e-4

# varied lengths: a one-word context, endings of one to ~20 tokens, and a context longer than the model's
# 64 positions (its first tokens must go)
EXAMPLES = [
    {"ctx": "Hi", "endings": ["there.", "you are a cat sitting on the warm mat all day long, purring", "no", "x y"],
     "label": 0},
    {"ctx": "A man is sitting on a roof. He", "endings": ["is using wrap to wrap a pair of skis.",
     "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "label": 3},
    {"ctx": "The chef chops onions and", "endings": ["cries.", "puts them in a pan with butter and garlic.",
     "sings a long song about the sea, the stars, and the wind over the hills.", "leaves."], "label": 1},
    {"ctx": " ".join(["word"] * 40 + ["then", "the", "dog"] * 10),  # about 70 tokens, more than 64
     "endings": ["barked.", "ran after the ball across the green park.", "slept", "ate the whole cake quickly"],
     "label": 2},
    {"ctx": "Numbers: 1, 2, 3,", "endings": ["4, 5", "banana", "7 8 9 10 11 12", "4"], "label": 0},
    {"ctx": "Le café était fermé, alors", "endings": ["nous sommes partis.", "il pleuvait.",
     "— élan", "nothing"], "label": 1},
]


def generated_examples(n, seed=0):
    """n examples whose endings are 1, 2, 5 and 12 words long (in a random order), the right one the shortest.
    A summed loss favours short endings (every token adds its loss, several nats here), a mean per token
    does not: so acc (the sum) gets most of them right and acc_norm (the mean) about a quarter, and a
    swap of the two shows."""
    rng = random.Random(seed)
    words = "the a dog cat ran sat on mat house tree river quickly slowly green blue under over and then it was".split()
    examples = []
    for _ in range(n):
        lengths = rng.sample([1, 2, 5, 12], 4)
        ctx = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize()
        endings = [" ".join(rng.choice(words) for _ in range(k)) + "." for k in lengths]
        examples.append({"ctx": ctx, "endings": endings, "label": lengths.index(1)})
    return examples


GENERATED = generated_examples(18)
ALL = GENERATED + EXAMPLES  # 24: enough that acc and acc_norm differ (asserted where it matters)


@pytest.fixture(scope="module")
def encode():
    return GPT2Tokenizer().encode


def write_jsonl(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples), encoding="utf-8")
    return path


@torch.no_grad()
def reference_losses(hf, tokens, n_scored):
    """The cross-entropy (nats) of each of the last n_scored tokens given all the tokens before it."""
    logits = hf(torch.tensor([tokens[:-1]])).logits[0]  # row i: the prediction of tokens[i + 1]
    logp = torch.log_softmax(logits[len(tokens) - 1 - n_scored:].double(), dim=-1)  # the scored rows only
    return [-logp[j, tokens[len(tokens) - n_scored + j]].item() for j in range(n_scored)]


def reference_record(hf, encode, example, block=BLOCK):
    ctx = encode(example["ctx"])
    sums, means = [], []
    for ending in example["endings"]:
        end = encode(" " + ending)
        kept = ctx[-(block + 1 - len(end)):]  # the model reads `block` tokens: block + 1 take part
        losses = reference_losses(hf, kept + end, len(end))
        sums.append(sum(losses))
        means.append(sum(losses) / len(end))
    return {"sum": sums, "mean": means, "pred": sums.index(min(sums)), "pred_norm": means.index(min(means)),
            "label": example["label"]}


@pytest.fixture(scope="module")
def references(hf_dir, encode):
    """The reference record of each example of ALL, in order."""
    return [reference_record(hf_dir[1], encode, e) for e in ALL]


def correct_counts(refs):
    """(examples right by the lowest sum, examples right by the lowest mean) among the reference records."""
    return sum(r["pred"] == r["label"] for r in refs), sum(r["pred_norm"] == r["label"] for r in refs)


def test_hellaswag_scores_match_transformers(hf_dir, encode, references):
    path, hf = hf_dir
    assert len(encode(EXAMPLES[3]["ctx"])) > BLOCK  # the truncation case is really there
    cfg = evaluation.EvalConfig(init_from=str(path), device="cpu", dtype="float32")
    loaded = loading.load(cfg)
    model, tokenizer = loaded.model, loaded.tokenizer
    ours = scoring.hellaswag_scores(model, tokenizer.encode, ALL, "cpu")
    assert len(ours) == len(references) == 24
    assert sum(r["pred"] != r["pred_norm"] for r in references) >= 6  # the two choices often differ
    for got, want in zip(ours, references):
        assert max(want["sum"]) - min(want["sum"]) > 10 * TOL  # the choice is not a coin toss
        torch.testing.assert_close(torch.tensor(got["sum"]), torch.tensor(want["sum"]), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(got["mean"]), torch.tensor(want["mean"]), atol=TOL, rtol=0)
        assert (got["pred"], got["pred_norm"], got["label"]) == (want["pred"], want["pred_norm"], want["label"])


def test_hellaswag_accuracy_from_the_command_line(tmp_path, hf_dir, references):
    path, refs = hf_dir[0], references
    data = write_jsonl(tmp_path / "hs.jsonl", ALL)
    correct, correct_norm = correct_counts(refs)
    assert correct - correct_norm >= 4  # (as generated_examples intends): a swap of acc and acc_norm shows
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--hellaswag={data}", "--device=cpu",
                          "--dtype=float32", "--json", check=True)
    h = json.loads(proc.stdout)["hellaswag"]
    assert (h["correct"], h["correct_norm"], h["total"]) == (correct, correct_norm, 24)
    assert (h["acc"], h["acc_norm"]) == (correct / 24, correct_norm / 24)
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--hellaswag={data}", "--device=cpu",
                          "--dtype=float32", "--limit=4", check=True)  # the first 4 examples only
    correct, correct_norm = correct_counts(refs[:4])
    assert correct != correct_norm
    assert proc.stdout == f"hellaswag acc_norm {correct_norm / 4:.4f} ({correct_norm}/4), acc {correct / 4:.4f} " \
                          f"({correct}/4)\n"


def test_ranks_split_the_examples_and_run_as_many_forward_passes(hf_dir, references, monkeypatch):
    """Under torchrun (simulated here: each rank in turn, with no process group the all-reduce is left to the
    test) the ranks score
    disjoint examples that make up the whole file, and all run the same number of forward passes (with
    FSDP a forward pass is a collective): 5 examples on 2 ranks, the second rank repeats one, uncounted.
    (Generated examples, whose acc and acc_norm differ.)"""
    loaded = loading.load(evaluation.EvalConfig(init_from=str(hf_dir[0])))
    model, tokenizer = loaded.model, loaded.tokenizer
    passes = []
    model.register_forward_hook(lambda *_: passes.append(1))
    summed, per_rank = [0, 0, 0], []
    for rank in range(2):
        passes.clear()
        h = scoring.hellaswag_accuracy(model, tokenizer.encode, GENERATED[:5], "cpu",
                                       world=distributed.World(True, rank, rank, 2))
        per_rank.append((h["total"], len(passes)))
        summed = [a + b for a, b in zip(summed, (h["correct_norm"], h["correct"], h["total"]))]
    assert per_rank == [(3, 3), (2, 3)]
    correct, correct_norm = correct_counts(references[:5])  # (ALL begins with GENERATED)
    assert correct != correct_norm and summed == [correct_norm, correct, 5]


def test_text_loss_perplexity_and_bits_per_byte(tmp_path, hf_dir, encode):
    path, hf = hf_dir
    text = "Café au lait — the quick brown fox jumps over the lazy dog. " * 12  # non-ASCII: bytes != characters
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    ids = encode(text)
    assert 2 * BLOCK + 1 < len(ids) < 3 * BLOCK  # three windows, the last one short
    # the windows: ids[0:65], ids[64:129], ids[128:]: the model reads all but the last token of each and
    # predicts each one's successor, so ids[1:] is predicted exactly once
    windows = [ids[0:BLOCK + 1], ids[BLOCK:2 * BLOCK + 1], ids[2 * BLOCK:]]
    assert sum(len(w) - 1 for w in windows) == len(ids) - 1
    nats = sum(sum(reference_losses(hf, w, len(w) - 1)) for w in windows)
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--text={tmp_path / 't.txt'}", "--device=cpu",
                          "--dtype=float32", "--batch_size=2", "--json", check=True)
    t = json.loads(proc.stdout)["text"]
    assert "hellaswag" not in json.loads(proc.stdout)  # --text alone runs no HellaSwag
    assert (t["tokens"], t["predicted"], t["bytes"]) == (len(ids), len(ids) - 1, len(text.encode("utf-8")))
    assert t["bytes"] > len(text)
    assert t["loss"] == pytest.approx(nats / (len(ids) - 1), abs=TOL)
    assert t["perplexity"] == pytest.approx(math.exp(nats / (len(ids) - 1)), rel=TOL)
    assert t["bits_per_byte"] == pytest.approx(nats / math.log(2) / t["bytes"], abs=TOL)
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--text={tmp_path / 't.txt'}", "--device=cpu",
                          "--dtype=float32", check=True)
    line = re.fullmatch(r"text loss (\S+), perplexity (\S+), bits per byte (\S+) \((\d+) tokens, (\d+) bytes\)\n",
                        proc.stdout)
    assert line and [float(x) for x in line.groups()] == pytest.approx(
        [t["loss"], t["perplexity"], t["bits_per_byte"], len(ids), t["bytes"]], rel=1e-3)


@pytest.mark.parametrize("content, words", [
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n{"ctx": "a", oops}\n', ["hs.jsonl:2", "JSON"]),
    ('{"endings": ["b", "c", "d", "e"], "label": 0}\n', ["hs.jsonl:1", "ctx"]),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}\n', ["hs.jsonl:1", "4"]),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}\n', ["hs.jsonl:1", "label"]),
    ('["a list"]\n', ["hs.jsonl:1", "JSON object"]),
    ("\n", ["hs.jsonl", "no examples"]),
])
def test_malformed_hellaswag_files_are_one_line_errors(tmp_path, hf_dir, content, words):
    (tmp_path / "hs.jsonl").write_text(content, encoding="utf-8")
    proc = run_in_process(evaluation.main, f"--init_from={hf_dir[0]}", f"--hellaswag={tmp_path / 'hs.jsonl'}",
                          "--device=cpu")
    assert_one_error_line(proc, *words)


def test_bad_inputs_are_one_line_errors(tmp_path, hf_dir):
    path = hf_dir[0]
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--hellaswag={tmp_path / 'none.jsonl'}",
                          "--device=cpu")  # (pinned: on a machine with a GPU, device=auto would load it there)
    assert_one_error_line(proc, "none.jsonl", "--hellaswag")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--text={tmp_path / 'empty.txt'}", "--device=cpu")
    assert_one_error_line(proc, "empty.txt", "nothing to predict")
    proc = run_in_process(evaluation.main, f"--init_from={path}", f"--text={tmp_path / 'missing.txt'}", "--device=cpu")
    assert_one_error_line(proc, "missing.txt")
    # a character-level model (a Hugging Face directory whose meta.json says so) asked for HellaSwag
    char_dir = tmp_path / "char"
    hf_model().save_pretrained(char_dir)
    meta.write(meta.DatasetMeta(tokenizer="char", vocab_size=5, chars="abcde"), char_dir)
    data = write_jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    proc = run_in_process(evaluation.main, f"--init_from={char_dir}", f"--hellaswag={data}", "--device=cpu")
    assert_one_error_line(proc, "HellaSwag needs a GPT-2 BPE model", "char", "--text")


def test_download_once_into_the_cache_and_offline_error(tmp_path, hf_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def offline(url, timeout):
        calls.append(url)
        raise scoring.urllib.error.URLError("no network")

    monkeypatch.setattr(scoring.urllib.request, "urlopen", offline)
    proc = run_in_process(evaluation.main, f"--init_from={hf_dir[0]}", "--device=cpu")
    assert_one_error_line(proc, "cannot download HellaSwag", "--hellaswag=FILE")
    assert calls == [scoring.HELLASWAG_URL] and not (tmp_path / "data").exists()  # nothing left behind

    class Response:
        def __init__(self, data):
            self.data = data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return self.data

    content = "".join(json.dumps(e) + "\n" for e in EXAMPLES[:2]).encode()
    monkeypatch.setattr(scoring.urllib.request, "urlopen", lambda url, timeout: calls.append(url) or
                        Response(content))
    for _ in range(2):  # the second run reads the cache
        proc = run_in_process(evaluation.main, f"--init_from={hf_dir[0]}", "--device=cpu", "--json", check=True)
        assert json.loads(proc.stdout)["hellaswag"]["total"] == 2
    assert len(calls) == 2  # the failed try, then one download
    assert (tmp_path / scoring.HELLASWAG_CACHE).read_bytes() == content
    assert [p.name for p in (tmp_path / "data" / "hellaswag").iterdir()] == ["hellaswag_val.jsonl"]


# ---------------------------------------------------------------------- during training (train.py)


def test_training_measures_hellaswag_every_interval_and_at_the_end(tmp_path, hf_dir, encode, bpe_data):
    """Finetuning the transformers model with --hellaswag_interval=2 (an evaluation every step, 3 steps):
    HellaSwag at steps 0, 2 and 3 (the last), logged and recorded with that step's losses. At step 0 the
    weights are still transformers', so the figures are the reference's (at the run's block_size, 32);
    at step 3, eval.py on the final checkpoint gives the same."""
    path, hf = hf_dir
    # a context longer than the run's block_size among them, generated ones so that acc and acc_norm differ; few:
    # a CPU test
    examples = EXAMPLES[1:4] + GENERATED[:3]
    data = write_jsonl(tmp_path / "hs.jsonl", examples)
    args = tiny_train_args(bpe_data, tmp_path / "out", dataset="shakespeare", init_from=path, dtype="float32",
                           max_iters=3, eval_interval=1, eval_iters=1, hellaswag_interval=2, hellaswag=data)
    proc = train(*args, f"--hellaswag={tmp_path / 'none.jsonl'}", check=False)  # (the last --hellaswag counts)
    assert_one_error_line(proc, "none.jsonl", "--hellaswag")
    assert not (tmp_path / "out").exists()  # refused at setup, before anything was written

    proc = train(*args)
    refs = [reference_record(hf, encode, e, block=32) for e in examples]
    correct, correct_norm = correct_counts(refs)
    assert correct != correct_norm
    acc, acc_norm = correct / len(refs), correct_norm / len(refs)
    assert f"step 0: hellaswag acc_norm {acc_norm:.4f}, acc {acc:.4f} (6 examples)\n" in proc.stdout
    assert [int(n) for n in re.findall(r"^step (\d+): hellaswag ", proc.stdout, re.M)] == [0, 2, 3]
    records = metrics.read(tmp_path / "out" / metrics.FILENAME)
    measured = {r["step"]: r for r in records if "hellaswag_acc_norm" in r}
    assert sorted(measured) == [0, 2, 3] and all("val_loss" in r and "hellaswag_acc" in r for r in measured.values())
    assert (measured[0]["hellaswag_acc_norm"], measured[0]["hellaswag_acc"]) == (acc_norm, acc)
    proc = run_in_process(evaluation.main, f"--out_dir={tmp_path / 'out'}", "--ckpt=latest", f"--hellaswag={data}",
                          "--device=cpu", "--dtype=float32", "--json", check=True)
    h = json.loads(proc.stdout)["hellaswag"]
    assert (h["acc_norm"], h["acc"]) == pytest.approx((measured[3]["hellaswag_acc_norm"], measured[3]["hellaswag_acc"]))


def test_training_refuses_hellaswag_it_cannot_run(tmp_path, module_data):
    data = write_jsonl(tmp_path / "hs.jsonl", EXAMPLES)
    args = tiny_train_args(module_data, tmp_path / "out", hellaswag=data)  # character-level, eval_interval=10
    proc = train(*args, "--hellaswag_interval=10", check=False)
    assert_one_error_line(proc, "HellaSwag needs a GPT-2 BPE model", "dataset tiny", "char", "hellaswag_interval=0")
    proc = train(*args, "--hellaswag_interval=15", check=False)
    assert_one_error_line(proc, "hellaswag_interval must be a multiple of eval_interval (10), got 15")
    proc = train(*args, "--hellaswag_interval=-10", check=False)
    assert_one_error_line(proc, "hellaswag_interval must not be negative")
    assert not (tmp_path / "out").exists()
