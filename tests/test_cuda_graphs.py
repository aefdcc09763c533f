"""CUDA graphs of the decode step (moekv/engine/cuda_graphs.py).

CPU: the host-side logic — buckets, padding rows on the scratch page and slot, which steps and
formats may take the graph path, the pool's scratch page — and the padded static-buffer step run
eagerly (use_graphs=False), which must give the tokens of the ordinary eager path.
GPU (`gpu` marker): real capture and replay against enforce_eager=True, for every graph-safe format
(tiered: with and without re-ranking; its re-ranking steps replay too).
"""
from __future__ import annotations

import time

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import default_block_size
from moekv.engine.block_manager import BlockManager
from moekv.engine.cuda_graphs import (
    DecodeGraphs,
    bucket_for,
    decode_fills,
    fill_buckets,
    graph_buckets,
    graphs_unsupported_reason,
    pad_decode_inputs,
    step_fits_graph,
)
from moekv.kvcache.formats import compressed_formats, get_kv_format
from moekv.kvcache.formats.tiered import TIER_LOW
from tests.kv_formats import engine_kwargs_for, format_options, self_contained_compressed

CUDA = torch.device("cuda")  # only its .type is read by graphs_unsupported_reason
# every format that replays its decode steps without tables or host-side step state (vq's tables
# and tiered's re-ranking have tests of their own below)
GRAPH_FORMATS = ["bf16", *self_contained_compressed()]
PROMPTS = [[5, 17, 33, 90, 4], [9, 8, 7, 250, 3, 3, 31, 64, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54],
           [100 + i for i in range(41)]]


# -- host-side logic (CPU) ---------------------------------------------------------------------------
def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    buckets = graph_buckets(6)
    assert [bucket_for(b, buckets) for b in range(1, 8)] == [1, 2, 4, 4, 6, 6, None]
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_fill_buckets_and_decode_fills():
    assert fill_buckets(1) == [0, 1]
    assert fill_buckets(6) == [0, 1, 2, 4, 6]
    assert [bucket_for(f, fill_buckets(8)) for f in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, None]
    # pages of 4: the sequences at 8 and 4 tokens complete their pages 1 and 0 (ids 9 and 5)
    slots, pages = decode_fills([8, 5, 4, 3], [2, 0, 1, 3], [[7, 9], [3, 6], [5], [4]], block_size=4)
    assert (slots, pages) == ([2, 1], [9, 5])
    assert decode_fills([1, 2], [0, 1], [[1], [2]], block_size=4) == ([], [])


def test_fill_lists_are_padded_with_the_scratch_slot_and_page():
    graphs = DecodeGraphs(None, torch.device("cpu"), 8, 4, 16, scratch_page=50, scratch_slot=8,
                          use_graphs=False, fill_variants=True)
    assert graphs.fill_bucket(0, 8) == 0 and graphs.fill_bucket(3, 8) == 4 and graphs.fill_bucket(8, 8) == 8
    graphs.load_fills([3, 1, 6], [11, 12, 13], 4)
    ctx = graphs.context(8, 4)
    assert ctx.fill_slots.tolist() == [3, 1, 6, 8] and ctx.fill_pages.tolist() == [11, 12, 13, 50]
    assert not ctx.fills_no_page and ctx.graph_step
    plain = graphs.context(8)
    assert plain.fill_slots is None and plain.fills_no_page
    no_lists = DecodeGraphs(None, torch.device("cpu"), 8, 4, 16, 50, 8, use_graphs=False)
    assert no_lists.fill_bucket(5, 8) == 0  # plain pages: fills need no list, one graph per batch bucket
    # what a server captures at start-up: every (batch bucket, fill bucket) a step can ask for
    assert no_lists.variants() == [(8, 0), (4, 0), (2, 0), (1, 0)]
    assert graphs.variants() == [(8, f) for f in (0, 1, 2, 4, 8)] + [(4, f) for f in (0, 1, 2, 4)] + [
        (2, 0), (2, 1), (2, 2), (1, 0), (1, 1)]
    assert {graphs.fill_bucket(f, b) for b in graphs.buckets for f in range(b + 1)} <= {f for _, f in graphs.variants()}


