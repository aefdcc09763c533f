"""The registry is the one list of KV formats: a format added to it (and its options, declared in
its own file) reaches the configuration, the command line and the cross-format tests with no other
edit. Shown with throwaway formats patched into the registry."""
from __future__ import annotations

import argparse

import pytest
import torch

from moekv import config
from moekv.cli.engine_args import add_engine_args, engine_config_from
from moekv.config import EngineConfig
from moekv.kvcache import formats
from moekv.kvcache.formats.int4 import Int4Format
from moekv.kvcache.formats.options import KVOption, integer_at_least
from tests.kv_formats import formats_sharing_pages, self_contained_compressed


class Int4WithLevel(Int4Format):
    """int4 with one more engine option, declared as a format declares its own."""

    name = "int4_level"
    engine_options = (*Int4Format.engine_options,
                      KVOption("level", 2, "int4_level: a throwaway option", integer_at_least(1)))

    def __init__(self, group_size: int = 32, outlier_fraction: float = 0.01, level: int = 2) -> None:
        super().__init__(group_size, outlier_fraction)
        self.level = level


@pytest.fixture
def registered(monkeypatch):
    """int4_level in the registry (and in names.py's list, which the configuration checks names against)."""
    names = (*formats.KV_FORMAT_NAMES, "int4_level")
    monkeypatch.setattr(formats, "KV_FORMAT_NAMES", names)
    monkeypatch.setattr(config, "KV_FORMAT_NAMES", names)
    monkeypatch.setitem(formats._COMPRESSED, "int4_level", ("int4", "Int4Format"))
    format_class = formats._format_class
    monkeypatch.setattr(formats, "_format_class",
                        lambda name: Int4WithLevel if name == "int4_level" else format_class(name))
    formats.engine_options.cache_clear()
    config.flat_fields.cache_clear()
    yield
    formats.engine_options.cache_clear()
    config.flat_fields.cache_clear()


def test_a_registered_format_and_its_option_reach_config_cli_and_tests(registered):
    cfg = EngineConfig(kv_cache_dtype="int4_level", kv_level=3)
    assert cfg.kv_format_options() == {"group_size": 32, "level": 3}
    fmt = formats.get_kv_format("int4_level", torch.bfloat16, **cfg.kv_format_options())
    assert isinstance(fmt, Int4WithLevel) and fmt.level == 3
    with pytest.raises(ValueError, match="kv_level=0 must be an integer >= 1"):
        EngineConfig(kv_cache_dtype="int4_level", kv_level=0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='nuq2' does not take kv_level=3"):
        EngineConfig(kv_cache_dtype="nuq2", kv_level=3)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "int4_level", "--kv-level", "4"])
    assert engine_config_from(args).cache.kv_options["level"] == 4
    assert "int4_level" in self_contained_compressed()
    assert "int4_level" in [name for name, _ in formats_sharing_pages()]


def test_an_option_must_be_taken_by_the_constructor(monkeypatch):
    class Undeclared(Int4Format):
        engine_options = (*Int4Format.engine_options, KVOption("level", 2, "not a constructor argument"))

    format_class = formats._format_class
    monkeypatch.setattr(formats, "_format_class", lambda name: Undeclared if name == "int4" else format_class(name))
    formats.engine_options.cache_clear()
    try:
        with pytest.raises(TypeError, match="declares the engine option 'level'"):
            formats.engine_options()
    finally:
        monkeypatch.undo()
        formats.engine_options.cache_clear()
