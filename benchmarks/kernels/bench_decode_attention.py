#!/usr/bin/env python3
"""Paged decode attention of every KV format vs torch SDPA (flash backend) on bf16, on one GPU.

32 query / 8 KV heads, head_dim 128, one query per sequence, (batch, context) in (1, 4096),
(1, 32768), (1, 131072), (16, 32768), (64, 32768), (128, 4096). One layer's pages are built
directly (no model): random keys (with a few outlier channels) and values, quantized by each
format's own `quantize` on the GPU, packed into its page layout, scattered over the pool by a
random block table. Everything is measured in the same run: HBM bandwidth (a large
device-to-device copy), the SDPA baseline, each format's kernel at a few launch shapes (the best
is reported; the default's time is kept beside it), and each kernel's error against the
reference on the first sequence.

    python benchmarks/kernels/bench_decode_attention.py
        # writes benchmarks/results/h200/decode_attention.json
    python benchmarks/kernels/bench_decode_attention.py --quick
        # smoke run: two small shapes, default launch only
    python benchmarks/kernels/bench_decode_attention.py --formats bf16 nuq2 nuq2_eager nuq2_noslots --shapes 16x32768 \
        --out /tmp/decode_attention_nuq2_variants.json   # nuq2 kernel variants side by side (a side study)
    python benchmarks/kernels/bench_decode_attention.py --formats nuq2 int4 kivi2 tiered --kernel triton gluon
        # the Triton and Gluon kernels side by side (rows nuq2, nuq2_gluon, int4, int4_gluon, kivi2, kivi2_gluon,
        # tiered, tiered_gluon: bench_tiered_gluon; vq, vq_gluon; fp8_e4m3, fp8_e4m3_gluon)
    python benchmarks/kernels/bench_decode_attention.py --formats fp8_e4m3 tiered --kernel triton gluon \
        --tiered-fp8-share 1.0   # every tiered page in FP8: fp8_e4m3's Triton and Gluon kernels, tiered's FP8 path
    python benchmarks/kernels/bench_decode_attention.py --formats bf16 fp8_e4m3 --peers flashinfer
        # FlashInfer beside them
    python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_prerope vq vq_prerope --configs 0 \
        --shapes 1x4096 16x32768 64x32768 1x131072   # keys stored before RoPE (rotated per tile) beside today's
    python benchmarks/kernels/bench_decode_attention.py --formats nuq2_all_slots nuq2 nuq2_sigma35 --kernel gluon \
        --configs 0 --pages domain-moe   # nuq2's outlier threshold and slot cap on domain-moe's keys and values
    python benchmarks/kernels/bench_decode_attention.py --formats fp8_e4m3 --configs 0 --swap-ab 0 1 \
        --max-registers none 80
        # the default launch in both orientations of the products and with and without a register cap

Rows: format, batch, context, ms (kernel, CUDA-graph replay, median), baseline_ms (SDPA, same
timer), speedup, bytes (what the format must read: its page slabs, the staged 16-bit tail, the
residual ring, q and out), gbps, floor_ms (bytes / measured bandwidth), plus eager_ms (plain
do_bench, Python launch included), launch shape, bits per element and the largest error of any
correct launch shape against the reference on sequence 0 (a launch shape more than 5% off is
listed in wrong_launches and does not compete; status "wrong" if none is right). Kernel variants
(NUQ2_VARIANTS, not in the default list) time another way of reading the same pages: nuq2_eager
the first outlier-slot code, nuq2_first the first chunk of 16 slots on every tile without a branch
(a candidate layout), nuq2_noslots no slot corrections at all (status "bound": a lower
bound on the slots' cost, its error is reported but does not disqualify it). Formats without
a fused kernel appear with status "reference" (their plain-PyTorch path, timed at the smallest
shape only) or "skipped" and the reason. tiered runs its own kernel (moekv/ops/decode/tiered.py) on a
cache with ~15% of pages in FP8 and the rest in nuq2 (bench_tiered: ms includes the per-page mass
output, nomass_ms is the kernel alone). vq runs on a random calibration
(codebooks fitted in a few seconds on Gaussian pages shaped like the benchmark's keys and values,
`moekv.kvcache.formats.vq.random_calibration`; --vq-calibration DIR takes a real one instead); its
bytes include the layer's codebooks and channel scales (the kernel's DecodeSpec.tables). A Gluon row
with a residual window (nuq2_r128, vq_r256, kivi2) adds tail_splits_ms: the same launch with the
ring's tail read by one program and by the default number (moekv/ops/gluon/launch.py plan_splits).

--peers flashinfer adds FlashInfer's paged decode attention (BatchDecodeWithPagedKVCacheWrapper,
benchmarks/kernels/flashinfer_peer.py) as a second peer after each shape's SDPA row: rows flashinfer_bf16 and
flashinfer_fp8_e4m3 (status "peer"; FP8 with per-tensor K and V scales), its CUDA-core and
tensor-core kernels tried (configs), timed and checked as the formats are, jit_s the wall seconds of
the first plan + run (its JIT build with nvcc). flashinfer-python 0.5.0 and the dependencies the device
image lacks are carried to the device as wheels (scripts/gpu_wheels.sh); without them the rows say
"skipped" and why.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from moekv.context import Context  # noqa: E402
from moekv.kvcache.formats import KV_FORMAT_NAMES, get_kv_format  # noqa: E402
from moekv.kvcache.formats.fragment import FragmentPagedFormat  # noqa: E402
from moekv.ops.reference import decode_attention_ref, gather_kv_ref  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 4096), (1, 32768), (1, 131072), (16, 32768), (64, 32768), (128, 4096)]
QUICK_SHAPES = [(1, 4096), (16, 4096)]
# label -> (kv_cache_dtype, options)
FORMATS = {
    "bf16": ("bf16", {}),
    "fp8_e4m3": ("fp8_e4m3", {}),
    "int4": ("int4", {"group_size": 32}),
    "kivi2": ("kivi2", {"residual": 128}),
    "kivi2_g64": ("kivi2", {"residual": 128, "group_size": 64}),  # 2.5 bits: KIVI at nuq2's bits
    # per-page k-means codebooks (calibrated ones keep the reference path); no residual window
    "nuq2": ("nuq2", {"codebook": "page", "residual": 0}),
    "nuq2_r128": ("nuq2", {"codebook": "page", "residual": 128}),  # its default 16-bit window of 128 tokens
    "nuq2_r256": ("nuq2", {"codebook": "page", "residual": 256}),  # a 256-token window: the ~3-bit setting
    "vq": ("vq", {"residual": 0}),  # calibration: a random one made at start (or --vq-calibration)
    "vq_r256": ("vq", {"residual": 256}),  # its default 16-bit window of 256 tokens
    "vq_r512": ("vq", {"residual": 512}),  # a 512-token window: vq ahead of kivi2 on every domain (CPU)
    "tiered": ("tiered", {}),
    "nuq2_eager": ("nuq2", {"codebook": "page", "residual": 0}),
    "nuq2_first": ("nuq2", {"codebook": "page", "residual": 0}),
    "nuq2_noslots": ("nuq2", {"codebook": "page", "residual": 0}),
    # keys stored before RoPE, rotated per tile in the kernel (kv_keys_before_rope; timed only when named)
    "nuq2_prerope": ("nuq2", {"codebook": "page", "residual": 0, "keys_before_rope": True}),
    "vq_prerope": ("vq", {"residual": 0, "keys_before_rope": True}),
    # nuq2 at 3.5 sigma, every slot (timed only when named): against "nuq2_all_slots" (3.0) it shows what the
    # slots that 3.0 fills cost the kernels' slot branches
    "nuq2_sigma35": ("nuq2", {"codebook": "page", "residual": 0, "outlier_sigma": 3.5, "outlier_cap": 1024}),
    # nuq2 filling every slot of the page padding beyond 3.0 sigma, not its default 16 a page-head and kind
    # (timed only when named): against "nuq2" it shows what the slot chunks past the first cost the kernel
    "nuq2_all_slots": ("nuq2", {"codebook": "page", "residual": 0, "outlier_cap": 1024}),
    # tiered with its nuq2 tier filling every slot the same way (timed only when named)
    "tiered_all_slots": ("tiered", {"outlier_cap": 1024}),  # tiered's default: every slot
    "tiered_cap16": ("tiered", {"outlier_cap": 16}),  # its nuq2 tier at nuq2's cap
}
PREROPE = {"nuq2_prerope", "vq_prerope"}
ONLY_NAMED = PREROPE | {"nuq2_sigma35", "nuq2_all_slots", "tiered_all_slots", "tiered_cap16", "nuq2_r256", "vq_r512"}
ROPE_THETA = 1e6  # the RoPE base keys stored before RoPE are rotated by (a Mixtral's; the speed does not depend on it)
# kernel variants of a format (timed only when named in --formats): label -> nuq2_spec's slots mode
NUQ2_VARIANTS = {"nuq2_eager": "eager", "nuq2_first": "first", "nuq2_noslots": "off"}
INEXACT = {"nuq2_noslots"}  # bounds, not formats: wrong wherever a slot is used
# launch shapes tried per (format, shape): (block_n, num_warps, num_stages, splits factor over
# num_splits_for, inline PTX, L2 prefetch distance in tiles). The first is the launcher's default:
# the spec's prefetch and the launcher's splits (splits factor None: decode_attention.wave_splits by
# the compiled kernel's programs per SM); a negative splits factor -n is exactly n splits. No 8-warp
# launches: slower than 4 at every point (docs/decisions.md, "Decode attention: the Triton kernels")
CONFIGS = [(64, 4, 2, None, True, None), (64, 4, 2, 1, True, 0), (64, 4, 2, 1, True, 1), (64, 4, 2, 1, True, 2),
           (64, 4, 3, 1, True, 2), (128, 4, 2, 1, True, 0), (64, 4, 2, 2, True, 0), (64, 4, 2, 1, False, 0),
           (64, 4, 2, None, True, 0)]
DEFAULT_CONFIG = CONFIGS[0]
UNIQUE_PAGES = 512  # distinct random pages, repeated over the pool (contents do not change the speed)
COMMAND_ARGV = None  # the command line to record, when a wrapper script rewrote sys.argv (sweep_decode_splits.py)
PEERS = ["flashinfer"]  # other libraries' paged decode attention, beside the SDPA baseline


def tolerance(ref_max_abs: float) -> float:
    """Largest error a correct launch may have against the reference of sequence 0."""
    return 0.05 * ref_max_abs + 1e-3


def timer(fn, cudagraph: bool) -> float:
    import triton.testing

    if cudagraph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_bandwidth(device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write)."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), cudagraph=False)
    src = dst = None  # free the buffers (rebound, not del: the timed lambda closes over them)
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


REAL_KV: dict[str, torch.Tensor] | None = None  # --pages domain-moe: real pages in place of random_kv's


def domain_moe_kv(block_size: int) -> dict[str, torch.Tensor]:
    """domain-moe's keys (after RoPE) and values on its held-out text, as benchmarks/quality/nuq2_slots.py
    takes them (transformers, float32, the first 4096 tokens of each domain, every layer): its page-heads
    (2 KV heads a layer) regrouped NUM_KV_HEADS to a page, {'key': [n, NUM_KV_HEADS, P, D], 'value': ...}."""
    sys.path.insert(0, str(REPO / "benchmarks" / "quality"))
    from nuq2_slots import PAGE, model_pages

    if block_size != PAGE or HEAD_DIM != 128:
        raise ValueError(f"--pages domain-moe needs --block-size {PAGE} (and head_dim 128)")
    sets, _ = model_pages(REPO / "models" / "domain-moe", 4096)
    out = {}
    for kind in ("key", "value"):
        heads = torch.cat([d[kind] for d in sets.values()]).reshape(-1, block_size, HEAD_DIM)
        out[kind] = heads[:heads.shape[0] // NUM_KV_HEADS * NUM_KV_HEADS].reshape(-1, NUM_KV_HEADS, block_size,
                                                                                  HEAD_DIM)
    return out


def random_kv(n: int, block_size: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, Hkv, P, D] fp32 keys (two outlier channels per head) and values; with --pages domain-moe
    (REAL_KV) domain-moe's pages instead, repeated past the ones it has."""
    if REAL_KV is not None:
        rows = torch.arange(n) % REAL_KV["key"].shape[0]
        return REAL_KV["key"][rows].to(device), REAL_KV["value"][rows].to(device)
    shape = (n, NUM_KV_HEADS, block_size, HEAD_DIM)
    k = torch.randn(shape, device=device, generator=gen)
    k[..., 7] *= 8
    k[..., HEAD_DIM // 2 + 27] += 6
    v = torch.randn(shape, device=device, generator=gen)
    return k, v


def decode_context(tables: torch.Tensor, context: int, device) -> Context:
    """One decode query per sequence of `tables` [batch, pages], each with `context` tokens cached."""
    batch = tables.shape[0]
    return Context(positions=torch.full((batch,), context - 1, device=device),
                   slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
                   block_tables=tables,
                   context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                   query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                   logits_indices=torch.arange(batch, device=device),
                   seq_slots=torch.arange(batch, device=device), max_query_len=1)


def build_cache(fmt, batch: int, context: int, block_size: int, device, gen):
    """One layer's pool for `batch` sequences of `context` tokens; returns (cache, ctx)."""
    pages_per_seq = -(-context // block_size)
    num_blocks = batch * pages_per_seq + 1
    cache = fmt.allocate(num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM, device, batch, torch.bfloat16)
    cache.rope_theta = ROPE_THETA  # read by keys_before_rope formats only
    unique = min(UNIQUE_PAGES, num_blocks)
    k, v = random_kv(unique, block_size, device, gen)
    repeat = torch.arange(num_blocks, device=device) % unique
    if "k_staging" not in cache.tensors:  # plain pages [N, Hkv, P, D]
        cache["k_pages"].copy_(k.to(cache["k_pages"].dtype)[repeat])
        cache["v_pages"].copy_(v.to(cache["v_pages"].dtype)[repeat])
    else:
        for name, kind, x in (("k", "key", k), ("v", "value", v)):
            slab = fmt.layout(kind, block_size, HEAD_DIM).pack(fmt.quantize(x, kind, cache.layer))
            if isinstance(fmt, FragmentPagedFormat) and fmt.is_fragment_pool(cache):  # a Gluon kernel's order
                for field, t in fmt.to_fragment(cache, kind, slab).items():
                    cache[field].copy_(t[repeat])
            else:
                cache[f"{name}_pages"].copy_(slab[repeat])
        tail = context % block_size  # the newest, partly filled page (staged in bf16)
        for name in ("k_staging", "v_staging"):
            cache[name].normal_(generator=gen)
            if tail:
                cache[name][:, :, tail:] = 0
        for name in ("k_residual", "v_residual"):  # a residual window's 16-bit ring of the newest tokens
            if name in cache.tensors:
                cache[name].normal_(generator=gen)
    del k, v
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen)[:batch * pages_per_seq]
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    ctx = decode_context(tables, context, device)
    return cache, ctx


def bytes_read(fmt, spec, batch: int, context: int, block_size: int) -> int:
    """What one decode step must read: page slabs of the quantized tokens, 16-bit tail and ring,
    q and the output (written)."""
    qo = 2 * batch * NUM_HEADS * HEAD_DIM * 2
    if spec is None or not spec.staged:  # plain pages: every token in its dtype
        return batch * NUM_KV_HEADS * context * HEAD_DIM * 2 * 2 + qo
    quantized = (context // block_size) * block_size
    if spec.residual:
        quantized = min(quantized, max(context - spec.residual, 0))
    slabs = (fmt.layout("key", block_size, HEAD_DIM).slab_bytes + fmt.layout("value", block_size, HEAD_DIM).slab_bytes)
    pages = -(-quantized // block_size)
    sixteen_bit = (context - quantized) * HEAD_DIM * 2 * 2
    return batch * NUM_KV_HEADS * (pages * slabs + sixteen_bit) + qo


LAUNCH_KEYS = ("block_n", "num_warps", "num_stages", "num_splits", "use_asm", "prefetch", "swap_ab", "max_registers")


def launcher_splits(q, cache, ctx, scale, spec, block_n, warps, stages, use_asm, prefetch, swap_ab,
                    max_registers=None, separate_tail=False) -> tuple[int, int]:
    """The (split count, register cap: 0 for none) paged_decode_attention chooses for this launch
    (by the compiled kernel's programs per SM and spills, decode/launch.py choose_launch)."""
    from moekv.ops.decode import launch as da
    from moekv.ops.decode.paged import paged_decode_attention

    paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, None, spec,
                           block_n=block_n, num_warps=warps, num_stages=stages, use_asm=use_asm, prefetch=prefetch,
                           swap_ab=swap_ab, max_registers=max_registers, separate_tail=separate_tail)
    return da.LAST_LAUNCH["num_splits"], da.LAST_LAUNCH["max_registers"] or 0


def config_splits(split_factor: int, batch: int, max_context: int, block_n: int, sms: int) -> int:
    """A config's splits: split_factor x num_splits_for's count, or exactly -split_factor when negative
    (sweep_decode_splits.py --split-counts)."""
    from moekv.ops.decode.launch import num_splits_for

    if split_factor < 0:
        return -split_factor
    return max(1, split_factor * num_splits_for(batch, NUM_KV_HEADS, max_context, block_n, sms))


def launches(args):
    """(config, swap_ab, max_registers) to time: every config in each orientation of --swap-ab (None: the
    spec's) and under each register cap of --max-registers (None: ptxas's choice)."""
    return [(config, swap_ab, regs) for config in args.configs for swap_ab in args.swap_ab
            for regs in args.max_registers]


def already_timed(launch: dict, results: list[dict]) -> bool:
    """A config that resolves to a launch already in `results` (the default is also one of the
    explicit shapes for every format: e.g. int4's prefetch 2) is not timed twice."""
    return any(all(r.get(k) == launch[k] for k in LAUNCH_KEYS) for r in results)


def fmt_spec_staged():
    """Stand-in spec for byte counting of a paged format without a kernel: pages + staged tail."""
    from moekv.ops.decode.common import DecodeSpec, TileReader

    return DecodeSpec(key=TileReader(None), value=TileReader(None), staged=True)


def reference_output(fmt, cache, ctx, q, context: int) -> torch.Tensor:
    """The reference decode attention of sequence 0 (fp32): [1, Hq, D]."""
    if hasattr(fmt, "gather"):
        k, v = fmt.gather(cache, ctx, 0, context, "key"), fmt.gather(cache, ctx, 0, context, "value")
    else:
        k = gather_kv_ref(cache["k_pages"], ctx.block_tables[0], context)
        v = gather_kv_ref(cache["v_pages"], ctx.block_tables[0], context)
    return decode_attention_ref(q[:1].float(), [k.float()], [v.float()], HEAD_DIM ** -0.5)


def sdpa_baseline(batch: int, context: int, device, gen, cudagraph: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    note = "flash, enable_gqa"

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        run()
    except RuntimeError as e:  # a flash build without GQA: give it the 32 heads it wants
        note = f"flash, K/V repeated to {NUM_HEADS} heads ({str(e).splitlines()[0][:80]})"
        k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
    ms = timer(run, cudagraph)
    eager = timer(run, cudagraph=False)
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    q = k = v = None  # free the tensors (rebound, not del: run() closes over them)
    torch.cuda.empty_cache()
    return {"ms": ms, "eager_ms": eager, "bytes": nbytes, "note": note}


def bench_format(label, batch, context, args, device, gen, bandwidth, base) -> dict:
    from moekv.ops.decode import launch as da
    from moekv.ops.decode.paged import paged_decode_attention

    name, options = FORMATS[label]
    row = {"format": label, "batch": batch, "context": context, "baseline_ms": base["ms"]}
    if name == "vq" and args.vq_calibration:
        options = {**options, "calibration": args.vq_calibration}
        if options.get("keys_before_rope"):
            options["calibration"] = before_rope_copy(args.vq_calibration)
    try:
        fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", **options)  # the Triton rows read slabs
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "skipped", "reason": f"cannot build the format: {e}"}
    if getattr(fmt, "needs_calibration", False) and "calibration" not in options:
        return {**row, "status": "skipped", "reason": "needs a calibration folder (moekv calibrate); not benchmarked"}
    try:
        fmt.check_layout(NUM_KV_HEADS, args.block_size, HEAD_DIM)
    except ValueError as e:
        return {**row, "status": "skipped", "reason": str(e)}
    if label in NUQ2_VARIANTS:
        from moekv.ops.decode.nuq2 import nuq2_spec

        spec = nuq2_spec(fmt, args.block_size, HEAD_DIM, slots=NUQ2_VARIANTS[label])
    else:
        spec = fmt.decode_spec(args.block_size, HEAD_DIM)
    row["bits_per_element"] = round(fmt.bits_per_element(NUM_KV_HEADS, args.block_size, HEAD_DIM), 4)
    scale = HEAD_DIM ** -0.5
    if FORMATS[label][0] == "tiered":
        return bench_tiered(fmt, row, batch, context, args, device, gen, bandwidth, base)
    if spec is None:
        if (batch, context) != min(args.shapes):
            return {**row, "status": "skipped", "reason": "no fused decode kernel; its reference path is timed "
                                                          "at the smallest shape only"}
        # the reference path (Python per sequence): a sanity figure, not a speed one
        try:
            cache, ctx = build_cache(fmt, batch, context, args.block_size, device, gen)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
            nbytes = bytes_read(fmt, fmt_spec_staged(), batch, context, args.block_size)
            ms = timer(lambda: fmt.attend(q, cache, ctx, scale, None), cudagraph=False)
            return {**row, "status": "reference", "ms": ms, "eager_ms": ms, "speedup": base["ms"] / ms,
                    "bytes": nbytes, "gbps": nbytes / ms * 1e-6, "floor_ms": nbytes / bandwidth * 1e3,
                    "reason": "no fused decode kernel: plain-PyTorch path, Python per sequence"}
        except Exception as e:  # noqa: BLE001 - a format still in progress must not stop the run
            return {**row, "status": "skipped", "reason": f"reference path failed: {type(e).__name__}: {e}"}
    cache, ctx = build_cache(fmt, batch, context, args.block_size, device, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    nbytes = bytes_read(fmt, spec, batch, context, args.block_size)
    tables = spec.tables(cache) if callable(spec.tables) else spec.tables
    if tables:  # per-layer tables outside the pages (vq's codebooks): read at least once per step
        row["table_bytes"] = sum(t.numel() * t.element_size() for t in tables)
        nbytes += row["table_bytes"]
    row.update(bytes=nbytes, floor_ms=nbytes / bandwidth * 1e3)

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ref = reference_output(fmt, cache, ctx, q, context)
    row["ref_max_abs"] = ref.abs().max().item()
    results = []
    max_context = ctx.block_tables.shape[1] * args.block_size
    for (block_n, warps, stages, split_factor, use_asm, prefetch), swap_ab, regs in launches(args):
        run_regs = regs
        if split_factor is None:  # the launcher's own choice, timed with exactly that launch
            splits, run_regs = launcher_splits(q, cache, ctx, scale, spec, block_n, warps, stages, use_asm, prefetch,
                                               swap_ab, regs, args.separate_tail)
        else:
            splits = config_splits(split_factor, batch, max_context, block_n, sms)

        def run(block_n=block_n, warps=warps, stages=stages, splits=splits, use_asm=use_asm, prefetch=prefetch,
                swap_ab=swap_ab, regs=run_regs):
            return paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, None,
                                          spec, num_splits=splits, block_n=block_n, num_warps=warps,
                                          num_stages=stages, use_asm=use_asm, prefetch=prefetch, swap_ab=swap_ab,
                                          max_registers=regs, separate_tail=args.separate_tail)
        launch = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "num_splits": splits,
                  "use_asm": use_asm, "prefetch": spec.prefetch if prefetch is None else prefetch,
                  "swap_ab": spec.swap_ab if swap_ab is None else bool(swap_ab),
                  "max_registers": spec.max_registers if regs is None else regs or None}
        if already_timed(launch, results):
            continue
        asked = {"split_factor": split_factor, "asked_registers": regs}  # what --write-config writes back
        try:
            out = run()
            torch.cuda.synchronize()
            launch["max_registers"] = da.LAST_LAUNCH["max_registers"]  # a default cap may be dropped (choose_launch)
            ms = timer(run, args.cudagraph)
            entry = {**launch, **asked, "ms": ms, "max_abs_err": (out[:1].float() - ref).abs().max().item()}
            if (block_n, warps, stages, split_factor, use_asm, prefetch) == DEFAULT_CONFIG and swap_ab is None \
                    and regs is None:
                entry["eager_ms"] = timer(run, cudagraph=False)
        except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported, not fatal
            entry = {**launch, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            traceback.print_exc(file=sys.stderr)
        results.append(entry)
    row["configs"] = results
    limit = tolerance(row["ref_max_abs"])
    # only correct launches compete (a bound competes on time alone)
    ok = [r for r in results if "ms" in r and (r["max_abs_err"] <= limit or label in INEXACT)]
    if not ok:
        bad = [r for r in results if "ms" in r]
        reason = (f"every launch shape disagrees with the reference "
                  f"(max error {min(r['max_abs_err'] for r in bad):.3g})"
                  if bad else results[0].get("error"))
        return {**row, "status": "wrong" if bad else "error", "reason": reason}
    best = min(ok, key=lambda r: r["ms"])
    default = next((r for r in ok if "eager_ms" in r), best)
    no_asm = next((r for r in ok if not r["use_asm"]), None)
    row.update(status="bound" if label in INEXACT else "kernel", ms=best["ms"], speedup=base["ms"] / best["ms"],
               gbps=nbytes / best["ms"] * 1e-6,
               default_ms=default["ms"], eager_ms=default.get("eager_ms"), block_n=best["block_n"],
               num_warps=best["num_warps"], num_stages=best["num_stages"], num_splits=best["num_splits"],
               use_asm=best["use_asm"], prefetch=best["prefetch"], swap_ab=best["swap_ab"],
               max_registers=best["max_registers"], no_asm_ms=no_asm["ms"] if no_asm else None,
               max_abs_err=max(r["max_abs_err"] for r in ok),
               wrong_launches=[r for r in results if "ms" in r and r["max_abs_err"] > limit] or None)
    cache = ctx = q = None  # free the cache (rebound, not del: the timed closures use these names)
    torch.cuda.empty_cache()
    return row


def timed_and_checked(row: dict, run, ref, base: dict, nbytes: int, args) -> None:
    """One Gluon row: `run` once, checked against `ref` (the first sequence's dense attention), then
    timed replayed and eager; the fields into `row`."""
    out = run()
    torch.cuda.synchronize()
    ms = timer(run, args.cudagraph)
    err = (out[:1].float() - ref).abs().max().item()
    row.update(status="kernel" if err <= tolerance(row["ref_max_abs"]) else "wrong", ms=ms,
               speedup=base["ms"] / ms, gbps=nbytes / ms * 1e-6, max_abs_err=err,
               eager_ms=timer(run, cudagraph=False))


def tail_split_study(fmt, cache, ctx, q, scale, args) -> dict:
    """A residual window's Gluon launch (fmt's decode entry, as attend calls it) timed with the ring's tail
    in one program and in the default number (ms by tail program count; the default's key is the count
    its launch planned, from moekv/ops/gluon/launch.py's plan_launch)."""
    import importlib

    kernel = fmt.gluon_kernel
    entry = kernel.decode_entry()
    module = importlib.import_module(entry.__module__)
    planned = []
    real = module.plan_launch
    module.plan_launch = lambda *a, **k: planned.append(real(*a, **k)) or planned[-1]
    try:
        entry(q, fmt.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
              staged=(cache["k_staging"], cache["v_staging"], ctx.seq_slots), **kernel.decode_options(fmt, cache))
    finally:
        module.plan_launch = real
    times = {}
    for tail_splits in sorted({1, planned[-1].tail_splits}):
        launch = lambda ts=tail_splits: entry(  # noqa: E731
            q, fmt.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
            staged=(cache["k_staging"], cache["v_staging"], ctx.seq_slots), tail_splits=ts,
            **kernel.decode_options(fmt, cache))
        times[str(tail_splits)] = timer(launch, args.cudagraph)
    return times


def bench_gluon(label, batch, context, args, device, gen, bandwidth, base) -> dict:
    """nuq2, int4, kivi2, vq or fp8_e4m3 through the engine's Gluon path (decode_kernel='gluon': pools in
    fragment order, KVFormat.attend -> moekv/ops/gluon/<format>_decode.py, the staged tail (and a residual
    window's ring) as the launch's extra split, the default split count), timed and checked as the Triton
    rows are: row `<label>_gluon`."""
    from moekv.ops.gluon.nuq2_layout import SLOT_BYTES, Nuq2FragmentPages

    name, options = FORMATS[label]
    if name == "vq":
        options = {**options, "calibration": args.vq_calibration}
    row = {"format": f"{label}_gluon", "batch": batch, "context": context, "baseline_ms": base["ms"]}
    try:
        fmt = get_kv_format(name, torch.bfloat16, decode_kernel="gluon", **options)
        cache, ctx = build_cache(fmt, batch, context, args.block_size, device, gen)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "skipped", "reason": f"no Gluon pools here: {type(e).__name__}: {e}"}
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    scale = HEAD_DIM ** -0.5
    pages = context // args.block_size if context % args.block_size else context // args.block_size - 1
    tail_tokens = context - pages * args.block_size  # the staged newest page, in bf16
    if "k_used" in cache.tensors:  # nuq2: codes and side tables, plus the used slots
        used = float(cache["k_used"].float().mean() + cache["v_used"].float().mean())  # slots a page-head reads
        per_page_head = Nuq2FragmentPages.code_bytes_per_page_head(None) + SLOT_BYTES * used
    elif "k_out_delta" in cache.tensors:  # int4: codes, scales, zeros, outlier channels and deltas
        used = None
        first_page = torch.zeros(1, dtype=torch.long, device=device)
        per_page_head = fmt.fragment_view(cache, first_page).kernel_bytes_per_page_head()
    elif "k_slabs" in cache.tensors:  # fp8_e4m3: its slabs (codes and row scales), in fragment order
        from moekv.ops.gluon.fp8_layout import fragment_bytes_per_page_head

        used = None
        per_page_head = fragment_bytes_per_page_head(fmt)
    elif "k_tok_scale" in cache.tensors:  # vq: codes, token scales and key means (the codebooks mostly from L2)
        from moekv.ops.gluon.vq_layout import VQFragmentPages

        used = None
        per_page_head = VQFragmentPages.kernel_bytes_per_page_head()
    else:  # kivi2: codes, scales and zeros
        from moekv.ops.gluon.kivi2_layout import Kivi2FragmentPages

        used = None
        per_page_head = Kivi2FragmentPages.kernel_bytes_per_page_head(None)
    if getattr(fmt, "residual", 0):  # a residual window (kivi2, nuq2, vq): the tail is the ring's R tokens
        from moekv.ops.gluon.splits import quantized_tokens

        quantized = quantized_tokens(context, True, fmt.residual)
        pages, tail_tokens = -(-quantized // args.block_size), context - quantized
    nbytes = int(batch * NUM_KV_HEADS * (pages * per_page_head + tail_tokens * HEAD_DIM * 4)
                 + 2 * batch * NUM_HEADS * HEAD_DIM * 2)
    row.update(bits_per_element=round(8 * fmt.page_bytes(NUM_KV_HEADS, args.block_size, HEAD_DIM)
                                      / (2 * NUM_KV_HEADS * args.block_size * HEAD_DIM), 4),
               bytes=nbytes, floor_ms=nbytes / bandwidth * 1e3, used_slots_per_page_head=used)
    ref = reference_output(fmt, cache, ctx, q, context)
    row["ref_max_abs"] = ref.abs().max().item()
    run = lambda: fmt.attend(q, cache, ctx, scale, None)  # noqa: E731
    try:
        timed_and_checked(row, run, ref, base, nbytes, args)
        if getattr(fmt, "residual", 0):  # the ring's tail: the default split of it against one program
            row["tail_splits_ms"] = tail_split_study(fmt, cache, ctx, q, scale, args)
        if "k_out_delta" in cache.tensors:  # int4: the same launch under ptxas register caps (a side study)
            from moekv.ops.gluon.int4_decode import int4_decode_attention

            frag = fmt.fragment_view(cache)
            staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)
            caps = {}
            for cap in GLUON_INT4_REGISTER_CAPS:
                launch = lambda cap=cap: int4_decode_attention(q, frag, ctx.block_tables, ctx.context_lens,  # noqa: E731
                                                               scale, max_registers=cap, staged=staged)
                caps[str(cap)] = timer(launch, args.cudagraph)
            row["max_registers_ms"] = caps
        elif "k_slabs" in cache.tensors:  # fp8_e4m3: the other choice of the steps' prefetch
            from moekv.ops.gluon.fp8_decode import DEFAULT_PREFETCH, fp8_decode_attention

            frag = fmt.fragment_view(cache)
            staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)
            row["prefetch_ms"] = {str(not DEFAULT_PREFETCH): timer(
                lambda: fp8_decode_attention(q, frag, ctx.block_tables, ctx.context_lens, scale, staged=staged,
                                             prefetch=not DEFAULT_PREFETCH), args.cudagraph)}
        elif "k_tok_scale" in cache.tensors:  # vq: where the codebooks are read, warps a CTA, register caps
            from moekv.ops.gluon.vq_decode import vq_decode_attention

            frag = fmt.fragment_view(cache)
            staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)
            ring = (cache["k_residual"], cache["v_residual"]) if fmt.residual else None
            def launch(**options):
                return lambda: vq_decode_attention(q, frag, ctx.block_tables, ctx.context_lens, scale, staged=staged,
                                                   residual=ring, **options)
            row["codebooks_ms"], row["codebooks_err"] = {}, {}
            for name, options in GLUON_VQ_CODEBOOKS.items():  # where the codewords are read from
                out = launch(**options)()
                row["codebooks_err"][name] = (out[:1].float() - ref).abs().max().item()
                row["codebooks_ms"][name] = timer(launch(**options), args.cudagraph)
        elif "k_codes" in cache.tensors and "k_slot_delta" not in cache.tensors:  # kivi2: the default cap and others
            from moekv.ops.gluon.kivi2_decode import kivi2_decode_attention

            frag = fmt.fragment_view(cache)
            staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)
            ring = (cache["k_residual"], cache["v_residual"]) if fmt.residual else None
            caps = {}
            for cap in GLUON_KIVI2_REGISTER_CAPS:
                launch = lambda cap=cap: kivi2_decode_attention(q, frag, ctx.block_tables, ctx.context_lens,  # noqa: E731
                                                                scale, max_registers=cap or None, staged=staged,
                                                                residual=ring)
                caps[str(cap or "none")] = timer(launch, args.cudagraph)
            row["max_registers_ms"] = caps
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    cache = ctx = q = None  # free the pools (rebound, not del: run closes over them)
    torch.cuda.empty_cache()
    return row


