"""
The whole GPT model in one file, read top to bottom:

    Head -> MultiHeadAttention -> FeedForward -> Block -> GPT

It follows GPT-2 (pre-LayerNorm blocks, learned position embedding, tied
input/output embedding, GELU MLP 4x wide: `mlp_ratio`), with one option GPT-2
lacks (`qk_norm`, used by the speedruns), and keeps nanoGPT's API:
`GPT(GPTConfig(...))`, `model(idx, targets) -> (logits, loss)`,
`model.generate(...)`, `estimate_mfu(...)`, `GPT.from_pretrained("gpt2")` (GPT-2's
published weights, read at the end of this file; the optimizer: optimizers.py).
This file imports nothing else of the project.

Generation uses a KV cache (`KVCache`): one pass over the prompt, then one
position per new token. The cached path gives the same tokens as re-running
the whole context, including past block_size (see `GPT.next_logits`).
"""

import glob
import json
import math
import os
import re
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest context the model sees (size of the position embedding)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, like GPT-2
    gelu: str = "none"  # GELU approximation: "none" (exact erf) or "tanh" (GPT-2's weights use tanh)
    qk_norm: bool = False  # normalise each head's queries and keys (not in GPT-2; see MultiHeadAttention)
    mlp_ratio: int = 4  # the MLP's hidden width in multiples of n_embd (GPT-2: 4)

    # What the fields are to the code around the model, which derives its lists from these (a new field
    # belongs to none of them by default: it must match on resume, and models that change it do not export):
    PER_RUN = ("dropout",)  # may change when a run resumes or finetunes a model: the weights do not depend on it
    NOT_IN_GPT2 = ("qk_norm",)  # GPT-2's config.json cannot say it: a model with another value cannot be exported
    NOT_IN_NANOGPT = ("gelu", "qk_norm", "mlp_ratio")  # nanoGPT's GPTConfig has no such field (it has the defaults)

    def validate(self):
        """Raise ValueError naming the first field that cannot build a model. (The one place that
        checks the model's settings: train.py turns the ValueError into a one-line error.)"""
        for name in [f.name for f in fields(self) if f.type is int]:  # sizes and counts
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.gelu not in ("none", "tanh"):
            raise ValueError(f"gelu must be 'none' or 'tanh', got {self.gelu!r}")


