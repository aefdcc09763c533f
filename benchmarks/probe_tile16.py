#!/usr/bin/env python3
"""Probe (session 6): where do tiles of 16 tokens go wrong on the GPU?

Session 5 found compiled decode kernels wrong with tiles of 16 tokens for int4, nuq2 and tiered
(fp8 right; tiles of 32-128 right; results/h200/probe_small_head_dim.txt). This splits the kernel:

1. tile readers alone: a kernel that only calls a format's key and value readers and stores the
   tiles, at tiles of 16 against the same tokens read with tiles of 64 (known right), with and
   without inline PTX;
2. the whole decode kernel at tiles of 16 under launch variants (pipeline stages, warps, inline
   PTX, page size, no outliers) against the float64 reference, and tiered's kernel;
3. the smallest suspect: int4 codes unpacked with tl.interleave (a join) straight into an MMA, at
   16 and 32 tokens, against the same codes unpacked one byte per column (no join).

Part 2 ran first without a fix (results/h200/probe_tile16_before.txt: wrong in every variant, part 1
right); the readers now unpack tiles of 16 without a join (moekv/ops/decode/codes.py JOIN_FREE_BELOW).

    PYTHONPATH=. python benchmarks/probe_tile16.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moekv.ops.decode.paged as da  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from tests.test_decode_attention import DEVICE, FORMATS, build_cache, reference  # noqa: E402



@triton.jit
def _read_tiles(pool, stride_p, bt, length, out, TILE: tl.constexpr, SCALED: tl.constexpr,
                A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, A4: tl.constexpr,
                A5: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """Tile t of KV head 0 of one sequence, dequantized by TILE (times its row scale), as fp32 rows."""
    t = tl.program_id(0)
    start = t * BLOCK_N
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < length
    PP: tl.constexpr = P if P < BLOCK_N else BLOCK_N
    NPG: tl.constexpr = BLOCK_N // PP
    if NPG == 1:  # as the decode kernel does: a scalar page inside one page, else per token and per page
        page = tl.load(bt + start // P).to(tl.int64)
        page_pg = page
    else:
        page = tl.load(bt + pos // P).to(tl.int64)
        page_pg = tl.load(bt + start // P + tl.arange(0, NPG)).to(tl.int64)
    x, scale = TILE(pool, page * stride_p, pos % P, page_pg * stride_p, start % P, valid, D, BLOCK_N, P, ASM,
                    A0, A1, A2, A3, A4, A5)
    x = x.to(tl.float32)
    if SCALED:
        x = x * scale[:, None]
    d = tl.arange(0, D)
    tl.store(out + pos[:, None] * D + d[None, :], x, mask=valid[:, None])


def read_tiles(cache, ctx, reader, pool_name, D, P, block_n, asm, warps=4):
    length = int(ctx.context_lens[0])
    n = (length // block_n) * block_n  # whole tiles inside full pages
    pool = cache[pool_name]
    out = torch.zeros(n, D, device=DEVICE, dtype=torch.float32)
    _read_tiles[(n // block_n,)](pool, pool.stride(0), ctx.block_tables[0], n, out, reader.fn, reader.row_scaled,
                                 *reader.constexprs(), D, P, block_n, asm, num_warps=warps)
    return out


def tile_readers() -> None:
    print("# 1. tile readers: tiles of 16 against tiles of 64 (same tokens), relative max difference")
    for label in ["fp8_e4m3", "int4_g32", "nuq2"]:
        name, options = FORMATS[label]
        for D, P in [(128, 16), (128, 64), (64, 16), (64, 64), (32, 16), (32, 64)]:
            fmt = get_kv_format(name, torch.bfloat16, **options)
            cache, ctx = build_cache(fmt, [256], 1, D, P, torch.bfloat16, seed=1)
            spec = fmt.decode_spec(P, D)
            for side, reader, pool in [("key", spec.key, spec.k_pool), ("value", spec.value, spec.v_pool)]:
                if reader.fold_fn is not None and P < 64:
                    continue  # tiles of 64 over pages of 16 keep the page affine that tiles of 16 fold into q
                ref = read_tiles(cache, ctx, reader, pool, D, P, 64, False)
                for asm in (False, True):
                    if asm and 16 * D // 4 < 4 * 32 * 4:
                        continue
                    try:
                        got = read_tiles(cache, ctx, reader, pool, D, P, 16, asm)
                        err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
                        print(f"{label:9} {side:5} D={D:3} P={P:2} asm={asm:d}: {err:.4f}"
                              f"{'   <-- DIFFERS' if err > 1e-3 else ''}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"{label:9} {side:5} D={D:3} P={P:2} asm={asm:d}: {type(e).__name__}: {str(e)[:160]}")


def whole_kernel() -> None:
    print("# 2. whole kernel at tiles of 16 (D=128 unless said): relative max error against float64")
    variants = [("base", {}, 16, "int4_g32", {}), ("stages=1", {"num_stages": 1}, 16, "int4_g32", {}),
                ("stages=3", {"num_stages": 3}, 16, "int4_g32", {}), ("asm off", {"use_asm": False}, 16, "int4_g32", {}),
                ("warps=1", {"num_warps": 1}, 16, "int4_g32", {}), ("warps=2", {"num_warps": 2}, 16, "int4_g32", {}),
                ("warps=8", {"num_warps": 8}, 16, "int4_g32", {}),
                ("no outliers", {}, 16, "int4_g32", {"outlier_fraction": 0.0}),
                ("P=32 tiles 16", {}, 32, "int4_g32", {}), ("P=64 tiles 16", {}, 64, "int4_g32", {}),
                ("P=32 tiles 32", {"block_n": 32}, 32, "int4_g32", {}),
                ("base", {}, 16, "nuq2", {}), ("stages=1", {"num_stages": 1}, 16, "nuq2", {}),
                ("asm off", {"use_asm": False}, 16, "nuq2", {}), ("P=64 tiles 16", {}, 64, "nuq2", {}),
                ("base", {}, 16, "fp8_e4m3", {}), ("base", {}, 16, "bf16", {})]
    for what, launch, P, label, extra in variants:
        name, options = FORMATS[label]
        fmt = get_kv_format(name, torch.bfloat16, **{**options, **extra})
        lens = [300, 129]
        D = 128
        cache, ctx = build_cache(fmt, lens, 2, D, P, torch.bfloat16, seed=1)
        q = torch.randn(len(lens), 8, D, device=DEVICE, dtype=torch.bfloat16)
        ref = reference(fmt, cache, ctx, q, D ** -0.5, None)
        launch = {"block_n": 16, **launch}
        try:
            out = da.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, D ** -0.5,
                                            None, fmt.decode_spec(P, D), **launch)
            err = (out.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
            print(f"{label:9} {what:14} P={P:2}: {err:.4f}{'   <-- WRONG' if err > 0.05 else ''}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label:9} {what:14} P={P:2}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def tiered() -> None:
    from moekv.kvcache.formats.tiered import TIER_FP8

    for D, P, block_n in [(128, 16, 16), (32, 16, 16), (128, 64, 16), (128, 64, 64)]:
        fmt = get_kv_format("tiered", torch.bfloat16, codebook="page", fused_decode=True)
        lens = [300, 129]
        cache, ctx = build_cache(fmt, lens, 2, D, P, torch.bfloat16, seed=1)
        for b, n in enumerate(lens):  # half the full pages to nuq2
            for i, page in enumerate(ctx.block_tables[b, :n // P].tolist()):
                if i % 2 and cache.state["tier"][page] == TIER_FP8:
                    fmt._demote(cache, [page])
        q = torch.randn(len(lens), 8, D, device=DEVICE, dtype=torch.bfloat16)
        ref = reference(fmt, cache, ctx, q, D ** -0.5, None)
        out = fmt.attend_kernel(q, cache, ctx, D ** -0.5, None, block_n=block_n)
        err = (out.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
        print(f"tiered    D={D:3} P={P:2} BLOCK_N={block_n:2}: {err:.4f}{'   <-- WRONG' if err > 0.05 else ''}", flush=True)


@triton.jit
def _join_dot(codes, q, out, N: tl.constexpr, D: tl.constexpr, JOIN: tl.constexpr):
    """out [16, N] = q [16, D] @ unpack(codes [N, D/2])^T, channel 2j from the low nibble of byte j."""
    n = tl.arange(0, N)
    d = tl.arange(0, D)
    r = tl.arange(0, 16)
    if JOIN:
        packed = tl.load(codes + n[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :])
        x = tl.interleave((packed & 0xF).to(tl.float16), (packed >> 4).to(tl.float16))
    else:
        byte = tl.load(codes + n[:, None] * (D // 2) + (d // 2)[None, :])
        x = ((byte >> ((d % 2) * 4)[None, :]) & 0xF).to(tl.float16)
    s = tl.dot(tl.load(q + r[:, None] * D + d[None, :]), tl.trans(x))
    tl.store(out + r[:, None] * N + n[None, :], s)


def join_dot() -> None:
    print("# 3. int4 codes through tl.interleave into tl.dot (one tile, no loop): relative max error")
    g = torch.Generator().manual_seed(0)
    for N in (16, 32):
        for D in (32, 128):
            codes = torch.randint(0, 256, (N, D // 2), generator=g, dtype=torch.uint8)
            q = torch.randn(16, D, generator=g).half()
            nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(N, D).double()
            ref = q.double() @ nib.T
            for join in (True, False):
                out = torch.empty(16, N, device=DEVICE)
                _join_dot[(1,)](codes.to(DEVICE), q.to(DEVICE), out, N, D, join)
                err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
                print(f"N={N:2} D={D:3} join={join:d}: {err:.4f}{'   <-- WRONG' if err > 1e-2 else ''}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    tile_readers()
    whole_kernel()
    tiered()
    join_dot()
