"""Format options: each format takes its constructor's keyword arguments and nothing else; the
engine's common kv_* options reach a format only when it takes them, and one set for a format that
does not is an error naming what it does take."""
from __future__ import annotations

import pytest
import torch

from moekv.config import EngineConfig
from moekv.kvcache.formats import KV_FORMAT_NAMES, get_kv_format, kv_format_options, kv_options_for
from moekv.kvcache.formats.vq import random_calibration

TAKEN = {
    "auto": (), "bf16": (), "fp16": (), "fp32": (), "fp8_e4m3": (),
    "int4": ("group_size", "outlier_fraction"),
    "nuq2": ("outlier_sigma", "calibration", "codebook", "quantize_kernel", "residual", "keys_before_rope",
             "sink_tokens", "outlier_cap"),
    "vq": ("calibration", "residual", "keys_before_rope", "sink_tokens"),
    "kivi2": ("residual", "kivi_residual", "group_size", "sink_tokens"),
    "tiered": ("rerank_interval", "tier1_fraction", "outlier_sigma", "calibration", "codebook", "fp8_pool_fraction",
               "fused_decode", "rank_window", "rank_after_prompt", "outlier_cap"),
}


def test_every_format_lists_its_options():
    assert set(TAKEN) == set(KV_FORMAT_NAMES)
    for name in KV_FORMAT_NAMES:
        assert kv_format_options(name) == TAKEN[name], name


@pytest.mark.parametrize("name", KV_FORMAT_NAMES)
def test_an_unknown_option_is_refused_with_the_accepted_ones(name, tmp_path):
    with pytest.raises(ValueError) as e:
        get_kv_format(name, torch.bfloat16, group_sise=32)  # misspelt
    message = str(e.value)
    assert f"kv_cache_dtype={name!r}" in message and "'group_sise'" in message
    assert all(repr(option) in message for option in TAKEN[name])
    if not TAKEN[name]:
        assert "no options" in message


@pytest.mark.parametrize("name", KV_FORMAT_NAMES)
def test_an_option_of_another_format_is_refused(name, tmp_path):
    other = "rerank_interval" if name in ("kivi2", "nuq2", "vq") else "residual"
    with pytest.raises(ValueError, match=f"does not take the option\\(s\\) \\['{other}'\\]"):
        get_kv_format(name, torch.bfloat16, **{other: 32})


@pytest.mark.parametrize("name", KV_FORMAT_NAMES)
def test_every_accepted_option_builds_the_format(name, tmp_path):
    """The options each format takes, at values it accepts, build it (one dict per format, so a
    format that gains an option without a case here fails)."""
    calibration = random_calibration(tmp_path, num_kv_heads=2, head_dim=32)
    values = {"group_size": 64, "outlier_fraction": 0.02, "outlier_sigma": 3.0, "outlier_cap": 16,
              "calibration": calibration,
              "codebook": "page", "quantize_kernel": False, "residual": 64, "kivi_residual": 64, "rerank_interval": 8,
              "tier1_fraction": 0.2, "fp8_pool_fraction": 0.5, "fused_decode": False, "rank_window": 64,
              "rank_after_prompt": True, "keys_before_rope": False, "sink_tokens": 4}
    fmt = get_kv_format(name, torch.bfloat16, **{key: values[key] for key in TAKEN[name]})
    assert fmt.name == (name if name != "auto" else "bf16")


def test_kv_options_for_keeps_only_what_a_format_takes():
    common = {"group_size": 64, "codebook": "page", "residual": 32}
    assert kv_options_for("int4", common) == {"group_size": 64}
    assert kv_options_for("kivi2", common) == {"group_size": 64, "residual": 32}
    assert kv_options_for("fp8_e4m3", common) == {}
    with pytest.raises(ValueError, match="is unknown"):
        kv_options_for("int3", common)


@pytest.mark.parametrize("name, option, value", [("int4", "kv_codebook", "page"), ("fp8_e4m3", "kv_residual", 64),
                                                 ("fp8_e4m3", "kv_group_size", 64), ("bf16", "kv_rerank_interval", 8),
                                                 ("kivi2", "kv_outlier_sigma", 3.0)])
def test_engine_config_refuses_an_option_the_format_does_not_take(name, option, value):
    with pytest.raises(ValueError) as e:
        EngineConfig(kv_cache_dtype=name, **{option: value})
    assert f"kv_cache_dtype={name!r} does not take {option}={value!r}" in str(e.value)
    taken = [f"kv_{o}" for o in ("group_size", "outlier_sigma", "calibration", "codebook", "rerank_interval",
                                 "tier1_fraction", "residual", "keys_before_rope", "sink_tokens") if o in TAKEN[name]]
    assert str(taken or "no kv_* option") in str(e.value)


def test_engine_config_refuses_a_calibration_for_a_format_without_tables(tmp_path):
    with pytest.raises(ValueError, match="does not take kv_calibration="):
        EngineConfig(kv_cache_dtype="int4", kv_calibration=str(tmp_path))


def test_engine_config_passes_each_format_only_its_options():
    """Defaults (what the CLI passes for flags not given) are no error, and only the options a
    format takes reach it; the checkpoint's shipped calibration goes to the formats that read one."""
    for name in KV_FORMAT_NAMES:
        options = EngineConfig(kv_cache_dtype=name).kv_format_options()
        assert set(options) <= set(TAKEN[name]), name
        get_kv_format(name, torch.bfloat16, **options)  # vq: the tiny model's shipped calibration
    options = EngineConfig(kv_cache_dtype="kivi2", kv_group_size=64, kv_residual=64).kv_format_options()
    assert options == {"group_size": 64, "residual": 64, "sink_tokens": None}
    tiered = EngineConfig(kv_cache_dtype="tiered", kv_rerank_interval=8, kv_codebook="page").kv_format_options()
    assert tiered["rerank_interval"] == 8 and tiered["codebook"] == "page" and "residual" not in tiered


def test_engine_config_validates_the_same_twice():
    """Validation does not rewrite options: a validated config's fields build an equal config (the
    parallel ranks and dataclasses.replace re-validate), for formats with and without tables, and
    the checkpoint's shipped calibration still reaches the formats that read one."""
    import dataclasses

    for name in KV_FORMAT_NAMES:
        config = EngineConfig(kv_cache_dtype=name)
        again = EngineConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        assert again == config and again.kv_format_options() == config.kv_format_options(), name
        assert dataclasses.replace(config).cache.kv_cache_dtype == name
        assert dataclasses.replace(config.cache) == config.cache
    assert EngineConfig(kv_cache_dtype="vq").kv_format_options()["calibration"].name == "kv_calibration"


@pytest.mark.parametrize("name", KV_FORMAT_NAMES)
def test_declared_engine_options_are_constructor_keywords_with_its_defaults(name):
    """What a format declares for the engine (engine_options) is what its constructor takes, at the
    constructor's default where it names one."""
    import inspect

    from moekv.kvcache.formats import format_class, format_engine_options

    params = inspect.signature(format_class(name)).parameters
    for option in format_engine_options(name):
        assert option.name in params, (name, option.name)
        assert params[option.name].default in (None, option.default), (name, option.name)
