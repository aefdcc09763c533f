"""Registry of KV formats. A format is one file here, plus its line in names.py: a spec (bytes per
page, bits per element), how it writes a step's K/V into pages and how attention reads them back,
and the optional capabilities it declares (interface.KVFormat: run statistics, read counts, sharding
of per-head tables, a calibration fitter, a Gluon decode kernel), which default to none.

Options reach a format as keyword arguments of its constructor, and only those: an option a format
does not take is an error naming the ones it does (kv_format_options), never silently ignored. The
decode kernel its pools are laid out for (decode_kernel: EngineConfig.cache.decode_kernel) is not an
option: every format takes it, and the registry gives it to the format it builds. The options a
format takes from the engine's configuration (kv_<name>) it declares itself (KVFormat.engine_options,
options.KVOption); engine_options gathers them for the configuration and the command line."""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch

from moekv import envs
from moekv.kvcache.formats.dense import dense_attention, is_decode_only
from moekv.kvcache.formats.fragment import FragmentPagedFormat
from moekv.kvcache.formats.interface import (
    CalibrationFitter,
    GraphStepHooks,
    GraphSupport,
    KVFormat,
    LayerKVCache,
    ReadCounts,
    StatisticGauge,
)
from moekv.kvcache.formats.names import (
    COMPRESSED_KV_FORMATS,
    DECODE_KERNELS,
    DEFAULT_DECODE_KERNEL,
    KV_FORMAT_NAMES,
    PLAIN_KV_FORMAT_NAMES,
    REGISTERED_KV_FORMATS,
    check_decode_kernel,
    kv_format_names,
)
from moekv.kvcache.formats.options import KVOption
from moekv.kvcache.formats.paged import Field, PagedQuantFormat, PageLayout, nonfinite_verdict, raise_nonfinite
from moekv.kvcache.formats.plain import PlainKVFormat

# plain formats, by the dtype they store ("auto": the model's); they take no options
_PLAIN: dict[str, torch.dtype | None] = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                         "fp32": torch.float32}
if tuple(_PLAIN) != PLAIN_KV_FORMAT_NAMES:
    raise ImportError(f"kvcache/formats/names.py lists the plain formats {PLAIN_KV_FORMAT_NAMES}, "
                      f"the registry {(*_PLAIN,)}")


def _check_name(name: str) -> None:
    if name not in kv_format_names():
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; accepted: {list(kv_format_names())}")


def _format_class(name: str) -> type[KVFormat]:
    if name in REGISTERED_KV_FORMATS:
        return REGISTERED_KV_FORMATS[name]
    module, cls = COMPRESSED_KV_FORMATS[name]  # imported when first asked for
    return getattr(importlib.import_module(f"moekv.kvcache.formats.{module}"), cls)


def register_format(name: str, cls: type[KVFormat]) -> None:
    """Add the compressed format `cls` under `name` while the process runs: for tests, which show with
    a throwaway format that the configuration, the command line and the cross-format tests take a
    format from the registry (a shipped format is a line in names.py instead). unregister_format
    takes it back."""
    if name in kv_format_names():
        raise ValueError(f"kv_cache_dtype={name!r} is already registered")
    REGISTERED_KV_FORMATS[name] = cls
    engine_options.cache_clear()


def unregister_format(name: str) -> None:
    """Take back a format register_format added."""
    del REGISTERED_KV_FORMATS[name]
    engine_options.cache_clear()


def kv_format_options(name: str) -> tuple[str, ...]:
    """The options format `name` takes: its constructor's keyword arguments, in their order."""
    _check_name(name)
    if name in _PLAIN:
        return ()
    return tuple(inspect.signature(_format_class(name)).parameters)


def format_class(name: str) -> type[KVFormat]:
    """The class of format `name` (PlainKVFormat for the plain ones), for what it says about itself
    before it is built: graph_support, needs_calibration, engine_options, the optional hooks it has."""
    _check_name(name)
    return PlainKVFormat if name in _PLAIN else _format_class(name)


