"""The int4 Gluon decode path (moekv/ops/gluon/int4_decode.py). On CPU: its split reference (per-group
scales on the accumulators, zeros through q's group sums and P's, outlier channels through their
deltas) against dense attention over int4's own dequantized pages, in float64, and the kernel's sm_90
build. On a GPU (marked gpu): the Gluon kernel against that reference and dense attention."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.int4 import Int4Format
from moekv.ops.gluon.int4_decode import DEFAULT_SMEM, int4_decode_split_reference
from moekv.ops.gluon.int4_layout import to_fragment_order
from tests.gluon_cases import (
    GPU,
    D,
    P,
    behind_tables,
    check_decode_matches_dense,
    check_kernel_matches_reference,
    check_prefetch_changes_nothing,
    check_same_partials,
    check_split_reference,
    check_staged_decode,
    check_staged_reference,
    large_channel_keys,
    num_pages,
    pack,
    run_sm90_build,
)


def build(lens, Hkv, seed, device="cpu", outlier_fraction=0.01):
    """Random int4 pages (keys with two large channels) for sequences of lengths `lens` behind a
    shuffled block table, in fragment order -> (fmt, frag, block_tables, context_lens, k_pages, v_pages)."""
    fmt = Int4Format(group_size=32, outlier_fraction=outlier_fraction)
    g = torch.Generator().manual_seed(seed)
    N = num_pages(lens)
    k = large_channel_keys(N, Hkv, g, shift=0.5)
    v = torch.randn(N, Hkv, P, D, generator=g) - 0.3
    v[..., 40] *= 5
    return behind_tables(fmt, pack(fmt, k, v), lens, g, to_fragment_order, device)


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("outlier_fraction", [0.01, 0.03])
def test_split_reference_equals_dense_attention(G, outlier_fraction):
    """The kernel's algebra (float64) against dense attention over int4's dequantized pages: several
    split counts (some splits empty), lengths on and off page boundaries, 1 and 4 outlier channels.
    (int4's dequantize computes in float32: ~1e-10 apart; a wrong term would be ~1e-3 or more.)"""
    frag = check_split_reference(int4_decode_split_reference, build, G, 1e-8, outlier_fraction=outlier_fraction)
    assert frag.num_outliers == (1 if outlier_fraction == 0.01 else 4)


@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
def test_staged_tail_and_sliding_window(window):
    """The staged 16-bit tail as split num_splits (the newest page, even when full, from staging) and
    sliding windows, against dense attention over pages + staging."""
    check_staged_reference(int4_decode_split_reference, build, window, 1e-8)


def test_bad_inputs_are_refused():
    _, frag, tables, lens_t, _, _ = build([100], 2, seed=0)
    q = torch.randn(1, 6, D)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        int4_decode_split_reference(q, frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="CUDA"):
        from moekv.ops.gluon.int4_decode import int4_decode_partials

        int4_decode_partials(torch.randn(1, 8, D, dtype=torch.bfloat16), frag, tables, lens_t, 0.1, 1)


SM90_BUILD = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.int4_decode import DEFAULT_PREFETCH, DEFAULT_SMEM
from moekv.ops.gluon.int4_kernel import int4_decode_kernel
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_scale": "*fp16", "k_zero": "*fp16", "v_scale": "*fp16",
       "v_zero": "*fp16", "k_oidx": "*i32", "k_odelta": "*fp32", "v_oidx": "*i32", "v_odelta": "*fp32",
       "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32", "seq_slots": "*i64",
       "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32",
       "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32", "num_splits": "i32",
       "ns_total": "i32", "HKV": "constexpr", "G": "constexpr", "NO": "constexpr", "STAGED": "constexpr",
       "PREFETCH": "constexpr", "SMEM": "constexpr"}
for G, NO, staged, smem, prefetch in ((1, 1, True, DEFAULT_SMEM, DEFAULT_PREFETCH), (4, 1, False, False, 1),
                                      (8, 4, True, False, 1), (4, 3, True, True, 2)):
    src = GluonASTSource(int4_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "NO": NO, "STAGED": staged, "PREFETCH": prefetch,
                                     "SMEM": smem},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(10)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    ptx = k.asm["ptx"]
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "sub.f16x2" in ptx, ".local" in ptx,
          "prefetch.global.L1" in ptx or "prefetch.global.L2" in ptx, ptx.count("cp.async.cg.shared.global"))
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships (groups 1, 4, 8; one and
    one, three and four outlier channels; pages from global memory or through shared memory): every
    tile's layout conversion is checked trivial at compile time. In a fresh interpreter (other CPU
    tests set TRITON_INTERPRET=1 for the session)."""
    words = run_sm90_build(SM90_BUILD)
    # per build: shared memory (SMEM: two stages of 8 kB of codes and three 512-byte tables), MMA and
    # the fp16 subtraction present, no local memory (spills), the next page asked of a cache, and the
    # cp.async copies in the PTX (a page's staging: 8 + 8 of codes and 3 of tables, 16 bytes a lane, at
    # two places: before the loop and in it)
    builds = [words[i:i + 7] for i in range(0, len(words), 7)]
    staged_smem = [str(2 * (8192 + 3 * 512)), "True", "True", "False", "True", "38"]
    unstaged = ["0", "True", "True", "False", "True", "0"]
    assert builds == [["1", *(staged_smem if DEFAULT_SMEM else unstaged)], ["4", *unstaged], ["8", *unstaged],
                      ["4", *staged_smem]], words


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens):
    """The Gluon kernel's partials against the split reference (float64): batch 1 and 4, lengths on
    and off page boundaries, GQA 1 / 4 / 8, split counts with empty splits."""
    from moekv.ops.gluon.int4_decode import int4_decode_partials

    check_kernel_matches_reference(int4_decode_partials, int4_decode_split_reference, build, G, lens)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4])
def test_gpu_prefetch_changes_nothing(G):
    """Prefetching the next page (L2 or L1) gives the same partials bit for bit as none."""
    from moekv.ops.gluon.int4_decode import int4_decode_partials

    check_prefetch_changes_nothing(int4_decode_partials, build, G)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_smem_changes_nothing(G):
    """Codes and side tables through shared memory (SMEM), with and without the prefetch of the rest,
    give the same partials bit for bit as global loads."""
    from moekv.ops.gluon.int4_decode import int4_decode_partials

    check_same_partials(int4_decode_partials, build, G, {"smem": False, "prefetch": 0},
                        [{"smem": True, "prefetch": 0}, {"smem": True, "prefetch": 2}, {"smem": True, "prefetch": 1}])


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("outlier_fraction", [0.01, 0.03])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G, outlier_fraction):
    """Kernel + reduce against dense attention over int4's own dequantized pages (1 and 4 outlier channels)."""
    from moekv.ops.gluon.int4_decode import int4_decode_attention

    check_decode_matches_dense(int4_decode_attention, build, G, outlier_fraction=outlier_fraction)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("smem", [False, True])
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_staged_tail_and_window(G, window, smem):
    """The staged bf16 tail as the launch's extra split, and sliding windows, against dense attention
    over pages + staging; pages from global memory or through shared memory (SMEM)."""
    from moekv.ops.gluon.int4_decode import int4_decode_attention

    check_staged_decode(int4_decode_attention, build, G, window, smem=smem)