def bench_tiered_gluon(batch, context, args, device, gen, bandwidth, base, label: str = "tiered") -> dict:
    """tiered through the engine's Gluon path (decode_kernel='gluon': its pools in the Gluon
    kernel's orders, TieredFormat.attend -> moekv/ops/gluon/tiered_decode.py: FP8 and nuq2 pages and
    the staged tail in one launch, then the reduce and the per-page mass into the device accumulator),
    on bench_tiered's cache (~15% of pages in FP8): row `<label>_gluon` (tiered_all_slots: its nuq2 tier
    filling every slot);
    nomass_ms: without the mass;
    side studies: max_registers_ms (other ptxas caps; smem_max_registers_ms with the nuq2 pages in
    shared memory), fp8_prefetch_ms (the other FP8 step loop, with its error against the reference in
    fp8_prefetch_err), smem_ms (the nuq2 pages through global loads and staged in shared memory,
    each choice explicit, their errors in smem_err)."""

    from moekv.kvcache.formats.tiered import TIER_FP8
    from moekv.ops.gluon import nuq2_layout
    from moekv.ops.gluon.tiered_decode import DEFAULT_FP8_PREFETCH, tiered_decode_attention

    P = args.block_size
    row = {"format": f"{label}_gluon", "batch": batch, "context": context, "baseline_ms": base["ms"]}
    try:
        fmt = get_kv_format("tiered", torch.bfloat16, decode_kernel="gluon", codebook="page", **FORMATS[label][1])
        cache, ctx = build_tiered_cache(fmt, batch, context, P, device, gen, args.tiered_fp8_share)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "skipped", "reason": f"no Gluon pools here: {type(e).__name__}: {e}"}
    st = cache.state
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    scale = HEAD_DIM ** -0.5
    full = context // P
    n_fp8 = sum(st.tier[p] == TIER_FP8 for p in ctx.block_tables[:, :full].flatten().tolist())
    fp8_slab = sum(fmt.hi.layout(kind, P, HEAD_DIM).slab_bytes for kind in ("key", "value"))
    used = float(cache["k_used"].float().mean() + cache["v_used"].float().mean())
    low = nuq2_layout.Nuq2FragmentPages.code_bytes_per_page_head(None) + nuq2_layout.SLOT_BYTES * used
    tail = batch * NUM_KV_HEADS * (context - full * P) * HEAD_DIM * 2 * 2  # the staged bf16 tail, K and V
    nbytes = int(NUM_KV_HEADS * (n_fp8 * fp8_slab + (batch * full - n_fp8) * low) + tail
                 + 2 * batch * NUM_HEADS * HEAD_DIM * 2)
    row.update(bytes=nbytes, floor_ms=nbytes / bandwidth * 1e3, fp8_page_share=n_fp8 / max(1, batch * full),
               used_slots_per_page_head=used, mass_bytes=batch * NUM_HEADS * ctx.block_tables.shape[1] * 8)
    ref = reference_output(fmt, cache, ctx, q, context)
    row["ref_max_abs"] = ref.abs().max().item()
    frag = nuq2_layout.fragment_view(fmt.lo, cache)
    staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)
    run = lambda: fmt.attend(q, cache, ctx, scale, None)  # noqa: E731
    run_nomass = lambda: tiered_decode_attention(q, frag, cache["k_fp8"], cache["v_fp8"], st.tier_dev,  # noqa: E731
                                                 st.slot_dev, ctx.block_tables, ctx.context_lens, scale,
                                                 fp8_fmt=fmt.hi, staged=staged, emit_mass=False)[0]

    def gluon(**launch):  # the engine's launch (mass included) with other launch options
        return lambda: fmt.attend_gluon(q, cache, ctx, scale, None, **launch)

    def error(launch) -> float:
        return (launch()[:1].float() - ref).abs().max().item()

    try:
        timed_and_checked(row, run, ref, base, nbytes, args)
        row["nomass_ms"] = timer(run_nomass, args.cudagraph)

        # side study of the default cap 128: other ptxas caps, with the default staging choice and with
        # the nuq2 pages in shared memory
        caps = {str(cap or "none"): timer(gluon(max_registers=cap), args.cudagraph)
                for cap in GLUON_TIERED_REGISTER_CAPS}
        smem_caps = {str(cap or "none"): timer(gluon(max_registers=cap, smem=True), args.cudagraph)
                     for cap in GLUON_TIERED_REGISTER_CAPS}
        row.update(max_registers_ms=caps, smem_max_registers_ms=smem_caps)
        other = gluon(fp8_prefetch=not DEFAULT_FP8_PREFETCH)
        row.update(fp8_prefetch_err=error(other),
                   fp8_prefetch_ms={str(not DEFAULT_FP8_PREFETCH): timer(other, args.cudagraph)})
        # both staging choices explicitly (the default picks one by the launch's size)
        choices = {str(smem): gluon(smem=smem) for smem in (False, True)}
        row.update(smem_err={k: error(launch) for k, launch in choices.items()},
                   smem_ms={k: timer(launch, args.cudagraph) for k, launch in choices.items()})
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    st.mass_dev.zero_()
    st.mass_pending = False
    cache = ctx = q = frag = staged = None  # free the pools (rebound, not del: run closes over them)
    torch.cuda.empty_cache()
    return row


