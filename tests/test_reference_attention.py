"""causal_attention_ref: the per-sequence attention of every format's prefill (and of the
reference decode path), against a float64 softmax; on CUDA, which SDPA backend it runs."""
from __future__ import annotations

import pytest
import torch

from moekv.ops.reference import causal_attention_ref


def _explicit(q, k, v, scale, window):
    """float64 attention of q [Tq, Hq, D] (the last Tq positions) over k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)


@pytest.mark.parametrize("num_q, length, window", [(24, 24, None), (5, 40, None), (17, 33, 8), (1, 50, None)])
def test_causal_attention_matches_float64(num_q, length, window):
    """A whole prompt (plain causal), a chunk after earlier tokens, a sliding window, one query."""
    g = torch.Generator().manual_seed(num_q * 100 + length)
    q = torch.randn(num_q, 8, 16, generator=g)
    k, v = torch.randn(length, 2, 16, generator=g), torch.randn(length, 2, 16, generator=g)
    out = causal_attention_ref(q, k, v, 0.25, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _explicit(q, k, v, 0.25, window), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_q, length", [(1000, 1000), (300, 1000)])
def test_prefill_attention_on_cuda_is_not_cudnn(num_q, length):
    """On CUDA the prefill's SDPA must not run cuDNN's attention, which builds a graph for every
    new sequence length (hundreds of ms a length); and bf16 results stay within bf16 of float64."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(num_q, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(length, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(length, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = causal_attention_ref(q, k, v, 128 ** -0.5)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names, "the profiler saw no CUDA kernel: a weak test"
    assert not any("cudnn" in n.lower() for n in names), names
    torch.testing.assert_close(out.double(), _explicit(q, k, v, 128 ** -0.5, None), rtol=2e-2, atol=2e-2)
