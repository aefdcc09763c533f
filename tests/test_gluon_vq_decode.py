"""The vq Gluon decode path (moekv/ops/gluon/vq_decode.py). On CPU: its split reference (the keys'
channel scale folded into q, their token scale onto the scores and their page mean as q . mean; the
values' token scale into P) against dense attention over vq's own dequantized pages in float64, with
the staged 16-bit tail and sliding windows; the kernel's fp16 roundings emulated; the kernel's sm_90
build. On a GPU (marked gpu): the Gluon kernel against that reference and dense attention."""
from __future__ import annotations

import functools

import pytest
import torch

from moekv.kvcache.formats.vq import VQFormat, random_calibration
from moekv.ops.gluon.launch import MAX_SPLITS
from moekv.ops.gluon.nuq2_decode import reduce_partials
from moekv.ops.gluon.vq_decode import vq_decode_split_reference
from moekv.ops.gluon.vq_layout import to_fragment_order
from tests.gluon_cases import (
    GPU,
    RING_SPLIT_CASES,
    D,
    P,
    behind_tables,
    check_kernel_matches_reference,
    check_ring_decode,
    check_ring_partials,
    check_ring_reference,
    dense_reference,
    gpu_case,
    large_channel_keys,
    num_pages,
    pack,
    relative_error,
    run_sm90_build,
    staging,
)

_FORMATS: dict[int, VQFormat] = {}


def vq_format(Hkv: int) -> VQFormat:
    """A vq format on a random calibration for Hkv heads (made once per head count)."""
    if Hkv not in _FORMATS:
        import tempfile

        _FORMATS[Hkv] = VQFormat(random_calibration(tempfile.mkdtemp(prefix="vq_gluon_"), Hkv, D))
    return _FORMATS[Hkv]


def build(lens, Hkv, seed, device="cpu"):
    """Random vq pages (keys with two large channels) for sequences of lengths `lens` behind a shuffled
    block table, in fragment order -> (fmt, frag, tables, lens, k_pages, v_pages)."""
    fmt = vq_format(Hkv)
    g = torch.Generator().manual_seed(seed)
    N = num_pages(lens)
    k = large_channel_keys(N, Hkv, g, shift=0.5)
    v = torch.randn(N, Hkv, P, D, generator=g) - 0.3
    return behind_tables(fmt, pack(fmt, k, v, layer=0), lens, g, to_fragment_order, device)


@pytest.mark.slow
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_reference_is_dense_attention(G, num_splits):
    """The split reference's algebra (float64) equals dense attention over vq's dequantized pages:
    lengths on and off page boundaries, empty splits."""
    Hkv = 8 // G if G > 1 else 4
    lens = [777, 64 * 5, 65, 1]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=G + num_splits)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    part_o, part_lse = vq_decode_split_reference(q, frag, tables, lens_t, D ** -0.5, num_splits)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5, layer=0)
    assert relative_error(reduce_partials(part_o, part_lse), ref) < 1e-6  # the dense pages are dequantized in float32


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
def test_reference_with_staged_tail_and_window(window):
    """The staged tail (the newest page, bf16) as the extra split, and sliding windows, in float64."""
    G, Hkv = 4, 2
    lens = [777, 64 * 16, 65, 64, 5]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=7)
    staged = staging(len(lens), Hkv, seed=3)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for ns in (1, 4):
        part_o, part_lse = vq_decode_split_reference(q, frag, tables, lens_t, D ** -0.5, ns, staged, window)
        ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5, staged, window, layer=0)
        assert relative_error(reduce_partials(part_o, part_lse), ref) < 1e-6, ns


def test_kernel_roundings_stay_small():
    """The kernel's fp16 operands (q, q * chan_scale, p * tok_scale) emulated in float32: within the
    GPU tests' 3e-3 of float64 dense attention, and not exact (the emulation does round)."""
    G, Hkv = 4, 2
    lens = [1000, 64 * 9, 129]
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=11)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(5))
    ref = dense_reference(fmt, k_pages, v_pages, q, tables, lens_t, D ** -0.5, layer=0)
    part_o, part_lse = vq_decode_split_reference(q, frag, tables, lens_t, D ** -0.5, 5, kernel_roundings=True)
    err = relative_error(reduce_partials(part_o.double(), part_lse.double()), ref)
    assert 1e-6 < err < 3e-3, err


