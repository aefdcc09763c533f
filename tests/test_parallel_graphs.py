"""Decode steps replayed from graphs with several ranks (engine/cuda_graphs.py, engine/parallel.py).

CPU (gloo, float32, tiny Mixtral): the shape-static expert dispatch that a captured step uses gives the
dynamic dispatch's output and byte counts, and the one-process output (2 processes); an engine over 2
ranks on the emulated graph path (MOEKV_EMULATE_CUDA_GRAPHS=1: every rank takes the graph path, each
"replay" being the same static-buffer step function run eagerly, which is what a CUDA graph captures)
gives the one-process tokens and logprobs, every rank replays the variants rank 0 picked in the same
order, the byte counters equal an eager 2-rank engine's, and a rank that fails a replayed step fails
its requests and frees their pages; tiered (host-side work on every rank before each replay) replays
its page-filling and re-ranking steps with the eager 2-rank engine's results, and a step one rank
turns down runs eagerly on both. GPU (`gpu` marker): NCCL inside real graphs, at world size 1 (the
parallel path forced) and 2 (tiered too).
"""
from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekv import LLM, SamplingParams
from moekv.envs import EMULATE_CUDA_GRAPHS_ENV
from moekv.layers.parallel import ExpertParallel, StaticDispatch, TPGroup
from moekv.ops.reference import fused_moe_ref
from tests.faults import inject_fault

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [12, 13, 14]},
           {"prompt_token_ids": [40, 41, 42, 43, 44]}]
# different lengths: batch 3 (bucket 4: one padding row), 2, then 1; logprobs compare the decode logits
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (9, 7, 5)]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=48, max_num_seqs=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the static dispatch against the dynamic one (2 gloo processes, no engine) ------------------------
def _dispatch_case(T: int, real: int, H: int = 16, E: int = 8, k: int = 2, inter: int = 24):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    expert_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x, w13, w2, weights, expert_ids


def _dispatch_worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tp = TPGroup(rank, world, dist.new_group(backend="gloo"))
        placement = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1]) % world  # not contiguous: owners mix
        results = []
        for T, real in ((6, 6), (8, 5), (1, 1)):  # (8, 5): a bucket of 8 holding 5 real rows
            x, w13, w2, weights, ids = _dispatch_case(T, real)
            local = torch.nonzero(placement == rank).flatten()
            ep = ExpertParallel(tp, placement, dispatch=True)
            ep.static = StaticDispatch(torch.device("cpu"))
            dynamic = tp.all_reduce(ep(x[:real], w13[local], w2[local], weights[:real], ids[:real]))
            dynamic_bytes = ep.bytes_sent
            ep.static.count_rows(real)
            ep.static.active = True
            static = tp.all_reduce(ep(x, w13[local], w2[local], weights, ids))
            results.append((dynamic, static[:real], dynamic_bytes, int(ep.static_bytes), ep.bytes_sent))
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_static_dispatch_equals_dynamic_dispatch_and_one_process(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dispatch_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 120
    try:
        while len(got) < world:
            assert time.monotonic() < deadline, "the ranks did not answer within 120 s"
            try:
                rank, results = queue.get(timeout=1)
                got[rank] = results
            except Exception:  # (queue.Empty) a rank that died sends nothing: do not wait for it
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), "a rank failed (its traceback above)"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for i, (T, real) in enumerate(((6, 6), (8, 5), (1, 1))):
        x, w13, w2, weights, ids = _dispatch_case(T, real)
        want = fused_moe_ref(x[:real], w13, w2, weights[:real], ids[:real])  # one process, every expert
        total_dynamic = 0
        for rank in range(world):
            dynamic, static, dynamic_bytes, static_bytes, both = got[rank][i]
            # without padding the same expert GEMMs on the same rows: bit for bit; padding rows change
            # the GEMMs' row counts (CPU BLAS blocking), so rounding may differ there
            if T == real:
                assert torch.equal(static, dynamic), f"T={T}, rank {rank}: static dispatch differs from dynamic"
            else:
                assert (static - dynamic).abs().max() < 1e-6, f"T={T}, rank {rank}"
            assert (dynamic - want).abs().max() < 1e-5
            # the real rows' bytes, not the padding's; equal to the dynamic path's count
            assert static_bytes == dynamic_bytes and both == 2 * dynamic_bytes
            total_dynamic += dynamic_bytes
        if T > 1:
            assert total_dynamic > 0, "no token crossed ranks: a weak case"


