"""Hugging Face GPT-2 checkpoints in and out (convert.py: load_hf, to_hf; export.py), offline, fp32.

A tiny random GPT2LMHeadModel from `transformers` (a test-only dependency) stands in for
OpenAI's weights. Its parameters are perturbed well away from their initial values (LayerNorm
gains 1, biases 0, small matrices), so that a mistake (an untransposed square Conv1D matrix,
a bias left out, the wrong GELU) moves the logits far more than the 1e-4 tolerance.
"""

import hashlib
import http.server
import json
import shutil
import sys
import threading

import huggingface_hub
import pytest
import torch

from transformers import GPT2LMHeadModel

from conftest import assert_one_error_line, assert_one_line, finetune_args, hf_model, make_corpus, perturb
from conftest import run_in_process
from conftest import train as train_in_process
import export
from machinery.generation import packing
from machinery import gpt2_weights
from machinery.weights import checkpoint, convert
from machinery.configurator import parse
from machinery.errors import UserError
from machinery.data.meta import DatasetMeta
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from model import GPT, GPTConfig
import sample
import train

VOCAB = 50257
TOL = 1e-4  # fp32; the two implementations differ in summation order (and tanh-GELU formula) only


def tokens(seed=0, T=64):
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def our_logits(model, idx):
    logits, _ = model.eval()(idx, idx)  # with targets: the logits of every position
    return logits


