"""
Chat finetuning shown to work, not only to run (issue 28): `bench.py --mode=chat`.

A synthetic conversational task, generated offline and deterministic from the seed: a system prompt, then a
user who gives a list of three common words (animals or things) and asks about it (how many are animals, whether
the first or the last is one, which word came first), and 1 or 2 more questions about the same list in later
turns. Held-out conversations ask about word sets that no training conversation has: the model cannot have seen
their answers.

On it, as a user would run the commands (their main(argv), in this process, which bench.py hands over):
prepare.py and train.py pretrain a small GPT-2 BPE model on the training conversations as plain text (their
messages' contents, a line each: no roles, no special tokens; --chat_pretrain=text: on text_source, Tiny
Shakespeare, instead), export.py writes it as a Hugging Face GPT-2 directory, prepare.py chat prepares the
training conversations, and train.py finetunes that model on them, at the same steps and settings, four ways:
every weight (full) or LoRA adapters only, with the loss on the assistant's tokens only (masked,
--chat_loss=assistant) or on every token (--chat_loss=all).
Each model, and the pretrained one before any finetuning, then answers every assistant turn of the held-out
conversations (greedy, in float32, through the generation engine, the earlier turns as written): the share of
replies exactly equal to the expected one, the share that end with <|assistant_end|>, and the mean
cross-entropy over the assistant's tokens of the held-out conversations (what masked finetuning minimises).
The figures are in BENCHMARKS.md.

    python bench.py --mode=chat [--chat_pretrain=task|text] [--chat_sft_iters=400] [--n_layer=4 --n_embd=128]
"""

import json
import os
import random
import time
from dataclasses import dataclass

import torch

from benchmarks.prepare import describe_machine
from benchmarks.runs import setting_args
from machinery import configurator
from machinery.data import chat, conversations
from machinery.generation import engine, loading, packing
from machinery.errors import UserError
from machinery.generation.request import Request
from machinery.generation.calibration_cache import CalibrationCache

SYSTEM = "Answer questions about the user's list of words."
# common nouns, half of them animals, each one GPT-2 token after a space (tests/test_bench.py checks)
ANIMALS = ("dog", "cat", "fish", "bird", "horse", "cow", "pig", "sheep", "goat", "duck", "wolf", "bear", "lion",
           "tiger", "fox", "mouse", "rat", "frog", "snake", "owl", "bee", "deer", "eagle", "whale", "monkey")
THINGS = ("apple", "river", "stone", "bread", "chair", "cloud", "tree", "house", "door", "road", "book", "ship",
          "sword", "fire", "water", "salt", "milk", "gold", "glass", "paper", "rock", "sand", "snow", "rain", "star")
WORDS = ANIMALS + THINGS
COUNTS = ("None.", "One.", "Two.", "Three.")
# what a user may ask about the list: the question, and the expected reply as a function of the words. Three
# need each word's kind, read where it stands (no word to copy: answers of one token); one, to copy the first
# word out of the list (which AdamW did not learn in these budgets, and Muon does: BENCHMARKS.md)
QUESTIONS = {
    "count": ("How many of them are animals?", lambda w: COUNTS[sum(word in ANIMALS for word in w)]),
    "first animal": ("Is the first word an animal?", lambda w: "Yes." if w[0] in ANIMALS else "No."),
    "last animal": ("Is the last word an animal?", lambda w: "Yes." if w[-1] in ANIMALS else "No."),
    "first": ("Which word came first?", lambda w: f"The first word is {w[0]}."),
}
LIST_LENGTHS = (3,)

# the runs' train.py settings (the bench adds data, out_dir, steps and the schedule); train.py settings given to
# the bench (see PASSED_ON) come after them and win
PRETRAIN = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=128", "--batch_size=8",
            "--gradient_accumulation_steps=1", "--learning_rate=2e-3", "--min_lr=2e-4", "--dropout=0.0",
            "--eval_iters=20", "--log_interval=50", "--compile=False"]
