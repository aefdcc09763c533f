"""The fp8_e4m3 Gluon decode path (moekv/ops/gluon/fp8_decode.py, fp8_kernel.py; the FP8 fragment order
itself is tested in test_gluon_tiered_decode.py). On CPU: the pool adapter (slabs in fragment order
and back through the format), the split reference against dense attention over fp8_e4m3's own
dequantized pages in float64, and the kernel's sm_90 build. On a GPU (marked gpu): the kernel against
that reference and dense attention."""
from __future__ import annotations

import pytest
import torch

from moekv.kvcache.formats.fp8 import FP8Format
from moekv.ops.gluon.fp8_decode import DEFAULT_PREFETCH, fp8_decode_split_reference
from moekv.ops.gluon.fp8_layout import (
    FP8_FRAGMENT_VERSION,
    FP8FragmentPages,
    dequantize_fragment,
    fragment_bytes_per_page_head,
    to_fragment_order,
)
from tests.gluon_cases import (
    GPU,
    D,
    P,
    behind_tables,
    check_decode_matches_dense,
    check_kernel_matches_reference,
    check_same_partials,
    check_split_reference,
    check_staged_decode,
    check_staged_reference,
    large_channel_keys,
    num_pages,
    pack,
    run_sm90_build,
)


def build(lens, Hkv, seed, device="cpu"):
    """Random fp8_e4m3 pages (keys with large channels, value rows of different scales) for sequences of
    lengths `lens` behind a shuffled block table, in fragment order -> (fmt, frag, block_tables,
    context_lens, k_pages, v_pages)."""
    fmt = FP8Format()
    g = torch.Generator().manual_seed(seed)
    N = num_pages(lens)
    k = large_channel_keys(N, Hkv, g, shift=0.5)
    v = torch.randn(N, Hkv, P, D, generator=g) * torch.rand(N, Hkv, P, 1, generator=g).mul(8).exp2()
    return behind_tables(fmt, pack(fmt, k, v), lens, g, to_fragment_order, device)