@torch.no_grad()
def hf_logits(model, idx):
    return model.eval()(idx).logits


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The two requests huggingface_hub's hf_hub_download makes of the Hugging Face Hub for a file (HEAD: its commit,
    ETag and size; GET: its bytes), answered from one local directory (self.server.directory), at commit COMMIT."""
    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body):
        data = (self.server.directory / self.path.rsplit("/", 1)[-1]).read_bytes()  # /<repo>/resolve/main/<file>
        self.send_response(200)
        for header, value in (("X-Repo-Commit", self.COMMIT), ("ETag", f'"{hashlib.sha256(data).hexdigest()}"'),
                              ("Content-Length", str(len(data)))):
            self.send_header(header, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that huggingface_hub uses (HF_HUB_CACHE, as a user sets it, and the constant
    huggingface_hub read from it when it was imported), and a function that downloads a directory's files into it
    as a hub repository, through huggingface_hub's own hf_hub_download from a local FakeHub: the cache's layout
    (blobs, snapshots of symlinks, refs/main) is the library's, not this project's idea of it."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def download(directory, repo_id, files=("config.json", "model.safetensors")):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
        server.directory = directory
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            for name in files:
                huggingface_hub.hf_hub_download(repo_id, name, cache_dir=cache, etag_timeout=30,
                                                endpoint=f"http://127.0.0.1:{server.server_port}")
        finally:
            server.shutdown()
            thread.join(timeout=30)

    return download


# ---------------------------------------------------------------------- loading


def test_load_hf_safetensors_matches_transformers(hf_dir):
    path, hf = hf_dir
    ours = convert.load_hf(str(path))
    assert ours.config == GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32,
                                    dropout=0.0, bias=True, gelu="tanh")
    idx = tokens()
    expected = hf_logits(hf, idx)
    assert expected.std() > 1.0  # logits large enough for 1e-4 to be a real test
    torch.testing.assert_close(our_logits(ours, idx), expected, atol=TOL, rtol=0)


def test_gpt_from_pretrained_as_nanogpt_users_call_it(hf_dir, hub_cache):
    """nanoGPT's API, `from model import GPT; GPT.from_pretrained(...)`, with a Hugging Face directory's path or
    a GPT-2 size (here from a Hugging Face cache that huggingface_hub wrote): transformers' logits. (model.py imports
    nothing of ours: tests/test_layout.py.)"""
    from model import GPT

    path, hf = hf_dir
    idx = tokens(7)
    model = GPT.from_pretrained(str(path))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(hf, idx), atol=TOL, rtol=0)
    # as nanoGPT's sample.py and train.py call it: override_args, which may set dropout only
    model = GPT.from_pretrained(str(path), dict(dropout=0.0))
    torch.testing.assert_close(our_logits(model, idx), hf_logits(hf, idx), atol=TOL, rtol=0)
    assert GPT.from_pretrained(str(path), override_args=dict(dropout=0.1)).config.dropout == 0.1
    with pytest.raises(ValueError, match=r"override_args may only set dropout, got \['n_layer'\]"):
        GPT.from_pretrained(str(path), dict(n_layer=1))

    hub_cache(path, "openai-community/gpt2")
    torch.testing.assert_close(our_logits(GPT.from_pretrained("gpt2"), idx), hf_logits(hf, idx), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="gpt2-xl is not in the local Hugging Face cache"):
        GPT.from_pretrained("gpt2-xl")


def test_load_hf_pytorch_model_bin_in_openai_layout(tmp_path, hf_dir):
    """pytorch_model.bin as in OpenAI's original gpt2 upload: GPT2Model keys (no `transformer.`),
    causal-mask buffers, no lm_head. transformers 5 no longer writes .bin files, so write it here."""
    path, hf = hf_dir
    out = tmp_path / "bin"
    out.mkdir()
    shutil.copy(path / "config.json", out / "config.json")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, out / "pytorch_model.bin")
    ours = convert.load_hf(str(out))
    idx = tokens(1)
    torch.testing.assert_close(our_logits(ours, idx), hf_logits(hf, idx), atol=TOL, rtol=0)


@pytest.mark.parametrize("repo_id", ["openai-community/gpt2", "gpt2"])  # (gpt2's name before openai-community/)
def test_gpt2_name_loads_from_the_local_hub_cache(tmp_path, hf_dir, hub_cache, repo_id):
    """gpt2 by name: the snapshot huggingface_hub downloaded (under either repository name) and refs/main points
    to; a snapshot without weights does not count; a size that is not there is a one-line error."""
    path, hf = hf_dir
    hub_cache(path, "openai-community/gpt2", files=["config.json"])  # (an interrupted download: no weights)
    with pytest.raises(UserError, match="gpt2 is not in the local Hugging Face cache"):
        convert.load_hf("gpt2")
    hub_cache(path, repo_id)
    assert (tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "refs" / "main").read_text() == \
        FakeHub.COMMIT
    ours = convert.load_hf("gpt2")
    direct = convert.load_hf(str(path))
    for k, v in direct.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    with pytest.raises(UserError, match="gpt2-xl is not in the local Hugging Face cache"):
        convert.load_hf("gpt2-xl")


def test_a_gpt2_name_without_huggingface_hub_says_what_to_install(hf_dir, monkeypatch):
    """huggingface_hub is optional: without it a GPT-2 size is a one-line ValueError naming the package (a directory
    still loads)."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` now raises ImportError
    with pytest.raises(ValueError, match=r"finding gpt2 in the Hugging Face cache needs huggingface_hub \(pip install"):
        GPT.from_pretrained("gpt2")
    assert GPT.from_pretrained(str(hf_dir[0])).config.n_layer == 2