class KVCache:
    """The keys and values of every layer for the positions seen so far, for generate().

    Allocated up front, so decoding allocates nothing per token and a compiled model
    sees the same buffers at every step. `pos` is the number of positions filled,
    which is also the position of the next token. (The generation engine keeps its
    own, one row per request: machinery/engine.py.)
    """

    def __init__(self, config, batch_size, dtype, device):
        # block_size positions and one spare: a slice [:end] is then never the whole buffer,
        # a case that torch.compile would otherwise specialise (one more graph to compile)
        shape = (batch_size, config.n_head, config.block_size + 1, config.n_embd // config.n_head)
        # empty, not zeros: only the positions filled so far are ever read
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.block_size = config.block_size
        self.pos = 0

    def positions(self, T, device):
        """The positions of T new tokens: (T,), the same in every row."""
        if self.pos + T > self.block_size:
            raise ValueError(f"cannot forward {self.pos + T} positions, block_size is only {self.block_size}")
        return torch.arange(self.pos, self.pos + T, dtype=torch.long, device=device)

    def attend(self, layer, q, k, v, heads):
        """Store k, v (B, nh, T, hs) at positions pos..pos+T-1; the heads' attention of q over every position."""
        start, end = self.pos, self.pos + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return heads(q, self.k[layer][:, :, :end], self.v[layer][:, :, :end])

    def advance(self, T):
        self.pos += T


class Head(nn.Module):
    """Causal scaled dot-product attention, softmax(QK^T / sqrt(head_size)) V, of every head at once.

    In the articles (and Karpathy's video), a Head owns its key, query and value projections and
    attends for one head; MultiHeadAttention then runs n_head of them and concatenates. Here the
    projections of all heads are one matrix in MultiHeadAttention (`qkv`, the same weights as
    n_head separate ones side by side), and this module receives q, k, v shaped
    (B, n_head, T, head_size): the heads are a batch dimension, so one call computes what n_head
    Heads of the articles compute one by one. It calls PyTorch's scaled_dot_product_attention,
    which picks flash attention on CUDA.
    """

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask=None):
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # PyTorch's CPU attention kernels are several times slower in bfloat16 (and 2x in float16) than in
            # float32 (BENCHMARKS.md), so attend in float32, with autocast off (it would cast back)
            with torch.autocast("cpu", enabled=False):
                return self(q.float(), k.float(), v.float(), mask).to(q.dtype)
        # q holds the newest Tq positions, k and v all Tk positions seen so far
        # (Tk > Tq only when decoding with a KV cache).
        Tq, Tk = q.size(-2), k.size(-2)
        dropout_p = self.dropout if self.training else 0.0
        if mask is not None:  # (B, 1, Tq, Tk): which positions each query sees (a cache of fixed size)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        if Tq == 1:
            # one new token may look at every position so far (checked first, so that a compiled
            # model decodes with one graph whatever the number of cached positions)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        if Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        # several new tokens after a cached prefix: query i sits at position Tk-Tq+i
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class MultiHeadAttention(nn.Module):
    """n_head Heads in parallel: one fused q/k/v projection, the heads, concatenation, W_O."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_size = config.n_embd // config.n_head
        self.qk_norm = config.qk_norm
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # W_Q, W_K, W_V of all heads
        # one Head module computes every head's attention at once: the heads are a batch dimension
        self.heads = Head(config.dropout)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, self.head_size) for t in self.qkv(x).split(C, dim=2))
        if self.qk_norm:
            # QK-norm: each head's query and key normalised (a LayerNorm without gain over head_size), so
            # the attention logits stay bounded however large the weights grow and large steps are safe
            # (modded-nanogpt uses RMSNorm; LayerNorm learns as well and is a fused kernel on the CPU)
            q, k = F.layer_norm(q, (self.head_size,)), F.layer_norm(k, (self.head_size,))
        # (B, T, n_head, head_size) -> (B, n_head, T, head_size): the heads become a batch dimension
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is None:
            y = self.heads(q, k, v)  # (B, n_head, T, head_size)
        else:  # the cache stores k and v, and has the heads attend over every position it holds
            y = kv_cache.attend(layer, q, k, v, self.heads)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate the heads
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    """The MLP of a block: expand (4x in GPT-2: mlp_ratio), GELU, project back."""

    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Transformer block: communication (attention) then computation (MLP), each pre-LayerNorm and residual."""

    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ffwd = FeedForward(config)

    def forward(self, x, kv_cache=None, layer=0):
        x = x + self.attn(self.ln1(x), kv_cache, layer)
        x = x + self.ffwd(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)  # learned absolute positions
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the output projection is the token embedding (fewer parameters, better loss)
        self.lm_head.weight = self.tok_emb.weight

        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2*n_layer),
        # since each block adds two of them and the stream's variance grows with every addition
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("ffwd.proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Number of parameters; by default without the position embedding (the token
        embedding counts, since it is also the output layer)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.pos_emb.weight.numel()
        return n_params

    def forward(self, idx, targets=None, kv_cache=None, every_position=False):
        """Logits (and the mean cross-entropy with targets) of the tokens idx (B, T). Without targets only the
        last position's logits are computed (generation needs no more), unless every_position (scoring)."""
        B, T = idx.size()
        if kv_cache is None:
            if T > self.config.block_size:
                raise ValueError(f"cannot forward {T} positions, block_size is only {self.config.block_size}")
            pos = torch.arange(T, dtype=torch.long, device=idx.device)
        else:
            pos = kv_cache.positions(T, idx.device)  # (T,), or (B, T) where rows have their own lengths
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for layer, block in enumerate(self.blocks):
            x = block(x, kv_cache, layer)
        x = self.ln_f(x)
        if kv_cache is not None:
            kv_cache.advance(T)

        if targets is not None or every_position:
            logits = self.lm_head(x)
            loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                                                ignore_index=-1)
        else:
            # inference: only the last position's logits are needed (the slice -1: keeps the time dim)
            logits = self.lm_head(x[:, -1:, :])
            loss = None
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_path, override_args=None):
        """GPT-2's weights, as nanoGPT's GPT.from_pretrained("gpt2", dict(dropout=0.1)): gpt2, gpt2-medium,
        gpt2-large or gpt2-xl from the local Hugging Face cache, or the path of a Hugging Face GPT-2 directory
        (the end of this file reads them). override_args may set dropout only, as in nanoGPT (the other
        settings are the weights'). ValueError names what is wrong with the name, the directory or its files."""
        override_args = dict(override_args or {})
        if set(override_args) - {"dropout"}:
            raise ValueError(f"override_args may only set dropout, got {sorted(override_args)}")
        directory = find_gpt2(name_or_path)
        model = cls(gpt2_config(read_gpt2_config(directory), directory, override_args.get("dropout", 0.0)))
        model.load_weights(from_gpt2_layout(read_gpt2_weights(directory), conv1d=True, source=directory))
        return model

    def load_weights(self, state):
        """Copy in a state dict in our layout (torch.compile's `_orig_mod.` prefixes and the tied lm_head may be
        there or not); ValueError when it does not fit this model."""
        try:
            missing, unexpected = self.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()},
                                                       strict=False)
        except RuntimeError as e:
            raise ValueError(f"the weights do not fit the model: {_first_line(e)}") from None
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to tok_emb.weight
        if missing or unexpected:
            raise ValueError(f"the weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")

    def crop_block_size(self, block_size):
        """Shrink the context, e.g. to finetune GPT-2 (block 1024) with a smaller block_size."""
        assert 0 < block_size <= self.config.block_size
        self.config.block_size = block_size
        self.pos_emb.weight = nn.Parameter(self.pos_emb.weight[:block_size])

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=312e12):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (default A100 bf16, as nanoGPT).
        FLOPs per token from the PaLM paper, appendix B."""
        cfg = self.config
        N = self.get_num_params()
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return flops_per_iter / dt / peak_flops

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 stop_tokens=None, generator=None, use_cache=True, vocab_size=None):
        """Extend idx (B, T) by up to max_new_tokens tokens and return the (B, T + n) result.

        temperature 0 is greedy (argmax). Generation ends early once every row has
        produced one of stop_tokens; a row that stopped is padded with its stop token.
        use_cache=False re-runs the whole context for every token, as nanoGPT does
        (same tokens, slower). vocab_size limits the tokens to the first vocab_size
        (a tokenizer's, when the model's vocabulary is padded, e.g. 50257 of 50304).
        Put the model in eval mode first (model.eval()).
        """
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p,
                                        stop_tokens, generator, use_cache, vocab_size))
        return torch.cat([idx] + [tok[:, None] for tok in new], dim=1)

    @torch.inference_mode()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        stop_tokens=None, generator=None, use_cache=True, vocab_size=None):
        """Like generate, but yields each new column of tokens, shape (B,), as soon as it is sampled."""
        block_size = self.config.block_size
        seq = idx[:, -block_size:]
        cache = None
        if use_cache:
            cache = KVCache(self.config, idx.size(0), self.cache_dtype(idx.device), idx.device)
        stops = torch.tensor(sorted(stop_tokens), device=idx.device) if stop_tokens else None
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        fill = torch.zeros(idx.size(0), dtype=torch.long, device=idx.device)
        for _ in range(max_new_tokens):
            logits = self.next_logits(seq, cache)[:, :vocab_size]
            tok = sample_next(logits, temperature, top_k, top_p, generator)
            if stops is not None:
                tok = torch.where(done, fill, tok)
                hit = torch.isin(tok, stops) & ~done
                fill = torch.where(hit, tok, fill)
                done = done | hit
            # the last block_size tokens are all the next step can see; one more tells it the window slid
            seq = torch.cat((seq[:, -block_size:], tok[:, None]), dim=1)
            yield tok
            if stops is not None and bool(done.all()):
                return

    @torch.inference_mode()
    def next_logits(self, seq, cache=None):
        """Logits (B, vocab_size), in float32, for the token that follows seq (B, T).

        The model sees the last block_size tokens of seq at positions 0..block_size-1,
        as nanoGPT's generate does. Without a cache it runs that whole window. With a
        cache it runs only the tokens the cache has not seen yet; the cache must hold a
        prefix of seq, as it does when seq grows by some tokens between calls.
        """
        block_size = self.config.block_size
        if cache is None:
            new = seq[:, -block_size:]  # nanoGPT's way: the whole context again for every token
        elif seq.size(1) > block_size:
            # Past block_size the window slides: every kept token moves to a new position, so
            # the cached keys (which carry their old positions) are stale and the window is
            # encoded again. This keeps the exact semantics at the cost of one full pass.
            cache.pos = 0
            new = seq[:, -block_size:]
        else:
            if cache.pos >= seq.size(1):
                raise ValueError(f"the cache already holds {cache.pos} positions; seq has only {seq.size(1)}")
            new = seq[:, cache.pos:]
        # a fresh contiguous copy: a compiled model then sees the same strides at every step
        # (a slice of the growing seq would change them and trigger recompiles)
        logits, _ = self(new.clone(memory_format=torch.contiguous_format), kv_cache=cache)
        return logits[:, -1, :].float()

    def cache_dtype(self, device):
        """The dtype of a KV cache: the keys' and values' (autocast's, else the weights'), except float32 for
        bfloat16 or float16 on the CPU, where Head attends in float32 (then only the new token's are cast, not the
        cache)."""
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
            else self.tok_emb.weight.dtype
        return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Scale logits (B, V) by temperature and mask (to -inf) what top_k / top_p leave out.

    temperature must be > 0 here (0 means greedy, handled by sample_next); top_k above
    the vocabulary size keeps everything; top_p keeps the smallest set of most likely
    tokens whose probabilities add up to at least top_p (nucleus sampling).
    """
    logits = logits.float() / temperature
    if top_k is not None:
        k = min(int(top_k), logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # drop a token when the ones before it already reach top_p; the top token always stays (top_p=0: greedy)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None, u=None):
    """One token per row of logits (B, V): argmax when temperature is 0, else a draw from the softmax of the
    filtered logits. The draw is one uniform number per row (u, (B, 1); drawn from generator when not given),
    looked up in the cumulative probabilities (inverse transform sampling: torch.multinomial would draw a
    number for every token of the vocabulary instead, as slow as a decoding step; BENCHMARKS.md)."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or so small that float32 would take it for 0: greedy
        return logits.argmax(dim=-1)
    # each row's largest logit subtracted first (the softmax is the same): then no temperature, however small,
    # overflows the division (the top logit stays 0, the others go to -inf at worst: greedy)
    logits = logits.float()
    probs = F.softmax(filter_logits(logits - logits.amax(dim=-1, keepdim=True), temperature, top_k, top_p), dim=-1)
    cdf = probs.cumsum(dim=-1)
    if u is None:
        u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device)
    u = u * cdf[:, -1:]
    # the first token whose cumulative probability exceeds u (right: never a token of probability 0)
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.size(-1) - 1).squeeze(-1)


# ---------------------------------------------------------------------- GPT-2's published weights
#
# GPT.from_pretrained reads a Hugging Face GPT-2 checkpoint (config.json and model.safetensors or
# pytorch_model.bin, possibly sharded), with no `transformers` and no download: OpenAI's gpt2 ... gpt2-xl
# from the local Hugging Face cache, or any directory. GPT-2's layout differs from ours in names only, and
# Hugging Face stores a block's four matrices as Conv1D, (in, out): the transpose of nn.Linear's (out, in).
# (machinery/convert.py uses the same names for nanoGPT's checkpoints, which have no Conv1D, and to export ours.)

GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json")
GPT2_NAMES = {"transformer.wte": "tok_emb", "transformer.wpe": "pos_emb", "transformer.ln_f": "ln_f",
              "lm_head": "lm_head", "ln_1": "ln1", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
              "ln_2": "ln2", "mlp.c_fc": "ffwd.fc", "mlp.c_proj": "ffwd.proj"}  # (inside transformer.h.N)
# Hugging Face's activation names: the tanh approximation under several names, or the exact GELU
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh", "gelu_fast": "tanh",
             "gelu": "none", "gelu_python": "none"}


def gpt2_config(hf, source, dropout=0.0):
    """The GPTConfig of a Hugging Face GPT-2 config.json (a dict); ValueError for what this GPT computes otherwise."""
    def refuse(why):
        raise ValueError(f"{source}: {why}, which this GPT cannot compute; only GPT-2's architecture loads")

    if hf.get("model_type") != "gpt2":
        refuse(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_GELU:
        refuse(f"activation_function is {act!r} (supported: {', '.join(GPT2_GELU)})")
    n_embd, n_inner = hf.get("n_embd", 768), hf.get("n_inner")
    n_inner = 4 * n_embd if n_inner is None else n_inner  # None: GPT-2's 4 * n_embd
    if n_inner % n_embd:
        refuse(f"the MLP is {n_inner} wide, not a multiple of n_embd = {n_embd}")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        refuse(f"layer_norm_epsilon is {hf['layer_norm_epsilon']} instead of 1e-5")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights is false (attention without the 1/sqrt(head size) scale)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx is true (attention scaled down by the layer number)")
    if hf.get("add_cross_attention", False):
        refuse("add_cross_attention is true (an encoder-decoder model)")
    # reorder_and_upcast_attn only changes the precision of the attention scores, not the maths: accepted
    config = GPTConfig(block_size=hf.get("n_positions", 1024), vocab_size=hf.get("vocab_size", 50257),
                       n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd,
                       dropout=dropout, bias=True, gelu=GPT2_GELU[act], mlp_ratio=n_inner // n_embd)
    try:
        config.validate()
    except ValueError as e:
        refuse(str(e))
    return config


def from_gpt2_layout(state, conv1d, source):
    """Our state dict from a Hugging Face (conv1d=True) or nanoGPT (conv1d=False) one. Accepts torch.compile's
    `_orig_mod.` prefixes and keys without `transformer.` (GPT2Model's files, like OpenAI's first gpt2 upload);
    skips the causal-mask buffers older code saved; refuses other unknown weights and an untied output layer."""
    out, unknown = {}, []
    for key, tensor in state.items():
        key = key.removeprefix("_orig_mod.")
        if re.search(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$", key):
            continue  # a mask, not a weight
        key = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        module, _, param = key.rpartition(".")
        block = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", module)
        if module in GPT2_NAMES and "." not in GPT2_NAMES[module]:
            ours = f"{GPT2_NAMES[module]}.{param}"
        elif block and block[2] in GPT2_NAMES:
            ours = f"blocks.{block[1]}.{GPT2_NAMES[block[2]]}.{param}"
        else:
            unknown.append(key)
            continue
        # every matrix inside a block is a Conv1D in Hugging Face's GPT-2 (LayerNorm gains are vectors)
        out[ours] = tensor.t() if conv1d and block and tensor.dim() == 2 else tensor
    if unknown:
        raise ValueError(f"{source} has weights that GPT-2 does not have ({', '.join(unknown[:3])}); "
                         f"it is not a plain GPT-2 model")
    head = out.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, out.get("tok_emb.weight", head)):
        raise ValueError(f"{source} has an output layer (lm_head) different from its token embedding; "
                         f"this GPT ties the two and cannot load it")
    return out


def find_gpt2(name_or_path):
    """The directory of a Hugging Face GPT-2 checkpoint: a GPT-2 size from the local cache, or a path."""
    if name_or_path in GPT2_SIZES:
        snap = _cached_snapshot(name_or_path)
        if snap is None:
            raise ValueError(f"{name_or_path} is not in the local Hugging Face cache ({', '.join(hub_caches())}); "
                             f"fetch it once (hf download openai-community/{name_or_path} config.json "
                             f"model.safetensors) or give the path of a directory holding them")
        return snap
    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            ours = any(os.path.isfile(os.path.join(name_or_path, f)) for f in ("ckpt.pt", "best.pt"))
            hint = "; it holds a training checkpoint: sample it with --out_dir, resume it with init_from=resume" \
                if ours else ""
            raise ValueError(f"{name_or_path} has no config.json, so it is not a Hugging Face GPT-2 checkpoint{hint}")
        return name_or_path
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path} is a file; give the directory holding config.json and model.safetensors")
    raise ValueError(f"{name_or_path!r} is neither a GPT-2 size ({', '.join(GPT2_SIZES)}) nor an existing "
                     f"directory with a Hugging Face GPT-2 checkpoint")


def hub_caches():
    """The Hugging Face cache directories to look in, as huggingface_hub resolves them."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    dirs = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"), os.path.join(home, "hub")]
    return [d for i, d in enumerate(dirs) if d and d not in dirs[:i]]


