"""
What the heads look at: every layer's and head's attention weights for a text, from the model's own forward pass
(model.Head's explicit path, asked for here only), in the layout bertviz and CircuitsVis read ([layers] of
(1, heads, T, T)), saved as .pt or JSON; the tokens as labels (a byte-level BPE token that is part of a UTF-8
character shares its character's label, numbered, never U+FFFD); what each head does, measured (its weight on the
previous token, the first token, itself; its entropy; its induction score); the cosine similarity of the learned
position embeddings; the settings that pick the model (loading.ModelSource), the text, layers and heads (plot.py
--attention=True). The pictures are plot.py's.
"""

import json
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from machinery.generation import loading
from machinery.configurator import setting
from machinery.errors import UserError
from machinery.fileio import atomic_write, read_text

MAX_TOKENS = 128  # the longest text mapped: a grid of T x T panels stays readable, and fast (bertviz #82)
INDUCTION_LENGTH = 50  # the random sequence read twice for the induction score (shorter where block_size is)
KINDS = {"previous": "previous-token heads", "first": "first-token sinks", "self": "self heads",
         "induction": "induction heads"}  # the statistics whose top heads are named, highest first


@dataclass
class AttentionConfig(loading.ModelSource):
    """plot.py --attention=True's settings: a model, a text, the layers and heads to draw, the files to write."""

    attention: bool = setting(False, "True: draw what the heads of a model (--out_dir, --init_from) look at in a "
                                     "text, instead of runs' curves")
    text: Optional[str] = setting(None, f"the text (at most {MAX_TOKENS} tokens), or FILE:path to read it from a file")
    layers: Optional[str] = setting(None, "the layers to draw, e.g. 0,2 (None: all)")
    heads: Optional[str] = setting(None, "the heads of each layer to draw, e.g. 0,1,5 (None: all)")
    head: Optional[str] = setting(None, "the head drawn large, LAYER,HEAD, e.g. 1,3 (None: the drawn head with the "
                                        "highest induction score)")
    out: str = setting("attention.png", "the grid's PNG; the large head and the position similarity go beside it "
                                        "(NAME_head.png, NAME_positions.png)")
    save: Optional[str] = setting(None, "also write the weights and tokens to FILE.pt or FILE.json (bertviz's and "
                                        "CircuitsVis' layout: a (1, heads, T, T) tensor a layer)")

    def validate(self):
        super().validate()
        if not self.text:
            raise UserError("no text given; add --text='...' (or --text=FILE:path)")
        if not self.out.endswith(".png"):
            raise UserError(f"--out must name a .png file, got {self.out!r}")
        if self.save is not None and not self.save.endswith((".pt", ".json")):
            raise UserError(f"--save must name a .pt or .json file, got {self.save!r}")

    def read_text(self):
        """The text, from --text or the file it names (FILE:path)."""
        if self.text.startswith("FILE:"):
            return read_text(self.text[len("FILE:"):], "the text file", "give a UTF-8 text file after --text=FILE:")
        return self.text


def indices(text, count, what):
    """The indices a setting such as --layers=0,2 picks among count (None: all); a one-line error otherwise."""
    if text is None:
        return list(range(count))
    try:
        picked = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"--{what}={text}: give numbers separated by commas, e.g. 0,1") from None
    wrong = [i for i in picked if not 0 <= i < count]
    if wrong or len(set(picked)) != len(picked):
        raise UserError(f"--{what}={text}: the model has {count} {what} (0 to {count - 1}), each picked once")
    return picked


@torch.no_grad()
def attention(model, ids):
    """Every layer's softmax weights for the tokens ids (a list): [n_layer] of (1, n_head, T, T) float32 tensors on
    the CPU, from one forward pass in which each Head takes its explicit path (the weights kept), then its fused one
    again."""
    heads = [block.attn.heads for block in model.blocks]
    idx = torch.tensor([ids], dtype=torch.long, device=model.tok_emb.weight.device)
    try:
        for head in heads:
            head.keep_weights = True
        model(idx)
        return [head.weights.float().cpu() for head in heads]
    finally:
        for head in heads:
            head.keep_weights, head.weights = False, None