# Muon (on the blocks' matrices, AdamW on the rest): with AdamW (3e-3 -> 3e-4) full finetuning was still at chance
# after 400 steps (36 % exact), with Muon it answers 82 % (BENCHMARKS.md)
FINETUNE = ["--block_size=128", "--batch_size=8", "--gradient_accumulation_steps=1", "--optimizer=muon",
            "--learning_rate=1e-2", "--min_lr=1e-3", "--dropout=0.0", "--eval_iters=10", "--log_interval=50",
            "--compile=False"]
LORA = ["--lora_rank=8", "--lora_alpha=16", "--lora_dropout=0.0", "--lora_targets=attn,proj,mlp"]
ALL_TOKENS = ["--chat_loss=all"]
VARIANTS = {  # name: (LoRA?, loss on, train.py settings on top of FINETUNE)
    "full": (False, "assistant", []),
    "full, all tokens": (False, "all", ALL_TOKENS),
    "LoRA": (True, "assistant", LORA),
    "LoRA, all tokens": (True, "all", LORA + ALL_TOKENS),
}
# bench settings passed on to train.py when given: to both phases, and to pretraining only (the model's shape;
# finetuning takes it from the weights)
PASSED_ON = ("device", "dtype", "compile", "seed", "batch_size", "block_size", "eval_iters")
PASSED_TO_PRETRAINING = ("n_layer", "n_head", "n_embd", "bias", "mlp_ratio")
MAX_EXTRA_TOKENS = 8  # a reply may run this many tokens past the expected one before it is cut (and wrong)


def conversation(rng):
    """(the words, the messages) of one conversation: a system prompt, the list and a question, then one or two
    other questions about the same list."""
    words = rng.sample(WORDS, rng.choice(LIST_LENGTHS))
    asked = rng.sample(sorted(QUESTIONS), rng.choice((2, 3)))
    messages = [{"role": "system", "content": SYSTEM}]
    for i, name in enumerate(asked):
        question, answer = QUESTIONS[name]
        text = f"Here are some words: {' '.join(words)}. {question}" if i == 0 else question
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer(words)}]
    return words, messages


def make_task(seed, n_train, n_heldout):
    """(training, held-out) conversations (lists of messages), deterministic from seed; no held-out conversation
    is about a set of words that any training conversation (or another held-out one) is about."""
    rng = random.Random(seed)
    train = [conversation(rng) for _ in range(n_train)]
    seen = {frozenset(words) for words, _ in train}
    heldout = []
    while len(heldout) < n_heldout:
        words, messages = conversation(rng)
        if frozenset(words) not in seen:
            seen.add(frozenset(words))
            heldout.append(messages)
    return [messages for _, messages in train], heldout


def write_jsonl(conversations, path):
    """The conversations as prepare.py chat reads them: JSON lines of {"messages": [...]}."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": messages}) + "\n" for messages in conversations)


@dataclass
class Result:
    """One model's figures on the held-out conversations."""
    name: str
    lora: bool
    loss_on: str  # the finetuning's loss: on the assistant's tokens, or all
    steps: int
    seconds: float  # its training's wall time
    accuracy: float = 0.0  # share of replies exactly as expected
    ended: float = 0.0  # share of replies that end with <|assistant_end|>
    loss: float = 0.0  # mean cross-entropy over the assistant's tokens
    by_question: dict = None  # exact-match share by the question asked (QUESTIONS' names)


def passed_on(cfg, names):
    """--key=value of the bench settings in names that the command line or a config file gave."""
    return setting_args(cfg, [name for name in names if name in configurator.given(cfg)])