# -- the engine over 2 ranks on the emulated graph path ----------------------------------------------
def _outputs(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _assert_same_logprobs(ours, ref, tol=1e-5):
    for seq_ours, seq_ref in zip(ours, ref):
        assert len(seq_ours) == len(seq_ref)
        for a, b in zip(seq_ours, seq_ref):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < tol


@pytest.fixture(scope="module")
def one_process(mixtral_ckpt):
    """The oracle: one process, eager steps."""
    return _outputs(LLM(model=str(mixtral_ckpt), **ENGINE))


@pytest.fixture(scope="module")
def eager_two_ranks(mixtral_ckpt):
    """2 ranks, TP + EP, every step eager (dynamic dispatch): tokens and byte counters."""
    llm = LLM(model=str(mixtral_ckpt), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60)
    try:
        assert llm.engine.runner.graphs is None  # the CPU: no graphs without the emulation
        tokens, logprobs = _outputs(llm)
        return tokens, logprobs, llm.engine.stats().ep_bytes_sent
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("expert_parallel, async_scheduling", [(True, False), (False, True)],
                         ids=["tp2+ep", "tp2-async"])
@pytest.mark.slow
def test_two_ranks_replay_the_variants_rank0_picks(mixtral_ckpt, monkeypatch, one_process, eager_two_ranks,
                                                   expert_parallel, async_scheduling):
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")  # (inherited by the spawned rank)
    llm = LLM(model=str(mixtral_ckpt), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              async_scheduling=async_scheduling, distributed_timeout=60)
    try:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and not graphs.use_graphs
        tokens, logprobs = _outputs(llm)
        stats = llm.engine.stats()
        ranks = llm.engine.runner.parallel_graph_stats()
        follow_on = llm.engine.num_follow_on_steps
    finally:
        llm.engine.shutdown()
    ref_tokens, ref_logprobs = one_process
    assert tokens == ref_tokens
    _assert_same_logprobs(logprobs, ref_logprobs)
    # after the prefill (eager) rank 0 picked batch bucket 4 for 4 decode steps (until the 5-token request
    # ends), bucket 2 for 2, then bucket 1 for 2 (fp32 pages: no fill lists, fill bucket 0); rank 1
    # captured and replayed the same variants in the same order
    r0, r1 = ranks
    assert r0["captured"] == r1["captured"] == [(1, 0), (2, 0), (4, 0)]
    assert r0["replayed"] == r1["replayed"] == [(4, 0)] * 4 + [(2, 0)] * 2 + [(1, 0)] * 2
    assert r0["num_captures"] == r1["num_captures"] == 3
    if async_scheduling:
        assert follow_on > 0  # follow-on steps replayed, their tokens broadcast before the replay
    if expert_parallel:
        # the same tokens routed as in the eager 2-rank engine: the same bytes, part of them counted
        # inside replayed steps (on the device), none for padding rows
        assert stats.ep_bytes_sent == eager_two_ranks[2]
        assert r0["static_ep_bytes"] + r1["static_ep_bytes"] > 0
        assert eager_two_ranks[0] == ref_tokens


def test_two_ranks_replay_page_filling_steps(hd32_ckpt, monkeypatch):
    """fp8 pages (quantized from the step's fill lists inside the captured step): replayed steps that
    fill a page take a fill-bucket variant on both ranks, with the one-process tokens and logprobs."""
    kwargs = dict(ENGINE, kv_cache_dtype="fp8_e4m3", block_size=8)  # decodes reach contexts 8 and 16
    ref_tokens, ref_logprobs = _outputs(LLM(model=str(hd32_ckpt), **kwargs))
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")
    llm = LLM(model=str(hd32_ckpt), **kwargs, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60)
    try:
        assert llm.engine.runner.graphs.fill_variants
        tokens, logprobs = _outputs(llm)
        r0, r1 = llm.engine.runner.parallel_graph_stats()
    finally:
        llm.engine.shutdown()
    assert tokens == ref_tokens
    _assert_same_logprobs(logprobs, ref_logprobs)
    assert r0["replayed"] == r1["replayed"] and len(r0["replayed"]) == 8
    assert any(fills for _, fills in r0["replayed"]), "no replayed step filled a page: a weak test"


@pytest.mark.slow
def test_a_rank_that_fails_a_replayed_step(mixtral_ckpt, monkeypatch, one_process):
    """A failure on rank 1 in a replayed step, before the replay (loading its inputs: no rank
    replays) and inside it (the emulated replay's layer; the other rank's collective times out):
    both fail the step's requests with the rank's error and free their pages; the graphs are
    dropped with the rebuilt compute group, recaptured on every rank, and the engine serves the
    one-process tokens again."""
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")
    llm = LLM(model=str(mixtral_ckpt), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=3)
    engine = llm.engine
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for fault, message in (("graph_load", "injected fault loading a graph step on rank 1"),
                               (1, "injected fault in layer 1")):
            ids = [engine.add_request(None, p, params, output_kind="delta") for p in PROMPTS]
            for _ in range(3):  # prefill, then replayed decodes: both requests hold pages
                assert all(o.error is None for o in engine.step())
            assert engine.runner.graphs.num_replays > 0 and engine.block_manager.num_used_blocks > 0
            generation = engine.runner.parallel.generation
            inject_fault(engine.runner, rank=1, fault=fault)
            outs = engine.step()
            assert sorted(o.request_id for o in outs) == sorted(ids)
            for o in outs:
                assert o.finished and o.outputs[0].finish_reason == "error"
                assert "rank 1 failed the step" in o.error and message in o.error, o.error
            assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
            assert engine.runner.parallel.generation == generation + 1
            assert all(not r["captured"] for r in engine.runner.parallel_graph_stats())  # dropped everywhere
            tokens, _ = _outputs(llm)
            assert tokens == one_process[0]
            ranks = engine.runner.parallel_graph_stats()
            assert ranks[0]["captured"] == ranks[1]["captured"] == [(1, 0), (2, 0), (4, 0)]  # recaptured
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()


# -- tiered: each rank's host-side work before a replay, one verdict for all ranks ---------------------
# tiered keeps its page state per rank (its KV heads' masses and tiers); before each replay every rank's
# format chooses its fills' FP8 slots, counts the step and re-ranks every 3 steps (prepare_graph_step).
# Prompts of 15, 31 and 47 tokens: decode steps 1 and 17 fill a page in each sequence (fill bucket 4);
# step 17 is the engine's 18th, a re-ranking step; the small tier-1 share demotes pages at re-ranking
TIERED = dict(ENGINE, kv_cache_dtype="tiered", kv_codebook="page", kv_rerank_interval=3, kv_tier1_fraction=0.05)
TIERED_PROMPTS = [{"prompt_token_ids": [(5 * i + 7 * j) % 300 + 2 for i in range(n)]}
                  for j, n in enumerate((15, 31, 47))]
TIERED_PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (50, 40, 30)]
TIERED_DECODE_STEPS = 49  # (the longest request's tokens after the prefill's)


