"""Attention sinks (gpt-oss: a logit per query head joining every softmax as a key of value 0) in
the reference attention and in the decode kernels, where the split-K partials are merged
(ops/decode/common.reduce_head, shared by the Triton paged and tiered kernels and every Gluon one).

Oracles: transformers' GptOss eager attention for the prefill reference; for decode, attention
without the sink rescaled by sigmoid(lse - sink) (the log-sum-exp identity), in float64.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_attention_sinks.py
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import DECODE_MODULES, kernel_modules, triton  # noqa: F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops.reference import causal_attention_ref, decode_attention_ref, gather_kv_ref  # noqa: E402

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
paged = decode["moekv.ops.decode.paged"]
from tests.test_decode_attention import DEVICE, FORMATS, build_cache, slab_format, tolerance  # noqa: E402


def sink_oracle(q, keys, values, scale, window, sinks):
    """Decode attention with sinks by the log-sum-exp identity: out_without_sink * sigmoid(lse - sink)."""
    out = decode_attention_ref(q, keys, values, scale, window)
    lse = []
    for b, k in enumerate(keys):
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("hd,lhd->hl", q[b], k.to(q.dtype).repeat_interleave(group, dim=1)) * scale
        if window is not None:
            scores[:, :max(0, k.shape[0] - window)] = float("-inf")
        lse.append(torch.logsumexp(scores, dim=-1))
    return out * torch.sigmoid(torch.stack(lse) - sinks.to(q.dtype))[..., None]


def gathered(fmt, cache, ctx):
    """Each sequence's K and V [L, Hkv, D] in float64 as the format dequantizes them."""
    keys, values = [], []
    for b, n in enumerate(ctx.context_lens.tolist()):
        if hasattr(fmt, "gather"):
            k, v = fmt.gather(cache, ctx, b, n, "key"), fmt.gather(cache, ctx, b, n, "value")
        else:  # plain pages
            k = gather_kv_ref(cache["k_pages"], ctx.block_tables[b], n)
            v = gather_kv_ref(cache["v_pages"], ctx.block_tables[b], n)
        keys.append(k.double())
        values.append(v.double())
    return keys, values


def test_decode_reference_with_sinks_matches_the_lse_identity():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    keys = [torch.randn(n, 2, 16, generator=g, dtype=torch.float64) for n in (13, 5)]
    values = [torch.randn(n, 2, 16, generator=g, dtype=torch.float64) for n in (13, 5)]
    sinks = torch.randn(8, generator=g, dtype=torch.float64) * 3
    for window in (None, 4):
        ours = decode_attention_ref(q, keys, values, 0.25, window, sinks)
        torch.testing.assert_close(ours, sink_oracle(q, keys, values, 0.25, window, sinks), rtol=1e-12, atol=1e-12)


def test_prefill_reference_with_sinks_matches_transformers():
    """causal_attention_ref with sinks (a chunk of a prompt's last queries, GQA, a sliding window, more
    query rows than one product chunk) against transformers' GptOss eager attention."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    import moekv.ops.reference as reference

    g = torch.Generator().manual_seed(1)
    L, Tq, Hq, Hkv, D = 40, 24, 4, 2, 16
    q = torch.randn(Tq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(L, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(L, Hkv, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64) * 2
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, sinks=sinks, training=False)
    for window in (None, 7):
        q_pos = torch.arange(L - Tq, L)[:, None]
        k_pos = torch.arange(L)[None, :]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        mask = torch.zeros(Tq, L, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        ref, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], mask[None, None], scaling=D ** -0.5)
        for chunk in (512, 5):  # one product, and several chunks of query rows
            old, reference.SINK_QUERY_CHUNK = reference.SINK_QUERY_CHUNK, chunk
            try:
                ours = causal_attention_ref(q, k, v, D ** -0.5, window, sinks)
            finally:
                reference.SINK_QUERY_CHUNK = old
            torch.testing.assert_close(ours, ref[0], rtol=1e-10, atol=1e-10)


def run_sink_case(label, lens, hkv, group, head_dim, block_size, splits, window, block_n=16, seed=0, fmt=None):
    name, options = FORMATS[label]
    fmt = fmt or slab_format(name, torch.bfloat16, **options)
    cache, ctx = build_cache(fmt, lens, hkv, head_dim, block_size, torch.bfloat16, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=g).to(DEVICE)
    sinks = (torch.randn(hkv * group, generator=g) * 3).to(DEVICE)
    scale = head_dim ** -0.5
    out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, window,
                                       fmt.decode_spec(block_size, head_dim), num_splits=splits, block_n=block_n,
                                       sinks=sinks)
    keys, values = gathered(fmt, cache, ctx)
    return out, sink_oracle(q.double(), keys, values, scale, window, sinks.double())


@pytest.mark.parametrize("label", ["bf16", "fp8_e4m3", "int4_g32", "nuq2"])
def test_paged_decode_kernel_with_sinks(label):
    """The Triton paged decode kernel with sinks (several splits, a window, an empty split) against
    the float64 oracle over the format's own dequantized pages."""
    for window, splits in ((None, 3), (11, 4)):
        out, ref = run_sink_case(label, [45, 7], 2, 4, 32, 16, splits, window)
        assert torch.isfinite(out).all()
        err = (out.double() - ref).abs().max().item()
        assert err <= tolerance(label, ref), f"{label} window={window}: max error {err:.3g}"


