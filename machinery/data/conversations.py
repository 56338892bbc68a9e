"""
Chat datasets: conversations read from JSON lines or parquet, prepared into token files, and trained on whole.

    python prepare.py chat --input FILE|DIR [--name NAME] [--max_len 1024]

    DATA_DIR/NAME/{split}.bin       the ids of its conversations, one after another (uint16, nanoGPT's token file)
                  {split}.mask      beside each id, 1 where the model learns it (the assistant's tokens), else 0 (uint8)
                  {split}.offsets   where each conversation begins, and the end (int64, one more than conversations)
                  meta.json         GPT-2 BPE with the format's special tokens, chat: the format's name (meta.py)

Owns reading and checking the input (README's chat section: its format, the cuts and drops) and, for train.py,
the batches (a row one conversation, padded) and the step's mean loss (TokenMean). Not here: the chat format
itself (chat.py, its one owner) and the token stream of plain datasets (dataset.py).
"""

import os
from array import array
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from machinery.data import chat, dataset, documents, meta
from machinery.errors import UserError
from machinery.fileio import atomic_write
from machinery.data.tokenizer import CharTokenizer

SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet")
DEFAULT_MAX_LEN = 1024  # GPT-2's block_size
LEARN = ("assistant", "all")  # train.py's --chat_loss: the targets of a row
PAD_MULTIPLE = 16  # rows are padded to the batch's longest conversation rounded up to this (fewer distinct shapes)


# ---------------------------------------------------------------------- reading and preparing


def read(path):
    """(where, messages) of every conversation in --input (a file or a directory), in order, each checked
    (chat.check); where names its file and line (row, in parquet) for errors."""
    files = documents.local_files(path, SUFFIXES, "conversations")
    for f in files:  # footers first: a parquet file without the column stops us before any reading
        if f.endswith(".parquet"):
            documents.open_parquet(f, "messages", "conversations")
    for f in files:
        if f.endswith(".parquet"):
            found = ((f"{f} row {row}", m) for row, m in enumerate(documents.parquet_values(f, "messages"), 1))
        else:
            found = ((f"{f} line {number}", record.get("messages") if isinstance(record, dict) else None)
                     for number, record in documents.jsonl_records(f))
        for where, messages in found:
            try:
                yield where, chat.check(messages, '"messages"')
            except ValueError as e:
                raise UserError(f"{where}: {e}; fix or remove that conversation (nothing was written)") from None


def fit(tok, messages, max_len):
    """(ids, mask, cut) of a conversation in at most max_len tokens: whole (cut False), or its longest beginning
    that ends with an assistant turn (cut True); None when it has no assistant turn or not even the first fits."""
    ids, mask = chat.encode(tok, messages)
    if len(ids) <= max_len:
        return (ids, mask, False) if any(m["role"] == "assistant" for m in messages) else None
    ends = [k + 1 for k, m in enumerate(messages[:-1]) if m["role"] == "assistant"]  # the beginnings that may do
    best, lo, hi = None, 0, len(ends) - 1
    while lo <= hi:  # a longer beginning has more tokens: binary search for the longest that fits
        mid = (lo + hi) // 2
        ids, mask = chat.encode(tok, messages[:ends[mid]])
        if len(ids) <= max_len:
            best, lo = (ids, mask, True), mid + 1
        else:
            hi = mid - 1
    return best


def encode_all(path, tok, max_len):
    """Every conversation of path fitted into max_len tokens: (ids, mask, offsets) of those kept, one after
    another, and the counts {read, kept, cut, too_long, no_assistant}."""
    ids, mask, offsets = array("H"), array("B"), [0]
    counts = dict(read=0, kept=0, cut=0, too_long=0, no_assistant=0)
    for _, messages in read(path):
        counts["read"] += 1
        fitted = fit(tok, messages, max_len)
        if fitted is None:
            counts["no_assistant" if not any(m["role"] == "assistant" for m in messages) else "too_long"] += 1
            continue
        ids.extend(fitted[0])
        mask.extend(fitted[1])
        offsets.append(len(ids))
        counts["kept"] += 1
        counts["cut"] += fitted[2]
    return (np.frombuffer(ids, dtype=np.uint16), np.frombuffer(mask, dtype=np.uint8),
            np.array(offsets, dtype=np.int64), counts)


def validation(n, fraction):
    """Which of n conversations go to the validation split: round(n * fraction) of them (at least one), spread
    evenly (the middle one of each equal share), so that a file sorted by topic gives both splits every topic."""
    n_val = max(1, round(n * fraction))
    if n - n_val < 1:
        raise UserError(f"only {n} conversation(s) kept: too few for a training and a validation split; give more "
                        f"conversations (or a smaller --val_fraction)")
    picked = np.zeros(n, dtype=bool)
    picked[((np.arange(n_val) + 0.5) * n / n_val).astype(np.int64)] = True
    return picked


