"""A BPE learned on the dataset (prepare.py --tokenizer=bpe, machinery/data/bpe.py): exact round trips, the learner's
own encoder as the reference, the files beside meta.json, bad input, and a checkpoint that carries it; a directory
of documents (corpus.py's shards) learned on its training documents alone, trained from, and continued after a
stop."""

import base64
import hashlib
import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

import prepare
import sample
from conftest import assert_one_error_line, fake_hub, make_corpus, run_in_process, tiny_train_args, train
from machinery.data import bpe, chat, corpus as shard_corpus, documents, meta, shards
from machinery.weights import checkpoint
from machinery.data.tokenizer import EOT_TEXT, GPT2_PATTERN, parse_ranks
from model import GPT, GPTConfig
from train import TrainConfig

VOCAB = 400
POEM = "秦川雄帝宅，函谷壯皇居。綺殿千尋起，離宮百雉餘。連甍遙接漢，飛觀迥凌虛。🌙 café naïve\n"


def corpus():
    """make_corpus()'s English with Tang poetry, accents and emoji between its lines (~30k characters)."""
    lines = make_corpus().splitlines(keepends=True)
    return "".join(line + (POEM if i % 20 == 0 else "") for i, line in enumerate(lines))


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """(dataset directory, its tokenizer, rustbpe's learner given the same training text, that text)."""
    root = tmp_path_factory.mktemp("bpe")
    src = root / "corpus.txt"
    src.write_text(corpus(), encoding="utf-8")
    run_in_process(prepare.main, "text", "--input", src, "--name", "mine", "--tokenizer", "bpe", "--vocab_size",
                   VOCAB, "--data_dir", root / "data", check=True)
    directory = root / "data" / "mine"
    text = corpus()
    train_text = text[:int(len(text) * 0.9)]
    learner = bpe.train([train_text], VOCAB - len(bpe.SPECIALS))
    return directory, meta.read(str(directory)).make_tokenizer(), learner, train_text


def random_texts(n=40, seed=0):
    """Random Unicode: CJK, emoji, combining marks, ASCII and whitespace, and random bytes decoded with
    errors=replace; then paragraphs of the corpus (where the merges apply, in their order)."""
    rng = random.Random(seed)
    pools = [(0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x0300, 0x036F), (0x20, 0x7E), (0xAC00, 0xD7A3), (0x0400, 0x04FF)]
    texts = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 80)):
            lo, hi = rng.choice(pools)
            chars.append(rng.choice([chr(rng.randint(lo, hi)), " ", "\n", "\t", "  "]) if rng.random() < 0.15
                         else chr(rng.randint(lo, hi)))
        texts.append("".join(chars))
        texts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 60))).decode("utf-8", errors="replace"))
    return texts + corpus()[:4000].split("\n\n") + ["<|endoftext|> <|user_start|>", " \n\n  x  ", ""]


def test_every_text_round_trips_and_the_ids_are_rustbpes(learned):
    _, tok, learner, _ = learned
    for text in random_texts():
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == learner.encode(text), text  # the learner's own encoder: the reference
        assert all(0 <= i < tok.vocab_size - len(bpe.SPECIALS) for i in ids)  # special tokens' texts stay text


def test_the_tokenizer_file_beside_meta_json_holds_rustbpes_ranks_and_the_specials_are_the_top_ids(learned):
    directory, tok, learner, _ = learned
    saved = json.loads((directory / "meta.json").read_text())
    data = (directory / saved["tokenizer_file"]).read_bytes()
    assert saved["tokenizer"] == "bpe" and saved["vocab_size"] == VOCAB and "ranks" not in saved
    assert saved["tokenizer_sha256"] == hashlib.sha256(data).hexdigest()
    assert parse_ranks(data) == dict(learner.get_mergeable_ranks())
    assert learner.get_pattern() == GPT2_PATTERN
    assert saved["special_tokens"] == {text: VOCAB - len(bpe.SPECIALS) + i for i, text in enumerate(bpe.SPECIALS)}
    assert tok.encode_with_specials(EOT_TEXT + "<|assistant_end|>") == [VOCAB - 7, VOCAB - 1]


def test_the_token_files_decode_to_the_text_and_learned_bpe_is_shorter_than_bytes(learned):
    directory, tok, _, train_text = learned
    ids = np.fromfile(directory / "train.bin", dtype=np.uint16).tolist()
    assert tok.decode(ids) == train_text
    assert len(ids) < 0.6 * len(train_text.encode("utf-8"))


