"""
Our model as one GGUF file, llama.cpp's format (Ollama and LM Studio read it too): llama.cpp's GPT-2
architecture, with the tokenizer inside, written with the gguf package's GGUFWriter.

It writes what llama.cpp's own converter (convert_hf_to_gguf.py) writes from our Hugging Face export (convert.py's
to_hf): the same metadata, tensor names, shapes and types (tensor_type), so the two load the same in llama.cpp.
Two differences: the feed-forward width is the model's own (the converter writes 4 * n_embd, which llama.cpp then
refuses for mlp_ratio != 4), and general.name is the model's. A chat model's file also holds its format
(_add_tokenizer). What GPT-2's architecture cannot say is refused before anything is written, in one line (to_hf:
QK-norm), and so is a character-level model (llama.cpp has no character tokenizer). Not here: the Hugging Face
export (convert.py), export.py's settings.
"""

import importlib
import json
import os

from machinery.data import chat
from machinery.weights import convert
from machinery.errors import UserError
from machinery.fileio import temp_path
from machinery.data.tokenizer import GPT2_PATTERN, gpt2_bpe_files

OUTTYPES = ("f32", "f16", "q8_0")
INSTALL = "pip install gguf==0.19.0"
# the Conv1D matrices of Hugging Face's GPT-2, transposed back to (out, in) as llama.cpp's converter does
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def import_gguf():
    """The gguf package (optional: only --to=gguf needs it), or a one-line error saying how to install it."""
    try:
        return importlib.import_module("gguf")
    except ImportError:
        raise UserError(f"export.py --to=gguf needs the gguf package: {INSTALL}") from None


def check_outtype(outtype):
    if outtype not in OUTTYPES:
        raise UserError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")


def vocabulary(gguf, vocab_size, data_meta):
    """The tokenizer's entries of a GGUF file: its tokens (byte-level strings, as Hugging Face's vocab.json writes
    them), special tokens as control tokens (<|endoftext|>, a chat model's), padded to the model's vocab_size with
    unused ones; their types; the merges. GPT-2's, or a learned BPE's (as its Hugging Face export says them)."""
    tok = data_meta.make_tokenizer()
    if data_meta.tokenizer == "bpe":
        if tok.pattern != GPT2_PATTERN:
            raise UserError("GGUF names its pre-tokenizer, and llama.cpp knows none for this tokenizer's split "
                            "pattern (only GPT-2's); export it with --to=hf instead")
        model = json.loads(convert.learned_tokenizer_json(tok))["model"]
        ids, merges = model["vocab"], [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    else:
        vocab_bpe, encoder_json = gpt2_bpe_files()
        with open(encoder_json, encoding="utf-8") as f:
            ids = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            merges = [line for line in f.read().split("\n")[1:] if line]  # (after the "#version" line)
    by_id = {i: token for token, i in ids.items()}
    control = {tok.eot_token, *(tok.specials.values() if data_meta.tokenizer == "bpe" else
                                chat.special_ids(data_meta.chat))}
    by_id.update({i: text for text, i in {**chat.SPECIAL_TOKENS, **tok.specials}.items() if i in control})
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.UNUSED for i in range(vocab_size)]
    return tokens, types, merges, tok


def tensor_type(gguf, name, array, outtype):
    """The GGUF type a tensor is written in (llama.cpp's converter's rules):

        outtype  matrices                                         vectors (LayerNorms, biases), position embedding
        f32      float32                                          float32
        f16      float16                                          float32
        q8_0     Q8_0 (int8 in blocks of 32, a float16 scale      float32
                 each; float16 where a row is not a multiple of 32)
    """
    types = gguf.GGMLQuantizationType
    if array.ndim <= 1 or name.startswith("position_embd."):
        return types.F32
    if outtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0:
        return types.Q8_0
    return types.F32 if outtype == "f32" else types.F16


def write_gguf(path, model, data_meta, outtype="f16", name="gpt"):
    """Write model (and its GPT-2 BPE tokenizer) to a new GGUF file at path, atomically; nothing is written
    when the model or the place cannot be. Any MLP width and either GELU is written as it is: llama.cpp computes
    the tanh approximation through a table of float16 values, so its float32 logits agree with ours within a
    small tolerance, not exactly (tests/test_gguf.py; the figures: docs/benchmarks-history.md)."""
    gguf = import_gguf()
    check_outtype(outtype)
    if data_meta is None or data_meta.tokenizer not in ("gpt2", "bpe"):
        raise UserError(f"GGUF holds its tokenizer, and llama.cpp has none for this model's "
                        f"{getattr(data_meta, 'tokenizer', None) or 'missing'} tokenizer (only byte-level BPE); "
                        f"export it with --to=hf instead")
    if os.path.exists(path):
        raise UserError(f"{path} already exists; pick a new file name")
    config, tensors = convert.to_hf(model, data_meta)  # refuses what GPT-2's architecture cannot say
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, config["n_layer"])
    tmp = temp_path(path)
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
    try:
        _add_metadata(gguf, writer, config, name, file_type)
        _add_tokenizer(gguf, writer, config, data_meta)
        for hf_name, tensor in tensors.items():
            if hf_name.endswith(_CONV1D):
                tensor = tensor.t()
            array = tensor.float().contiguous().numpy()
            new_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            qtype = tensor_type(gguf, new_name, array, outtype)
            writer.add_tensor(new_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}); pick another place") from None
    finally:
        writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)


def _add_metadata(gguf, writer, config, name, file_type):
    """The keys llama.cpp reads of the architecture: its sizes (as its converter writes them)."""
    width = config["n_inner"] or 4 * config["n_embd"]
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(width)
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(gguf, writer, config, data_meta):
    """The tokenizer's keys: a byte-level BPE split by GPT-2's pattern (llama.cpp's "gpt-2" pre-tokenizer), and for
    a chat model (chat.py) its special tokens as control tokens, its template as tokenizer.chat_template (without
    the {% generation %} block, which only transformers knows; llama.cpp's chat uses it) and its assistant's end
    of turn as the end of a generation (eot: llama.cpp stops there)."""
    tokens, types, merges, tok = vocabulary(gguf, config["vocab_size"], data_meta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.eot_token)
    writer.add_eos_token_id(tok.eot_token)
    writer.add_add_bos_token(False)
    if data_meta.chat:
        writer.add_chat_template(chat.jinja_template(mask=False))
        writer.add_eot_token_id(chat.stop_token(tok))