GLUON_FORMATS = ("nuq2", "int4", "kivi2", "tiered", "vq", "fp8_e4m3")  # formats with a Gluon kernel (--kernel gluon)
GLUON_TIERED_REGISTER_CAPS = (168, 0)  # tiered's: 185 registers uncapped (0), 168 no spills, 128 (default) 192 B stack
GLUON_INT4_REGISTER_CAPS = (200, 168)  # int4's Gluon kernel: 255 registers uncapped (8 programs an SM)
# vq's codebooks: global (one-warp programs, L1/L2 gathers, cap 128) or shared by the warps of a CTA
# (vq_smem_kernel: 4 warps at cap 168, three CTAs an SM, by default; 8 at 128, two; 8 uncapped, one; 16 at
# 128, one)
GLUON_VQ_CODEBOOKS = {"global": {"codebooks": "global"}, "shared_w4": {"codebooks": "shared", "warps": 4},
                      "shared_w8_cap128": {"codebooks": "shared", "warps": 8, "max_registers": 128},
                      "shared_w8_uncapped": {"codebooks": "shared", "warps": 8, "max_registers": None},
                      "shared_w16_cap128": {"codebooks": "shared", "warps": 16, "max_registers": 128}}
GLUON_KIVI2_REGISTER_CAPS = (0, 200)  # kivi2's: 168 by default (12 programs an SM), 240-247 uncapped (0), 200 spills
TIERED_FP8_SHARE = 0.15  # pages in FP8 in the tiered benchmark's cache (its default tier1_fraction)