def test_fragment_pages_dequantize_as_the_slabs():
    """The pool adapter: slabs of the same size, each page dequantizing to what fp8_e4m3 gives its own slab."""
    fmt, frag, _, _, k_pages, v_pages = build([300], 2, seed=1)
    assert frag.num_kv_heads == 2 and frag.version == FP8_FRAGMENT_VERSION
    assert fragment_bytes_per_page_head(fmt) == k_pages.shape[-1] + v_pages.shape[-1]
    for kind, slabs in (("key", k_pages), ("value", v_pages)):
        want = fmt.dequantize(fmt.layout(kind, P, D).unpack(slabs), kind)
        assert torch.equal(dequantize_fragment(frag, kind), want)
    stale = FP8FragmentPages(frag.k_slabs, frag.v_slabs, fmt, version=FP8_FRAGMENT_VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        dequantize_fragment(stale, "key")


@pytest.mark.parametrize("G", [1, 4, 8])
def test_split_reference_equals_dense_attention(G):
    """The reference's splits (float64) against dense attention over fp8_e4m3's dequantized pages:
    several split counts (some splits empty), lengths on and off page boundaries."""
    check_split_reference(fp8_decode_split_reference, build, G, 1e-9)


@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
def test_staged_tail_and_sliding_window(window):
    """The staged 16-bit tail as split num_splits (the newest page, even when full, from staging) and
    sliding windows, against dense attention over pages + staging."""
    check_staged_reference(fp8_decode_split_reference, build, window, 1e-9)


def test_bad_inputs_are_refused():
    _, frag, tables, lens_t, _, _ = build([100], 2, seed=0)
    with pytest.raises(ValueError, match="G in 1, 2, 4, 8"):
        fp8_decode_split_reference(torch.randn(1, 6, D), frag, tables, lens_t, 0.1, 1)
    with pytest.raises(ValueError, match="block_size 64"):
        FP8Format().fragment_layout().check_shape(FP8Format(), 16, D)
    with pytest.raises(ValueError, match="CUDA"):
        from moekv.ops.gluon.fp8_decode import fp8_decode_partials

        fp8_decode_partials(torch.randn(1, 8, D, dtype=torch.bfloat16), frag, tables, lens_t, 0.1, 1)


SM90_BUILD = """
import os, subprocess, tempfile
import triton
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekv.ops.gluon.fp8_decode import DEFAULT_MAX_REGISTERS
from moekv.ops.gluon.fp8_kernel import fp8_decode_kernel
sig = {"kf_w": "*i32", "vf_w": "*i32", "kf_h": "*fp16", "vf_h": "*fp16",
       "q_ptr": "*bf16", "block_tables": "*i32", "stride_bt": "i32", "context_lens": "*i32", "seq_slots": "*i64",
       "k_stage": "*bf16", "v_stage": "*bf16", "stride_ss": "i32", "stride_sh": "i32", "stride_st": "i32",
       "part_o": "*fp32", "part_lse": "*fp32", "qk_scale": "fp32", "window": "i32", "num_splits": "i32",
       "ns_total": "i32", "HKV": "constexpr", "G": "constexpr", "STAGED": "constexpr", "FW": "constexpr",
       "F_KS": "constexpr", "F_VS": "constexpr", "FP8_PREFETCH": "constexpr"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for G, staged, prefetch in ((1, True, True), (4, True, False), (8, False, True)):
    src = GluonASTSource(fp8_decode_kernel, signature=sig,
                         constexprs={"HKV": 8, "G": G, "STAGED": staged, "FW": 2080, "F_KS": 8192, "F_VS": 8192,
                                     "FP8_PREFETCH": prefetch},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    k = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, maxnreg=DEFAULT_MAX_REGISTERS))
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    print(G, k.metadata.shared, "mma.sync.aligned.m16n8k16" in ptx, ".local" in ptx, sass.count("LDG.E.128") >= 8,
          sass.count("F2FP.F16.E4M3.UNPACK_B") >= 64)
"""


@pytest.mark.slow
def test_kernel_module_compiles_for_sm90_without_a_gpu():
    """The Gluon kernel builds for the H200 (sm_90) with Triton's ptxas at its register cap (groups 1, 4
    and 8, with and without the staged tail, with and without the steps' prefetch): every assert_trivial
    layout conversion holds, no shared or local memory, the codes arrive by 128-bit loads and convert two
    an instruction (F2FP.F16.E4M3.UNPACK_B)."""
    words = run_sm90_build(SM90_BUILD)
    plain = ["0", "True", "False", "True", "True"]
    assert words == ["1", *plain, "4", *plain, "8", *plain], words


# -- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("lens", [[64], [4096 + 7], [1000, 64 * 9, 129, 3000]])
def test_gpu_kernel_matches_reference(G, lens):
    """The Gluon kernel's partials against the split reference (float64): batch 1 and 4, lengths on
    and off page boundaries, GQA 1 / 4 / 8, split counts with empty splits."""
    from moekv.ops.gluon.fp8_decode import fp8_decode_partials

    check_kernel_matches_reference(fp8_decode_partials, fp8_decode_split_reference, build, G, lens)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 8])
def test_gpu_prefetch_changes_nothing(G):
    """The steps' prefetch (the next 16 tokens' codes loaded while this step computes) gives the same
    partials bit for bit as none."""
    from moekv.ops.gluon.fp8_decode import fp8_decode_partials

    check_same_partials(fp8_decode_partials, build, G, {"prefetch": DEFAULT_PREFETCH},
                        [{"prefetch": not DEFAULT_PREFETCH}])


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_decode_matches_dense_attention(G):
    """Kernel + reduce against dense attention over fp8_e4m3's own dequantized pages."""
    from moekv.ops.gluon.fp8_decode import fp8_decode_attention

    check_decode_matches_dense(fp8_decode_attention, build, G)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("window", [None, 1, 100, 64 * 5 + 3])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_staged_tail_and_window(G, window):
    """The staged bf16 tail as the launch's extra split, and sliding windows, against dense attention
    over pages + staging."""
    from moekv.ops.gluon.fp8_decode import fp8_decode_attention

    check_staged_decode(fp8_decode_attention, build, G, window)
