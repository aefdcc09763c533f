"""Scheduler: which sequences run in the next step, and how many of their tokens.

One step mixes decodes (1 token per running sequence) and prefill chunks (the uncomputed part
of a prompt, cut to fit the token budget). Running sequences go first, oldest first; new prompts
join while budget, `max_num_seqs` and free pages allow. When a running sequence needs a page and
none is free, the newest running sequence is preempted: its pages go back to the pool and it
returns to the front of the waiting queue, to be recomputed later. With prefix caching, a prompt
being admitted starts from the longest run of its full pages already cached (BlockManager), and the
pages a step completes are indexed for later prompts. No tensors here.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moekv.engine.block_manager import BlockManager
from moekv.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens of seq computed in this step, starting at seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of whichever queue holds it and give its pages back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def live_sequences(self) -> list[Sequence]:
        return list(self.waiting) + self.running

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_schedulable_tokens, budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_tokens):
                victim = self.running.pop()  # newest running sequence loses its pages
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_tokens))
                budget -= num_tokens
                i += 1

        # New prompts only when nothing had to be preempted: they would take the pages back.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                bm = self.block_manager
                cached = bm.find_cached_prefix(seq) if seq.reads_prefix_cache else []
                num_cached = len(cached) * bm.block_size  # a waiting sequence has nothing computed
                num_tokens = min(seq.num_tokens - num_cached if cached else seq.num_schedulable_tokens, budget)
                if not bm.allocate(seq, num_cached + num_tokens, cached):
                    break
                if bm.enable_prefix_caching and seq.reads_prefix_cache:
                    bm.prefix_cache_queries += seq.num_prompt_tokens
                    bm.prefix_cache_hits += num_cached
                seq.num_computed_tokens = seq.num_cached_tokens = num_cached
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, num_tokens))
                budget -= num_tokens
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens are now in the cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.register_computed(item.seq, item.seq.num_computed_tokens - item.num_tokens,
                                                 item.seq.num_computed_tokens)
