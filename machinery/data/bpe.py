"""
Learning a byte-level BPE on a corpus: prepare.py --tokenizer=bpe --vocab_size=N.

rustbpe (nanochat's learner, in Rust) learns the merges from text split by GPT-2's pattern; its mergeable ranks
are tiktoken's, so machinery/data/tokenizer.py's BPETokenizer encodes with tiktoken at GPT-2's speed
(BENCHMARKS.md: why rustbpe rather than Hugging Face's tokenizers). A vocabulary of N tokens is the 256 bytes,
N - 256 - len(SPECIALS) learned merges, then the special tokens at the top ids: <|endoftext|> (between
documents) and the chat format's (machinery/data/chat.py), so a chat model needs no ids outside the vocabulary.
"""

import time

from machinery.data import chat
from machinery.errors import UserError
from machinery.data.tokenizer import EOT_TEXT, GPT2_PATTERN, BPETokenizer

SPECIALS = (EOT_TEXT, *chat.SPECIAL_TOKENS)  # in id order, after the learned tokens
MAX_VOCAB_SIZE = 1 << 16  # token files hold uint16 ids
BATCH_CHARS = 1 << 20  # the learner is given the text in pieces of about this many characters


def check_vocab_size(vocab_size):
    """A one-line error unless vocab_size holds the 256 bytes and the special tokens, and fits uint16 ids."""
    least = 256 + len(SPECIALS)
    if not least <= vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(f"--vocab_size {vocab_size} is outside {least}..{MAX_VOCAB_SIZE}: a learned BPE holds the "
                        f"256 bytes and {len(SPECIALS)} special tokens, and token files hold uint16 ids")
    return vocab_size


def check_options(tokenizer_kind, vocab_size, tokenizer_chars=None):
    """A one-line error unless --vocab_size comes with --tokenizer bpe, and only there, and fits (check_vocab_size),
    and --tokenizer_chars, where given, goes with it too and is at least 1."""
    if (vocab_size is None) != (tokenizer_kind != "bpe"):
        raise UserError("--vocab_size goes with --tokenizer bpe (the size of the vocabulary to learn), and only there")
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    if tokenizer_chars is not None and tokenizer_kind != "bpe":
        raise UserError("--tokenizer_chars goes with --tokenizer bpe (the characters to learn it on), and only there")
    if tokenizer_chars is not None and tokenizer_chars < 1:
        raise UserError(f"--tokenizer_chars must be at least 1, got {tokenizer_chars}")


def train(texts, n_tokens):
    """rustbpe's Tokenizer learned on texts (an iterable of strings) up to n_tokens tokens (bytes and merges)."""
    import rustbpe

    learner = rustbpe.Tokenizer()
    learner.train_from_iterator(iter(texts), n_tokens, pattern=GPT2_PATTERN)
    return learner


def learn(texts, vocab_size):
    """A BPETokenizer of vocab_size tokens learned on texts (an iterable of strings); a corpus with too few
    distinct pairs for its merges is a one-line error saying how many it had."""
    check_vocab_size(vocab_size)
    n_learned = vocab_size - len(SPECIALS)
    ranks = dict(train(texts, n_learned).get_mergeable_ranks())
    if len(ranks) == 256 and n_learned > 256:
        raise UserError("the corpus has no pair of bytes to merge (empty?); give a text to learn the tokenizer on")
    if len(ranks) < n_learned:
        raise UserError(f"the corpus is too small to learn {n_learned - 256} merges: it gave only {len(ranks) - 256}; "
                        f"give more text or --vocab_size {len(ranks) + len(SPECIALS)} or less")
    return BPETokenizer.learned(ranks, specials_after(len(ranks)))


def learn_on(texts, vocab_size, what):
    """learn(texts, vocab_size), saying what it learns on (e.g. "1,000 characters of corpus.txt") and how long it
    took."""
    print(f"learning a BPE of {vocab_size} tokens on {what}")
    start = time.perf_counter()
    tok = learn(texts, vocab_size)
    print(f"learned in {time.perf_counter() - start:.2f} s")
    return tok


def specials_after(n_ranks):
    """{text: id} of the special tokens after n_ranks learned tokens."""
    return {text: n_ranks + i for i, text in enumerate(SPECIALS)}


def pieces(chunks, limit=None):
    """The strings of chunks (an iterable of strings) cut to their first limit characters in all (None: all)."""
    seen = 0
    for text in chunks:
        if limit is not None:
            if seen >= limit:
                return
            text = text[:limit - seen]
        seen += len(text)
        yield text  # (an empty one too: an empty document does not end the corpus)
