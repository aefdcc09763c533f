"""Sequence: one request's tokens, progress through the model, and KV pages. No tensors here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from moekv.sampling_params import SamplingParams

# "cumulative": every step's output holds everything so far (the engine API's default);
# "delta": a running request's outputs hold only the step's new tokens, text and logprobs, its
#   final output everything (the server streams deltas and reads finals);
# "final": nothing until the request ends (LLM.generate).
OUTPUT_KINDS = ("cumulative", "delta", "final")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in flight.

    num_computed_tokens counts the tokens whose K/V are in the cache; the tokens not yet
    computed are token_ids[num_computed_tokens:]. A preempted sequence drops its pages and sets
    num_computed_tokens back to 0: its prompt *and* its generated tokens are recomputed later.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never lets the sequence pass max_model_len
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Filled by the engine (not by the scheduler): text, logprobs, timings.
    output_text: str = ""
    streamed_text_len: int = 0  # characters of output_text already handed out as delta_text
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    # When a list: the model's logits [n, V] for each prompt chunk computed (LLM.score fills it).
    prompt_logits: list | None = None
    # Scoring in decode mode: prompt tokens from this position on are fed one per step, as decode
    # would (teacher forcing), so each one is predicted from the cache exactly as generation reads it.
    decode_from: int | None = None
    cumulative_logprob: float = 0.0
    # What step() returns for this request while it runs (see OUTPUT_KINDS): a full copy of its
    # tokens, text and logprobs so far costs O(length) per step, quadratic over a long output.
    output_kind: str = "cumulative"
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # prefix caching: the chained hashes of the prompt's full pages (BlockManager.page_hashes), and
    # how many prompt tokens the last admission found in the cache (not computed again)
    page_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    # structured outputs: the GrammarState following this sequence's output (engine/structured_output.py)
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens the next step may compute for this sequence (before the token budget)."""
        n = self.num_uncomputed_tokens
        if self.decode_from is not None:
            n = (1 if self.num_computed_tokens >= self.decode_from
                 else min(n, self.decode_from - self.num_computed_tokens))
        return n

    def token_ids(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] across prompt and output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the sequence may start from cached pages: not when it wants something from every
        prompt position (prompt logprobs, prompt logits, scoring in decode mode)."""
        return (self.sampling_params.prompt_logprobs is None and self.prompt_logits is None
                and self.decode_from is None)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
