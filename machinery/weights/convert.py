"""
GPT-2 weights in the layouts of other code: Hugging Face transformers and nanoGPT,
read into this repository's model and (for Hugging Face) written back out.

The three share one architecture and differ only in names (gpt2_weights.GPT2_NAMES, the one
table of them, read both ways by gpt2_weights.gpt2_weight) and in Hugging Face's Conv1D, which
stores a block's matrices transposed. Reading Hugging Face's GPT-2 is model.py's
GPT.from_pretrained (machinery/gpt2_weights.py: no `transformers`, no download); this file
adds the commands' one-line errors, finetuning, and writing our models in Hugging Face's
format. Not checkpoints (checkpoint.py, nanoGPT's included) nor adapters (lora.py).

GPT-2's own weights were trained with the tanh approximation of GELU, so they load
with GPTConfig.gelu="tanh"; nanoGPT's models use the exact GELU (gelu="none").
"""

import json
import os

import torch

from machinery.data import chat, meta
from machinery.errors import UserError
from machinery.fileio import atomic_write
from machinery.gpt2_weights import GPT2_SIZES, find_gpt2, gpt2_weight
from machinery.data.tokenizer import GPT2_EOT, GPT2Tokenizer, gpt2_bpe_files
from model import GPT, GPTConfig

_GELU_TO_HF = {"tanh": "gelu_new", "none": "gelu"}  # gelu_new: the name GPT-2's own config.json uses
NOT_IN_GPT2 = ("qk_norm",)  # GPTConfig's fields GPT-2's config.json cannot say: another value cannot be exported


def to_hf_state(state):
    """Hugging Face GPT-2 tensors (transformer.*, Conv1D transposed, lm_head left to tying) from ours
    (gpt2_weights.gpt2_weight: the one table of names, both ways)."""
    renamed = (gpt2_weight(k, v, to_gpt2=True) for k, v in state.items() if k != "lm_head.weight")
    return {name: tensor.contiguous() for name, tensor in renamed}


# ---------------------------------------------------------------------- Hugging Face directories


def find_pretrained(name_or_path):
    """The directory of a Hugging Face GPT-2 checkpoint (a GPT-2 size from the local cache, or a path), checked
    before anything starts: one-line errors."""
    try:
        return find_gpt2(name_or_path)
    except ValueError as e:
        raise UserError(f"init_from: {e}") from None


def load_hf(name_or_path, dropout=0.0, initialise=True):
    """GPT.from_pretrained (gpt2 ... gpt2-xl from the local Hugging Face cache, or a directory with config.json
    and model.safetensors or pytorch_model.bin; no download, no `transformers`), with one-line errors.
    initialise=False: without drawing initial weights first (for inference; training draws them, as nanoGPT)."""
    try:
        return GPT.from_pretrained(name_or_path, dict(dropout=dropout), initialise)
    except ValueError as e:
        raise UserError(str(e)) from None


def pretrained_meta(name_or_path, found=False):
    """The tokenizer of a Hugging Face checkpoint: a GPT-2 size's is GPT-2 BPE; a directory's, the meta.json export.py
    writes there, else GPT-2 BPE. found: the directory is known to hold one (else checked, with one-line errors)."""
    if name_or_path in GPT2_SIZES:
        return meta.DatasetMeta.gpt2()
    return meta.for_dataset(name_or_path if found else find_pretrained(name_or_path))


def load_pretrained(name_or_path):
    """A Hugging Face checkpoint for inference (sample.py, serve.py, eval.py, export.py): load_hf's model, built
    without drawing initial weights, and its tokenizer (pretrained_meta)."""
    model = load_hf(name_or_path, initialise=False)
    return model, pretrained_meta(name_or_path, found=True)


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
    if data_meta.vocab_size > mc.vocab_size and data_meta.chat:
        grow_vocab(model, data_meta.model_vocab_size)  # the chat format's special tokens, in GPT-2's spare ids
    if data_meta.vocab_size > mc.vocab_size:
        raise UserError(f"dataset {dataset} has {data_meta.vocab_size} tokens, more than {name_or_path}'s "
                        f"vocab_size {mc.vocab_size}")
    if block_size > mc.block_size:
        raise UserError(f"block_size {block_size} is larger than {name_or_path}'s {mc.block_size}; "
                        f"use --block_size={mc.block_size} or less")
    if block_size < mc.block_size:
        model.crop_block_size(block_size)
    return model


