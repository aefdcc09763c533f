"""The nuq2 Gluon decode path (moekv/ops/gluon/nuq2_decode.py). On CPU: its split reference (main
term with the keys' channel affine folded into q, then the outlier slots as a sparse term) against
dense attention over nuq2's own dequantized pages, in float64. On a GPU (marked gpu): the Gluon
kernel against that reference."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.ops.gluon.nuq2_decode import (
    main_term_reference,
    nuq2_decode_split_reference,
    outlier_corrections,
    reduce_partials,
)
from moekv.ops.gluon.nuq2_layout import dequantize_fragment, to_fragment_order
from moekv.ops.reference import decode_attention_ref

P, D = 64, 128


def build(lens, Hkv, seed, outliers=True, device="cpu", heavy=True):
    """Random nuq2 pages for sequences of lengths `lens` behind a shuffled block table, in
    fragment order -> (fmt, frag, block_tables, context_lens, k_pages, v_pages)."""
    fmt = NUQ2Format(codebook="page", quantize_kernel=False)
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // P) for n in lens]
    N = sum(pages_per) + 2
    k = torch.randn(N, Hkv, P, D, generator=g)
    k[..., 7] *= 8
    k[..., 91] += 6
    v = torch.randn(N, Hkv, P, D, generator=g)
    if heavy:
        k.view(-1)[torch.randint(0, k.numel(), (N * 6,), generator=g)] *= 12
        v.view(-1)[torch.randint(0, v.numel(), (N * 4,), generator=g)] *= 10
    slabs = []
    for kind, x in (("key", k), ("value", v)):
        fields = fmt.quantize(x, kind)
        if not outliers:
            fields["out_idx"].fill_(0xFFFF)
        slabs.append(fmt.layout(kind, P, D).pack(fields))
    perm = torch.randperm(N, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        tables[b, :n] = perm[at:at + n]
        at += n
    frag = to_fragment_order(fmt, slabs[0].to(device), slabs[1].to(device))
    return fmt, frag, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), slabs[0], slabs[1]


def dense_reference(fmt, k_pages, v_pages, q, tables, lens, scale, outliers=True):
    """decode_attention_ref over each sequence's pages as nuq2 dequantizes them (float64)."""
    kd = fmt.dequantize(fmt.layout("key", P, D).unpack(k_pages.cpu()), "key")  # [N, H, P, D]
    vd = fmt.dequantize(fmt.layout("value", P, D).unpack(v_pages.cpu()), "value")
    keys, values = [], []
    for b, n in enumerate(lens.tolist()):
        ids = tables[b, :-(-n // P)].long().cpu()
        keys.append(kd[ids].permute(0, 2, 1, 3).reshape(-1, kd.shape[1], D)[:n].double())
        values.append(vd[ids].permute(0, 2, 1, 3).reshape(-1, vd.shape[1], D)[:n].double())
    return decode_attention_ref(q.double().cpu(), keys, values, scale)


@pytest.mark.parametrize("G, num_splits", [(1, 3), (4, 1), (4, 8), (8, 3)])
def test_split_reference_matches_dense_attention(G, num_splits):
    Hkv = 2
    lens = [64, 200, 5 * 64 + 1]  # on and off page boundaries; 8 splits leave some empty
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=G + num_splits)
    assert (frag.k_out_idx != 0xFFFF).any() and (frag.v_out_idx != 0xFFFF).any()
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = D ** -0.5
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, scale)
    part_o, part_lse = nuq2_decode_split_reference(q, frag, tables, lens_t, scale, num_splits)
    assert part_o.shape == (len(lens), Hkv * G, num_splits, D)
    torch.testing.assert_close(reduce_partials(part_o, part_lse), ref, rtol=1e-9, atol=1e-9)
    # the sparse term is what makes it exact: without it the output is off
    main_o, main_lse = main_term_reference(q, frag, tables, lens_t, scale, num_splits)
    assert (reduce_partials(main_o, main_lse) - ref).abs().max() > 1e-3


