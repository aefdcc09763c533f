"""The engine flags of the `moekv` commands, generated from EngineConfig's fields: a field `max_model_len`
is the flag `--max-model-len` with the field's default, and its help text and choices come from the
field's metadata (config.option), so names, defaults and help have one source."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from moekv.config import EngineConfig, field_default


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _value_type(f: dataclasses.Field, hints: dict) -> type:
    """The type a flag's string is converted to: int, float or str (paths stay strings, as given)."""
    args = typing.get_args(hints[f.name]) or (hints[f.name],)
    for kind in (bool, int, float):
        if kind in args:
            return kind
    return str


def add_engine_args(parser: argparse.ArgumentParser, own_flags: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (with its aliases, except those in own_flags: names the
    command itself defines, such as generate's per-request --seed)."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        default = field_default(f)
        if isinstance(default, Path):
            default = str(default)
        kind = _value_type(f, hints)
        kwargs = {"dest": f.name, "default": default, "help": f.metadata.get("help")}
        if kind is bool:
            # a bool that may be None (decided by the engine) gets --x / --no-x; a plain one is a switch
            kwargs["action"] = argparse.BooleanOptionalAction if default is None else "store_true"
        else:
            kwargs["type"] = kind
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
        aliases = [a for a in f.metadata.get("aliases", ()) if a not in own_flags]
        parser.add_argument(flag_name(f), *aliases, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The parsed engine flags (add_engine_args) as EngineConfig / LLM keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def llm_from(args: argparse.Namespace):
    """The moekv.LLM of parsed engine flags (imported here, so `--help` does not load the engine)."""
    from moekv.llm import LLM

    return LLM(**engine_kwargs(args))


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags (add_engine_args)."""
    return EngineConfig(**engine_kwargs(args))
