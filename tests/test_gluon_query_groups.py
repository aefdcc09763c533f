"""Query groups beyond the Gluon kernels' 8 (GLM-4.5's 12 query heads a KV head): a fragment-order pool's
decode step runs the kernel once per part of the group (fragment.attend_in_group_parts), each part the
same query heads of every KV head's group with their sinks, and the parts' outputs fill those heads.

The Gluon kernels do not run on the CPU: here the kernel entry is replaced by a stand-in that honours its
contract (q [B, Hkv * g, D] contiguous with g a group the kernels take, the pool's own tables, block
tables and staged tail, sinks [Hq]) and computes the format's reference attention for the heads it is
given; the split must give what attending every head at once gives. decode_kernel='auto' keeps the
Gluon kernels for groups of up to GLUON_MAX_GROUP_PARTS parts."""
from __future__ import annotations

import importlib

import pytest
import torch

from moekv.kvcache.formats.fragment import (
    GLUON_MAX_GROUP_PARTS,
    GLUON_QUERY_GROUPS,
    decode_kernel_for_model,
    query_group_parts,
)
from tests.test_gluon_engine import ATTEND, D, H, P, decode_ctx, filled_pools, tiered_pools

SCALE = D ** -0.5
CTX = ([2 * P + 5, P + 1, 3 * P], [2, 0, 1], [[0, 3, 1], [5, 4, 0], [1, 2, 3]])  # lengths, slots, tables


def test_query_group_parts_are_the_fewest_kernel_groups():
    assert query_group_parts(8) == ((0, 8),)
    assert query_group_parts(12) == ((0, 8), (8, 4))
    assert query_group_parts(16) == ((0, 8), (8, 8))
    assert query_group_parts(6) == ((0, 4), (4, 2))
    assert query_group_parts(24) == ((0, 8), (8, 8), (16, 8))
    assert query_group_parts(7) == ((0, 4), (4, 2), (6, 1))
    for group in range(1, 65):
        parts = query_group_parts(group)
        assert all(size in GLUON_QUERY_GROUPS for _, size in parts)
        assert [o for o, _ in parts] == [sum(s for _, s in parts[:i]) for i in range(len(parts))]  # contiguous
        assert sum(s for _, s in parts) == group
        assert len(parts) == group // 8 + bin(group % 8).count("1")  # the fewest: eights, then binary digits
    with pytest.raises(ValueError, match="at least one head"):
        query_group_parts(0)


def test_auto_keeps_gluon_for_groups_of_at_most_two_parts():
    assert GLUON_MAX_GROUP_PARTS == 2
    # 4, 8, 1, 2 (whole groups); 12 = 8 + 4 (GLM-4.5), 16 = 8 + 8, 6 = 4 + 2
    for heads, kv in ((32, 8), (64, 8), (8, 8), (16, 8), (96, 8), (128, 8), (48, 8)):
        assert decode_kernel_for_model("auto", heads, kv) == "auto", (heads, kv)
    for heads, kv in ((120, 8), (56, 8), (40, 3)):  # 15 = 8 + 4 + 2 + 1, 7 = 4 + 2 + 1, no whole group
        assert decode_kernel_for_model("auto", heads, kv) == "triton", (heads, kv)
    for choice in ("gluon", "triton"):  # an explicit choice stands
        assert decode_kernel_for_model(choice, 120, 8) == choice
        assert decode_kernel_for_model(choice, 96, 8) == choice


