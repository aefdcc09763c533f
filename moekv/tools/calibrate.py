"""calibrate: fit the KV formats' learned tables (codebooks, key channel scales) on text.

A tool above the engine: it drives an LLM over the text and fits, for every format in the registry
that declares a calibration fitter (KVFormat.calibration_fitter: nuq2's codebooks, vq's codebooks
and key channel scales), the tables that format reads back through moekv/kvcache/calibration_io.py.

Calibration text runs through the engine in fp32 with an fp32 cache; every attention layer's
observer hands over the post-RoPE K/V of each window, which are cut into pages of `block_size`
tokens (formats take some statistics, such as the key channel means, per page) and subsampled
to a bounded number of pages per layer. With keys_before_rope the key pages are rotated back by
their positions first (each window starts at position 0), for formats that store keys before RoPE
(kv_keys_before_rope); the record says which. The result is one safetensors file plus a JSON record:

  out_dir/kv_calibration.safetensors
    <format>.layer{l}.*             each fitter's tables (named and shaped in its format's file), e.g.
    vq.layer{l}.key.chan_scale      [Hkv, D]          key channel scales (around page means)
    vq.layer{l}.{kind}.codebook     [Hkv, D/d, C, d]  e4m3 values in fp16, one per head and channel group
    nuq2.layer{l}.{kind}.centroids  [Hkv, 4]          fp16 4-level codebooks
  out_dir/kv_calibration.json       model, text, tokens used, the formats fitted (and what each fitter
                                    records: vq its options and codebook bytes), shapes, bytes, date
"""
from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from moekv.eval.perplexity import read_text_tokens
from moekv.kvcache.calibration_io import RECORD_FILE, save_calibration
from moekv.kvcache.formats import calibration_fitters
from moekv.kvcache.formats.paged import rotate_key_pages
from moekv.llm import LLM

__all__ = ["RECORD_FILE", "PageSampler", "calibrate", "collect_pages", "fit_tables", "fitter_options"]


class PageSampler:
    """Keeps at most `pages_per_window` random full pages of each window, per layer and kind."""

    def __init__(self, num_layers: int, block_size: int, pages_per_window: int, seed: int,
                 rope_theta: float | None = None) -> None:
        """rope_theta: keep the key pages rotated back by RoPE of this base (keys before RoPE), else as observed."""
        self.block_size, self.pages_per_window = block_size, pages_per_window
        self.rope_theta = rope_theta
        self.generator = torch.Generator().manual_seed(seed)
        self.pending: list[dict[str, list[torch.Tensor]]] = [{"key": [], "value": []} for _ in range(num_layers)]
        self.pages: list[dict[str, list[torch.Tensor]]] = [{"key": [], "value": []} for _ in range(num_layers)]

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Observer hook: k, v [T, Hkv, D] of one step (one window may span several steps)."""
        self.pending[layer]["key"].append(k.detach().float().cpu())
        self.pending[layer]["value"].append(v.detach().float().cpu())

    def end_window(self) -> None:
        """Cut the window's tokens into pages; keep the same random subset for every layer and kind."""
        P = self.block_size
        pick = None
        for layer, kinds in enumerate(self.pending):
            for kind, parts in kinds.items():
                x = torch.cat(parts)  # [T, Hkv, D]
                parts.clear()
                n = x.shape[0] // P
                if n == 0:
                    continue
                if pick is None:
                    pick = torch.randperm(n, generator=self.generator)[:self.pages_per_window]
                pages = x[:n * P].reshape(n, P, *x.shape[1:]).transpose(1, 2)  # [n, Hkv, P, D]
                if kind == "key" and self.rope_theta is not None:  # page j of the window starts at j * P
                    pages = rotate_key_pages(pages, torch.arange(n) * P, self.rope_theta, inverse=True)
                self.pages[layer][kind].append(pages[pick])

    def collected(self, layer: int, kind: str) -> torch.Tensor:
        """All kept pages of a layer and kind: [n, Hkv, P, D]."""
        return torch.cat(self.pages[layer][kind])


def collect_pages(llm, ids: list[int], window: int, block_size: int, max_pages: int, seed: int,
                  progress: bool, keys_before_rope: bool = False) -> PageSampler:
    """Score the text window by window through `llm`, keeping sampled pages of every layer's K/V
    (the keys rotated back by RoPE with keys_before_rope)."""
    layers = llm.engine.runner.model.attention_layers
    starts = list(range(0, max(1, len(ids) - block_size + 1), window))
    per_window = max(1, math.ceil(max_pages / len(starts)))
    theta = llm.engine.model_config.rope_theta if keys_before_rope else None
    sampler = PageSampler(len(layers), block_size, per_window, seed, theta)
    for attn in layers:
        attn.hooks.kv_observer = sampler.observe
    try:
        for start in tqdm(starts, desc="calibrate: collect K/V", unit="window", disable=not progress):
            llm.score([{"prompt_token_ids": ids[start:start + window]}])
            sampler.end_window()
    finally:
        for attn in layers:
            attn.hooks.kv_observer = None
    return sampler


