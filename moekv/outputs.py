"""What the engine hands back for a request (shaped like vLLM's RequestOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities: token id -> logprob (the chosen token always included).
PositionLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    # Text and token ids added since the last output of this request (for streaming). With the
    # sequence's output_kind "delta" (the server's), a running request's outputs[0] holds only these
    # too (and this step's logprobs); its final output holds everything.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # prefix caching (as vLLM's field): prompt tokens read from the cache at the request's last admission
    num_cached_tokens: int = 0
