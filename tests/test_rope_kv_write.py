"""The fused RoPE + K/V store (ops/rope_kv_write.py) against the unfused path: the RoPE kernel
(ops/rotary.py, same fp32 expression, so the stored values must be bit-identical), the references
(write_kv_pages_ref, stage_decode_tokens, kivi2's ring, apply_rotary_ref) and the layer wired
both ways. Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors (fp32/fp16)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.context import Context  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.kvcache.formats.interface import LayerKVCache
from moekv.kvcache.formats.paged import stage_decode_tokens  # noqa: E402
from moekv.kvcache.formats.vq import random_calibration  # noqa: E402
from moekv.layers.attention import Attention  # noqa: E402
from moekv.models.model_config import ModelConfig  # noqa: E402
from moekv.ops.reference import apply_rotary_ref, rope_kv_write_ref, rotary_cos_sin_ref, write_kv_pages_ref  # noqa: E402

rkw, ro = kernel_modules("moekv.ops.rope_kv_write", "moekv.ops.rotary")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THETA = 1e4
POISON = 777.0  # every slot the step does not own must keep it


def qkv(T, Hq, Hkv, D, dtype, seed):
    """Strided q, k, v views of one projection, as the attention layer passes them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(DEVICE)
    q, k, v = x.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)


def assert_same(got, want, what=""):
    """Bit-equal under the interpreter; on CUDA the two kernels are compiled apart, so allow the
    one rounding step a different contraction of a*c - b*s into FMAs could give."""
    if DEVICE == "cpu":
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(got.dtype).eps, atol=1e-6, msg=what)


def check_rotation(q_out, q, positions, D, dtype):
    exact = apply_rotary_ref(q.double(), *rotary_cos_sin_ref(positions, D, THETA, torch.float64))
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert ((q_out.double() - exact).norm() / exact.norm()) < tol


