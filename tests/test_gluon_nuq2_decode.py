"""The nuq2 Gluon decode path (moekv/ops/gluon/nuq2_decode.py). On CPU: its split reference (the
keys' channel affine folded into q, the outlier slots folded in as one-hot products, the staged
16-bit tail as one more split or, with a residual ring, several, sliding windows) against dense
attention over nuq2's own dequantized pages, in float64; the launch's split rules. On a GPU (marked
gpu): the Gluon kernel against that reference and dense attention."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.ops.gluon.launch import programs_per_sm
from moekv.ops.gluon.nuq2_decode import (
    default_num_splits,
    nuq2_decode_split_reference,
    reduce_partials,
)
from moekv.ops.gluon.nuq2_layout import dequantize_fragment, slot_positions, to_fragment_order
from moekv.ops.reference import decode_attention_ref
from tests.gluon_cases import (
    GPU,
    RING_SPLIT_CASES,
    D,
    P,
    behind_tables,
    check_decode_matches_dense,
    check_kernel_matches_reference,
    check_prefetch_changes_nothing,
    check_ring_decode,
    check_ring_partials,
    check_ring_reference,
    check_staged_decode,
    dense_reference,
    gpu_case,
    large_channel_keys,
    num_pages,
    pack,
    relative_error,
    run_sm90_build,
    staging,
)


def build(lens, Hkv, seed, outliers=True, device="cpu", heavy=True):
    """Random nuq2 pages for sequences of lengths `lens` behind a shuffled block table, in
    fragment order -> (fmt, frag, block_tables, context_lens, k_pages, v_pages)."""
    fmt = NUQ2Format(codebook="page", quantize_kernel=False,
                     outlier_cap=1024)  # every slot fillable: the kernel's later slot chunks run
    g = torch.Generator().manual_seed(seed)
    N = num_pages(lens)
    k = large_channel_keys(N, Hkv, g)
    v = torch.randn(N, Hkv, P, D, generator=g)
    if heavy:
        k.view(-1)[torch.randint(0, k.numel(), (N * 6,), generator=g)] *= 12
        v.view(-1)[torch.randint(0, v.numel(), (N * 4,), generator=g)] *= 10
    no_slots = None if outliers else (lambda fields: fields["out_idx"].fill_(0xFFFF))
    return behind_tables(fmt, pack(fmt, k, v, no_slots), lens, g, to_fragment_order, device)


def fewer_slots(frag, sk: int, sv: int):
    """frag with only the first sk key and sv value slots of each page-head (used ones come first:
    the used counts clipped to them)."""
    return dataclasses.replace(
        frag, k_out_idx=frag.k_out_idx[..., :sk].contiguous(), k_slot_delta=frag.k_slot_delta[..., :sk].contiguous(),
        k_used=frag.k_used.clamp(max=sk), v_out_idx=frag.v_out_idx[..., :sv].contiguous(),
        v_slot_delta=frag.v_slot_delta[..., :sv].contiguous(), v_used=frag.v_used.clamp(max=sv))


def kernel_pages(frag, kind: str) -> torch.Tensor:
    """Pages [N, H, 64, 128] float64 as the kernel's algebra sees them: the codebook term plus each used
    slot's stored (fp16) delta at its element (keys: the delta is already in key units)."""
    n, H = frag.k_codes.shape[:2]
    name = "k" if kind == "key" else "v"
    x = dequantize_fragment(frag, kind, outliers=False).double().reshape(n, H, P * D)
    idx = slot_positions(getattr(frag, f"{name}_out_idx"))
    used = idx != 0xFFFF
    x.scatter_add_(2, torch.where(used, idx, 0), torch.where(used, getattr(frag, f"{name}_slot_delta").double(), 0.0))
    return x.reshape(n, H, P, D)


def attention_over(q, k, v, tables, lens, scale):
    """decode_attention_ref (float64) over pages k, v [N, H, 64, 128] behind block tables."""
    Hkv = k.shape[1]
    keys = [k[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n] for b, n in enumerate(lens)]
    values = [v[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n] for b, n in enumerate(lens)]
    return decode_attention_ref(q, keys, values, scale)


