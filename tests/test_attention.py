"""What the heads look at (machinery/generation/attention_maps.py, model.Head's explicit path, plot.py
--attention=True): the weights against transformers' on our export, their shape as a softmax must have it, the
explicit path against the fused one, the statistics of heads built by hand, the labels of a Chinese text, the
pictures and the command's refusals. Small models built in this process."""

import json

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

from conftest import assert_one_error_line, perturb, run_in_process
from machinery.data.meta import DatasetMeta
from machinery.data.tokenizer import CharTokenizer, GPT2Tokenizer
from machinery.generation import attention_maps
from machinery.weights import checkpoint, convert
import model as model_py
from model import GPT, GPTConfig, Head
import plot
import train

CHINESE = "床前明月光，疑是地上霜。举头望明月，低头思故乡。"
ENGLISH = "ROMEO: Is the day so young? But sad hours seem long."


def small_model(seed=0, **config):
    """A random GPT of our own, perturbed (so its heads differ), in eval mode."""
    torch.manual_seed(seed)
    args = dict(block_size=64, vocab_size=50257, n_layer=2, n_head=4, n_embd=32, gelu="tanh")
    return perturb(GPT(GPTConfig(**{**args, **config})), seed).eval()


@pytest.fixture(scope="module")
def ours():
    return small_model()


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory, ours):
    """ours saved as a GPT-2 BPE checkpoint: its out_dir."""
    out_dir = tmp_path_factory.mktemp("attention") / "out"
    out_dir.mkdir()
    state = checkpoint.training_state(ours.state_dict(), ours.config, train.TrainConfig(), DatasetMeta.gpt2(),
                                      iter_num=1, best_val_loss=3.0)
    checkpoint.save(state, str(out_dir / checkpoint.BEST))
    return out_dir


def test_the_weights_are_transformers_output_attentions_on_our_export(ours):
    from transformers import GPT2Config, GPT2LMHeadModel

    config, state = convert.to_hf(ours, DatasetMeta.gpt2())
    hf = GPT2LMHeadModel(GPT2Config(**config, attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (tied to the token embedding)
    ids = torch.randint(0, 50257, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids]), output_attentions=True).attentions
    weights = attention_maps.attention(ours, ids)
    assert len(weights) == len(theirs) == 2
    for mine, reference in zip(weights, theirs):
        assert mine.shape == reference.shape == (1, 4, 40, 40) and mine.dtype == torch.float32
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)


def test_every_row_is_a_softmax_over_the_tokens_up_to_its_own(ours):
    weights = attention_maps.attention(ours, list(range(100, 130)))
    for w in weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 30), atol=1e-6, rtol=0)
        seen = torch.ones(30, 30, dtype=torch.bool).tril()
        assert (w[..., ~seen] == 0).all() and (w[..., seen] > 0).all()
    # asked for once: the heads take their fused path again, keeping nothing
    assert all(not b.attn.heads.keep_weights and b.attn.heads.weights is None for b in ours.blocks)


