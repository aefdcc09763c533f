"""Tensor and expert parallelism on the CPU (gloo): an engine over 2 (and once 4) processes gives the
greedy tokens and logits of the same engine in one process, for every supported architecture."""
from __future__ import annotations

import pytest

from moekv import LLM, SamplingParams
from moekv.layers.parallel import kv_heads_of_rank

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [12, 13, 14]}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=48)


def run(model, **kwargs):
    """(greedy token ids per prompt, prompt logits per prompt, engine stats) of one engine, shut down after."""
    llm = LLM(model=str(model), **ENGINE, **kwargs)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        logits = llm.score(PROMPTS)
        return tokens, logits, llm.engine.stats()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def single(checkpoints):
    return {arch: run(path) for arch, path in checkpoints.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2+ep"])
def test_two_ranks_match_one_process(arch, expert_parallel, checkpoints, single):
    tokens, logits, stats = run(checkpoints[arch], tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                                distributed_timeout=60)
    ref_tokens, ref_logits, _ = single[arch]
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max() < 1e-5
    # expert parallel dispatches tokens between the ranks (top-2 of 8 experts on 2 ranks: some cross)
    assert (stats.ep_bytes_sent is not None and stats.ep_bytes_sent > 0) == expert_parallel


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads(mixtral_ckpt, single):
    """4 ranks over 2 KV heads: each KV head (and its pages) on two ranks, experts 2 per rank."""
    tokens, logits, _ = run(mixtral_ckpt, tensor_parallel_size=4, enable_expert_parallel=True, distributed_timeout=60)
    ref_tokens, ref_logits, _ = single["mixtral"]
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) < 1e-5


def test_heads_of_each_rank():
    # GQA 8 query heads over 2 KV heads: query heads h read KV head h // 4
    assert [kv_heads_of_rank(8, 2, r, 2) for r in range(2)] == [(range(0, 4), range(0, 1)), (range(4, 8), range(1, 2))]
    assert [kv_heads_of_rank(8, 2, r, 4)[1] for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="num_attention_heads=8"):
        kv_heads_of_rank(8, 2, 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        kv_heads_of_rank(12, 4, 0, 6)


def test_bad_parallel_options(mixtral_ckpt):
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(model=str(mixtral_ckpt), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(model=str(mixtral_ckpt), tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="distributed_timeout"):
        LLM(model=str(mixtral_ckpt), distributed_timeout=0, **ENGINE)


def test_async_scheduling_with_two_ranks(mixtral_ckpt, single):
    """Follow-on decode steps (their tokens sampled by rank 0 on the device and broadcast inside the
    step) give the one-process tokens; steps really were queued ahead."""
    llm = LLM(model=str(mixtral_ckpt), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
              async_scheduling=True, distributed_timeout=60)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.num_follow_on_steps > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.engine.shutdown()
    assert tokens == single["mixtral"][0]