@pytest.mark.parametrize("G, num_splits", [(1, 3), (4, 1), (4, 8), (8, 3)])
def test_split_reference_matches_dense_attention(G, num_splits):
    """The fold of the outlier slots (one-hot products in the tile) is exact: the reference equals dense
    attention over the pages the tables hold (codebook term + fp16 slot deltas) to float64's precision;
    against nuq2's own dequantized pages (the slots' FP8 values, unrounded deltas) it differs only by the
    deltas' fp16 rounding (measured: at most 3.5e-4 on these outputs, under 1/100 of what the slots
    themselves change); without the slots it differs by far more."""
    Hkv = 2
    lens = [64, 200, 5 * 64 + 1]  # on and off page boundaries; 8 splits leave some empty
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=G + num_splits)
    assert (frag.k_used > 0).any() and (frag.v_used > 0).any()
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = D ** -0.5
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, scale)
    part_o, part_lse = nuq2_decode_split_reference(q, frag, tables, lens_t, scale, num_splits)
    assert part_o.shape == (len(lens), Hkv * G, num_splits, D)
    out = reduce_partials(part_o, part_lse)
    exact = attention_over(q, kernel_pages(frag, "key"), kernel_pages(frag, "value"), tables, lens, scale)
    torch.testing.assert_close(out, exact, rtol=1e-9, atol=1e-9)
    fp16_error = float((out - ref).abs().max())
    main_o, main_lse = nuq2_decode_split_reference(q, frag, tables, lens_t, scale, num_splits, outliers=False)
    slots_change = float((reduce_partials(main_o, main_lse) - ref).abs().max())
    assert 0 < fp16_error < slots_change / 100 and slots_change > 1e-2


def test_codebook_term_is_attention_over_pages_without_outliers():
    """outliers=False: attention over the codebook values with the keys' channel affine, slots
    ignored (dequantize_fragment(outliers=False))."""
    Hkv, G, lens = 2, 4, [130, 64 * 3]
    _, frag, tables, lens_t, _, _ = build(lens, Hkv, seed=3)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kd, vd = dequantize_fragment(frag, "key", outliers=False), dequantize_fragment(frag, "value", outliers=False)
    keys = [kd[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].double()
            for b, n in enumerate(lens)]
    values = [vd[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].double()
              for b, n in enumerate(lens)]
    ref = decode_attention_ref(q, keys, values, 0.1)
    out = reduce_partials(*nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 2, outliers=False))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_pages_without_slots():
    Hkv, G, lens = 2, 4, [100]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=4, outliers=False)
    assert int(frag.k_used.sum()) == 0 and int(frag.v_used.sum()) == 0
    q = torch.randn(1, Hkv * G, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o, lse = nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 2)
    o2, lse2 = nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 2, outliers=False)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    torch.testing.assert_close(reduce_partials(o, lse), dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 1, 50, 64 * 2 + 3, 10_000])
def test_staged_tail_and_sliding_window(window):
    """The staged 16-bit tail as split num_splits (the newest page, even when full, from staging)
    and sliding windows (pages before the window skipped, the first one masked), against dense
    attention over pages + staging with the same window (within the slot deltas' fp16 rounding)."""
    Hkv, G = 2, 4
    lens = [64, 65, 200, 5 * 64 + 1, 4 * 64]  # tails of 64, 1, 8, 1, 64 tokens
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=7)
    staged = staging(len(lens), Hkv, seed=8)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1, staged, window)
    for ns in (1, 3):
        part_o, part_lse = nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, ns, staged=staged,
                                                       sliding_window=window)
        assert part_o.shape[2] == ns + 1 and bool(part_lse[:, :, ns].isfinite().all())  # every tail holds a token
        assert relative_error(reduce_partials(part_o, part_lse), ref) < 3e-3  # the slot deltas' fp16 rounding
    if window == 1:  # only the newest token counts: the page splits are empty
        assert bool((part_lse[:, :, :ns] == -float("inf")).all())


@pytest.mark.parametrize("R, window", [(64, None), (128, 100), (200, 150), (32, 64 * 5 + 3)])
def test_residual_ring_and_sliding_window(R, window):
    """A residual window's ring as the tail split (its newest R tokens; with R < 64 staged ones before
    them), the pages ending where it begins, and sliding windows, against dense attention (float64) over
    nuq2's dequantized pages: within the slot deltas' fp16 rounding (a relative error under 3e-3, measured
    6e-5; a token read from the ring instead of the staging, or the other way round, is off by far more)."""
    check_ring_reference(nuq2_decode_split_reference, build, R, window, 3e-3)