def take(ids, mask, offsets, picks):
    """(ids, mask, offsets) of the conversations picks (a boolean array), one after another."""
    starts, lengths = offsets[:-1][picks], np.diff(offsets)[picks]
    new = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = np.repeat(starts - new[:-1], lengths) + np.arange(new[-1])
    return ids[index], mask[index], new


def prepare(input_path, out_dir, tokenizer_kind="gpt2", max_len=DEFAULT_MAX_LEN, val_fraction=0.1):
    """Read, check and encode the conversations of input_path, then write the chat dataset into out_dir (nothing
    is written before every conversation has been read); return its DatasetMeta."""
    if tokenizer_kind == "char":
        chat.require(CharTokenizer(""), "prepare.py chat --tokenizer char")
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if max_len < 3:
        raise UserError(f"--max_len must be at least 3 tokens (a turn's two and one before), got {max_len}")
    tok = chat.tokenizer()
    ids, mask, offsets, counts = encode_all(input_path, tok, max_len)
    print(f"{counts['read']:,} conversations read: {counts['kept']:,} kept ({counts['cut']:,} of them cut after the "
          f"last assistant turn that fits in --max_len {max_len} tokens), {counts['too_long']:,} dropped as too long "
          f"(not even the first assistant turn fits), {counts['no_assistant']:,} dropped without an assistant turn")
    val = validation(counts["kept"], val_fraction)
    splits = {"train": take(ids, mask, offsets, ~val), "val": take(ids, mask, offsets, val)}
    write(out_dir, splits)
    data_meta = meta.DatasetMeta.of(tok, train_tokens=len(splits["train"][0]), val_tokens=len(splits["val"][0]),
                                    max_token_id=int(ids.max()), source=os.path.abspath(input_path),
                                    chat=chat.TEMPLATE)
    data_meta = meta.write(data_meta, out_dir)
    print(f"{out_dir}: " + ", ".join(f"{split} {len(o) - 1:,} conversations ({len(i):,} tokens, {int(m.sum()):,} "
                                     f"of them the assistant's)" for split, (i, m, o) in splits.items()))
    return data_meta


