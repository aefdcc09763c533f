"""ops/mla_rope_norm.py (MLA's RoPE, kv_a_layernorm and the entry in one launch) against its reference
(reference.mla_rope_norm_ref: the ops layers/mla.py runs off CUDA) and a float64 oracle. Without CUDA
it runs under TRITON_INTERPRET=1 on CPU tensors (fp32 / fp16)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# isort: split

from moekv.ops.reference import mla_rope_cos_sin_ref, mla_rope_norm_ref  # noqa: E402

(mrn,) = kernel_modules("moekv.ops.rms_norm", "moekv.ops.mla_rope_norm")[1:]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rotate64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, interleave: bool):
    """The rotation in float64 from the fp32 angles (the model's: position times inv_freq in fp32, as
    transformers computes them), x [T, n, r] -> [T, n, r] (evens first when interleaved)."""
    ang = (positions.float()[:, None, None] * inv_freq.float()[None, None, :]).double()
    c, s = ang.cos() * scale, ang.sin() * scale
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T, H, nope, R, rope", [(1, 4, 16, 32, 8), (3, 3, 12, 24, 16), (2, 16, 8, 64, 4)])
def test_matches_reference_and_float64(T, H, nope, R, rope, interleave, dtype):
    """Rotated parts equal the reference's (the same roundings; fp32 on a GPU within one rounding, where
    the compiler may fuse a product into the sum) and float64's within the dtype's rounding; the
    normalised latent as RMSNorm's kernel against rms_norm_ref; q_abs's first R columns untouched."""
    g = torch.Generator().manual_seed(T * 100 + H * 10 + rope)
    q = torch.randn(T, H * (nope + rope), generator=g).to(dtype).to(DEVICE)
    kv = (torch.randn(T, R + rope, generator=g) * 2).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype).to(DEVICE)
    positions = torch.tensor([5, 1000, 77][:T], device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope, 2, dtype=torch.float32, device=DEVICE) / rope)
    cos, sin = mla_rope_cos_sin_ref(positions, inv_freq, 0.9, dtype)
    q_abs, entries = mrn.mla_rope_norm(q, kv, cos, sin, weight, 1e-6, H, nope, interleave)
    ref_q, ref_e = mla_rope_norm_ref(q, kv, cos, sin, weight, 1e-6, H, nope, interleave)
    assert q_abs.shape == (T, H, R + rope) and entries.shape == (T, R + rope) and q_abs.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-6
    exact = DEVICE == "cpu" or dtype != torch.float32
    for got, ref in ((q_abs[..., R:], ref_q[..., R:]), (entries[:, R:], ref_e[:, R:])):
        assert torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=tol, atol=tol)
    assert torch.allclose(entries[:, :R].double(), ref_e[:, :R].double(), rtol=tol, atol=tol)
    rot64 = rotate64(torch.cat([q.view(T, H, -1)[..., nope:], kv[:, None, R:]], dim=1), positions, inv_freq, 0.9,
                     interleave)
    got = torch.cat([q_abs[..., R:], entries[:, None, R:]], dim=1).double()
    assert ((got - rot64).norm() / rot64.norm()) < 2 * tol
    c64 = kv[:, :R].double()
    norm64 = c64 * torch.rsqrt(c64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert ((entries[:, :R].double() - norm64).norm() / norm64.norm()) < tol


def test_refuses_mismatched_shapes():
    q, kv = torch.zeros(1, 4 * 24), torch.zeros(1, 40)
    cs = torch.ones(1, 1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        mrn.mla_rope_norm(q, kv, cs, cs, torch.ones(32), 1e-6, 3, 16, True)  # 3 heads of 16 + 8 != 96
    with pytest.raises(ValueError, match="do not fit"):
        mrn.mla_rope_norm(q, kv, cs, cs, torch.ones(32, dtype=torch.float16), 1e-6, 4, 16, True)
