"""The vectorized decode write (one indexed copy, no host sync, so it can be captured in a CUDA
graph; the pages the step fills quantized in one batch from the context's fill lists) stores
exactly what the general staging loop stores."""
from __future__ import annotations

import pytest
import torch

from moekv.context import Context
from moekv.engine.cuda_graphs import decode_fills
from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.base import nonfinite_verdict, raise_nonfinite
from tests.kv_formats import format_options, self_contained_compressed


def decode_ctx(context_lens, slots, block_size, fills_no_page):
    B = len(context_lens)
    pages = max(-(-n // block_size) for n in context_lens)
    return Context(
        positions=torch.tensor([n - 1 for n in context_lens]),
        slot_mapping=torch.zeros(B, dtype=torch.long),  # unused by staged formats
        block_tables=torch.arange(B * pages, dtype=torch.int32).reshape(B, pages),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
        logits_indices=torch.arange(B),
        seq_slots=torch.tensor(slots),
        max_query_len=1,
        fills_no_page=fills_no_page,
    )


@pytest.mark.parametrize("name", self_contained_compressed())
def test_vectorized_decode_write_matches_the_loop(name):
    fmt = get_kv_format(name, torch.float32, **format_options(name, **({"residual": 64} if name == "kivi2" else {})))
    H, P, D = 2, 64, 32
    caches = [fmt.allocate(16, H, P, D, torch.device("cpu"), 4, torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    context_lens, slots = [5, 70, 130], [2, 0, 3]  # none lands on a page boundary
    for _ in range(3):  # a few steps, each appending one token per sequence
        k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
        for cache, vectorized in zip(caches, (False, True)):
            fmt.write(cache, k, v, decode_ctx(context_lens, slots, P, fills_no_page=vectorized))
        context_lens = [n + 1 for n in context_lens]
    for key in caches[0].tensors:
        assert torch.equal(caches[0][key], caches[1][key]), key
    assert caches[1]["k_staging"].abs().sum() > 0  # something was written


def fill_ctx(context_lens, slots, block_size, graph_step=False):
    """decode_ctx with the fill lists the model runner gives a decode step (no fill: fills_no_page)."""
    ctx = decode_ctx(context_lens, slots, block_size, fills_no_page=all(n % block_size for n in context_lens))
    fill_slots, fill_pages = decode_fills(context_lens, slots, ctx.block_tables.tolist(), block_size)
    if fill_slots:
        ctx.fill_slots, ctx.fill_pages = torch.tensor(fill_slots), torch.tensor(fill_pages)
    ctx.graph_step = graph_step
    return ctx


@pytest.mark.parametrize("name", self_contained_compressed())
def test_decode_steps_that_fill_pages_match_the_loop(name):
    """Steps where one, two or no sequences complete a page, in two layers: the loop (no fill lists)
    quantizes each filled page inside write, the vectorized path stages only and quantizes every
    layer's filled pages in one batch after the step (quantize_filled_pages); the pages, staging and
    rings must be identical, and the filled pages must hold something."""
    fmt = get_kv_format(name, torch.float32, **format_options(name))
    H, P, D = 2, 32, 32
    loop_caches = [fmt.allocate(16, H, P, D, torch.device("cpu"), 4, torch.float32) for _ in range(2)]
    vec_caches = [fmt.allocate(16, H, P, D, torch.device("cpu"), 4, torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    context_lens, slots = [30, 62, 29], [2, 0, 3]  # step 2 fills two pages, step 3 one
    filled = 0
    for _ in range(5):
        vec = fill_ctx(context_lens, slots, P)
        for loop_cache, vec_cache in zip(loop_caches, vec_caches):  # the layers of one step
            k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
            fmt.write(loop_cache, k, v,
                      decode_ctx(context_lens, slots, P, fills_no_page=all(n % P for n in context_lens)))
            fmt.write(vec_cache, k, v, vec)
        fmt.quantize_filled_pages(vec_caches, vec)
        filled += 0 if vec.fill_slots is None else len(vec.fill_slots)
        context_lens = [n + 1 for n in context_lens]
    assert filled == 3
    for loop_cache, vec_cache in zip(loop_caches, vec_caches):
        for key in loop_cache.tensors:
            assert torch.equal(loop_cache[key], vec_cache[key]), key
        assert vec_cache["k_pages"].abs().sum() > 0 and vec_cache["v_pages"].abs().sum() > 0


def test_a_graph_step_flags_nonfinite_fills_instead_of_syncing():
    """In a graph step the NaN check cannot raise on the spot: the flag it sets is the step's
    verdict, read after it (PendingStep.wait), and raise_nonfinite clears it; an eager step raises
    at once."""
    fmt = get_kv_format("int4", torch.float32)
    H, P, D = 2, 16, 32
    cache = fmt.allocate(8, H, P, D, torch.device("cpu"), 2, torch.float32)
    k, v = torch.randn(1, H, D), torch.randn(1, H, D)

    def step(n, graph_step):
        ctx = fill_ctx([n], [0], P, graph_step=graph_step)
        fmt.write(cache, k, v, ctx)
        fmt.quantize_filled_pages([cache], ctx)

    step(16, graph_step=True)
    assert not bool(nonfinite_verdict([cache]))  # finite: nothing
    k[0, 1, 3] = float("nan")
    step(32, graph_step=True)
    assert bool(cache.nonfinite) and bool(nonfinite_verdict([cache]))
    with pytest.raises(ValueError, match="non-finite"):
        raise_nonfinite([cache])
    assert not bool(cache.nonfinite)
    with pytest.raises(ValueError, match="non-finite"):
        step(48, graph_step=False)



def chunk_ctx(chunks, starts, slots, tables):
    """A step where sequence b writes chunks[b] tokens from position starts[b] (prefill chunks),
    its pages tables[b]."""
    query_start = [0]
    for n in chunks:
        query_start.append(query_start[-1] + n)
    return Context(
        positions=torch.cat([torch.arange(s, s + n) for s, n in zip(starts, chunks)]),
        slot_mapping=torch.zeros(sum(chunks), dtype=torch.long),  # unused by staged formats
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor([s + n for s, n in zip(starts, chunks)], dtype=torch.int32),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.long),
        seq_slots=torch.tensor(slots),
        max_query_len=max(chunks),
    )


@pytest.mark.parametrize("name", self_contained_compressed())
def test_prefill_chunks_store_what_one_token_at_a_time_stores(name):
    """Prefill chunks that start mid-page, span several whole pages, end on a page boundary or not
    (two sequences per step, their pages quantized in one batch) leave the pages and the newest
    page in staging exactly as writing the same tokens one at a time does."""
    fmt = get_kv_format(name, torch.float32, **format_options(name))
    H, P, D = 2, 32, 32
    plan = [[5, 64], [59, 33], [96, 1], [1, 30]]  # per step: tokens of sequence 0 and 1 (64: two whole pages)
    total = [sum(step[b] for step in plan) for b in range(2)]
    width = -(-max(total) // P)
    tables = [list(range(b * width, (b + 1) * width)) for b in range(2)]
    g = torch.Generator().manual_seed(1)
    k = [torch.randn(n, H, D, generator=g) for n in total]
    v = [torch.randn(n, H, D, generator=g) for n in total]
    chunked, single = (fmt.allocate(2 * width, H, P, D, torch.device("cpu"), 2, torch.float32) for _ in range(2))
    slots, done = [1, 0], [0, 0]
    for step in plan:
        rows = [slice(done[b], done[b] + step[b]) for b in range(2)]
        fmt.write(chunked, torch.cat([k[b][rows[b]] for b in range(2)]), torch.cat([v[b][rows[b]] for b in range(2)]),
                  chunk_ctx(step, done, slots, tables))
        done = [d + n for d, n in zip(done, step)]
        for b in range(2):  # after every step: staging holds the newest page, full or not
            first = (done[b] - 1) // P * P
            for name_, x in (("k_staging", k[b]), ("v_staging", v[b])):
                staged = chunked[name_][slots[b], :, :done[b] - first]
                assert torch.equal(staged, x[first:done[b]].transpose(0, 1).to(staged.dtype)), (b, name_)
    for b in range(2):
        for t in range(total[b]):
            fmt.write(single, k[b][t:t + 1], v[b][t:t + 1], chunk_ctx([1], [t], [slots[b]], [tables[b]]))
    assert {n % P == 0 for n in total} == {True, False}  # the newest page: full in one sequence, not in the other
    for name_ in ("k_pages", "v_pages"):
        assert torch.equal(chunked[name_], single[name_]), name_
        assert chunked[name_].count_nonzero() > 0
    for b in range(2):
        newest = (total[b] - 1) % P + 1  # tokens of the newest page, which attention reads from staging
        for name_ in ("k_staging", "v_staging"):
            assert torch.equal(chunked[name_][slots[b], :, :newest], single[name_][slots[b], :, :newest]), (b, name_)
