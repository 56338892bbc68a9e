"""
GPT-2's published weights: their names for our weights (GPT2_NAMES, the one table, read here and written by
convert.py), finding a checkpoint (a GPT-2 size in the local Hugging Face cache, or a directory), its config.json
and its tensors. GPT.from_pretrained (model.py) is the one that builds a model of them; this module never imports
model.py (the config's class is passed in), nor anything else of the project. Its errors are ValueErrors, as
nanoGPT's from_pretrained raises: the commands turn them into one-line errors (convert.py, checkpoint.py, lora.py).
"""

import json
import os
import re

import torch

GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
GPT2_NAMES = {  # GPT-2's module -> ours; N: a block's number
    "transformer.wte": "tok_emb", "transformer.wpe": "pos_emb", "transformer.ln_f": "ln_f", "lm_head": "lm_head",
    "transformer.h.N.ln_1": "blocks.N.ln1", "transformer.h.N.attn.c_attn": "blocks.N.attn.qkv",
    "transformer.h.N.attn.c_proj": "blocks.N.attn.proj", "transformer.h.N.ln_2": "blocks.N.ln2",
    "transformer.h.N.mlp.c_fc": "blocks.N.ffwd.fc", "transformer.h.N.mlp.c_proj": "blocks.N.ffwd.proj"}
UNSUPPORTED = ", which this GPT cannot compute; only GPT-2's architecture loads"  # (the end of a config's refusal)
GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh", "gelu_fast": "tanh",
             "gelu": "none", "gelu_python": "none"}  # Hugging Face's activation names -> GPTConfig.gelu


def load(name_or_path):
    """(config_path, fields, state) of a GPT-2 size or Hugging Face GPT-2 directory: its config.json's path, the
    GPTConfig fields it sets (model.py builds and validates the config: this module never imports it) and its
    weights in our layout."""
    directory = find_gpt2(name_or_path)
    path, fields = gpt2_config(directory)
    return path, fields, from_gpt2_layout(read_gpt2_weights(directory), conv1d=True, source=directory)


def gpt2_weight(key, tensor, to_gpt2=False, conv1d=True):
    """(name, tensor) of a weight in the other layout (GPT-2's with to_gpt2, else ours); name None: not in the table."""
    table = {ours: theirs for theirs, ours in GPT2_NAMES.items()} if to_gpt2 else GPT2_NAMES
    module, _, param = key.rpartition(".")
    block = re.search(r"\.(\d+)\.", module)
    name = table.get(re.sub(r"\.\d+\.", ".N.", module, count=1))
    if name is None or block is None:
        return (name and f"{name}.{param}"), tensor
    return f"{name.replace('.N.', block[0])}.{param}", (tensor.t() if conv1d and tensor.dim() == 2 else tensor)


def from_gpt2_layout(state, conv1d, source):
    """Our state dict from a Hugging Face (conv1d=True) or nanoGPT (conv1d=False) one; `_orig_mod.` prefixes, keys
    without `transformer.` (GPT2Model's) and causal masks taken, other weights and an untied lm_head refused."""
    out, unknown = {}, []
    for key, tensor in state.items():
        key = key.removeprefix("_orig_mod.")
        if re.search(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$", key):
            continue  # a mask, not a weight
        key = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        ours, tensor = gpt2_weight(key, tensor, conv1d=conv1d)
        if ours is None:
            unknown.append(key)
        out[ours] = tensor
    out.pop(None, None)
    if unknown:
        raise ValueError(f"{source} has weights that GPT-2 does not have ({', '.join(unknown[:3])}); "
                         f"it is not a plain GPT-2 model")
    head = out.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, out.get("tok_emb.weight", head)):
        raise ValueError(f"{source} has an output layer (lm_head) different from its token embedding; "
                         f"this GPT ties the two and cannot load it")
    return out


