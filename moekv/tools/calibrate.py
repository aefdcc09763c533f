"""calibrate: fit the KV formats' learned tables (VQ codebooks, key channel scales, nuq2 codebooks) on text.

A tool above the engine: it drives an LLM over the text and fits what the formats read back
through moekv/kvcache/calibration_io.py.

Calibration text runs through the engine in fp32 with an fp32 cache; every attention layer's
observer hands over the post-RoPE K/V of each window, which are cut into pages of `block_size`
tokens (formats take some statistics, such as the key channel means, per page) and subsampled
to a bounded number of pages per layer. The result is one safetensors file plus a JSON record:

  out_dir/kv_calibration.safetensors
    vq.layer{l}.key.chan_scale      [Hkv, D]          key channel scales (around page means)
    vq.layer{l}.{kind}.codebook     [Hkv, D/d, C, d]  e4m3 values in fp16, one per head and channel group
    nuq2.layer{l}.{kind}.centroids  [Hkv, 4]          fp16 4-level codebooks
  out_dir/kv_calibration.json       model, text, tokens used, shapes, bytes, date
"""
from __future__ import annotations

import datetime
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moekv.eval.perplexity import read_text_tokens
from moekv.kvcache.calibration_io import RECORD_FILE, save_calibration
from moekv.kvcache.formats import nuq2, vq
from moekv.llm import LLM

__all__ = ["RECORD_FILE", "PageSampler", "calibrate", "collect_pages", "fit_tables"]


class PageSampler:
    """Keeps at most `pages_per_window` random full pages of each window, per layer and kind."""

    def __init__(self, num_layers: int, block_size: int, pages_per_window: int, seed: int) -> None:
        self.block_size, self.pages_per_window = block_size, pages_per_window
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
                self.pages[layer][kind].append(pages[pick])

    def collected(self, layer: int, kind: str) -> torch.Tensor:
        """All kept pages of a layer and kind: [n, Hkv, P, D]."""
        return torch.cat(self.pages[layer][kind])


def collect_pages(llm, ids: list[int], window: int, block_size: int, max_pages: int, seed: int,
                  progress: bool) -> PageSampler:
    """Score the text window by window through `llm`, keeping sampled pages of every layer's K/V."""
    layers = llm.engine.runner.model.attention_layers
    starts = list(range(0, max(1, len(ids) - block_size + 1), window))
    per_window = max(1, math.ceil(max_pages / len(starts)))
    sampler = PageSampler(len(layers), block_size, per_window, seed)
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


def fit_tables(sampler: PageSampler, num_layers: int, seed: int, progress: bool,
               vq_sub_dim: int, vq_iters: int, vq_max_vectors: int) -> dict[str, torch.Tensor]:
    """Every learned table, by name (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    tables: dict[str, torch.Tensor] = {}
    steps = [(layer, kind) for layer in range(num_layers) for kind in ("key", "value")]
    for layer, kind in tqdm(steps, desc="calibrate: fit codebooks", disable=not progress):
        pages = sampler.collected(layer, kind)  # [n, Hkv, P, D]
        chan_scale = None
        if kind == "key":
            chan_scale = tables[f"vq.layer{layer}.key.chan_scale"] = vq.fit_key_channel_scale(pages)
        tables[f"vq.layer{layer}.{kind}.codebook"] = vq.fit_codebook(
            pages, kind, chan_scale, vq_sub_dim, vq_iters, vq_max_vectors, generator)
        tables[f"nuq2.layer{layer}.{kind}.centroids"] = nuq2.fit_centroids(pages, kind)
    return {name: t.contiguous() for name, t in tables.items()}


def calibrate(model_dir: str | Path, text_path: str | Path, out_dir: str | Path, max_tokens: int = 65536,
              window: int = 512, progress: bool = True, block_size: int = 64, max_pages: int = 2048,
              max_sample_bytes: int = 1 << 30, seed: int = 0, vq_sub_dim: int = 8, vq_iters: int = 16,
              vq_max_vectors: int = 16384, device: str = "cpu") -> Path:
    """Fit the KV formats' calibration on `text_path` and write it to `out_dir`; returns out_dir.

    max_tokens bounds the text used; window is the tokens scored at once (capped by the model's
    context); block_size the page size that per-page statistics are taken over; max_pages the
    pages kept per layer and kind (fewer if the kept K/V would pass max_sample_bytes); vq_* the
    codebook fit (channels per subvector, Lloyd iterations, vectors per codebook); device where the
    text is scored (fp32 either way; the pages are kept and fitted on the CPU).
    """
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
    sampler = collect_pages(llm, ids, window, block_size, max_pages, seed, progress)
    tables = fit_tables(sampler, cfg.num_layers, seed, progress, vq_sub_dim, vq_iters, vq_max_vectors)
    record = {
        "model": str(Path(model_dir).resolve()), "text": str(Path(text_path).resolve()),
        "tokens_used": len(ids), "window": window, "device": device, "block_size": block_size,
        "pages_per_layer_and_kind": int(sampler.collected(0, "key").shape[0]),
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vq": {"sub_dim": vq_sub_dim, "codebook_size": 256, "iters": vq_iters, "max_vectors": vq_max_vectors,
               "seed": seed,
               "codebook_bytes_fp16": sum(t.numel() * t.element_size() for n, t in tables.items()
                                          if n.endswith(".codebook"))},
        "tensors": {name: list(t.shape) for name, t in tables.items()},
        "total_bytes": sum(t.numel() * t.element_size() for t in tables.values()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return save_calibration(out_dir, tables, record)