def test_default_split_rule():
    assert default_num_splits(1, 8, 2048) == 256  # batch 1 at 128k: capped (MAX_SPLITS)
    assert default_num_splits(1, 8, 64) == 32  # short contexts: at least 2 pages a split
    assert default_num_splits(16, 8, 512) == 32  # about 4096 programs
    assert default_num_splits(64, 8, 512) == 8
    assert default_num_splits(1, 8, 2048, extra=1) == 255  # with the staged split: 256 partials in all
    # whole waves (an H200's 132 SMs): a launch of between one and two waves, the staged split's
    # programs counted, is cut to one
    assert default_num_splits(1, 8, 2048, extra=1, wave=132 * 12) == 197  # 1576 + 8 staged: 1584 slots
    assert default_num_splits(1, 8, 396, extra=1, wave=1584) == 197  # 198 + 1 splits: 1592 programs
    assert default_num_splits(1, 8, 2048, extra=0, wave=132 * 12) == 198
    assert default_num_splits(1, 8, 2048, extra=1, wave=132 * 16) == 255  # already one wave
    assert default_num_splits(16, 8, 512, extra=1, wave=132 * 12) == 32  # 2.6 waves: kept
    assert default_num_splits(1, 8, 64, extra=1, wave=132 * 12) == 32  # under one wave: kept
    assert default_num_splits(1, 8, 2048, extra=1, wave=132 * 8) == 131


