"""BlockManager: owns the KV pages of one pool as plain integers (no tensors).

A page (block) holds block_size tokens of every layer's K and V for one sequence. Sequences keep
their own block tables (list of page ids, in token order); the manager hands pages out from a
free list and takes them back. Reference counts are kept per page so that sharing (prefix
caching, forking) can be added without changing the invariant checked by `check_invariants`.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol


class HasBlockTable(Protocol):
    block_table: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # pages that went back to the free list since the model runner last drained this list
        # (formats with state per page, such as tiers, forget it then)
        self.freed_since_drain: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Pages `seq` still needs so that its table covers its first num_tokens tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    def allocate(self, seq: HasBlockTable, num_tokens: int) -> bool:
        """Grow seq's table to cover num_tokens tokens. All or nothing: False if pages ran out."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"page {block} on the free list is still referenced"
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: HasBlockTable) -> None:
        """Return all of seq's pages (newest first, so recently used pages are reused last)."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"page {block} freed twice")
            if self._ref_counts[block] == 0:
                self._free.append(block)
                self.freed_since_drain.append(block)
        seq.block_table.clear()

    def drain_freed(self) -> list[int]:
        freed, self.freed_since_drain = self.freed_since_drain, []
        return freed

    def check_invariants(self, live: Iterable[HasBlockTable]) -> None:
        """Every page is either free or owned, never both, never twice; raises AssertionError."""
        owners = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice on the free list"
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], (
                f"page {block}: {owners[block]} owners but ref count {self._ref_counts[block]}")
            assert (block in free) == (owners[block] == 0), (
                f"page {block}: free={block in free} but {owners[block]} owners")