def _tiered_outputs(outs):
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.fixture(scope="module")
def tiered_eager(hd32_ckpt):
    """The oracle, once per expert_parallel (ask before setting the graph emulation): the eager 2-rank
    engine's tokens, logprobs and each rank's per-layer step counts. Not one process's: a rank ranks
    pages by its own KV heads' masses, so once pages are demoted the 2-rank engine is another
    (per-rank) ranking (here the first sequence leaves one process's tokens at its 39th)."""
    cache = {}

    def get(expert_parallel: bool):
        if expert_parallel not in cache:
            llm = LLM(model=str(hd32_ckpt), **TIERED, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                      distributed_timeout=60)
            try:
                assert llm.engine.runner.graphs is None
                tokens, logprobs = _tiered_outputs(llm.generate(TIERED_PROMPTS, TIERED_PARAMS))
                steps = [r["format_steps"] for r in llm.engine.runner.parallel_graph_stats()]
            finally:
                llm.engine.shutdown()
            cache[expert_parallel] = tokens, logprobs, steps
        return cache[expert_parallel]

    return get


@pytest.mark.parametrize("expert_parallel, async_scheduling", [(True, False), (False, True)],
                         ids=["tp2+ep", "tp2-async"])
@pytest.mark.slow
def test_two_ranks_replay_tiered_decode_steps(hd32_ckpt, monkeypatch, tiered_eager, expert_parallel,
                                              async_scheduling):
    """tiered over 2 ranks takes the graph path for every decode step, those that fill pages and those
    that re-rank too (each rank's format prepares its own pools before the replay): the eager 2-rank
    engine's tokens and logprobs, both ranks replay the same variants, and
    every layer on every rank counts each step once, as the eager engine's do."""
    ref_tokens, ref_logprobs, ref_steps = tiered_eager(expert_parallel)
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")
    llm = LLM(model=str(hd32_ckpt), **TIERED, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              async_scheduling=async_scheduling, distributed_timeout=60)
    try:
        assert llm.engine.runner.graphs.fill_variants
        tokens, logprobs = _tiered_outputs(llm.generate(TIERED_PROMPTS, TIERED_PARAMS))
        ranks = llm.engine.runner.parallel_graph_stats()
        follow_on = llm.engine.num_follow_on_steps
    finally:
        llm.engine.shutdown()
    assert tokens == ref_tokens
    # the padded static steps' GEMMs round differently from the eager ones (CPU BLAS blocking): up to
    # 1.3e-5 in a logprob with tiered's default outlier threshold in its nuq2 tier
    _assert_same_logprobs(logprobs, ref_logprobs, tol=3e-5)
    r0, r1 = ranks
    assert r0["replayed"] == r1["replayed"] and len(r0["replayed"]) == TIERED_DECODE_STEPS  # every decode step
    assert r0["replayed"][0] == (4, 4), "the first decode step (3 page fills) did not replay"
    assert [r["format_steps"] for r in ranks] == ref_steps == [[TIERED_DECODE_STEPS + 1] * 2] * 2
    if async_scheduling:
        assert follow_on > 0


