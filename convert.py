"""
GPT-2 weights in the layouts of other code: Hugging Face transformers and nanoGPT,
read into this repository's model and (for Hugging Face) written back out.

The three share one architecture and differ only in names (and Conv1D):

    ours                 Hugging Face GPT-2 / nanoGPT
    tok_emb              transformer.wte
    pos_emb              transformer.wpe
    blocks.N.ln1         transformer.h.N.ln_1
    blocks.N.attn.qkv    transformer.h.N.attn.c_attn     Hugging Face: Conv1D, weight transposed
    blocks.N.attn.proj   transformer.h.N.attn.c_proj     Hugging Face: Conv1D, weight transposed
    blocks.N.ln2         transformer.h.N.ln_2
    blocks.N.ffwd.fc     transformer.h.N.mlp.c_fc        Hugging Face: Conv1D, weight transposed
    blocks.N.ffwd.proj   transformer.h.N.mlp.c_proj      Hugging Face: Conv1D, weight transposed
    ln_f                 transformer.ln_f
    lm_head (tied)       lm_head (tied; Hugging Face files usually leave it out)

Hugging Face's Conv1D computes x @ W + b with W shaped (in, out); nn.Linear stores
(out, in), hence the transpose. Hugging Face GPT-2 is read without `transformers`:
config.json is JSON and model.safetensors is read by `safetensors` (pytorch_model.bin
by torch.load with weights_only=True). Nothing is downloaded: gpt2 ... gpt2-xl come
from the local Hugging Face cache when they are there.

GPT-2's own weights were trained with the tanh approximation of GELU, so they load
with GPTConfig.gelu="tanh"; nanoGPT's models use the exact GELU (gelu="none").
"""

import glob
import json
import os
import re

import torch

import meta
from fileio import atomic_write, read_json_object
from errors import UserError, first_line
from model import GPT, GPTConfig
from safe_pickle import torch_load
from tokenizer import GPT2_EOT

GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

_TOP = {"transformer.wte": "tok_emb", "transformer.wpe": "pos_emb", "transformer.ln_f": "ln_f", "lm_head": "lm_head"}
_BLOCK = {"ln_1": "ln1", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "ln_2": "ln2",
          "mlp.c_fc": "ffwd.fc", "mlp.c_proj": "ffwd.proj"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
# Hugging Face's activation names: the tanh approximation under several names, or the exact GELU
_HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh", "gelu_fast": "tanh",
            "gelu": "none", "gelu_python": "none"}
_GELU_TO_HF = {"tanh": "gelu_new", "none": "gelu"}  # gelu_new: the name GPT-2's own config.json uses
# the GPTConfig fields a GPT-2 config.json can say; any other field must keep its default to be exported
_EXPRESSIBLE = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "gelu", "mlp_ratio"}


def _our_name(key):
    """Our name for a GPT-2 layout key (transformer.h.0.ln_1.weight -> blocks.0.ln1.weight), or None."""
    module, _, param = key.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{param}"
    m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", module)
    if m and m.group(2) in _BLOCK:
        return f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{param}"
    return None


def _gpt2_name(key):
    """The inverse of _our_name."""
    module, _, param = key.rpartition(".")
    if module in _TOP_BACK:
        return f"{_TOP_BACK[module]}.{param}"
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
    return f"transformer.h.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}.{param}"


def _is_conv1d(our_key, tensor):
    # every matrix inside a block is a Conv1D in Hugging Face's GPT-2 (LayerNorm gains are vectors)
    return our_key.startswith("blocks.") and tensor.dim() == 2


