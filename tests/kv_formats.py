"""The KV formats of the cross-format tests (graphs, staging, prefix caching), taken from the
registry and filtered by what a test needs, so that a format added to the registry is tested
without an edit here: only a format that needs options to run in a small test says so below."""
from __future__ import annotations

import torch

from moekv.config import EngineConfig
from moekv.context import Context
from moekv.kvcache.formats import GraphStepHooks, compressed_formats, format_class, get_kv_format

# engine keywords a format needs in the small tests: a residual window of 32 tokens for the formats
# that keep one (their defaults, 128 and 256, outlast the tests' sequences, so no token would reach
# their 2-bit pages)
SMALL_TEST_KWARGS: dict[str, dict] = {name: {"kv_residual": 32} for name in ("kivi2", "nuq2", "vq")}


def engine_kwargs_for(name: str, **overrides) -> dict:
    """EngineConfig / LLM keywords of format `name` in a small test."""
    return {"kv_cache_dtype": name, **SMALL_TEST_KWARGS.get(name, {}), **overrides}


def format_options(name: str, **overrides) -> dict:
    """get_kv_format's options of format `name` in a small test (overrides by the format's keywords:
    residual=64)."""
    kwargs = engine_kwargs_for(name, **{f"kv_{key}": value for key, value in overrides.items()})
    return dict(EngineConfig(**kwargs).cache.kv_options)


def self_contained_compressed() -> list[str]:
    """The compressed formats that build without calibration tables and keep no host-side state
    between steps (GraphStepHooks: tiered, whose pages are re-ranked, has tests of its own)."""
    return [name for name in compressed_formats()
            if not format_class(name).needs_calibration and not issubclass(format_class(name), GraphStepHooks)]


def formats_sharing_pages() -> list[tuple[str, dict]]:
    """(name, engine keywords) of every format whose pages prefix caching can share, at keywords that
    allow it (kivi2, nuq2, vq: no residual window); tiered's re-ranking never allows it. Each is built as the
    engine builds it (the default model's shipped calibration reaches vq)."""
    out = []
    for name in ("fp32", "bf16", *compressed_formats()):
        kwargs = engine_kwargs_for(name, **({"kv_residual": 0} if name in SMALL_TEST_KWARGS else {}))
        config = EngineConfig(**kwargs)
        fmt = get_kv_format(name, decode_kernel=config.cache.decode_kernel, **config.kv_format_options())
        if fmt.prefix_caching_unsupported() is None:
            out.append((name, {key: value for key, value in kwargs.items() if key != "kv_cache_dtype"}))
    return out


def step_context(chunks: list[tuple[int, list[int], int, int]], block_size: int) -> Context:
    """A step's Context for format-level tests: chunks are (staging slot, block table, first
    position, end position) of each sequence in the step; block tables padded with page 0."""
    positions, slots, starts = [], [], [0]
    for _, table, lo, hi in chunks:
        pos = torch.arange(lo, hi)
        positions.append(pos)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + hi - lo)
    width = max(len(t) for _, t, _, _ in chunks)
    return Context(positions=torch.cat(positions), slot_mapping=torch.cat(slots),
                   block_tables=torch.tensor([t + [0] * (width - len(t)) for _, t, _, _ in chunks], dtype=torch.int32),
                   context_lens=torch.tensor([hi for *_, hi in chunks], dtype=torch.int32),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32),
                   logits_indices=torch.tensor(starts[1:]) - 1, seq_slots=torch.tensor([c[0] for c in chunks]),
                   max_query_len=max(hi - lo for *_, lo, hi in chunks))
