"""The one-launch RMSNorm and RoPE kernels against their references (ops/reference.py) and a
float64 oracle. Without CUDA they run under TRITON_INTERPRET=1 on CPU tensors (fp32/fp16)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.ops.reference import add_rms_norm_ref, apply_rotary_ref, rms_norm_ref, rotary_cos_sin_ref  # noqa: E402

rn, ro = kernel_modules("moekv.ops.rms_norm", "moekv.ops.rotary")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, H", [(1, 64), (5, 96), (3, 256)])  # 96: not a power of two
def test_rms_norm_matches_reference(T, H, dtype):
    g = torch.Generator().manual_seed(T * H)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype).to(DEVICE)
    x[0, :7] = 0.0  # zeros and one large row
    if T > 1:
        x[1] *= 100
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    out = rn.rms_norm(x, w, 1e-5)
    ref = rms_norm_ref(x, w, 1e-5)
    assert out.dtype == x.dtype and out.shape == x.shape
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.double(), ref.double(), rtol=tol, atol=tol)
    assert ((out.double() - exact).norm() / exact.norm()) < tol


def test_rms_norm_strided_rows_and_bad_weight():
    x = torch.randn(4, 2, 64, device=DEVICE)[:, 0]  # rows 128 apart
    w = torch.ones(64, device=DEVICE)
    assert torch.allclose(rn.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rn.rms_norm(x, w.half(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, H", [(1, 64), (4, 96)])
def test_add_rms_norm_matches_reference(T, H, dtype):
    g = torch.Generator().manual_seed(7 * T + H)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype).to(DEVICE)
    delta = (torch.randn(T, 2, H, generator=g) * 50).to(dtype).to(DEVICE)[:, 1]  # strided rows, large values
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    total, out = rn.add_rms_norm(x, delta, w, 1e-5)
    ref_total, ref_out = add_rms_norm_ref(x, delta, w, 1e-5)
    assert torch.equal(total, ref_total)  # the residual stream is rounded exactly as torch's add
    s = x.double() + delta.double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.double(), ref_out.double(), rtol=tol, atol=tol)
    assert ((out.double() - exact).norm() / exact.norm()) < 2 * tol
    with pytest.raises(ValueError, match="dtypes must match"):
        rn.add_rms_norm(x, delta.float() if dtype != torch.float32 else delta.half(), w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [16, 32, 128])
def test_rotary_matches_reference(D, dtype):
    g = torch.Generator().manual_seed(D)
    T, Hq, Hkv = 5, 4, 2
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :Hq * D].reshape(T, Hq, D)  # strided views, as the attention layer passes them
    k = qkv[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    positions = torch.tensor([0, 1, 7, 511, 100000], device=DEVICE)
    q_out, k_out = ro.apply_rotary(positions, q, k, 1e6)
    cos, sin = rotary_cos_sin_ref(positions, D, 1e6, torch.float64)
    for x, out in ((q, q_out), (k, k_out)):
        exact = apply_rotary_ref(x.double(), cos, sin)
        ref = apply_rotary_ref(x, *rotary_cos_sin_ref(positions, D, 1e6, dtype))
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        # fp32 angles: at position 1e5 the reference's own fp32 angle is off by ~1e-3 rad too
        assert ((out.double() - exact).norm() / exact.norm()) < (2e-3 if dtype == torch.float32 else 5e-3)
        assert ((out.double() - ref.double())[:4].norm() / ref.double()[:4].norm()) < tol
    assert torch.equal(q_out[0], q[0]) and torch.equal(k_out[0], k[0])  # position 0 is the identity


def test_rotary_refuses_odd_head_dim():
    x = torch.randn(2, 1, 15, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        ro.apply_rotary(torch.arange(2, device=DEVICE), x, x, 1e4)


def _qk_views(T: int, D: int, R: int, dtype, Hq: int = 4, Hkv: int = 2):
    """q [T, Hq, D] and k [T, Hkv, D] as strided views of one fused qkv row, as the attention layers hand them."""
    g = torch.Generator().manual_seed(D + R)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    return qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D, R", [(32, 16), (128, 64), (16, 12), (96, 32)])  # GLM-4.5: 128 with 64 rotated
def test_partial_rotary_matches_reference(D, R, dtype):
    """Partial RoPE: the first R elements of each head rotated at frequencies theta^(-2i/R), the
    other D - R copied bit for bit."""
    T = 5
    q, k = _qk_views(T, D, R, dtype)
    positions = torch.tensor([0, 1, 7, 511, 3000], device=DEVICE)
    q_out, k_out = ro.apply_rotary(positions, q, k, 1e4, R)
    cos, sin = rotary_cos_sin_ref(positions, R, 1e4, torch.float64)
    assert cos.shape == (T, R)
    for x, out in ((q, q_out), (k, k_out)):
        assert out.shape == x.shape
        assert torch.equal(out[..., R:], x[..., R:])  # passed through untouched
        exact = apply_rotary_ref(x.double(), cos, sin)
        assert torch.equal(exact[..., R:], x[..., R:].double())
        tol = 1e-4 if dtype == torch.float32 else 3e-3  # fp32 angles at position 3000: ~1e-5 relative
        assert ((out.double() - exact).norm() / exact.norm()) < tol
        # a full-width rotation differs: the partial one is not the full one in disguise
        full = apply_rotary_ref(x.double(), *rotary_cos_sin_ref(positions, D, 1e4, torch.float64))
        assert ((out.double() - full)[1:].norm() / full[1:].norm()) > 10 * tol


def test_partial_rotary_refuses_bad_rotary_dim():
    x = torch.randn(2, 1, 16, device=DEVICE)
    for bad in (0, 7, 18):
        with pytest.raises(ValueError, match="rotary_dim must be even and in"):
            ro.apply_rotary(torch.arange(2, device=DEVICE), x, x, 1e4, bad)


# gpt-oss-20b's YaRN (factor 32 over 4096 positions, theta 150000, untruncated ramp)
YARN = dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False,
            attention_factor=0.1 * math.log(32.0) + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D, R", [(64, 64), (32, 16)])
def test_yarn_rotary_matches_reference(D, R, dtype):
    """Scaled RoPE (YaRN): the kernel reads the inverse-frequency table and multiplies cos and sin by
    the attention factor. Oracle: float64 cos/sin of the same fp32 angles (the table is the
    specification: yarn_inv_freq, checked against transformers' in test_gpt_oss.py)."""
    from moekv.layers.rotary import RotaryEmbedding
    from moekv.models.model_config import YarnRope

    theta, yarn = 150000.0, YarnRope(**YARN)
    rope = RotaryEmbedding(D, theta, R, yarn)
    inv_freq = rope.inv_freq(torch.device(DEVICE))
    assert inv_freq.shape == (R // 2,) and inv_freq.dtype == torch.float32
    T = 5
    q, k = _qk_views(T, D, R, dtype)
    positions = torch.tensor([0, 1, 7, 511, 5000], device=DEVICE)
    q_out, k_out = ro.apply_rotary(positions, q, k, theta, R, inv_freq, rope.scale)
    angles = (positions.float()[:, None] * inv_freq[None, :]).double()  # the reference's fp32 product
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos() * rope.scale, emb.sin() * rope.scale
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for x, out in ((q, q_out), (k, k_out)):
        exact = apply_rotary_ref(x.double(), cos, sin)
        assert ((out.double() - exact).norm() / exact.norm()) < tol
        ref = apply_rotary_ref(x, *rope.cos_sin(positions, dtype))  # the layer's CPU path
        assert ((out.double() - ref.double()).norm() / exact.norm()) < tol
        # position 0 is the scale alone, not the identity (the unrotated elements pass as they are);
        # plain RoPE at theta is another rotation
        assert torch.allclose(out[0, :, :R].double(), x[0, :, :R].double() * rope.scale, rtol=tol, atol=tol)
        assert torch.equal(out[..., R:], x[..., R:])
        plain = apply_rotary_ref(x.double(), *rotary_cos_sin_ref(positions, R, theta, torch.float64))
        assert ((out.double() - plain)[1:].norm() / plain[1:].norm()) > 10 * tol
    with pytest.raises(ValueError, match="inv_freq must be"):
        ro.apply_rotary(positions, q, k, theta, R, inv_freq.double(), rope.scale)



def test_rotary_refuses_a_scale_without_a_table():
    """A cos/sin scale without an inverse-frequency table: rotary_cos_sin_ref multiplies cos and sin by
    it (the contract apply_rotary's docstring repeats), the kernel's plain branch computed theta's angles
    and dropped it. No layer passes that pair (RotaryEmbedding's scale is 1.0 without YaRN), so the
    kernel refuses it rather than return another rotation than the reference's."""
    T, D = 3, 16
    q, k = _qk_views(T, D, D, torch.float32)
    positions = torch.tensor([0, 3, 9], device=DEVICE)
    with pytest.raises(ValueError, match="scale"):
        ro.apply_rotary(positions, q, k, 1e4, D, None, 0.5)
    q_out, k_out = ro.apply_rotary(positions, q, k, 1e4, D, None, 1.0)  # plain RoPE, as without the arguments
    assert torch.equal(q_out, ro.apply_rotary(positions, q, k, 1e4, D)[0])
