"""
The engine's decoding step: its KV cache (model.KVCache's keys and values, a row, a slot, for each running
request) and the two ways a step runs the model over it. Not the model (model.py) nor the scheduler (engine.py).

- Rows: the rows that have tokens to feed, each attending over exactly its own positions (one attention
  call a row). The shapes change at every step. The CPU's way, and every prompt's (in chunks).
- Fixed: every row of the cache at once, one token each, each attending over its own positions of the cache
  (machinery/generation/decode_attention.py: over the whole cache through a mask, or over the row's own blocks). The shapes
  never change, so on CUDA the step runs as one captured graph (a launch per step instead of hundreds), and a
  row's rounding never depends on the others: the same kernels run whatever the load. CUDA's way
  (engine.Engine's `fixed`).
"""

import sys

import torch

from machinery.generation import bf16_rows, decode_attention
from model import KVCache


def cache_dtype(model, device, fixed=False, compiled=False):
    """The engine's KV cache's dtype for model on device: KVCache.dtype_for's (float32 on a CPU, where PyTorch's
    attention runs in float32), but bfloat16 where a bfloat16 model decodes row by row (not fixed), uncompiled
    (dynamo cannot trace a kernel of ours), on a CPU with AMX, and our attention kernel runs (bf16_rows.attend: the
    keys and values are bfloat16 already, so none is rounded; half the bytes of a float32 cache to read, and faster
    than PyTorch's attention: docs/benchmarks-history.md)."""
    device, config = torch.device(device), model.config
    if device.type == "cpu" and not fixed and not compiled and next(model.parameters()).dtype == torch.bfloat16 \
            and bf16_rows.chosen() and bf16_rows.attends(torch.bfloat16, config.n_embd // config.n_head,
                                                         config.block_size + 1):
        return torch.bfloat16
    return KVCache.dtype_for(model, device)


