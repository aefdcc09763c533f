"""Scheduler: the engine loop simulated without a model (sampling = appending a fake token)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moekv.engine.block_manager import BlockManager
from moekv.engine.scheduler import Scheduler, SchedulerOutput
from moekv.engine.sequence import Sequence, SequenceStatus
from moekv.sampling_params import SamplingParams

FAKE_TOKEN = 7


def make_seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)),
                    sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def pages_for_full_length(seq: Sequence, block_size: int) -> int:
    """Pages the sequence can ever hold: the last sampled token is never computed."""
    return -(-(seq.num_prompt_tokens + seq.max_tokens - 1) // block_size)


class Sim:
    """Drives schedule() / on_step_done() like LLMEngine.step, checking every step's output."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.all: list[Sequence] = []
        self.steps = 0

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.all.append(seq)

    def step(self) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        outputs_before = {id(s): list(s.output_token_ids) for s in self.all}
        had_work = sched.has_unfinished()

        out = sched.schedule()
        self.steps += 1
        self.check_output(out, running_before, waiting_before, outputs_before)
        if had_work:
            assert not out.is_empty(), "unfinished work but nothing scheduled (livelock)"

        sched.on_step_done(out)
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens == seq.num_tokens:  # the whole sequence is in the cache: sample
                seq.output_token_ids.append(FAKE_TOKEN)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    sched.finish(seq, "length")
        self.check_state()
        return out

    def check_output(self, out, running_before, waiting_before, outputs_before) -> None:
        sched, bm = self.sched, self.bm
        seqs = [item.seq for item in out.scheduled]
        assert len(seqs) == len({id(s) for s in seqs}), "a sequence is scheduled twice"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for item in out.scheduled:
            s = item.seq
            assert 1 <= item.num_tokens <= s.num_uncomputed_tokens
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + item.num_tokens
            assert s.status is SequenceStatus.RUNNING and s in sched.running
            if item.num_tokens < s.num_uncomputed_tokens:  # a chunk is cut only by the token budget
                assert out.num_tokens == sched.max_num_batched_tokens
        # Scheduled sequences are the oldest running ones, in running order.
        assert seqs == sched.running[: len(seqs)]
        # Preempted: newest running first, no pages, back to 0, at the front of waiting, outputs kept.
        preempted_ids = {id(s) for s in out.preempted}
        assert len(preempted_ids) == len(out.preempted)
        assert not preempted_ids & {id(s) for s in seqs}
        assert out.preempted == running_before[len(running_before) - len(out.preempted):][::-1]
        assert list(sched.waiting)[: len(out.preempted)] == out.preempted[::-1]
        for s in out.preempted:
            assert s.block_table == [] and s.num_computed_tokens == 0
            assert s.status is SequenceStatus.WAITING and s not in sched.running
            assert s.output_token_ids == outputs_before[id(s)]
        if out.preempted:  # no admissions in a step that preempted
            assert all(any(s is r for r in running_before) for s in seqs)
            assert list(sched.waiting)[len(out.preempted):] == waiting_before
        # Admission is first come, first served: the admitted ones were the head of waiting.
        admitted = [s for s in seqs if not any(s is r for r in running_before)]
        assert admitted == waiting_before[: len(admitted)]
        # Any running sequence left out of the step is so because the budget is used up.
        if len(seqs) < len(sched.running):
            assert out.num_tokens == sched.max_num_batched_tokens

    def check_state(self) -> None:
        sched, bm = self.sched, self.bm
        bm.check_invariants(sched.live_sequences())
        live = sched.live_sequences()
        assert len(live) == len({id(s) for s in live}), "a sequence is queued twice"
        for s in sched.waiting:
            assert s.status is SequenceStatus.WAITING
            assert s.block_table == [] and s.num_computed_tokens == 0
        for s in sched.running:
            assert s.status is SequenceStatus.RUNNING
            # exactly the pages that hold the computed tokens: nothing leaked, nothing missing
            assert len(s.block_table) == bm.blocks_for_tokens(s.num_computed_tokens)
            assert s.num_computed_tokens <= s.num_tokens
            assert len(s.output_token_ids) < s.max_tokens
        for s in self.all:
            if s.is_finished:
                assert s.block_table == [] and s not in live
        owned = sum(len(s.block_table) for s in live)
        assert bm.num_free_blocks + owned == bm.num_blocks