def test_a_chat_conversation_uses_the_ids_reserved_in_the_learned_vocabulary(learned):
    _, tok, _, _ = learned
    ids, mask = chat.encode(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    s = tok.specials
    assert ids == [s[EOT_TEXT], s["<|user_start|>"], *tok.encode("hi"), s["<|user_end|>"],
                   s["<|assistant_start|>"], *tok.encode("yo"), s["<|assistant_end|>"]]
    assert max(ids) < tok.vocab_size and chat.stop_token(tok) == VOCAB - 1
    assert mask == [0] * (4 + len(tok.encode("hi"))) + [1] * (len(tok.encode("yo")) + 1)


@pytest.mark.parametrize("vocab, text, says", [
    (262, "hello world " * 50, "--vocab_size 262 is outside 263..65536"),
    (65537, "hello world " * 50, "outside 263..65536"),
    (1000, "hello world " * 50, "too small to learn 737 merges: it gave only"),
    (300, "", "is empty"),
    (262, "DIR", "--vocab_size 262 is outside 263..65536"),
    (1000, "DIR", "too small to learn 737 merges: it gave only"),
    (300, "DIR of empty documents", "holds no text"),
])
def test_bad_vocabularies_and_corpora_exit_2_with_one_line_and_write_nothing(tmp_path, vocab, text, says):
    src = tmp_path / "c.txt"
    if text.startswith("DIR"):  # a directory of documents: the first validation's, the others train's
        src = tmp_path / "docs"
        src.mkdir()
        for i in range(3):
            (src / f"{i}.txt").write_text("" if "empty" in text else "hello world " * 50, encoding="utf-8")
    else:
        src.write_text(text, encoding="utf-8")
    proc = run_in_process(prepare.main, "text", "--input", src, "--name", "x", "--tokenizer", "bpe", "--vocab_size",
                          vocab, "--data_dir", tmp_path / "data")
    assert_one_error_line(proc, says)
    assert not (tmp_path / "data").exists()


def test_a_changed_tokenizer_file_is_refused_in_one_line(learned, tmp_path):
    directory, _, _, _ = learned
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    with open(copy / meta.BPE_FILENAME, "ab") as f:
        f.write(b"IQ== 400\n")
    with pytest.raises(meta.UserError, match="sha256 differs"):
        meta.read(str(copy))


def test_a_checkpoint_samples_with_its_dataset_directory_deleted(learned, tmp_path):
    directory, tok, _, _ = learned
    data_meta = meta.read(str(directory))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=data_meta.model_vocab_size, n_layer=1, n_head=2, n_embd=32))
    path = tmp_path / "best.pt"
    checkpoint.save(checkpoint.training_state(model.state_dict(), model.config, TrainConfig(), data_meta, iter_num=0,
                                              best_val_loss=float("inf")), str(path))
    assert checkpoint.load(str(path)).data_meta.same_tokens(data_meta)
    shutil.move(str(directory), str(tmp_path / "moved"))  # (put back after: the module's other tests use it)
    try:
        proc = run_in_process(sample.main, f"--out_dir={path}", "--device=cpu", "--dtype=float32", "--start=" + POEM[:5],
                              "--max_new_tokens=12", "--num_samples=1", "--temperature=0", check=True)
    finally:
        shutil.move(str(tmp_path / "moved"), str(directory))
    prompt = tok.encode(POEM[:5])
    expected = model.eval().generate(torch.tensor([prompt]), 12, temperature=0)[0].tolist()
    assert proc.stdout.split("\n---------------\n")[0] == tok.decode(expected)


