"""The tiered decode kernel (moekv/ops/decode/tiered.py): both tiers in one launch, against the float64
reference over the format's own gather, and its per-page attention mass against what the format's
reference path (TieredFormat.attend_reference) accumulates.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_decode_tiered.py
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import DECODE_MODULES, kernel_modules, triton  # noqa: F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

from moekv.context import Context, HostLists  # noqa: E402
from moekv.kvcache.formats.tiered import TIER_FP8, TIER_LOW  # noqa: E402

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
decode_launch, dt = decode["moekv.ops.decode.launch"], decode["moekv.ops.decode.tiered"]
from tests.test_decode_attention import DEVICE, build_cache, reference, slab_format  # noqa: E402


def tiered_cache(lens, hkv, head_dim, block_size, kv_dtype, seed=0, demote_every=2, **options):
    """A tiered cache written through fmt.write, then every `demote_every`-th full page (not the
    first of its sequence) demoted to nuq2 (none for 0), so that both tiers hold pages of each sequence."""
    fmt = slab_format("tiered", kv_dtype, codebook="page", fused_decode=True, **options)
    cache, ctx = build_cache(fmt, lens, hkv, head_dim, block_size, kv_dtype, seed=seed)
    st = cache.state
    for b, n in enumerate(lens):
        for i, page in enumerate(ctx.block_tables[b, :n // block_size].tolist()):
            if demote_every and i % demote_every == 1 and st.tier[page] == TIER_FP8:
                fmt._demote(cache, [page])
    return fmt, cache, ctx


def mirrors_match(cache):
    st = cache.state
    assert st.tier_dev.tolist() == st.tier
    assert st.slot_dev.tolist() == st.fp8_slot


def run_and_compare(fmt, cache, ctx, group, q_dtype=torch.float32, window=None, seed=1, rel=2e-3, mass_rel=1e-4,
                    **launch):
    hkv, head_dim = cache["k_staging"].shape[1], cache["k_staging"].shape[3]
    g = torch.Generator().manual_seed(seed)
    B = ctx.block_tables.shape[0]
    q = torch.randn(B, hkv * group, head_dim, generator=g).to(DEVICE, q_dtype)
    scale = head_dim ** -0.5
    ref = reference(fmt, cache, ctx, q, scale, window)
    st = cache.state
    # the reference path's mass, from zero (it adds to the device accumulator too: folded here)
    st.mass = [0.0] * len(st.mass)
    fmt.attend_reference(q, cache, ctx, scale, window)
    fmt._fold_mass(cache)
    ref_mass = torch.tensor(st.mass, dtype=torch.float64)
    st.mass = [0.0] * len(st.mass)
    out = fmt.attend_kernel(q, cache, ctx, scale, window, **launch)
    fmt._fold_mass(cache)
    mass = torch.tensor(st.mass, dtype=torch.float64)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= rel * (ref.abs().max().item() + 1e-6), f"max error {err:.3g}"
    assert (mass - ref_mass).abs().max().item() <= mass_rel * max(1.0, ref_mass.abs().max().item()), (mass, ref_mass)
    assert not st.mass_pending and st.mass_dev.abs().max().item() == 0
    return out, ref, mass, ref_mass


# (lens, Hkv, G, D, P, splits, BLOCK_N, kv dtype): batch 1 and 3, contexts on and off page
# boundaries, GQA 1 and 4, several tiles per page, more splits than tiles, fp32 and fp16 caches
GRID = [
    ([80], 2, 4, 32, 16, 2, 16, torch.float32),
    ([64, 37, 96], 2, 1, 32, 32, 3, 16, torch.float16),
    ([100, 48, 5], 1, 4, 64, 32, 7, 32, torch.float32),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(GRID)))
@pytest.mark.parametrize("swap_ab", [False, True], ids=["qk", "kq"])
def test_tiered_kernel_matches_reference(case, swap_ab):
    lens, hkv, group, head_dim, block_size, splits, block_n, kv_dtype = GRID[case]
    fmt, cache, ctx = tiered_cache(lens, hkv, head_dim, block_size, kv_dtype, seed=case)
    tiers = [cache.state.tier[p] for b, n in enumerate(lens) for p in ctx.block_tables[b, :n // block_size].tolist()]
    assert TIER_FP8 in tiers and TIER_LOW in tiers
    mirrors_match(cache)
    _, _, mass, _ = run_and_compare(fmt, cache, ctx, group, num_splits=splits, block_n=block_n, swap_ab=swap_ab)
    assert mass.sum() > 0


@pytest.mark.parametrize("separate_tail", [False, True], ids=["last-split", "own-program"])
def test_tiered_tail_in_the_last_split(separate_tail):
    """The staged tail is read by the last split after its pages (num_splits programs per head), its
    values in the planar order of that split's accumulator; separate_tail (its own program, the
    earlier layout) gives the same output and mass."""
    lens, hkv, group, head_dim, block_size, splits, block_n, kv_dtype = GRID[2]
    fmt, cache, ctx = tiered_cache(lens, hkv, head_dim, block_size, kv_dtype, seed=5)
    assert any(n % block_size for n in lens)  # a partly filled page: a tail to read
    run_and_compare(fmt, cache, ctx, group, num_splits=splits, block_n=block_n, separate_tail=separate_tail)
    assert decode_launch.LAST_LAUNCH["grid"] == (len(lens) * hkv, splits + (1 if separate_tail else 0))


def test_tiered_window_16bit_queries_and_pool_pressure():
    """A sliding window; fp16 queries; an FP8 pool too small for the pages, so that writing demotes
    the coldest page and sends pages straight to nuq2; releasing pages resets their mirrors."""
    fmt, cache, ctx = tiered_cache([120, 70], 2, 32, 16, torch.float16, seed=4, demote_every=3,
                                   fp8_pool_fraction=0.2)
    mirrors_match(cache)
    run_and_compare(fmt, cache, ctx, 4, window=37, num_splits=2, block_n=16)
    run_and_compare(fmt, cache, ctx, 4, q_dtype=torch.float16, rel=1e-2, mass_rel=1e-3, num_splits=3, block_n=16)
    # pending kernel mass of a released page is dropped with it
    out = fmt.attend_kernel(torch.randn(2, 8, 32).to(DEVICE), cache, ctx, 32 ** -0.5, None, block_n=16)
    assert out.shape == (2, 8, 32)
    pages = ctx.block_tables[1, :70 // 16].tolist()
    fmt.release_pages(cache, pages)
    mirrors_match(cache)
    assert all(cache.state.mass_dev[p].item() == 0 for p in pages)
    fmt._fold_mass(cache)
    assert all(cache.state.mass[p] == 0 for p in pages)


def test_rerank_folds_kernel_mass():
    """Re-ranking reads the kernel's mass: the hottest page keeps FP8, cold ones drop."""
    fmt, cache, ctx = tiered_cache([160], 1, 32, 16, torch.float32, seed=9, demote_every=0,
                                   tier1_fraction=0.1, fp8_pool_fraction=1.0)
    st = cache.state
    pages = ctx.block_tables[0, :10].tolist()
    assert all(st.tier[p] == TIER_FP8 for p in pages)
    st.mass_dev[pages[4]] = 5.0  # as if the kernel had put all attention on page 4
    st.mass_pending = True
    fmt._rerank(cache, ctx.host_lists())
    assert st.tier[pages[4]] == TIER_FP8 and st.tier[pages[0]] == TIER_FP8 and st.tier[pages[-1]] == TIER_FP8
    assert sum(st.tier[p] == TIER_LOW for p in pages) == 7
    assert fmt.page_mass(cache, pages[4]) == 2.5  # halved after the ranking
    mirrors_match(cache)