# -- random workloads ----------------------------------------------------------------------------

@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    requests: list[tuple[int, int, int]]  # (arrival step, prompt length, max_tokens)
    aborts: list[tuple[int, int]]  # (step, index into the live sequences)


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.integers(1, 8))
    requests = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40), st.integers(1, 12)),
                             min_size=1, max_size=10))
    # The engine guarantees the pool holds one sequence at full length; sometimes give exactly that.
    need = max(-(-(p + m - 1) // block_size) for _, p, m in requests)
    num_blocks = need + draw(st.sampled_from([0, 0, 1, 2, 5, 30]))
    return Workload(
        block_size=block_size, num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)), budget=draw(st.integers(1, 64)),
        requests=requests,
        aborts=draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 100)), max_size=3)))


def run_workload(w: Workload) -> Sim:
    sim = Sim(w.num_blocks, w.block_size, w.max_num_seqs, w.budget)
    pending = sorted(enumerate(w.requests), key=lambda r: (r[1][0], r[0]))
    last_arrival = max(a for a, _, _ in w.requests)
    # Each step the oldest running sequence (never preempted: it fits alone) computes >= 1 of its
    # own tokens, and it never recomputes them; idle steps only happen before the last arrival.
    bound = last_arrival + 1 + sum(p + m for _, p, m in w.requests)
    step = 0
    while pending or sim.sched.has_unfinished():
        assert step <= bound, f"workload did not drain in {bound} steps (livelock?)"
        while pending and pending[0][1][0] <= step:
            i, (_, p, m) = pending.pop(0)
            sim.add(make_seq(f"r{i}", p, m))
        for abort_step, k in w.aborts:
            live = sim.sched.live_sequences()
            if abort_step == step and live:
                victim = live[k % len(live)]
                sim.sched.finish(victim, "abort")
                assert victim.is_finished and victim.block_table == []
                sim.check_state()
        sim.step()
        step += 1
    return sim


@settings(max_examples=400, deadline=None)
@given(workloads())
def test_random_workloads_drain_and_keep_invariants(w):
    """Any workload drains in bounded steps with every page returned and every step well formed."""
    sim = run_workload(w)
    event(f"preempted: {sim.sched.num_preemptions > 0}")
    event(f"aborted: {any(s.finish_reason == 'abort' for s in sim.all)}")
    event(f"chunked: {max(p for _, p, _ in w.requests) > w.budget}")
    assert not sim.sched.waiting and not sim.sched.running
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    sim.bm.check_invariants([])
    for s in sim.all:
        assert s.is_finished and s.block_table == []
        assert s.finish_reason in ("length", "abort")
        if s.finish_reason == "length":
            assert len(s.output_token_ids) == s.max_tokens
            assert s.num_computed_tokens == s.num_tokens - 1  # the last sampled token is never computed
    assert sim.sched.num_preemptions == sum(s.num_preemptions for s in sim.all)


# -- deterministic scenarios ---------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, budget", [(10, 3), (12, 4), (13, 4), (5, 1), (7, 7)])
def test_chunked_prefill_takes_ceil_steps(prompt_len, budget):
    """A prompt longer than the budget is prefilled in ceil(len/budget) budget-sized chunks."""
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, budget=budget)
    seq = make_seq("a", prompt_len, 2)
    sim.add(seq)
    chunks = []
    while not seq.output_token_ids:
        out = sim.step()
        assert [item.seq for item in out.scheduled] == [seq]
        chunks.append(out.scheduled[0].num_tokens)
    assert len(chunks) == math.ceil(prompt_len / budget)
    assert chunks == [budget] * (len(chunks) - 1) + [prompt_len - budget * (len(chunks) - 1)]
    out = sim.step()  # decode: one token
    assert out.scheduled[0].num_tokens == 1 and seq.is_finished and seq.finish_reason == "length"
    assert sim.bm.num_free_blocks == 16


def test_budget_is_shared_decode_first():
    """Running decodes go first; the rest of the budget goes to a new prompt's first chunk."""
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, budget=6)
    a = make_seq("a", 3, 10)
    sim.add(a)
    sim.step()  # a: whole prompt, first token
    b = make_seq("b", 20, 2)
    sim.add(b)
    out = sim.step()
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1), (b, 5)]