@pytest.mark.slow
def test_a_rank_that_turns_a_replayed_tiered_step_down(hd32_ckpt, monkeypatch, tiered_eager):
    """One rank turns a replayed step down (as its format's prepare_graph_step does when a fill would
    have to go straight to nuq2: forced here, on rank 1 at decode step 1, which fills 3 pages, and on
    rank 0 at decode step 17, which fills 3 pages and re-ranks): no rank replays it, every rank runs it
    eagerly (the other rank's format had prepared it: its eager step counts nothing again and stores its
    fills anew), and every other decode step replays. The eager 2-rank engine's tokens, logprobs and
    per-layer step counts on each rank."""
    ref_tokens, ref_logprobs, ref_steps = tiered_eager(True)
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")
    llm = LLM(model=str(hd32_ckpt), **TIERED, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60)
    engine = llm.engine
    refuse = {1: 1, 17: 0}  # decode step -> the rank that turns it down
    try:
        graphs = engine.runner.graphs
        ids = [engine.add_request(None, prompt, params, output_kind="final")
               for prompt, params in zip(TIERED_PROMPTS, TIERED_PARAMS)]
        outs, replays, step = {}, [], 0
        while engine.has_unfinished_requests():
            if step in refuse:
                inject_fault(engine.runner, rank=refuse[step], fault="graph_verdict")
            before = graphs.num_replays
            for o in engine.step():
                assert o.error is None, o.error
                outs[o.request_id] = o
            replays.append(graphs.num_replays - before)
            if step == 1:  # rank 0's format had prepared the step rank 1 turned down; the eager step took it
                for st in (c.state for c in engine.runner.kv_caches):
                    assert not st.counted_ahead and not st.fill_slots_loaded
                    assert (st.fill_fp8_dev == st.scratch_fp8).all()  # what a capture's warm-up may write
            step += 1
        ranks = engine.runner.parallel_graph_stats()
    finally:
        engine.shutdown()
    # the prefill (eager), the two steps turned down (eager on both ranks), every other decode step replayed
    assert replays == [0 if s == 0 or s in refuse else 1 for s in range(TIERED_DECODE_STEPS + 1)]
    assert engine.runner.graphs is graphs  # graphs stay on
    r0, r1 = ranks
    assert r0["replayed"] == r1["replayed"] and len(r0["replayed"]) == TIERED_DECODE_STEPS - len(refuse)
    tokens, logprobs = _tiered_outputs([outs[i] for i in ids])
    assert tokens == ref_tokens
    _assert_same_logprobs(logprobs, ref_logprobs)
    # counted once each on every rank, the prepared-then-eager steps included
    assert [r["format_steps"] for r in ranks] == ref_steps