def test_sinks_change_the_kernel_output():
    """Not vacuous: sinks of 3 sigma move the output far beyond the tolerance above (10x the GPU's, whose
    16-bit MMA operands allow 2e-2 of the output's scale; the CPU's is 1e-5)."""
    out, ref = run_sink_case("bf16", [45], 2, 4, 32, 16, 2, None)
    name, options = FORMATS["bf16"]
    fmt = slab_format(name, torch.bfloat16, **options)
    cache, ctx = build_cache(fmt, [45], 2, 32, 16, torch.bfloat16, seed=0)
    q = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, 32 ** -0.5,
                                         None, fmt.decode_spec(16, 32), num_splits=2, block_n=16)
    assert (plain.double() - ref).abs().max().item() > 10 * tolerance("bf16", ref)


def test_sinks_of_the_wrong_shape_are_refused():
    name, options = FORMATS["bf16"]
    fmt = slab_format(name, torch.bfloat16, **options)
    cache, ctx = build_cache(fmt, [20], 2, 32, 16, torch.bfloat16)
    q = torch.randn(1, 8, 32).to(DEVICE)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq=8\]"):
        paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, 0.1, None,
                                     fmt.decode_spec(16, 32), sinks=torch.zeros(2, device=DEVICE))


def test_tiered_kernel_with_sinks():
    """The tiered kernel (both tiers, its reduce fused with the page mass) with sinks."""
    from tests.test_decode_tiered import tiered_cache

    fmt, cache, ctx = tiered_cache([70, 33], 2, 32, 16, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 32, generator=g).to(DEVICE)
    sinks = (torch.randn(8, generator=g) * 3).to(DEVICE)
    keys, values = gathered(fmt, cache, ctx)
    for window in (None, 20):
        ref = sink_oracle(q.double(), keys, values, 32 ** -0.5, window, sinks.double())
        out = fmt.attend_kernel(q, cache, ctx, 32 ** -0.5, window, sinks=sinks, num_splits=3, block_n=16)
        assert (out.double() - ref).abs().max().item() <= tolerance("nuq2", ref)  # (2e-3 of the scale on the CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon kernels and compiled Triton kernels need CUDA")
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int4", "kivi2", "nuq2", "tiered"])
@pytest.mark.parametrize("head_dim,block_size", [(128, 64), (64, 16)], ids=["gluon-shape", "gpt-oss-shape"])
def test_format_decode_with_sinks_on_gpu(name, head_dim, block_size):
    """Each format's own decode dispatch on the GPU (decode_kernel 'auto': a Gluon kernel where it
    covers the shape, head_dim 128 / pages of 64 on sm_90; the Triton kernel elsewhere) with sinks and
    a window, against the oracle over the format's dequantized pages; 64 query heads over 8 KV heads."""
    options = {"residual": 64} if name == "kivi2" else {"codebook": "page"} if name in ("nuq2", "tiered") else {}
    if name == "tiered":
        options["fused_decode"] = True
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="auto", **options)
    if name == "kivi2":
        block_size = max(block_size, fmt.group)  # its keys are quantized over groups of 32 tokens a page
    lens = [1000, 300, 70]
    cache, ctx = build_cache(fmt, lens, 8, head_dim, block_size, torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(len(lens), 64, head_dim, generator=g).to("cuda", torch.bfloat16)
    sinks = (torch.randn(64, generator=g) * 3).to("cuda", torch.bfloat16)
    keys, values = gathered(fmt, cache, ctx)
    for window in (None,) if name == "tiered" else (None, 128):  # tiered refuses sliding windows
        ref = sink_oracle(q.double(), keys, values, head_dim ** -0.5, window, sinks.double())
        out = fmt.attend(q, cache, ctx, head_dim ** -0.5, window, None, sinks)
        err = (out.double() - ref).abs().max().item()
        assert err <= 3e-2 * ref.abs().max().item(), f"{name} window={window}: max error {err:.3g}"