def test_tail_shares_cut_the_tail_as_the_kernels_do():
    """tail_shares (the references' copy of common.tail_share): the tail [lo, length) cut into contiguous
    shares, in program order, that cover it once; each starts on a 16-token step from lo (no tile is
    read by two programs) and all but the last non-empty one are equal; programs past the tail's end
    get nothing."""
    from moekv.ops.gluon.splits import tail_shares

    for lo, length in ((0, 5), (3968, 4096), (873, 1001), (900, 1001), (4032, 4033), (100, 356)):
        for parts in (1, 2, 3, 4, 8, 16):
            shares = tail_shares(lo, length, parts)
            assert [t0 for _, t0, _ in shares] == [lo] + [t1 for _, _, t1 in shares[:-1]]
            assert shares[-1][2] == length and [p for p, _, _ in shares] == list(range(len(shares)))
            sizes = [t1 - t0 for _, t0, t1 in shares]
            assert all(n % 16 == 0 and n == sizes[0] for n in sizes[:-1]) and 0 < sizes[-1] <= sizes[0]
            assert len(shares) == min(parts, -(-(length - lo) // sizes[0]))
    assert tail_shares(3968, 4096, 4) == [(0, 3968, 4000), (1, 4000, 4032), (2, 4032, 4064), (3, 4064, 4096)]
    assert tail_shares(3840, 4096, 8)[-1] == (7, 4064, 4096)  # vq's 256 tokens: 8 programs of 32
    assert tail_shares(4000, 4096, 8) == [(p, 4000 + 16 * p, 4016 + 16 * p) for p in range(6)]  # a window cut


def test_tail_split_rule():
    """launch.plan_splits on an H100 (132 SMs) at the kernels' caps (nuq2: 160, 12 programs an SM; vq's
    one-warp kernel: 128, 16), 8 KV heads: with a ring, the tail in shares of 32 tokens where they fit
    one wave beside the page splits (batch 1 to 8 at 4k, batch 1 at 128k, whose page splits then cede
    the wave's room), else one program and the page splits of the launch without a ring."""
    from moekv.ops.gluon.launch import default_tail_splits, plan_splits

    nuq2, vq = 132 * 12, 132 * 16
    assert plan_splits(1, 8, 64, True, 128, nuq2) == (32, 4)  # (1, 4k): 128 tokens, 4 programs of 32
    assert plan_splits(1, 8, 64, True, 256, vq) == (32, 8)  # vq's 256 tokens: 8
    assert plan_splits(1, 8, 64, True, 0, nuq2) == (32, 1)  # no ring: the staged page's one program
    assert plan_splits(1, 8, 64, True, 32, nuq2) == (32, 2)  # a ring shorter than a page: up to 64 tokens
    assert plan_splits(1, 8, 2048, True, 128, nuq2) == (194, 4)  # (1, 128k): 11 pages a split, as 197 give
    assert plan_splits(1, 8, 2048, True, 0, nuq2) == (197, 1)
    assert plan_splits(8, 8, 64, True, 128, nuq2) == (20, 4)  # (8, 4k): cut to one wave with the tail's 4
    for ring, wave in ((128, nuq2), (256, vq)):  # (16, 32k), (64, 32k): several waves, as without a ring
        assert plan_splits(16, 8, 512, True, ring, wave) == plan_splits(16, 8, 512, True, 0, wave) == (32, 1)
        assert plan_splits(64, 8, 512, True, ring, wave) == plan_splits(64, 8, 512, True, 0, wave) == (8, 1)
    assert plan_splits(1, 8, 64, False, 0, nuq2) == (32, 0)  # no staged tail: no tail program
    assert plan_splits(1, 8, 64, True, 128, nuq2, num_splits=5) == (5, 4)
    assert plan_splits(1, 8, 64, True, 128, nuq2, tail_splits=2) == (32, 2)
    assert plan_splits(1, 8, 2048, True, 128, nuq2, num_splits=254) == (254, 1)  # 256 partials at most
    # vq's shared-codebook launches: the tail alone in its own launch (no page split beside it)
    assert default_tail_splits(16 * 8, 0, 256, vq) == 8 and default_tail_splits(64 * 8, 0, 256, vq) == 4
    assert default_tail_splits(300 * 8, 0, 256, vq) == 1
    with pytest.raises(ValueError, match="tail_splits"):
        plan_splits(1, 8, 64, True, 0, nuq2, tail_splits=2)  # more than one program needs a ring
    with pytest.raises(ValueError, match="tail_splits"):
        plan_splits(1, 8, 64, True, 128, nuq2, tail_splits=0)


def test_shared_memory_stagings_wait_for_a_whole_wave(monkeypatch):
    """Launch.fills_wave, the rule of kivi2's CODES_SMEM and tiered's SMEM: the launch's programs (the
    staged split's included) leave no room in a wave of an H200 (132 SMs x 16 programs at cap 128)
    for one more split."""
    from moekv.ops.gluon import launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    q = torch.zeros(1, 32, 128)

    def plan(batch, pages, num_splits=None):  # with the staged tail, as the engine launches
        bt = torch.zeros(batch, pages, dtype=torch.int32)
        lens = torch.full((batch,), pages * 64, dtype=torch.int32)
        return launch.plan_launch(q.expand(batch, 32, 128), batch, 8, bt, lens, num_splits, (q, q, lens), None, 128)

    assert plan(1, 64).wave == 2112 and not plan(1, 64).fills_wave  # batch 1 at 4k: 8 x 33 programs
    assert plan(16, 512).num_splits == 32 and plan(16, 512).fills_wave  # (16, 32k): 128 x 33 programs
    assert plan(64, 512).fills_wave  # (64, 32k)
    assert plan(8, 512).num_splits == 32 and plan(8, 512).fills_wave  # (8, 32k): cut to one wave, 64 x 33
    assert plan(1, 2048).num_splits == 255 and not plan(1, 2048).fills_wave  # (1, 128k): 2048 programs
    assert plan(1, 2048, num_splits=263).fills_wave and not plan(1, 2048, num_splits=262).fills_wave


def test_programs_per_sm_follow_the_register_cap():
    assert [programs_per_sm(c) for c in (None, 0, 255, 184, 168, 128, 64, 16)] == [8, 8, 8, 11, 12, 16, 32, 32]


def test_bad_inputs_are_refused():
    _, frag, tables, lens_t, _, _ = build([64], 2, seed=5)
    q = torch.zeros(1, 2, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        nuq2_decode_split_reference(torch.zeros(1, 6, D, dtype=torch.float64), frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="head"):
        nuq2_decode_split_reference(torch.zeros(1, 2, 64, dtype=torch.float64), frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="num_splits"):
        nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 0)
    with pytest.raises(ValueError, match="sliding_window"):
        nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1, sliding_window=0)
    k, v, slots = staging(1, 2, seed=1)
    with pytest.raises(ValueError, match="staging tensors"):
        nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1, staged=(k[:, :1], v[:, :1], slots))
    with pytest.raises(ValueError, match="seq_slots"):
        nuq2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1, staged=(k, v, slots.repeat(2)))
    with pytest.raises(ValueError, match="CUDA"):
        from moekv.ops.gluon.nuq2_decode import nuq2_decode_partials

        nuq2_decode_partials(q.float(), frag, tables, lens_t, 0.1, 1)


