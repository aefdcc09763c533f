"""StructuredOutputsParams: the constraint a request's output must satisfy (shaped like vLLM's).

Exactly one of json (a JSON Schema), json_object (any JSON object), regex, choice or grammar
(EBNF, xgrammar's dialect) is set. The engine compiles it into a grammar (engine/structured_output.py)
and masks, at every step, the tokens that would leave it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A constraint that is malformed or that the grammar engine cannot compile; the message says which
    and why."""


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise StructuredOutputsError(f"the JSON schema is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputsError(
                    f"a JSON schema must be an object (or true/false), got {type(schema).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise StructuredOutputsError(f"json_object={self.json_object!r}; accepted: True (or leave it unset)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise StructuredOutputsError(f"regex={self.regex!r}; accepted: a non-empty regular expression string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputsError(f"choice={self.choice!r}; accepted: a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise StructuredOutputsError(f"grammar={self.grammar!r}; accepted: a non-empty EBNF grammar string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value)
