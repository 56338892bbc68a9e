"""
How the rows of the fixed decoding step (decode.Fixed) attend over the KV cache: the `decode_attention` setting of
engine.Engine, sample.py and serve.py, its two ways, and the bytes of keys and values each way reads (kv_bytes); and
where the fixed step's settings apply (check, check_ahead: decode_ahead's).

- full: PyTorch's SDPA over the whole cache, each row masked to its own positions: every row reads every position.
- flex: FlexAttention with a block mask built on the device from the rows' positions (Flex.prepare): a row reads
  its own blocks only, so its bytes grow with its own length.

Either way the step's shapes never change, so its kernels never do, and a row's result depends on its own
positions only: masked keys weigh exactly 0, and the order of a row's sums follows from its own block count.
Not here: the fixed step itself and its CUDA graph (decode.py).
"""

import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from machinery.errors import UserError

KINDS = ("full", "flex")
BLOCK = 128  # positions of a flex KV block (flex's default; its decoding kernel tiles a block in 64 or 128 keys)
ALIGN = {"full": 64, "flex": BLOCK}  # a fixed cache's positions are a multiple of this: SDPA's kernels tile 64 keys,
# flex reads whole blocks


def check(kind, fixed=True):
    """A one-line error for a decode_attention that cannot apply: not one of KINDS, or flex where decoding does not
    run in the fixed step (fixed False: the CPU's engine decodes row by row, each row over its own positions)."""
    if kind not in KINDS:
        raise UserError(f"decode_attention must be full or flex, got {kind!r}")
    if kind == "flex" and not fixed:
        raise UserError("decode_attention=flex applies to CUDA's fixed decoding step only (this device decodes row "
                        "by row, each row over its own positions); use --device=cuda or leave it out")


def default(kind, device, server):
    """kind, or where it is None the command's: flex for a server on CUDA, which compiles flex's kernel once at its
    start (~10 s on an H200) and then decodes a lone request ~2x as fast as full (as many rows as fast); full for
    sample.py, whose 500 tokens would gain less than those 10 s (BENCHMARKS.md), and on a CPU (check)."""
    if kind is not None:
        return kind
    return "flex" if server and torch.device(device).type == "cuda" else "full"


def check_ahead(ahead, fixed=True):
    """A one-line error for decode_ahead asked for where decoding does not run in the fixed step."""
    if ahead and not fixed:
        raise UserError("decode_ahead applies to CUDA's fixed decoding step only (this device decodes row by row); "
                        "use --device=cuda or leave it out")


def make(kind, slots, pos, compiled=False):
    """The attention of a fixed step over slots' cache for positions pos (rows,), the step's tensor. compiled: the
    whole step is torch.compiled (flex is then compiled with it)."""
    check(kind)
    return Full(slots, pos) if kind == "full" else Flex(slots, pos, compiled)


class Full:
    """Masked SDPA over the whole cache (the model's own attention call, with a mask of each row's positions)."""

    kind = "full"

    def __init__(self, slots, pos):
        self.pos, self.length = pos, slots.length
        self.span = torch.arange(slots.length, device=slots.device)
        self.mask = None

    def prepare(self):
        """This step's mask from pos: each row sees the positions up to its own."""
        self.mask = (self.span[None, :] <= self.pos[:, None])[:, None, None, :]  # (rows, 1, 1, length)

    def __call__(self, q, keys, values, heads):
        return heads(q, keys, values, self.mask)

    def positions_read(self):
        """(rows,): the cache positions each row's attention reads this step: all of them."""
        return torch.full_like(self.pos, self.length)


class Flex:
    """FlexAttention over each row's own blocks, through a block mask built at every step (prepare), with tensor
    ops alone (no wait for the host: it is captured in the step's CUDA graph). On CUDA flex runs compiled (its
    decoding kernel splits a row's keys across thread blocks); on the CPU eagerly, PyTorch's unfused reference,
    for tests (compiling it there is slow: docs/benchmarks-history.md)."""

    kind = "flex"

    def __init__(self, slots, pos, compiled=False):
        if slots.length % BLOCK:
            raise ValueError(f"a flex cache holds a multiple of {BLOCK} positions, not {slots.length}")
        self.pos, self.length, n = pos, slots.length, slots.length // BLOCK
        shape = (slots.rows, 1, 1)  # (rows, heads, query blocks): one mask for every head, one query block
        self.one = torch.ones(shape, dtype=torch.int32, device=slots.device)
        self.order = torch.arange(n, dtype=torch.int32, device=slots.device).expand(*shape, n).contiguous()
        self.block_mask = None

        def before(b, h, q_idx, kv_idx):  # (the mask of a row's last block: the positions up to its own)
            return kv_idx <= pos[b]
        self.mask_mod = before
        if compiled:  # inside the compiled step: dynamo traces it with the rest
            self.flex = flex_attention
        elif slots.device.type == "cuda":  # compiled alone: flex's fused kernels (eager, it is a slow reference)
            self.flex = torch.compile(flex_attention, dynamic=False)
        else:
            self.flex = uncompiled_flex

    def prepare(self):
        """This step's block mask from pos: a row's blocks before its position's are full (read without a mask);
        its position's block is its one partial block (read through mask_mod). kv_indices holds that block in every
        entry: the kernel reads the first kv_num_blocks (1) of them, and may load the others' indices."""
        blocks = (self.pos // BLOCK).to(torch.int32)[:, None, None]  # (rows, 1, 1): the row's full blocks
        self.block_mask = BlockMask.from_kv_blocks(
            self.one, blocks[..., None].expand_as(self.order).contiguous(), blocks, self.order, BLOCK_SIZE=BLOCK,
            mask_mod=self.mask_mod, seq_lengths=(1, self.length), compute_q_blocks=False)

    def __call__(self, q, keys, values, heads):
        out = self.flex(q.to(keys.dtype), keys, values, block_mask=self.block_mask)
        return out.to(q.dtype)  # (the CPU's cache is float32 whatever the model's dtype: decode.cache_dtype)

    def positions_read(self):
        """(rows,): the cache positions each row's attention reads this step, from the block mask: its blocks (the
        partial one and the full ones) times BLOCK."""
        mask = self.block_mask
        return (mask.kv_num_blocks + mask.full_kv_num_blocks)[:, 0, 0].long() * BLOCK


def uncompiled_flex(*args, **kwargs):
    """flex_attention uncompiled, without the warning that it is (expected where it runs so: the CPU's tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def kv_bytes(attention, slots):
    """(rows,): the bytes of keys and values each row of a fixed step reads, over every layer, at the positions the
    attention was last prepared for: positions read x heads x head size x 2 (keys and values) x bytes a value x
    layers."""
    _, heads, _, head_size = slots.k[0].shape
    return attention.positions_read() * heads * head_size * 2 * slots.k[0].element_size() * len(slots.k)