@pytest.mark.parametrize("args, says", [
    (["chat", "--input", "DIR", "--tokenizer", "bpe"], "--tokenizer bpe is for `text` files"),
    (["fineweb_edu", "--input", "DIR", "--tokenizer", "char"], "not by character"),
    (["openwebtext", "--input", "DIR", "--vocab_size", "300"], "--vocab_size goes with --tokenizer bpe"),
    (["shakespeare_char", "--input", "FILE", "--tokenizer", "gpt2"], "shakespeare_char is prepared in its own"),
    (["shakespeare", "--input", "FILE", "--tokenizer", "bpe", "--vocab_size", "300"], "shakespeare is prepared in"),
    (["text", "--input", "DIR", "--name", "x", "--vocab_size", "300"], "--vocab_size goes with --tokenizer bpe"),
    (["text", "--input", "DIR", "--name", "x", "--tokenizer", "char"], "not by character"),
    (["text", "--input", "FILE", "--name", "x", "--vocab_size", "300"], "--vocab_size goes with --tokenizer bpe"),
    (["text", "--input", "FILE", "--name", "x", "--tokenizer", "bpe"], "--vocab_size goes with --tokenizer bpe"),
    (["text", "--input", "FILE", "--name", "x", "--tokenizer_chars", "5"], "--tokenizer_chars goes with --tokenizer bpe"),
    (["text", "--input", "DIR", "--name", "x", "--tokenizer_chars", "5"], "--tokenizer_chars goes with --tokenizer bpe"),
])
def test_what_a_learned_bpe_is_not_for_yet_is_refused_in_one_line(tmp_path, args, says):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "f.txt").write_text("hello world", encoding="utf-8")
    args = [{"DIR": tmp_path / "docs", "FILE": tmp_path / "f.txt"}.get(a, a) for a in args]
    proc = run_in_process(prepare.main, *args, "--data_dir", tmp_path / "data")
    assert_one_error_line(proc, says)
    assert not (tmp_path / "data").exists()


# ---------------------------------------------------------------------------- a directory of documents

SHARD = 2000  # tokens a train shard, so that train has several
GREEK = "αβγ δεζ ηθι κλμ νξο " * 60  # only in the first document, validation's


def write_documents(path):
    """.txt documents: the first (validation's) Greek, the others corpus()'s paragraphs; returns their texts."""
    paragraphs = corpus().split("\n\n")
    texts = [GREEK] + ["\n\n".join(paragraphs[i:i + 12]) for i in range(0, len(paragraphs), 12)]
    path.mkdir()
    for i, text in enumerate(texts):
        (path / f"doc_{i:02d}.txt").write_text(text, encoding="utf-8")
    return texts


@pytest.fixture(scope="module")
def learned_docs(tmp_path_factory):
    """(dataset directory, the documents' texts): `prepare.py text --input DIR --tokenizer bpe` on 2 processes."""
    root = tmp_path_factory.mktemp("bpe_docs")
    texts = write_documents(root / "docs")
    run_in_process(prepare.main, "text", "--input", root / "docs", "--name", "docs", "--tokenizer", "bpe",
                   "--vocab_size", VOCAB, "--shard_tokens", SHARD, "--num_proc", 2, "--data_dir", root / "data",
                   check=True)
    return root / "data" / "docs", texts


def written_tokenizer(directory):
    """(meta.json, tiktoken's Encoding of the tokenizer file beside it, read by hand: a token in base64 and its rank
    a line)."""
    import tiktoken

    saved = json.loads((directory / "meta.json").read_text())
    lines = (directory / saved["tokenizer_file"]).read_bytes().splitlines()
    return saved, tiktoken.Encoding("mine", pat_str=GPT2_PATTERN, special_tokens=saved["special_tokens"],
                                    mergeable_ranks={base64.b64decode(t): int(r)
                                                     for t, r in (line.split() for line in lines)})


def test_the_shards_decode_to_the_documents_with_the_tokenizer_file_read_by_tiktoken(learned_docs):
    directory, texts = learned_docs
    saved, enc = written_tokenizer(directory)
    found = shards.list_shards(str(directory))
    assert len(found["val"]) == 1 and len(found["train"]) >= 3 and saved["shards"] == 1 + len(found["train"])
    val = shards.open_tokens(found["val"][0]).tolist()
    train_ids = np.concatenate([shards.open_tokens(p) for p in found["train"]]).tolist()
    assert enc.decode(val) == EOT_TEXT + GREEK  # validation: the first document, whole, and nothing else
    assert enc.decode(train_ids) == "".join(EOT_TEXT + text for text in texts[1:])
    assert (saved["val_tokens"], saved["train_tokens"], saved["documents"]) == (len(val), len(train_ids), len(texts))
    assert saved["tokenizer"] == "bpe" and saved["vocab_size"] == VOCAB