def fitter_options(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each fitter's options (CalibrationFitter.options: its defaults), by format, from the tool's
    `<format>_<option>` keyword arguments (vq_iters=4); TypeError for one no fitter takes."""
    fitters = calibration_fitters()
    out = {name: dict(fitter.options) for name, fitter in fitters.items()}
    for key, value in options.items():
        owner = next((name for name in out if key.startswith(f"{name}_") and key[len(name) + 1:] in out[name]), None)
        if owner is None:
            accepted = [f"{name}_{option}" for name, taken in out.items() for option in taken]
            raise TypeError(f"calibrate: no fitter takes {key}={value!r}; accepted: {accepted}")
        out[owner][key[len(owner) + 1:]] = value
    return out


def fit_tables(sampler: PageSampler, num_layers: int, seed: int, progress: bool,
               options: dict[str, dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
    """Every fitter's tables, by name (see the module docstring); options: fitter_options()."""
    fitters = calibration_fitters()
    options = fitter_options({}) if options is None else options
    generator = torch.Generator().manual_seed(seed)
    tables: dict[str, torch.Tensor] = {}
    steps = [(layer, kind) for layer in range(num_layers) for kind in ("key", "value")]
    for layer, kind in tqdm(steps, desc="calibrate: fit codebooks", disable=not progress):
        pages = sampler.collected(layer, kind)  # [n, Hkv, P, D]
        for name, fitter in fitters.items():
            tables.update(fitter.fit(pages, layer, kind, generator, **options[name]))
    return {name: t.contiguous() for name, t in tables.items()}


def calibrate(model_dir: str | Path, text_path: str | Path, out_dir: str | Path, max_tokens: int = 65536,
              window: int = 512, progress: bool = True, block_size: int = 64, max_pages: int = 2048,
              max_sample_bytes: int = 1 << 30, seed: int = 0, device: str = "cpu", keys_before_rope: bool = False,
              **options: Any) -> Path:
    """Fit the KV formats' calibration on `text_path` and write it to `out_dir`; returns out_dir.

    max_tokens bounds the text used; window is the tokens scored at once (capped by the model's
    context); block_size the page size that per-page statistics are taken over; max_pages the
    pages kept per layer and kind (fewer if the kept K/V would pass max_sample_bytes); device where
    the text is scored (fp32 either way; the pages are kept and fitted on the CPU); keys_before_rope:
    fit the key tables on keys before RoPE (for kv_keys_before_rope; recorded). options: a
    fitter's own, as `<format>_<option>` (vq_sub_dim, vq_iters, vq_max_vectors: channels per
    subvector, Lloyd iterations, vectors per codebook).
    """
    per_format = fitter_options(options)  # before the model loads: a misspelt option fails at once
    if max_tokens < block_size:
        raise ValueError(f"max_tokens={max_tokens} must be at least block_size={block_size}")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp32", max_num_seqs=1, device=device)
    window = min(window, llm.engine.max_model_len)
    if window < block_size:
        raise ValueError(f"window={window} must hold at least one page of block_size={block_size} tokens")
    ids = read_text_tokens(llm.tokenizer, text_path, max_tokens)
    if len(ids) < block_size:
        raise ValueError(f"{text_path} holds {len(ids)} tokens; calibration needs at least one page "
                         f"of block_size={block_size}")
    cfg = llm.engine.model_config
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * 4  # K and V, fp32
    max_pages = max(1, min(max_pages, max_sample_bytes // page_bytes))
    sampler = collect_pages(llm, ids, window, block_size, max_pages, seed, progress, keys_before_rope)
    tables = fit_tables(sampler, cfg.num_layers, seed, progress, per_format)
    record = {
        "model": str(Path(model_dir).resolve()), "text": str(Path(text_path).resolve()),
        "tokens_used": len(ids), "window": window, "device": device, "block_size": block_size,
        "pages_per_layer_and_kind": int(sampler.collected(0, "key").shape[0]),
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "formats": list(per_format), "keys_before_rope": bool(keys_before_rope),
    }
    for name, fitter in calibration_fitters().items():
        if fitter.summary is not None:
            own = {n: t for n, t in tables.items() if n.startswith(f"{name}.")}
            record[name] = fitter.summary(own, per_format[name], seed)
    record |= {
        "tensors": {name: list(t.shape) for name, t in tables.items()},
        "total_bytes": sum(t.numel() * t.element_size() for t in tables.values()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return save_calibration(out_dir, tables, record)
