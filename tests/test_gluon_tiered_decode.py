"""tiered's Gluon decode path (moekv/ops/gluon/tiered_decode.py, tiered_kernel.py, fp8_layout.py).
On CPU: the FP8 fragment order (a bijection that puts every code in the lane whose mma A fragment
holds it, and back), the split reference (FP8 and nuq2 pages behind one block table, the per-page
attention mass, the staged 16-bit tail of tiered's rule, sliding windows) against dense attention
over the two formats' own dequantized slabs, in float64, and the sm_90 offline build. On a GPU
(marked gpu): the kernel against the reference and dense attention."""
from __future__ import annotations

import math

import pytest
import torch

from moekv.kvcache.formats.fp8 import FP8Format
from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.ops.gluon.fp8_layout import (
    CODE_BYTES,
    ELEMENT_OF_BYTE,
    FP8_FRAGMENT_VERSION,
    dequantize_fragment_slabs,
    slabs_from_fragment,
    slabs_to_fragment,
)
from moekv.ops.gluon.nuq2_decode import reduce_partials
from moekv.ops.gluon.nuq2_layout import to_fragment_order
from moekv.ops.gluon.tiered_decode import page_mass, tiered_decode_split_reference
from moekv.ops.reference import decode_attention_ref
from tests.gluon_cases import (
    GPU,
    D,
    P,
    large_channel_keys,
    pack,
    relative_error,
    run_sm90_build,
    shuffled_tables,
    staging,
)

FP8 = FP8Format()


