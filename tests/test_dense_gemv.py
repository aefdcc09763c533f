"""dense_gemv (decode-size projections in one launch) against F.linear and a float64 oracle.
Without CUDA it runs under TRITON_INTERPRET=1 on CPU tensors (fp32/fp16); the `gpu` test runs the
Mixtral-8x7B attention shapes in bf16 on the device."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_kernels import kernel_modules, triton  # noqa: F401 (before any kernel import)

(dg,) = kernel_modules("moekv.ops.dense_gemv")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(out, x, w, b, tol):
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert ((out.double() - exact).norm() / exact.norm()) < tol
    assert torch.allclose(out.double(), F.linear(x, w, b).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, N, K, bias", [(1, 48, 256, False), (3, 40, 300, True), (4, 17, 1030, False)])
def test_dense_gemv_matches_linear(T, N, K, bias, dtype):
    """N off the 16-row blocks, K off the 512-column blocks (masked tail), with and without bias."""
    g = torch.Generator().manual_seed(T * N + K)
    x = torch.randn(T, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    _check(dg.dense_gemv(x, w, b), x, w, b, 1e-5 if dtype == torch.float32 else 2e-3)


def test_dense_gemv_strided_input_and_checks():
    x = torch.randn(2, 2, 64, device=DEVICE)[:, 1]  # a strided view, as a split qkv would be
    w = torch.randn(32, 64, device=DEVICE)
    _check(dg.dense_gemv(x, w), x, w, None, 1e-5)
    assert dg.dense_gemv(x[:0], w).shape == (0, 32)
    with pytest.raises(ValueError, match="do not match"):
        dg.dense_gemv(x, torch.randn(32, 63, device=DEVICE))
    with pytest.raises(ValueError, match="do not match"):
        dg.dense_gemv(x, w, torch.randn(31, device=DEVICE))
    assert not dg.fits(torch.empty(1, 64), torch.empty(8, 64))  # CPU tensors keep F.linear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("N", [6144, 4096])  # Mixtral-8x7B's qkv and o projections
def test_gpu_dense_gemv_bf16(T, N):
    g = torch.Generator().manual_seed(N + T)
    x = torch.randn(T, 4096, generator=g).bfloat16().cuda()
    w = (torch.randn(N, 4096, generator=g) / 64).bfloat16().cuda()
    assert dg.fits(x, w) == (T <= dg.MAX_TOKENS)
    _check(dg.dense_gemv(x, w), x, w, None, 5e-3)
