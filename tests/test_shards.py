"""shards.py: llm.c's shard format read by hand, bad shards, token-id checks, windows across shards;
meta.py: nanoGPT's meta.pkl loads (as plain data), a pickle that would run code is refused."""

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from conftest import assert_one_line
from machinery.data import dataset, shards
from machinery.data.dataset import BatchSampler
from machinery.errors import UserError
from machinery.data.meta import from_path as read_meta_file


def test_header_format_read_by_hand(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 1234, 7], dtype=np.int64)
    path = tmp_path / "x_train_000001.bin"
    shards.write_shard(path, tokens)
    raw = path.read_bytes()
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240520, 1, 6) and not any(header[3:])
    assert struct.unpack("<6H", raw[1024:]) == tuple(tokens.tolist())
    assert len(raw) == 1024 + 2 * 6
    assert shards.read_header(path) == 6
    assert shards.open_tokens(path).tolist() == tokens.tolist()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    umask = os.umask(0o22)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any file the user writes


def test_write_shard_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError):
        shards.write_shard(tmp_path / "x.bin", [1, 65536])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage, words", [
    (lambda raw: struct.pack("<i", 12345) + raw[4:], ["magic 12345"]),
    (lambda raw: raw[:4] + struct.pack("<i", 2) + raw[8:], ["version 2"]),
    (lambda raw: raw[:-2], ["1030 bytes", "4 tokens"]),
    (lambda raw: raw + b"\0\0", ["1034 bytes", "4 tokens"]),
    (lambda raw: raw[:100], ["100 bytes", "shorter than a shard header"]),
])
def test_bad_shards_stop_with_one_line_naming_the_file(tmp_path, damage, words):
    path = tmp_path / "x_val_000000.bin"
    shards.write_shard(path, [1, 2, 3, 4])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError) as e:
        shards.read_header(path)
    assert_one_line(e, path, *words)
    with pytest.raises(UserError):
        shards.open_tokens(path)


def test_check_max_token_names_file_id_and_position(tmp_path):
    tokens = np.arange(100, dtype=np.uint16) % 50
    tokens[73] = 50257
    path = tmp_path / "x_train_000001.bin"
    shards.write_shard(path, tokens)
    with pytest.raises(UserError) as e:
        shards.check_max_token(path, 50257, chunk=16)  # several chunks: the id sits in the 5th
    assert_one_line(e, path, "token id 50257", "position 73")
    assert shards.check_max_token(path, 50258, chunk=16) == 50257
    with pytest.raises(UserError) as e:
        shards.check_max_token(tokens, 50000, chunk=7)
    assert_one_line(e, "token array", "50257", "position 73")
    tokens[73] = 3
    assert shards.check_max_token(tokens, 50, chunk=7) == 49


def test_list_shards_both_namings_in_number_order(tmp_path):
    for name in ["fineweb_train_000010.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin",
                 "my_data_train_000001.bin", "notes.txt", "train.bin", "x_test_000001.bin"]:
        (tmp_path / name).write_bytes(b"")
    found = shards.list_shards(tmp_path)
    assert [os.path.basename(p) for p in found["train"]] == [
        "my_data_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000010.bin"]
    assert [os.path.basename(p) for p in found["val"]] == ["fineweb_val_000000.bin"]
    assert shards.list_shards(tmp_path / "missing") == {"train": [], "val": []}


def make_split(tmp_path, lengths=(300, 50, 400, 250)):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50257, n).astype(np.uint16) for n in lengths]
    for i, part in enumerate(parts):
        shards.write_shard(tmp_path / f"d_train_{i + 1:06d}.bin", part)
    shards.write_shard(tmp_path / "d_val_000000.bin", parts[0][:100])
    return np.concatenate(parts)


def test_sharded_tokens_index_like_their_concatenation(tmp_path):
    whole = make_split(tmp_path)
    data = dataset.load_split(tmp_path, "train", block_size=8)
    assert len(data) == len(whole) == 1000 and data.shape == (1000,)
    idx = np.random.default_rng(1).integers(0, 1000, (7, 9))
    assert np.array_equal(data[idx], whole[idx]) and data[idx].dtype == np.uint16
    assert np.array_equal(data[290:360], whole[290:360])  # across two boundaries (300, 350)
    assert data[349] == whole[349] and data[-1] == whole[-1]
    with pytest.raises(IndexError):
        data[np.array([1000])]


def test_batch_sampler_over_shards_is_deterministic_and_covers_all_shards(tmp_path):
    whole = make_split(tmp_path)
    data = dataset.load_split(tmp_path, "train", block_size=16)

    def batches(tokens, seed, n):
        sampler = BatchSampler(tokens, 8, 16, torch.Generator().manual_seed(seed))
        return sampler, [sampler.next() for _ in range(n)]

    _, from_shards = batches(data, 5, 30)
    _, from_array = batches(whole, 5, 30)  # the same draws as one concatenated train.bin
    for (x, y), (x2, y2) in zip(from_shards, from_array):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(batches(data, 5, 30)[1][7][0], from_shards[7][0])
    assert not torch.equal(batches(data, 6, 1)[1][0][0], from_shards[0][0])
    # the windows' starts (the sampler's draws, repeated) fall in every shard, some windows cross a boundary
    gen = torch.Generator().manual_seed(5)
    drawn = torch.cat([torch.randint(len(whole) - 16, (8,), generator=gen) for _ in range(30)]).numpy()
    assert set(np.searchsorted(data.ends, drawn, side="right")) == {0, 1, 2, 3}
    assert any(np.searchsorted(data.ends, drawn, side="right") != np.searchsorted(data.ends, drawn + 16, side="right"))
    # exact resume: the sampler's state is its generator's state
    sampler, _ = batches(data, 9, 3)
    state = sampler.state_dict()
    after = [sampler.next() for _ in range(3)]
    fresh = BatchSampler(data, 8, 16, torch.Generator())
    fresh.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(after, [fresh.next() for _ in range(3)]):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_load_split_errors(tmp_path):
    with pytest.raises(UserError) as e:
        dataset.load_split(tmp_path, "train", 8)
    assert_one_line(e, tmp_path, "_train_")
    make_split(tmp_path, lengths=(5, 3))
    with pytest.raises(UserError) as e:
        dataset.load_split(tmp_path, "train", 8)
    assert_one_line(e, "8 tokens", "block_size")


NANOGPT_META = {"vocab_size": 3, "itos": {0: "\n", 1: "a", 2: "é"}, "stoi": {"\n": 0, "a": 1, "é": 2}}


@pytest.mark.parametrize("protocol", [0, 2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_nanogpt_meta_pkl_loads(tmp_path, protocol):
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps(NANOGPT_META, protocol=protocol))
    got = read_meta_file(str(path))
    assert (got.tokenizer, got.vocab_size, got.chars) == ("char", 3, "\naé")


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"vocab_size": 3, "x": _Exploit(marker)}))
    assert b"system" in path.read_bytes()
    with pytest.raises(UserError) as e:
        read_meta_file(str(path))
    assert_one_line(e, path, "refusing", "system")
    assert not marker.exists()


@pytest.mark.parametrize("content, words", [(b"not a pickle", ["not a readable pickle"]),
                                            (pickle.dumps([1, 2]), ["not a nanoGPT character meta.pkl"])])
def test_other_bad_meta_pkl(tmp_path, content, words):
    path = tmp_path / "meta.pkl"
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        read_meta_file(str(path))
    assert_one_line(e, path, *words)