def test_padding_rows_sit_on_the_scratch_page_and_slot():
    block_size, scratch_page, scratch_slot = 16, 99, 8
    x = pad_decode_inputs([11, 12, 13], [20, 5, 40], [3 * 16 + 4, 7 * 16 + 5, 2 * 16 + 8], [[1, 3], [7], [0, 6, 2]],
                          [21, 6, 41], [0, 5, 2], bucket=4, width=16, scratch_page=scratch_page,
                          scratch_slot=scratch_slot, block_size=block_size)
    assert x.batch == 4
    assert x.input_ids.tolist() == [11, 12, 13, 0]
    assert x.positions.tolist() == [20, 5, 40, 0]
    assert x.slot_mapping.tolist() == [52, 117, 40, scratch_page * block_size]  # offset 0 of the scratch page
    assert x.context_lens.tolist() == [21, 6, 41, 1]
    assert x.seq_slots.tolist() == [0, 5, 2, scratch_slot]
    assert x.block_tables.shape == (4, 16) and x.block_tables.dtype.name == "int32"
    assert x.block_tables[0].tolist() == [1, 3] + [scratch_page] * 14  # unused entries: the scratch page
    assert x.block_tables[3].tolist() == [scratch_page] * 16
    for arr, kind in ((x.input_ids, "int64"), (x.positions, "int64"), (x.slot_mapping, "int64"),
                      (x.seq_slots, "int64"), (x.context_lens, "int32")):
        assert arr.dtype.name == kind
    empty = pad_decode_inputs([], [], [], [], [], [], bucket=2, width=4, scratch_page=7, scratch_slot=3, block_size=4)
    assert empty.context_lens.tolist() == [1, 1] and empty.slot_mapping.tolist() == [28, 28]
    with pytest.raises(ValueError):
        pad_decode_inputs([1, 2], [0, 0], [0, 0], [[0], [1]], [1, 1], [0, 1], bucket=1, width=4, scratch_page=7,
                          scratch_slot=3, block_size=4)
    with pytest.raises(ValueError):  # a table wider than max_pages_per_seq
        pad_decode_inputs([1], [0], [0], [[0, 1, 2]], [1], [0], bucket=1, width=2, scratch_page=7,
                          scratch_slot=3, block_size=4)


def test_which_steps_fit_a_graph():
    bs = 16
    assert step_fits_graph([1, 1, 1], [5, 17, 40], [0, 1, 2], bs, max_batch=4)
    assert not step_fits_graph([1, 3], [5, 17], [0, 3], bs, max_batch=4)  # prefill chunk in the step
    assert not step_fits_graph([7], [7], [6], bs, max_batch=4)  # a prompt
    assert not step_fits_graph([1, 1], [5, 32], [0, 1], bs, max_batch=4)  # the second fills its page
    assert step_fits_graph([1, 1], [5, 32], [0, 1], bs, max_batch=4, fills_ok=True)  # ... which the format can do
    assert not step_fits_graph([1, 3], [5, 32], [0, 3], bs, max_batch=4, fills_ok=True)
    assert not step_fits_graph([1, 1], [5, 6], [0, 0, 1], bs, max_batch=4)  # prompt logits wanted too
    assert not step_fits_graph([1, 1], [5, 6], [0], bs, max_batch=4)  # a sequence that does not sample
    assert not step_fits_graph([1] * 5, [3] * 5, list(range(5)), bs, max_batch=4)  # larger than every bucket
    assert not step_fits_graph([], [], [], bs, max_batch=4)


