"""
The engine's prefix cache: the keys and values of prompts' whole prefill chunks, kept for the next request
that begins with the same tokens (the next turn of a conversation, the same system prompt, the other
choices of a request), and the rows of paused streams while they wait for their readers.

The engine encodes a prompt in chunks of a fixed size from its first token, so a whole chunk's keys and values
depend only on the tokens up to its end: what is kept is bit for bit what a recomputation would give. A part of a
chunk is never kept (a pass over fewer tokens may round otherwise). Entries form a tree (SGLang's radix tree, over
whole chunks) under a root per cache_salt (different salts share nothing: a hit is visible in timing), in a pool of
blocks allocated once (vLLM's block pool): never more than its budget. Not here: when the engine stores, takes
or parks (engine.py), the rows' memory (decode.Slots).
"""

import collections

import torch


class Node:
    """A cached chunk: its tokens, its block of the pool, the chunks cached after it."""

    def __init__(self, tokens, block, parent):
        self.tokens, self.block, self.parent = tokens, block, parent
        self.children = {}


class PrefixCache:
    """Whole chunks of `chunk` tokens of prompts, and parked rows, in blocks of `budget_mb` MB at most, over the
    engine's Slots (decode.py: keys and values are copied between its rows and the pool's blocks).

    When a block is needed and none is free, the least recently used leaf is evicted (OrderedDict's order, with
    every node kept after its descendants, so the oldest entry is always a leaf). A parked row (a paused stream
    that gave its slot to a waiting request) holds blocks of its own until it resumes; those are never evicted."""

    def __init__(self, slots, chunk, budget_mb):
        rows, n_head, _, head_size = slots.k[0].shape
        self.slots, self.chunk = slots, chunk
        shape = (2, len(slots.k), n_head, chunk, head_size)
        self.block_bytes = 2 * len(slots.k) * n_head * chunk * head_size * slots.k[0].element_size()
        blocks = int(budget_mb * 2**20) // self.block_bytes
        # torch.empty: pages are touched only as blocks are filled
        self.pool = torch.empty((blocks, *shape), dtype=slots.k[0].dtype, device=slots.device)
        self.free = list(range(blocks))[::-1]
        self.roots = collections.defaultdict(lambda: Node((), None, None))  # a root per cache_salt
        self.lru = collections.OrderedDict()  # Node -> None, least recently used first, descendants before
        self.parked = {}  # owner -> its blocks
        self.lookups = self.hits = self.tokens_saved = self.evictions = 0

    @property
    def blocks(self):
        return len(self.pool)

    def _path(self, salt, ids, most):
        """The cached nodes of ids' whole chunks, from the first, for `most` tokens at most."""
        node, path = self.roots[salt], []
        for start in range(0, most - self.chunk + 1, self.chunk):
            node = node.children.get(tuple(ids[start:start + self.chunk]))
            if node is None:
                break
            path.append(node)
        return path

    def _touch(self, path):
        for node in reversed(path):  # deepest first: every node stays after its descendants
            self.lru.move_to_end(node)

    def cached(self, salt, ids, most):
        """Tokens of ids (whole chunks, `most` at most) that the cache holds."""
        return len(self._path(salt, ids, most)) * self.chunk

    def take(self, salt, ids, have, most, slot, count=True):
        """Copy into slot the cached chunks of ids after its first `have` tokens (which it holds: a multiple of the
        chunk), up to `most` tokens; the tokens copied. count: a request's lookup (the statistics)."""
        path = self._path(salt, ids, most)
        self._touch(path)
        for i in range(have // self.chunk, len(path)):
            self.slots.copy_in(slot, i * self.chunk, self.pool[path[i].block])
        got = max(0, len(path) * self.chunk - have)
        if count:
            self.lookups += have == 0
            self.hits += got > 0 and have == 0
            self.tokens_saved += got
        return got

    def store(self, salt, ids, slot):
        """Keep the last chunk of ids (a multiple of the chunk, all of it in slot), after the prefix before it;
        nothing when that prefix is not cached (evicted meanwhile) or no block can be had."""
        path = self._path(salt, ids, len(ids) - self.chunk)
        if len(path) * self.chunk != len(ids) - self.chunk:
            return
        parent = path[-1] if path else self.roots[salt]
        tokens = tuple(ids[-self.chunk:])
        node = parent.children.get(tokens)
        if node is None:
            block = self._block(keep=path)
            if block is None:
                return
            self.slots.copy_out(slot, len(ids) - self.chunk, self.pool[block])
            node = parent.children[tokens] = Node(tokens, block, parent)
            self.lru[node] = None
        self._touch(path + [node])

    def _block(self, keep=()):
        """A free block, evicting the least recently used entry if needed (not one of keep); None if none can be."""
        if not self.free:
            oldest = next((n for n in self.lru if n not in keep), None)
            if oldest is None or oldest.children:
                return None
            del self.lru[oldest]
            del oldest.parent.children[oldest.tokens]
            self.free.append(oldest.block)
            self.evictions += 1
        return self.free.pop()

    def park(self, owner, slot, length):
        """Keep the first `length` positions of slot for owner (until unpark or drop); False when the budget cannot
        hold them (cached chunks are evicted for them, parked rows never)."""
        need = -(-length // self.chunk)
        if need > len(self.free) + len(self.lru):
            return False
        blocks = [self._block() for _ in range(need)]
        for i, block in enumerate(blocks):
            end = min(length, (i + 1) * self.chunk)
            self.slots.copy_out(slot, i * self.chunk, self.pool[block, :, :, :, :end - i * self.chunk])
        self.parked[owner] = (blocks, length)
        return True

    def unpark(self, owner, slot):
        """Write owner's parked positions into slot, and free their blocks."""
        blocks, length = self.parked.pop(owner)
        for i, block in enumerate(blocks):
            end = min(length, (i + 1) * self.chunk)
            self.slots.copy_in(slot, i * self.chunk, self.pool[block, :, :, :, :end - i * self.chunk])
        self.free += blocks

    def drop(self, owner):
        """Free owner's parked blocks (it ended while parked)."""
        if owner in self.parked:
            self.free += self.parked.pop(owner)[0]

    def stats(self):
        """What the cache has done and holds: lookups and hits (requests that reused a prefix), tokens saved,
        evictions, entries, parked rows, and bytes held (of the budget)."""
        used = self.blocks - len(self.free)
        return {"lookups": self.lookups, "hits": self.hits, "tokens_saved": self.tokens_saved,
                "evictions": self.evictions, "entries": len(self.lru), "parked": len(self.parked),
                "bytes_held": used * self.block_bytes, "bytes_budget": self.blocks * self.block_bytes}