def test_main_term_is_attention_over_pages_without_outliers():
    """The kernel's term alone: attention over the codebook values with the keys' channel affine,
    slots ignored (dequantize_fragment(outliers=False)), folded or not."""
    Hkv, G, lens = 2, 4, [130, 64 * 3]
    _, frag, tables, lens_t, _, _ = build(lens, Hkv, seed=3)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kd, vd = dequantize_fragment(frag, "key", outliers=False), dequantize_fragment(frag, "value", outliers=False)
    keys = [kd[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].double()
            for b, n in enumerate(lens)]
    values = [vd[tables[b, :-(-n // P)].long()].permute(0, 2, 1, 3).reshape(-1, Hkv, D)[:n].double()
              for b, n in enumerate(lens)]
    ref = decode_attention_ref(q, keys, values, 0.1)
    torch.testing.assert_close(reduce_partials(*main_term_reference(q, frag, tables, lens_t, 0.1, 2)), ref,
                               rtol=1e-9, atol=1e-9)


def test_corrections_without_slots_change_nothing():
    Hkv, G, lens = 2, 4, [100]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=4, outliers=False)
    q = torch.randn(1, Hkv * G, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o, lse = main_term_reference(q, frag, tables, lens_t, 0.1, 2)
    o2, lse2 = o.clone(), lse.clone()
    outlier_corrections(o2, lse2, q, frag, tables, lens_t, 0.1)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    torch.testing.assert_close(reduce_partials(o, lse), dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, 0.1),
                               rtol=1e-9, atol=1e-9)


def test_bad_inputs_are_refused():
    _, frag, tables, lens_t, _, _ = build([64], 2, seed=5)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        main_term_reference(torch.zeros(1, 6, D, dtype=torch.float64), frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="head"):
        main_term_reference(torch.zeros(1, 2, 64, dtype=torch.float64), frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="num_splits"):
        main_term_reference(torch.zeros(1, 2, D, dtype=torch.float64), frag, tables, lens_t, 0.1, 0)


SM90_BUILD = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.nuq2_kernel import nuq2_decode_kernel
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_tables": "*i32", "v_tables": "*i32", "k_mean": "*fp8e4nv",
       "k_scale": "*fp8e4nv", "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32",
       "context_lens": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "zero": "i32",
       "num_splits": "i32", "HKV": "constexpr", "G": "constexpr"}
for G in (1, 4, 8):
    src = GluonASTSource(nuq2_decode_kernel, signature=sig, constexprs={"HKV": 8, "G": G},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(8)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    ptx = k.asm["ptx"]
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "prmt.b32" in ptx, ".local" in ptx)
"""


def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships, for groups of 1, 4
    and 8: layouts that do not convert trivially, inline PTX or shapes that do not fit fail here,
    not on the device. In a fresh interpreter: other CPU tests set TRITON_INTERPRET=1 for the
    session (tests/triton_kernels.py), which leaves triton.language's own helpers uncompilable."""
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
    # per group: no shared memory (registers only), MMA and prmt present, no local memory (spills)
    assert run.stdout.split() == ["1", "0", "True", "True", "False", "4", "0", "True", "True", "False",
                                  "8", "0", "True", "True", "False"], run.stdout


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Gluon has no CPU backend)")


def relative_error(out, ref):
    return float((out.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_main_term(G, lens):
    """The Gluon kernel's partials against the main-term reference (float64): batch 1 and 4,
    lengths on and off page boundaries, GQA 1 / 4 / 8, a few split counts (some splits empty)."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_partials

    Hkv = 8 // G if G > 1 else 4
    _, frag, tables, lens_t, _, _ = build(lens, Hkv, seed=G, device="cuda")
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    frag64 = frag
    for ns in (1, 5, 64):
        part_o, part_lse = nuq2_decode_partials(q, frag, tables, lens_t, D ** -0.5, ns)
        ref_o, ref_lse = main_term_reference(q.double(), frag64, tables, lens_t, D ** -0.5, ns)
        full = ref_lse > -float("inf")
        assert torch.equal(part_lse.isfinite().cpu(), full.cpu()), "empty splits must be -inf, others finite"
        assert (part_lse - ref_lse)[full].abs().max() < 2e-2
        assert relative_error(reduce_partials(part_o.double(), part_lse.double()),
                              reduce_partials(ref_o, ref_lse).cpu()) < 3e-3


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("outliers", [True, False])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G, outliers):
    """Kernel + sparse term + reduce against dense attention over nuq2's own dequantized pages."""
    from moekv.ops.gluon.nuq2_decode import nuq2_decode_attention

    Hkv = 8 // G if G > 1 else 4
    lens = [777, 64 * 16, 65]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=10 + G, outliers=outliers, device="cuda")
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5)
    out = nuq2_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=4)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2
    if outliers:  # the sparse term matters at this tolerance
        without = nuq2_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=4, outliers=False)
        assert relative_error(without, ref) > 2 * relative_error(out, ref)