SM90_BUILD = """
import os, re, subprocess, tempfile
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.nuq2_decode import DEFAULT_PREFETCH
from moekv.ops.gluon.nuq2_kernel import nuq2_decode_kernel
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_tables": "*i32", "v_tables": "*i32", "k_mean": "*fp8e4nv",
       "k_scale": "*fp8e4nv", "k_idx": "*u16", "k_delta": "*fp16", "k_used": "*u8", "v_idx": "*u16",
       "v_delta": "*fp16", "v_used": "*u8", "SK": "i32", "SV": "i32", "q_ptr": "*bf16", "block_tables": "*i32",
       "stride_bt": "i32", "context_lens": "*i32", "seq_slots": "*i64", "k_stage": "*bf16", "v_stage": "*bf16",
       "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32", "k_ring": "*bf16", "v_ring": "*bf16",
       "stride_rs": "i32", "stride_rh": "i32", "stride_rt": "i32", "R": "i32", "part_o": "*fp32", "part_lse": "*fp32",
       "qk_scale": "fp32", "window": "i32", "zero": "i32", "num_splits": "i32", "ns_total": "i32",
       "HKV": "constexpr", "G": "constexpr", "STAGED": "constexpr", "CHUNK0": "constexpr",
       "PREFETCH": "constexpr", "SMEM": "constexpr", "RING": "constexpr"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for G, staged, chunk0, smem, cap in ((1, True, False, False, None), (4, False, True, False, None),
                                     (8, True, False, False, None), (4, False, True, True, 128),
                                     (8, True, True, True, None)):
    src = GluonASTSource(nuq2_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "STAGED": staged, "CHUNK0": chunk0,
                                     "PREFETCH": DEFAULT_PREFETCH, "SMEM": smem, "RING": False},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(12)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, **({"maxnreg": cap} if cap else {})))
    ptx = k.asm["ptx"]
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "prmt.b32" in ptx, ".local" in ptx)
    if smem:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        print("cp.async.cg.shared.global" in ptx, "cp.async.wait_group" in ptx, sass.count("LDGSTS.E.BYPASS.128"),
              sass.count("LDS.128"), re.search(r"\\b(LDL|STL)\\b", sass) is not None)
print("RING")
for G, smem in ((1, True), (4, True), (8, False)):  # a residual window's ring as the tail, at the launcher's cap
    src = GluonASTSource(nuq2_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "STAGED": True, "CHUNK0": True,
                                     "PREFETCH": DEFAULT_PREFETCH, "SMEM": smem, "RING": True},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(12)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, maxnreg=160))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    spills = re.search(r"\\b(LDL|STL)\\b", sass) is not None
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in k.asm["ptx"], spills)
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships, for groups of 1, 4
    and 8, with and without the staged tail, the unconditional first slot chunk, the shared-memory
    stages (SMEM) and a residual window's ring (RING): layouts that do
    not convert trivially, inline PTX or shapes that do not fit fail here, not on the device. In a
    fresh interpreter: other CPU tests set TRITON_INTERPRET=1 for the session
    (tests/triton_kernels.py), which leaves triton.language's own helpers uncompilable."""
    words = run_sm90_build(SM90_BUILD)
    words, ring = words[:words.index("RING")], words[words.index("RING") + 1:]
    # with a residual window's ring (RING): the same shared memory, no spill at the launcher's cap of 160
    stages = str(2 * (2 * 2048 + 256 + 128 + 32))
    assert ring == ["1", stages, "True", "False", "4", stages, "True", "False", "8", "0", "True", "False"], ring
    # per build: shared memory (none: registers only; SMEM: two stages of 2 x 2 kB of codes, 256 bytes
    # of scale and mean, 128 of slots (16-bit positions and deltas) and 32 of words), MMA and prmt present,
    # no local memory in the PTX; SMEM: cp.async (16 bytes a lane for the codes: 8 a page, 8 before the
    # loop) and its wait, the 8 code rows read by 128-bit LDS, no spills (at the launcher's cap of 128 without the tail)
    smem = [str(2 * (2 * 2048 + 256 + 128 + 32)), "True", "True", "False", "True", "True", "16", "8", "False"]
    assert words == ["1", "0", "True", "True", "False", "4", "0", "True", "True", "False",
                     "8", "0", "True", "True", "False", "4", *smem, "8", *smem], words


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens):
    """The Gluon kernel's partials (outlier slots folded in) against the split reference (float64):
    batch 1 and 4, lengths on and off page boundaries, GQA 1 / 4 / 8, a few split counts (some
    splits empty)."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_partials

    check_kernel_matches_reference(nuq2_decode_partials, nuq2_decode_split_reference, build, G, lens)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4])
def test_gpu_prefetch_changes_nothing(G):
    """Prefetching the next page (L2 or L1) gives the same partials bit for bit as none."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_partials

    check_prefetch_changes_nothing(nuq2_decode_partials, build, G)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("outliers", [True, False])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_smem_changes_nothing(G, outliers):
    """The next page's codes and side data through shared memory (SMEM) give the partials of the
    register / global path bit for bit: lengths on and off page boundaries, some splits empty, pages
    with and without slots, fewer than 16 slots a page-head (the copies zero-filled past them) or none,
    the staged tail, sliding windows, without the register cap, with the prefetch, without the
    unconditional first slot chunk."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_partials

    lens = [64, 1000, 64 * 9, 129, 3000]
    Hkv, _, frag, tables, lens_t, _, _, q = gpu_case(build, G, lens, 40 + G, outliers=outliers)
    staged = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    cases = [(frag, {"num_splits": ns}) for ns in (1, 5, 64)] + [
        (frag, {"num_splits": 3, "staged": staged}),
        (frag, {"num_splits": 5, "staged": staged, "sliding_window": 100}),
        (frag, {"num_splits": 2, "sliding_window": 64 * 5 + 3}),
        (frag, {"num_splits": 5, "max_registers": None}),
        (frag, {"num_splits": 5, "prefetch": 2}),
        (frag, {"num_splits": 5, "slot_chunk0": False}),
        (fewer_slots(frag, 8, 4), {"num_splits": 5, "staged": staged}),
        (fewer_slots(frag, 0, 0), {"num_splits": 5})]
    for f, options in cases:
        ref_o, ref_lse = nuq2_decode_partials(q, f, tables, lens_t, D ** -0.5, smem=False, **options)
        part_o, part_lse = nuq2_decode_partials(q, f, tables, lens_t, D ** -0.5, smem=True, **options)
        assert torch.equal(part_o, ref_o) and torch.equal(part_lse, ref_lse), (f.k_out_idx.shape[2], options)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("outliers", [True, False])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G, outliers):
    """Kernel + reduce against dense attention over nuq2's own dequantized pages."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_attention

    check_decode_matches_dense(nuq2_decode_attention, build, G, outliers=outliers)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_staged_tail_and_window(G, window):
    """The staged bf16 tail as the launch's extra split, and sliding windows, against dense attention
    over pages + staging."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_attention

    check_staged_decode(nuq2_decode_attention, build, G, window)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("R, window", RING_SPLIT_CASES)
@pytest.mark.parametrize("G, smem", [(1, True), (4, False), (8, True)])
def test_gpu_residual_ring_split_over_programs(G, smem, R, window):
    """The ring's tail read by 1 to 16 programs (each a share): the kernel's partials against the split
    reference's at the same splits, and kernel + reduce with sinks; rings that wrap, sequences shorter
    than R, windows cutting into the tail."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_attention, nuq2_decode_partials

    check_ring_partials(nuq2_decode_partials, nuq2_decode_attention, nuq2_decode_split_reference, build, G, R, window,
                        smem=smem)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("smem", [True, False])
@pytest.mark.parametrize("R, window", [(128, None), (64, 100), (32, 64 * 5 + 3), (256, 1)])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_residual_ring(G, R, window, smem):
    """A residual window's ring as the launch's tail split (RING), with and without the shared-memory
    stages, against dense attention over pages, ring and staging."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_attention

    check_ring_decode(nuq2_decode_attention, build, G, R, window, smem=smem)
