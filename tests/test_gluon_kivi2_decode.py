"""The kivi2 Gluon decode path (moekv/ops/gluon/kivi2_decode.py). On CPU: its split reference (keys'
per-channel scale folded into q per token half and zeros as q . zero, values' per-token scale into P
and zeros through P's sums, the 16-bit tail from the residual ring and the staging page) against
dense attention over kivi2's own dequantized pages, in float64; the kernel's fp16 roundings emulated
in float32; the kernel's sm_90 build. On a GPU (marked gpu): the Gluon kernel against that reference
and dense attention."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.kivi2 import KIVI2Format
from moekv.ops.gluon.kivi2_decode import (
    kivi2_decode_split_reference,
    quantized_tokens,
    tail_tokens,
)
from moekv.ops.gluon.kivi2_layout import to_fragment_order
from moekv.ops.gluon.nuq2_decode import reduce_partials
from tests import gluon_cases
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
    large_channel_keys,
    num_pages,
    pack,
    relative_error,
    run_sm90_build,
)


def build(lens, Hkv, seed, device="cpu"):
    """Random kivi2 pages (keys with two large channels, as KIVI's key outliers) for sequences of
    lengths `lens` behind a shuffled block table, in fragment order -> (fmt, frag, tables, lens, k_pages, v_pages)."""
    fmt = KIVI2Format()
    g = torch.Generator().manual_seed(seed)
    N = num_pages(lens)
    k = large_channel_keys(N, Hkv, g, shift=0.5)
    v = torch.randn(N, Hkv, P, D, generator=g) - 0.3
    v[..., 40] *= 5
    return behind_tables(fmt, pack(fmt, k, v), lens, g, to_fragment_order, device)


def tail(B, Hkv, R, seed, device="cpu", dtype=torch.float64):
    """Random 16-bit staging pages [B + 1, Hkv, 64, 128] and rings [B + 1, Hkv, R, 128] (one spare
    slot), a permuted slot per sequence: staged, residual. Staging and ring hold different values, so
    a token read from the wrong one shows."""
    g = torch.Generator().manual_seed(seed)
    staged = (torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype).to(device),
              torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype).to(device),
              torch.randperm(B + 1, generator=g)[:B].to(device))
    ring = (torch.randn(B + 1, Hkv, R, D, generator=g).to(dtype).to(device) + 1.0,
            torch.randn(B + 1, Hkv, R, D, generator=g).to(dtype).to(device) - 1.0)
    return staged, ring


def dense_reference(fmt, k_pages, v_pages, q, tables, lens, scale, staged=None, residual=None, sliding_window=None):
    """decode_attention_ref (float64) over each sequence's tokens: [0, quantized) as kivi2 dequantizes
    its pages, the rest from the ring (t >= len - R, row t % R) or the staging page (row t % 64)."""
    R = residual[0].shape[2] if residual is not None else 0
    cpu = lambda t: tuple(x.cpu() for x in t) if t is not None else None  # noqa: E731

    def tokens(b, n):
        quantized = quantized_tokens(n, True, R)
        kt, vt = tail_tokens(cpu(staged), cpu(residual), b, quantized, n, torch.float64)
        return quantized, kt.transpose(0, 1), vt.transpose(0, 1)

    return gluon_cases.dense_reference(fmt, k_pages, v_pages, q, tables, lens, scale, staged, sliding_window, tokens)


def test_quantized_tokens_is_the_triton_kernels_rule():
    """Pages hold [0, min(newest page start, len - R)); the tail is at most max(R, 64) tokens."""
    assert quantized_tokens(1000, True, 128) == 872  # inside page 13: the page is read up to 872
    assert quantized_tokens(1000, True, 0) == 960
    assert quantized_tokens(100, True, 128) == 0
    assert quantized_tokens(64 * 20, True, 32) == 64 * 19  # the newest page, full, stays staged
    assert quantized_tokens(777, False, 128) == 777


@pytest.mark.parametrize("G", [1, 4, 8])
def test_split_reference_equals_dense_attention(G):
    """The kernel's algebra (float64) against dense attention over kivi2's dequantized pages, pages only:
    several split counts (some splits empty), lengths on and off page boundaries. (kivi2's dequantize
    computes in float32: ~1e-10 apart; a wrong term would be ~1e-3 or more.)"""
    check_split_reference(kivi2_decode_split_reference, build, G, 1e-8, dense=dense_reference)


@pytest.mark.slow
@pytest.mark.parametrize("R", [0, 32, 128])
@pytest.mark.parametrize("window", [None, 1, 100, 150, 64 * 5 + 3])
def test_tail_ring_and_sliding_window(R, window):
    """The 16-bit tail (staging page and residual ring) as the splits from num_splits on (with the ring 1,
    3 or 8, each a share of it) and sliding windows (some ending inside the tail, so that a page split
    has no valid token), against dense attention."""
    Hkv, G = 2, 4
    lens = [1000, 777, 64 * 16, 65, 64, 130, 5]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=5 + R)
    staged, ring = tail(len(lens), Hkv, R, seed=8)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1, staged, ring, window)
    for ns, ts in ((1, 1), (3, 3), (7, 8)):
        ts = ts if R else 1  # the tail over several programs needs the ring
        o, lse = kivi2_decode_split_reference(q, frag, tables, lens_t, 0.1, ns, staged=staged, residual=ring,
                                              sliding_window=window, tail_splits=ts)
        assert o.shape[2] == ns + ts
        assert torch.allclose(reduce_partials(o, lse), ref, atol=1e-8, rtol=1e-8), (ns, ts)


def test_kernel_roundings_stay_small():
    """The kernel's fp16 operand roundings (q, ks * q, P, vs * P; the bf16 tail), emulated in float32,
    against dense attention in float64: the error budget the GPU tests allow (3e-3) holds with margin,
    and the emulation is not the exact algebra (so it models something)."""
    Hkv, G = 2, 4
    lens = [1000, 64 * 16, 65]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=3)
    staged, ring = tail(len(lens), Hkv, 128, seed=4, dtype=torch.bfloat16)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64).to(torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5, staged, ring)
    o, lse = kivi2_decode_split_reference(q.float(), frag, tables, lens_t, D ** -0.5, 4, staged=staged,
                                          residual=ring, kernel_roundings=True)
    err = relative_error(reduce_partials(o.double(), lse.double()), ref)
    assert 1e-6 < err < 1e-3, err


def test_bad_inputs_are_refused():
    _, frag, tables, lens_t, _, _ = build([100], 2, seed=0)
    q = torch.randn(1, 6, D)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        kivi2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1)
    staged, ring = tail(1, 2, 48, seed=0)
    q = torch.randn(1, 8, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kivi2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1, staged=staged, residual=ring)
    with pytest.raises(ValueError, match="comes with the staged"):
        kivi2_decode_split_reference(q, frag, tables, lens_t, 0.1, 1, residual=ring)
    with pytest.raises(ValueError, match="CUDA"):
        from moekv.ops.gluon.kivi2_decode import kivi2_decode_partials

        kivi2_decode_partials(torch.randn(1, 8, D, dtype=torch.bfloat16), frag, tables, lens_t, 0.1, 1)


SM90_BUILD = """
import re, subprocess
from pathlib import Path
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.kivi2_decode import DEFAULT_MAX_REGISTERS, DEFAULT_PREFETCH, DEFAULT_SIDE_SMEM
from moekv.ops.gluon.kivi2_kernel import kivi2_decode_kernel
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_scale": "*fp16", "k_zero": "*fp16", "v_scale": "*fp16",
       "v_zero": "*fp16", "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32",
       "seq_slots": "*i64", "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32",
       "stride_st": "i32", "k_ring": "*bf16", "v_ring": "*bf16", "stride_rs": "i32", "stride_rh": "i32",
       "stride_rt": "i32", "R": "i32", "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32",
       "num_splits": "i32", "ns_total": "i32", "HKV": "constexpr", "G": "constexpr",
       "STAGED": "constexpr", "PREFETCH": "constexpr", "SIDE_SMEM": "constexpr", "CODES_SMEM": "constexpr"}