def shown(text):
    """A token's text as a label: a space as ␣, other invisible characters escaped (\\n)."""
    return "".join("␣" if ch == " " else ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def token_labels(tokenizer, ids):
    """A label for each token: its text; tokens that are parts of one UTF-8 character (a byte-level BPE splits many
    Chinese characters) share their characters' text, numbered (你[1/2], 你[2/2]); bytes that never complete a
    character are written as bytes (<e4 bd>). Never U+FFFD."""
    labels, group, buffer = [], [], b""
    for token in ids:
        group, buffer = group + [token], buffer + tokenizer.token_bytes(token)
        try:
            text = shown(buffer.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        labels += [text] if len(group) == 1 else [f"{text}[{i + 1}/{len(group)}]" for i in range(len(group))]
        group, buffer = [], b""
    for token in group:  # (an end cut inside a character)
        labels.append(f"<{tokenizer.token_bytes(token).hex(' ')}>")
    return labels


def head_stats(weights):
    """What each head does, over the queries after the first (the first can only look at itself): the mean weight on
    the token just before, on the first token, on itself, and the mean entropy of its weights (nats: 0 looks at one
    token; log(i + 1) spreads evenly over all i + 1). {name: (n_layer, n_head)}; weights as attention() gives them."""
    w = torch.cat(weights)[:, :, 1:]  # (n_layer, n_head, T - 1, T): queries 1..T-1
    rows = torch.arange(1, w.size(-1))
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)
    return {"previous": w[:, :, rows - 1, rows - 1].mean(-1), "first": w[..., 0].mean(-1),
            "self": w[:, :, rows - 1, rows].mean(-1), "entropy": entropy.mean(-1)}


def induction_scores(model, vocab_size, seed=0):
    """Each head's induction score, (n_layer, n_head): the model reads n random tokens twice; in the second copy, the
    mean weight a head puts on the token right after the current token's first occurrence (an induction head: 'what
    came after me last time?' copies it). n = INDUCTION_LENGTH, or half the block_size where that is shorter."""
    n = min(INDUCTION_LENGTH, model.config.block_size // 2)
    g = torch.Generator().manual_seed(seed)
    once = torch.randint(0, vocab_size, (n,), generator=g).tolist()
    w = torch.cat(attention(model, once + once))  # (n_layer, n_head, 2n, 2n)
    queries = torch.arange(n, 2 * n)
    return w[:, :, queries, queries - n + 1].mean(-1)


def position_similarity(model):
    """(block_size, block_size): the cosine similarity of every pair of learned position vectors."""
    p = F.normalize(model.pos_emb.weight.detach().float().cpu(), dim=-1)
    return p @ p.T


@dataclass
class Maps:
    """A text's attention maps: the tokens, their labels, the layers and heads picked, and their weights ([layers]
    of (1, heads, T, T)); stats: every head's statistics ({name: (n_layer, n_head)}, induction included)."""

    ids: list
    tokens: list
    layers: list
    heads: list
    weights: list
    stats: dict

    def save(self, path):
        """The weights and tokens as .pt (tensors) or .json (nested lists), the layout bertviz's head_view takes."""
        record = {"tokens": self.tokens, "ids": self.ids, "layers": self.layers, "heads": self.heads}
        if path.endswith(".pt"):
            with atomic_write(path) as f:
                torch.save({**record, "attention": self.weights}, f)
        else:
            with atomic_write(path, "w", encoding="utf-8") as f:
                json.dump({**record, "attention": [w.tolist() for w in self.weights]}, f, ensure_ascii=False)

    def table(self):
        """The heads drawn, a line each with their statistics, then the top heads of each kind named."""
        columns = ("previous", "first", "self", "entropy", "induction")
        lines = ["layer  head" + "".join(f"{name:>10}" for name in columns)]
        for layer, head in self.picked():
            values = [self.stats[name][layer, head].item() for name in columns]
            lines.append(f"{layer:5d} {head:5d}" + "".join(f"{value:10.3f}" for value in values))
        for kind, name in KINDS.items():
            top = sorted(self.picked(), key=lambda lh: -self.stats[kind][lh].item())[:3]
            lines.append(f"{name}: " + ", ".join(f"L{l}H{h} ({self.stats[kind][l, h].item():.2f})" for l, h in top))
        return lines

    def picked(self):
        """(layer, head) of every head drawn."""
        return [(layer, head) for layer in self.layers for head in self.heads]

    def weight(self, layer, head):
        """(T, T): the weights of one head drawn."""
        return self.weights[self.layers.index(layer)][0, self.heads.index(head)]


def most_tokens(config):
    """The most tokens a text mapped by a model of config may have: MAX_TOKENS, or its block_size where shorter."""
    return min(MAX_TOKENS, config.block_size)


def maps(model, tokenizer, text, layers=None, heads=None):
    """The Maps of text (at most MAX_TOKENS tokens, and the model's block_size) for the layers and heads given as
    settings are (e.g. "0,2"; None: all); a one-line error for a text too short or too long, or a head not there."""
    ids = tokenizer.encode(text)
    most = most_tokens(model.config)
    if not 2 <= len(ids) <= most:
        raise UserError(f"the text is {len(ids)} tokens; the maps take 2 to {most} (at most {MAX_TOKENS}, so the grid "
                        f"stays readable, and the model's block_size {model.config.block_size}): "
                        f"{'lengthen' if len(ids) < 2 else 'shorten'} it")
    layers = indices(layers, model.config.n_layer, "layers")
    heads = indices(heads, model.config.n_head, "heads")
    weights = attention(model, ids)
    stats = {**head_stats(weights), "induction": induction_scores(model, tokenizer.vocab_size)}
    picked = [weights[layer][:, heads] for layer in layers]
    return Maps(ids, token_labels(tokenizer, ids), layers, heads, picked, stats)


def large_head(found, head):
    """(layer, head) of the head to draw large: the setting LAYER,HEAD (one drawn), or the drawn head with the highest
    induction score."""
    if head is None:
        return max(found.picked(), key=lambda lh: found.stats["induction"][lh].item())
    try:
        layer, number = (int(part) for part in str(head).split(","))
    except ValueError:
        raise UserError(f"--head={head}: give LAYER,HEAD, e.g. --head=1,3") from None
    if (layer, number) not in found.picked():
        raise UserError(f"--head={head}: not among the heads drawn (layers {found.layers}, heads {found.heads})")
    return layer, number