# (prefill-like: three sequences' chunks, one crossing a page boundary, P=16) and (decode: T = B)
PREFILL = dict(positions=[0, 1, 2, 3, 4, 14, 15, 16, 17, 40, 41], slots=[48, 49, 50, 51, 52, 94, 95, 16, 17, 104, 105])
DECODE = dict(positions=[7, 33, 0], slots=[7, 2 * 16 + 1, 5 * 16])


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float32, torch.float16)])
@pytest.mark.slow
@pytest.mark.parametrize("D, Hq, Hkv", [(32, 4, 4), (64, 8, 2), (128, 4, 1)])
@pytest.mark.parametrize("step", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_plain_pages_match_the_unfused_write(step, D, Hq, Hkv, dtype, cache_dtype):
    N, P = 8, 16
    positions = torch.tensor(step["positions"], device=DEVICE)
    slots = torch.tensor(step["slots"], device=DEVICE)
    T = len(positions)
    q, k, v = qkv(T, Hq, Hkv, D, dtype, seed=D + T)
    k_pages = torch.full((N, Hkv, P, D), POISON, dtype=cache_dtype, device=DEVICE)
    v_pages = k_pages.clone()
    q_out = rkw.rope_kv_write(positions, q, k, v, THETA, k_pages, v_pages, slots)
    # unfused: the RoPE kernel, then the reference write
    q_rot, k_rot = ro.apply_rotary(positions, q, k, THETA)
    k_exp, v_exp = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    write_kv_pages_ref(k_exp, v_exp, k_rot, v, slots)
    assert q_out.dtype == dtype and q_out.shape == (T, Hq, D) and q_out.is_contiguous()
    assert_same(q_out, q_rot)
    assert_same(k_pages, k_exp)
    assert torch.equal(v_pages, v_exp)
    assert (k_pages == POISON).sum() == (N * P - T) * Hkv * D  # nothing else touched
    check_rotation(q_out, q, positions, D, dtype)
    # the composed reference (model-dtype cos/sin): same slots, rotation within rounding
    k_ref, v_ref = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    q_ref = rope_kv_write_ref(positions, q, k, v, THETA, k_ref, v_ref, slots)
    tol = 1e-5 if dtype == cache_dtype == torch.float32 else 3e-3
    assert torch.allclose(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    assert torch.allclose(k_pages.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(v_pages, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D, Hq, Hkv", [(32, 4, 2), (64, 8, 1)])
@pytest.mark.parametrize("ring", [None, 32])
def test_staging_matches_stage_decode_tokens(D, Hq, Hkv, dtype, ring):
    S, P = 5, 16
    positions = torch.tensor([5, 17, 0, 47], device=DEVICE)
    seq_slots = torch.tensor([4, 0, 2, 1], device=DEVICE)
    B = len(positions)
    q, k, v = qkv(B, Hq, Hkv, D, dtype, seed=D)
    staging_dtype = torch.float16  # what staging_tensors gives an fp16 or fp32 model on CPU tests
    shape = (S, Hkv, P, D)

    def buffers():
        t = {n: torch.full(shape, POISON, dtype=staging_dtype, device=DEVICE) for n in ("k_staging", "v_staging")}
        if ring:
            t.update({n: torch.full((S, Hkv, ring, D), POISON, dtype=staging_dtype, device=DEVICE)
                      for n in ("k_residual", "v_residual")})
        return LayerKVCache(t)

    got, want = buffers(), buffers()
    rings = (got["k_residual"], got["v_residual"]) if ring else (None, None)
    q_out = rkw.rope_kv_write(positions, q, k, v, THETA, got["k_staging"], got["v_staging"], seq_slots, True,
                              *rings)
    q_rot, k_rot = ro.apply_rotary(positions, q, k, THETA)
    ctx = Context(positions=positions, slot_mapping=torch.zeros(B, dtype=torch.long, device=DEVICE),
                  block_tables=torch.zeros(B, 4, dtype=torch.int32, device=DEVICE),
                  context_lens=(positions + 1).int(), query_start_loc=torch.arange(B + 1, device=DEVICE).int(),
                  logits_indices=torch.arange(B, device=DEVICE), seq_slots=seq_slots, max_query_len=1,
                  fills_no_page=True)
    stage_decode_tokens(want, k_rot, v, ctx)
    if ring:  # what KIVI2Format.write adds on a vectorized step
        for name, x in (("k", k_rot), ("v", v)):
            want[f"{name}_residual"][seq_slots, :, positions % ring] = x.to(staging_dtype)
    assert_same(q_out, q_rot)
    for name in want.tensors:
        assert_same(got[name], want[name], name)
    assert (got["k_staging"] == POISON).sum() == (S * P - B) * Hkv * D
    check_rotation(q_out, q, positions, D, dtype)
    ref = buffers()
    rope_kv_write_ref(positions, q, k, v, THETA, ref["k_staging"], ref["v_staging"], seq_slots, True,
                      *((ref["k_residual"], ref["v_residual"]) if ring else (None, None)))
    for name in ref.tensors:
        assert torch.allclose(got[name].float(), ref[name].float(), rtol=3e-3, atol=3e-3), name


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("D, R", [(32, 16), (128, 64)])  # GLM-4.5: head_dim 128, 64 rotated
def test_partial_rope_pages_and_staging_match_the_unfused_path(D, R, dtype, cache_dtype):
    """Partial RoPE (rotary_dim R < D) through both destinations: the same q and stored k, v as the
    partial RoPE kernel followed by the reference stores; the unrotated elements stored as they are."""
    Hq, Hkv, N, P = 4, 2, 8, 16
    positions = torch.tensor(PREFILL["positions"], device=DEVICE)
    slots = torch.tensor(PREFILL["slots"], device=DEVICE)
    T = len(positions)
    q, k, v = qkv(T, Hq, Hkv, D, dtype, seed=D + R)
    k_pages = torch.full((N, Hkv, P, D), POISON, dtype=cache_dtype, device=DEVICE)
    v_pages = k_pages.clone()
    q_out = rkw.rope_kv_write(positions, q, k, v, THETA, k_pages, v_pages, slots, rotary_dim=R)
    q_rot, k_rot = ro.apply_rotary(positions, q, k, THETA, R)
    k_exp, v_exp = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    write_kv_pages_ref(k_exp, v_exp, k_rot, v, slots)
    assert_same(q_out, q_rot)
    assert_same(k_pages, k_exp)
    assert torch.equal(v_pages, v_exp)
    assert torch.equal(q_out[..., R:], q[..., R:])
    pages, offsets = slots // P, slots % P
    assert torch.equal(k_pages[pages, :, offsets, R:], k[..., R:].to(cache_dtype))
    exact = apply_rotary_ref(q.double(), *rotary_cos_sin_ref(positions, R, THETA, torch.float64))
    assert ((q_out.double() - exact).norm() / exact.norm()) < (1e-5 if dtype == torch.float32 else 3e-3)
    k_ref, v_ref = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    q_ref = rope_kv_write_ref(positions, q, k, v, THETA, k_ref, v_ref, slots, rotary_dim=R)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert torch.allclose(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    assert torch.allclose(k_pages.float(), k_ref.float(), rtol=tol, atol=tol)
    # staged, with a residual ring: one token per sequence
    S, ring = 5, 32
    dpos = torch.tensor([5, 17, 0, 47], device=DEVICE)
    seq_slots = torch.tensor([4, 0, 2, 1], device=DEVICE)
    q, k, v = qkv(len(dpos), Hq, Hkv, D, dtype, seed=D * R)
    got = [torch.full((S, Hkv, n, D), POISON, dtype=cache_dtype, device=DEVICE) for n in (P, P, ring, ring)]
    want = [x.clone() for x in got]
    q_out = rkw.rope_kv_write(dpos, q, k, v, THETA, got[0], got[1], seq_slots, True, got[2], got[3], rotary_dim=R)
    q_rot, k_rot = ro.apply_rotary(dpos, q, k, THETA, R)
    for cache, x in zip(want, (k_rot, v, k_rot, v)):
        cache[seq_slots, :, dpos % cache.shape[2]] = x.to(cache_dtype)
    assert_same(q_out, q_rot)
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("step", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_yarn_pages_match_the_unfused_path(step, dtype, cache_dtype):
    """Scaled RoPE (gpt-oss's YaRN: a table of inverse frequencies, cos and sin times the attention
    factor): the same q and stored k, v as the RoPE kernel with that table followed by the reference
    store, and within the model dtype's rounding of the reference (rope_kv_write_ref)."""
    from moekv.layers.rotary import RotaryEmbedding
    from moekv.models.model_config import YarnRope

    D, Hq, Hkv, N, P, theta = 64, 8, 2, 8, 16, 150000.0
    rope = RotaryEmbedding(D, theta, yarn=YarnRope(factor=32.0, original_max_position_embeddings=4096,
                                                  beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                  attention_factor=1.35))
    inv_freq = rope.inv_freq(torch.device(DEVICE))
    positions = torch.tensor(step["positions"], device=DEVICE)
    slots = torch.tensor(step["slots"], device=DEVICE)
    T = len(positions)
    q, k, v = qkv(T, Hq, Hkv, D, dtype, seed=T)
    k_pages = torch.full((N, Hkv, P, D), POISON, dtype=cache_dtype, device=DEVICE)
    v_pages = k_pages.clone()
    q_out = rkw.rope_kv_write(positions, q, k, v, theta, k_pages, v_pages, slots, inv_freq=inv_freq,
                              scale=rope.scale)
    q_rot, k_rot = ro.apply_rotary(positions, q, k, theta, D, inv_freq, rope.scale)
    k_exp, v_exp = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    write_kv_pages_ref(k_exp, v_exp, k_rot, v, slots)
    assert_same(q_out, q_rot)
    assert_same(k_pages, k_exp)
    assert torch.equal(v_pages, v_exp)
    k_ref, v_ref = torch.full_like(k_pages, POISON), torch.full_like(v_pages, POISON)
    q_ref = rope_kv_write_ref(positions, q, k, v, theta, k_ref, v_ref, slots, inv_freq=inv_freq, scale=rope.scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert torch.allclose(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    assert torch.allclose(k_pages.float(), k_ref.float(), rtol=tol, atol=tol)
    plain = rope_kv_write_ref(positions, q, k, v, theta, k_ref.clone(), v_ref.clone(), slots)
    assert not torch.allclose(q_out.float(), plain.float(), rtol=10 * tol, atol=10 * tol)  # the table is read


def test_bad_shapes_are_refused():
    q, k, v = qkv(2, 2, 1, 32, torch.float32, 0)
    pos, idx = torch.arange(2, device=DEVICE), torch.arange(2, device=DEVICE)
    pages = torch.zeros(4, 2, 16, 32, device=DEVICE)  # two KV heads, k has one
    with pytest.raises(ValueError, match="KV heads"):
        rkw.rope_kv_write(pos, q, k, v, THETA, pages, pages.clone(), idx)
    pages = torch.zeros(4, 1, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="staged"):
        rkw.rope_kv_write(pos, q, k, v, THETA, pages, pages.clone(), idx, False, pages, pages.clone())
    q_empty = rkw.rope_kv_write(pos[:0], q[:0], k[:0], v[:0], THETA, pages, pages.clone(), idx[:0])
    assert q_empty.shape == (0, 2, 32)


# -- the layer: which formats take the fused path, and the same results either way ---------------

def decode_ctx(context_lens, slots, block_size, fills_no_page=True):
    B = len(context_lens)
    pages = max(-(-n // block_size) for n in context_lens)
    tables = torch.arange(B * pages, dtype=torch.int32).reshape(B, pages)
    pos = torch.tensor([n - 1 for n in context_lens])
    return Context(positions=pos.to(DEVICE),
                   slot_mapping=(tables[torch.arange(B), pos // block_size].long() * block_size
                                 + pos % block_size).to(DEVICE),
                   block_tables=tables.to(DEVICE),
                   context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
                   query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=DEVICE),
                   logits_indices=torch.arange(B, device=DEVICE), seq_slots=torch.tensor(slots, device=DEVICE),
                   max_query_len=1, fills_no_page=fills_no_page)


def prefill_ctx(chunks, block_size, pages_per_seq=4):
    """chunks: (first position, tokens) per sequence; sequence b owns pages b*pages_per_seq + ..."""
    pos, slots, ends = [], [], []
    tables = torch.arange(len(chunks) * pages_per_seq, dtype=torch.int32).reshape(len(chunks), pages_per_seq)
    tables = tables.flip(1)  # pages out of order
    for b, (first, n) in enumerate(chunks):
        p = torch.arange(first, first + n)
        pos.append(p)
        slots.append(tables[b, p // block_size].long() * block_size + p % block_size)
        ends.append(first + n)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).int()
    return Context(positions=torch.cat(pos).to(DEVICE), slot_mapping=torch.cat(slots).to(DEVICE),
                   block_tables=tables.to(DEVICE), context_lens=torch.tensor(ends, dtype=torch.int32, device=DEVICE),
                   query_start_loc=starts.to(DEVICE), logits_indices=starts[1:].long().to(DEVICE) - 1,
                   seq_slots=torch.arange(len(chunks), device=DEVICE), max_query_len=max(n for _, n in chunks))


def test_which_formats_fuse(tmp_path):
    dev, P = torch.device(DEVICE), 32
    dec = decode_ctx([5, 40], [1, 0], P)
    k = torch.zeros(2, 2, 32, device=DEVICE)
    plain = get_kv_format("fp16")
    t = plain.fused_rope_write_target(plain.allocate(4, 2, P, 32, dev, 2, torch.float16), k, dec)
    assert t is not None and not t.staged and t.index is dec.slot_mapping
    for name in ("int4", "fp8_e4m3", "nuq2"):
        fmt = get_kv_format(name, torch.float16, **({"residual": 0} if name == "nuq2" else {}))
        cache = fmt.allocate(4, 2, P, 32, dev, 2, torch.float16)
        t = fmt.fused_rope_write_target(cache, k, dec)
        assert t.staged and t.k_dest is cache["k_staging"] and t.index is dec.seq_slots and t.k_ring is None, name
        assert fmt.fused_rope_write_target(cache, k, decode_ctx([5, 40], [1, 0], P, fills_no_page=False)) is None
        assert fmt.fused_rope_write_target(cache, torch.zeros(3, 2, 32, device=DEVICE),
                                           prefill_ctx([(0, 3)], P)) is None
    for name, options in (("kivi2", {}), ("nuq2", {}), ("vq", {"calibration": random_calibration(tmp_path, 2, 32)})):
        windowed = get_kv_format(name, torch.float16, residual=64, **options)  # a residual window: its ring too
        cache = windowed.allocate(4, 2, P, 32, dev, 2, torch.float16)
        t = windowed.fused_rope_write_target(cache, k, dec)
        assert t.staged and t.k_ring is cache["k_residual"] and t.v_ring is cache["v_residual"], name
    kivi0 = get_kv_format("kivi2", torch.float16, residual=0)
    assert kivi0.fused_rope_write_target(kivi0.allocate(4, 2, P, 32, dev, 2, torch.float16), k, dec).k_ring is None
    tiered = get_kv_format("tiered", torch.float16)  # an eager step needs its write (counts steps, re-ranks)
    cache = tiered.allocate(4, 2, P, 32, dev, 2, torch.float16)
    assert tiered.fused_rope_write_target(cache, k, dec) is None
    dec.graph_step = True  # a CUDA-graph step: its write would only stage
    t = tiered.fused_rope_write_target(cache, k, dec)
    assert t.staged and t.k_dest is cache["k_staging"] and t.index is dec.seq_slots and t.k_ring is None
    dec.fills_no_page = False
    assert tiered.fused_rope_write_target(cache, k, dec) is None


def make_attention(dtype, head_dim=32, num_heads=4, num_kv_heads=2, seed=0, rotary_dim=0, yarn=False):
    """yarn: gpt-oss's scaled RoPE (factor 32 over 4096 positions)."""
    from moekv.models.model_config import YarnRope

    scaled = YarnRope(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                      truncate=False, attention_factor=1.35) if yarn else None
    cfg = ModelConfig(architecture="test", vocab_size=8, hidden_size=64, num_layers=1, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=THETA,
                      max_position_embeddings=4096, num_experts=1, top_k=1, moe_intermediate_size=8,
                      norm_topk_prob=False, rotary_dim=rotary_dim, yarn=scaled)
    attn = Attention(cfg, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return attn.to(dtype).to(DEVICE)


def run_both_ways(fmt_name, dtype, steps, P, observer=False, monkeypatch=None, rotary_dim=0, yarn=False):
    """Run the same steps through the layer fused and unfused; return (outputs, caches, observed k) per way.
    rotary_dim: partial RoPE over that many of the head's 32 elements (0: all)."""
    results, calls = [], []
    if monkeypatch is not None:  # count the fused launches (the layer imports the launcher at each call)
        launch = rkw.rope_kv_write
        monkeypatch.setattr(rkw, "rope_kv_write", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    for fuse in (True, False):
        attn = make_attention(dtype, rotary_dim=rotary_dim, yarn=yarn)
        attn.hooks.fuse_rope_write = fuse
        fmt = get_kv_format(fmt_name, dtype, **({"residual": 32} if fmt_name == "kivi2" else {}))
        attn.hooks.kv_format, attn.hooks.kv_cache = fmt, fmt.allocate(16, 2, P, 32, torch.device(DEVICE), 4, dtype)
        seen = []
        if observer:
            attn.hooks.kv_observer = lambda layer, k, v: seen.append(k)
        g = torch.Generator().manual_seed(1)
        outs = [attn(torch.randn(ctx.num_tokens, 64, generator=g).to(dtype).to(DEVICE), ctx) for ctx in steps]
        results.append((outs, attn.kv_cache.tensors, seen))
        if monkeypatch is not None:
            assert len(calls) == (0 if observer or not fuse else len(steps)), (fuse, len(calls))
            calls.clear()
    return results


@pytest.mark.parametrize("fmt_name, dtype, rotary_dim, yarn", [
    ("fp32", torch.float32, 0, False), ("fp16", torch.float16, 0, False), ("int4", torch.float16, 0, False),
    ("kivi2", torch.float16, 0, False), ("fp32", torch.float32, 16, False), ("kivi2", torch.float16, 16, False),
    ("fp32", torch.float32, 0, True), ("fp16", torch.float16, 0, True), ("int4", torch.float16, 0, True)])
def test_layer_fused_matches_unfused(fmt_name, dtype, rotary_dim, yarn, monkeypatch):
    """rotary_dim 16 of 32: partial RoPE (GLM-4.5) through both paths; yarn: gpt-oss's scaled RoPE."""
    P = 32
    if fmt_name.startswith("fp"):
        steps = [prefill_ctx([(0, 5), (30, 4)], P), decode_ctx([6, 35], [0, 1], P)]
    else:  # the staged formats fuse decode steps that fill no page
        steps = [decode_ctx([3, 20, 9], [2, 0, 3], P), decode_ctx([4, 21, 10], [2, 0, 3], P)]
    (out_f, cache_f, _), (out_u, cache_u, _) = run_both_ways(fmt_name, dtype, steps, P, monkeypatch=monkeypatch,
                                                             rotary_dim=rotary_dim, yarn=yarn)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # the CPU unfused path rotates with model-dtype cos/sin
    for a, b in zip(out_f, out_u):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    for name in cache_u:
        assert torch.allclose(cache_f[name].float(), cache_u[name].float(), rtol=5e-3, atol=5e-3), name
    written = "k_pages" if fmt_name.startswith("fp") else "k_staging"
    assert cache_f[written].float().abs().sum() > 0


def test_observer_keeps_the_unfused_path(monkeypatch):
    P = 32
    (_, _, seen_f), (_, _, seen_u) = run_both_ways("fp32", torch.float32, [decode_ctx([6, 35], [0, 1], P)], P,
                                                   observer=True, monkeypatch=monkeypatch)
    assert len(seen_f) == len(seen_u) == 1 and torch.equal(seen_f[0], seen_u[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rotary_dim, yarn", [(0, False), (16, False), (0, True)])  # 16 of 32: GLM-4.5; gpt-oss
@pytest.mark.parametrize("fmt_name", ["bf16", "int4", "fp8_e4m3", "kivi2"])
def test_layer_fused_matches_unfused_cuda_bf16(fmt_name, rotary_dim, yarn, monkeypatch):
    """On CUDA both paths rotate with the same fp32 expression: the caches must agree to the bit
    (k allowed one bf16 rounding step, in case the compiler contracts the products differently)."""
    P = 32
    steps = [decode_ctx([3, 20, 9], [2, 0, 3], P), decode_ctx([4, 21, 10], [2, 0, 3], P)]
    if fmt_name == "bf16":
        steps = [prefill_ctx([(0, 5), (30, 4), (64, 17)], P)] + steps
    (out_f, cache_f, _), (out_u, cache_u, _) = run_both_ways(fmt_name, torch.bfloat16, steps, P,
                                                             monkeypatch=monkeypatch, rotary_dim=rotary_dim,
                                                             yarn=yarn)
    for a, b in zip(out_f, out_u):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for name in cache_u:
        if name.startswith("v") or cache_u[name].dtype == torch.uint8:
            assert torch.equal(cache_f[name], cache_u[name]), name
        else:
            torch.testing.assert_close(cache_f[name], cache_u[name], rtol=2 ** -7, atol=1e-6)
            print(f"{fmt_name} {name}: {(cache_f[name] != cache_u[name]).sum().item()} elements differ")


def test_refuses_a_scale_without_a_table():
    """rope_kv_write_ref multiplies cos and sin by `scale` with or without a table; the kernel's plain
    branch dropped it, so a scale without a table is refused (no layer passes one: scale is 1.0
    without YaRN) rather than stored as another rotation than the reference's."""
    q, k, v = qkv(2, 4, 2, 16, torch.float32, 5)
    pages = torch.zeros(2, 2, 4, 16, device=DEVICE)
    positions, slots = torch.tensor([1, 6], device=DEVICE), torch.tensor([1, 6], device=DEVICE)
    with pytest.raises(ValueError, match="scale"):
        rkw.rope_kv_write(positions, q, k, v, THETA, pages, pages.clone(), slots, scale=0.5)