for G, staged, codes_smem in ((1, True, False), (4, False, False), (8, True, False), (4, True, True), (8, True, True)):
    src = GluonASTSource(kivi2_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "STAGED": staged, "PREFETCH": DEFAULT_PREFETCH,
                                     "SIDE_SMEM": DEFAULT_SIDE_SMEM, "CODES_SMEM": codes_smem},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, maxnreg=DEFAULT_MAX_REGISTERS))
    ptx = k.asm["ptx"]
    Path("k.cubin").write_bytes(k.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", "k.cubin"], capture_output=True, text=True).stdout
    ops = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
           if (m := re.match(r"\\s+/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_]+)", line))]
    loops = [(int(t.group(1), 16), a) for a, op, line in ops
             if op == "BRA" and (t := re.search(r"BRA\\s+(0x[0-9a-f]+)", line)) and int(t.group(1), 16) < a]
    spilled = sum(op in ("LDL", "STL") and lo <= a <= hi for a, op, _ in ops for lo, hi in loops) > 4
    print(G, codes_smem, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "sub.f16x2" in ptx,
          bool(loops) and not spilled)
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu(tmp_path):
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships (groups 1, 4, 8; with
    and without the tail split; codes in registers or through shared memory) under the default register
    cap: every tile's layout conversion is checked trivial at compile time; shared memory: 3 kB for the
    side tables' two stages (SIDE_SMEM), 8 kB more for the codes' (CODES_SMEM); the MMAs and the
    magic-number subtraction present, at most 4 spill instructions inside the loops (G 8: two stores and
    two loads a page, in L1). In a fresh interpreter (other CPU tests set TRITON_INTERPRET=1 for the
    session)."""
    words = run_sm90_build(SM90_BUILD, cwd=tmp_path)
    builds = [words[i:i + 6] for i in range(0, len(words), 6)]
    shared = {"False": "3072", "True": str(3072 + 8192)}
    rest = ["True", "True", "True"]
    assert builds == [[g, c, shared[c], *rest] for g, c in (("1", "False"), ("4", "False"), ("8", "False"),
                                                            ("4", "True"), ("8", "True"))], words


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens):
    """The Gluon kernel's partials against the split reference (float64): batch 1 and 4, lengths on
    and off page boundaries, GQA 1 / 4 / 8, split counts with empty splits."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_partials

    check_kernel_matches_reference(kivi2_decode_partials, kivi2_decode_split_reference, build, G, lens)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4])
