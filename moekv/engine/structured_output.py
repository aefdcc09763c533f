"""Structured outputs: a request's constraint -> a compiled grammar (xgrammar) -> per step, the bitmask
of the tokens that keep the output inside it.

The grammar engine is xgrammar (docs/decisions.md, 'Structured outputs: xgrammar'), imported on first use
(`pip install 'moekv[structured]'`). One GrammarCompiler serves the engine; it caches each distinct
constraint's compiled grammar. Each sequence holds its own matcher (GrammarState), which follows its
output tokens on the host. The sampler fills one bitmask row per constrained sequence on the CPU,
after the step's forward is queued (so the fill overlaps the device's work), and applies it to the
logits outside any CUDA graph (layers/sampler.py).
"""
from __future__ import annotations

import functools
import json
import re
import threading
from typing import TYPE_CHECKING, Any

from moekv.structured_outputs import StructuredOutputsError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from moekv.models.tokenizer import Tokenizer


# xgrammar's messages start with its C++ log prefix: "[11:01:51] /project/cpp/regex_converter.cc:94: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputsError(
            "structured outputs need the xgrammar package: pip install 'moekv[structured]' (or pip install xgrammar)"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (the logits' width).

    JSON (schema or any object) is compiled without free whitespace between its tokens (xgrammar's
    any_whitespace=False: compact JSON): a model sampled at temperature 1 could otherwise spend its
    whole token budget on whitespace.
    """

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # the server compiles in several worker threads

    def _get(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                from transformers import PreTrainedTokenizerFast  # (a dependency of xgrammar)

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.tokenizers_object)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The xgrammar CompiledGrammar of spec (cached by xgrammar per distinct constraint), or
        StructuredOutputsError naming what could not be compiled and why."""
        if not isinstance(spec, StructuredOutputsParams):
            raise StructuredOutputsError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(spec).__name__}")
        spec.validate()
        compiler = self._get()
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
                    "choice": "choice list", "grammar": "EBNF grammar"}[kind]
            lines = str(e).strip().splitlines()
            detail = _LOG_PREFIX.sub("", lines[-1]) if lines else type(e).__name__
            raise StructuredOutputsError(f"the {what} could not be compiled: {detail}") from None

    def state_for(self, spec: StructuredOutputsParams) -> "GrammarState":
        return GrammarState(self.compile(spec))


@functools.cache
def _batch_filler():
    return _xgrammar().BatchGrammarMatcher(max_threads="auto")


class GrammarState:
    """One sequence's position in its grammar: follows the tokens it outputs, fills its bitmask row."""

    def __init__(self, compiled: Any) -> None:
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self.num_accepted = 0
        # the matcher's is_terminated(), kept here: it changes only when a token is accepted, and asking the
        # matcher three times a token (accept, fill, the engine's stop check) cost the host about as much as
        # accepting the token (a CPU profile of domain-moe's batch-64 step with a regex on every request)
        self._terminated = bool(self._matcher.is_terminated())

    def accept_at(self, position: int, token_id: int) -> bool:
        """Advance by output token number `position` (0-based), once: a token already accepted (a follow-on
        step's runner accepts its input token before the engine appends it) is not accepted again.
        False if the grammar does not allow it (then nothing changes)."""
        if position < self.num_accepted:
            return True
        ok = not self._terminated and bool(self._matcher.accept_token(token_id))
        if ok:
            self.num_accepted += 1
            self._terminated = bool(self._matcher.is_terminated())
        return ok

    @property
    def is_terminated(self) -> bool:
        """The output is complete and a stop token was accepted."""
        return self._terminated

    @staticmethod
    def fill_rows(states: list["GrammarState"], bitmask: "torch.Tensor", rows: list[int]) -> None:
        """Write into bitmask[rows[i]] (int32 words, bit t of word w = token 32w + t allowed) what may
        come next after states[i]'s tokens; several rows at once on xgrammar's thread pool (one thread
        per free core). A terminated grammar leaves its row as it is (every token allowed): its
        sequence has ended, and a follow-on step's row for it is dropped unread."""
        live = [(state._matcher, row) for state, row in zip(states, rows) if not state._terminated]
        if len(live) == 1:
            live[0][0].fill_next_token_bitmask(bitmask, live[0][1])
        elif live:
            _batch_filler().batch_fill_next_token_bitmask([m for m, _ in live], bitmask, indices=[r for _, r in live])
