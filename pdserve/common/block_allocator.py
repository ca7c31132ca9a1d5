"""Pure-Python block bookkeeping of the paged KV pool (no tensors: the scheduler is tested without torch)."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list of block ids. A request owns a list of block ids that covers its tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def extra_needed(self, block_ids: list[int], num_tokens: int) -> int:
        """How many more blocks `block_ids` needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.extra_needed(block_ids, num_tokens) <= len(self._free)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Append blocks to `block_ids` (in place) to cover `num_tokens`; all or nothing."""
        need = self.extra_needed(block_ids, num_tokens)
        if need > len(self._free):
            return False
        block_ids.extend(self._free.pop() for _ in range(need))
        return True

    def free(self, block_ids: list[int]) -> None:
        """Return every block of `block_ids` to the pool and empty the list."""
        self._free.extend(reversed(block_ids))
        block_ids.clear()