# -- GPU: NCCL inside the graphs ---------------------------------------------------------------------
def _forced_parallel_engine(ckpt, monkeypatch, device: str, expert_parallel: bool, **kwargs):
    """An engine at tensor_parallel_size=1 whose runner takes the parallel path anyway: a world of
    one rank (gloo commands, NCCL compute group on CUDA), every layer cut by shard_model (which
    keeps it whole) and, with expert_parallel, every expert on rank 0 behind the dispatching
    ExpertParallel (what bench_parallel_cost.py's tp+ep variant measures)."""
    from moekv.engine import model_runner
    from moekv.engine.parallel import ParallelGroup

    if expert_parallel:
        def every_expert_on_rank0(config, model_cfg, moe_layer_ids):
            return {i: torch.zeros(model_cfg.num_experts, dtype=torch.long) for i in moe_layer_ids}

        monkeypatch.setattr(model_runner, "placement_of", every_expert_on_rank0)
    group = ParallelGroup(0, 1, f"tcp://127.0.0.1:{_free_port()}", torch.device(device), 60)
    monkeypatch.setattr(model_runner, "start_ranks", lambda *args: group)
    return LLM(model=str(ckpt), device=device, **kwargs)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp1", "tp1+ep"])
def test_world_size_one_parallel_path_on_the_cpu(mixtral_ckpt, monkeypatch, one_process, expert_parallel):
    """The GPU test below, on the CPU: the forced parallel path at world size 1 on the emulated graph
    path (gloo) gives the one-process tokens and logprobs."""
    monkeypatch.setenv(EMULATE_CUDA_GRAPHS_ENV, "1")
    llm = _forced_parallel_engine(mixtral_ckpt, monkeypatch, "cpu", expert_parallel,
                                  **{k: v for k, v in ENGINE.items() if k != "device"})
    try:
        runner = llm.engine.runner
        assert runner.parallel is not None and runner.graphs is not None
        assert (runner.static_dispatch is not None) == expert_parallel
        tokens, logprobs = _outputs(llm)
        assert runner.graphs.num_replays > 0
    finally:
        llm.engine.shutdown()
    assert tokens == one_process[0]
    _assert_same_logprobs(logprobs, one_process[1])


GPU_ENGINE = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=4, block_size=16, kv_cache_dtype="bf16",
                  num_kv_blocks=64)
GPU_PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (40, 30, 20)]


def _gpu_outputs(llm):
    return llm.generate(PROMPTS, GPU_PARAMS)


def _assert_graph_tokens_match_eager(ref, out):
    from tests.test_cuda_graphs import _first_divergence_is_a_tie

    for a, b in zip(ref, out):
        ok, where = _first_divergence_is_a_tie(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                               b.outputs[0].token_ids, b.outputs[0].logprobs)
        assert ok, where
    return sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL inside CUDA graphs)")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp1", "tp1+ep"])
def test_world_size_one_nccl_graphs_match_eager(hd32_ckpt, monkeypatch, expert_parallel):
    """World size 1 on NCCL with the parallel path forced: decode steps captured with their NCCL
    all-reduces (and, with EP, the static dispatch's all_to_all_single) and replayed give the tokens
    of the same engine with enforce_eager=True (by the graph tests' near-tie rule; bf16)."""
    eager = _forced_parallel_engine(hd32_ckpt, monkeypatch, "cuda", expert_parallel, enforce_eager=True,
                                    **GPU_ENGINE)
    try:
        assert eager.engine.runner.graphs is None
        ref = _gpu_outputs(eager)
    finally:
        eager.engine.shutdown()
    llm = _forced_parallel_engine(hd32_ckpt, monkeypatch, "cuda", expert_parallel, **GPU_ENGINE)
    try:
        runner = llm.engine.runner
        graphs = runner.graphs
        assert graphs is not None and graphs.use_graphs and runner.parallel.backend == "nccl"
        out = _gpu_outputs(llm)
        assert runner.graphs is graphs, "the graph path failed (see the log)"
        assert graphs.num_replays > 20 and {b for b, _ in graphs.graphs} == {4, 2, 1}
        stats = runner.graph_stats()
    finally:
        llm.engine.shutdown()
    exact = _assert_graph_tokens_match_eager(ref, out)
    if expert_parallel:
        assert stats["static_ep_bytes"] == 0  # one rank: nothing crosses, nothing counted
    print(f"\nworld size 1, NCCL graphs vs eager ({'tp+ep' if expert_parallel else 'tp'}): {exact}/3 identical, "
          f"{graphs.num_replays} replays")


