"""The GPT language model, all of it in this one file: GPTConfig -> Head -> MultiHeadAttention -> FeedForward ->
Block -> GPT. GPT-2's architecture (pre-LayerNorm blocks, learned position embedding, tied embeddings, GELU MLP) with
one option GPT-2 lacks (`qk_norm`), and nanoGPT's API: `GPT(GPTConfig(...))`, `model(idx, targets)`, `generate`,
`estimate_mfu`, `GPT.from_pretrained` (GPT-2's files read by machinery/gpt2_weights.py, the one module of the
project it imports, there only)."""

import math
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """The model's shape and options: GPT-2 small's by default (its vocabulary padded)."""

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
        """Raise ValueError naming the first field that cannot build a model (the one check of the settings)."""
        for name in [f.name for f in fields(self) if f.type is int]:  # sizes and counts
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); pick a multiple")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.gelu not in ("none", "tanh"):
            raise ValueError(f"gelu must be 'none' or 'tanh', got {self.gelu!r}")


class Head(nn.Module):
    """Causal scaled dot-product attention, softmax(QK^T / sqrt(head_size)) V, of every head at once: the n_head
    heads that tutorials build as one Head module each, in one call on q, k, v (B, n_head, T, head_size) projected
    by MultiHeadAttention."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout
        self.keep_weights, self.weights = False, None  # keep_weights: the explicit path, its softmax kept in weights

    def forward(self, q, k, v, mask=None):
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # PyTorch's CPU attention is slower in 16 bits than in float32 (BENCHMARKS.md): float32, autocast off
            with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else nullcontext():
                return self.forward(q.float(), k.float(), v.float(), mask).to(q.dtype)
        Tq, Tk = q.size(-2), k.size(-2)  # q: the newest Tq positions; k, v: all Tk so far (Tk > Tq: a KV cache)
        dropout_p = self.dropout if self.training else 0.0
        if mask is None and (self.keep_weights or Tq not in (1, Tk)):  # causal: query i is at position Tk-Tq+i
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        if self.keep_weights:  # the fused kernels never build the weights (PyTorch #98505): the same, step by step
            return self.explicit(q, k, v, mask, dropout_p)
        if mask is not None:  # which positions each query sees: (B, 1, Tq, Tk) from a cache of fixed size, or causal
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        if Tq == 1:  # one new token sees every position (first: a compiled model decodes with one graph)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # Tq == Tk

    def explicit(self, q, k, v, mask, dropout_p=0.0):
        """SDPA's softmax(q k^T / sqrt(head_size), where mask) v; the softmax (B, n_head, Tq, Tk) kept in weights."""
        scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        self.weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return F.dropout(self.weights, dropout_p) @ v