@pytest.mark.parametrize("name", GRAPH_FORMATS)
def test_graph_safe_formats(name):
    fmt = get_kv_format(name, torch.bfloat16, **format_options(name))
    block_size = default_block_size(name)
    assert fmt.graph_support.replays_decode and fmt.graph_support.replays_fills
    assert fmt.graph_support.lists_fills == (name in compressed_formats())  # paged formats quantize the fills
    assert graphs_unsupported_reason(CUDA, False, fmt, torch.bfloat16, block_size, 32) is None
    assert "enforce_eager" in graphs_unsupported_reason(CUDA, True, fmt, torch.bfloat16, block_size, 32)
    assert "CUDA" in graphs_unsupported_reason(torch.device("cpu"), False, fmt, torch.bfloat16, block_size, 32)
    assert "dtype" in graphs_unsupported_reason(CUDA, False, fmt, torch.float32, block_size, 32)


def test_calibrated_tables_are_graph_safe(tmp_path):
    """Formats whose codebooks live outside the pages (nuq2 calibrated, vq) take the fused kernel
    with them as DecodeSpec.tables (device copies made on the warm-up call, before capture): graphs too."""
    from safetensors.torch import save_file

    from moekv.kvcache.formats.nuq2 import fit_centroids
    from moekv.kvcache.formats.vq import VQFormat

    pages = torch.randn(4, 2, 64, 32, generator=torch.Generator().manual_seed(0))
    save_file({f"nuq2.layer0.{kind}.centroids": fit_centroids(pages, kind) for kind in ("key", "value")},
              str(tmp_path / "kv_calibration.safetensors"))
    nuq2 = get_kv_format("nuq2", torch.bfloat16, calibration=str(tmp_path), codebook="calibrated")
    assert nuq2.calibrated and nuq2.graph_support.replays_decode
    assert nuq2.decode_spec(64, 32) is not None
    assert graphs_unsupported_reason(CUDA, False, nuq2, torch.bfloat16, 64, 32) is None
    assert "CUDA" in graphs_unsupported_reason(torch.device("cpu"), False, nuq2, torch.bfloat16, 64, 32)
    assert VQFormat.graph_support.replays_decode


def test_formats_that_stay_eager():
    fp32 = get_kv_format("fp32")  # graph-safe writes, but no fused kernel for fp32 pages
    assert "fused decode kernel" in graphs_unsupported_reason(CUDA, False, fp32, torch.float16, 16, 32)


def test_tiered_is_graph_safe_where_its_fused_kernel_runs(tmp_path):
    """tiered replays its decode steps where they take its fused kernel (page codebooks, pages of a
    multiple of 16 tokens, a power-of-two head_dim >= 16, fused_decode on); elsewhere its reference
    path syncs with the host, and the runner says why it stays eager."""
    from safetensors.torch import save_file

    from moekv.kvcache.formats.nuq2 import fit_centroids

    tiered = get_kv_format("tiered", torch.bfloat16, codebook="page")
    assert tiered.graph_support.replays_decode
    assert tiered.decode_spec(64, 32) is None  # its own kernel, not decode_attention's
    for block_size, head_dim in ((16, 32), (32, 32), (64, 128), (32, 16)):
        assert graphs_unsupported_reason(CUDA, False, tiered, torch.bfloat16, block_size, head_dim) is None
    assert "dtype" in graphs_unsupported_reason(CUDA, False, tiered, torch.float32, 64, 32)
    for block_size, head_dim in ((8, 32), (64, 48), (64, 8)):
        assert "no fused decode kernel" in graphs_unsupported_reason(CUDA, False, tiered, torch.bfloat16,
                                                                     block_size, head_dim)
    reference = get_kv_format("tiered", torch.bfloat16, codebook="page", fused_decode=False)
    assert "fused_decode=False" in graphs_unsupported_reason(CUDA, False, reference, torch.bfloat16, 64, 32)
    pages = torch.randn(4, 2, 64, 32, generator=torch.Generator().manual_seed(0))
    save_file({f"nuq2.layer0.{kind}.centroids": fit_centroids(pages, kind) for kind in ("key", "value")},
              str(tmp_path / "kv_calibration.safetensors"))
    calibrated = get_kv_format("tiered", torch.bfloat16, calibration=str(tmp_path), codebook="calibrated")
    assert calibrated.lo.calibrated
    assert "calibrated" in graphs_unsupported_reason(CUDA, False, calibrated, torch.bfloat16, 64, 32)


