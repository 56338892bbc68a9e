"""A model of a learned BPE (prepare.py --tokenizer=bpe) exported: Hugging Face's AutoTokenizer and llama.cpp, reading
the tokenizer from the files export.py writes, give our ids on random Unicode; the models' logits are ours."""

import copy
import importlib.util

import pytest
import torch

import export
import llama_side
import prepare
from conftest import run_in_process
from machinery.data import meta
from model import GPT, GPTConfig
from test_bpe import VOCAB, corpus, random_texts
from test_gguf import assert_llama_logits, checkpoint_of, in_llama, vectors_moved

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed: bash .ci/install-llama-cpp")


@pytest.fixture(scope="module")
def learned_model(tmp_path_factory):
    """(checkpoint directory, our tokenizer, the random model): a BPE of VOCAB tokens learned on test_bpe's corpus,
    a 2-layer model over it with its vectors moved away from their initial values (as test_gguf's)."""
    root = tmp_path_factory.mktemp("bpe_exports")
    (root / "corpus.txt").write_text(corpus(), encoding="utf-8")
    run_in_process(prepare.main, "text", "--input", root / "corpus.txt", "--name", "mine", "--tokenizer", "bpe",
                   "--vocab_size", VOCAB, "--data_dir", root / "data", check=True)
    data_meta = meta.read(str(root / "data" / "mine"))
    torch.manual_seed(3)
    model = vectors_moved(GPT(GPTConfig(block_size=64, vocab_size=data_meta.model_vocab_size, n_layer=2, n_head=4,
                                        n_embd=32, gelu="tanh")).eval())
    return checkpoint_of(model, root / "out", data_meta), data_meta.make_tokenizer(), model


def test_autotokenizer_on_the_hf_export_gives_our_ids_and_the_model_our_logits(learned_model, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    out, tok, model = learned_model
    run_in_process(export.main, f"--out_dir={out}", "--to=hf", tmp_path / "hf", check=True)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in random_texts():
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode_with_specials(text), text
        assert theirs.decode(ids) == text
    assert theirs.eos_token_id == tok.eot_token and len(theirs) == VOCAB
    idx = tok.encode(random_texts()[0])[:64]
    with torch.no_grad():
        hf_logits = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(torch.tensor([idx])).logits[0]
        ours = model(torch.tensor([idx]), every_position=True)[0][0]
    torch.testing.assert_close(hf_logits, ours, atol=1e-5, rtol=0)


@needs_llama
def test_llama_cpp_on_the_gguf_export_gives_our_ids_and_our_logits(learned_model, tmp_path):
    """The f32 file: llama.cpp's tokenizer (with specials parsed and without) and detokenizer against ours on
    random Unicode; its logits within test_gguf's bounds (1e-4 of ours with llama.cpp's table GELU, 1e-3 of our
    exact model)."""
    out, tok, model = learned_model
    run_in_process(export.main, f"--out_dir={out}", "--to=gguf", "--outtype=f32", tmp_path / "m.gguf", check=True)
    texts = [t for t in random_texts() if t]
    specials, plain, back, eos, bos = in_llama(llama_side.tokenizer, tmp_path / "m.gguf", texts,
                                               [tok.encode(t) for t in texts])
    assert plain == [tok.encode(t) for t in texts]
    assert specials == [tok.encode_with_specials(t) for t in texts]
    assert back == texts and eos == bos == tok.eot_token
    idx = tok.encode(texts[0] + texts[2])[:64]
    n_vocab, theirs = in_llama(llama_side.vocab_and_logits, tmp_path / "m.gguf", idx)
    assert n_vocab == VOCAB
    assert_llama_logits(theirs, copy.deepcopy(model), idx)