def grow_vocab(model, vocab_size):
    """Give model's (tied) token embedding rows up to vocab_size: GPT-2's 50257 padded to 50304, as a model trained
    here has, so that special tokens in the spare ids (chat.py's) can be learned. A new row starts as the mean of
    the others: its logit is then an average one, where a zero row's (0) would tower over GPT-2's, which are far
    below 0, and take most of the probability."""
    old = model.tok_emb.weight.data
    new = torch.cat([old, old.mean(dim=0, keepdim=True).expand(vocab_size - len(old), -1)])
    model.tok_emb.weight = torch.nn.Parameter(new)
    model.lm_head.weight = model.tok_emb.weight  # tied again
    model.tok_emb.num_embeddings = model.lm_head.out_features = model.config.vocab_size = vocab_size


def check_gpt2_format(model_config):
    """Refuse in one line a model that GPT-2's format cannot express (a field beyond GPT-2's not at its default)."""
    defaults = GPTConfig()
    for key in NOT_IN_GPT2:
        value = getattr(model_config, key)
        if value != getattr(defaults, key):
            raise UserError(f"GPT-2's format cannot express {key}={value!r}; this model cannot be exported to it")


def to_hf(model, data_meta):
    """config.json (a dict) and tensors in Hugging Face GPT2LMHeadModel format from our model.

    Refuses a model GPT-2's format cannot express (a GPTConfig field beyond GPT-2's). The exact
    GELU is Hugging Face's "gelu", the tanh one "gelu_new". A model without biases (bias=False)
    is written with zero biases: adding zero is exactly what leaving the bias out computes, so
    the export gives the same logits; importing it back gives bias=True with those zeros.
    """
    mc = model.config
    check_gpt2_format(mc)
    state = model.state_dict()
    for key, weight in list(state.items()):
        bias = key[:-len("weight")] + "bias"
        if key.endswith(".weight") and not key.startswith(("tok_emb.", "pos_emb.", "lm_head.")) and bias not in state:
            state[bias] = torch.zeros(weight.size(0), dtype=weight.dtype)
    eot = data_meta.make_tokenizer().eot_token if data_meta is not None else None  # char models: none
    config = {  # every field of GPT-2's own config.json (n_ctx: its old name of n_positions, which some tools read)
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": mc.vocab_size, "n_positions": mc.block_size, "n_ctx": mc.block_size, "n_embd": mc.n_embd,
        "n_layer": mc.n_layer, "n_head": mc.n_head, "n_inner": None if mc.mlp_ratio == 4 else mc.mlp_ratio * mc.n_embd,
        "activation_function": _GELU_TO_HF[mc.gelu],
        "resid_pdrop": mc.dropout, "embd_pdrop": mc.dropout, "attn_pdrop": mc.dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        # (the summary_* fields configure GPT2DoubleHeadsModel's classification head: GPT-2's values)
        "summary_type": "cls_index", "summary_use_proj": True, "summary_activation": None,
        "summary_proj_to_labels": True, "summary_first_dropout": 0.1,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None,
        "dtype": str(model.tok_emb.weight.dtype).removeprefix("torch."),
    }
    return config, to_hf_state(state)


def generation_config(config):
    """generation_config.json: the tokens that begin and end a text (as GPT-2's own file says)."""
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


