"""The engine flags of the `moekv` commands, generated from the configuration's fields (config.flat_fields:
EngineConfig's own, each group's, and the KV formats' options as the formats declare them): a field
`max_model_len` is the flag `--max-model-len` with the field's default, and its help text and choices
come from the field's metadata (config.option, kvcache/formats/options.KVOption), so names, defaults and
help have one source. The flags stay flat, as EngineConfig's keywords are; --help shows them under one
heading per group, and the CUDA-only ones under "engine: CUDA only"."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from moekv.config import EngineConfig, FlatField, flat_fields


def flag_name(f: FlatField) -> str:
    return f.flag or "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, own_flags: tuple[str, ...] = ()) -> None:
    """One flag per flat EngineConfig field (with its aliases, except those in own_flags: names the
    command itself defines), in one argument group per configuration group; the flags that matter
    only on CUDA in a group of their own, last."""
    sections = {None: parser.add_argument_group("engine")}
    sections.update({f.name: parser.add_argument_group(f"engine: {f.metadata['group']}")
                     for f in dataclasses.fields(EngineConfig) if "group" in f.metadata})
    cuda_only = parser.add_argument_group("engine: CUDA only", "flags that change nothing on the CPU")
    for f in flat_fields():
        default = str(f.default) if isinstance(f.default, Path) else f.default
        kwargs = {"dest": f.name, "default": default, "help": f.help}
        if f.value_type is bool:
            # a bool that may be None (decided by the engine) or is on by default gets --x / --no-x; one off
            # by default is a switch
            kwargs["action"] = argparse.BooleanOptionalAction if default is None or default is True else "store_true"
        else:
            kwargs["type"] = f.value_type
            if f.choices:
                kwargs["choices"] = list(f.choices)
        aliases = [a for a in f.aliases if a not in own_flags]
        (cuda_only if f.cuda_only else sections[f.group]).add_argument(flag_name(f), *aliases, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The parsed engine flags (add_engine_args) as EngineConfig / LLM keyword arguments."""
    return {f.name: getattr(args, f.name) for f in flat_fields()}


def llm_from(args: argparse.Namespace):
    """The moekv.LLM of parsed engine flags (imported here, so `--help` does not load the engine)."""
    from moekv.llm import LLM

    return LLM(**engine_kwargs(args))


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags (add_engine_args)."""
    return EngineConfig(**engine_kwargs(args))