def test_decode_read_counters_match_what_the_reference_path_reads():
    """count_decode_reads counts, from the tier map, what each decode row reads: against the bits
    and elements the reference path's gather counts from the slabs it actually reads, in the same
    step; full pages in FP8 against the tier map; rows with more than one query left out."""
    fmt, cache, ctx = tiered_cache([150, 64, 37], 2, 32, 16, torch.float32, seed=5, demote_every=2)
    st = cache.state
    host = ctx.host_lists()
    fmt.count_decode_reads = True
    fmt.reset_read_counters()
    fmt._count_decode_reads(cache, host)
    q = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    fmt.attend_reference(q, cache, ctx, 32 ** -0.5, None)
    assert 0 < fmt.decode_bits_read == fmt.bits_read and fmt.decode_elements_read == fmt.elements_read
    full = [p for b, n in enumerate(host.context_lens) for p in host.block_tables[b][:n // 16]]
    assert fmt.decode_pages == len(full) == 9 + 4 + 2
    assert fmt.decode_fp8_pages == sum(st.tier[p] == TIER_FP8 for p in full)
    assert 0 < fmt.decode_fp8_pages < fmt.decode_pages  # both tiers are read
    assert fmt.measured_decode_bits_per_element == fmt.measured_bits_per_element
    # a step where row 0 runs 5 queries (a prefill chunk): only rows 1 and 2 count
    fmt.reset_read_counters()
    mixed = HostLists(host.context_lens, [0, 5, 6, 7], host.seq_slots, host.block_tables)
    fmt._count_decode_reads(cache, mixed)
    assert fmt.decode_pages == 4 + 2
    # off by default: _count_step counts nothing then
    fmt.count_decode_reads = False
    fmt.reset_read_counters()
    fmt._count_step(cache, host)
    assert fmt.decode_elements_read == 0 and fmt.measured_decode_bits_per_element is None


def test_reference_path_reads_nothing_back_per_sequence(monkeypatch):
    """The reference path's attention mass goes to the device accumulator (folded when the ranking
    reads it): no Tensor.tolist / .item in attend_reference, each one a sync per sequence and layer
    on CUDA. The folded mass is what key_mass gives each page."""
    fmt, cache, ctx = tiered_cache([150, 64, 37], 2, 32, 16, torch.float32, seed=6)
    st = cache.state
    host = ctx.host_lists()
    ctx.host = host
    q = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fmt._fold_mass(cache)
    st.mass = [0.0] * len(st.mass)
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=original, **k: reads.append(1) or _o(t, *a, **k))
    fmt.attend_reference(q, cache, ctx, 32 ** -0.5, None)
    monkeypatch.undo()
    assert reads == [] and st.mass_pending
    fmt._fold_mass(cache)
    for b, n in enumerate(host.context_lens):
        k = fmt.gather(cache, ctx, b, n, "key").double()
        scores = torch.einsum("hd,lhd->hl", q[b].double().view(2, 4, 32).reshape(8, 32),
                              k.repeat_interleave(4, dim=1)) * 32 ** -0.5
        want = scores.softmax(-1).sum(0)[:n // 16 * 16].view(-1, 16).sum(-1)
        got = torch.tensor([st.mass[p] / st.mass_weight for p in host.block_tables[b][:n // 16]], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), b


@pytest.mark.parametrize("after_prompt", [False, True])
def test_rank_after_prompt_leaves_a_prompt_in_progress_alone(after_prompt):
    """rank_after_prompt: a re-ranking demotes the pages of the sequences that decode in the step
    (one query) and leaves those of a sequence in the middle of its prompt in FP8; without it, both."""
    fmt, cache, ctx = tiered_cache([160, 160], 1, 32, 16, torch.float32, seed=7, demote_every=0,
                                   tier1_fraction=0.1, fp8_pool_fraction=1.0, rank_after_prompt=after_prompt)
    st = cache.state
    host = ctx.host_lists()
    tables = [host.block_tables[b][:10] for b in range(2)]
    for table in tables:
        st.mass_dev[table[4]] = 5.0
    st.mass_pending = True
    fmt._rerank(cache, HostLists(host.context_lens, [0, 5, 6], host.seq_slots, host.block_tables))  # row 0: 5 queries
    low = [sum(st.tier[p] == TIER_LOW for p in table) for table in tables]
    assert low == ([0, 7] if after_prompt else [7, 7])
    assert all(st.tier[table[4]] == TIER_FP8 for table in tables)
    mirrors_match(cache)


@pytest.mark.parametrize("window", [0, 8, 100])
def test_rank_window_takes_the_mass_of_the_chunks_last_queries(window):
    """rank_window=N: a prompt chunk's attention mass comes from its last N queries only (all of them
    for 0, or N above the chunk), against the probabilities of those queries in float64."""
    import dataclasses

    fmt, cache, ctx = tiered_cache([150], 2, 32, 16, torch.float32, seed=8, demote_every=2, rank_window=window)
    st = cache.state
    num_q, H, D = 40, 8, 32
    chunk = dataclasses.replace(ctx, query_start_loc=torch.tensor([0, num_q], dtype=torch.int32, device=DEVICE),
                                max_query_len=num_q, host=None)
    q = torch.randn(num_q, H, D, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    fmt._fold_mass(cache)
    st.mass = [0.0] * len(st.mass)
    fmt.attend_reference(q, cache, chunk, D ** -0.5, None)
    fmt._fold_mass(cache)
    k = fmt.gather(cache, chunk, 0, 150, "key").double().repeat_interleave(4, dim=1)  # [L, H, D]
    used = num_q if window == 0 else min(window, num_q)
    q_pos = torch.arange(150 - used, 150)
    scores = torch.einsum("thd,lhd->thl", q[num_q - used:].double(), k) * D ** -0.5
    scores.masked_fill_(torch.arange(150)[None, None, :] > q_pos[:, None, None], float("-inf"))
    want = scores.softmax(-1).sum((0, 1))[:144].view(9, 16).sum(-1)
    pages = chunk.host_lists().block_tables[0][:9]
    got = torch.tensor([st.mass[p] / st.mass_weight for p in pages], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rank_window_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="rank_window"):
            slab_format("tiered", torch.float32, codebook="page", rank_window=bad)


def test_dispatch_cpu_keeps_reference(monkeypatch):
    assert slab_format("tiered").fused_decode is True  # the default since its H200 run
    fmt = slab_format("tiered", torch.float32, codebook="page")
    cache, ctx = build_cache(fmt, [40], 1, 32, 16, torch.float32, device=torch.device("cpu"))  # CPU on any machine
    q = torch.randn(1, 2, 32)
    assert not fmt.use_kernel(q, ctx, cache)
    monkeypatch.setattr(fmt, "attend_kernel", lambda *a, **k: pytest.fail("kernel on CPU"))
    fmt.attend(q, cache, ctx, 32 ** -0.5, None)


def test_replayed_step_mass_matches_eager():
    """A CUDA-graph replay runs attend_kernel's device work (the kernels, the mass added into mass_dev)
    but not its Python (mass_pending = True): after_graph_replay must flag the mass so that the next
    fold credits it as after the eager step. The replay's batch is padded as the graph runner pads it
    (a padding row on a scratch page and slot, unused table entries on the scratch page): the real
    pages get the eager step's mass, and nothing reaches the scratch page's score."""
    fmt, cache, ctx = tiered_cache([80, 37], 2, 32, 16, torch.float32, seed=3)
    st = cache.state
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 32, generator=g).to(DEVICE)
    scale = 32 ** -0.5
    num_blocks = len(st.tier)
    used = set(ctx.block_tables.flatten().tolist())
    scratch = max(set(range(num_blocks)) - used)  # build_cache leaves two pages unused
    scratch_slot = 0  # build_cache's sequences use staging slots 2 and 3

    out = fmt.attend_kernel(q, cache, ctx, scale, None, num_splits=2, block_n=16)
    fmt._fold_mass(cache)
    eager_mass = list(st.mass)
    assert sum(eager_mass) > 0
    st.mass = [0.0] * num_blocks

    width = ctx.block_tables.shape[1] + 2
    tables = torch.full((3, width), scratch, dtype=torch.int32)
    for b, n in enumerate((80, 37)):
        tables[b, :-(-n // 16)] = ctx.block_tables[b, :-(-n // 16)]
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=DEVICE)  # noqa: E731
    padded = Context(positions=t([79, 36, 0], torch.long), slot_mapping=t([0, 0, scratch * 16], torch.long),
                     block_tables=tables.to(DEVICE), context_lens=t([80, 37, 1], torch.int32),
                     query_start_loc=t([0, 1, 2, 3], torch.int32), logits_indices=t([0, 1, 2], torch.long),
                     seq_slots=torch.cat([ctx.seq_slots.cpu(), torch.tensor([scratch_slot])]).to(DEVICE),
                     max_query_len=1, fills_no_page=True, graph_step=True)
    q_pad = torch.cat([q, torch.randn(1, 8, 32, generator=g).to(DEVICE)])
    replayed = fmt.attend_kernel(q_pad, cache, padded, scale, None, num_splits=2, block_n=16)
    st.mass_pending = False  # what a replay leaves: it does not run this line of attend_kernel
    assert st.mass_dev[scratch].item() == 0  # the padding row and unused entries carry no mass
    st.mass_dev[scratch] += 1.0  # and if they did, it must not reach a score
    fmt._fold_mass(cache)
    assert sum(st.mass) == 0, "the fold credited mass nobody flagged"
    fmt.after_graph_replay([cache])
    assert st.mass_pending
    fmt._fold_mass(cache)
    assert torch.allclose(replayed[:2], out, rtol=1e-5, atol=1e-6)
    assert st.mass[scratch] == 0
    assert torch.allclose(torch.tensor(st.mass), torch.tensor(eager_mass), rtol=1e-5, atol=1e-7)
    assert not st.mass_pending and st.mass_dev.abs().max().item() == 0


def tiered_mix(lens, hkv, head_dim, block_size, kv_dtype, seed=0, fp8_every=7):
    """~1/fp8_every of each sequence's full pages (and its first) in FP8, the rest in nuq2."""
    fmt = slab_format("tiered", kv_dtype, codebook="page", fused_decode=True, fp8_pool_fraction=1.0)
    cache, ctx = build_cache(fmt, lens, hkv, head_dim, block_size, kv_dtype, seed=seed)
    for b, n in enumerate(lens):
        for i, page in enumerate(ctx.block_tables[b, :n // block_size].tolist()):
            if i and i % fp8_every != 3 and cache.state.tier[page] == TIER_FP8:
                fmt._demote(cache, [page])
    return fmt, cache, ctx


def test_tiered_mix_small():
    """The GPU test's cache recipe, at interpreter size."""
    fmt, cache, ctx = tiered_mix([150, 90], 2, 32, 16, torch.float32, seed=2, fp8_every=3)
    run_and_compare(fmt, cache, ctx, 4, num_splits=2, block_n=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_n", [64, 32])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["qk", "kq"])
def test_gpu_tiered_realistic(block_n, swap_ab):
    """32 query / 8 KV heads, head_dim 128, pages of 64, long contexts off page boundaries, bf16 queries,
    ~15% of pages in FP8; the engine's path (fmt.attend) takes the kernel."""
    lens = [4096 + 7, 1000, 16384, 129]
    fmt, cache, ctx = tiered_mix(lens, 8, 128, 64, torch.bfloat16, seed=11)
    mirrors_match(cache)
    run_and_compare(fmt, cache, ctx, 4, q_dtype=torch.bfloat16, rel=2e-2, mass_rel=2e-2, block_n=block_n,
                    swap_ab=swap_ab)
    q = torch.randn(len(lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    ref = reference(fmt, cache, ctx, q, 128 ** -0.5, None)
    assert fmt.use_kernel(q, ctx, cache)
    decode_launch.OCCUPANCY.forget(keep=lambda key: key[0] != "tiered")
    out = fmt.attend(q, cache, ctx, 128 ** -0.5, None)
    assert (out.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    # the launcher compiled first and chose the splits that fill whole waves at that occupancy (the
    # kernel under its default cap: 256 tiles in the longest context, many a split)
    cap = decode_launch.register_cap("tiered", 64)
    assert cap and decode_launch.LAST_LAUNCH["max_registers"] == cap
    (per_sm,) = [v[0] for k, v in decode_launch.OCCUPANCY.items() if k[0] == "tiered" and k[-2] == cap]
    assert 1 <= per_sm <= 4, per_sm
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert decode_launch.LAST_LAUNCH["num_splits"] == decode_launch.wave_splits(
        len(lens), 8, ctx.block_tables.shape[1] * 64, 64, sms, per_sm)
    windowed = reference(fmt, cache, ctx, q, 128 ** -0.5, 700)
    out = fmt.attend(q, cache, ctx, 128 ** -0.5, 700)
    assert (out.double() - windowed).abs().max().item() <= 2e-2 * windowed.abs().max().item()


@pytest.mark.parametrize("accumulate", [False, True], ids=["returned", "accumulated"])
@pytest.mark.parametrize("max_pages, tpp, block", [(70, 2, 16), (5, 1, 64)])
def test_reduce_and_mass_kernel_matches_the_formulas(max_pages, tpp, block, accumulate):
    """reduce_and_mass_kernel against both sums written in PyTorch (float64). Outputs: each head's
    splits merged by their log2-sum-exp. Mass: heads' final log2-sum-exp over the splits, tile
    masses, summed over heads and the tiles of each full page; 0 for the partly filled page and past
    the context; more pages than one program's block. Tiles the decode kernel does not write (before
    the window's first tile, past the full pages) hold NaN and must not be read. accumulated: the
    sums are added into a per-page accumulator at the pages' ids (the format's mass_dev), which
    already holds mass from earlier steps."""
    gen = torch.Generator().manual_seed(3)
    B, Hq, ns, D = 3, 6, 5, 16  # 6 heads: padded to 8 in the mass programs
    P = tpp * block
    context = torch.tensor([max_pages * P, 3 * P + 1, 1], dtype=torch.int32)
    window = max_pages * P - 2 * block  # sequence 0 starts at its third tile; the others see everything
    part_lse = torch.randn(B, Hq, ns, generator=gen) * 3
    part_lse[2, :, 1:] = float("-inf")  # empty shares
    part_o = torch.randn(B, Hq, ns, D, generator=gen)
    part_o[2, :, 1:] = 0.0  # what store_partial writes for an empty share
    tile_sum = torch.rand(B, Hq, max_pages * tpp, generator=gen)
    tile_max = torch.randn(B, Hq, max_pages * tpp, generator=gen)
    tile_max[1, :, 1] = float("-inf")  # a tile whose tokens were all masked
    tile_sum[1, :, 1] = 0.0
    unwritten = torch.zeros(B, max_pages * tpp, dtype=torch.bool)
    unwritten[0, :2] = True
    for b, n in enumerate((context // P).tolist()):
        unwritten[b, n * tpp:] = True
    tile_sum[unwritten[:, None, :].expand_as(tile_sum)] = float("nan")
    tile_max[unwritten[:, None, :].expand_as(tile_max)] = float("nan")
    ids = torch.randperm(B * max_pages, generator=gen).reshape(B, max_pages).to(torch.int32)  # page ids
    earlier = torch.rand(B * max_pages, generator=gen)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    mass = dev(earlier.clone()) if accumulate else torch.empty(B, max_pages, device=DEVICE)
    out = torch.empty(B, Hq, D, device=DEVICE)
    block_pages = min(32, dt.mass_block_pages(Hq, tpp))  # more pages than one program's block
    dt.reduce_and_mass_kernel[(B, Hq + triton.cdiv(max_pages, block_pages))](
        dev(part_o), dev(part_lse), out, out.stride(0), out.stride(1),
        dev(tile_sum), dev(tile_max), mass, dev(context), dev(ids), ids.stride(0), window,
        ns, max_pages * tpp, max_pages, Hq, 8, D, tpp, P, block, block_pages, accumulate)
    weights = torch.softmax(part_lse.double() * 0.6931471805599453, dim=-1)  # 2^lse_s / sum
    want_out = (weights[..., None] * part_o.double()).sum(2)
    assert torch.allclose(out.cpu().double(), want_out, rtol=1e-5, atol=1e-6)
    lse = torch.logsumexp(part_lse.double() * 0.6931471805599453, dim=-1) / 0.6931471805599453
    terms = tile_sum.double() * torch.exp2(tile_max.double() - lse[..., None])
    want = terms.masked_fill(unwritten[:, None, :], 0.0).sum(1).reshape(B, max_pages, tpp).sum(-1)
    assert want[0, 0] == 0 and want[1, 3:].abs().max().item() == 0 and want[2].abs().max().item() == 0
    if accumulate:
        want = earlier.double().index_add(0, ids.reshape(-1).long(), want.reshape(-1))
    assert torch.isfinite(mass).all()
    assert torch.allclose(mass.cpu().double(), want, rtol=1e-5, atol=1e-6), (mass, want)
