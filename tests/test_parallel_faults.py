"""A failing rank of a 2-process engine (gloo): the step's requests fail with an error naming the rank,
their pages go back to the pool, the engine keeps serving; a dead rank fails requests at once."""
from __future__ import annotations

import time

import pytest

from moekv import LLM, SamplingParams
from tests.faults import inject_fault

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [12, 13, 14]}]


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_step_and_the_engine_recovers(mixtral_ckpt):
    llm = LLM(model=str(mixtral_ckpt), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=48,
              tensor_parallel_size=2, enable_expert_parallel=True, distributed_timeout=3)
    engine = llm.engine
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        ids = [engine.add_request(None, p, GREEDY, output_kind="delta") for p in PROMPTS]
        for _ in range(3):  # prefill, then decodes: both requests hold pages
            assert all(o.error is None for o in engine.step())
        assert engine.block_manager.num_used_blocks > 0
        inject_fault(engine.runner, rank=1, fault=1)  # raises between two collectives of the step
        start = time.monotonic()
        outs = engine.step()
        assert time.monotonic() - start < 30  # rank 0's collective timed out (3 s), no hang
        assert sorted(o.request_id for o in outs) == sorted(ids)
        for o in outs:
            assert o.finished and o.outputs[0].finish_reason == "error"
            assert "rank 1 failed the step" in o.error and "injected fault in layer 1" in o.error
        assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
        # the freed pages are released on both ranks with the next step, and the ranks agree again
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
        assert engine.block_manager.num_used_blocks == 0

        engine.runner.parallel.procs[0].kill()  # a rank that is gone
        engine.runner.parallel.procs[0].join(10)
        rid = engine.add_request(None, PROMPTS[0], GREEDY)
        (out,) = engine.step()
        assert out.request_id == rid and out.outputs[0].finish_reason == "error"
        assert "rank 1 exited" in out.error
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()
