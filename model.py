"""
The whole GPT model in one file, read top to bottom:

    Head -> MultiHeadAttention -> FeedForward -> Block -> GPT

It follows GPT-2 (pre-LayerNorm blocks, learned position embedding, tied
input/output embedding, GELU MLP 4x wide: `mlp_ratio`), with one option GPT-2
lacks (`qk_norm`, used by the speedruns), and keeps nanoGPT's API:
`GPT(GPTConfig(...))`, `model(idx, targets) -> (logits, loss)`,
`model.generate(...)`, `estimate_mfu(...)` (the optimizer: optimizers.py).
(GPT-2's published weights load through convert.py, which knows their layout;
this file imports nothing else of the project.)

Generation uses a KV cache (`KVCache`): one pass over the prompt, then one
position per new token. The cached path gives the same tokens as re-running
the whole context, including past block_size (see `GPT.next_logits`).
"""

import math
from dataclasses import dataclass

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

    def validate(self):
        """Raise ValueError naming the first field that cannot build a model. (The one place that
        checks the model's settings: train.py turns the ValueError into a one-line error.)"""
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
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
    """Keys and values of every layer for the positions seen so far.

    Allocated up front, so decoding allocates nothing per token and a compiled model
    sees the same buffers at every step. `pos` is the number of positions filled,
    which is also the position of the next token.
    """

    def __init__(self, config, batch_size, dtype, device):
        # block_size positions and one spare: a slice [:end] is then never the whole buffer,
        # a case that torch.compile would otherwise specialise (one more graph to compile)
        shape = (batch_size, config.n_head, config.block_size + 1, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.pos = 0

    def update(self, layer, k, v):
        """Store k, v (B, nh, T, hs) at positions pos..pos+T-1; return all keys and values so far."""
        start, end = self.pos, self.pos + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Head(nn.Module):
    """Causal scaled dot-product attention of one head: softmax(QK^T / sqrt(d_k)) V.

    It works on tensors shaped (..., T, head_size), so MultiHeadAttention runs
    all heads at once by handing them over as a batch dimension. It calls
    PyTorch's scaled_dot_product_attention, which picks flash attention on CUDA.
    """

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # PyTorch's CPU attention kernels are several times slower in bfloat16 than in float32
            # (BENCHMARKS.md), so attend in float32, with autocast off (it would cast back to bfloat16)
            with torch.autocast("cpu", enabled=False):
                return self(q.float(), k.float(), v.float()).to(q.dtype)
        # q holds the newest Tq positions, k and v all Tk positions seen so far
        # (Tk > Tq only when decoding with a KV cache).
        Tq, Tk = q.size(-2), k.size(-2)
        dropout_p = self.dropout if self.training else 0.0
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
        # one Head computes every head's attention at once: the heads are a batch dimension
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
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        y = self.heads(q, k, v)  # (B, n_head, T, head_size)
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

    def forward(self, idx, targets=None, kv_cache=None):
        B, T = idx.size()
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"cannot forward {start + T} positions, block_size is only {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for layer, block in enumerate(self.blocks):
            x = block(x, kv_cache, layer)
        x = self.ln_f(x)
        if kv_cache is not None:
            kv_cache.pos += T

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference: only the last position's logits are needed (the slice -1: keeps the time dim)
            logits = self.lm_head(x[:, -1:, :])
            loss = None
        return logits, loss

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
            cache = KVCache(self.config, idx.size(0), self._activation_dtype(idx.device), idx.device)
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

    def _activation_dtype(self, device):
        """The dtype the q/k/v projection produces: autocast's, else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.lm_head.weight.dtype


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
        # drop a token when the ones before it already reach top_p (so the top token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of logits (B, V): argmax when temperature is 0, else a draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
