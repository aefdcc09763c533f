#!/usr/bin/env python3
"""Probe (session 5): decode kernels against the float64 reference at small shapes on the GPU.

The interpreter-sized tests of the tiered kernel failed when run compiled on the H200 at head_dim 32
(errors 0.35-0.45 of the output's scale) while its 128-wide GPU tests pass. This checks which
formats and shapes are affected, generic kernel and tiered, bf16 queries and caches:

    PYTHONPATH=. python benchmarks/probe_small_head_dim.py             # the first run
    PYTHONPATH=. python benchmarks/probe_small_head_dim.py --second    # 16-token tiles: warps, tile sizes
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.kvcache.formats.tiered import TIER_FP8  # noqa: E402
from tests.test_decode_attention import DEVICE, FORMATS, build_cache, reference  # noqa: E402


SHAPES = [(32, 16, 16, 4), (32, 64, 64, 4), (64, 16, 16, 4), (64, 64, 64, 4), (128, 16, 16, 4),
          (128, 64, 64, 4)]  # (D, P, BLOCK_N, num_warps): the first run
SECOND = [(128, 16, 16, 1), (128, 16, 16, 2), (128, 32, 32, 4), (128, 64, 16, 4), (32, 32, 32, 4)]


def main() -> None:
    torch.manual_seed(0)
    shapes = SECOND if "--second" in sys.argv else SHAPES
    labels = ["int4_g32", "nuq2", "tiered"] if "--second" in sys.argv else ["fp8_e4m3", "int4_g32", "kivi2_r32",
                                                                             "nuq2", "tiered"]
    for label, (D, P, block_n, warps) in itertools.product(labels, shapes):
        if label.startswith("kivi2") and P < 32:
            continue
        name, options = ("tiered", {"codebook": "page", "fused_decode": True}) if label == "tiered" else FORMATS[label]
        fmt = get_kv_format(name, torch.bfloat16, **options)
        lens = [300, 129]
        cache, ctx = build_cache(fmt, lens, 2, D, P, torch.bfloat16, seed=1)
        if label == "tiered":  # half the full pages to nuq2
            for b, n in enumerate(lens):
                for i, page in enumerate(ctx.block_tables[b, :n // P].tolist()):
                    if i % 2 and cache.state["tier"][page] == TIER_FP8:
                        fmt._demote(cache, [page])
        q = torch.randn(len(lens), 8, D, device=DEVICE, dtype=torch.bfloat16)
        ref = reference(fmt, cache, ctx, q, D ** -0.5, None)
        try:
            if label == "tiered":
                if P % block_n:
                    continue
                out = fmt.attend_kernel(q, cache, ctx, D ** -0.5, None, block_n=block_n, num_warps=warps)
            else:
                from moekv.ops.decode.paged import paged_decode_attention

                out = paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, D ** -0.5,
                                             None, fmt.decode_spec(P, D), block_n=block_n, num_warps=warps)
            err = (out.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
            print(f"{label:9} D={D:3} P={P:2} BLOCK_N={block_n:2} warps={warps}: relative max error {err:.4f}"
                  f"{'   <-- WRONG' if err > 0.05 else ''}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label:9} D={D:3} P={P:2} BLOCK_N={block_n:2}: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