def hf_tokenizer_files(data_meta, block_size):
    """{file name: content} of a Hugging Face tokenizer equal to ours: for GPT-2 BPE a GPT2Tokenizer of GPT-2's own
    vocab.json (encoder.json) and merges.txt (vocab.bpe), for a learned BPE a tokenizer.json; as bytes, and its
    settings, as dicts. None where no Hugging Face tokenizer can say ours (a character vocabulary)."""
    if data_meta is None or data_meta.tokenizer not in ("gpt2", "bpe"):
        return None
    eos = GPT2Tokenizer.eos_text  # <|endoftext|>: the only special token of text, its bos, eos and unk
    special = {"bos_token": eos, "eos_token": eos, "unk_token": eos}
    if data_meta.tokenizer == "bpe":
        tok = data_meta.make_tokenizer()
        files, added, tokenizer_class = {"tokenizer.json": learned_tokenizer_json(tok)}, tok.specials, \
            "PreTrainedTokenizerFast"
    else:
        vocab_bpe, encoder_json = gpt2_bpe_files()
        with open(encoder_json, "rb") as f, open(vocab_bpe, "rb") as g:
            files = {"vocab.json": f.read(), "merges.txt": g.read()}
        added, tokenizer_class = {eos: GPT2_EOT}, "GPT2Tokenizer"
        if data_meta.chat:
            added.update(chat.SPECIAL_TOKENS)
    if data_meta.chat:  # a chat model's: its format's special tokens and the format as a Jinja template
        chat.tokenizer(data_meta.chat)  # (a one-line error for a format this code does not know)
        special["additional_special_tokens"] = list(chat.SPECIAL_TOKENS)
    files["special_tokens_map.json"] = special
    files["tokenizer_config.json"] = {
        "tokenizer_class": tokenizer_class, "model_max_length": block_size, **special,
        "add_prefix_space": False, "add_bos_token": False, "errors": "replace",
        # no clean-up on decoding (it would join " ," into ","): decode(encode(text)) gives text back, as ours
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": text, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for text, i in added.items()},
        **({"chat_template": chat.jinja_template()} if data_meta.chat else {}),
    }
    return files


def learned_tokenizer_json(tok):
    """tokenizer.json (bytes) of a learned BPE (tokenizer.BPETokenizer): transformers' TikTokenConverter turns its
    tiktoken ranks into a byte-level BPE's vocabulary and merges, splitting text by the same pattern; the special
    tokens follow in id order, as ours."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, _):  # (it reads a .tiktoken file; ours are in memory)
            return tok.ranks

    specials = sorted(tok.specials, key=tok.specials.get)
    converted = RanksConverter(pattern=tok.pattern, extra_special_tokens=specials).converted()
    if [converted.token_to_id(t) for t in specials] != [tok.specials[t] for t in specials]:
        raise UserError("Hugging Face's tokenizer cannot give this tokenizer's special tokens their ids; export it "
                        "with --to=gguf")
    return converted.to_str().encode("utf-8")


def write_hf(directory, config, tensors, data_meta=None):
    """Write a new or empty directory that transformers' from_pretrained loads: config.json,
    generation_config.json, model.safetensors, the tokenizer's files (GPT-2 BPE) and our meta.json (for
    sample.py). Returns the names of the files written."""
    files = {"model.safetensors": tensors, "config.json": config, "generation_config.json": generation_config(config),
             **(hf_tokenizer_files(data_meta, config["n_positions"]) or {})}
    if data_meta is None:
        return write_directory(directory, files)
    # meta.json: the tokenizer, not the data
    return write_directory(directory, files, lambda: meta.write(meta.DatasetMeta.of(data_meta.make_tokenizer()),
                                                                directory)) + [meta.FILENAME]


def write_directory(directory, files, extra=None):
    """Write {file name: content} into directory, new or empty: bytes as they are, a dict of tensors as
    safetensors, other dicts as JSON, each file atomically; then extra(), if given. Returns the names written."""
    from safetensors.torch import save

    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise UserError(f"{directory} already exists and is not an empty directory; pick a new one")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, content in files.items():
            if name.endswith(".safetensors"):
                content = save(content, metadata={"format": "pt"})
            with atomic_write(os.path.join(directory, name)) as f:
                f.write(content if isinstance(content, bytes) else
                        json.dumps(content, indent=2, ensure_ascii=False).encode("utf-8"))
        if extra is not None:
            extra()
    except OSError as e:
        raise UserError(f"cannot write to {directory} ({e.strerror}); pick another directory") from None
    return list(files)