def build(lens, Hkv, seed, fp8_share=0.3, device="cpu"):
    """Random pages for sequences of lengths `lens` behind a shuffled block table: every logical page
    has a nuq2 row (garbage for FP8 pages, as a demoted pool's stale rows are), a share of them an
    FP8 slot (shuffled) -> a dict of the kernel's inputs and the dense pages the formats dequantize."""
    g = torch.Generator().manual_seed(seed)
    nuq2 = NUQ2Format(codebook="page", quantize_kernel=False,
                      outlier_cap=1024)  # every slot fillable: the kernel's later slot chunks run
    pages_per = [-(-n // P) for n in lens]
    N = sum(pages_per) + 2
    k = large_channel_keys(N, Hkv, g)
    v = torch.randn(N, Hkv, P, D, generator=g)
    k.view(-1)[torch.randint(0, k.numel(), (N * 6,), generator=g)] *= 12
    k_low, v_low = pack(nuq2, k, v)
    frag = to_fragment_order(nuq2, k_low, v_low)
    tier = torch.full((N,), 2, dtype=torch.int32)
    fp8_pages = torch.randperm(N, generator=g)[:round(fp8_share * N)]
    tier[fp8_pages] = 1
    F = len(fp8_pages) + 1  # a spare slot
    slot = torch.full((N,), -1, dtype=torch.int32)
    slot[fp8_pages] = torch.randperm(F, generator=g)[:len(fp8_pages)].to(torch.int32)
    # the FP8 tier's own pages: other data than the low rows, so reading the wrong tier shows
    k8 = large_channel_keys(F, Hkv, g, shift=0.5)
    v8 = torch.randn(F, Hkv, P, D, generator=g) * 2
    k_fp8, v_fp8 = pack(FP8, k8, v8)
    kd = nuq2.dequantize(nuq2.layout("key", P, D).unpack(k_low), "key")
    vd = nuq2.dequantize(nuq2.layout("value", P, D).unpack(v_low), "value")
    k8d = FP8.dequantize(FP8.layout("key", P, D).unpack(k_fp8), "key")
    v8d = FP8.dequantize(FP8.layout("value", P, D).unpack(v_fp8), "value")
    kd[fp8_pages], vd[fp8_pages] = k8d[slot[fp8_pages].long()], v8d[slot[fp8_pages].long()]
    tables = shuffled_tables(N, lens, g)
    def to(t):
        return t.to(device)

    if device != "cpu":
        frag = to_fragment_order(nuq2, k_low.to(device), v_low.to(device))
    return dict(fp8_fmt=FP8, frag=frag,
                k_fp8=to(slabs_to_fragment(FP8, "key", k_fp8)), v_fp8=to(slabs_to_fragment(FP8, "value", v_fp8)),
                page_tier=to(tier), page_slot=to(slot), block_tables=to(tables),
                context_lens=to(torch.tensor(lens, dtype=torch.int32))), (kd, vd)


def dense(dense_pages, inputs, q, scale, staged=None, window=None):
    """float64 decode attention over each sequence's dense pages (+ the staged tail from (n // 64) * 64
    on) and each full page's attention mass summed over the query heads [B, max_pages]."""
    kd, vd = dense_pages
    tables, lens = inputs["block_tables"].cpu(), inputs["context_lens"].cpu().tolist()
    keys, values = [], []
    mass = torch.zeros(len(lens), tables.shape[1], dtype=torch.float64)
    for b, n in enumerate(lens):
        ids = tables[b, :-(-n // P)].long()
        k = kd[ids].permute(0, 2, 1, 3).reshape(-1, kd.shape[1], D)[:n].double()
        v = vd[ids].permute(0, 2, 1, 3).reshape(-1, vd.shape[1], D)[:n].double()
        if staged is not None:
            quantized, slot = n // P * P, int(staged[2][b])
            k = torch.cat([k[:quantized], staged[0][slot].cpu().double().transpose(0, 1)[:n - quantized]])
            v = torch.cat([v[:quantized], staged[1][slot].cpu().double().transpose(0, 1)[:n - quantized]])
        keys.append(k)
        values.append(v)
        G = q.shape[1] // k.shape[1]
        s = torch.einsum("hd,lhd->hl", q[b].double().cpu(), k.repeat_interleave(G, dim=1)) * scale
        if window is not None:
            s[:, :max(0, n - window)] = -math.inf
        probs = torch.softmax(s, -1).sum(0)  # [L]
        full = n // P
        mass[b, :full] = probs[:full * P].reshape(full, P).sum(-1)
    return decode_attention_ref(q.double().cpu(), keys, values, scale, window), mass


# -- the FP8 fragment order ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["key", "value"])
def test_fp8_fragment_order_puts_each_code_in_its_fragment_lane(kind):
    """Byte e of the order: row e // 512 (step (row // 4): 16 tokens), lane (e % 512) // 16. The
    element there belongs to that lane's mma_v2 A fragment (rows g = lane // 4 mod 8, column pairs
    2 (lane % 4) mod 8): K [16, 128] for keys (rows tokens), V^T [128, 16] for values (rows channels)."""
    e = ELEMENT_OF_BYTE[kind]
    assert torch.equal(e.sort().values, torch.arange(CODE_BYTES))  # a permutation
    byte = torch.arange(CODE_BYTES)
    row, lane = byte // 512, (byte % 512) // 16
    token, chan = e // D, e % D
    a_row, a_col = (token, chan) if kind == "key" else (chan, token)
    assert torch.equal(token // 16, row // 4)
    assert torch.equal(a_row % 8, lane // 4) and torch.equal((a_col % 8) // 2, lane % 4)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_kernel_reshapes_give_the_step_tiles(kind):
    """The logical reshape/permute of fp8_kernel.fp8_page (the same dims, in torch) turns step i's
    [4 rows, 128 words, 4 bytes] of the order into K [16, 128] (tokens 16 i ..) / V^T [128, 16]: what
    the kernel computes depends on this and the layouts only (convert_layout is an identity; the
    offline build asserts it moves no data)."""
    x = torch.arange(P * D)
    frag = x[ELEMENT_OF_BYTE[kind]]
    for i in range(4):
        t = frag[i * 2048:(i + 1) * 2048].reshape(2, 2, 8, 4, 2, 2, 2, 2)  # f1 f0 g q4 y3 y2 y1 y0
        rows = x.reshape(P, D)[16 * i:16 * i + 16]
        if kind == "key":
            assert torch.equal(t.permute(6, 2, 0, 1, 4, 5, 3, 7).reshape(16, 128), rows)
        else:
            assert torch.equal(t.permute(0, 1, 4, 6, 2, 5, 3, 7).reshape(128, 16), rows.T)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_fp8_fragment_round_trip(kind):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, P, D, generator=g) * 3
    slabs = FP8.layout(kind, P, D).pack(FP8.quantize(x, kind))
    frag = slabs_to_fragment(FP8, kind, slabs)
    assert frag.shape == slabs.shape and not torch.equal(frag, slabs)
    assert torch.equal(frag[..., CODE_BYTES:], slabs[..., CODE_BYTES:])  # scales and padding stay
    assert torch.equal(slabs_from_fragment(FP8, kind, frag), slabs)
    want = FP8.dequantize(FP8.layout(kind, P, D).unpack(slabs), kind)
    assert torch.equal(dequantize_fragment_slabs(FP8, kind, frag), want)
    with pytest.raises(ValueError, match="version"):
        slabs_from_fragment(FP8, kind, frag, version=FP8_FRAGMENT_VERSION + 1)
    with pytest.raises(ValueError, match="uint8"):
        slabs_to_fragment(FP8, kind, slabs[..., :-1])


# -- the split reference ----------------------------------------------------------------------------
@pytest.mark.parametrize("G, num_splits, fp8_share", [(1, 3, 0.3), (4, 1, 0.0), (4, 8, 0.5), (8, 3, 1.0)])
def test_split_reference_matches_dense_attention_and_mass(G, num_splits, fp8_share):
    """FP8 and nuq2 pages behind one table (none, some or all in FP8), lengths on and off page
    boundaries, 8 splits leaving some empty: the merged partials equal dense attention over the
    formats' own dequantized slabs, and the page masses its probabilities per page."""
    Hkv = 2
    lens = [64, 200, 5 * 64 + 1]
    inputs, pages = build(lens, Hkv, seed=G + num_splits, fp8_share=fp8_share)
    assert bool((inputs["page_tier"] == 1).any()) == (fp8_share > 0)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, ref_mass = dense(pages, inputs, q, D ** -0.5)
    part_o, part_lse, t_sum, t_max = tiered_decode_split_reference(q, **inputs, scale=D ** -0.5, num_splits=num_splits)
    assert part_o.shape == (len(lens), Hkv * G, num_splits, D) and t_sum.shape == (len(lens), Hkv * G, 6)
    torch.testing.assert_close(reduce_partials(part_o, part_lse), ref, rtol=1e-9, atol=1e-9)
    mass = page_mass(part_lse, t_sum, t_max, inputs["context_lens"])
    torch.testing.assert_close(mass, ref_mass, rtol=1e-9, atol=1e-9)
    assert abs(float(mass[0].sum()) - Hkv * G) < 1e-9  # a context of whole pages: all of every head's mass
    assert float(mass[1].sum()) < Hkv * G - 1e-3  # the partly filled page has none


def test_batch_one_and_wrong_tier_shows():
    """Batch 1; reading an FP8 page from the low tier (tiers swapped) changes the output: the test
    sees which tier a page is read from."""
    Hkv, G = 2, 4
    inputs, pages = build([4 * 64 + 17], Hkv, seed=11, fp8_share=0.5)
    q = torch.randn(1, Hkv * G, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref, _ = dense(pages, inputs, q, 0.1)
    out = reduce_partials(*tiered_decode_split_reference(q, **inputs, scale=0.1, num_splits=2)[:2])
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    swapped = dict(inputs, page_tier=torch.where(inputs["page_tier"] == 1, 2, 1).to(torch.int32),
                   page_slot=torch.where(inputs["page_slot"] >= 0, -1, 0).to(torch.int32))
    other = reduce_partials(*tiered_decode_split_reference(q, **swapped, scale=0.1, num_splits=2)[:2])
    assert (other - ref).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 1, 50, 64 * 2 + 3, 10_000])
def test_staged_tail_and_sliding_window(window):
    """tiered's staging rule (tokens from (len // 64) * 64 on: full pages are stored when they fill,
    so a length on a page boundary has an empty tail) as split num_splits, and sliding windows (pages
    before the window skipped and given no mass, the first one masked)."""
    Hkv, G = 2, 4
    lens = [64, 65, 200, 5 * 64 + 1, 4 * 64]  # tails of 0, 1, 8, 1, 0 tokens
    inputs, pages = build(lens, Hkv, seed=7, fp8_share=0.4)
    staged = staging(len(lens), Hkv, seed=8)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, ref_mass = dense(pages, inputs, q, 0.1, staged, window)
    for ns in (1, 3):
        part_o, part_lse, t_sum, t_max = tiered_decode_split_reference(q, **inputs, scale=0.1, num_splits=ns,
                                                                       staged=staged, sliding_window=window)
        assert part_o.shape[2] == ns + 1
        tail_full = (torch.tensor(lens) % P != 0)[:, None].expand(-1, Hkv * G)
        assert torch.equal(part_lse[:, :, ns].isfinite(), tail_full)  # empty tails on page boundaries
        torch.testing.assert_close(reduce_partials(part_o, part_lse), ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(page_mass(part_lse, t_sum, t_max, inputs["context_lens"], window), ref_mass,
                                   rtol=1e-9, atol=1e-9)


def test_bad_inputs_are_refused():
    inputs, _ = build([64], 2, seed=5)
    q = torch.zeros(1, 8, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="page_tier"):
        tiered_decode_split_reference(q, **dict(inputs, page_tier=inputs["page_tier"][:-1]), scale=0.1, num_splits=1)
    with pytest.raises(ValueError, match="FP8 pools"):
        tiered_decode_split_reference(q, **dict(inputs, v_fp8=inputs["v_fp8"][:, :1]), scale=0.1, num_splits=1)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        tiered_decode_split_reference(torch.zeros(1, 6, D, dtype=torch.float64), **inputs, scale=0.1, num_splits=1)
    with pytest.raises(ValueError, match="CUDA"):
        from moekv.ops.gluon.tiered_decode import tiered_decode_partials

        tiered_decode_partials(q.float(), **inputs, scale=0.1, num_splits=1)


SM90_BUILD = """
import os, subprocess, tempfile
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.tiered_kernel import tiered_decode_kernel
sig = {"k_codes": "*i32", "v_codes": "*i32", "k_tables": "*i32", "v_tables": "*i32", "k_mean": "*fp8e4nv",
       "k_scale": "*fp8e4nv", "k_idx": "*u16", "k_delta": "*fp16", "k_used": "*u8", "v_idx": "*u16",
       "v_delta": "*fp16", "v_used": "*u8", "SK": "i32", "SV": "i32",
       "kf_w": "*i32", "vf_w": "*i32", "kf_h": "*fp16", "vf_h": "*fp16", "page_tier": "*i32", "page_slot": "*i32",
       "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32", "seq_slots": "*i64",
       "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32",
       "part_o": "*fp32", "part_lse": "*fp32", "tile_sum": "*fp32", "tile_max": "*fp32", "max_tiles": "i32",
       "qk_scale": "fp32", "window": "i32", "zero": "i32", "num_splits": "i32", "ns_total": "i32",
       "HKV": "constexpr", "G": "constexpr", "STAGED": "constexpr", "CHUNK0": "constexpr", "EMIT_MASS": "constexpr",
       "FW": "constexpr", "F_KS": "constexpr", "F_VS": "constexpr", "FP8_PREFETCH": "constexpr", "SMEM": "constexpr"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for G, staged, mass, prefetch, smem in ((1, True, True, False, False), (4, True, True, False, False),
                                        (8, False, False, False, False), (4, True, True, True, False),
                                        (4, True, True, False, True)):
    src = GluonASTSource(tiered_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "STAGED": staged, "CHUNK0": True, "EMIT_MASS": mass,
                                     "FW": 2080, "F_KS": 8192, "F_VS": 8192, "FP8_PREFETCH": prefetch, "SMEM": smem},
                         attrs={(i,): [["tt.divisibility", 16]] for i in list(range(12)) + list(range(14, 20))})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, maxnreg=128))
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, "cvt.rn.f16x2.e4m3x2" in ptx, ".local" in ptx,
          sass.count("LDG.E.128") >= (8 if smem else 24), sass.count("F2FP.F16.E4M3.UNPACK_B") >= 64,
          sass.count("LDGSTS.E.BYPASS.128"))
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with Triton's ptxas, groups 1, 4 and 8, with and
    without the staged tail and the mass, with the FP8 steps' prefetch, and with the nuq2 pages through
    shared memory (SMEM): every assert_trivial layout conversion (nuq2's and the FP8 tiles') holds, no
    local memory, the FP8 codes arrive by 128-bit loads (and the nuq2 codes: 16 loads, or with SMEM 16
    128-bit cp.async copies in two places) and convert two an instruction (F2FP.F16.E4M3.UNPACK_B);
    shared memory only with SMEM (nuq2's two stages)."""
    words = run_sm90_build(SM90_BUILD)
    plain = ["0", "True", "True", "False", "True", "True", "0"]
    assert words == ["1", *plain, "4", *plain, "8", *plain, "4", *plain,
                     "4", "9024", "True", "True", "False", "True", "True", "16"], words


# -- on a GPU ------------------------------------------------------------------------------------------
def gpu_inputs(lens, G, seed, fp8_share=0.3):
    Hkv = 8 // G if G > 1 else 4
    inputs, pages = build(lens, Hkv, seed, fp8_share, device="cuda")
    q = torch.randn(len(lens), Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    return Hkv, inputs, pages, q


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens, fp8_share", [([64], 1.0), ([4096 + 7], 0.15), ([1000, 64 * 9, 129, 3000], 0.3),
                                             ([700, 2000], 0.0)])
def test_gpu_kernel_matches_reference(G, lens, fp8_share):
    """Partials and page masses of the kernel against the split reference (float64): split counts 1,
    5, 64 (some empty), batch 1 and 4, GQA 1 / 4 / 8, no, some and all pages in FP8."""
    from moekv.ops.gluon.tiered_decode import tiered_decode_partials

    _, inputs, _, q = gpu_inputs(lens, G, seed=G, fp8_share=fp8_share)
    for ns in (1, 5, 64):
        part_o, part_lse, t_sum, t_max = tiered_decode_partials(q, **inputs, scale=D ** -0.5, num_splits=ns)
        ref_o, ref_lse, ref_sum, ref_max = tiered_decode_split_reference(q.double(), **inputs, scale=D ** -0.5,
                                                                         num_splits=ns)
        full = ref_lse > -float("inf")
        assert torch.equal(part_lse.isfinite(), full), "empty splits must be -inf, others finite"
        assert (part_lse - ref_lse)[full].abs().max() < 2e-2
        assert relative_error(reduce_partials(part_o.double(), part_lse.double()),
                              reduce_partials(ref_o, ref_lse)) < 3e-3
        written = ref_max > -float("inf")  # the pages some split read: the kernel writes those only
        mass = page_mass(part_lse.double(), torch.where(written, t_sum.double(), 0.0),
                         torch.where(written, t_max.double(), -math.inf), inputs["context_lens"])
        ref_mass = page_mass(ref_lse, ref_sum, ref_max, inputs["context_lens"])
        assert (mass - ref_mass).abs().max() < 2e-2 * max(1.0, float(ref_mass.abs().max()))  # as the lse


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("fp8_share", [0.0, 0.3, 1.0])
def test_gpu_smem_changes_nothing(G, fp8_share):
    """The nuq2 pages through shared memory (SMEM) give the same partials and page masses bit for bit as
    global loads: no, some and all pages in FP8, split counts with empty splits, staged tail and windows
    (the tile entries compared through page_mass: entries of pages no split reads are not written)."""
    from moekv.ops.gluon.tiered_decode import tiered_decode_partials

    lens = [1000, 64 * 9, 129, 3000]
    Hkv, inputs, _, q = gpu_inputs(lens, G, seed=40 + G, fp8_share=fp8_share)
    k, v, slots = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    for ns, window in ((1, None), (5, 100), (64, None), (None, 64 * 5 + 3)):
        kw = dict(scale=D ** -0.5, num_splits=ns, staged=(k, v, slots), sliding_window=window)
        ref = tiered_decode_partials(q, **inputs, **kw, smem=False)
        got = tiered_decode_partials(q, **inputs, **kw, smem=True)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (ns, window)
        lens_t = inputs["context_lens"]
        assert torch.equal(page_mass(*got[1:], lens_t, window), page_mass(*ref[1:], lens_t, window)), (ns, window)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("lens", [[64 * 3 + 20], [1000, 64 * 9, 129, 3000]])
def test_gpu_fp8_prefetch_matches_reference(lens):
    """The FP8 steps' prefetch variant (fp8_prefetch, not the default): the same partials and masses
    as the split reference, windows that skip steps of an FP8 page included."""
    from moekv.ops.gluon.tiered_decode import tiered_decode_attention

    Hkv, inputs, pages, q = gpu_inputs(lens, 4, seed=31, fp8_share=0.6)
    k, v, slots = staging(len(lens), Hkv, seed=4, device="cuda", dtype=torch.bfloat16)
    for window in (None, 40, 64 * 2 + 50):
        ref, ref_mass = dense(pages, inputs, q, D ** -0.5, (k, v, slots), window)
        out, mass = tiered_decode_attention(q, **inputs, scale=D ** -0.5, staged=(k, v, slots),
                                            sliding_window=window, fp8_prefetch=True)
        assert relative_error(out, ref) < 1e-2, window
        assert (mass.double().cpu() - ref_mass).abs().max() < 1e-2 * q.shape[1]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_attention_and_mass_match_dense(G, window):
    """Kernel + the reduce-and-mass launch against dense attention over the formats' own pages +
    the staged bf16 tail (tiered's rule), split counts 1, 3 and the default; the mass returned and
    added into a per-page accumulator (mass_into, as the engine's format does)."""
    from moekv.ops.gluon.tiered_decode import tiered_decode_attention

    lens = [777, 64 * 16, 65, 64]
    Hkv, inputs, pages, q = gpu_inputs(lens, G, seed=20 + G)
    k, v, slots = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    ref, ref_mass = dense(pages, inputs, q, D ** -0.5, (k, v, slots), window)
    for ns in (1, 3, None):
        out, mass = tiered_decode_attention(q, **inputs, scale=D ** -0.5, num_splits=ns, staged=(k, v, slots),
                                            sliding_window=window)
        assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2, ns
        assert (mass.double().cpu() - ref_mass).abs().max() < 1e-2 * q.shape[1]
    acc = torch.zeros(inputs["page_tier"].shape[0], device="cuda")
    out2, none = tiered_decode_attention(q, **inputs, scale=D ** -0.5, staged=(k, v, slots), sliding_window=window,
                                         mass_into=acc)
    assert none is None and relative_error(out2, ref) < 1e-2
    want = torch.zeros_like(acc, dtype=torch.float64).cpu()
    tables = inputs["block_tables"].cpu().long()
    for b in range(len(lens)):
        want.index_add_(0, tables[b], ref_mass[b])
    assert (acc.double().cpu() - want).abs().max() < 1e-2 * q.shape[1]
