"""vq in the paged decode kernel (moekv/ops/decode/vq.py) against the float64 reference.

The reference is dense attention over `VQFormat.gather` (its `dequantize`: codebook rows, outlier
slots, token scales, the keys' channel affine). Caches are written through the format's own
`write` with a calibration fitted in the test (two layers with different codebooks). Without
CUDA the kernel runs under TRITON_INTERPRET=1 (fp32 dots); with CUDA the `gpu` test adds the
benchmark's shape (32/8 heads, head_dim 128, pages of 64) in bf16.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_decode_vq.py
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import DECODE_MODULES, kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from safetensors.torch import save_file  # noqa: E402

from moekv.kvcache.calibration_io import CALIBRATION_FILE  # noqa: E402
from moekv.kvcache.formats.vq import fit_codebook, fit_key_channel_scale  # noqa: E402
from tests.test_decode_attention import build_cache, reference, slab_format  # noqa: E402 (shared recipe, oracle)

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
common, paged = decode["moekv.ops.decode.common"], decode["moekv.ops.decode.paged"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _keys(pages: torch.Tensor) -> torch.Tensor:
    """Keys as the tests write them: two offset / wide channels per head."""
    k = pages.clone()
    k[..., 5] *= 6
    k[..., -3] += 4
    return k


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """(Hkv, D) -> calibration folder with layers 0 and 1 fitted on different random pages."""
    root = tmp_path_factory.mktemp("vqdecode")
    made = {}

    def make(hkv: int, D: int) -> str:
        if (hkv, D) not in made:
            folder = root / f"h{hkv}d{D}"
            folder.mkdir()
            tables = {}
            for layer in (0, 1):
                g = torch.Generator().manual_seed(10 + layer)
                pages = torch.randn(8, hkv, 64, D, generator=g) * (1 + layer)
                keys = _keys(pages)
                scale = fit_key_channel_scale(keys)
                tables[f"vq.layer{layer}.key.chan_scale"] = scale
                tables[f"vq.layer{layer}.key.codebook"] = fit_codebook(keys, "key", scale, 8, 2, 512, g)
                tables[f"vq.layer{layer}.value.codebook"] = fit_codebook(pages, "value", None, 8, 2, 512, g)
            save_file(tables, str(folder / CALIBRATION_FILE))
            made[(hkv, D)] = str(folder)
        return made[(hkv, D)]
    return make


def vq_kv(kv=None, hkv=None, D=None):
    """The shared build_cache's kv(T, g): keys with the outlier channels of `_keys` unless kv(T, hkv, D, g)
    gives the data."""
    if kv is not None:
        return lambda T, g: kv(T, hkv, D, g)
    return lambda T, g: (_keys(torch.randn(T, hkv, D, generator=g)), torch.randn(T, hkv, D, generator=g))


def run_case(calibration, lens, hkv, group, D, P, splits, block_n, window=None, layer=0, seed=0, kv=None,
             q_dtype=torch.float32, kv_dtype=torch.bfloat16, residual=0):
    fmt = slab_format("vq", calibration=calibration(hkv, D), residual=residual)
    cache, ctx = build_cache(fmt, lens, hkv, D, P, kv_dtype, layer=layer, seed=seed, kv=vq_kv(kv, hkv, D))
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hkv * group, D, generator=g).to(DEVICE, q_dtype)
    scale = D ** -0.5
    spec = fmt.decode_spec(P, D)
    out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, window,
                                    spec, num_splits=splits, block_n=block_n)
    return out, reference(fmt, cache, ctx, q, scale, window), fmt


def check(out, ref, q_dtype=torch.float32):
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    # fp16 tiles (u * tok_scale for keys) against the fp32/fp64 reference; on CUDA fp16 MMA operands
    rel = 2e-3 if DEVICE.type == "cpu" and q_dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= rel * (ref.abs().max().item() + 1e-6), f"max error {err:.3g} (ref max {ref.abs().max().item():.3g})"


def test_slots_exist_at_the_test_shapes(calibration):
    """The cases below exercise the outlier corrections: these shapes leave slots in the padding."""
    fmt = slab_format("vq", calibration=calibration(2, 32))
    assert fmt.outlier_slots("key", 32, 32) == 8 and fmt.outlier_slots("value", 32, 32) == 16
    fmt = slab_format("vq", calibration=calibration(1, 128))
    assert fmt.outlier_slots("key", 16, 128) == 32 and fmt.outlier_slots("value", 16, 128) == 32


# (lens, Hkv, G, D, P, splits, BLOCK_N): batch 1 and 3, contexts on and off page boundaries and
# shorter than a page, GQA 1 / 4, tiles inside a page (from its start or not: the fold path) and
# tiles over 2 or 4 pages (the affine in the tile), one or two chunks of 16 slots
GRID = [
    ([64], 2, 4, 32, 32, 1, 16),
    ([96, 40, 1], 2, 4, 32, 32, 3, 64),
    ([150, 64, 7], 2, 1, 64, 16, 2, 32),
    ([75], 1, 4, 128, 16, 2, 16),
    ([70, 33], 1, 1, 128, 16, 1, 64),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(GRID)))
def test_kernel_matches_reference(calibration, case):
    lens, hkv, group, D, P, splits, block_n = GRID[case]
    out, ref, _ = run_case(calibration, lens, hkv, group, D, P, splits, block_n)
    check(out, ref)


def test_layer_tables_and_sliding_window(calibration):
    """Layer 1's codebooks (not layer 0's) and a window that starts inside a tile."""
    out, ref, fmt = run_case(calibration, [83, 16], 2, 4, 32, 32, 2, 16, window=19, layer=1, seed=3)
    check(out, ref)
    assert not torch.equal(fmt.codebook("key", 0), fmt.codebook("key", 1))
    assert len(fmt._on_device) >= 1  # device copies made once per (layer, device)
    # the same cache read with layer 0's tables is not the reference: the tables do reach the kernel
    tables0 = fmt.decode_tables(0, DEVICE)
    fmt2 = slab_format("vq", calibration=calibration(2, 32), residual=0)
    cache, ctx = build_cache(fmt2, [83, 16], 2, 32, 32, torch.bfloat16, layer=1, seed=3, kv=vq_kv(None, 2, 32))
    q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    spec = fmt2.decode_spec(32, 32)
    wrong = common.DecodeSpec(key=spec.key, value=spec.value, staged=True, tables=tables0)
    right = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, 0.2, None, spec,
                                      num_splits=1, block_n=32)
    other = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, 0.2, None, wrong,
                                      num_splits=1, block_n=32)
    check(right, reference(fmt2, cache, ctx, q, 0.2, None))
    assert (right - other).abs().max() > 1e-3


def _structured_kv(T, hkv, D, g):
    """Heavy-tailed keys (outlier slots in use) and values with an all-zero stretch and constant rows."""
    k = _keys(torch.randn(T, hkv, D, generator=g))
    k[T // 3] *= 8
    k.view(-1)[torch.randperm(k.numel(), generator=g)[:12]] = 30.0
    v = torch.randn(T, hkv, D, generator=g)
    v[: T // 4] = 0.0  # zero pages: no slot used (the unused-chunk branch)
    v[T // 4: T // 2] = 0.75
    return k, v


def test_structured_inputs(calibration):
    out, ref, _ = run_case(calibration, [130, 48], 2, 4, 64, 16, 2, 32, kv=_structured_kv, seed=5)
    check(out, ref)
    zeros = lambda T, hkv, D, g: (torch.zeros(T, hkv, D), torch.zeros(T, hkv, D))  # noqa: E731
    out, ref, _ = run_case(calibration, [40], 2, 4, 32, 32, 2, 16, kv=zeros, seed=6)
    check(out, ref)
    assert ref.abs().max() == 0 and out.abs().max() == 0


@pytest.mark.parametrize("R", [48, 256])
def test_residual_window(calibration, R):
    """The newest R tokens from the ring in the tail split (48: from inside a page; 256: every token of
    the shorter sequences), with a sliding window that starts before the ring or inside it."""
    for window in (None, 19, 100):
        out, ref, fmt = run_case(calibration, [150, 64, 7], 2, 4, 32, 32, 2, 32, window=window, seed=8, residual=R)
        assert fmt.decode_spec(32, 32).residual == R
        check(out, ref)


def test_16bit_queries(calibration):
    out, ref, _ = run_case(calibration, [70, 33], 2, 4, 32, 32, 2, 32, q_dtype=torch.float16, seed=7,
                           kv_dtype=torch.float16)
    check(out, ref, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("P,block_n", [(64, 64), (64, 128), (16, 64)])
def test_gpu_realistic_shapes(calibration, P, block_n):
    """The benchmark's heads (32 query / 8 KV, head_dim 128), pages of 64 (no slots) and of 16 (32
    slots per slab, tiles over 4 pages), compiled with inline PTX allowed, bf16 queries."""
    out, ref, _ = run_case(calibration, [4096 + 37, 1000, 64], 8, 4, 128, P, None, block_n, q_dtype=torch.bfloat16,
                           seed=11)
    check(out, ref, torch.bfloat16)
    out, ref, _ = run_case(calibration, [2048], 8, 4, 128, P, None, block_n, window=700, layer=1,
                           q_dtype=torch.bfloat16, seed=12)
    check(out, ref, torch.bfloat16)
