"""
LoRA (Hu et al. 2021, as Hugging Face's peft computes it): low-rank adapters on the model's linear layers, the base
weights frozen. A targeted layer y = W x + b becomes

    y = W x + b + (alpha / rank) * B A dropout(x)        A: (rank, in), B: (out, rank)

    --lora_targets   attn (the q/k/v projection, blocks.N.attn.qkv), proj (attention's output, blocks.N.attn.proj),
                     mlp (blocks.N.ffwd.fc and blocks.N.ffwd.proj)

Owns the adapters (LoRALinear, TrainedTokens), what a LoRA checkpoint records of its base (named so that it can
be rebuilt, fingerprinted so that a changed base is refused: build_base), merging (merge: sample, serve, eval and
export then see a plain GPT) and PEFT's format (peft_files). Not here: the checkpoint's file (checkpoint.py).
"""

import hashlib
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery.weights import convert
from machinery.errors import UserError
from machinery.gpt2_weights import GPT2_SIZES, gpt2_weight
from model import GPT, GPTConfig

TARGETS = {"attn": ("attn.qkv",), "proj": ("attn.proj",), "mlp": ("ffwd.fc", "ffwd.proj")}  # -> a Block's modules
ADAPTERS = (".lora_A", ".lora_B", ".token_rows")  # how the adapters' names end in a state dict
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # an adapter directory's files


@dataclass
class LoRASettings:
    """A run's LoRA: rank, alpha (the scale is alpha / rank), dropout on the adapters' input, the targets."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple

    @classmethod
    def of(cls, cfg):
        """The settings of a TrainConfig (lora_rank, ...), checked; None for lora_rank=0 (LoRA off)."""
        targets = tuple(t.strip() for t in str(cfg.lora_targets).split(","))
        unknown = [t for t in targets if t not in TARGETS]
        if cfg.lora_rank < 0:
            raise UserError(f"lora_rank must be 0 (no LoRA) or positive, got {cfg.lora_rank}")
        if unknown or len(set(targets)) != len(targets):
            raise UserError(f"lora_targets must be a comma list of {', '.join(TARGETS)} (each once), got "
                            f"{cfg.lora_targets!r}")
        if not cfg.lora_alpha > 0:
            raise UserError(f"lora_alpha must be positive, got {cfg.lora_alpha}")
        if not 0 <= cfg.lora_dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
        return cls(cfg.lora_rank, float(cfg.lora_alpha), float(cfg.lora_dropout), targets) if cfg.lora_rank else None

    @property
    def modules(self):
        """The targeted modules of a Block, by their names in it (attn.qkv, ...)."""
        return [name for target in self.targets for name in TARGETS[target]]


class LoRALinear(nn.Module):
    """An nn.Linear (its own weight and bias, frozen) plus a low-rank update: (alpha / rank) B A dropout(x).
    A is drawn as nn.Linear's (and peft's) kaiming_uniform(a=sqrt(5)) and B is zero, so training starts from the
    base model exactly. It keeps the `weight` and `bias` names, so a base state dict loads into a LoRA model as it
    is and the adapters are the state's `.lora_A` / `.lora_B` entries."""

    def __init__(self, linear, rank, alpha, dropout):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: a base state dict loads as it is
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))  # zero: the base model at first
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init, as peft (and loralib)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x):
        # peft's order of operations: lora_B(lora_A(dropout(x))) * scaling, added to the base layer's output
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.lora_dropout(x), self.lora_A),
                                                              self.lora_B) * self.scaling

    @torch.no_grad()
    def merged(self):
        """A plain nn.Linear computing the same: W + (alpha / rank) B A (in float32, then the weight's dtype)."""
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=self.bias is not None,
                                    device=self.weight.device, dtype=self.weight.dtype)
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scaling
        linear.weight.copy_(self.weight.float() + delta)
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        return linear


class TrainedTokens(nn.Module):
    """The token embedding, or the output layer tied to it, with the rows of some token ids trained (`rows`) while
    the rest stay frozen: the special tokens of a chat format, which GPT-2 never learned (their rows start equal,
    and a frozen copy would give each the same logit: the end of a turn could never be told apart)."""

    def __init__(self, layer, ids, rows):
        super().__init__()
        self.weight = layer.weight  # the same Parameter: a base state dict loads as it is
        self.embeds = isinstance(layer, nn.Embedding)
        self.register_buffer("ids", torch.tensor(ids, device=layer.weight.device), persistent=False)
        self.token_rows = rows  # one Parameter shared by the embedding and the output layer, as their weight is

    def forward(self, x):
        if self.embeds:  # x: token ids; a trained id takes its row
            out = F.embedding(x, self.weight)
            hit = (x.unsqueeze(-1) == self.ids).to(out.dtype)
            return torch.where(hit.sum(-1, keepdim=True) > 0, hit @ self.token_rows.to(out.dtype), out)
        logits = F.linear(x, self.weight)  # x: hidden states; the trained ids' logits from their rows
        return logits.index_copy(-1, self.ids, F.linear(x, self.token_rows.to(x.dtype)).to(logits.dtype))