def test_block_manager_never_hands_out_the_scratch_page():
    """The scratch page is id num_blocks: outside the block manager's range, so no table holds it."""
    num_blocks = 6
    bm = BlockManager(num_blocks, 4)

    class Seq:
        def __init__(self):
            self.block_table = []

    seqs = [Seq() for _ in range(4)]
    for round_ in range(3):
        for i, s in enumerate(seqs):
            bm.allocate(s, 4 * (round_ + i + 1))
        assert all(num_blocks not in s.block_table for s in seqs)
        bm.check_invariants(seqs)
        for s in seqs[::2]:
            bm.free(s)
    assert bm.num_blocks == num_blocks


def test_cpu_engine_reserves_a_scratch_page_and_slot_and_stays_eager(mixtral_ckpt):
    llm = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_seqs=4)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    assert runner.graphs is None  # CPU
    assert bm.num_blocks == runner.num_blocks == runner.scratch_page
    assert runner.scratch_slot == 4
    for cache in runner.kv_caches:
        assert cache["k_pages"].shape[0] == runner.num_blocks + 1
    # a memory budget of exactly N pages gives N - 1 pages to hand out: the scratch page is paid from it
    pages = 10  # under the cap of max_num_seqs full-length sequences (16 pages)
    sized = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_seqs=4,
                kv_cache_memory_gb=pages * runner.kv_bytes_per_block / 2**30)
    assert sized.engine.runner.num_blocks == pages - 1
    assert sized.engine.runner.kv_caches[0]["k_pages"].shape[0] == pages
    kivi = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_seqs=3, kv_cache_dtype="fp8_e4m3")
    assert kivi.engine.runner.kv_caches[0]["k_staging"].shape[0] == 4