def _eager_then_graphs(ckpt, kwargs, figure):
    """The same 2-rank engine built with enforce_eager=True, then with graphs, each generating
    _gpu_outputs -> (eager outputs, figure(eager engine), graph outputs, every rank's graph_stats,
    figure(graph engine)); fails if the graph engine fell back to eager on the way."""
    eager = LLM(model=str(ckpt), enforce_eager=True, **kwargs)
    try:
        ref, ref_figure = _gpu_outputs(eager), figure(eager.engine)
    finally:
        eager.engine.shutdown()
    llm = LLM(model=str(ckpt), **kwargs)
    try:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.use_graphs
        out = _gpu_outputs(llm)
        assert llm.engine.runner.graphs is graphs, "the graph path failed (see the log)"
        ranks, got_figure = llm.engine.runner.parallel_graph_stats(), figure(llm.engine)
    finally:
        llm.engine.shutdown()
    return ref, ref_figure, out, ranks, got_figure


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL between two ranks in graphs)")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2+ep"])
def test_two_gpus_nccl_graphs_match_eager(hd32_ckpt, expert_parallel):
    """2 GPUs: every rank captures and replays the decode step with NCCL inside; against the same
    2-rank engine with enforce_eager=True: the near-tie rule on tokens, the same buckets replayed on
    both ranks in the same order, and (EP) the same bytes counted."""
    kwargs = dict(device="cuda", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                  distributed_timeout=120, **GPU_ENGINE)
    ref, ref_bytes, out, ranks, got_bytes = _eager_then_graphs(hd32_ckpt, kwargs,
                                                               lambda engine: engine.stats().ep_bytes_sent)
    exact = _assert_graph_tokens_match_eager(ref, out)
    assert ranks[0]["replayed"] == ranks[1]["replayed"] and len(ranks[0]["replayed"]) > 20
    assert ranks[0]["captured"] == ranks[1]["captured"] == [(1, 0), (2, 0), (4, 0)]
    if expert_parallel and exact == len(ref):  # the same tokens routed: the same bytes
        assert got_bytes == ref_bytes and sum(r["static_ep_bytes"] for r in ranks) > 0
    print(f"\n2 GPUs, NCCL graphs vs eager ({'tp+ep' if expert_parallel else 'tp'}): {exact}/3 identical")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL between two ranks in graphs)")
def test_two_gpus_tiered_graphs_match_eager(hd32_ckpt):
    """tiered on 2 GPUs: every rank prepares its own pools before each replay (FP8 slots for the fills,
    re-ranking every 8 steps) and the replayed steps hold the NCCL collectives. Against the same 2-rank
    engine with enforce_eager=True: both ranks replay the same variants (page-filling ones included),
    each layer on each rank counts the same steps, and tokens and logprobs by the one-GPU tiered graph
    test's rule (the two runs rank masses of differently padded batches: mean logprob difference < 0.1
    while the tokens agree)."""
    from tests.test_cuda_graphs import _tiered_logprob_diffs

    kwargs = dict(GPU_ENGINE, device="cuda", tensor_parallel_size=2, enable_expert_parallel=True,
                  distributed_timeout=120, kv_cache_dtype="tiered", kv_codebook="page", kv_rerank_interval=8)
    ref, ref_steps, out, ranks, _ = _eager_then_graphs(
        hd32_ckpt, kwargs, lambda engine: [r["format_steps"] for r in engine.runner.parallel_graph_stats()])
    diffs = _tiered_logprob_diffs(ref, out, 8)
    assert ranks[0]["replayed"] == ranks[1]["replayed"] and len(ranks[0]["replayed"]) > 20
    assert any(fills for _, fills in ranks[0]["replayed"]), "no replayed step filled a page: a weak test"
    assert [r["format_steps"] for r in ranks] == ref_steps
    exact = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, out))
    print(f"\n2 GPUs, tiered NCCL graphs vs eager: {exact}/3 identical, {len(ranks[0]['replayed'])} replays, "
          f"mean |logprob difference| {sum(diffs) / len(diffs):.4f} over {len(diffs)} tokens")