def strip_prefix(state_dict, prefix="_orig_mod."):
    """Weights of a torch.compile'd model carry an `_orig_mod.` prefix; drop it."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


def load_weights(model, state):
    """Copy a state dict in our layout into model, with a clear error when it does not fit."""
    try:
        missing, unexpected = model.load_state_dict(strip_prefix(state), strict=False)
    except RuntimeError as e:
        raise UserError(f"the checkpoint's weights do not fit the model: {first_line(e)}") from None
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to tok_emb.weight
    if missing or unexpected:
        raise UserError(f"the checkpoint's weights do not match the model: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")


def from_gpt2_layout(state, conv1d, source):
    """Our state dict from a Hugging Face (conv1d=True) or nanoGPT (conv1d=False) one.

    Accepts `_orig_mod.` prefixes (torch.compile) and keys without `transformer.` (files of
    GPT2Model, like OpenAI's original gpt2 upload); skips the causal-mask buffers
    (`h.N.attn.bias`, `h.N.attn.masked_bias`) older code saved; refuses anything else unknown
    and an output layer that is not tied to the token embedding.
    """
    out, unknown = {}, []
    for key, tensor in strip_prefix(state).items():
        if re.search(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$", key):
            continue  # a mask, not a weight
        ours = _our_name(key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key)
        if ours is None:
            unknown.append(key)
            continue
        out[ours] = tensor.t() if conv1d and _is_conv1d(ours, tensor) else tensor
    if unknown:
        raise UserError(f"{source} has weights that GPT-2 does not have ({', '.join(unknown[:3])}); "
                        f"it is not a plain GPT-2 model")
    head = out.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, out.get("tok_emb.weight", head)):
        raise UserError(f"{source} has an output layer (lm_head) different from its token embedding; "
                        f"this GPT ties the two and cannot load it")
    return out


def to_hf_state(state):
    """Hugging Face GPT-2 tensors (transformer.*, Conv1D transposed, lm_head left to tying) from ours."""
    return {_gpt2_name(k): (v.t() if _is_conv1d(k, v) else v).contiguous()
            for k, v in state.items() if k != "lm_head.weight"}


# ---------------------------------------------------------------------- Hugging Face directories


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
                        any(os.path.isfile(os.path.join(snap, w)) for w in WEIGHT_FILES):
                    return snap
    return None


def find_pretrained(name_or_path):
    """The directory of a Hugging Face GPT-2 checkpoint: a GPT-2 size from the local cache, or a path."""
    if name_or_path in GPT2_SIZES:
        snap = _cached_snapshot(name_or_path)
        if snap is None:
            raise UserError(f"{name_or_path} is not in the local Hugging Face cache ({', '.join(hub_caches())}); "
                            f"fetch it once (hf download openai-community/{name_or_path} config.json "
                            f"model.safetensors) or give the path of a directory holding them")
        return snap
    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            ours = any(os.path.isfile(os.path.join(name_or_path, f)) for f in ("ckpt.pt", "best.pt"))
            hint = "; it holds a training checkpoint: sample it with --out_dir, resume it with init_from=resume" \
                if ours else ""
            raise UserError(f"{name_or_path} has no config.json, so it is not a Hugging Face GPT-2 checkpoint{hint}")
        return name_or_path
    if os.path.exists(name_or_path):
        raise UserError(f"{name_or_path} is a file; give the directory holding config.json and model.safetensors")
    raise UserError(f"init_from {name_or_path!r} is neither a GPT-2 size ({', '.join(GPT2_SIZES)}) "
                    f"nor an existing directory with a Hugging Face GPT-2 checkpoint")


def config_from_hf(hf, source, dropout=0.0):
    """The GPTConfig of a Hugging Face GPT-2 config.json, refusing what this GPT would compute differently."""
    def refuse(why):
        raise UserError(f"{source}: {why}, which this GPT cannot compute; only GPT-2's architecture loads")

    if hf.get("model_type") != "gpt2":
        refuse(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_GELU:
        refuse(f"activation_function is {act!r} (supported: {', '.join(_HF_GELU)})")
    n_embd = hf.get("n_embd", 768)
    n_inner = hf.get("n_inner")
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
                       dropout=dropout, bias=True, gelu=_HF_GELU[act], mlp_ratio=n_inner // n_embd)
    try:
        config.validate()
    except ValueError as e:
        refuse(str(e))
    return config


def _read_tensors(path):
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path} is not a readable safetensors file ({first_line(e)})") from None
    state = torch_load(path)  # pytorch_model.bin: torch.load with weights_only=True
    if not isinstance(state, dict):
        raise UserError(f"{path} does not hold a dict of weights")
    return state


def read_hf_weights(directory):
    """All tensors of a Hugging Face checkpoint directory (one file, or shards listed in an index)."""
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            break
    else:
        raise UserError(f"{directory} has no weights ({' or '.join(WEIGHT_FILES[::2])})")
    if not name.endswith(".index.json"):
        return _read_tensors(path)
    weight_map = read_json_object(path, "").get("weight_map")
    if not isinstance(weight_map, dict):
        raise UserError(f"{path} has no weight_map")
    state = {}
    for shard in sorted(set(weight_map.values())):
        state.update(_read_tensors(os.path.join(directory, shard)))
    return state


def load_hf(name_or_path, dropout=0.0):
    """A GPT holding a Hugging Face GPT-2 checkpoint: gpt2, gpt2-medium, gpt2-large or gpt2-xl from the local
    Hugging Face cache, or a directory with config.json and model.safetensors (or pytorch_model.bin). No
    download, no `transformers`."""
    directory = find_pretrained(name_or_path)
    config = config_from_hf(read_json_object(os.path.join(directory, "config.json"), ""), directory, dropout)
    state = from_gpt2_layout(read_hf_weights(directory), conv1d=True, source=directory)
    model = GPT(config)
    load_weights(model, state)
    return model


def pretrained_meta(name_or_path):
    """The tokenizer of a Hugging Face checkpoint: the meta.json export.py writes next to it, else GPT-2 BPE."""
    return meta.for_dataset(find_pretrained(name_or_path))


def load_for_finetune(name_or_path, data_meta, dataset, block_size, dropout):
    """GPT-2 weights to finetune on a dataset. They fix the model (n_layer, n_head, n_embd, bias, gelu,
    vocab_size); a smaller block_size crops the position embedding; dropout is the caller's."""
    want = pretrained_meta(name_or_path)
    if not data_meta.same_tokens(want):
        raise UserError(f"dataset {dataset} is tokenized with {data_meta.tokenizer}, but {name_or_path} was "
                        f"trained with {want.tokenizer}; prepare the data with that tokenizer (for GPT-2 BPE: "
                        f"python prepare.py shakespeare, or prepare.py text --tokenizer gpt2)")
    model = load_hf(name_or_path, dropout)
    mc = model.config
    if data_meta.vocab_size > mc.vocab_size:
        raise UserError(f"dataset {dataset} has {data_meta.vocab_size} tokens, more than {name_or_path}'s "
                        f"vocab_size {mc.vocab_size}")
    if block_size > mc.block_size:
        raise UserError(f"block_size {block_size} is larger than {name_or_path}'s {mc.block_size}; "
                        f"use --block_size={mc.block_size} or less")
    if block_size < mc.block_size:
        model.crop_block_size(block_size)
    return model


def to_hf(model, data_meta):
    """config.json (a dict) and tensors in Hugging Face GPT2LMHeadModel format from our model.

    Refuses a model GPT-2's format cannot express (a GPTConfig field beyond GPT-2's). The exact
    GELU is Hugging Face's "gelu", the tanh one "gelu_new". A model without biases (bias=False)
    is written with zero biases: adding zero is exactly what leaving the bias out computes, so
    the export gives the same logits; importing it back gives bias=True with those zeros.
    """
    defaults, mc = GPTConfig(), model.config
    for key, value in vars(mc).items():
        if key not in _EXPRESSIBLE and getattr(defaults, key) != value:
            raise UserError(f"GPT-2's format cannot express {key}={value!r}; this model cannot be exported to it")
    state = model.state_dict()
    for key, weight in list(state.items()):
        bias = key[:-len("weight")] + "bias"
        if key.endswith(".weight") and not key.startswith(("tok_emb.", "pos_emb.", "lm_head.")) and bias not in state:
            state[bias] = torch.zeros(weight.size(0), dtype=weight.dtype)
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": mc.vocab_size, "n_positions": mc.block_size, "n_embd": mc.n_embd, "n_layer": mc.n_layer,
        "n_head": mc.n_head, "n_inner": None if mc.mlp_ratio == 4 else mc.mlp_ratio * mc.n_embd,
        "activation_function": _GELU_TO_HF[mc.gelu],
        "resid_pdrop": mc.dropout, "embd_pdrop": mc.dropout, "attn_pdrop": mc.dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
        "use_cache": True, "dtype": str(model.tok_emb.weight.dtype).removeprefix("torch."),
    }
    if data_meta is not None and data_meta.tokenizer == "gpt2":
        config.update(bos_token_id=GPT2_EOT, eos_token_id=GPT2_EOT)
    return config, to_hf_state(state)


def write_hf(directory, config, tensors, data_meta=None):
    """Write config.json, model.safetensors (and our tokenizer's meta.json) into a new or empty directory."""
    from safetensors.torch import save

    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise UserError(f"{directory} already exists and is not an empty directory; pick a new one")
    try:
        os.makedirs(directory, exist_ok=True)
        with atomic_write(os.path.join(directory, "model.safetensors")) as f:
            f.write(save(tensors, metadata={"format": "pt"}))
        with atomic_write(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        if data_meta is not None:
            meta.write(meta.DatasetMeta(data_meta.tokenizer, data_meta.vocab_size, data_meta.chars), directory)
    except OSError as e:
        raise UserError(f"cannot write to {directory} ({e.strerror}); pick another directory") from None