@pytest.mark.parametrize("change, message", [
    ({"activation_function": "relu"}, "activation_function is 'relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"n_inner": 48}, "48 wide, not a multiple of n_embd = 32"),
    ({"n_inner": 0}, "mlp_ratio must be a positive integer, got 0"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"n_head": 3}, "divisible by n_head"),
])
def test_configs_gpt2_cannot_compute_are_refused(tmp_path, hf_dir, change, message):
    path = copy_dir(hf_dir[0], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        convert.load_hf(str(path))


def test_exact_gelu_config_loads_as_exact_gelu(tmp_path):
    hf = hf_model(seed=3, activation_function="gelu")
    hf.save_pretrained(tmp_path / "m")
    ours = convert.load_hf(str(tmp_path / "m"))
    assert ours.config.gelu == "none"
    idx = tokens(3)
    torch.testing.assert_close(our_logits(ours, idx), hf_logits(hf, idx), atol=TOL, rtol=0)


def test_other_mlp_width_loads_as_mlp_ratio(tmp_path):
    hf = hf_model(seed=6, n_inner=96)  # 3 * n_embd
    hf.save_pretrained(tmp_path / "m")
    ours = convert.load_hf(str(tmp_path / "m"))
    assert ours.config.mlp_ratio == 3 and ours.blocks[0].ffwd.fc.weight.shape == (96, 32)
    idx = tokens(6)
    torch.testing.assert_close(our_logits(ours, idx), hf_logits(hf, idx), atol=TOL, rtol=0)


def test_untied_output_layer_is_refused(tmp_path):
    hf_model(seed=4, tie_word_embeddings=False).save_pretrained(tmp_path / "m")
    with pytest.raises(UserError, match="lm_head.*different from its token embedding"):
        convert.load_hf(str(tmp_path / "m"))


def test_malformed_directories_and_names(tmp_path, hf_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="nor a directory that has config.json"):
        convert.load_hf(str(empty))
    bad_json = copy_dir(hf_dir[0], tmp_path / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        convert.load_hf(str(bad_json))
    no_weights = copy_dir(hf_dir[0], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no weights"):
        convert.load_hf(str(no_weights))
    corrupt = copy_dir(hf_dir[0], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(UserError, match="not a readable safetensors file"):
        convert.load_hf(str(corrupt))
    with pytest.raises(UserError, match="nor a directory that has config.json"):
        convert.load_hf(str(hf_dir[0] / "config.json"))
    with pytest.raises(UserError, match="'gpt3' is neither a GPT-2 size"):
        convert.load_hf("gpt3")


def test_bad_init_from_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert_one_error_line(run_in_process(sample.main, f"--init_from={tmp_path / 'empty'}", "--device=cpu"),
                          "has config.json")
    assert_one_error_line(train_in_process("--init_from=gpt3", "--device=cpu", check=False), "init_from")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nothing written


# ---------------------------------------------------------------------- export


def our_checkpoint(out_dir, gelu="tanh", bias=True, seed=5, qk_norm=False, mlp_ratio=4, data_meta=None):
    """A random model of ours saved as out_dir/best.pt (GPT-2 BPE unless data_meta says otherwise); returns the
    model."""
    data_meta = data_meta or DatasetMeta.gpt2()
    torch.manual_seed(seed)
    model = perturb(GPT(GPTConfig(block_size=48, vocab_size=max(VOCAB, data_meta.vocab_size), n_layer=2, n_head=4,
                                  n_embd=32, bias=bias, gelu=gelu, dropout=0.1, qk_norm=qk_norm,
                                  mlp_ratio=mlp_ratio)), seed).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    state = checkpoint.training_state(model.state_dict(), model.config, train.TrainConfig(), data_meta,
                                      iter_num=7, best_val_loss=3.0)
    checkpoint.save(state, str(out_dir / checkpoint.BEST))
    return model


@pytest.mark.parametrize("gelu, bias, mlp_ratio", [("tanh", True, 4), ("none", False, 4), ("tanh", True, 3)])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, gelu, bias, mlp_ratio):
    ours = our_checkpoint(tmp_path / "out", gelu, bias, mlp_ratio=mlp_ratio)
    dest = tmp_path / "hf"
    export.main([f"--out_dir={tmp_path / 'out'}", "--to=hf", str(dest)])
    config = json.loads((dest / "config.json").read_text())
    assert config["activation_function"] == {"tanh": "gelu_new", "none": "gelu"}[gelu]
    assert config["n_inner"] == {4: None, 3: 96}[mlp_ratio]  # None: GPT-2's 4 * n_embd
    hf, info = GPT2LMHeadModel.from_pretrained(dest, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    idx = tokens(5, T=48)
    expected = our_logits(ours, idx)
    assert expected.std() > 1.0
    torch.testing.assert_close(hf_logits(hf, idx), expected, atol=TOL, rtol=0)

    back = convert.load_hf(str(dest)).state_dict()
    if bias:  # export -> import gives back every tensor exactly
        assert back.keys() == ours.state_dict().keys()
        for k, v in ours.state_dict().items():
            assert torch.equal(back[k], v), k
    else:  # bias=False was written as zero biases: the same weights, zeros where there were no biases
        for k, v in back.items():
            assert torch.equal(v, ours.state_dict()[k]) if k in ours.state_dict() else not v.any(), k


def test_a_checkpoint_with_a_model_setting_this_code_does_not_know_is_refused(tmp_path):
    """A checkpoint written by another version of the code (a model setting GPTConfig has no field for)
    is refused when it is read, in one line, before export writes anything."""
    our_checkpoint(tmp_path / "out")
    path = tmp_path / "out" / checkpoint.BEST
    state = torch.load(path, weights_only=True)
    state["model_config"]["n_kv_head"] = 1
    checkpoint.save(state, str(path))
    with pytest.raises(UserError, match="has model settings this model.py does not know .n_kv_head.") as e:
        checkpoint.load(path).build_model()
    assert_one_line(e)
    proc = run_in_process(export.main, f"--out_dir={tmp_path / 'out'}", tmp_path / "new")
    assert_one_error_line(proc, "n_kv_head", "does not know")
    assert not (tmp_path / "new").exists()


def test_export_refuses_what_gpt2_cannot_express_and_overwrites_nothing(tmp_path):
    """convert.to_hf's own refusal: a model setting GPT-2's config.json cannot say (QK-norm) is refused
    in one line, and nothing is written."""
    our_checkpoint(tmp_path / "out", qk_norm=True)
    with pytest.raises(UserError, match="cannot express qk_norm=True"):
        convert.to_hf(checkpoint.load(tmp_path / "out" / checkpoint.BEST).build_model(), DatasetMeta.gpt2())
    proc = run_in_process(export.main, f"--out_dir={tmp_path / 'out'}", tmp_path / "new")
    assert_one_error_line(proc, "cannot express qk_norm=True")
    assert not (tmp_path / "new").exists()

    our_checkpoint(tmp_path / "out")
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "config.json").write_text("mine")
    assert_one_error_line(run_in_process(export.main, f"--out_dir={tmp_path / 'out'}", dest), "not an empty directory")
    assert (dest / "config.json").read_text() == "mine"
    with pytest.raises(UserError, match="no checkpoint in"):
        export.main([f"--out_dir={tmp_path / 'missing'}", str(tmp_path / "x")])
    with pytest.raises(UserError, match="give one destination"):
        export.main([f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(SystemExit) as exit_:
        export.main(["--help"])
    assert exit_.value.code == 0


# what tools that take a Hugging Face directory read from an export

# the keys of OpenAI's gpt2 config.json on the hub (openai-community/gpt2), written out here
GPT2_CONFIG_KEYS = {"activation_function", "architectures", "attn_pdrop", "bos_token_id", "embd_pdrop", "eos_token_id",
                    "initializer_range", "layer_norm_epsilon", "model_type", "n_ctx", "n_embd", "n_head", "n_layer",
                    "n_positions", "resid_pdrop", "summary_activation", "summary_first_dropout",
                    "summary_proj_to_labels", "summary_type", "summary_use_proj", "vocab_size"}
# texts whose ids must come out the same: Unicode (accents, CJK, emoji with joiners, a combining mark), runs of
# spaces, tabs and newlines, contractions and digits (GPT-2's pre-tokenizer splits them), <|endoftext|>
TEXTS = ["ROMEO: What light through yonder window breaks?",
         "héllo wörld — 你好世界 🚀😶\u200d🌫️ café\u0301 нещо на Български",
         "  \n\n\t  x   y\t\t\n   \n    ", " 's 't 'RE I've 3333333 3.3 ...!!!???",
         "the end<|endoftext|>A new one <|endoftext|>\n"]
# llama.cpp's convert_hf_to_gguf.py (vendored in llama-cpp-python 0.3.36's sources, conversion/base.py) knows a
# BPE tokenizer's pre-tokenizer by the sha256 of str(tokenizer.encode(CHKTXT)); this hash is its "gpt-2"
# (ref openai-community/gpt2). Another hash stops the conversion ("BPE pre-tokenizer was not recognized").
LLAMA_CPP_CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
                    'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 '
                    '?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!'
                    '?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like '
                    'some tea? We\'Ve a\'lL')
LLAMA_CPP_GPT2_HASH = "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A model of ours exported with export.py (a GPT-2 BPE checkpoint): (the directory, our model)."""
    root = tmp_path_factory.mktemp("export")
    ours = our_checkpoint(root / "out")
    run_in_process(export.main, f"--out_dir={root / 'out'}", root / "hf", check=True)
    return root / "hf", ours


def test_export_has_every_file_and_config_field_that_tools_read(exported):
    dest, ours = exported
    assert sorted(p.name for p in dest.iterdir()) == [
        "config.json", "generation_config.json", "merges.txt", "meta.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    config = json.loads((dest / "config.json").read_text())
    assert GPT2_CONFIG_KEYS <= config.keys()
    assert config["n_ctx"] == config["n_positions"] == 48 and config["bos_token_id"] == config["eos_token_id"] == 50256
    # what llama.cpp's converter reads for GPT2LMHeadModel (conversion/gpt2.py: set_gguf_parameters; base.py:
    # the block count), each a KeyError there when missing: n_ctx was (issue 29)
    assert all(config[k] == v for k, v in dict(architectures=["GPT2LMHeadModel"], n_layer=2, n_ctx=48, n_embd=32,
                                               n_head=4, layer_norm_epsilon=1e-5).items())
    assert json.loads((dest / "generation_config.json").read_text()) == {"bos_token_id": 50256, "eos_token_id": 50256}


def test_autotokenizer_of_an_export_encodes_and_decodes_as_ours(exported):
    from transformers import AutoTokenizer

    tok, ours = AutoTokenizer.from_pretrained(exported[0]), GPT2Tokenizer()
    assert len(tok) == VOCAB and tok.eos_token_id == tok.bos_token_id == 50256
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ours.encode_with_specials(text), text  # <|endoftext|> is the special token, as in HF
        assert tok.decode(ids) == ours.decode(ids) == text
    assert TEXTS[-1].count("<|endoftext|>") == tok.encode(TEXTS[-1]).count(50256) == 2
    assert hashlib.sha256(str(tok.encode(LLAMA_CPP_CHKTXT)).encode()).hexdigest() == LLAMA_CPP_GPT2_HASH


def test_pipeline_text_generation_on_an_export_continues_as_we_do(exported):
    """transformers' pipeline("text-generation", model=DIR), greedy: our model's greedy continuation."""
    from transformers import pipeline

    dest, ours = exported
    prompt, tok = TEXTS[0], GPT2Tokenizer()
    with torch.no_grad():
        ids = ours.generate(torch.tensor([tok.encode(prompt)]), 10, temperature=0)[0].tolist()
    generator = pipeline("text-generation", model=str(dest), device="cpu")
    out = generator(prompt, max_new_tokens=10, do_sample=False)
    assert out[0]["generated_text"] == tok.decode(ids)


def test_a_character_model_exports_without_a_tokenizer_and_says_so(tmp_path):
    chars = CharTokenizer(sorted(set(make_corpus(50))))
    ours = our_checkpoint(tmp_path / "out", data_meta=DatasetMeta.of(chars))
    proc = run_in_process(export.main, f"--out_dir={tmp_path / 'out'}", tmp_path / "hf", check=True)
    notes = proc.stderr.strip().splitlines()
    assert len(notes) == 1 and "no Hugging Face tokenizer" in notes[0] and "char" in notes[0]
    assert not any((tmp_path / "hf" / name).exists() for name in ("vocab.json", "merges.txt", "tokenizer_config.json"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] is config["eos_token_id"] is None  # not GPT-2's 50256
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    idx = tokens(2, T=48)
    torch.testing.assert_close(hf_logits(hf, idx), our_logits(ours, idx), atol=TOL, rtol=0)
    assert DatasetMeta.from_dict(json.loads((tmp_path / "hf" / "meta.json").read_text()), "meta.json").chars == \
        chars.chars


# ---------------------------------------------------------------------- sample.py and train.py


def test_sample_init_from_hf_directory_uses_gpt2_bpe(hf_dir, cpu_bf16, monkeypatch):
    path, _ = hf_dir
    used, prepare = [], packing.prepare  # the dtype sample.py decodes in
    monkeypatch.setattr(packing, "prepare", lambda model, device, dtype, **kw: used.append(dtype) or
                        prepare(model, device, dtype, **kw))
    prompt, n = "The king said", 12
    tok = GPT2Tokenizer()
    model = convert.load_hf(str(path)).eval()
    ids = torch.tensor([tok.encode(prompt)])
    # in the precision sample.py's dtype=auto picks on this kind of CPU (both kinds in turn: cpu_bf16)
    with torch.no_grad():
        out = model.to(cpu_bf16).generate(ids, n, temperature=0, stop_tokens=[tok.eot_token])[0, ids.size(1):].tolist()
    if tok.eot_token in out:
        out = out[:out.index(tok.eot_token)]
    expected = prompt + tok.decode(out)
    proc = run_in_process(sample.main, f"--init_from={path}", f"--start={prompt}", f"--max_new_tokens={n}",
                          "--temperature=0", "--num_samples=2", "--device=cpu", check=True)
    assert proc.stdout == f"{expected}\n---------------\n" * 2
    assert used == [str(cpu_bf16).removeprefix("torch.")]


def test_init_from_hf_directory_crops_block_size_and_keeps_the_weights(tmp_path, hf_dir, bpe_data):
    path, hf = hf_dir
    cfg = parse(train.TrainConfig, finetune_args(path, bpe_data, tmp_path / "out", dropout=0.1))
    cfg.validate()
    model = train.Trainer(cfg).raw_model
    assert model.config == GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32,
                                     dropout=0.1, bias=True, gelu="tanh")
    hf_state = gpt2_weights.from_gpt2_layout(hf.state_dict(), conv1d=True, source="hf")
    hf_state["pos_emb.weight"] = hf_state["pos_emb.weight"][:32]
    for k, v in model.state_dict().items():
        if k != "lm_head.weight":
            assert torch.equal(v, hf_state[k]), k


def test_train_finetune_shakespeare_from_hf_directory(tmp_path, hf_dir, bpe_data):
    out = tmp_path / "out"
    proc = train_in_process(*finetune_args(hf_dir[0], bpe_data, out))
    assert f"initialized from {hf_dir[0]}" in proc.stdout
    assert "iter 4: loss" in proc.stdout and "step 4: train loss" in proc.stdout
    ckpt = checkpoint.load(out / checkpoint.LATEST)
    assert ckpt.iter_num == 4 and ckpt.model_config.gelu == "tanh" and ckpt.model_config.block_size == 32
    assert ckpt.data_meta.tokenizer == "gpt2"


def test_init_from_refuses_a_character_dataset(tmp_path, hf_dir, char_data):
    cfg = parse(train.TrainConfig, finetune_args(hf_dir[0], char_data, tmp_path / "out", dataset="tiny"))
    with pytest.raises(UserError, match="tokenized with char"):
        train.Trainer(cfg)
