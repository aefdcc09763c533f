"""SamplingParams: how one request picks its tokens and when it stops (shaped like vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moekv.structured_outputs import StructuredOutputsParams


class SamplingParamsError(ValueError):
    """A SamplingParams field out of range: `field` names it, `value` is what it was given and
    `accepted` says what would be; the message reads 'SamplingParams.<field>=<value> is out of range;
    accepted: ...'."""

    def __init__(self, field: str, value: object, accepted: str) -> None:
        self.field, self.value, self.accepted = field, value, accepted
        super().__init__(f"SamplingParams.{field}={value!r} is out of range; accepted: {accepted}")

    def message_for(self, name: str) -> str:
        """The same message with the field called `name` (an API parameter's name)."""
        return f"{name}={self.value!r} is out of range; accepted: {self.accepted}"


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables nucleus sampling;
    both rank equal logits by the smaller token id first.
    seed (taken modulo 2^64) makes one request's samples reproducible whatever else is in the batch: the
    same seed, prompt, parameters and logits give the same tokens (docs/serving.md, "Seeds").
    max_tokens None means "until max_model_len".
    logprobs: also return the log-probabilities of the top-N tokens at each generated position
        (and the sampled token's). prompt_logprobs: the same for every prompt position after the first.
    structured_outputs: a constraint the output must satisfy (a JSON schema, any JSON object, a regex,
        a choice, an EBNF grammar: StructuredOutputsParams); the request ends when it is complete.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (also after a caller changed one) and normalise stop / stop_token_ids."""
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise SamplingParamsError("stop", self.stop, "a string or a list of strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)

        def bad(name: str, accepted: str) -> SamplingParamsError:
            return SamplingParamsError(name, getattr(self, name), accepted)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1, or None")
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "a number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "-1 or 0 (disabled) or an integer >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"at most max_tokens={self.max_tokens}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "a number > 0 (1.0 = off)")
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= 20):
                raise bad(name, "None or an integer in [0, 20]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "None or a StructuredOutputsParams")
            self.structured_outputs.validate()
            # the grammar decides when the output is complete: it must be free to end it there
            if self.ignore_eos:
                raise bad("ignore_eos", "False with structured_outputs (the grammar ends the output with EOS)")
            if self.min_tokens:
                raise bad("min_tokens", "0 with structured_outputs (the grammar decides the output's length)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
