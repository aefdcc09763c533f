"""Async scheduling: a decode step queued on the device before the host has read the step before it.

The engine must give exactly what the synchronous engine gives (tokens, text, finish reasons,
logprobs), stop a sequence on a token it had not yet seen without emitting the extra one, survive
aborts and faults while a step runs ahead, and return every page. Each test also checks that
steps really were queued ahead, so that none passes by running synchronously.
"""
from __future__ import annotations

import time

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.engine.model_runner import PendingStep
from tests.test_cuda_graphs import _with_emulated_graphs
from tests.test_engine import PROMPTS, assert_pool_empty

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make(ckpt, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(ckpt, dtype="float32", max_model_len=64, async_scheduling=async_scheduling, **kwargs)


def summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


@pytest.fixture(scope="module")
def sync_llm(mixtral_ckpt):
    return make(mixtral_ckpt, False)


@pytest.fixture(scope="module")
def async_llm(mixtral_ckpt):
    return make(mixtral_ckpt, True)


def mixed_requests(sync_llm):
    """Requests that stop in every way: at max_tokens, on a stop token (found from a free run, so
    it is one the host sees only after the next step was queued), on a stop string, held back by
    min_tokens; seeded sampling; logprobs."""
    free = sync_llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)[0].outputs[0].token_ids
    frequent = sync_llm.generate([{"prompt_token_ids": PROMPTS[4]}], GREEDY)[0].outputs[0].token_ids
    frequent = max(set(frequent), key=frequent.count)  # still likely after min_tokens held it back
    text = sync_llm.generate("It was the best", GREEDY)[0].outputs[0].text
    assert len(text) > 6
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] + ["It was the best"]
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[free[5]], ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=4, stop_token_ids=[frequent], ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop=[text[3:6]], ignore_eos=True),
    ]
    return prompts, params


@pytest.mark.slow
def test_async_gives_what_the_synchronous_engine_gives(sync_llm, async_llm):
    prompts, params = mixed_requests(sync_llm)
    want = sync_llm.generate(prompts, params)
    before = async_llm.engine.num_follow_on_steps
    got = async_llm.generate(prompts, params)
    assert summary(got) == summary(want)
    assert [o.outputs[0].finish_reason for o in got].count("stop") >= 3  # stop token, min_tokens + stop, string
    for g, w in zip(got, want):
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-4)
    assert got[3].outputs[0].logprobs == [pytest.approx(lp, abs=1e-4) for lp in want[3].outputs[0].logprobs]
    assert async_llm.engine.num_follow_on_steps - before > 10
    assert sync_llm.engine.num_follow_on_steps == 0
    assert_pool_empty(async_llm)