def random_vq_calibration() -> Path:
    """A vq calibration fitted on Gaussian pages of this benchmark's heads (random_calibration), in a
    fresh temporary folder named vqcal* (the result file records it as random by that name)."""
    import tempfile

    from moekv.kvcache.formats.vq import random_calibration

    return random_calibration(Path(tempfile.mkdtemp(prefix="vqcal")), NUM_KV_HEADS, HEAD_DIM)


def before_rope_copy(folder: Path) -> Path:
    """The calibration `folder`'s tables in a temporary folder whose record says they were fitted on
    keys before RoPE (what vq_prerope needs to build; the speed does not depend on the fit)."""
    import json
    import shutil
    import tempfile

    from moekv.kvcache.calibration_io import CALIBRATION_FILE, RECORD_FILE

    out = Path(tempfile.mkdtemp(prefix="vqcal_prerope"))
    shutil.copy(Path(folder) / CALIBRATION_FILE, out / CALIBRATION_FILE)
    (out / RECORD_FILE).write_text(json.dumps({"keys_before_rope": True, "tables_of": str(folder)}))
    return out


def fp8_page(i: int, share: float) -> bool:
    """Whether a sequence's i-th full page is in FP8 in the tiered benchmark's cache: at the default
    share the pages whose index is 3, 10, 16, ... of 20 (spread over the context), at another share
    every page where i * share passes a whole number (1.0: every page)."""
    if share == TIERED_FP8_SHARE:
        return (i % 20) in (3, 10, 16)
    return int((i + 1) * share) > int(i * share)


