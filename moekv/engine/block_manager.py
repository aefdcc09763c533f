"""BlockManager: owns the KV pages of one pool as plain integers (no tensors).

A page (block) holds block_size tokens of every layer's K and V for one sequence. Sequences keep
their own block tables (list of page ids, in token order); the manager hands pages out from a
free list and takes them back, counting references per page.

Prefix caching (enable_prefix_caching): a full page of prompt tokens, once computed, is indexed by
a chained content hash (the hash of its parent page's hash and its own token ids; the chain's root
hashes whatever else decides a page's bytes: the model, the KV format and its options). A later
sequence whose prompt starts with the same full pages takes those pages into its table (one more
reference each) instead of computing them again. A cached page that no sequence references any
more is kept, still indexed, on an LRU list; it counts as free, and is evicted (its index entry
dropped, its page handed out afresh) only when the pool needs room, least recently freed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Iterable, Protocol


class HasBlockTable(Protocol):
    block_table: list[int]


class HasPrompt(HasBlockTable, Protocol):
    prompt_token_ids: list[int]
    page_hashes: list[bytes]  # filled by BlockManager.page_hashes, once per sequence


def root_hash(*parts: object) -> bytes:
    """The chain's root for a pool: a digest of what, besides the tokens, decides a page's contents."""
    return hashlib.sha256(repr(parts).encode()).digest()


def chain_hashes(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hash of each full page of token_ids: page i's is sha256(page i-1's hash, its ids)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[start:start + block_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 cache_salt: bytes = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # pages that went back to the free list since the model runner last drained this list
        # (formats with state per page, such as tiers, forget it then)
        self.freed_since_drain: list[int] = []
        # prefix caching: content hash <-> page, and the unreferenced cached pages, LRU first
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_root = root_hash(block_size, cache_salt)
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # vLLM's counters, in tokens: prompt tokens looked up, and of those found cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Pages allocate may hand out: free ones and cached ones nobody references (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Pages indexed by the prefix cache (referenced or not)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Pages `seq` still needs so that its table covers its first num_tokens tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    # -- prefix cache ------------------------------------------------------------------------
    def page_hashes(self, seq: HasPrompt) -> list[bytes]:
        """The chained hashes of seq's full prompt pages (computed on first use, kept on the sequence)."""
        n = len(seq.prompt_token_ids) // self.block_size
        if len(seq.page_hashes) != n:
            seq.page_hashes = chain_hashes(self.cache_root, seq.prompt_token_ids, self.block_size)
        return seq.page_hashes

    def find_cached_prefix(self, seq: HasPrompt) -> list[int]:
        """Pages holding the longest cached prefix of seq's prompt, in order (nothing changes). At most
        (prompt length - 1) // block_size pages: at least one prompt token is left to compute, so
        the step that finishes the prompt has its logits, and it writes only into seq's own pages."""
        if not self.enable_prefix_caching:
            return []
        limit = (len(seq.prompt_token_ids) - 1) // self.block_size
        pages = []
        for h in self.page_hashes(seq)[:limit]:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def register_computed(self, seq: HasPrompt, start: int, end: int) -> None:
        """A step computed seq's tokens start..end-1 into its pages: index the full prompt pages it
        completed. A page whose content another page already holds stays unindexed (freed as usual)."""
        n_prompt = len(seq.prompt_token_ids)
        if not self.enable_prefix_caching or start >= n_prompt:
            return
        first, n = start // self.block_size, min(end, n_prompt) // self.block_size
        hashes = self.page_hashes(seq)
        for i in range(first, n):
            page, h = seq.block_table[i], hashes[i]
            if page in self._hash_of or h in self._page_of:
                continue
            self._page_of[h] = page
            self._hash_of[page] = h

    def forget(self, seq: HasBlockTable) -> None:
        """Drop seq's pages from the index (their contents are not trusted: its step failed)."""
        for page in seq.block_table:
            h = self._hash_of.pop(page, None)
            if h is not None:
                del self._page_of[h]
                self._evictable.pop(page, None)  # (held by seq, so never on it; kept for safety)

    def _uncache(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]

    def _take_free_page(self) -> int:
        """A page for new contents: a free one, else the least recently used unreferenced cached one."""
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        self._uncache(page)
        self.freed_since_drain.append(page)  # its old contents are gone: formats forget its state
        return page

    # -- allocate / free ---------------------------------------------------------------------
    def allocate(self, seq: HasBlockTable, num_tokens: int, cached: list[int] = ()) -> bool:
        """Grow seq's table to cover num_tokens tokens. All or nothing: False if pages ran out.

        cached: pages of a cached prefix (find_cached_prefix) that start seq's empty table; each
        takes one more reference, and only the pages beyond them are new."""
        if cached:
            if seq.block_table:
                raise ValueError("a cached prefix can only start an empty block table")
            if any(page not in self._hash_of for page in cached):
                raise ValueError("allocate got a cached prefix page that is not in the prefix cache")
        needed = max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table) - len(cached))
        revived = sum(1 for page in cached if page in self._evictable)
        if needed > self.num_free_blocks - revived:
            return False
        for page in cached:
            if self._ref_counts[page] == 0:
                del self._evictable[page]
            self._ref_counts[page] += 1
            seq.block_table.append(page)
        for _ in range(needed):
            block = self._take_free_page()
            assert self._ref_counts[block] == 0, f"page {block} on the free list is still referenced"
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: HasBlockTable) -> None:
        """Return all of seq's pages (newest first, so recently used pages are reused last, and a
        cached prefix's last pages are evicted before its first ones)."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"page {block} freed twice")
            if self._ref_counts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None  # most recently used end
                else:
                    self._free.append(block)
                    self.freed_since_drain.append(block)
        seq.block_table.clear()

    def drain_freed(self) -> list[int]:
        freed, self.freed_since_drain = self.freed_since_drain, []
        return freed

    def check_invariants(self, live: Iterable[HasBlockTable]) -> None:
        """Every page is owned (ref count = owners), free, or cached and unreferenced: exactly one,
        never twice; the prefix index maps hashes and pages one to one. Raises AssertionError."""
        owners = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a page appears twice on the free list"
        assert not free & set(self._evictable), "a page is both free and cached"
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], (
                f"page {block}: {owners[block]} owners but ref count {self._ref_counts[block]}")
            unowned = block in free or block in self._evictable
            assert unowned == (owners[block] == 0), (
                f"page {block}: free={block in free}, cached={block in self._evictable} but {owners[block]} owners")
        assert len(self._page_of) == len(self._hash_of), "the prefix index is not one to one"
        for page, h in self._hash_of.items():
            assert self._page_of.get(h) == page, f"page {page}: its hash maps elsewhere"
            assert page not in free, f"page {page} is free but still indexed"
        for page in self._evictable:
            assert page in self._hash_of, f"page {page} is on the cached list but not indexed"
