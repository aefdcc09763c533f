"""The options a KV format takes from the engine's configuration, declared by the format itself.

A format class lists them in `engine_options`: each one is the keyword of its constructor (`name`),
the engine's field and flag `kv_<name>` (EngineConfig(kv_group_size=64), --kv-group-size), its
default, its help text and the check of a value. The registry (kvcache/formats/__init__.py) gathers
them for the configuration and the command line, so an option is declared once, in its format's
file. Formats that take the same option declare the same default; each checks its own values.

Imports nothing, as names.py: the declarations are read before any format is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class KVOption:
    """One engine option of a format. check(value) is None for a value the format accepts, else why
    not, worded to follow "kv_<name>=<value> " (e.g. "must be > 0")."""

    name: str
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    choices: tuple[str, ...] | None = None
    kind: type | None = None  # what the flag's string becomes when the default (None) does not say

    @property
    def field(self) -> str:
        """The engine's keyword and the flag's dest: kv_<name>."""
        return "kv_" + self.name

    @property
    def value_type(self) -> type:
        """What the flag's string becomes: `kind`, else the default's type (str where the default is None: a path)."""
        if self.kind is not None:
            return self.kind
        return str if self.default is None else type(self.default)

    def refusal(self, value: Any) -> str | None:
        """The error message for `value`, naming the engine's field, or None when accepted."""
        reason = self.check(value) if self.check is not None else None
        return None if reason is None else f"{self.field}={value!r} {reason}"


def one_of(*accepted: Any) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in accepted else f"is not supported; accepted: {', '.join(map(repr, accepted))}"
    return check


def integer_at_least(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return None if ok else f"must be an integer >= {low}"
    return check


def positive(value: Any) -> str | None:
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else "must be > 0"


def fraction(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
    return None if ok else "must be in [0, 1]"


# a folder of learned tables: every format that reads one takes it under this name
CALIBRATION = KVOption("calibration", None,
                       "folder from `moekv calibrate` (default: the checkpoint's kv_calibration/ if it has one)")


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


# keys quantized before RoPE (nuq2, vq): pages hold un-rotated keys, every reader rotates them by
# their positions after dequantizing (docs/kv-formats.md, "Keys stored before RoPE")
KEYS_BEFORE_ROPE = KVOption("keys_before_rope", False,
                            "nuq2/vq: quantize keys before RoPE, rotated by every reader after the lookup "
                            "(the Triton decode kernel, no Gluon kernel)", boolean)
