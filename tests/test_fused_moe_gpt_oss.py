"""The fused MoE kernels with gpt-oss's epilogues (expert biases, the clamped SwiGLU) against
ops/reference.clamped_swiglu_moe_ref in float64: the grouped GEMM, the decode GEMV with its down
projection split over I, and the GEMV with the slots folded (interpreter on the CPU).

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_fused_moe_gpt_oss.py
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.ops.reference import clamped_swiglu_moe_ref, fused_moe_ref  # noqa: E402

_, fm = kernel_modules("moekv.ops.dense_gemv", "moekv.ops.fused_moe")
from tests.test_fused_moe import DEVICE, SMALL_GEMM, experts, route  # noqa: E402

ALPHA, LIMIT = 1.702, 0.7  # a limit the random pre-activations cross, so both clamps bind


def biased_case(T, E, k, H, I, seed=0):
    w13, w2 = experts(E, H, I, seed)
    weights, ids = route(T, E, k, "random", seed)
    g = torch.Generator().manual_seed(seed + 2)
    b13 = torch.randn(E, 2 * I, generator=g, dtype=torch.float64).to(DEVICE)
    b2 = torch.randn(E, H, generator=g, dtype=torch.float64).to(DEVICE)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(DEVICE)
    return x, w13, b13, w2, b2, weights, ids


@pytest.mark.parametrize("path,cfg", [("gemm", SMALL_GEMM),
                                      ("gemv", fm.GemvConfig(block_n=16, block_k=16, num_splits=2)),
                                      ("gemv", fm.GemvConfig(block_n=16, block_k=16, fold_slots=True)),
                                      ("gemv", fm.GemvConfig(block_n=16, block_k=16, num_splits=2, row_sums=False))],
                         ids=["gemm", "gemv-split", "gemv-fold", "gemv-tile"])
@pytest.mark.parametrize("H,I", [(40, 24), (32, 64)])  # off and on the block sizes
def test_biases_and_clamped_swiglu_match_the_reference(path, cfg, H, I):
    x, w13, b13, w2, b2, weights, ids = biased_case(5, 6, 3, H, I)
    ref = clamped_swiglu_moe_ref(x, w13, b13, w2, b2, weights.double(), ids, ALPHA, LIMIT)
    out = fm.fused_moe(x.float(), w13.float(), w2.float(), weights, ids, path=path, config=cfg,
                       biases=(b13.float(), b2.float()), clamped_swiglu=(ALPHA, LIMIT))
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    # not vacuous: the plain kernel differs from the reference by far more
    plain = fm.fused_moe(x.float(), w13.float(), w2.float(), weights, ids, path=path, config=cfg)
    assert (plain.double() - fused_moe_ref(x, w13, w2, weights.double(), ids)).abs().max().item() < 1e-4
    assert (plain.double() - ref).abs().max().item() > 1e-1


def test_bias_shapes_are_checked():
    x, w13, b13, w2, b2, weights, ids = biased_case(2, 4, 2, 40, 16)
    with pytest.raises(ValueError, match=r"b13 \[E, 2I\]"):
        fm.fused_moe(x.float(), w13.float(), w2.float(), weights, ids, biases=(b2.float(), b13.float()))
