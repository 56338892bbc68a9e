"""Chat datasets (machinery/data/conversations.py): prepare.py chat writes each conversation's chat.encode ids and mask,
cuts or drops the long ones and counts them, stops on a malformed line with one line and nothing written; train.py
trains on whole conversations, one a row, with the step's loss the mean over all its target tokens (written out here
with per-token cross-entropy), resumes exactly, and 2 DDP ranks equal one process."""

import copy
import json
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (ROOT, assert_one_error_line, load_checkpoint, perturb, run_in_process, tiny_train_args,
                      train)
from machinery.data import chat, conversations
from machinery.configurator import parse
from model import GPT, GPTConfig
import prepare
from test_resume import assert_same
import train as train_script

TOKENIZER = chat.tokenizer()


def conversation(i, tagged=False):
    """A small arithmetic conversation, 1 or 2 turns, sometimes a system prompt; tagged: its user's first turn
    names i (all different)."""
    rng = random.Random(i)
    messages = [{"role": "system", "content": "Add."}] if i % 3 == 0 else []
    for turn in range(1 + i % 2):
        a, b = rng.randrange(100), rng.randrange(100)
        messages.append({"role": "user", "content": (f"#{i} " if tagged and turn == 0 else "") + f"{a}+{b}"})
        messages.append({"role": "assistant", "content": f"{a + b}" if rng.random() < 0.5 else f"{a}+{b}={a + b}"})
    return messages


def write_jsonl(path, convs, extra_lines=()):
    lines = [json.dumps({"messages": m}) for m in convs]
    for at, line in extra_lines:
        lines.insert(at, line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path, convs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": m} for m in convs]), path)
    return path


def read_split(directory, split):
    """[(ids, mask)] of a split's conversations, read from its files by hand (uint16 ids, uint8 mask, int64
    offsets)."""
    ids = np.fromfile(directory / f"{split}.bin", dtype=np.uint16).tolist()
    mask = np.fromfile(directory / f"{split}.mask", dtype=np.uint8).tolist()
    offsets = np.fromfile(directory / f"{split}.offsets", dtype="<i8").tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(offsets, offsets[1:])]


