"""BlockManager: page accounting as plain integers (no model, no tensors)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from moekv.engine.block_manager import BlockManager


@dataclass(eq=False)
class FakeSeq:
    name: str = "s"
    block_table: list[int] = field(default_factory=list)


# -- constructor and arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (4, 0), (4, -3), (0, 0)])
def test_constructor_rejects_non_positive_sizes(num_blocks, block_size):
    """A pool needs at least one page of at least one token."""
    with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1"):
        BlockManager(num_blocks, block_size)


def test_fresh_pool_is_all_free():
    """A new pool has every page free and reports zero usage."""
    bm = BlockManager(7, 4)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (7, 0, 0.0)
    bm.check_invariants([])


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_tokens_rounds_up(tokens, pages):
    """blocks_for_tokens is ceil(tokens / block_size), 0 for 0 tokens."""
    assert BlockManager(1, 4).blocks_for_tokens(tokens) == pages


@given(st.integers(1, 64), st.integers(0, 10_000))
def test_blocks_for_tokens_is_ceil(block_size, tokens):
    """For any block size, the page count is the smallest one that holds all tokens."""
    pages = BlockManager(1, block_size).blocks_for_tokens(tokens)
    assert pages == math.ceil(tokens / block_size)
    assert pages * block_size >= tokens and (pages - 1) * block_size < max(tokens, 1)


# -- allocate / free -----------------------------------------------------------------------------

def test_allocate_grows_table_to_cover_tokens():
    """allocate appends exactly the missing pages; covered token counts allocate nothing."""
    bm = BlockManager(8, 4)
    s = FakeSeq()
    assert bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.allocate(s, 8)  # still covered by 2 pages
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.allocate(s, 3)  # fewer tokens never shrinks the table
    assert len(s.block_table) == 2
    assert bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(s.block_table)) == 3
    assert bm.num_new_blocks(s, 20) == 2 and bm.num_new_blocks(s, 1) == 0
    bm.check_invariants([s])


def test_allocate_is_all_or_nothing():
    """When pages run out, allocate returns False and changes neither the table nor the pool."""
    bm = BlockManager(4, 2)
    a, b = FakeSeq("a"), FakeSeq("b")
    assert bm.allocate(a, 5)  # 3 pages, 1 left
    assert not bm.allocate(b, 3)  # needs 2
    assert b.block_table == [] and bm.num_free_blocks == 1
    before = list(a.block_table)
    assert not bm.allocate(a, 10)  # needs 2 more, only 1 free
    assert a.block_table == before and bm.num_free_blocks == 1
    assert bm.allocate(a, 8)  # exactly the last page
    assert bm.num_free_blocks == 0
    bm.check_invariants([a, b])


def test_free_returns_every_page():
    """free empties the table and puts all its pages back; they can be handed out again."""
    bm = BlockManager(5, 3)
    a, b = FakeSeq("a"), FakeSeq("b")
    assert bm.allocate(a, 9) and bm.allocate(b, 6)
    assert bm.num_free_blocks == 0
    pages_a = set(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3
    bm.check_invariants([a, b])
    c = FakeSeq("c")
    assert bm.allocate(c, 9)
    assert set(c.block_table) == pages_a
    bm.check_invariants([b, c])
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 5 and bm.usage == 0.0


def test_freed_pages_are_reused_last():
    """Freed pages go to the back of the free list: never-used pages are handed out first."""
    bm = BlockManager(6, 1)
    a = FakeSeq("a")
    assert bm.allocate(a, 2)
    used = set(a.block_table)
    bm.free(a)
    b = FakeSeq("b")
    assert bm.allocate(b, 4)
    assert not used & set(b.block_table)


def test_free_of_empty_table_is_a_no_op():
    """Freeing a sequence that holds nothing (e.g. a waiting one) changes nothing."""
    bm = BlockManager(3, 2)
    s = FakeSeq()
    bm.free(s)
    assert bm.num_free_blocks == 3
    bm.check_invariants([s])


def test_double_free_is_detected():
    """Returning the same page twice raises instead of putting it on the free list twice."""
    bm = BlockManager(4, 2)
    a = FakeSeq("a")
    assert bm.allocate(a, 2)
    stale = FakeSeq("stale", list(a.block_table))  # a second, stale copy of the same table
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(stale)


# -- the invariant checker itself must be able to fail ------------------------------------------

def test_check_invariants_catches_leaked_page():
    """A page that is referenced but owned by no live sequence is reported."""
    bm = BlockManager(4, 2)
    a = FakeSeq()
    assert bm.allocate(a, 3)
    with pytest.raises(AssertionError):
        bm.check_invariants([])


def test_check_invariants_catches_shared_page():
    """A page that appears in two tables without a shared ref count is reported."""
    bm = BlockManager(4, 2)
    a = FakeSeq("a")
    assert bm.allocate(a, 2)
    b = FakeSeq("b", list(a.block_table))
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])


def test_check_invariants_catches_owned_free_page():
    """A page in a table that the pool thinks is free is reported."""
    bm = BlockManager(4, 2)
    rogue = FakeSeq("rogue", [3])
    with pytest.raises(AssertionError):
        bm.check_invariants([rogue])


def test_check_invariants_catches_page_lost_from_free_list():
    """A page neither owned nor on the free list (lost by the pool) is reported."""
    bm = BlockManager(4, 2)
    bm._free.pop()  # simulate the pool losing track of a page
    with pytest.raises(AssertionError):
        bm.check_invariants([])


def test_check_invariants_catches_page_free_twice():
    """A page listed twice on the free list is reported."""
    bm = BlockManager(4, 2)
    bm._free.append(0)
    with pytest.raises(AssertionError):
        bm.check_invariants([])


# -- stateful: random grow / free / preempt ------------------------------------------------------

NUM_SEQS = 5


class BlockManagerMachine(RuleBasedStateMachine):
    """Random grows, frees and preemptions over a few sequences, checked against a simple model."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.seqs = [FakeSeq(f"s{i}") for i in range(NUM_SEQS)]
        self.tokens = [0] * NUM_SEQS  # tokens each table is meant to cover

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.bm.block_size)

    @rule(i=st.integers(0, NUM_SEQS - 1), n=st.integers(1, 40))
    def grow(self, i, n):
        s = self.seqs[i]
        free_before, table_before = self.bm.num_free_blocks, list(s.block_table)
        needed = max(0, self._pages(self.tokens[i] + n) - len(table_before))
        ok = self.bm.allocate(s, self.tokens[i] + n)
        assert ok == (needed <= free_before)
        if ok:
            self.tokens[i] += n
            assert s.block_table[: len(table_before)] == table_before  # existing pages keep their place
            assert len(s.block_table) == self._pages(self.tokens[i])
            assert self.bm.num_free_blocks == free_before - needed
        else:
            assert s.block_table == table_before and self.bm.num_free_blocks == free_before

    @rule(i=st.integers(0, NUM_SEQS - 1))
    def free(self, i):
        s = self.seqs[i]
        free_before, held = self.bm.num_free_blocks, len(s.block_table)
        self.bm.free(s)
        self.tokens[i] = 0
        assert s.block_table == [] and self.bm.num_free_blocks == free_before + held

    @precondition(lambda self: any(self.tokens))
    @rule(data=st.data())
    def preempt_and_regrow(self, data):
        """Free a sequence, then recompute a prefix of it: the pages it just gave back suffice."""
        i = data.draw(st.sampled_from([k for k in range(NUM_SEQS) if self.tokens[k]]))
        s = self.seqs[i]
        chunk = data.draw(st.integers(1, self.tokens[i]))
        self.bm.free(s)
        assert s.block_table == []
        assert self.bm.allocate(s, chunk)
        self.tokens[i] = chunk
        assert len(s.block_table) == self._pages(chunk)

    @invariant()
    def pages_are_accounted_for(self):
        self.bm.check_invariants(self.seqs)
        owned = [b for s in self.seqs for b in s.block_table]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert all(0 <= b < self.bm.num_blocks for b in owned)
        assert self.bm.num_free_blocks + len(owned) == self.bm.num_blocks
        for s, t in zip(self.seqs, self.tokens):
            assert len(s.block_table) == self._pages(t)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