def test_the_explicit_path_computes_what_the_fused_one_does(ours, monkeypatch):
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fused, _ = ours(idx, every_position=True)
        for block in ours.blocks:
            block.attn.heads.keep_weights = True
        try:
            explicit, _ = ours(idx, every_position=True)
        finally:
            for block in ours.blocks:
                block.attn.heads.keep_weights = False
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (3, 7, 7))  # a cache's case: 3 new of 7 positions
    mask = torch.rand(2, 1, 3, 7, generator=g) < 0.7
    mask[..., 0] = True
    head = Head(0.0)
    for m in (None, mask):
        fused = head(q, k, v, m)
        head.keep_weights = True
        torch.testing.assert_close(head(q, k, v, m), fused, atol=1e-6, rtol=1e-6)
        head.keep_weights = False
    by_hand = torch.softmax(q[0, 0, 0] @ k[0, 0].T / 8 ** 0.5 + torch.where(mask[0, 0, 0], 0.0, float("-inf")), -1)
    torch.testing.assert_close(head.weights[0, 0, 0], by_hand, atol=1e-7, rtol=1e-6)
    calls = []  # nobody asking: the fused kernel, every layer
    sdpa = model_py.F.scaled_dot_product_attention
    monkeypatch.setattr(model_py.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    with torch.no_grad():
        ours(idx)
    assert len(calls) == ours.config.n_layer


def one_hot_model(vocab_size, block_size):
    """A GPT of two layers and one head each, built by hand on one-hot residuals (token | position | the token
    before): layer 0's head looks one token back (its query is its position shifted by one, its key its position)
    and copies that token into the third part; layer 1's head copies (its query is its token, its key the token
    before: it attends to the token after the current one's earlier occurrence). No MLPs."""
    V, P = vocab_size, block_size
    C = 2 * V + P
    model = GPT(GPTConfig(block_size=P, vocab_size=V, n_layer=2, n_head=1, n_embd=C, bias=True)).eval()
    tok, pos, prev = slice(0, V), slice(V, V + P), slice(V + P, C)
    scale = 60.0  # the logits far apart: exp of their difference is 0 in float32
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for ln in [model.ln_f] + [m for b in model.blocks for m in (b.ln1, b.ln2)]:
            ln.weight.fill_(1.0)
        model.tok_emb.weight[:, tok] = torch.eye(V)
        model.pos_emb.weight[:, pos] = torch.eye(P)
        shift = torch.roll(torch.eye(P), shifts=-1, dims=0)  # position i's query asks for position i - 1
        for layer, (q_from, q_map, k_from, v_from, v_to) in enumerate([(pos, shift, pos, tok, prev),
                                                                       (tok, torch.eye(V), prev, tok, tok)]):
            attn = model.blocks[layer].attn
            attn.qkv.weight[q_from, q_from] = scale * q_map
            attn.qkv.weight[C + q_from.start:C + q_from.stop, k_from] = torch.eye(q_from.stop - q_from.start)
            attn.qkv.weight[2 * C + v_from.start:2 * C + v_from.stop, v_from] = torch.eye(V)
            attn.proj.weight[v_to, v_from] = torch.eye(V)
    return model


def test_heads_built_to_look_back_and_to_copy_measure_so():
    model = one_hot_model(vocab_size=48, block_size=64)
    stats = attention_maps.head_stats(attention_maps.attention(model, list(range(40))))
    assert stats["previous"][0, 0].item() == pytest.approx(1.0, abs=1e-6)
    assert stats["self"][0, 0].item() < 1e-6 and stats["entropy"][0, 0].item() < 1e-4
    copying = attention_maps.induction_scores(model, vocab_size=48)
    assert copying[1, 0].item() > 0.6 and copying[0, 0].item() < 0.1  # the copying head, not the one looking back
    random = attention_maps.induction_scores(small_model(seed=3), vocab_size=50257)
    assert random.max().item() < 0.2


def test_labels_of_a_chinese_text_are_its_characters_never_the_replacement_character():
    tokenizer = GPT2Tokenizer()
    ids = tokenizer.encode(CHINESE)
    labels = attention_maps.token_labels(tokenizer, ids)
    assert len(labels) == len(ids) > len(CHINESE) // 2 and not any("\ufffd" in label for label in labels)
    assert any(label.endswith("[1/2]") for label in labels)  # a character split in two tokens: one label each
    assert "".join(label.split("[")[0] for i, label in enumerate(labels)
                   if "[" not in label or label.split("[")[1].startswith("1/")) == CHINESE
    cut = attention_maps.token_labels(tokenizer, ids[:1])  # the first half of 床 alone: its bytes
    assert cut[0] == f"<{tokenizer.token_bytes(ids[0]).hex(' ')}>"
    chars = CharTokenizer("ab \n明")
    assert attention_maps.token_labels(chars, chars.encode("a b\n明")) == ["a", "␣", "b", "\\n", "明"]


def test_maps_pick_layers_and_heads_and_save_in_bertviz_layout(ours, tmp_path):
    found = attention_maps.maps(ours, GPT2Tokenizer(), ENGLISH, layers="1", heads="0,3")
    T = len(found.ids)
    assert [w.shape for w in found.weights] == [(1, 2, T, T)] and found.picked() == [(1, 0), (1, 3)]
    assert torch.equal(found.weight(1, 3), attention_maps.attention(ours, found.ids)[1][0, 3])
    found.save(str(tmp_path / "maps.pt"))
    found.save(str(tmp_path / "maps.json"))
    saved = torch.load(tmp_path / "maps.pt")
    assert saved["tokens"] == found.tokens and torch.equal(saved["attention"][0], found.weights[0])
    as_json = json.loads((tmp_path / "maps.json").read_text(encoding="utf-8"))
    assert np.array(as_json["attention"]).shape == (1, 1, 2, T, T) and as_json["layers"] == [1]
    similarity = attention_maps.position_similarity(ours)
    assert similarity.shape == (64, 64) and torch.allclose(similarity.diagonal(), torch.ones(64))
    assert len(found.table()) == 1 + 2 + len(attention_maps.KINDS)


def png(path):
    """The decoded pixels (H, W, 4) of a PNG."""
    return mpimg.imread(path)


def test_the_command_draws_the_grid_one_head_and_the_positions(bpe_checkpoint, tmp_path):
    out = tmp_path / "maps.png"
    proc = run_in_process(plot.main, "--attention=True", f"--out_dir={bpe_checkpoint}", f"--text={ENGLISH}",
                          f"--out={out}", "--head=1,2", check=True)
    grid = png(out)
    width = max(4 * plot.GRID_PANEL_INCHES, plot.GRID_INCHES) + plot.COLOUR_INCHES
    height = 2 * plot.GRID_PANEL_INCHES + plot.TITLE_INCHES
    assert grid.shape[:2] == (round(height * plot.DPI), round(width * plot.DPI))  # 2 layers down, 4 heads across
    for path in (out, tmp_path / "maps_head.png", tmp_path / "maps_positions.png"):
        pixels = png(path)[..., :3]
        assert pixels.std() > 0.1 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, path  # not blank
    assert proc.stdout.count("\n") == 1 + 8 + len(attention_maps.KINDS) + 1  # the table, the files written


def test_tokens_no_font_draws_are_labelled_by_position_never_as_boxes(monkeypatch, capsys):
    tokens = attention_maps.token_labels(GPT2Tokenizer(), GPT2Tokenizer().encode(CHINESE))
    assert plot.font_for(["abc"]) == (None, [])  # matplotlib's default font draws these
    monkeypatch.setattr(plot, "font_for", lambda labels: (None, ["床"]))  # no CJK font installed
    assert plot.tick_labels(tokens) == ([str(i) for i in range(len(tokens))], None)
    out, err = capsys.readouterr()
    assert "fonts-noto-cjk" in err and len(err.splitlines()) == 1 and out.startswith("tokens: 0 床[1/2]  1 床[2/2]")
    monkeypatch.setattr(plot, "font_for", lambda labels: ("Noto Sans CJK JP", []))  # one that draws them
    assert plot.tick_labels(tokens) == (tokens, "Noto Sans CJK JP") and not any("\ufffd" in t for t in tokens)


def test_the_command_refuses_bad_input_in_one_line_writing_nothing(bpe_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "x.png"
    model = f"--out_dir={bpe_checkpoint}"
    for args, words in [((f"--out_dir={tmp_path / 'none'}", "--text=hi there"), ()),
                        ((model,), ("no text",)),
                        ((model, "--text=" + "word " * 200), (f"at most {attention_maps.MAX_TOKENS}", "shorten")),
                        ((model, "--text=hi there", "--layers=2"), ("--layers=2", "2 layers")),
                        ((model, "--text=hi there", "--heads=a"), ("--heads=a",)),
                        ((model, "--text=hi there", "--layers=0", "--head=1,0"), ("--head=1,0", "not among")),
                        ((model, "--text=hi there", "--save=x.txt"), ("--save",)),
                        ((model, "--text=hi there", "--smoothing=0.5"), ("--smoothing",)),
                        ((model, "--text=hi there", str(bpe_checkpoint)), ("unexpected argument",))]:
        proc = run_in_process(plot.main, "--attention=True", *args, f"--out={out}")
        assert_one_error_line(proc, *words)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    proc = run_in_process(plot.main, "--attention=True", model, "--text=hi there", f"--out={out}")
    assert proc.stderr.strip() == "error: plot.py needs matplotlib: pip install matplotlib==3.11.2"
    assert list(tmp_path.iterdir()) == []
