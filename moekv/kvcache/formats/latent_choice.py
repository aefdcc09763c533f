"""Which latent cache an MLA model's kv_cache_dtype names (kvcache/formats/latent.py, latent_lowbit.py)."""
from __future__ import annotations

import torch

from moekv.kvcache.formats import format_engine_options
from moekv.kvcache.formats.latent import PLAIN_LATENTS, LatentFormat, LatentFP8Format
from moekv.kvcache.formats.latent_lowbit import Latent2BitFormat, LatentInt4Format

# the per-head formats' names with a low-bit latent form (latent_lowbit.py) -> the kv_* options it takes
LOW_BIT_LATENTS = {"int4": ("group_size",), "kivi2": ("group_size", "residual"), "nuq2": ("residual",)}
LATENT_FORMAT_NAMES = ("auto", *PLAIN_LATENTS, "fp8_e4m3", *LOW_BIT_LATENTS)


def latent_format_for(name: str, model_dtype: torch.dtype, kv_lora_rank: int,
                      options: dict | None = None) -> LatentFormat:
    """The latent cache kv_cache_dtype=`name` asks for ('auto': the model's dtype), or a ValueError
    naming the ones an MLA model accepts. options: the engine's kv_* options of that name (its
    EngineConfig.cache.kv_options): kv_group_size for int4 and kivi2, kv_residual for kivi2 and nuq2;
    any other set away from its default is refused (the per-head format's options that have no latent form)."""
    options = dict(options or {})
    if name == "auto":
        return LatentFormat(model_dtype, kv_lora_rank)
    if name in PLAIN_LATENTS:
        return LatentFormat(PLAIN_LATENTS[name], kv_lora_rank)
    if name == "fp8_e4m3":
        return LatentFP8Format(kv_lora_rank)
    if name in LOW_BIT_LATENTS:
        taken = LOW_BIT_LATENTS[name]
        defaults = {option.name: option.default for option in format_engine_options(name)}
        refused = [f"kv_{key}={value!r}" for key, value in options.items()
                   if key not in taken and value != defaults.get(key)]
        if refused:
            raise ValueError(f"kv_cache_dtype={name!r} on a multi-head latent attention model takes "
                             f"{['kv_' + key for key in taken]}, not {', '.join(refused)}")
        group = options.get("group_size") or 32
        residual = options.get("residual")
        residual = 128 if residual is None else residual  # KIVI's window, kivi2's and nuq2's default
        if name == "int4":
            return LatentInt4Format(kv_lora_rank, group)
        if name == "kivi2":  # KIVI's key recipe on the latent: the baseline 2-bit latent
            return Latent2BitFormat(kv_lora_rank, name, "channel", "uniform", group, residual)
        # per channel as kivi2 (a trained latent's channels differ in scale: docs/decisions.md, "Low-bit latents"),
        # Lloyd-Max levels of a normal instead of the uniform grid
        return Latent2BitFormat(kv_lora_rank, name, "channel", "gaussian", 32, residual)
    raise ValueError(f"kv_cache_dtype={name!r} has no latent-cache form for multi-head latent attention "
                     f"(DeepSeek-V2/V3); accepted: {list(LATENT_FORMAT_NAMES)}")