def test_gpu_prefetch_changes_nothing(G):
    """Prefetching the next page (L2 or L1) gives the same partials bit for bit as none."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_partials

    check_prefetch_changes_nothing(kivi2_decode_partials, build, G)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_shared_memory_staging_changes_nothing(G):
    """Side tables, and codes, through shared memory (SIDE_SMEM, CODES_SMEM) give the same partials bit for
    bit as global loads."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_partials

    check_same_partials(kivi2_decode_partials, build, G, {"side_smem": False, "codes_smem": False},
                        [{"side_smem": True, "codes_smem": False}, {"side_smem": False, "codes_smem": True},
                         {"side_smem": True, "codes_smem": True, "max_registers": 128}])


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G):
    """Kernel + reduce against dense attention over kivi2's own dequantized pages."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_attention

    check_decode_matches_dense(kivi2_decode_attention, build, G)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("R, window", gluon_cases.RING_SPLIT_CASES)
@pytest.mark.parametrize("G, codes_smem", [(1, False), (4, True), (8, False)])
def test_gpu_residual_ring_split_over_programs(G, codes_smem, R, window):
    """The ring's tail read by 1 to 16 programs (each a share): the kernel's partials against the split
    reference's at the same splits, and kernel + reduce with sinks; rings that wrap, sequences shorter
    than R, windows cutting into the tail."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_attention, kivi2_decode_partials

    gluon_cases.check_ring_partials(kivi2_decode_partials, kivi2_decode_attention, kivi2_decode_split_reference, build,
                                    G, R, window, codes_smem=codes_smem)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("codes_smem", [False, True])
@pytest.mark.parametrize("R", [0, 128])
@pytest.mark.parametrize("window", [None, 1, 100, 150, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_tail_ring_and_window(G, window, R, codes_smem):
    """The bf16 tail (staging page and residual ring) as the launch's extra split, and sliding windows,
    against dense attention over pages + tail; codes in registers or through shared memory."""
    from moekv.ops.gluon.kivi2_decode import kivi2_decode_attention

    Hkv = 8 // G if G > 1 else 4
    lens = [1000, 777, 64 * 16, 65, 64, 130, 5]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=20 + G, device="cuda")
    staged, ring = tail(len(lens), Hkv, max(R, 32), seed=G, device="cuda", dtype=torch.bfloat16)
    residual = ring if R else None
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, staged, residual, window)
    for ns in (1, 3, None):
        out = kivi2_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, staged=staged,
                                     residual=residual, sliding_window=window, codes_smem=codes_smem)
        assert relative_error(out, ref) < 1e-2, ns