def gpt2_config(directory):
    """(path, GPTConfig's fields) of a Hugging Face GPT-2 directory's config.json; ValueError for what this GPT
    cannot compute (UNSUPPORTED: the rest GPTConfig.validate checks)."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        hf = e
    if not isinstance(hf, dict):
        raise ValueError(f"{path} is not valid JSON holding an object ({hf})")
    act, n_embd, n_inner = hf.get("activation_function", "gelu_new"), hf.get("n_embd", 768), hf.get("n_inner")
    n_inner = 4 * n_embd if n_inner is None else n_inner  # None: GPT-2's 4 * n_embd
    why = next((why for wrong, why in [
        (hf.get("model_type") != "gpt2", f"model_type is {hf.get('model_type')!r}, not 'gpt2'"),
        (act not in GPT2_GELU, f"activation_function is {act!r} (supported: {', '.join(GPT2_GELU)})"),
        (n_inner % n_embd, f"the MLP is {n_inner} wide, not a multiple of n_embd = {n_embd}"),
        (hf.get("layer_norm_epsilon", 1e-5) != 1e-5, f"layer_norm_epsilon is {hf.get('layer_norm_epsilon')}, not 1e-5"),
        (not hf.get("scale_attn_weights", True), "scale_attn_weights is false (no 1/sqrt(head size) scale)"),
        (hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx is true (scaled by the layer)"),
        (hf.get("add_cross_attention"), "add_cross_attention is true (an encoder-decoder model)"),
    ] if wrong), None)
    if why:
        raise ValueError(f"{path}: {why}{UNSUPPORTED}")
    return path, dict(block_size=hf.get("n_positions", 1024), vocab_size=hf.get("vocab_size", 50257),
                      n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd, bias=True,
                      gelu=GPT2_GELU.get(act), mlp_ratio=n_inner // n_embd)


def find_gpt2(name_or_path):
    """The directory of a Hugging Face GPT-2 checkpoint: a path, or a GPT-2 size in the local Hugging Face cache."""
    if name_or_path not in GPT2_SIZES:
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            ours = any(os.path.isfile(os.path.join(name_or_path, f)) for f in ("ckpt.pt", "best.pt"))
            raise ValueError(f"{name_or_path!r} is neither a GPT-2 size ({', '.join(GPT2_SIZES)}) nor a directory that "
                             f"has config.json (a Hugging Face GPT-2 checkpoint)"
                             f"{'; it holds a training checkpoint: sample it with --out_dir' if ours else ''}")
        return name_or_path
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise ValueError(f"finding {name_or_path} in the Hugging Face cache needs huggingface_hub (pip install "
                         f"huggingface_hub==2.4.0), or give the path of a directory holding its files") from None
    for repo in (f"openai-community/{name_or_path}", name_or_path):
        config, *weights = (try_to_load_from_cache(repo, f) for f in ("config.json", *GPT2_WEIGHT_FILES))
        if isinstance(config, str) and any(isinstance(w, str) for w in weights):
            return os.path.dirname(config)
    raise ValueError(f"{name_or_path} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); fetch it once "
                     f"(hf download openai-community/{name_or_path}) or give the path of a directory holding it")


def read_gpt2_weights(directory):
    """The tensors of a Hugging Face checkpoint directory, read by safetensors or torch.load(weights_only=True)."""
    from safetensors.torch import load_file

    path = next((p for p in (os.path.join(directory, f) for f in GPT2_WEIGHT_FILES) if os.path.isfile(p)), None)
    if path is None:
        raise ValueError(f"{directory} has no weights ({' or '.join(GPT2_WEIGHT_FILES)})")
    try:
        state = load_file(path) if path.endswith(".safetensors") else torch.load(path, "cpu", weights_only=True)
    except Exception as e:  # a damaged file fails in many ways inside either reader
        kind = "safetensors" if path.endswith(".safetensors") else "PyTorch"
        raise ValueError(f"{path} is not a readable {kind} file ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a dict of weights")
    return state