def build_tiered_cache(fmt, batch: int, context: int, block_size: int, device, gen,
                       fp8_share: float = TIERED_FP8_SHARE):
    """A tiered layer with fp8_share of each sequence's full pages in FP8 (fp8_page) and the rest in
    nuq2, both pools filled from the same random pages; host state and the kernel's device mirrors as
    the format keeps them."""
    from moekv.kvcache.formats.tiered import TIER_FP8, TIER_LOW

    pages_per_seq = -(-context // block_size)
    num_blocks = batch * pages_per_seq + 1
    fmt.fp8_pool_fraction = min(1.0, fp8_share + 0.05)
    cache = fmt.allocate(num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM, device, batch, torch.bfloat16)
    unique = min(UNIQUE_PAGES, num_blocks)
    k, v = random_kv(unique, block_size, device, gen)
    num_fp8 = cache["k_fp8"].shape[0]
    for name, kind, x in (("k", "key", k), ("v", "value", v)):
        for sub, pool in ((fmt.hi, "fp8"), (fmt.lo, "low")):
            slab = sub.layout(kind, block_size, HEAD_DIM).pack(sub.quantize(x, kind, cache.layer))
            n = num_fp8 if pool == "fp8" else num_blocks
            rows = torch.arange(n, device=device) % unique
            for field, t in fmt.tier_tables(cache, pool, kind, slab).items():  # the unique pages converted once
                cache[field].copy_(t[rows])
    for name in ("k_staging", "v_staging"):
        cache[name].normal_(generator=gen)
        if context % block_size:
            cache[name][:, :, context % block_size:] = 0
    del k, v
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen)[:batch * pages_per_seq]
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    st = cache.state
    full = context // block_size
    for row in tables[:, :full].tolist():
        for i, page in enumerate(row):
            if fp8_page(i, fp8_share) and st.free_fp8:
                st.tier[page], st.fp8_slot[page] = TIER_FP8, st.free_fp8.pop()
            else:
                st.tier[page] = TIER_LOW
    fmt._sync_pages(cache, [p for p in range(num_blocks) if st.tier[p]])
    ctx = decode_context(tables, context, device)
    assert num_fp8 >= 1
    return cache, ctx


