"""router_gemv (decode-size router logits in one launch) against F.linear and a float64 oracle.
Without CUDA it runs under TRITON_INTERPRET=1 on CPU tensors (fp32/fp16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

(rg,) = kernel_modules("moekv.ops.router_gemv")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, H", [(1, 8, 256), (3, 60, 300), (2, 16, 1000)])  # E, H off the blocks
def test_router_gemv_matches_linear(T, E, H, dtype):
    g = torch.Generator().manual_seed(T * E + H)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(dtype).to(DEVICE)
    out = rg.router_gemv(x, gate)
    assert out.shape == (T, E) and out.dtype == dtype
    exact = x.double() @ gate.double().T
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((out.double() - exact).norm() / exact.norm()) < tol
    assert torch.allclose(out.double(), F.linear(x, gate).double(), rtol=tol, atol=tol)


def test_router_gemv_shape_checks():
    assert rg.fits(torch.empty(1, 8), torch.empty(8, 8)) and not rg.fits(torch.empty(65, 8), torch.empty(8, 8))
    with pytest.raises(ValueError, match="does not match"):
        rg.router_gemv(torch.randn(1, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, E, H", [(1, 32, 2880), (3, 60, 300)])  # gpt-oss-20b's router; E, H off the blocks
def test_router_gemv_with_logit_bias_matches_linear(T, E, H, dtype):
    """gpt-oss's router logit bias added in the epilogue: F.linear(x, gate, bias) and a float64 oracle."""
    g = torch.Generator().manual_seed(T * E + H)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5).to(dtype).to(DEVICE)
    bias = torch.randn(E, generator=g).to(dtype).to(DEVICE)
    out = rg.router_gemv(x, gate, bias=bias)
    assert out.shape == (T, E) and out.dtype == dtype
    exact = x.double() @ gate.double().T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((out.double() - exact).norm() / exact.norm()) < tol
    assert torch.allclose(out.double(), F.linear(x, gate, bias).double(), rtol=tol, atol=tol)
    unbiased = rg.router_gemv(x, gate)
    assert torch.allclose((out - unbiased).double(), bias.double().expand(T, E), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="one logit per expert"):
        rg.router_gemv(x, gate, bias=bias[:-1])