def contract_check(cache, ctx, calls):
    """What a Gluon decode entry must be handed, checked (each call's group into calls)."""
    view_tensor = next(iter(cache.tensors[f] for f in ("k_codes", "k_slabs") if f in cache.tensors))

    def check(q, view, block_tables, context_lens, staged, sinks):
        Hkv = cache["k_staging"].shape[1]
        g = q.shape[1] // Hkv
        assert q.dim() == 3 and q.shape[1] == Hkv * g and g in GLUON_QUERY_GROUPS and q.is_contiguous()
        frag = getattr(view, "k_codes", getattr(view, "k_slabs", None))
        assert frag is not None and frag.data_ptr() == view_tensor.data_ptr()  # the pool's tables, not a copy
        assert block_tables is ctx.block_tables and context_lens is ctx.context_lens
        assert staged[0] is cache["k_staging"] and staged[1] is cache["v_staging"] and staged[2] is ctx.seq_slots
        assert sinks is None or (sinks.shape == (q.shape[1],) and sinks.is_contiguous())
        calls.append(g)

    return check


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("group", [8, 12, 16])
@pytest.mark.parametrize("name, residual", [case for case in ATTEND if case[1] in (None, 0, 64)])
def test_split_group_attends_as_all_heads_at_once(monkeypatch, name, residual, group, sinks):
    """A fragment-order pool's decode step at G = 12 (8 + 4) and 16 (8 + 8) calls the kernel once a part
    and gives attention over all heads at once, sinks included (with a 100-token window too); G = 8 is
    one call on q as it is."""
    fmt, cache = filled_pools(name, "gluon", residual=residual)
    ctx = decode_ctx(*CTX)
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(3, group * H, D, generator=gen)
    sink = 2 * torch.randn(group * H, generator=gen) if sinks else None
    kernel = fmt.gluon_kernel
    module, _, entry = kernel.decode.partition(":")
    calls, seen = [], []
    check = contract_check(cache, ctx, calls)

    def fake_entry(q_part, view, block_tables, context_lens, scale, staged=None, sliding_window=None, sinks=None,
                   **options):
        check(q_part, view, block_tables, context_lens, staged, sinks)
        seen.append(q_part)
        assert scale == SCALE and sliding_window == window
        assert set(options) == set(kernel.decode_options(fmt, cache) if kernel.decode_options else {})
        return fmt.attend_reference(q_part, cache, ctx, scale, sliding_window, sinks=sinks)

    monkeypatch.setattr(importlib.import_module(module), entry, fake_entry)
    monkeypatch.setattr(fmt, "gluon_step", lambda q, ctx: True)
    for window in (None, 100):
        calls.clear()
        seen.clear()
        out = fmt.attend(q, cache, ctx, SCALE, window, sinks=sink)
        assert calls == [size for _, size in query_group_parts(group)]
        if group == 8:
            assert seen[0] is q  # one call on q itself
        want = fmt.attend_reference(q, cache, ctx, SCALE, window, sinks=sink)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        if sinks:  # the sinks change the output: a part given another part's sinks would not match
            assert float((want - fmt.attend_reference(q, cache, ctx, SCALE, window)).abs().max()) > 1e-2


@pytest.mark.parametrize("group", [8, 12, 16])
def test_tiered_split_group_adds_each_parts_page_mass(monkeypatch, group):
    """tiered at G = 12 and 16: the Gluon launch once a part, each adding its heads' page mass to the
    accumulator (the mass is a sum over query heads, each from its own softmax): output and mass as
    attending all heads at once, sinks included."""
    from moekv.ops.gluon import tiered_decode

    fmt, cache = tiered_pools("gluon")
    ctx = decode_ctx(*CTX)
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(3, group * H, D, generator=gen)
    sink = 2 * torch.randn(group * H, generator=gen)
    st = cache.state
    calls = []

    def fake_entry(q_part, low, k_fp8, v_fp8, tier, slot, block_tables, context_lens, scale, fp8_fmt=None,
                   staged=None, sliding_window=None, mass_into=None, sinks=None, **launch):
        g = q_part.shape[1] // H
        assert g in GLUON_QUERY_GROUPS and q_part.is_contiguous() and sinks.shape == (H * g,)
        assert k_fp8 is cache["k_fp8"] and tier is st.tier_dev and mass_into is st.mass_dev and fp8_fmt is fmt.hi
        assert block_tables is ctx.block_tables and staged[2] is ctx.seq_slots and scale == SCALE
        calls.append(g)
        # the reference adds q_part's heads' mass of each full page into the same accumulator
        return fmt.attend_reference(q_part, cache, ctx, scale, sliding_window, sinks=sinks), None

    monkeypatch.setattr(tiered_decode, "tiered_decode_attention", fake_entry)
    monkeypatch.setattr(fmt, "use_kernel", lambda q, ctx, cache=None: True)
    st.mass_dev.zero_()
    out = fmt.attend(q, cache, ctx, SCALE, None, sinks=sink)
    assert calls == [size for _, size in query_group_parts(group)]
    mass = st.mass_dev.clone()
    st.mass_dev.zero_()
    want = fmt.attend_reference(q, cache, ctx, SCALE, None, sinks=sink)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert float(mass.sum()) > 1  # full pages were ranked: 3 sequences' pages, each head's share summed
    torch.testing.assert_close(mass, st.mass_dev, rtol=1e-5, atol=1e-5)