def prepare_chat(*args):
    return run_in_process(prepare.main, "chat", *args)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A chat dataset `tinychat` of 80 conversations, each at most 33 tokens (block_size 32); returns its data_dir."""
    root = tmp_path_factory.mktemp("chat")
    src = write_jsonl(root / "convs.jsonl", [conversation(i) for i in range(80)])
    prepare_chat("--input", src, "--name", "tinychat", "--data_dir", root / "data", "--max_len", 33)
    return root / "data"


# ---------------------------------------------------------------------- prepare.py chat


def test_each_conversation_is_stored_as_chat_encode_gives_it_and_the_splits_share_them_out(tmp_path):
    # a directory: JSON lines, then parquet (sorted names), read in that order
    convs = [conversation(i, tagged=True) for i in range(25)]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", convs[:15])
    write_parquet(tmp_path / "in" / "b.parquet", convs[15:])
    proc = prepare_chat("--input", tmp_path / "in", "--name", "c", "--data_dir", tmp_path / "data")
    assert proc.returncode == 0, proc.stderr
    assert "25 conversations read: 25 kept (0 of them cut" in proc.stdout

    out = tmp_path / "data" / "c"
    expected = [chat.encode(TOKENIZER, m) for m in convs]
    splits = {split: read_split(out, split) for split in ("train", "val")}
    assert len(splits["val"]) == round(25 * 0.1)  # --val_fraction 0.1
    rest = {split: list(found) for split, found in splits.items()}
    for conv in expected:  # every conversation in exactly one split, each split in the input's order
        split = next((s for s in rest if rest[s] and rest[s][0] == conv), None)
        assert split, conv
        rest[split].pop(0)
    assert rest == {"train": [], "val": []}

    saved = json.loads((out / "meta.json").read_text())
    assert saved["chat"] == chat.TEMPLATE and saved["tokenizer"] == "gpt2" and saved["vocab_size"] == 50257 + 6
    assert saved["train_tokens"] == sum(len(i) for i, _ in splits["train"])
    assert saved["max_token_id"] == max(max(i) for i, _ in expected) == chat.SPECIAL_TOKENS["<|assistant_end|>"]


def test_long_conversations_are_cut_after_an_assistant_turn_or_dropped_and_counted(tmp_path):
    turn = [{"role": "user", "content": "one two three"}, {"role": "assistant", "content": "four five six"}]
    long = turn * 3  # cut after its second assistant turn
    max_len = len(chat.encode(TOKENIZER, long[:4])[0]) + 2  # (a third turn adds 10 tokens: it does not fit)
    fits = turn + [{"role": "user", "content": "x"}]  # (ends with the user's turn: kept whole all the same)

    def said(k):
        return [{"role": "user", "content": " ".join(["seven"] * k)}, {"role": "assistant", "content": "x"}]

    exact = next(said(k) for k in range(1, max_len) if len(chat.encode(TOKENIZER, said(k))[0]) == max_len)
    too_long = [{"role": "user", "content": "word " * max_len}, {"role": "assistant", "content": "no"}]
    silent = [{"role": "system", "content": "s"}, {"role": "user", "content": "nothing answers"}]
    src = write_jsonl(tmp_path / "c.jsonl", [fits, long, too_long, silent, exact])
    proc = prepare_chat("--input", src, "--name", "c", "--data_dir", tmp_path / "data", "--max_len", max_len)
    assert proc.returncode == 0, proc.stderr
    assert (f"5 conversations read: 3 kept (1 of them cut after the last assistant turn that fits in --max_len "
            f"{max_len} tokens), 1 dropped as too long (not even the first assistant turn fits), 1 dropped without "
            f"an assistant turn") in proc.stdout
    stored = read_split(tmp_path / "data" / "c", "train") + read_split(tmp_path / "data" / "c", "val")
    assert sorted(stored) == sorted(tuple(chat.encode(TOKENIZER, m)) for m in (fits, long[:4], exact))
    assert all(len(ids) <= max_len for ids, _ in stored)


GOOD = json.dumps({"messages": conversation(1)})


@pytest.mark.parametrize("bad, says", [
    ("{not json", "line 2 is not valid JSON"),
    (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}), "line 2: \"messages\"[0] has role 'bot'"),
    (json.dumps({"messages": [{"role": "user", "content": ["hi"]}]}), "line 2: \"messages\"[0] (user) has a content"),
    (json.dumps({"messages": []}), "line 2: \"messages\" must be a non-empty list"),
    (json.dumps({"text": "no messages"}), "line 2: \"messages\" must be a non-empty list"),
    (json.dumps([1, 2]), "line 2: \"messages\" must be a non-empty list"),
], ids=["json", "role", "content", "empty", "no-messages", "not-an-object"])
def test_a_malformed_line_stops_with_one_line_naming_it_and_nothing_is_written(tmp_path, bad, says):
    data = tmp_path / "data"
    good = write_jsonl(tmp_path / "good.jsonl", [conversation(i) for i in range(10)])
    prepare_chat("--input", good, "--name", "ds", "--data_dir", data)
    before = {p.name: p.read_bytes() for p in (data / "ds").iterdir()}
    assert set(before) == {f"{s}.{x}" for s in ("train", "val") for x in ("bin", "mask", "offsets")} | {"meta.json"}

    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join([GOOD, bad, GOOD]) + "\n", encoding="utf-8")
    for name in ("ds", "new"):  # an existing dataset stays as it was; a new one is not begun
        line = assert_one_error_line(prepare_chat("--input", src, "--name", name, "--data_dir", data))
        assert f"{src} {says}" in line
    assert {p.name: p.read_bytes() for p in (data / "ds").iterdir()} == before
    assert not (data / "new").exists()
    src.write_text("\n".join([GOOD, GOOD, GOOD]) + "\n", encoding="utf-8")  # fixed, it prepares
    assert prepare_chat("--input", src, "--name", "new", "--data_dir", data).returncode == 0


def test_other_bad_inputs_stop_with_one_line(tmp_path):
    data = tmp_path / "data"
    good = write_jsonl(tmp_path / "good.jsonl", [conversation(i) for i in range(4)])
    bad_row = conversation(2)
    bad_row[0]["content"] = None  # a null in a parquet file's messages
    cases = [(["--input", write_parquet(tmp_path / "rows.parquet", [conversation(1), bad_row])], "rows.parquet row 2"),
             (["--input", good, "--tokenizer", "char"], "needs GPT-2 BPE"),
             (["--input", tmp_path / "missing.jsonl"], "does not exist"),
             (["--name", "x"], "needs --input"),
             (["--input", write_jsonl(tmp_path / "one.jsonl", [conversation(1)])], "too few")]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "text.parquet")
    cases.append((["--input", tmp_path / "text.parquet"], "no `messages` column"))
    for args, says in cases:
        assert_one_error_line(prepare_chat(*args, "--data_dir", data), says)
    assert not data.exists()


# ---------------------------------------------------------------------- batches


def test_a_row_is_one_conversation_its_targets_the_learned_tokens_or_all(chat_dir):
    stored = read_split(chat_dir / "tinychat", "train")
    for learn in conversations.LEARN:
        data = conversations.load(str(chat_dir / "tinychat"), 32, learn)
        picks = [3, 0, 7, 3]
        x, y = data.train.rows(np.array(picks), 32)
        longest = max(len(stored[i][0]) for i in picks)
        assert x.shape == y.shape == (4, min(32, -(-(longest - 1) // 16) * 16))
        for row, i in enumerate(picks):
            ids, mask = stored[i]
            n = len(ids) - 1
            assert x[row, :n].tolist() == ids[:-1] and not x[row, n:].any()  # padding: 0, never a target
            learned = [t if learn == "all" or m else -1 for t, m in zip(ids[1:], mask[1:])]
            assert y[row].tolist() == learned + [-1] * (x.shape[1] - n)
        if learn == "assistant":
            assert 0 < (y >= 0).sum() < (x.shape[0] * x.shape[1])


def test_no_conversation_attends_to_another(chat_dir):
    torch.manual_seed(0)
    model = perturb(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50304)), 0).eval()
    split = conversations.load(str(chat_dir / "tinychat"), 32).train
    a, b, c = 5, 8, 13
    n = split.offsets[a + 1] - split.offsets[a] - 1
    with torch.no_grad():
        alone = model(split.rows(np.array([a]), 32)[0][:, :n], every_position=True)[0][0]
        for other in (b, c):
            x, _ = split.rows(np.array([a, other]), 32)
            torch.testing.assert_close(model(x, every_position=True)[0][0, :n], alone, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- the step's loss


def hand_rows(convs, learn):
    """(x, y) of conversations one a row, written here from chat.encode: targets where learned, -1 elsewhere."""
    encoded = [chat.encode(TOKENIZER, m) for m in convs]
    width = max(len(ids) for ids, _ in encoded) - 1
    x, y = torch.zeros(len(convs), width, dtype=torch.long), torch.full((len(convs), width), -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(encoded):
        for t in range(len(ids) - 1):
            x[row, t] = ids[t]
            if learn == "all" or mask[t + 1]:
                y[row, t] = ids[t + 1]
    return x, y


LONG_ANSWER = [{"role": "user", "content": "Count."},
               {"role": "assistant", "content": "one two three four five six seven eight nine ten eleven"}]
MICRO_BATCHES = [[LONG_ANSWER, conversation(4)], [conversation(8), conversation(2)]]  # 14 and 8 learned tokens


def step_loss(tmp_path, chat_dir, monkeypatch, learn):
    """One optimizer step of a Trainer on MICRO_BATCHES (2 micro-batches): (its loss, the gradients it clipped,
    the model before the step)."""
    cfg = parse(train_script.TrainConfig, tiny_train_args(chat_dir, tmp_path / learn, dataset="tinychat",
                                                          batch_size=2, gradient_accumulation_steps=2,
                                                          grad_clip=1e9, chat_loss=learn))
    trainer = train_script.Trainer(cfg)
    with torch.no_grad():  # losses far apart from token to token (large logits): a mean of means is far from the mean
        perturb(trainer.raw_model, 1).tok_emb.weight.mul_(4)
    before = copy.deepcopy(trainer.raw_model)
    first, second = (hand_rows(convs, learn) for convs in MICRO_BATCHES)
    trainer.next_batch = [first, second].pop  # second, then first again as the next step's prefetch
    grads = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, *args, **kwargs):
        parameters = list(parameters)
        grads.extend(p.grad.clone() for p in parameters)
        return clip(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    loss, _, _ = trainer.optimizer_step(*first)
    trainer.out_dir_lock.release()
    return loss.item(), grads, before


@pytest.mark.parametrize("learn", conversations.LEARN)
def test_the_step_loss_is_the_mean_over_all_its_target_tokens(tmp_path, chat_dir, monkeypatch, learn):
    loss, grads, model = step_loss(tmp_path, chat_dir, monkeypatch, learn)
    # the reference: every target token's cross-entropy, one at a time, summed over both micro-batches, over
    # their number
    total, count, means = 0.0, 0, []
    for convs in MICRO_BATCHES:
        x, y = hand_rows(convs, learn)
        logits, _ = model(x, y)
        batch = [F.cross_entropy(logits[r, t][None], y[r, t][None]) for r, t in (y >= 0).nonzero().tolist()]
        total, count = total + sum(c.double() for c in batch), count + len(batch)
        means.append(sum(batch).item() / len(batch))
    reference = total / count
    reference.backward()
    # (train.py's cross-entropy sums each micro-batch's targets in float32, in another order: rel 1e-6, 1e-8 measured)
    assert loss == pytest.approx(reference.item(), rel=1e-6)
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item())
    # control: the two micro-batches hold different numbers of targets, so the mean of their means is another loss
    assert abs(sum(means) / 2 - reference.item()) > 100 * 1e-6 * loss
    if learn == "all":  # and learning every token is another loss than learning the assistant's
        other, _, _ = step_loss(tmp_path, chat_dir, monkeypatch, "assistant")
        assert abs(other - loss) > 100 * 1e-6 * loss


# ---------------------------------------------------------------------- training runs


N = 2


def logged(stdout):
    return re.findall(r"^(iter \d+: loss [^,]+|step \d+: train loss [^\n]*)", stdout, re.M)


def test_training_on_chat_data_resumes_exactly(tmp_path, chat_dir):
    def args(out, **kw):
        return tiny_train_args(chat_dir, tmp_path / out, dataset="tinychat", dropout=0.1, gradient_accumulation_steps=2,
                               batch_size=2, eval_interval=N, eval_iters=1, ckpt_interval=0, lr_decay_iters=2 * N, **kw)

    straight = train(*args("straight", max_iters=2 * N))
    first = train(*args("split", max_iters=N))
    resumed = train(*args("split", max_iters=2 * N, init_from="resume"))
    a, b = load_checkpoint(tmp_path / "straight" / "ckpt.pt"), load_checkpoint(tmp_path / "split" / "ckpt.pt")
    for key in ("model", "optimizer", "ranks"):
        assert_same(a[key], b[key], key)
    assert a["meta"]["chat"] == chat.TEMPLATE  # the checkpoint knows its format (sample.py, serve.py ask it)
    lines = logged(straight.stdout)
    assert len(lines) == 2 * N + 3 and lines[0].startswith("step 0: train loss ")
    before, after = logged(first.stdout), logged(resumed.stdout)
    assert after[0] == before[-1] and after[0].startswith(f"step {N}:")  # a resumed run evaluates first, alike
    assert lines == before + after[1:]
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    iter1 = re.search(r"^iter 1: loss ([\d.]+)", straight.stdout, re.M)[1]
    assert f"{next(r['loss'] for r in records if r['step'] == 1 and 'loss' in r):.4f}" == iter1


def test_bad_chat_settings_stop_with_one_line(tmp_path, chat_dir):
    refused = train(*tiny_train_args(chat_dir, tmp_path / "o", dataset="tinychat", chat_loss="some"), check=False)
    assert_one_error_line(refused, "chat_loss must be one of assistant, all")
    refused = train(*tiny_train_args(chat_dir, tmp_path / "o", dataset="tinychat", block_size=16), check=False)
    assert_one_error_line(refused, "more than block_size + 1 = 17", "--max_len=17")


def test_finetune_chat_preset_from_gpt2_grows_the_vocabulary_for_the_special_tokens(tmp_path, chat_dir, hf_dir):
    path, hf = hf_dir
    args = [ROOT / "config" / "finetune_chat.py", f"--init_from={path}", f"--data_dir={chat_dir}", "--dataset=tinychat",
            f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--dtype=float32", "--compile=False", "--block_size=32",
            "--batch_size=2", "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2",
            "--eval_iters=1", "--warmup_iters=1", "--lr_decay_iters=2"]
    cfg = parse(train_script.TrainConfig, [str(a) for a in args])
    trainer = train_script.Trainer(cfg)
    model = trainer.raw_model
    trainer.out_dir_lock.release()
    wte = hf.transformer.wte.weight.detach()
    assert model.tok_emb.weight.shape == (50304, 32) and model.lm_head.weight is model.tok_emb.weight
    assert torch.equal(model.tok_emb.weight[:50257].detach(), wte)
    torch.testing.assert_close(model.tok_emb.weight[50257:].detach(), wte.mean(0).expand(47, -1))
    out = train(*args)
    assert "initialized from" in out.stdout and "vocab_size=50304" in out.stdout
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["model"]["tok_emb.weight"].shape == (50304, 32)


def test_lora_on_chat_data_trains_the_special_tokens_rows_merged_on_load_and_as_peft_s_trainable_tokens(tmp_path, chat_dir, hf_dir):
    """With LoRA the embedding is frozen, but the chat format's tokens (rows that start equal: each would get the
    same logit, and the end of a turn could never be told apart) train with the adapters."""
    import export
    from machinery.weights import checkpoint, lora

    path, hf = hf_dir
    out = tmp_path / "out"
    train(ROOT / "config" / "finetune_chat.py", f"--init_from={path}", f"--data_dir={chat_dir}", "--dataset=tinychat",
          f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--compile=False", "--block_size=32",
          "--batch_size=2", "--gradient_accumulation_steps=1", "--max_iters=3", "--eval_interval=3",
          "--eval_iters=1", "--warmup_iters=1", "--lr_decay_iters=3", "--learning_rate=1e-2", "--lora_rank=4")
    ckpt = checkpoint.load(str(out / checkpoint.LATEST))
    special = sorted(chat.SPECIAL_TOKENS.values())
    assert ckpt.lora_record["tokens"] == special and ckpt.adapters["tok_emb.token_rows"].shape == (6, 32)
    merged = ckpt.build_model().eval()
    emb, wte = merged.tok_emb.weight.detach(), hf.transformer.wte.weight.detach()
    assert merged.lm_head.weight is merged.tok_emb.weight
    assert torch.equal(emb[:50257], wte)  # GPT-2's rows frozen
    torch.testing.assert_close(emb[special[-1] + 1:], wte.mean(0).expand(50304 - special[-1] - 1, -1))  # unused
    assert torch.equal(emb[special], ckpt.adapters["tok_emb.token_rows"])
    assert all(not torch.allclose(emb[i], wte.mean(0)) for i in special)  # trained away from their start
    # the merged model computes what the adapters on the base do (the rows in both the input and the output)
    unmerged = lora.load_adapters(lora.build_base(ckpt.lora_record, ckpt.model_config, "x"), ckpt.lora_record,
                                  ckpt.adapters, "x").eval()
    ids, _ = chat.encode(TOKENIZER, conversation(0))
    x = torch.tensor([ids[:32]])
    with torch.no_grad():
        torch.testing.assert_close(unmerged(x, x)[0], merged(x, x)[0], atol=1e-5, rtol=0)
    # --adapter_only: the rows as PEFT's trainable tokens, with the tokenizer that has them; peft on the base grown to
    # that tokenizer computes what the merged export does (its first 50263 logits: ours has 41 padding rows more)
    from peft import PeftModel
    from transformers import AutoTokenizer, GPT2LMHeadModel

    run_in_process(export.main, f"--out_dir={out}", "--ckpt=latest", tmp_path / "merged", check=True)
    proc = run_in_process(export.main, f"--out_dir={out}", "--ckpt=latest", "--adapter_only", tmp_path / "ad",
                          check=True)
    assert "base.resize_token_embeddings(len(" in proc.stdout
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["trainable_token_indices"] == special
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ad")
    assert len(tokenizer) == 50257 + 6
    assert tokenizer.convert_tokens_to_ids(list(chat.SPECIAL_TOKENS)) == list(chat.SPECIAL_TOKENS.values())
    base = GPT2LMHeadModel.from_pretrained(path)
    base.resize_token_embeddings(len(tokenizer))
    with_peft = PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    with torch.no_grad():
        expected = with_peft(x).logits[..., :len(tokenizer)]
        text = x[x < 50257][None]  # (the base has no chat tokens)
        assert (with_peft(text).logits[..., :50257] - hf(text).logits).abs().max() > 1e-2  # the adapters matter
        merged_hf = GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged_hf(x).logits[..., :len(tokenizer)], expected, atol=1e-5, rtol=0)


def test_two_ddp_ranks_on_chat_data_equal_one_process(tmp_path, chat_dir, zygotes):
    """2 gloo ranks, each on 2 of a step's 4 micro-batches (tests/dist_worker.py's shared stream), against one
    process on all 4: the targets are counted over both ranks (a rank's own count would give another gradient)."""
    from dist_worker import Instruments, instrumented_run
    from test_distributed import TOL, ckpt, launch, max_weight_diff, ok, report, train_args

    def args(out):
        return train_args(chat_dir, tmp_path / out, dataset="tinychat", max_iters=1, batch_size=2, eval_iters=1,
                          eval_at_start=False)

    ddp = ok(launch(args("ddp"), tmp_path / "report", SHARED_BATCHES=1, zygotes=zygotes))
    one = Instruments(shared=True, float64=True)
    alone = run_in_process(lambda argv: instrumented_run(argv, one), *args("one"), check=True)
    ranks = [report(tmp_path / "report", r) for r in (0, 1)]
    assert ranks[0]["batches"][:2] + ranks[1]["batches"][:2] == one.batches[:4]
    for r in ranks:
        assert r["grad_norms"] == pytest.approx(one.grad_norms, rel=TOL)
    assert max_weight_diff(ckpt(tmp_path / "ddp"), ckpt(tmp_path / "one")) < TOL
    # rank 0 logs the step's loss over both ranks' tokens: the one process's
    losses = [re.findall(r"^iter \d+: loss [^,]+", out.stdout, re.M) for out in (ddp, alone)]
    assert losses[0] == losses[1] and len(losses[0]) == 1