def test_shared_codebooks_where_they_pay(monkeypatch):
    """The default place of the codebooks (shared_codebooks_pay) on an H100/H200 (132 SMs): shared where
    the one-warp kernel's launch would fill a wave (16 programs an SM at cap 128) or a CTA's splits read
    more page bytes than its 64 kB codebook copy, global elsewhere; and the shared kernel's split count
    in whole CTAs (three of 4 warps an SM at cap 168), within MAX_SPLITS and one wave where the one-warp
    rule asks for one."""
    from moekv.ops.gluon import vq_decode

    monkeypatch.setattr(vq_decode, "sm_count", lambda device: 132)
    pay = functools.partial(vq_decode.shared_codebooks_pay, Hkv=8, staged=True, device="cpu")
    assert pay(16, max_pages=512) and pay(64, max_pages=512) and pay(8, max_pages=512)  # 2.1-2.3x faster (H200)
    assert pay(32, max_pages=64)  # (32, 4k): the one-warp launch fills a wave
    assert pay(1, max_pages=2048)  # (1, 128k): 11 pages a split; 65 against 79-98 us
    assert not pay(1, max_pages=64)  # (1, 4k): 2 pages a split; 18.0 against 12.4 us
    ctas = vq_decode.shared_ctas_per_sm(vq_decode.DEFAULT_WARPS, vq_decode.SHARED_MAX_REGISTERS)
    assert ctas == 3 and vq_decode.shared_ctas_per_sm(8, None) == 1 and vq_decode.shared_ctas_per_sm(8, 128) == 2
    splits = [vq_decode.shared_splits(B, 8, pages, True, "cpu", 8, 2) for B, pages in ((16, 512), (1, 2048), (1, 64))]
    assert all(s % 8 == 0 for s in splits) and splits[0] == 32, splits
    # (1, 128k): the tail's split fits MAX_SPLITS, and the 8 heads' CTAs (splits / 8 each) one wave
    assert splits[1] + 1 <= MAX_SPLITS and 8 * (splits[1] // 8) <= 132 * 2, splits
    # one CTA an SM: 131 splits round down to 16 CTAs of the 132 a wave holds, not up to 17 (a second wave)
    assert vq_decode.shared_splits(1, 8, 2048, True, "cpu", 8, 1) == 128


@pytest.mark.parametrize("R, window", [(64, None), (256, 150), (32, 64 * 5 + 3)])
def test_residual_ring_and_sliding_window(R, window):
    """A residual window's ring as the tail split (its newest R tokens; with R < 64 staged ones before
    them), the pages ending where it begins, and sliding windows, against dense attention (float64)."""
    check_ring_reference(vq_decode_split_reference, build, R, window, 1e-6, layer=0)  # pages dequantized in float32


BUILD_PRELUDE = """
import re, subprocess
from pathlib import Path
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TABLES = {"k_codes": "*i32", "v_codes": "*i32", "k_tok_scale": "*fp16", "v_tok_scale": "*fp16",
          "k_mean": "*fp8e4nv", "k_codebook": "*fp8e4nv", "k_chan_scale": "*fp32", "v_codebook": "*fp8e4nv",
          "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32"}


def build(kernel, sig, constexprs, **options):
    \"\"\"(compiled kernel, its SASS ops [(address, opcode, line)], its loops [(start, end)]) for sm_90.\"\"\"
    src = GluonASTSource(kernel, signature=sig, constexprs=constexprs,
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(8)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    Path("k.cubin").write_bytes(k.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", "k.cubin"], capture_output=True, text=True).stdout
    ops = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
           if (m := re.match(r"\\s+/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_.]+)", line))]
    loops = [(int(t.group(1), 16), a) for a, op, line in ops
             if op.startswith("BRA") and (t := re.search(r"BRA\\s+(?:\\w+\\s+)?(0x[0-9a-f]+)", line))
             and int(t.group(1), 16) < a]
    return k, ops, loops
"""

SM90_BUILD = BUILD_PRELUDE + """
from moekv.ops.gluon.vq_kernel import vq_decode_kernel
sig = {**TABLES, "seq_slots": "*i64", "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32",
       "stride_st": "i32", "k_ring": "*bf16", "v_ring": "*bf16", "stride_rs": "i32", "stride_rh": "i32",
       "stride_rt": "i32", "R": "i32", "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32",
       "num_splits": "i32", "ns_total": "i32", "split0": "i32", "HKV": "constexpr", "G": "constexpr",
       "STAGED": "constexpr", "RING": "constexpr"}
for G, staged, ring in ((1, True, False), (4, False, False), (8, True, False), (1, True, True), (8, True, True)):
    k, ops, loops = build(vq_decode_kernel, sig, {"HKV": 8, "G": G, "STAGED": staged, "RING": ring}, num_warps=1)
    lo, hi = loops[0]  # the page loop (the tail's comes after it)
    gathers = sum(op == "LDG.E.64" and lo <= a <= hi for a, op, _ in ops)
    codes = sum(op == "LDG.E.128" and lo <= a <= hi for a, op, _ in ops)
    local = sum(op.startswith(("LDL", "STL")) and lo <= a <= hi for a, op, _ in ops)
    print(G, staged, k.metadata.shared, gathers, codes, local)
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu(tmp_path):
    """The Gluon kernel builds for the H200 (sm_90) with the ptxas Triton ships (groups 1, 4, 8; with and without
    the tail split; with a residual window's ring as the tail): no shared memory (the tiles' layout conversions
    move registers within a thread only), in the page loop 64 8-byte codeword gathers and 4 128-bit code loads,
    and no spill there. In a fresh interpreter (other CPU tests set TRITON_INTERPRET=1 for the session)."""
    words = run_sm90_build(SM90_BUILD, cwd=tmp_path)
    builds = [words[i:i + 6] for i in range(0, len(words), 6)]
    assert builds == [[g, s, "0", "64", "4", "0"] for g, s in (("1", "True"), ("4", "False"), ("8", "True"),
                                                              ("1", "True"), ("8", "True"))], words


SMEM_BUILD = BUILD_PRELUDE + """
from moekv.ops.gluon.vq_smem_kernel import vq_smem_decode_kernel
sig = {**TABLES, "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32", "num_splits": "i32",
       "ns_total": "i32", "R": "i32", "HKV": "constexpr", "G": "constexpr", "W": "constexpr", "STAGED": "constexpr",
       "RING": "constexpr"}
for G, W, cap, ring in ((1, 4, 168, False), (8, 8, 0, False), (4, 16, 128, False), (4, 4, 168, True)):
    k, ops, loops = build(vq_smem_decode_kernel, sig, {"HKV": 8, "G": G, "W": W, "STAGED": True, "RING": ring},
                          num_warps=W, **({"maxnreg": cap} if cap else {}))
    print(G, W, k.metadata.shared, sum(op == "LDS.64" for _, op, _ in ops),
          sum(op == "LDG.E.128" for _, op, _ in ops), len(loops),
          sum(op.startswith(("LDL", "STL")) and loops[0][0] <= a <= loops[0][1] for a, op, _ in ops))
"""


@pytest.mark.slow
def test_shared_codebook_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The shared-codebook kernel builds for sm_90 (4 warps at the default 168 registers, 8 uncapped, 16 at 128; 4
    at 168 with a residual window, whose pages end where the ring begins): its only shared memory is the head's
    two e4m3 codebooks (64 kB: the codeword reads address it from the dynamic shared memory's base, so nothing
    else may sit before it), the 64 codeword reads of a page are LDS.64, the global 128-bit loads only the
    codes' 4 a page (and their first page's 4), and the caps spill little in the page loop (none uncapped)."""
    words = run_sm90_build(SMEM_BUILD, cwd=tmp_path)
    builds = [words[i:i + 7] for i in range(0, len(words), 7)]
    assert [b[:4] for b in builds] == [["1", "4", "65536", "64"], ["8", "8", "65536", "64"],
                                       ["4", "16", "65536", "64"], ["4", "4", "65536", "64"]], words
    assert all(b[4] == "8" and b[5] == "1" for b in builds), words
    assert builds[1][6] == "0" and all(int(b[6]) <= 24 for b in builds), words


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("codebooks", ["global", "shared"])
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens, codebooks):
    """The Gluon kernel's partials against the split reference (float64): batch 1 and 4, lengths on and
    off page boundaries, GQA 1 / 4 / 8, split counts with empty splits (and, shared codebooks, CTAs
    whose warps run past the splits)."""
    from moekv.ops.gluon.vq_decode import vq_decode_partials

    partials = functools.partial(vq_decode_partials, codebooks=codebooks)
    check_kernel_matches_reference(partials, vq_decode_split_reference, build, G, lens)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G):
    """Kernel + reduce against dense attention over vq's own dequantized pages."""
    from moekv.ops.gluon.vq_decode import vq_decode_attention

    _, fmt, frag, tables, lens_t, k_pages, v_pages, q = gpu_case(build, G, [777, 64 * 16, 65], 10 + G)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, layer=0)
    out = vq_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=4)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("codebooks", ["global", "shared"])