def _with_emulated_graphs(llm):
    """Route the runner's graph path through the padded static buffers, run eagerly (the CPU has no
    graphs); record each such step's context lengths."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.device, llm.engine.config.scheduler.max_num_seqs,
                          runner.max_pages_per_seq,
                          runner.block_size, runner.scratch_page, runner.scratch_slot, use_graphs=False,
                          fill_variants=runner.kv_format.graph_support.lists_fills,
                          after_forward=runner.quantize_filled_pages)
    calls = []
    run = graphs.run

    def recording_run(input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots, *fills, **kwargs):
        calls.append(list(context_lens))
        return run(input_ids, positions, slot_mapping, block_tables, context_lens, seq_slots, *fills, **kwargs)

    graphs.run = recording_run
    runner.graphs = graphs
    return graphs, calls


@pytest.mark.parametrize("fmt", ["fp32", *self_contained_compressed()])
def test_padded_static_step_matches_eager_on_cpu(hd32_ckpt, fmt):
    """The graph path's padded rows (and padded page fills) must not disturb the real ones: the
    static-buffer step (run eagerly on the CPU) gives the eager path's tokens, takes decode steps
    that fill pages too (quantized from the static fill lists), and leaves every page free."""
    block_size = 16 if fmt == "fp32" else 32
    kwargs = engine_kwargs_for(fmt, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=block_size)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 9, 6)]
    prompts = [{"prompt_token_ids": p[:n]} for p, n in zip(PROMPTS, (5, 23, 30))]
    eager = LLM(hd32_ckpt, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = LLM(hd32_ckpt, **kwargs)
    graphs, calls = _with_emulated_graphs(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert graphs.num_replays == len(calls) > 0
    assert any(n % block_size == 0 for lens in calls for n in lens), "no replayed step filled a page: a weak test"
    assert {len(lens) for lens in calls} >= {1, 2, 3}  # batches 3, 2, 1 padded to buckets 4, 2, 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _record_tiered(llm):
    """Record each re-ranking of layer 0 (its step count and the tier map it leaves) and the step
    count after each replay."""
    runner = llm.engine.runner
    fmt, first = runner.kv_format, runner.kv_caches[0]
    reranks, replayed_at = [], []
    rerank, after = fmt._rerank, fmt.after_graph_replay

    def recording_rerank(cache, host):
        rerank(cache, host)
        if cache is first:
            reranks.append((cache.state.steps, list(cache.state.tier)))

    def recording_after(caches):
        after(caches)
        replayed_at.append(first.state.steps)

    fmt._rerank, fmt.after_graph_replay = recording_rerank, recording_after
    return reranks, replayed_at


def _check_tiered_pool_drained(llm):
    """Every page back in the block manager, in no tier, FP8 slot freed, no mass left on it."""
    from moekv.kvcache.formats.tiered import TIER_NONE

    engine = llm.engine
    engine.runner.release_pages(engine.block_manager.drain_freed())
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for cache in engine.runner.kv_caches:
        st = cache.state
        assert set(st.tier) == {TIER_NONE}
        assert sorted(st.free_fp8) == list(range(st.scratch_fp8))  # every slot but the scratch one
        # pending mass of a released page is dropped with it (if unflagged, it would stay here)
        assert st.mass_dev.abs().max().item() == 0
        engine.runner.kv_format._fold_mass(cache)
        assert not any(st.mass)


@pytest.mark.parametrize("rerank_interval, tier1_fraction", [(4, 0.15), (10**6, 0.15), (10**6, 0.05)])
def test_tiered_padded_static_step_matches_eager_on_cpu(hd32_ckpt, rerank_interval, tier1_fraction):
    """tiered through the graph path (the static-buffer step run eagerly): the eager path's tokens,
    the same re-rankings at the same steps with the same tier maps (re-ranking steps replayed too:
    prepare_graph_step re-ranks before them), the same step counts, and every page and FP8 slot freed.
    Replayed steps fill pages too (their FP8 slots chosen before the step); with the smaller FP8
    pool (tier1_fraction 0.05: 12 slots), choosing them demotes pages."""
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_dtype="tiered", block_size=16,
                  kv_codebook="page", kv_rerank_interval=rerank_interval, kv_tier1_fraction=tier1_fraction)
    lengths = (40, 30, 20) if tier1_fraction > 0.1 else (110, 100, 90)  # (more pages than FP8 slots)
    if tier1_fraction < 0.1:
        kwargs["max_model_len"] = 256
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = LLM(hd32_ckpt, **kwargs)
    eager_reranks, _ = _record_tiered(eager)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = LLM(hd32_ckpt, **kwargs)
    graphs, calls = _with_emulated_graphs(llm)
    reranks, replayed_at = _record_tiered(llm)
    fmt, prepared = llm.engine.runner.kv_format, []
    prepare = fmt._prepare_fills

    def recording_prepare(caches, fill_pages, first_pages):
        low = sum(t == TIER_LOW for t in caches[0].state.tier)
        ok = prepare(caches, fill_pages, first_pages)
        prepared.append((ok, sum(t == TIER_LOW for t in caches[0].state.tier) - low))
        return ok

    fmt._prepare_fills = recording_prepare
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert graphs.num_replays == len(calls) == len(replayed_at) > 20
    assert any(n % 16 == 0 for lens in calls for n in lens), "no replayed step filled a page: a weak test"
    assert prepared and all(ok for ok, _ in prepared)
    if tier1_fraction == 0.05:
        assert any(demoted for _, demoted in prepared), "no replayed fill demoted a page: a weak test"
    if rerank_interval == 4:
        assert any(s % rerank_interval == 0 for s in replayed_at), "no re-ranking step was replayed: a weak test"
    steps = {c.state.steps for e in (eager, llm) for c in e.engine.runner.kv_caches}
    assert len(steps) == 1
    assert [s for s, _ in reranks] == [s for s, _ in eager_reranks] == list(range(rerank_interval, steps.pop() + 1,
                                                                                  rerank_interval))
    assert reranks == eager_reranks
    if rerank_interval == 4:
        assert any(TIER_LOW in tiers for _, tiers in reranks), "no page was demoted: a weak test"
    for e in (eager, llm):
        _check_tiered_pool_drained(e)


@pytest.mark.parametrize("fails_in", ["capture", "replay"])
def test_a_failing_graph_falls_back_to_eager_steps(hd32_ckpt, fails_in):
    """A capture or replay that raises (a host sync inside the step, say) leaves the engine on eager
    steps, with the eager tokens: a capture before a page-filling step (tiered chooses FP8 slots
    after it) as much as one inside the replay."""
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_dtype="tiered", block_size=16,
                  kv_codebook="page")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 15)]
    # prompts of 15 and 31 tokens: the first decode step fills a page in both
    prompts = [{"prompt_token_ids": PROMPTS[2][:n]} for n in (15, 31)]
    want = [o.outputs[0].token_ids for o in LLM(hd32_ckpt, **kwargs).generate(prompts, params)]
    llm = LLM(hd32_ckpt, **kwargs)
    graphs, _ = _with_emulated_graphs(llm)
    graphs.use_graphs = True  # so that the runner captures before a page-filling step

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    if fails_in == "capture":
        graphs.capture = broken
    else:
        graphs.capture = lambda *args: None
        graphs.run = broken
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.engine.runner.graphs is None


def test_graph_path_skips_steps_that_need_prompt_logits_or_observers(mixtral_ckpt):
    llm = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_seqs=4)
    graphs, calls = _with_emulated_graphs(llm)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp)
    assert calls, "decode steps after the prompt still replay (prompt logprobs are done by then)"
    calls.clear()
    attn = llm.engine.runner.model.attention_layers[0]
    attn.hooks.kv_observer = lambda *a: None
    try:
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=6, temperature=0.0))
    finally:
        attn.hooks.kv_observer = None
    assert not calls  # a Python observer inside the step: eager


# -- GPU: capture and replay -------------------------------------------------------------------------
def _tiered_logprob_diffs(ref, out, rerank_interval: int) -> list[float]:
    """|logprob difference| of each greedy token up to the first divergence of each sequence pair;
    without re-ranking a divergence must be a near-tie, and the mean difference must stay < 0.1."""
    diffs = []
    for a, b in zip(ref, out):
        ra, rb = a.outputs[0], b.outputs[0]
        if rerank_interval > 1000:
            ok, where = _first_divergence_is_a_tie(ra.token_ids, ra.logprobs, rb.token_ids, rb.logprobs)
            assert ok, f"tiered without re-ranking: {where}"
        for i, (x, y) in enumerate(zip(ra.token_ids, rb.token_ids)):
            if x != y:
                break
            diffs.append(abs(ra.logprobs[i][x] - rb.logprobs[i][y]))
    assert sum(diffs) / len(diffs) < 0.1, f"mean |logprob difference| {sum(diffs) / len(diffs):.3f} over {len(diffs)}"
    return diffs


def _first_divergence_is_a_tie(a_ids, a_lps, b_ids, b_lps, tol=0.1):
    """Same tokens, or they part where the eager run's two best tokens were within `tol` nats (a
    near tie that padding-dependent GEMM rounding may flip); logprobs agree until then."""
    for i, (x, y) in enumerate(zip(a_ids, b_ids)):
        if x != y:
            top = sorted(a_lps[i].values(), reverse=True)
            return len(top) > 1 and top[0] - top[1] < tol, f"position {i}: {x} vs {y}, eager top2 {top[:2]}"
        if abs(a_lps[i][x] - b_lps[i][y]) > tol:
            return False, f"position {i}: logprob {a_lps[i][x]} vs {b_lps[i][y]}"
    return len(a_ids) == len(b_ids), "lengths"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", GRAPH_FORMATS)
def test_cuda_graphs_match_eager(hd32_ckpt, fmt):
    """Replayed decode steps against enforce_eager=True, with pages of 32 so that replayed steps
    fill pages too (quantized inside the graph for the compressed formats)."""
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_dtype=fmt,
                  kv_codebook="page" if fmt == "nuq2" else "auto", block_size=32)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (40, 30, 20)]
    eager = LLM(hd32_ckpt, enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    ref = eager.generate(prompts, params)
    llm = LLM(hd32_ckpt, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.use_graphs
    out = llm.generate(prompts, params)
    assert llm.engine.runner.graphs is graphs, "the graph path failed and fell back to eager (see the log)"
    assert graphs.num_replays > 20
    assert {bucket for bucket, _ in graphs.graphs} == {4, 2, 1}  # batches 3, 2, 1
    if llm.engine.runner.kv_format.graph_support.lists_fills:
        assert any(fills for _, fills in graphs.graphs), "no replayed step filled a page: a weak test"
    for a, b in zip(ref, out):
        ok, where = _first_divergence_is_a_tie(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                               b.outputs[0].token_ids, b.outputs[0].logprobs)
        assert ok, f"{fmt}: {where}"
    exact = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, out))
    print(f"\n{fmt}: {exact}/3 sequences identical, {graphs.num_replays} replays, buckets {sorted(graphs.graphs)}")
    for e in (eager, llm):
        bm = e.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rerank_interval", [10**6, 8])
def test_tiered_cuda_graphs_match_eager(hd32_ckpt, rerank_interval):
    """tiered replays its decode steps, those that fill pages and re-rank too, with pages of 16 so
    that pages fill and (every 8 steps) move to nuq2. Against enforce_eager=True: the same re-ranking
    steps, step counts and final page state, and tokens and logprobs by the near-tie rule without
    re-ranking. With it, the two runs rank masses computed on differently padded batches, so a page
    near the cut may land in the other tier (FP8 vs 2 bits; test_tiered_fused_decode_matches_reference_in_the_engine
    saw single logprobs part by up to ~0.3 nats for that reason): there the check is the mean
    difference while the tokens agree. Every page, FP8 slot and pending mass is freed."""
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_dtype="tiered",
                  kv_codebook="page", block_size=16, kv_rerank_interval=rerank_interval)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (90, 60, 40)]
    eager = LLM(hd32_ckpt, enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    eager_reranks, _ = _record_tiered(eager)
    ref = eager.generate(prompts, params)
    llm = LLM(hd32_ckpt, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.use_graphs
    reranks, replayed_at = _record_tiered(llm)
    out = llm.generate(prompts, params)
    assert llm.engine.runner.graphs is graphs, "the graph path failed and fell back to eager (see the log)"
    assert graphs.num_replays == len(replayed_at) > 50
    assert {bucket for bucket, _ in graphs.graphs} == {4, 2, 1}  # batches 3, 2, 1
    # page-filling steps replay too (prepare_graph_fills chooses their FP8 slots before the replay)
    assert any(fills for _, fills in graphs.graphs), "no replayed step filled a page: a weak test"
    if rerank_interval == 8:
        assert any(s % rerank_interval == 0 for s in replayed_at), "no re-ranking step was replayed: a weak test"
    steps = {c.state.steps for e in (eager, llm) for c in e.engine.runner.kv_caches}
    assert len(steps) == 1
    assert [s for s, _ in reranks] == [s for s, _ in eager_reranks] == list(range(rerank_interval, steps.pop() + 1,
                                                                                  rerank_interval))
    diffs = _tiered_logprob_diffs(ref, out, rerank_interval)
    if rerank_interval == 8:
        from moekv.kvcache.formats.tiered import TIER_LOW

        assert any(TIER_LOW in tiers for _, tiers in eager_reranks), "no page was demoted: a weak test"
        same_tiers = sum(x == y for x, y in zip(reranks, eager_reranks))
    else:
        same_tiers = len(reranks)
    exact = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, out))
    print(f"\ntiered graphs vs eager (re-rank every {rerank_interval}): {exact}/3 sequences identical, "
          f"{graphs.num_replays} replays, {len(reranks)} re-rankings ({same_tiers} with the eager tier map), "
          f"mean |logprob difference| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.3f} over {len(diffs)} tokens")
    for e in (eager, llm):
        _check_tiered_pool_drained(e)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_captured_at_start_up_serve_every_step(hd32_ckpt):
    """capture_all (what `moekv serve` runs at start-up) leaves no capture for a request to wait for:
    batches 3, 2, 1 with page fills replay without capturing, and give the lazily captured tokens."""
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=4, kv_cache_dtype="nuq2",
                  kv_codebook="page", block_size=32)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 30, 20)]
    lazy = LLM(hd32_ckpt, **kwargs)
    want = [o.outputs[0].token_ids for o in lazy.generate(prompts, params)]
    llm = LLM(hd32_ckpt, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs.capture_all(progress=False) == len(graphs.variants()) == 4 + 3 + 2  # buckets 4, 2, 1
    captures = graphs.num_captures
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert graphs.num_captures == captures and graphs.num_replays > 20
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_batch1_speed(hd32_ckpt):
    """Not an assertion on speed: prints tok/s at batch 1, eager vs graphs."""
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rates = {}
    for eager in (True, False):
        llm = LLM(hd32_ckpt, dtype="bfloat16", device="cuda", max_model_len=256, kv_cache_dtype="bf16",
                  enforce_eager=eager)
        llm.generate(prompt, sp)  # warm-up: compiles, captures
        torch.cuda.synchronize()
        start = time.perf_counter()
        n = len(llm.generate(prompt, sp)[0].outputs[0].token_ids)
        rates["eager" if eager else "graphs"] = n / (time.perf_counter() - start)
    print(f"\nbatch 1, tiny model, bf16 KV: eager {rates['eager']:.0f} tok/s, graphs {rates['graphs']:.0f} tok/s "
          f"({rates['graphs'] / rates['eager']:.2f}x)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rerank_interval", [10**6, 8])
def test_tiered_fused_decode_matches_reference_in_the_engine(hd32_ckpt, monkeypatch, rerank_interval):
    """tiered's decode steps take the fused two-tier kernel by default; both engines here run eagerly
    (test_tiered_cuda_graphs_match_eager checks the graph path against the eager one), so this
    compares the kernel with the reference path. Without re-ranking (every page stays FP8) the
    engine's tokens and logprobs follow the reference path by the graph test's near-tie rule. With
    re-ranking every 8 steps the two paths rank pages by masses computed differently (the kernel's
    exp2 of a bf16 MMA, the reference's fp32 softmax), so a page near the cut may sit in the other
    tier (FP8 vs 2 bits) and single logprobs part by up to ~0.3 nats (first H200 runs: 0.11, 0.22,
    0.29): there the check is the mean difference while the tokens agree (mixed tiers are checked
    exactly, kernel against reference on one cache, in test_decode_tiered.py). Every page is freed."""
    from moekv.kvcache.formats.tiered import TieredFormat

    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_dtype="tiered",
                  kv_codebook="page", block_size=16, enforce_eager=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (90, 60, 40)]
    calls = []
    kernel = TieredFormat.attend_kernel

    def counting(self, *args, **kw):
        calls.append(1)
        return kernel(self, *args, **kw)

    monkeypatch.setattr(TieredFormat, "attend_kernel", counting)
    fused = LLM(hd32_ckpt, **kwargs)
    fused.engine.runner.model.attention_layers[0].hooks.kv_format.rerank_interval = rerank_interval
    out = fused.generate(prompts, params)
    assert calls, "the fused kernel was not used"
    monkeypatch.setattr(TieredFormat, "use_kernel", lambda *a, **k: False)
    ref_llm = LLM(hd32_ckpt, **kwargs)
    ref_llm.engine.runner.model.attention_layers[0].hooks.kv_format.rerank_interval = rerank_interval
    ref = ref_llm.generate(prompts, params)
    diffs = _tiered_logprob_diffs(ref, out, rerank_interval)
    exact = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, out))
    print(f"\ntiered fused vs reference (re-rank every {rerank_interval}): {exact}/3 sequences identical, "
          f"{len(calls)} fused attention calls, "
          f"mean |logprob difference| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.3f} over {len(diffs)} tokens")
    for e in (fused, ref_llm):
        bm = e.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