class MultiHeadAttention(nn.Module):
    """n_head Heads in parallel: one fused q/k/v projection, the heads, concatenation, W_O."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_size, self.qk_norm = config.n_head, config.n_embd // config.n_head, config.qk_norm
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # W_Q, W_K, W_V of all heads
        self.heads = Head(config.dropout)  # every head's attention at once: the heads are a batch dimension
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, self.head_size) for t in self.qkv(x).split(C, dim=2))
        if self.qk_norm:
            # QK-norm (as modded-nanogpt, with LayerNorm: a fused kernel on the CPU): each head's query and key
            # normalised, so the attention logits stay bounded however large the weights grow
            q, k = F.layer_norm(q, (self.head_size,)), F.layer_norm(k, (self.head_size,))
        # (B, T, n_head, head_size) -> (B, n_head, T, head_size): the heads become a batch dimension
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # (B, n_head, T, head_size); a cache stores k and v, and has the heads attend over every position it holds
        y = self.heads(q, k, v) if kv_cache is None else kv_cache.attend(layer, q, k, v, self.heads)
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
    """The language model: token and position embeddings, n_layer Blocks, a last LayerNorm, the tied output layer."""

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
        self.lm_head.weight = self.tok_emb.weight  # weight tying: fewer parameters, better loss
        self.apply(self._init_weights)
        # GPT-2: the projections into the residual stream scaled by 1/sqrt(2*n_layer) (two additions a block)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("ffwd.proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Number of parameters, by default without the position embedding (the token one is the output layer too)."""
        return sum(p.numel() for p in self.parameters()) - (self.pos_emb.weight.numel() if non_embedding else 0)

    def forward(self, idx, targets=None, kv_cache=None, every_position=False):
        """The logits of the tokens idx (B, T) (without targets, only the last position's unless every_position), and
        their mean cross-entropy with targets."""
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
        # inference: only the last position's logits are needed (the slice -1: keeps the time dim)
        logits = self.lm_head(x if targets is not None or every_position else x[:, -1:, :])
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                                            ignore_index=-1)
        return logits, loss

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 stop_tokens=None, generator=None, use_cache=True, vocab_size=None):
        """idx (B, T) extended by up to max_new_tokens tokens, as nanoGPT's generate (model.eval() first). temperature 0
        is greedy; it ends once every row has drawn one of stop_tokens (then repeated); use_cache=False runs the whole
        context for every token, as nanoGPT (the same tokens, slower); vocab_size: a tokenizer's, under a padded one."""
        cache = KVCache(self.config, len(idx), KVCache.dtype_for(self, idx.device), idx.device) if use_cache else None
        stops = torch.tensor(sorted(stop_tokens or ()), dtype=torch.long, device=idx.device)
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        with attention_backends(idx.device):
            for _ in range(max_new_tokens):
                # the last block_size tokens are all the model can see; one more tells next_logits the window slid
                logits = self.next_logits(idx[:, -self.config.block_size - 1:], cache)[:, :vocab_size]
                tok = sample_next(logits, temperature, top_k, top_p, generator)
                tok = torch.where(done, idx[:, -1], tok)  # a row that stopped repeats its stop token
                done |= torch.isin(tok, stops)
                idx = torch.cat((idx, tok[:, None]), dim=1)
                if stop_tokens and bool(done.all()):
                    break
        return idx

    @torch.inference_mode()
    def next_logits(self, seq, cache=None):
        """Float32 logits (B, vocab_size) of the token after seq (B, T), whose last block_size tokens the model sees at
        positions 0.. as nanoGPT's generate: with a cache (of a prefix of seq), only the tokens it has not seen. Past
        block_size every kept token moves to a new position: the window is encoded again (exact, one full pass)."""
        block_size = self.config.block_size
        if cache is not None and seq.size(1) > block_size:
            cache.pos = 0
        if cache is not None and cache.pos >= seq.size(1):
            raise ValueError(f"the cache already holds {cache.pos} positions; seq has only {seq.size(1)}")
        new = seq[:, -block_size:] if cache is None or cache.pos == 0 else seq[:, cache.pos:]
        # (a fresh contiguous copy: a compiled model sees the same strides at every step, no recompiles)
        logits, _ = self(new.clone(memory_format=torch.contiguous_format), kv_cache=cache)
        return logits[:, -1, :].float()

    def crop_block_size(self, block_size):
        """Shrink the context, e.g. to finetune GPT-2 (block 1024) with a smaller block_size."""
        assert 0 < block_size <= self.config.block_size
        self.config.block_size = block_size
        self.pos_emb.weight = nn.Parameter(self.pos_emb.weight[:block_size])

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=312e12):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (A100 bf16, as nanoGPT); PaLM's FLOPs per token."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        return flops_per_token * T * fwdbwd_per_iter / dt / peak_flops

    @classmethod
    def from_pretrained(cls, name_or_path, override_args=None, initialise=True):
        """GPT-2's weights, as nanoGPT's GPT.from_pretrained("gpt2", dict(dropout=0.1)): gpt2 ... gpt2-xl from the local
        Hugging Face cache, or a Hugging Face GPT-2 directory. ValueError says what is wrong with the name or files.
        initialise=False: built with_weights, without nanoGPT's random initial weights (faster; torch's random
        stream left as it was)."""
        from machinery import gpt2_weights  # (here, not at the top: for all else model.py stands alone)

        override_args = dict(override_args or {})
        if set(override_args) - {"dropout"}:
            raise ValueError(f"override_args may only set dropout, got {sorted(override_args)}")
        path, fields, state = gpt2_weights.load(name_or_path)
        config = GPTConfig(**fields, dropout=override_args.get("dropout", 0.0))
        try:
            config.validate()
        except ValueError as e:
            raise ValueError(f"{path}: {e}{gpt2_weights.UNSUPPORTED}") from None
        if not initialise:
            return cls.with_weights(config, state)
        model = cls(config)
        model.load_weights(state)
        return model

    @classmethod
    def with_weights(cls, config, state):
        """A GPT of config holding the weights of state (our layout, as load_weights takes it), built without
        drawing initial weights that loading would overwrite (docs/benchmarks-history.md): its modules are
        made on the meta device, and state's tensors become its parameters (in float32; as they are otherwise, a
        transposed view included: what converts them next, to another dtype or a packed layout, copies them)."""
        with torch.device("meta"), SkipInit():
            model = cls(config)
        model.load_weights({k: v.float() for k, v in state.items()}, assign=True)
        model.lm_head.weight = model.tok_emb.weight  # (assigning replaced the tied Parameter)
        return model

    def load_weights(self, state, assign=False):
        """Copy in a state dict of our layout (with or without torch.compile's `_orig_mod.` prefixes and the tied
        lm_head), or with assign take its tensors as the parameters; ValueError when it does not fit this model."""
        try:
            missing, unexpected = self.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state.items()},
                                                       strict=False, assign=assign)
        except RuntimeError as e:  # its last line names the last weight of the wrong shape
            raise ValueError(f"the weights do not fit the model: {str(e).strip().splitlines()[-1].strip()}") from None
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to tok_emb.weight
        if missing or unexpected:
            raise ValueError(f"the weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


class SkipInit(torch.overrides.TorchFunctionMode):
    """Inside it (and torch.device("meta")), modules are made without filling their weights: torch.nn.init's
    functions and the in-place fills they use return their tensor as it is (normal_ on the meta device would
    import TorchDynamo to do nothing)."""

    FILLS = {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_", "constant_", "zero_", "fill_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class KVCache:
    """The keys and values of every layer for `rows` sequences, allocated up front: block_size positions and a spare
    (torch.compile would specialise a slice of the whole buffer). generate's cache, every row at position pos; the
    engine's is built of it (machinery/generation/decode.py: a row a request, each at its own length; `length` and `alloc` its)."""

    def __init__(self, config, rows, dtype, device, length=None, alloc=torch.empty):
        shape = (rows, config.n_head, length or config.block_size + 1, config.n_embd // config.n_head)
        # a layer's keys and values in one tensor (2, *shape): one indexed write can store both (the engine's step)
        self.kv = [alloc((2, *shape), dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.k, self.v = [kv[0] for kv in self.kv], [kv[1] for kv in self.kv]
        self.block_size, self.pos = config.block_size, 0  # pos: positions filled, the next token's position

    @staticmethod
    def dtype_for(model, device):
        """A cache's dtype: float32 on the CPU (where Head attends in float32), else autocast's or the weights'."""
        if device.type == "cpu":
            return torch.float32
        on = torch.is_autocast_enabled(device.type)
        return torch.get_autocast_dtype(device.type) if on else model.tok_emb.weight.dtype

    def positions(self, T, device):
        """The positions of T new tokens: (T,), the same in every row."""
        if self.pos + T > self.block_size:
            raise ValueError(f"cannot forward {self.pos + T} positions, block_size is only {self.block_size}")
        return torch.arange(self.pos, self.pos + T, dtype=torch.long, device=device)

    def attend(self, layer, q, k, v, heads):
        """Store k, v (B, nh, T, hs) at positions pos..pos+T-1; the heads' attention of q over every position."""
        return self.attend_at(self.k[layer], self.v[layer], self.pos, q, k, v, heads)

    @staticmethod
    def attend_at(keys, values, start, q, k, v, heads):
        """Store k, v (B, nh, T, hs) in keys, values (B, nh, length, hs) at positions start..start+T-1; the heads'
        attention of q over the positions up to there."""
        end = start + k.size(2)
        keys[:, :, start:end], values[:, :, start:end] = k, v
        return heads(q, keys[:, :, :end], values[:, :, :end])

    def advance(self, T):
        self.pos += T


def attention_backends(device):
    """A context manager that picks PyTorch's attention kernels for decoding on device (generate's, the engine's):
    on CUDA flash and memory-efficient attention, then the plain one, chosen explicitly: left to its default choice,
    PyTorch chose anew, slowly, for each shape it had not seen, i.e. at every token (docs/benchmarks-history.md).
    Elsewhere nothing: the CPU's default is fast (and its tokens stay what they were)."""
    if torch.device(device).type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # (looked up here: tests stand in for it)

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Logits (B, V) divided by temperature (> 0), -inf where top_k, or top_p (the fewest most likely tokens whose
    probabilities add up to top_p), leave a token out."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(int(top_k), logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        weights = token_weights(logits)
        # ties in the order of the vocabulary (stable): which of equal tokens is cut never depends on the sort
        sorted_weights, order = torch.sort(weights, dim=-1, descending=True, stable=True)
        before = sorted_weights.cumsum(dim=-1) - sorted_weights
        # drop a token when the ones before it already reach top_p; the top token always stays (top_p=0: greedy)
        drop_sorted = before.double() >= top_p * weights.sum(dim=-1, keepdim=True).double()
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def token_weights(logits):
    """Each token's probability under logits (B, V), unnormalised, as an integer: exp(logit - the row's largest)
    in fixed point, the largest 2^bits (as many bits as leave the row's sum below 2^62). Sums of integers are exact
    in any order, so a row's cumulative sums, and so its draw and its top_p set, are the same whatever other rows
    its batch holds: PyTorch's CUDA cumsum adds a row up in an order that depends on the batch's shape (one row
    alone: another scan), and float32 sums drew another token now and then (docs/benchmarks-history.md, GPU). A token
    under 2^-bits of the most likely one's probability (2^-46 for GPT-2's vocabulary) gets weight 0."""
    bits = 62 - logits.size(-1).bit_length()
    # below e^-64 every weight is 0 (e^-64 * 2^61 < 1): clamped there, no exp underflows float32 (many times slower)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return shifted.clamp_min_(-64.0).exp_().mul_(2.0 ** bits).long()  # (in place: a row of V floats a pass)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None, u=None):
    """One token per row of logits (B, V): the argmax when temperature is 0, else a draw from the filtered softmax by
    one uniform number per row (u (B, 1), else from generator) in the cumulative probabilities (not torch.multinomial,
    which draws a number per token of the vocabulary: docs/benchmarks-history.md, "Serving and decoding"), summed as
    integers (token_weights: each row's draw its own, whatever the batch)."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or so small that float32 would take it for 0: greedy
        return logits.argmax(dim=-1)
    logits = logits.float()  # minus each row's largest: no temperature, however small, overflows the division
    weights = token_weights(filter_logits(logits - logits.amax(dim=-1, keepdim=True), temperature, top_k, top_p))
    cdf = weights.cumsum_(dim=-1)
    u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device) if u is None else u
    # the first token whose cumulative weight exceeds u of the row's total (right: never a token of weight 0)
    target = (u.double() * cdf[:, -1:].double()).long()
    return torch.searchsorted(cdf, target, right=True).clamp(max=cdf.size(-1) - 1).squeeze(-1)