def test_waiting_requests_and_preemption_interrupt_the_pipeline(mixtral_ckpt):
    """Admitting a waiting request or preempting needs the scheduler: the pipeline drains for it,
    and picks up again afterwards."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for kwargs in (dict(max_num_seqs=2), dict(block_size=16, num_kv_blocks=5)):
        want = make(mixtral_ckpt, False, **kwargs).generate(prompts, GREEDY)
        llm = make(mixtral_ckpt, True, **kwargs)
        got = llm.generate(prompts, GREEDY)
        assert summary(got) == summary(want), kwargs
        assert llm.engine.num_follow_on_steps > 0
        assert_pool_empty(llm)
    assert llm.engine.scheduler.num_preemptions > 0


def test_abort_while_a_step_runs_ahead(sync_llm, async_llm):
    want_b = sync_llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)[0].outputs[0].token_ids
    engine = async_llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY, output_kind="delta")
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, GREEDY, output_kind="delta")
    for _ in range(4):
        engine.step()
    assert engine.num_steps_in_flight == 1
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    rest = []
    while engine.has_unfinished_requests():
        rest += engine.step()
    assert rest and all(o.request_id == "b" for o in rest)
    assert rest[-1].finished and rest[-1].outputs[0].token_ids == want_b
    assert_pool_empty(async_llm)
    # b stopped at max_tokens, known in advance: no step was queued past its last token
    assert engine.num_steps_in_flight == 0 and engine.step() == []


def test_a_step_queued_past_an_unseen_stop_is_dropped_unread(sync_llm, async_llm):
    """A lone request that stops on a token the host had not seen leaves a step queued for it; the
    next call drops it without output, and its pages are already back in the pool."""
    free = sync_llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[free[5]], ignore_eos=True)
    want = sync_llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)
    engine = async_llm.engine
    got = async_llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)
    assert summary(got) == summary(want) and got[0].outputs[0].finish_reason == "stop"
    assert engine.num_steps_in_flight == 1
    assert_pool_empty(async_llm)
    dropped = engine.num_dropped_steps
    assert engine.step() == [] and engine.num_steps_in_flight == 0
    assert engine.num_dropped_steps == dropped + 1


def test_a_fault_in_a_step_run_ahead_fails_its_requests(async_llm, sync_llm, monkeypatch):
    engine = async_llm.engine
    wait = PendingStep.wait
    calls = []

    def faulty_wait(self):
        calls.append(self)
        if len(calls) == 5:
            raise RuntimeError("simulated device fault")
        return wait(self)

    monkeypatch.setattr(PendingStep, "wait", faulty_wait)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[2]}, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    monkeypatch.undo()
    failed = [o for o in outs if o.error is not None]
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all("simulated device fault" in o.error and o.finished for o in failed)
    assert engine.num_follow_on_steps > 0
    assert_pool_empty(async_llm)
    # the engine goes on: the next request gets what a fresh synchronous engine gives
    want = sync_llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY)
    assert summary(async_llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY)) == summary(want)


def test_penalties_keep_the_engine_synchronous(sync_llm, async_llm):
    """Penalties read the tokens so far on the host: no step is queued ahead of them."""
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    before = async_llm.engine.num_follow_on_steps
    assert summary(async_llm.generate(prompts, params)) == summary(sync_llm.generate(prompts, params))
    assert async_llm.engine.num_follow_on_steps == before


@pytest.mark.parametrize("fmt", ["fp32", "nuq2"])
def test_steps_run_ahead_through_the_graph_path(hd32_ckpt, fmt):
    """Queued-ahead decode steps through the CUDA-graph path's static buffers (run eagerly on the
    CPU): their input tokens are copied on the device into the static input ids, page-filling
    steps included, and the tokens are those of the synchronous eager engine."""
    block_size = 16 if fmt == "fp32" else 32
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_dtype=fmt, block_size=block_size)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 30, 20)]
    prompts = [{"prompt_token_ids": p[:n]} for p, n in zip(PROMPTS, (5, 23, 30))]
    want = LLM(hd32_ckpt, async_scheduling=False, **kwargs).generate(prompts, params)
    llm = LLM(hd32_ckpt, async_scheduling=True, **kwargs)
    graphs, _ = _with_emulated_graphs(llm)
    run, ahead = graphs.run, []

    def recording_run(*args, input_ids_device=None, **kwargs):
        if input_ids_device is not None:
            ahead.append(list(args[4]))  # context_lens
        return run(*args, input_ids_device=input_ids_device, **kwargs)

    graphs.run = recording_run
    got = llm.generate(prompts, params)
    assert summary(got) == summary(want)
    assert len(ahead) > 10
    assert any(n % block_size == 0 for lens in ahead for n in lens), "no step run ahead filled a page"
    assert_pool_empty(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["bf16", "nuq2", "tiered"])
def test_async_matches_sync_on_the_gpu(hd32_ckpt, fmt):
    """On CUDA, with graphs: steps queued ahead (replayed, page-filling ones too; tiered's eager fill
    and re-ranking steps) give exactly the synchronous engine's tokens and logprobs. The batches
    are the same in both runs (every sequence stops at max_tokens), so the same kernels see the
    same rows. Prints the batch-1 time per step of both (no assertion on speed)."""
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=4, kv_cache_dtype=fmt,
                  block_size=32, **{"bf16": {}, "nuq2": dict(kv_codebook="page"),
                                    "tiered": dict(kv_codebook="page", kv_rerank_interval=8)}[fmt])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (60, 45, 30)]
    runs, rates = {}, {}
    for mode in (False, True):
        llm = LLM(hd32_ckpt, async_scheduling=mode, **kwargs)
        runs[mode] = llm.generate(prompts, params)
        assert (llm.engine.num_follow_on_steps > 20) == mode
        assert_pool_empty(llm)
        one = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], one)  # captures
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts[:1], one)
        rates[mode] = 1e3 * (time.perf_counter() - start) / 200
    for a, b in zip(runs[False], runs[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    print(f"\n{fmt}, tiny model, batch 1: {rates[False]:.3f} ms a step synchronous, {rates[True]:.3f} ms async")