def test_max_num_seqs_limits_admission():
    """No more than max_num_seqs sequences run at once; the others wait their turn in order."""
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, budget=100)
    seqs = [make_seq(f"s{i}", 3, 2) for i in range(3)]
    for s in seqs:
        sim.add(s)
    out = sim.step()
    assert [i.seq for i in out.scheduled] == seqs[:2] and list(sim.sched.waiting) == [seqs[2]]
    sim.step()  # both finish
    out = sim.step()
    assert [i.seq for i in out.scheduled] == [seqs[2]]


def test_forced_preemption_takes_newest_and_it_recomputes_from_zero():
    """Two sequences, pages for one at full length: the newest is preempted, then recomputed."""
    bs = 2
    a, b = make_seq("a", 2, 6), make_seq("b", 2, 6)
    sim = Sim(num_blocks=pages_for_full_length(a, bs), block_size=bs, max_num_seqs=4, budget=64)
    assert sim.bm.num_blocks < pages_for_full_length(a, bs) + pages_for_full_length(b, bs)
    sim.add(a)
    sim.add(b)
    preempt_step = readmit_step = None
    while sim.sched.has_unfinished():
        b_computed_before = b.num_computed_tokens
        out = sim.step()
        if out.preempted and preempt_step is None:
            preempt_step = sim.steps
            assert out.preempted == [b]
            assert [i.seq for i in out.scheduled] == [a]
            assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
            assert sim.sched.waiting[0] is b
            assert len(b.output_token_ids) >= 1  # it had generated: those tokens are recomputed too
            tokens_of_b = b.num_tokens
        b_items = [i for i in out.scheduled if i.seq is b]
        if preempt_step is not None and readmit_step is None and b_items:
            readmit_step = sim.steps
            # recomputed from token 0: prompt and generated tokens in one chunk (the budget is large)
            assert b_computed_before == 0 and b_items[0].num_tokens == tokens_of_b
        assert sim.steps < 100
    assert preempt_step is not None and readmit_step is not None and readmit_step > preempt_step
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_token_ids) == len(b.output_token_ids) == 6
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_no_admission_in_a_step_that_preempted():
    """After a preemption, nothing waiting is admitted that step, even if it would fit."""
    bs, budget = 2, 3
    a, b = make_seq("a", 1, 6), make_seq("b", 3, 6)
    # a: 1 page at first, 3 pages at full length; pool of 3 pages.
    sim = Sim(num_blocks=3, block_size=bs, max_num_seqs=4, budget=budget)
    sim.add(a)
    sim.add(b)
    out = sim.step()  # a: 1 token (1 page), b: 2-token chunk (1 page)
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1), (b, 2)]
    out = sim.step()  # a decodes (2 tokens, 1 page), b finishes its prompt (2 pages): pool full
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1), (b, 1)]
    assert sim.bm.num_free_blocks == 0
    out = sim.step()  # a needs its 2nd page: b is preempted
    assert out.preempted == [b] and [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1)]
    # Precondition that makes this test meaningful: b's next chunk would have fit right now.
    left = budget - out.num_tokens
    assert left > 0 and sim.bm.num_new_blocks(b, min(b.num_tokens, left)) <= sim.bm.num_free_blocks
    assert list(sim.sched.waiting) == [b] and b.block_table == []
    out = sim.step()  # next step b is admitted again, from token 0
    assert [i.seq for i in out.scheduled] == [a, b]
    assert b.num_computed_tokens == out.scheduled[1].num_tokens


def test_abort_frees_pages_of_waiting_and_running():
    """finish(seq, 'abort') takes a sequence out of either queue and returns its pages."""
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=1, budget=100)
    a, b = make_seq("a", 8, 4), make_seq("b", 4, 4)
    sim.add(a)
    sim.add(b)
    sim.step()
    assert a in sim.sched.running and b in sim.sched.waiting and a.block_table
    sim.sched.finish(b, "abort")
    sim.sched.finish(a, "abort")
    assert a.finish_reason == b.finish_reason == "abort"
    assert not sim.sched.has_unfinished() and sim.bm.num_free_blocks == 4
    sim.bm.check_invariants([])
    assert sim.sched.schedule().is_empty()