def train_tokens(model, ids):
    """TrainedTokens on model's token embedding and its tied output layer for ids (in place)."""
    rows = nn.Parameter(model.tok_emb.weight.detach()[list(ids)].clone())
    model.tok_emb = TrainedTokens(model.tok_emb, ids, rows)
    model.lm_head = TrainedTokens(model.lm_head, ids, rows)


def apply(model, settings, tokens=()):
    """Freeze every weight of model and put LoRALinear layers in place of the targeted ones, and TrainedTokens for
    the token ids `tokens` (in place)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for name in settings.modules:
            parent, _, child = name.rpartition(".")
            parent = block.get_submodule(parent)
            setattr(parent, child, LoRALinear(getattr(parent, child), settings.rank, settings.alpha,
                                              settings.dropout))
    if tokens:
        train_tokens(model, tokens)
    return model


def merge(model):
    """The adapters added into their layers (LoRALinear -> nn.Linear, trained token rows into the tied embedding),
    every weight trainable again: a plain GPT."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    if isinstance(model.tok_emb, TrainedTokens):
        with torch.no_grad():
            weight = model.tok_emb.weight.detach().clone()
            weight[model.tok_emb.ids] = model.tok_emb.token_rows.to(weight.dtype)
        model.tok_emb = nn.Embedding.from_pretrained(weight, freeze=False)
        model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                  dtype=weight.dtype)
        model.lm_head.weight = model.tok_emb.weight  # tied again
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def is_adapter(name):
    """Whether a state dict's entry is an adapter (lora_A or lora_B of a layer)."""
    return name.endswith(ADAPTERS)


def adapter_state(state):
    """The adapters of a state dict (the entries a LoRA checkpoint keeps)."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def load_adapters(model, record, adapters, source):
    """LoRA as a checkpoint's record says put on model (its base), the checkpoint's adapters copied in; a one-line
    error when they do not fit it. Returns model."""
    apply(model, settings_of(record), record.get("tokens", ()))
    expected = {k for k in model.state_dict() if is_adapter(k)}
    if set(adapters) != expected:
        odd = sorted(set(adapters) ^ expected)
        raise UserError(f"{source}: its LoRA adapters do not fit the model (e.g. {', '.join(odd[:2])})")
    try:
        model.load_state_dict(adapters, strict=False)
    except RuntimeError as e:  # its last line names the tensor of the wrong shape
        raise UserError(f"{source}: its LoRA adapters do not fit the model: "
                        f"{str(e).strip().splitlines()[-1].strip()}") from None
    return model


def trainable_line(model, record):
    """A log line: what LoRA trains, against the frozen base."""
    settings = settings_of(record)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return (f"LoRA rank {settings.rank} (alpha {settings.alpha:g}, dropout {settings.dropout:g}) on "
            f"{','.join(settings.targets)}: {trained:,} trainable parameters, {frozen:,} frozen")


# ---------------------------------------------------------------------- the base, named and checked


def fingerprint(model):
    """The sha256 of a model's base weights (names, shapes, dtypes, bytes; the adapters and tied lm_head left out)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if is_adapter(name) or name == "lm_head.weight":
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def attach(model, cfg, tokens=()):
    """LoRA on a new run's model (built from cfg.init_from, on the CPU) when cfg asks for it: the base checked in,
    adapters applied, and the rows of the token ids `tokens` trained too (a chat format's special tokens). Returns
    what the checkpoint records (settings, base, tokens), or None without LoRA."""
    settings = LoRASettings.of(cfg)
    if settings is None:
        return None
    if cfg.init_from == "scratch":  # a new model is rebuilt from the seed it was drawn with
        base = {"init_from": "scratch", "seed": cfg.seed}
    else:  # GPT-2 weights: a size from the Hugging Face cache, or a directory (absolute: found from anywhere)
        base = {"init_from": cfg.init_from if cfg.init_from in GPT2_SIZES else os.path.abspath(cfg.init_from)}
    base["sha256"] = fingerprint(model)
    apply(model, settings, tokens)
    return {**asdict(settings), "targets": list(settings.targets), "base": base, "tokens": list(tokens)}


def settings_of(record):
    """The LoRASettings a checkpoint's record holds."""
    return LoRASettings(record["rank"], record["alpha"], record["dropout"], tuple(record["targets"]))