@pytest.mark.parametrize("window", [None, 1, 100, 150, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_staged_tail_and_window(G, window, codebooks):
    """The staged bf16 tail as the launch's extra split (shared codebooks: the one-warp kernel's second
    launch), and sliding windows, against dense attention over pages + staging (split counts 1, 3 and
    the default)."""
    from moekv.ops.gluon.vq_decode import vq_decode_attention

    lens = [777, 64 * 16, 65, 64]
    Hkv, fmt, frag, tables, lens_t, k_pages, v_pages, q = gpu_case(build, G, lens, 20 + G)
    k, v, slots = staging(len(lens), Hkv, seed=G, device="cuda", dtype=torch.bfloat16)
    ref = dense_reference(fmt, k_pages, v_pages, q, tables.cpu(), lens_t.cpu(), D ** -0.5, (k, v, slots), window,
                          layer=0)
    for ns in (1, 3, None):
        out = vq_decode_attention(q, frag, tables, lens_t, D ** -0.5, num_splits=ns, staged=(k, v, slots),
                                  sliding_window=window, codebooks=codebooks)
        assert relative_error(out, ref) < 1e-2, ns


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("R, window", RING_SPLIT_CASES)
@pytest.mark.parametrize("G, codebooks", [(1, "global"), (4, "shared"), (8, "global"), (8, "shared")])
def test_gpu_residual_ring_split_over_programs(G, codebooks, R, window):
    """The ring's tail read by 1 to 16 programs (each a share; shared codebooks: the one-warp kernel's
    second launch, tail_splits programs a head): the kernel's partials against the split reference's at
    the same splits, and kernel + reduce with sinks; rings that wrap, sequences shorter than R, windows
    cutting into the tail."""
    from moekv.ops.gluon.vq_decode import vq_decode_attention, vq_decode_partials

    check_ring_partials(vq_decode_partials, vq_decode_attention, vq_decode_split_reference, build, G, R, window,
                        codebooks=codebooks)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("codebooks", ["global", "shared"])
@pytest.mark.parametrize("R, window", [(256, None), (64, 100), (32, 64 * 5 + 3), (128, 1)])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_residual_ring(G, R, window, codebooks):
    """A residual window's ring as the launch's tail split (RING), both kernels (the shared-codebook one's
    pages ending where the ring begins), against dense attention over pages, ring and staging."""
    from moekv.ops.gluon.vq_decode import vq_decode_attention

    check_ring_decode(vq_decode_attention, build, G, R, window, layer=0, codebooks=codebooks)