def write(out_dir, splits):
    """The split files, each written beside its old version and all replaced only once all are complete."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with ExitStack() as files:
            for split, (ids, mask, offsets) in splits.items():
                for suffix, values in (("bin", ids.astype(np.uint16)), ("mask", mask.astype(np.uint8)),
                                       ("offsets", offsets.astype("<i8"))):
                    files.enter_context(atomic_write(os.path.join(out_dir, f"{split}.{suffix}"))).write(
                        values.tobytes())
    except OSError as e:
        raise UserError(f"cannot write the chat dataset in {out_dir} ({e.strerror or e}); free some space or pick "
                        f"another --data_dir (nothing there was changed)") from None


# ---------------------------------------------------------------------- a prepared chat dataset


@dataclass
class ChatSplit:
    """One split's conversations: their ids and mask (memory-mapped) and where each begins."""
    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    learn: str = "assistant"  # the targets of a row: the assistant's tokens, or all

    def __len__(self):
        return len(self.offsets) - 1

    @property
    def longest(self):
        return int(np.diff(self.offsets).max())

    @property
    def targets(self):
        """How many target tokens the split's conversations hold (the first token of each is none)."""
        return int(self.mask.sum(dtype=np.int64)) if self.learn == "assistant" else len(self.ids) - len(self)

    def rows(self, picks, block_size, device="cpu"):
        """(x, y) on device of the conversations picks, one a row, padded to the longest (rounded up to
        PAD_MULTIPLE, at most block_size): x a conversation without its last token (padding 0), y without its
        first, -1 (no loss) on the padding and, learning the assistant's tokens only, where the mask is 0."""
        import torch

        starts, ends = self.offsets[picks], self.offsets[np.asarray(picks) + 1]
        width = min(block_size, -(-(int((ends - starts).max()) - 1) // PAD_MULTIPLE) * PAD_MULTIPLE)
        x, y = np.zeros((len(starts), width), np.int64), np.full((len(starts), width), -1, np.int64)
        for row, (start, end) in enumerate(zip(starts, ends)):
            tokens, n = self.ids[start:end].astype(np.int64), end - start - 1
            x[row, :n] = tokens[:-1]
            y[row, :n] = tokens[1:] if self.learn == "all" else np.where(self.mask[start + 1:end] == 1, tokens[1:], -1)
        return dataset.to_device(torch.from_numpy(x), torch.from_numpy(y), torch.device(device))


@dataclass
class ChatDataset:
    """A prepared chat dataset: its metadata and two splits of conversations (train.py's dataset.Dataset for chat)."""
    directory: str
    data_meta: meta.DatasetMeta
    train: ChatSplit
    val: ChatSplit

    def check_token_ids(self, vocab_size):
        """dataset.Dataset.check_token_ids of the two splits' ids."""
        ids = dataset.Dataset(self.directory, self.data_meta, self.train.ids, self.val.ids)
        return ids.check_token_ids(vocab_size)


def load(directory, block_size, learn="assistant"):
    """The dataset in directory for training: a ChatDataset when its metadata says chat, else dataset.load's token
    stream. Every conversation must fit a row: at most block_size + 1 tokens."""
    found = meta.read(directory) if os.path.isdir(directory) else None
    if found is None or not found.chat:
        return dataset.load(directory, block_size)
    train, val = (load_split(directory, split, learn) for split in ("train", "val"))
    longest = max(train.longest, val.longest)
    if longest > block_size + 1:
        raise UserError(f"{directory} holds conversations of up to {longest} tokens, more than block_size + 1 = "
                        f"{block_size + 1}; train with --block_size={longest - 1}, or prepare the data again with "
                        f"--max_len={block_size + 1}")
    return ChatDataset(directory, found, train, val)


def load_split(directory, split, learn):
    """One split of a chat dataset, its files checked against each other."""
    ids = dataset.load_split(directory, split, 0)
    paths = {suffix: os.path.join(directory, f"{split}.{suffix}") for suffix in ("mask", "offsets")}
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise UserError(f"{missing[0]} is missing; prepare the chat dataset again (python prepare.py chat ...)")
    mask = np.memmap(paths["mask"], dtype=np.uint8, mode="r")
    offsets = np.fromfile(paths["offsets"], dtype="<i8").astype(np.int64)
    if not (len(mask) == len(ids) and len(offsets) >= 2 and offsets[0] == 0 and offsets[-1] == len(ids)
            and (np.diff(offsets) > 0).all()):
        raise UserError(f"{paths['mask']} and {paths['offsets']} do not match {split}.bin in {directory}; prepare "
                        f"the chat dataset again (python prepare.py chat ...)")
    return ChatSplit(ids, mask, offsets, learn)


# ---------------------------------------------------------------------- batches and the step's loss


class ChatBatchSampler(dataset.BatchSampler):
    """Random batches of whole conversations of a chat split, batch_size of them drawn with the generator (with
    replacement, as BatchSampler's windows); its state is the generator's, so a resumed run draws the same."""

    def next(self):
        import torch

        picks = torch.randint(len(self.data), (self.batch_size,), generator=self.generator)
        return self.data.rows(picks.numpy(), self.block_size, self.device)


def batch_sampler(data, batch_size, block_size, generator, device="cpu"):
    """Random batches of a split: whole conversations of a chat split, else windows (dataset.BatchSampler). A
    row holds one conversation, padded, so no conversation attends to another; y is -1 (no loss) on the padding
    and, with --chat_loss=assistant (the default), where the mask is 0."""
    sampler = ChatBatchSampler if isinstance(data, ChatSplit) else dataset.BatchSampler
    return sampler(data, batch_size, block_size, generator, device)


def split_batches(data, batch_size, block_size, device="cpu", rank=0, world_size=1):
    """A whole split once, in order (rank takes every world_size-th batch): a chat split's conversations
    batch_size at a time, else dataset.whole_split_batches' windows."""
    if not isinstance(data, ChatSplit):
        yield from dataset.whole_split_batches(data, batch_size, block_size, device, rank, world_size)
        return
    for i in range(rank * batch_size, len(data), world_size * batch_size):
        yield data.rows(np.arange(i, min(i + batch_size, len(data))), block_size, device)


def token_mean(data, accum, batch_size, world, device):
    """train.py's step loss for a ChatDataset (TokenMean); None for a token stream, whose steps average their
    micro-batches (all of one size)."""
    if not isinstance(data, ChatDataset):
        return None
    return TokenMean(accum * batch_size * data.train.targets / len(data.train), world, device)


class TokenMean:
    """A chat step's loss: the mean over every target token of the step, all micro-batches and ranks together.

    Not the mean of the micro-batches' means, which weighs a short answer's tokens more than a long one's (the bug
    TRL and Hugging Face fixed in 2024). A micro-batch's mean loss is weighed by its number of targets over
    `expected`, the targets a rank's step holds on average (so gradients keep their usual size; any constant gives
    the same step); the step's count, summed over the ranks, is known once its last micro-batch is in, and finish()
    scales the gradients (which DDP and FSDP average over the ranks) to the mean over it."""

    def __init__(self, expected, world, device):
        import torch

        self.expected, self.world = expected, world
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss summed over the targets, targets

    def weigh(self, loss, y):
        """The micro-batch's share of the step's loss, to backpropagate: loss (its mean) times its targets."""
        import torch

        targets = (y >= 0).sum()
        self.totals += torch.stack([loss.detach().double() * targets, targets.double()])
        return loss * (targets / self.expected)

    def finish(self, model):
        """After the step's last backward (every rank calls it): the gradients scaled to the mean over all the
        step's targets; returns that mean loss, the step's."""
        import torch

        from machinery import distributed

        totals, self.totals = distributed.all_reduce(self.totals), torch.zeros_like(self.totals)
        factor = self.expected * self.world.size / totals[1]
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
        return totals[0] / totals[1]