def bench_tiered(fmt, row, batch, context, args, device, gen, bandwidth, base) -> dict:
    """tiered through its own kernel (moekv/ops/decode/tiered.py): ~15% of pages FP8, the rest nuq2;
    ms is the engine's path (kernel + per-page mass into the device accumulator), nomass_ms the
    kernel alone without the mass output."""
    from moekv.kvcache.formats.tiered import TIER_FP8
    from moekv.ops.decode import launch as da
    from moekv.ops.decode.launch import format_tuning, register_cap
    from moekv.ops.decode.tiered import tiered_decode_attention

    P = args.block_size
    cache, ctx = build_tiered_cache(fmt, batch, context, P, device, gen, args.tiered_fp8_share)
    st = cache.state
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    scale = HEAD_DIM ** -0.5
    full = context // P
    n_fp8 = sum(st.tier[p] == TIER_FP8 for p in ctx.block_tables[:, :full].flatten().tolist())
    slab = {t: sum(f.layout(kind, P, HEAD_DIM).slab_bytes for kind in ("key", "value")) for t, f in
            (("fp8", fmt.hi), ("low", fmt.lo))}
    tiles = batch * NUM_HEADS * ctx.block_tables.shape[1] * (P // min(64, P))
    nbytes = (NUM_KV_HEADS * (n_fp8 * slab["fp8"] + (batch * full - n_fp8) * slab["low"])
              + batch * NUM_KV_HEADS * (context - full * P) * HEAD_DIM * 2 * 2 + 2 * batch * NUM_HEADS * HEAD_DIM * 2)
    row.update(bytes=nbytes, floor_ms=nbytes / bandwidth * 1e3, fp8_page_share=n_fp8 / max(1, batch * full),
               mass_bytes=tiles * 8)
    ref = reference_output(fmt, cache, ctx, q, context)
    row["ref_max_abs"] = ref.abs().max().item()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    results = []
    for (block_n, warps, stages, split_factor, use_asm, prefetch), swap_ab, regs in launches(args):
        if block_n > P:  # its tiles lie in one page
            continue
        launch = dict(num_splits=None, block_n=block_n, num_warps=warps, num_stages=stages, use_asm=use_asm,
                      prefetch=prefetch, swap_ab=swap_ab, max_registers=regs, separate_tail=args.separate_tail)
        if split_factor is None:  # the launcher's choice (choose_launch at the compiled kernel's occupancy)
            fmt.attend_kernel(q, cache, ctx, scale, None, **launch)  # the engine's path, mass included
            splits = da.LAST_LAUNCH["num_splits"]
            launch["max_registers"] = da.LAST_LAUNCH["max_registers"] or 0  # timed with exactly that launch
        else:
            splits = config_splits(split_factor, batch, ctx.block_tables.shape[1] * P, block_n, sms)
        launch["num_splits"] = splits

        def run(launch=launch):
            return fmt.attend_kernel(q, cache, ctx, scale, None, **launch)

        def run_nomass(launch=launch):
            return tiered_decode_attention(q, cache, st.tier_dev, st.slot_dev, ctx.block_tables,
                                           ctx.context_lens, ctx.seq_slots, scale, None, fmt.hi, fmt.lo,
                                           emit_mass=False, **launch)[0]
        entry = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "num_splits": splits, "use_asm": use_asm,
                 "prefetch": format_tuning("tiered").prefetch if prefetch is None else prefetch,
                 "swap_ab": format_tuning("tiered").swap_ab if swap_ab is None else bool(swap_ab),
                 "max_registers": register_cap("tiered", P) if regs is None else regs or None}
        if already_timed(entry, results):
            continue
        try:
            out = run()
            torch.cuda.synchronize()
            entry["max_registers"] = da.LAST_LAUNCH["max_registers"]  # a default cap may be dropped (choose_launch)
            entry.update(ms=timer(run, args.cudagraph), nomass_ms=timer(run_nomass, args.cudagraph),
                         max_abs_err=(out[:1].float() - ref).abs().max().item())
            if (block_n, warps, stages, split_factor, use_asm, prefetch) == DEFAULT_CONFIG and swap_ab is None \
                    and regs is None:
                entry["eager_ms"] = timer(run, cudagraph=False)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc(file=sys.stderr)
        results.append(entry)
    st.mass_dev.zero_()
    st.mass_pending = False
    row["configs"] = results
    limit = tolerance(row["ref_max_abs"])
    ok = [r for r in results if "ms" in r and r["max_abs_err"] <= limit]
    if not ok:
        bad = [r for r in results if "ms" in r]
        return {**row, "status": "wrong" if bad else "error",
                "reason": "every launch shape disagrees with the reference" if bad else results[0].get("error")}
    best = min(ok, key=lambda r: r["ms"])
    default = next((r for r in ok if "eager_ms" in r), best)
    row.update(status="kernel", ms=best["ms"], nomass_ms=best["nomass_ms"], speedup=base["ms"] / best["ms"],
               gbps=nbytes / best["ms"] * 1e-6, default_ms=default["ms"], eager_ms=default.get("eager_ms"),
               block_n=best["block_n"], num_warps=best["num_warps"], num_stages=best["num_stages"],
               num_splits=best["num_splits"], use_asm=best["use_asm"], prefetch=best["prefetch"],
               swap_ab=best["swap_ab"], max_registers=best["max_registers"],
               max_abs_err=max(r["max_abs_err"] for r in ok),
               wrong_launches=[r for r in results if "ms" in r and r["max_abs_err"] > limit] or None)
    cache = ctx = q = None  # free the cache (rebound, not del: the timed closures use these names)
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "h200" / "decode_attention.json")
    p.add_argument("--quick", action="store_true", help="smoke run: two small shapes, the default launch shape only")
    p.add_argument("--formats", nargs="*", default=[f for f in FORMATS if f not in NUQ2_VARIANTS.keys() | ONLY_NAMED],
                   help=f"labels among {list(FORMATS)} (kernel variants {list(NUQ2_VARIANTS)} only when named)")
    p.add_argument("--shapes", nargs="*", default=None, help="batchxcontext, e.g. 1x4096 16x32768")
    p.add_argument("--configs", nargs="*", type=int, default=None,
                   help=f"indices into CONFIGS (default: all; 0 is the default launch): {CONFIGS}")
    p.add_argument("--swap-ab", nargs="*", default=None, choices=("spec", "0", "1"),
                   help="orientations of the products to time with every config (default: the spec's; "
                        "0: scores as q @ k^T, 1: as k @ q^T, DecodeSpec.swap_ab)")
    p.add_argument("--max-registers", nargs="*", default=None,
                   help="ptxas register caps to time with every config ('spec': the format's default, "
                        "decode/launch.py register_cap; 'none': ptxas's own choice; e.g. none 80)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per page (64: kivi2 needs a multiple of 32)")
    p.add_argument("--no-cudagraph", dest="cudagraph", action="store_false",
                   help="time with plain do_bench (Python launch included) instead of CUDA-graph replay")
    p.add_argument("--separate-tail", action="store_true",
                   help="every launch with the 16-bit tail in a program of its own ("
                        "default: where DecodeSpec.tail_in_last_split says; fp8 keeps its own program)")
    p.add_argument("--write-config", action="store_true",
                   help="write each format's best launch over the shapes (prefetch, swap_ab, and the register cap "
                        "and split factor where the run set them) into moekv/ops/configs/ (moekv/ops/tuning.py)")
    p.add_argument("--tiered-fp8-share", type=float, default=TIERED_FP8_SHARE,
                   help="share of full pages in FP8 in tiered's cache, both kernels (1.0: every page, so "
                        "tiered_gluon's nomass_ms is what the Gluon tiered kernel's FP8 path would cost as an "
                        "fp8_e4m3 kernel)")
    p.add_argument("--vq-calibration", type=Path, default=None,
                   help="calibration folder for vq (default: a random one fitted at start, see the docstring)")
    p.add_argument("--kernel", nargs="+", choices=("triton", "gluon"), default=["triton"],
                   help="the decode kernels to time (nuq2, int4, kivi2, tiered, vq): triton (slab pools, "
                        "moekv/ops/decode) and/or gluon (fragment order, moekv/ops/gluon; rows <format>_gluon)")
    p.add_argument("--pages", choices=("random", "domain-moe"), default="random",
                   help="what the pages hold: random keys and values (random_kv), or domain-moe's keys and values "
                        "on its held-out text (domain_moe_kv; the quantized formats' outliers as the engine meets "
                        "them there)")
    p.add_argument("--peers", nargs="*", choices=PEERS, default=[],
                   help="other libraries timed after each shape's SDPA row "
                        "(flashinfer: benchmarks/kernels/flashinfer_peer.py)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention: needs a CUDA device")
    if args.vq_calibration is None and any(FORMATS[f][0] == "vq" for f in args.formats if f in FORMATS):
        t0 = time.time()
        args.vq_calibration = random_vq_calibration()
        print(f"vq: random calibration fitted in {time.time() - t0:.1f} s ({args.vq_calibration})", flush=True)
    args.swap_ab = [None if v == "spec" else v == "1" for v in (args.swap_ab or ["spec"])]
    args.max_registers = [{"spec": None, "none": 0}.get(v) if v in ("spec", "none") else int(v)
                          for v in (args.max_registers or ["spec"])]
    args.shapes = ([tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes
                   else QUICK_SHAPES if args.quick else SHAPES)
    args.configs = ([DEFAULT_CONFIG] if args.quick else CONFIGS if args.configs is None
                    else [CONFIGS[i] for i in args.configs])
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.time()
    if args.pages == "domain-moe":
        global REAL_KV
        REAL_KV = domain_moe_kv(args.block_size)
        print(f"domain-moe's pages: {REAL_KV['key'].shape[0]} of {NUM_KV_HEADS} heads ({time.time() - started:.1f} s)",
              flush=True)
    bandwidth = measure_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    peers = {}
    if "flashinfer" in args.peers:  # imported only when asked: the peer needs flashinfer-python
        from flashinfer_peer import flashinfer_rows, flashinfer_version

        peers["flashinfer"], reason = flashinfer_version()
        print(f"flashinfer {peers['flashinfer'] or reason}", flush=True)
    rows = []
    for batch, context in args.shapes:
        base = sdpa_baseline(batch, context, device, gen, args.cudagraph)
        rows.append({"format": "sdpa_bf16", "batch": batch, "context": context, "status": "baseline",
                     "ms": base["ms"], "baseline_ms": base["ms"], "speedup": 1.0, "bytes": base["bytes"],
                     "gbps": base["bytes"] / base["ms"] * 1e-6, "floor_ms": base["bytes"] / bandwidth * 1e3,
                     "eager_ms": base["eager_ms"], "note": base["note"]})
        print(f"\n({batch}, {context}) sdpa {base['ms'] * 1e3:.1f} us  [{base['note']}]", flush=True)
        if "flashinfer" in peers:
            for row in flashinfer_rows(batch, context, args.block_size, device, gen, bandwidth, base, args.cudagraph,
                                       sys.modules[__name__]):
                rows.append(row)
                print_row(row)
        for label in args.formats:
            gluon = FORMATS[label][0] in GLUON_FORMATS and label not in NUQ2_VARIANTS
            if "triton" in args.kernel or not gluon:
                row = bench_format(label, batch, context, args, device, gen, bandwidth, base)
                rows.append(row)
                print_row(row)
            if "gluon" in args.kernel and gluon:
                if FORMATS[label][0] == "tiered":
                    rows.append(bench_tiered_gluon(batch, context, args, device, gen, bandwidth, base, label))
                else:
                    rows.append(bench_gluon(label, batch, context, args, device, gen, bandwidth, base))
                print_row(rows[-1])
            write_record(args, bandwidth, started, peers, rows)  # after each row: a cut-off run keeps what it measured
    write_record(args, bandwidth, started, peers, rows)
    print(f"\nwrote {args.out} ({time.time() - started:.1f} s)")
    if args.write_config:
        from moekv.ops.tuning import write_tuning

        formats = {label: best_launch(rows, label) for label in args.formats if label in KV_FORMAT_NAMES}
        path = write_tuning("decode_attention", torch.cuda.get_device_name(), {"formats": formats})
        print(f"wrote {path}: {formats}")
    print_table(rows)


def best_launch(rows: list[dict], label: str) -> dict:
    """The tuning fields of `label`'s launch with the least time over the run's shapes (each shape's times
    relative to its best correct launch; tiles of 64, 4 warps, 2 stages; launches timed at every shape):
    prefetch and swap_ab, and the register cap and split factor where the run asked for them."""
    timed = {}
    shapes = [r for r in rows if r["format"] == label and r.get("status") == "kernel"]
    for row in shapes:
        ok = [c for c in row["configs"] if "ms" in c and c["max_abs_err"] <= tolerance(row["ref_max_abs"])
              and (c["block_n"], c["num_warps"], c["num_stages"]) == (64, 4, 2)]
        for c in ok:
            key = (c["prefetch"], c["swap_ab"], c.get("asked_registers"), c.get("split_factor"))
            timed.setdefault(key, []).append(c["ms"] / min(o["ms"] for o in ok))
    full = {key: sum(times) for key, times in timed.items() if len(times) == len(shapes)}
    if not full:
        return {}
    prefetch, swap_ab, regs, split_factor = min(full, key=full.get)
    best = {"prefetch": prefetch, "swap_ab": swap_ab}
    if regs is not None:  # 0: ptxas's own choice
        best["max_registers"] = regs or None
    if split_factor is not None and split_factor > 0:
        best["split_factor"] = split_factor
    return best


def write_record(args, bandwidth: float, started: float, peers: dict, rows: list[dict]) -> None:
    """The result file: run metadata and every row so far."""
    import triton

    record = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "command": " ".join(["python"] + (COMMAND_ARGV or sys.argv)),
        "bandwidth_gbps": bandwidth / 1e9,
        "timer": "do_bench_cudagraph median" if args.cudagraph else "do_bench median",
        "heads": {"query": NUM_HEADS, "kv": NUM_KV_HEADS, "head_dim": HEAD_DIM}, "block_size": args.block_size,
        "seconds": round(time.time() - started, 1), "separate_tail": args.separate_tail, "pages": args.pages,
        "vq_calibration": ("random (moekv.kvcache.formats.vq.random_calibration)"
                           if args.vq_calibration and args.vq_calibration.name.startswith("vqcal")
                           else (str(args.vq_calibration) if args.vq_calibration else None)),
        "peers": peers,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


def print_row(row: dict) -> None:
    """One progress line per format or peer row."""
    if "ms" in row:
        print(f"  {row['format']:>9} {row['status']:>9}: {row['ms'] * 1e3:9.1f} us  x{row['speedup']:.2f} vs sdpa  "
              f"{row['gbps']:6.0f} GB/s  floor {row['floor_ms'] * 1e3:8.1f} us  err {row.get('max_abs_err')}",
              flush=True)
        for key, label in (("max_registers_ms", "register caps"),
                           ("smem_max_registers_ms", "register caps, nuq2 pages in shared memory"),
                           ("smem_ms", "nuq2 pages in shared memory"), ("codebooks_ms", "vq codebooks"),
                           ("codebooks_err", "vq codebooks' errors"),
                           ("tail_splits_ms", "ring tail programs (count: time)")):
            if key in row:
                shown = "{:.2g}" if key.endswith("_err") else "{:.1f} us"  # errors as they are, times in us
                scale = 1 if key.endswith("_err") else 1e3
                times = ", ".join(f"{option} {shown.format(x * scale)}" for option, x in row[key].items())
                print(f"            {label}: {times}", flush=True)
    else:
        print(f"  {row['format']:>9} {row['status']}: {row.get('reason')}", flush=True)


def print_table(rows: list[dict]) -> None:
    print("\n| format | batch | context | ms | SDPA ms | speedup | GB/s | floor ms | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" not in r:
            print(f"| {r['format']} | {r['batch']} | {r['context']} | {r['status']}: {r.get('reason', '')} | | | | | |")
            continue
        print(f"| {r['format']} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['baseline_ms']:.4f} | "
              f"{r['speedup']:.2f} | {r['gbps']:.0f} | {r['floor_ms']:.4f} | {100 * r['floor_ms'] / r['ms']:.0f}% |")


if __name__ == "__main__":
    main()