def test_the_tokenizer_is_learned_on_the_training_documents_alone(learned_docs):
    directory, texts = learned_docs
    ranks = meta.read(str(directory)).make_tokenizer().ranks
    assert ranks == dict(bpe.train(texts[1:], VOCAB - len(bpe.SPECIALS)).get_mergeable_ranks())
    assert not any("α".encode() in token for token in ranks)  # validation's Greek was never seen...
    everything = dict(bpe.train(texts, VOCAB - len(bpe.SPECIALS)).get_mergeable_ranks())
    assert any("α".encode() in token for token in everything)  # ... where it would have been learned


def test_train_py_trains_on_the_documents_and_sample_py_samples_in_their_tokenizer(learned_docs, tmp_path):
    directory, _ = learned_docs
    out = tmp_path / "out"
    proc = train(*tiny_train_args(directory.parent, out, dataset="docs", n_layer=1, block_size=16, batch_size=2,
                                  max_iters=2, eval_interval=2, eval_iters=1, lr_decay_iters=2, warmup_iters=1))
    assert [step for step, _ in re.findall(r"^step (\d+): train loss (\S+)", proc.stdout, re.M)] == ["0", "2"]
    proc = run_in_process(sample.main, f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--start=the king",
                          "--max_new_tokens=4", "--num_samples=1", "--seed=1", check=True)
    assert proc.stdout.startswith("the king")


def test_a_stopped_preparation_of_documents_continues_to_the_same_bytes_on_one_process(learned_docs, tmp_path,
                                                                                        monkeypatch):
    directory, _ = learned_docs
    out = tmp_path / "docs"
    real, names = shard_corpus.shards.write_shard, []

    def write_two_then_stop(path, tokens):
        if len(names) == 2:
            raise KeyboardInterrupt  # the validation shard and a train shard written
        names.append(path)
        real(path, tokens)

    monkeypatch.setattr(shard_corpus.shards, "write_shard", write_two_then_stop)
    source = documents.LocalSource(directory.parent.parent / "docs")
    with pytest.raises(KeyboardInterrupt):
        shard_corpus.prepare_corpus(source, out, "docs", SHARD, 1, progress=False, vocab_size=VOCAB)
    monkeypatch.undo()
    assert not (out / "meta.json").exists() and len(names) == 2
    shard_corpus.prepare_corpus(source, out, "docs", SHARD, 1, progress=False, vocab_size=VOCAB)
    for name in sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".tiktoken")):
        assert (out / name).read_bytes() == (directory / name).read_bytes(), name


def test_a_hub_corpus_learns_its_bpe_on_its_first_training_characters_into_its_own_dataset(tmp_path, monkeypatch):
    """`prepare.py fineweb_edu --tokenizer bpe` with huggingface_hub's two calls faked (no network here): the
    tokenizer is learned on the first HUB_TOKENIZER_CHARS characters of the documents after validation's, the
    dataset is fineweb_edu_bpeN (beside a GPT-2 one), and its shards decode to the documents."""
    texts = write_documents(tmp_path / "docs")
    fake_hub(monkeypatch, tmp_path, {"sample/10BT/000_00000.parquet": texts[:9],
                                     "sample/10BT/001_00000.parquet": texts[9:]})
    monkeypatch.setattr(shard_corpus, "HUB_TOKENIZER_CHARS", 5000)
    proc = run_in_process(prepare.main, "fineweb_edu", "--tokenizer", "bpe", "--vocab_size", VOCAB, "--shard_tokens",
                          SHARD, "--num_proc", 1, "--data_dir", tmp_path / "data", check=True)
    assert "(their first 5,000 characters)" in proc.stdout
    directory = tmp_path / "data" / f"fineweb_edu_bpe{VOCAB}"
    saved, enc = written_tokenizer(directory)
    learned_on, left = [], 5000  # the training documents' first 5,000 characters
    for text in texts[1:]:
        learned_on.append(text[:left])
        left -= len(learned_on[-1])
    ranks = meta.read(str(directory)).make_tokenizer().ranks
    assert ranks == dict(bpe.train(learned_on, VOCAB - len(bpe.SPECIALS)).get_mergeable_ranks())
    found = shards.list_shards(str(directory))
    assert enc.decode(shards.open_tokens(found["val"][0]).tolist()) == EOT_TEXT + GREEK
    train_ids = np.concatenate([shards.open_tokens(p) for p in found["train"]]).tolist()
    assert enc.decode(train_ids) == "".join(EOT_TEXT + text for text in texts[1:])
    assert saved["tokenizer"] == "bpe" and saved["documents"] == len(texts)