class Slots:
    """The keys and values of a model.KVCache (every layer's, up to block_size positions and a spare) for `rows`
    requests, each at its own length. A running request holds one row from its first token to its last; the next
    request reuses it, so the cache's memory is that of `rows` rows whatever the number of requests. fixed: rounded
    up to what the step's attention reads whole (decode_attention.ALIGN) and zeroed, since a fixed step reads
    positions past a row's (masked: but 0 x NaN would still be NaN); else empty, as a row only reads what it wrote."""

    def __init__(self, config, rows, dtype, device, fixed=False, attention="full"):
        length = config.block_size + 1
        if fixed:
            align = decode_attention.ALIGN[attention]
            length = -(-length // align) * align
        cache = KVCache(config, rows, dtype, device, length, torch.zeros if fixed else torch.empty)
        self.kv, self.k, self.v = cache.kv, cache.k, cache.v
        self.rows, self.length, self.device = rows, length, torch.device(device)
        self.block_size = config.block_size
        self.free = list(range(rows))[::-1]
        # one row's attention by our kernel (a row of one new token, on a CPU), where it runs on this cache
        cpu = self.device.type == "cpu" and not fixed
        self.attend = bf16_rows.attend if cpu and bf16_rows.attends(dtype, self.k[0].size(-1), length) else None

    def copy_out(self, slot, start, dest):
        """Copy the keys and values of a slot's positions start.. into dest (2, n_layer, n_head, T, head size)."""
        end = start + dest.size(-2)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            dest[0, layer].copy_(k[slot, :, start:end])
            dest[1, layer].copy_(v[slot, :, start:end])

    def copy_in(self, slot, start, src):
        """Write src (2, n_layer, n_head, T, head size) as the keys and values of a slot's positions start.."""
        end = start + src.size(-2)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[slot, :, start:end] = src[0, layer]
            v[slot, :, start:end] = src[1, layer]


class Rows:
    """The kv_cache of a pass over some rows: T new tokens for each of some slots, each after its own length.
    Attention runs row by row over exactly the row's positions (PyTorch's batched attention kernels round a
    row differently depending on the other rows, and a request's tokens must not depend on what else runs)."""

    def __init__(self, slots, rows):
        self.slots, self.rows = slots, rows  # [(slot, length)]

    def positions(self, T, device):
        """The positions of T new tokens: (B, T), each row's own (arange, not range(T): compiled, T stays symbolic and
        one graph serves every prompt length)."""
        starts = torch.tensor([length for _, length in self.rows], device=device)
        return starts[:, None] + torch.arange(T, device=device)

    def attend(self, layer, q, k, v, heads):
        """Store each row's k, v (B, nh, T, hs) in its slot; the heads' attention of each row over its positions."""
        keys, values, T = self.slots.k[layer], self.slots.v[layer], q.size(2)
        out = []
        for i, (slot, length) in enumerate(self.rows):
            if T == 1 and self.slots.attend is not None:  # (it stores the new key and value itself)
                out.append(self.slots.attend(q[i], k[i], v[i], keys[slot], values[slot], length + 1))
            else:  # as generate's cache does, on the slot's row alone
                out.append(KVCache.attend_at(keys[slot:slot + 1], values[slot:slot + 1], length, q[i:i + 1],
                                             k[i:i + 1], v[i:i + 1], heads))
        return torch.cat(out) if len(out) > 1 else out[0]

    def kernel_rows(self, layer):
        """Each row's (keys, values, positions after its new one) in layer, for a pass of one new position a row
        that our kernel computes (engine.KernelBlock), where the cache is one that our attention reads; else None."""
        if self.slots.attend is None:
            return None
        keys, values = self.slots.k[layer], self.slots.v[layer]
        return [(keys[slot], values[slot], length + 1) for slot, length in self.rows]

    def advance(self, T):
        pass  # the engine keeps each row's length


class Fixed:
    """The kv_cache of a fixed-shape step: one token for every row of the cache, at positions `pos` (rows,),
    a tensor on the device that each step fills in (so that one captured graph serves every step). attention: how
    the rows attend (decode_attention.KINDS); compiled: the step runs torch.compiled."""

    def __init__(self, slots, attention="full", compiled=False):
        self.slots, self.compiled = slots, compiled
        self.pos = torch.zeros(slots.rows, dtype=torch.long, device=slots.device)
        _, heads, length, _ = slots.k[0].shape
        rows = torch.arange(slots.rows, device=slots.device)
        # where each row's heads begin in a layer's keys seen as (rows * heads * length, head size)
        self.starts = (rows[:, None] * heads + torch.arange(heads, device=slots.device)) * length
        self.at = None
        self.use(attention)

    def use(self, attention):
        self.attention = decode_attention.make(attention, self.slots, self.pos, self.compiled)

    def positions(self, T, device):
        """(rows, 1): each row's position; each row then sees the positions up to it (the attention's mask)."""
        self.at = self.starts + self.pos[:, None]  # (rows, heads): where each row's heads write their new key
        self.attention.prepare()
        # a row that does not decode in this step may stand at block_size (ended, or its window to be encoded
        # again): it writes at that spare position, and its logits, which nobody reads, take the last embedding
        return self.pos.clamp(max=self.slots.block_size - 1)[:, None]

    def attend(self, layer, q, k, v, heads):
        self.store(layer, k[:, :, 0], v[:, :, 0])
        return self.attention(q, self.slots.k[layer], self.slots.v[layer], heads)

    def store(self, layer, k, v):
        """Each row's new key and value (rows, heads, head size) at its position in layer's cache: one indexed
        write for both where they are views of one tensor (the model's qkv projection, split), else one each."""
        kv = self.slots.kv[layer]
        k, v = k.to(kv.dtype), v.to(kv.dtype)  # (the CPU's cache is float32: cache_dtype)
        flat = kv.view(2, -1, kv.size(-1))  # (2, rows * heads * length, head size)
        both = None if torch.compiler.is_compiling() else joint(k, v)  # (inductor fuses the writes itself)
        if both is not None:
            flat[:, self.at] = both
        else:
            flat[0][self.at], flat[1][self.at] = k, v

    def advance(self, T):
        pass


def joint(k, v):
    """k and v as one view (2, *k.shape) where v lies at a fixed distance after k in the same memory with the same
    strides (two slices of one tensor), else None."""
    apart = v.storage_offset() - k.storage_offset()
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() or k.stride() != v.stride() or apart <= 0:
        return None
    return k.as_strided((2, *k.shape), (apart, *k.stride()))


# what a failed capture says on stderr (bench.py refuses to report an eager figure as the graph's)
EAGER_NOTE = "note: the decoding step runs eagerly, without a CUDA graph"
# what flex attention that cannot run says, once, before the step decodes with full attention instead
FLEX_NOTE = "note: decode_attention=flex cannot run here; the decoding step attends with full"


class FixedStep:
    """The model's fixed-shape decoding step: logits (rows, 1, V) of one token per row of the cache, torch.compiled
    when asked (static shapes: one graph, whatever the lengths), its rows attending as `attention` says
    (decode_attention.KINDS). On CUDA it is captured as a graph at the first call and replayed after (eager where
    capture fails: said once). Flex attention that fails at the first call (to build, compile or capture) gives way
    to full attention: said once."""

    def __init__(self, model, slots, compile=False, attention="full"):
        self.model, self.compile, self.fixed = model, compile, Fixed(slots, attention, compile)
        self.idx = torch.zeros(slots.rows, 1, dtype=torch.long, device=slots.device)
        self.graph, self.logits = None, None
        self.capture = slots.device.type == "cuda"
        self.started = False
        self._run = self._compiled()

    def __call__(self, idx, pos):
        """Run the step on tokens idx (rows, 1) at positions pos (rows,), on the device (or the CPU: copied from
        pageable memory, the host then waits for the device's queue)."""
        self.idx.copy_(idx, non_blocking=True)
        self.fixed.pos.copy_(pos, non_blocking=True)
        if not self.started:
            self.started = True
            return self._first()
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits

    def _first(self):
        """The first step: flex attention that cannot run gives way to full, which then captures (or not) anew."""
        try:
            return self._start()
        except Exception as e:
            if self.fixed.attention.kind == "full":
                raise
            print(f"{FLEX_NOTE} ({said(e)})", file=sys.stderr)
            self.fixed.use("full")
            self._run = self._compiled()
            return self._start()

    def _start(self):
        """Capture the step as a graph where it is one (self.capture), then run it."""
        if self.capture:
            stream = torch.cuda.current_stream(self.idx.device)
            try:
                with torch.cuda.device(self.idx.device):  # (the thread's current GPU may be another: cuda:N)
                    self._capture()
            except Exception as e:  # e.g. a model whose kernels cannot be captured, or that did not compile
                # a failed capture can leave its stream current (torch.cuda.graph ends the capture first); then the
                # step runs eagerly, as the model itself, unless flex attention was in it: full's capture first
                torch.cuda.set_stream(stream)
                self.graph = None
                if self.fixed.attention.kind != "full":
                    raise
                self._run = self._eager
                print(f"{EAGER_NOTE} ({said(e)})", file=sys.stderr)
            self.capture = False
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits

    def _compiled(self):
        return torch.compile(self._eager, fullgraph=True, dynamic=False) if self.compile else self._eager

    def _eager(self):
        return self.model(self.idx, kv_cache=self.fixed)[0]

    def _capture(self):
        """Warm up on a side stream (lazy initialisations must not happen inside the capture), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()


def said(e):
    """An exception in a note's parentheses: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
