"""Pure-Python block bookkeeping of the paged KV pool (no tensors: the scheduler is tested without torch).

Blocks are placed so that a request's blocks are consecutive whenever the pool allows: a new
request starts at the first open run long enough for the tokens it expects and is promised that run
(other new requests start elsewhere), and a growing one takes the block right after its last.
Attention then reads a request's KV as one view of the pool instead of gathering it. Placement is
only a preference: when no open run is left, any free block will do, promised or not.

Prefix caching: a full block whose KV is computed may be named (`commit`, with its hash from
`protocol.block_hashes`); a new request then shares the named blocks of its prompt's longest cached
prefix (`match`). Blocks are reference-counted: a block goes back when its last holder frees it, and a
named one stays cached, evictable, until a request needs a block and no free one is left; the least
recently released is evicted first (a request's last blocks before its first, since prefixes are
what others share). "Used" counts blocks some request holds; evictable blocks count as free.
"""

from __future__ import annotations

from collections import OrderedDict


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return cdiv(num_tokens, block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free (held by no request, named by no hash)
        self._open = bytearray(b"\x01") * num_blocks  # 1 = free and promised to no request
        self._promises: dict[int, int] = {}  # first block of a request -> end of the run it was promised
        self._refs = [0] * num_blocks  # how many requests hold each block
        self._named: dict[int, int] = {}  # block -> its hash, for the blocks in the prefix cache
        self._by_name: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named blocks no request holds, least recent first
        self._num_free = num_blocks  # free or evictable
        self._longest_open = num_blocks  # at least as long as the longest run of open blocks (taking only shortens)
        self.num_evicted = 0  # since start
        self.changes: dict[int, bool] | None = None  # set to {} to follow the cache: name -> stored (True) or evicted

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and evictable cached ones."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - self._num_free

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix cache, held or evictable."""
        return len(self._named)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refs(self, block: int) -> int:
        """How many requests hold `block`."""
        return self._refs[block]

    def extra_needed(self, block_ids: list[int], num_tokens: int) -> int:
        """How many more blocks `block_ids` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def grow(self, block_ids: list[int], num_tokens: int, expected_tokens: int = 0) -> bool:
        """Append blocks to `block_ids` (in place) to cover `num_tokens`; all or nothing.

        `expected_tokens`: how long the request may grow, to leave it room to stay consecutive."""
        need = self.extra_needed(block_ids, num_tokens)
        if need > self._num_free:
            return False
        expected_blocks = blocks_for(max(expected_tokens, num_tokens), self.block_size)
        for _ in range(need):
            block_ids.append(self._take(block_ids, expected_blocks - len(block_ids)))
        return True

    def _take(self, block_ids: list[int], room: int) -> int:
        nxt = block_ids[-1] + 1 if block_ids else -1
        if 0 <= nxt < self.num_blocks and self._free[nxt]:
            block = nxt
        else:
            block, length = self._first_run(max(1, room))
            if block == -1:  # nothing free: the least recently used cached block goes
                block = self._evict()
            elif not block_ids:  # a new request: promise it the run
                self._promises[block] = block + length
                self._open[block : block + length] = bytes(length)
        self._free[block] = 0
        self._open[block] = 0
        self._refs[block] = 1
        self._num_free -= 1
        return block

    def _first_run(self, length: int) -> tuple[int, int]:
        """(start, length) of the first open run of `length` blocks, or of a shorter one, or any free block
        ((-1, 1) when none is free)."""
        longest = min(self._num_free, self._longest_open)
        while length > longest:  # no run that long exists: the same answer, unsought
            length //= 2
        while length >= 1:
            at = self._open.find(b"\x01" * length)
            if at != -1:
                return at, length
            self._longest_open = length - 1
            length //= 2
        return self._free.find(1), 1

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        name = self._named.pop(block)
        del self._by_name[name]
        self.num_evicted += 1
        self._changed(name, False)
        return block

    def _changed(self, name: int, stored: bool) -> None:
        if self.changes is not None:
            self.changes[name] = stored  # the last change of a name is its state

    def take_changes(self) -> tuple[list[int], list[int]]:
        """The names stored in and evicted from the cache since the last call (each as it stands now)."""
        changes, self.changes = self.changes or {}, {}
        return [n for n, s in changes.items() if s], [n for n, s in changes.items() if not s]

    def cached_names(self) -> list[int]:
        """Every name in the cache now."""
        return list(self._by_name)

    def free(self, block_ids: list[int]) -> None:
        """Release every block of `block_ids` and empty the list: a block no request holds any more goes back to
        the pool, or, named, stays cached (evictable)."""
        self._longest_open = self.num_blocks  # blocks may open again
        if block_ids and block_ids[0] in self._promises and self._refs[block_ids[0]] == 1:
            start = block_ids[0]
            end = self._promises.pop(start)
            for b in range(start, end):  # the unused rest of its promise opens again
                if self._free[b]:
                    self._open[b] = 1
        for b in reversed(block_ids):  # the last blocks become evictable first: they are evicted before the first
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            self._num_free += 1
            if b in self._named:
                self._evictable[b] = None
            else:
                self._free[b] = 1
                self._open[b] = 1
        block_ids.clear()

    # ---- the prefix cache -----------------------------------------------------------------------
    def match(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, now held by the caller (free them as any)."""
        blocks = []
        for h in hashes:
            block = self._by_name.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if not self._refs[block]:
                del self._evictable[block]
                self._num_free -= 1
            self._refs[block] += 1
        return blocks

    def commit(self, block: int, block_hash: int) -> bool:
        """Name a held, full block whose KV is computed, so that later requests may share it. False when that hash
        is cached already (another block holds the same KV: this one stays private) or the block is named."""
        if block_hash in self._by_name or block in self._named or not self._refs[block]:
            return False
        self._named[block] = block_hash
        self._by_name[block_hash] = block
        self._changed(block_hash, True)
        return True

    def cached_prefix(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, are cached (nothing is taken)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._by_name:
            n += 1
        return n