def _cached_snapshot(name):
    """The cached snapshot of gpt2* (refs/main first, then the newest) holding config.json and weights."""
    for cache in hub_caches():
        for repo in (f"models--{name}", f"models--openai-community--{name}"):
            root = os.path.join(cache, repo)
            snapshots = sorted(glob.glob(os.path.join(root, "snapshots", "*")), key=os.path.getmtime, reverse=True)
            ref = os.path.join(root, "refs", "main")
            if os.path.isfile(ref):
                with open(ref) as f:
                    snapshots.insert(0, os.path.join(root, "snapshots", f.read().strip()))
            for snap in snapshots:
                if os.path.isfile(os.path.join(snap, "config.json")) and \
                        any(os.path.isfile(os.path.join(snap, w)) for w in GPT2_WEIGHT_FILES):
                    return snap
    return None


def _first_line(e):
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def read_gpt2_config(directory):
    """The dict of a Hugging Face directory's config.json."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        hf = e
    if not isinstance(hf, dict):  # unreadable, not JSON, or JSON of something else
        why = _first_line(hf) if isinstance(hf, Exception) else type(hf).__name__
        raise ValueError(f"{path} is not valid JSON holding an object ({why})")
    return hf


def read_gpt2_weights(directory):
    """All tensors of a Hugging Face checkpoint directory (one file, or the shards an index lists)."""
    path = next((os.path.join(directory, name) for name in GPT2_WEIGHT_FILES
                 if os.path.isfile(os.path.join(directory, name))), None)
    if path is None:
        raise ValueError(f"{directory} has no weights ({' or '.join(GPT2_WEIGHT_FILES[::2])})")
    if not path.endswith(".index.json"):
        return _read_tensors(path)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not an index with a weight_map") from None
    return {k: v for shard in shards for k, v in _read_tensors(os.path.join(directory, shard)).items()}


def _read_tensors(path):
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
    except Exception as e:  # a damaged file fails in many ways inside either reader
        kind = "safetensors" if path.endswith(".safetensors") else "PyTorch weights"
        raise ValueError(f"{path} is not a readable {kind} file ({_first_line(e)})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a dict of weights")
    return state
