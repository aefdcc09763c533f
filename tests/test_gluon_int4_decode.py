"""The int4 Gluon decode path (moekv/ops/gluon/int4_decode.py). On CPU: its split reference (per-group
scales on the accumulators, zeros through q's group sums and P's, outlier channels through their
deltas) against dense attention over int4's own dequantized pages, in float64, and the kernel's sm_90
build. On a GPU (marked gpu): the Gluon kernel against that reference and dense attention."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.int4 import Int4Format
from moekv.ops.gluon.int4_decode import int4_decode_split_reference
from moekv.ops.gluon.int4_layout import to_fragment_order
from moekv.ops.gluon.nuq2_decode import reduce_partials
from moekv.ops.reference import decode_attention_ref

P, D = 64, 128


def build(lens, Hkv, seed, device="cpu", outlier_fraction=0.01):
    """Random int4 pages (keys with two large channels) for sequences of lengths `lens` behind a
    shuffled block table, in fragment order -> (fmt, frag, block_tables, context_lens, k_pages, v_pages)."""
    fmt = Int4Format(group_size=32, outlier_fraction=outlier_fraction)
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // P) for n in lens]
    N = sum(pages_per) + 2
    k = torch.randn(N, Hkv, P, D, generator=g) + 0.5
    k[..., 7] *= 8
    k[..., 91] += 6
    v = torch.randn(N, Hkv, P, D, generator=g) - 0.3
    v[..., 40] *= 5
    slabs = [fmt.layout(kind, P, D).pack(fmt.quantize(x, kind)) for kind, x in (("key", k), ("value", v))]
    perm = torch.randperm(N, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        tables[b, :n] = perm[at:at + n]
        at += n
    frag = to_fragment_order(fmt, slabs[0].to(device), slabs[1].to(device))
    return fmt, frag, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), slabs[0], slabs[1]


def dense_reference(fmt, k_pages, v_pages, q, tables, lens, scale, staged=None, sliding_window=None):
    """decode_attention_ref over each sequence's pages as int4 dequantizes them (float64); with staged =
    (k_stage, v_stage, seq_slots), tokens from ((len - 1) // 64) * 64 on from the staging."""
    kd = fmt.dequantize(fmt.layout("key", P, D).unpack(k_pages.cpu()), "key")  # [N, H, P, D]
    vd = fmt.dequantize(fmt.layout("value", P, D).unpack(v_pages.cpu()), "value")
    keys, values = [], []
    for b, n in enumerate(lens.tolist()):
        ids = tables[b, :-(-n // P)].long().cpu()
        k = kd[ids].permute(0, 2, 1, 3).reshape(-1, kd.shape[1], D)[:n].double()
        v = vd[ids].permute(0, 2, 1, 3).reshape(-1, vd.shape[1], D)[:n].double()
        if staged is not None:
            quantized = (n - 1) // P * P
            slot = int(staged[2][b])
            k = torch.cat([k[:quantized], staged[0][slot].cpu().double().transpose(0, 1)[: n - quantized]])
            v = torch.cat([v[:quantized], staged[1][slot].cpu().double().transpose(0, 1)[: n - quantized]])
        keys.append(k)
        values.append(v)
    return decode_attention_ref(q.double().cpu(), keys, values, scale, sliding_window)


def staging(B, Hkv, seed, device="cpu", dtype=torch.float64):
    """Random 16-bit staging pages [B + 1, Hkv, 64, 128] (one spare) and a permuted slot per sequence."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype)
    v = torch.randn(B + 1, Hkv, P, D, generator=g).to(dtype)
    slots = torch.randperm(B + 1, generator=g)[:B]
    return k.to(device), v.to(device), slots.to(device)


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("outlier_fraction", [0.01, 0.03])
def test_split_reference_equals_dense_attention(G, outlier_fraction):
    """The kernel's algebra (float64) against dense attention over int4's dequantized pages: several
    split counts (some splits empty), lengths on and off page boundaries, 1 and 4 outlier channels.
    (int4's dequantize computes in float32: ~1e-10 apart; a wrong term would be ~1e-3 or more.)"""
    Hkv = 8 // G if G > 1 else 2
    lens = [700, 64 * 3, 65, 1]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=G, outlier_fraction=outlier_fraction)
    assert frag.num_outliers == (1 if outlier_fraction == 0.01 else 4)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5)
    for ns in (1, 3, 16):
        o, lse = int4_decode_split_reference(q, frag, tables, lens_t, D ** -0.5, ns)
        assert torch.allclose(reduce_partials(o, lse), ref, atol=1e-8, rtol=1e-8), ns


@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
def test_staged_tail_and_sliding_window(window):
    """The staged 16-bit tail as split num_splits (the newest page, even when full, from staging) and
    sliding windows, against dense attention over pages + staging."""
    Hkv, G = 2, 4
    lens = [777, 64 * 16, 65, 64]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=5)
    staged = staging(len(lens), Hkv, seed=8)
    q = torch.randn(len(lens), Hkv * G, D, dtype=torch.float64)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1, staged, window)
    for ns in (1, 3, 7):
        o, lse = int4_decode_split_reference(q, frag, tables, lens_t, 0.1, ns, staged=staged, sliding_window=window)
        assert torch.allclose(reduce_partials(o, lse), ref, atol=1e-8, rtol=1e-8), ns


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
from moekv.ops.gluon.int4_kernel import int4_decode_kernel
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_scale": "*fp16", "k_zero": "*fp16", "v_scale": "*fp16",
       "v_zero": "*fp16", "k_oidx": "*i32", "k_odelta": "*fp32", "v_oidx": "*i32", "v_odelta": "*fp32",
       "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32", "seq_slots": "*i64",
       "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32",
       "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32", "num_splits": "i32",
       "ns_total": "i32", "HKV": "constexpr", "G": "constexpr", "NO": "constexpr", "STAGED": "constexpr"}