def build_base(record, model_config, source):
    """The base model a LoRA checkpoint names, rebuilt on the CPU and checked against its sha256 (GPT-2 weights:
    their init_from; a new model: init_from=scratch and the seed that drew it); a base that changed since is
    refused, not silently used."""
    base = record["base"]
    name = base["init_from"]
    if name == "scratch":
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left alone
            torch.manual_seed(base["seed"])
            model = GPT(GPTConfig(**asdict(model_config)))
    else:
        try:
            model = GPT.from_pretrained(name)
        except ValueError as e:
            raise UserError(f"{source} holds LoRA adapters for the base {name}, which does not load: {e}") from None
        if model_config.block_size < model.config.block_size:  # finetuned with a cropped context
            model.crop_block_size(model_config.block_size)
        if model_config.vocab_size > model.config.vocab_size:  # padded for a chat format's tokens, as in training
            convert.grow_vocab(model, model_config.vocab_size)
    if fingerprint(model) != base["sha256"]:
        raise UserError(f"{source} holds LoRA adapters for the base {name}, but the weights found there now differ "
                        f"from those it was trained on (sha256); restore that base")
    return model


def merged_model(record, model_config, adapters, source):
    """The model a LoRA checkpoint holds, as sample, serve, eval and export use it: its base rebuilt and checked,
    the adapters merged in (a plain GPT)."""
    return merge(load_adapters(build_base(record, model_config, source), record, adapters, source))


def resume_settings(record, cfg, source):
    """The checkpoint's LoRA settings written into cfg (so that the train_config it records tells the truth); a
    setting the command gives otherwise is refused: a resumed run continues the adapters it has."""
    from machinery.configurator import given

    if record is None:
        if cfg.lora_rank:
            raise UserError(f"{source} was trained without LoRA; resume it without --lora_rank (LoRA starts a new "
                            f"run from GPT-2 weights: --init_from=gpt2 or a directory)")
        return
    saved = {"lora_rank": record["rank"], "lora_alpha": record["alpha"], "lora_dropout": record["dropout"],
             "lora_targets": ",".join(record["targets"])}
    for name in sorted(given(cfg) & set(saved)):
        asked = getattr(cfg, name)
        asked = ",".join(t.strip() for t in asked.split(",")) if name == "lora_targets" else asked
        if asked != saved[name]:
            raise UserError(f"{source} was trained with {name}={saved[name]} but the command asks for {asked}; "
                            f"resume with the same LoRA settings (or leave {name} out)")
    for name, value in saved.items():
        setattr(cfg, name, value)


# ---------------------------------------------------------------------- PEFT's format


def peft_files(record, adapters, model_config):
    """adapter_config.json (a dict) and adapter_model.safetensors (tensors) in PEFT's format for Hugging Face's
    GPT2LMHeadModel: GPT-2's module names (c_attn, c_proj, c_fc; Conv1D: fan_in_fan_out), peft's key naming; trained
    chat-token rows as PEFT's trainable tokens on the embedding (its `trainable_token_indices`: the full rows, which
    peft ties to the output layer as our TrainedTokens does)."""
    convert.check_gpt2_format(model_config)  # (GPT-2's modules must be able to take the adapters)
    base = record["base"]["init_from"]
    if base == "scratch":
        raise UserError("the base of these adapters is a new model (init_from=scratch), which no Hugging Face "
                        "directory holds; export the merged model instead (drop --adapter_only)")
    tokens = list(record.get("tokens") or ())
    tensors = {}
    for key, tensor in adapters.items():
        if key.endswith(".token_rows"):  # (the embedding's and the output layer's: one Parameter)
            continue
        name, _ = gpt2_weight(key, tensor, to_gpt2=True, conv1d=False)  # A, B: (rank, in), (out, rank) in both
        tensors[f"base_model.model.{name}.weight"] = tensor.contiguous()
    if tokens:
        tensors["base_model.model.transformer.wte.token_adapter.trainable_tokens_delta"] = \
            adapters["tok_emb.token_rows"].float().contiguous()
    # the targets as GPT-2's module suffixes (attn.c_proj, not c_proj: the MLP has a c_proj too)
    modules = [gpt2_weight(f"blocks.0.{m}.weight", None, to_gpt2=True, conv1d=False)[0]
               for m in settings_of(record).modules]
    alpha = record["alpha"]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": f"openai-community/{base}" if base in GPT2_SIZES else base,
        "r": record["rank"], "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": record["dropout"],
        "target_modules": [m.removeprefix("transformer.h.0.").removesuffix(".weight") for m in modules],
        "fan_in_fan_out": True, "bias": "none", "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "trainable_token_indices": tokens or None,
    }
    return config, tensors
