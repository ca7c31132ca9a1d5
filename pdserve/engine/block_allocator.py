"""Pure-Python block bookkeeping of the paged KV pool (no tensors: the scheduler is tested without torch).

Blocks are placed so that a request's blocks are consecutive whenever the pool allows: a new
request starts at the first open run long enough for the tokens it expects and is promised that run
(other new requests start elsewhere), and a growing one takes the block right after its last.
Attention then reads a request's KV as one view of the pool instead of gathering it. Placement is
only a preference: when no open run is left, any free block will do, promised or not.
"""

from __future__ import annotations


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
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free
        self._open = bytearray(b"\x01") * num_blocks  # 1 = free and promised to no request
        self._promises: dict[int, int] = {}  # first block of a request -> end of the run it was promised
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

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
            if not block_ids:  # a new request: promise it the run
                self._promises[block] = block + length
                self._open[block : block + length] = bytes(length)
        self._free[block] = 0
        self._open[block] = 0
        self._num_free -= 1
        return block

    def _first_run(self, length: int) -> tuple[int, int]:
        """(start, length) of the first open run of `length` blocks, or of a shorter one, or any free block."""
        while length >= 1:
            at = self._open.find(b"\x01" * length)
            if at != -1:
                return at, length
            length //= 2
        return self._free.find(1), 1

    def free(self, block_ids: list[int]) -> None:
        """Return every block of `block_ids` to the pool and empty the list."""
        if block_ids and block_ids[0] in self._promises:
            start = block_ids[0]
            end = self._promises.pop(start)
            for b in range(start, end):  # the unused rest of its promise opens again
                if self._free[b]:
                    self._open[b] = 1
        for b in block_ids:
            self._free[b] = 1
            self._open[b] = 1
        self._num_free += len(block_ids)
        block_ids.clear()