for G, NO, staged in ((1, 1, True), (4, 1, False), (8, 4, True)):
    src = GluonASTSource(int4_decode_kernel, signature=sig, constexprs={"HKV": 8, "G": G, "NO": NO, "STAGED": staged},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(10)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    ptx = k.asm["ptx"]
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "sub.f16x2" in ptx, ".local" in ptx)
"""


def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships (groups 1, 4, 8; one and
    four outlier channels): every tile's layout conversion is checked trivial at compile time. In a
    fresh interpreter (other CPU tests set TRITON_INTERPRET=1 for the session)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SM90_BUILD], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    # per build: no shared memory, MMA and the fp16 subtraction present, no local memory (spills)
    assert run.stdout.split() == ["1", "0", "True", "True", "False", "4", "0", "True", "True", "False",
                                  "8", "0", "True", "True", "False"], run.stdout


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")


def relative_error(out, ref):
    return float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm())


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens):
    """The Gluon kernel's partials against the split reference (float64): batch 1 and 4, lengths on
    and off page boundaries, GQA 1 / 4 / 8, split counts with empty splits."""
    from moekv.ops.gluon.int4_decode import int4_decode_partials

    Hkv = 8 // G if G > 1 else 4
    _, frag, tables, lens_t, _, _ = build(lens, Hkv, seed=G, device="cuda")
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    for ns in (1, 5, 64):
        part_o, part_lse = int4_decode_partials(q, frag, tables, lens_t, D ** -0.5, ns)
        ref_o, ref_lse = int4_decode_split_reference(q.double(), frag, tables, lens_t, D ** -0.5, ns)
        full = ref_lse > -float("inf")
        assert torch.equal(part_lse.isfinite().cpu(), full.cpu()), "empty splits must be -inf, others finite"
        assert (part_lse - ref_lse)[full].abs().max() < 2e-2
        assert relative_error(reduce_partials(part_o.double(), part_lse.double()),
                              reduce_partials(ref_o, ref_lse)) < 3e-3


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("outlier_fraction", [0.01, 0.03])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G, outlier_fraction):
    """Kernel + reduce against dense attention over int4's own dequantized pages (1 and 4 outlier channels)."""
    from moekv.ops.gluon.int4_decode import int4_decode_attention

    Hkv = 8 // G if G > 1 else 4
    lens = [777, 64 * 16, 65]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=10 + G, device="cuda",
                                                        outlier_fraction=outlier_fraction)
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5)
    out = int4_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=4)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_staged_tail_and_window(G, window):
    """The staged bf16 tail as the launch's extra split, and sliding windows, against dense attention
    over pages + staging."""
    from moekv.ops.gluon.int4_decode import int4_decode_attention

    Hkv = 8 // G if G > 1 else 4
    lens = [777, 64 * 16, 65, 64]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=20 + G, device="cuda")
    k, v, slots = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, (k, v, slots), window)
    for ns in (1, 3, None):
        out = int4_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, staged=(k, v, slots),
                                    sliding_window=window)
        assert relative_error(out, ref) < 1e-2, ns