def compressed_formats() -> tuple[str, ...]:
    """The formats that quantize their pages (every one but the plain 16/32-bit formats), in registry order."""
    return (*COMPRESSED_KV_FORMATS, *REGISTERED_KV_FORMATS)


def calibration_fitters() -> dict[str, CalibrationFitter]:
    """The formats that fit calibration tables (`moekv calibrate`), by name: their class's
    calibration_fitter, in registry order."""
    return {name: format_class(name).calibration_fitter for name in compressed_formats()
            if format_class(name).calibration_fitter is not None}


def format_engine_options(name: str) -> tuple[KVOption, ...]:
    """The options format `name` takes from the engine's configuration (its class's engine_options)."""
    _check_name(name)
    return () if name in _PLAIN else _format_class(name).engine_options


@functools.cache
def engine_options() -> dict[str, KVOption]:
    """Every format's engine options by name, in registry order: one entry per name for the
    configuration's defaults and the command line's flags. Formats that take the same option must
    declare the same default and choices; their help texts are joined. The check stays each
    format's own (format_engine_options)."""
    merged: dict[str, KVOption] = {}
    for name in compressed_formats():
        taken = kv_format_options(name)
        for option in format_engine_options(name):
            if option.name not in taken:
                raise TypeError(f"kv_cache_dtype={name!r} declares the engine option {option.name!r}, which its "
                                f"constructor does not take ({list(taken)})")
            seen = merged.get(option.name)
            if seen is None:
                merged[option.name] = option
                continue
            if (seen.default, seen.choices) != (option.default, option.choices):
                raise TypeError(f"kv_cache_dtype={name!r} declares kv_{option.name} with default {option.default!r} "
                                f"and choices {option.choices}; another format with {seen.default!r}, {seen.choices}")
            if option.help not in seen.help.split("; "):
                merged[option.name] = KVOption(seen.name, seen.default, f"{seen.help}; {option.help}",
                                               choices=seen.choices, kind=seen.kind)
    return merged


def kv_options_for(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of `options` that format `name` takes: for callers that hold one set of options
    for several formats on purpose (EngineConfig, `moekv info`) and have checked it themselves."""
    taken = kv_format_options(name)
    return {key: value for key, value in options.items() if key in taken}


def get_kv_format(name: str, model_dtype: torch.dtype = torch.bfloat16, *,
                  decode_kernel: str = DEFAULT_DECODE_KERNEL, **options: Any) -> KVFormat:
    """The format called `name`, built with `options` (group_size, outlier_sigma, calibration, ...), its
    pools laid out for `decode_kernel` (DECODE_KERNELS: 'auto', 'triton', 'gluon'); ValueError for an
    unknown name or kernel, or an option the format does not take."""
    envs.check_decode_kernel_unset()
    check_decode_kernel(decode_kernel)
    taken = kv_format_options(name)
    unknown = sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"kv_cache_dtype={name!r} does not take the option(s) {unknown}; "
                         f"it takes: {list(taken) if taken else 'no options'}")
    fmt = PlainKVFormat(_PLAIN[name] or model_dtype) if name in _PLAIN else _format_class(name)(**options)
    fmt.decode_kernel = decode_kernel
    return fmt


__all__ = ["DECODE_KERNELS", "KV_FORMAT_NAMES", "CalibrationFitter", "Field", "FragmentPagedFormat",
           "GraphStepHooks", "GraphSupport", "KVFormat", "KVOption", "LayerKVCache", "PageLayout",
           "PagedQuantFormat", "ReadCounts", "StatisticGauge", "calibration_fitters", "compressed_formats",
           "dense_attention", "engine_options", "format_class", "format_engine_options", "get_kv_format",
           "is_decode_only", "kv_format_options", "kv_options_for", "nonfinite_verdict", "raise_nonfinite",
           "register_format", "unregister_format"]