def timed(commands, script, args):
    """Run `python SCRIPT ARGS` as commands[script] (its main), in this process; its wall time."""
    print(f"\n$ python {script} {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    commands[script](args)
    return time.perf_counter() - t0


def schedule(steps):
    """train.py's steps, schedule and evaluation for a run of `steps` steps: one evaluation, at the end."""
    return [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--warmup_iters={max(1, steps // 10)}",
            f"--eval_interval={steps}", "--eval_at_start=False", "--ckpt_interval=0"]


def plain_text(conversations):
    """The conversations as plain text: each message's content a line (the system prompt left out), a blank line
    between conversations."""
    return "\n\n".join("\n".join(m["content"] for m in messages if m["role"] != "system")
                       for messages in conversations) + "\n"


def pretrain(cfg, workdir, commands, train_set):
    """Pretrain the base model on the training conversations as plain text (or text_source); (its out_dir, a
    Hugging Face directory of it, the wall time)."""
    data, out, hf, source = (os.path.join(workdir, d) for d in ("data", "pretrained", "pretrained-hf", "task.txt"))
    if cfg.chat_pretrain == "task":
        with open(source, "w", encoding="utf-8") as f:
            f.write(plain_text(train_set))
    else:
        source = cfg.text_source
    timed(commands, "prepare.py", ["text", "--input", source, "--name", "pretrain", "--tokenizer", "gpt2",
                                   "--data_dir", data])
    seconds = timed(commands, "train.py", [*PRETRAIN, "--dataset=pretrain", f"--data_dir={data}",
                                             f"--out_dir={out}", *schedule(cfg.chat_pretrain_iters),
                                             *passed_on(cfg, PASSED_ON + PASSED_TO_PRETRAINING)])
    timed(commands, "export.py", [f"--out_dir={out}", "--ckpt=latest", hf])
    return out, hf, seconds


def finetune(cfg, workdir, commands, base, name):
    """Finetune base (a Hugging Face directory) on the chat dataset one of the VARIANTS' ways; (its out_dir, the
    Result to fill)."""
    lora, loss_on, settings = VARIANTS[name]
    out = os.path.join(workdir, "sft-" + name.replace(",", "").replace(" ", "-"))
    seconds = timed(commands, "train.py", [*FINETUNE, *settings, f"--init_from={base}", "--dataset=chat",
                                             f"--data_dir={os.path.join(workdir, 'data')}", f"--out_dir={out}",
                                             *schedule(cfg.chat_sft_iters), *passed_on(cfg, PASSED_ON)])
    return out, Result(name, lora, loss_on, cfg.chat_sft_iters, seconds)


def heldout_split(conversations_file, tok):
    """The held-out conversations (a JSON lines file) as a chat split, their loss on the assistant's tokens."""
    ids, mask, offsets, _ = conversations.encode_all(conversations_file, tok, conversations.DEFAULT_MAX_LEN)
    return conversations.ChatSplit(ids, mask, offsets, learn="assistant")


@torch.no_grad()
def masked_loss(model, split, device, batch_size=16):
    """The mean cross-entropy over every target token of a chat split (on the assistant's tokens: its content and
    <|assistant_end|>), all conversations together."""
    total, count = 0.0, 0
    for x, y in conversations.split_batches(split, batch_size, model.config.block_size, device):
        _, loss = model(x, y)
        n = int((y >= 0).sum())
        total, count = total + loss.item() * n, count + n
    return total / count


def replies(model, tok, device, turns, batch=64):
    """Each turn's greedy reply (prompt ids, expected text) through the generation engine: (text, finish_reason).
    The turns go in `batch` at a time, all prompts of a batch encoded before its rows decode together. The
    engine's calibration is this machine's file, as serve.py's: the same shapes at every evaluation, measured once."""
    runner = engine.Engine(model, tok, device, max_batch=batch, max_waiting=batch, calibration=CalibrationCache())
    answers = []
    for i in range(0, len(turns), batch):
        generations = [runner.submit(Request(ids, max_tokens=len(tok.encode(expected)) + MAX_EXTRA_TOKENS,
                                             temperature=0.0, stop_tokens=(chat.stop_token(),)))
                       for ids, expected in turns[i:i + batch]]
        while not all(g.done for g in generations):
            runner.step()
        answers += [(g.text.text, g.finish_reason) for g in generations]
    return answers


def evaluate(cfg, out_dir, heldout, split, result):
    """Fill result with the figures of out_dir's final model on the held-out conversations (split: the same as a
    chat split)."""
    loaded = loading.load(loading.ModelSource(init_from="resume", out_dir=out_dir, ckpt="latest"), cfg.device,
                          "float32")
    tok = chat.tokenizer()  # (the pretrained model's own has no chat tokens: it is asked in the same format)
    result.loss = masked_loss(loaded.model, split, loaded.device)
    turns = [(chat.encode(tok, messages[:i], add_generation_prompt=True)[0], m["content"])
             for messages in heldout for i, m in enumerate(messages) if m["role"] == "assistant"]
    asked = [next(name for name, (question, _) in QUESTIONS.items() if messages[i - 1]["content"].endswith(question))
             for messages in heldout for i, m in enumerate(messages) if m["role"] == "assistant"]
    answers = replies(packing.prepare(loaded.model, loaded.device, "float32"), tok, loaded.device, turns)
    result.accuracy = sum(text == expected for (text, _), (_, expected) in zip(answers, turns)) / len(turns)
    result.ended = sum(reason == "stop" for _, reason in answers) / len(turns)
    kinds = {}  # by the question asked: [right, asked]
    for (text, _), (_, expected), question in zip(answers, turns, asked):
        kind = kinds.setdefault(question, [0, 0])
        kind[0], kind[1] = kind[0] + (text == expected), kind[1] + 1
    result.by_question = {k: right / asked for k, (right, asked) in sorted(kinds.items())}
    print(f"{result.name}: {result.accuracy:.1%} of {len(turns)} held-out replies exact, {result.ended:.1%} end "
          f"with <|assistant_end|>, held-out masked loss {result.loss:.4f}; exact by reply: "
          f"{', '.join(f'{k} {v:.0%}' for k, v in result.by_question.items())}; e.g. {turns[0][1]!r} -> "
          f"{answers[0][0]!r}", flush=True)
    return result


def table(cfg, results, seconds):
    """The results as a markdown table, with the command, machine, torch version and the whole run's time."""
    command = " ".join(["python bench.py", *setting_args(cfg, sorted(configurator.given(cfg)))])
    lines = [f"command: `{command}`", describe_machine() + f"; torch {torch.__version__}; the whole benchmark "
             f"{seconds / 60:.1f} minutes", "",
             "| model | loss on | steps | train time | exact match | ends with <\\|assistant_end\\|> | "
             "held-out masked loss |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.name} | {r.loss_on} | {r.steps} | {r.seconds:.0f} s | {r.accuracy:.1%} | "
                     f"{r.ended:.1%} | {r.loss:.4f} |")
    return "\n".join(lines)


def bench_chat(cfg, workdir, commands):
    """The task, the pretraining, the four finetunings and their figures; returns the Results (pretrained first).
    commands: {"prepare.py": its main, "train.py": ..., "export.py": ...}."""
    if cfg.chat_pretrain == "text" and not os.path.isfile(cfg.text_source):
        raise UserError(f"--text_source {cfg.text_source} is not a file; give the text to pretrain on (Tiny "
                        f"Shakespeare: ../shared/data/tinyshakespeare/input.txt)")
    t0 = time.perf_counter()
    train_set, heldout = make_task(cfg.seed, cfg.chat_train, cfg.chat_heldout)
    path, heldout_path = (os.path.join(workdir, f"{name}.jsonl") for name in ("conversations", "heldout"))
    write_jsonl(train_set, path)
    write_jsonl(heldout, heldout_path)
    print(f"task: {len(train_set)} training and {len(heldout)} held-out conversations (word sets never trained "
          f"on), e.g. {heldout[0]}", flush=True)
    pretrained, hf, seconds = pretrain(cfg, workdir, commands, train_set)
    timed(commands, "prepare.py", ["chat", "--input", path, "--name", "chat", "--data_dir",
                                       os.path.join(workdir, "data")])
    runs = [(pretrained, Result("pretrained, no finetuning", False, "-", cfg.chat_pretrain_iters, seconds))]
    runs += [finetune(cfg, workdir, commands, hf, name) for name in VARIANTS]
    print()
    split = heldout_split(heldout_path, chat.tokenizer())
    results = [evaluate(cfg, out_dir, heldout, split, result) for out_dir, result in runs]
    print("\n" + table(cfg, results, time.perf_counter() - t0))
    return results
