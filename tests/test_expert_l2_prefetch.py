"""L2 prefetch of the predicted experts (moekv/experts/l2_prefetch.py): the byte budget and its split
on the CPU, the option's validation, and on CUDA the engine's tokens and logits with and without it."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.config import EngineConfig, default_model_path
from moekv.experts.l2_prefetch import (
    L2_SHARE,
    LINE_BYTES,
    MAX_PAIRS,
    L2PrefetchPlan,
    l2_prefetch_budget,
    l2_prefetch_lines,
)

MODEL = default_model_path()
PROMPTS = ["It was a dark and stormy night", "The sea was calm and the ship", "Elizabeth said to her sister that"]
MB = 10**6


def test_budget_is_bounded_by_half_the_l2_and_the_window():
    l2 = 60 * MB
    assert l2_prefetch_budget(l2) == min(int(10e-6 * 4.0e12), int(l2 * L2_SHARE))  # 40 MB vs 30 MB
    assert l2_prefetch_budget(l2) == 30 * MB
    assert l2_prefetch_budget(l2, window_s=2e-6) == 8 * MB  # a short attention: what HBM delivers in it
    assert l2_prefetch_budget(l2, requested_bytes=12 * MB) == 12 * MB
    assert l2_prefetch_budget(l2, requested_bytes=100 * MB) == 30 * MB  # never more than half the L2
    assert l2_prefetch_budget(50 * MB, requested_bytes=100 * MB) == 25 * MB
    with pytest.raises(ValueError):
        l2_prefetch_budget(0)
    with pytest.raises(ValueError):
        l2_prefetch_budget(l2, requested_bytes=0)


def test_lines_split_the_budget_evenly_and_stop_at_one_expert():
    # Mixtral-8x7B: one expert's w13 is 2 x 14336 x 4096 bf16 = 234.9 MB; top-2 at batch 1 share 16 MB
    mixtral_w13 = 2 * 14336 * 4096 * 2
    lines = l2_prefetch_lines(16 * MB, 2, mixtral_w13)
    assert lines == (8 * MB) // 128 and lines * 128 <= 8 * MB < (lines + 1) * 128
    # Qwen3-30B-A3B shape: w13 2 x 768 x 2048 bf16 = 6.29 MB, top-8: 30 MB gives 3.75 MB a pair
    qwen_w13 = 2 * 768 * 2048 * 2
    assert l2_prefetch_lines(30 * MB, 8, qwen_w13) == (30 * MB // 8) // 128
    # a budget larger than the predicted experts' w13: each is prefetched whole, no further
    assert l2_prefetch_lines(100 * MB, 8, qwen_w13) == qwen_w13 // 128
    assert l2_prefetch_lines(100 * MB, 1, 1000) == 8  # 1000 bytes: 7 lines and a part, the part counts
    assert l2_prefetch_lines(100, 1, 10**6) == 0  # under one line per pair
    assert l2_prefetch_lines(16 * MB, 0, qwen_w13) == 0


def test_plan_bytes_and_batch_bound():
    plan = L2PrefetchPlan(pairs=4, lines=10)
    assert plan.bytes == 4 * 10 * LINE_BYTES
    assert MAX_PAIRS >= 2  # batch 1 of a top-2 model is prefetched


def test_option_is_refused_off_cuda_and_with_offload():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(expert_l2_prefetch=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(model=MODEL, dtype="float32", max_model_len=64, expert_l2_prefetch=True)
    with pytest.raises(ValueError, match="only applies with expert_l2_prefetch"):
        EngineConfig(expert_l2_prefetch_mb=8.0)
    with pytest.raises(ValueError, match="expert_l2_prefetch_mb"):
        EngineConfig(expert_l2_prefetch=True, expert_l2_prefetch_mb=-1.0)
    with pytest.raises(ValueError, match="use one of them"):
        EngineConfig(expert_l2_prefetch=True, expert_offload=True)
    with pytest.raises(ValueError, match="must be True or False"):
        EngineConfig(expert_l2_prefetch="yes")


def test_cli_flags_exist():
    import argparse

    from moekv.cli.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--expert-l2-prefetch", "--expert-l2-prefetch-mb", "12"])
    assert args.expert_l2_prefetch is True and args.expert_l2_prefetch_mb == 12.0
    assert p.parse_args([]).expert_l2_prefetch is False


def test_hook_plan_on_a_cpu_model_matches_the_split():
    """The per-layer plan from the model's own expert sizes (no CUDA needed to plan)."""
    from moekv.experts.l2_prefetch import ExpertL2Prefetch

    llm = LLM(model=MODEL, dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    hook = ExpertL2Prefetch.__new__(ExpertL2Prefetch)  # planning only: no stream on the CPU
    from moekv.models.loader import moe_layers

    hook.layers, hook.per_token, hook.budget_bytes = moe_layers(model), 2, 1 << 20
    i, moe = next(iter(hook.layers.items()))
    w13_bytes = moe.w13[0].numel() * moe.w13.element_size()
    plan = hook.plan(1, i)
    assert plan.pairs == 2 and plan.lines == l2_prefetch_lines(1 << 20, 2, w13_bytes)
    assert hook.plan(MAX_PAIRS, i).lines == 0  # MAX_PAIRS tokens x 2: a prefill, nothing prefetched


def test_decoder_calls_after_attention_once_per_layer():
    """The late launch point: LayerHooks.after_attention gets each layer's attention output."""
    llm = LLM(model=MODEL, dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    seen = []
    for i, layer in enumerate(model.layers):
        layer.hooks.after_attention = lambda attn, i=i: seen.append((i, tuple(attn.shape)))
    llm.generate(["It was a dark"], SamplingParams(max_tokens=2, temperature=0.0))
    H, n = model.config.hidden_size, len(model.layers)
    assert [i for i, _ in seen] == list(range(n)) * (len(seen) // n) and len(seen) >= 2 * n
    assert all(shape[-1] == H for _, shape in seen)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefetch_kernel_runs_over_every_expert_and_writes_nothing():
    """Both kernels (prefetch.global.L2 and the bulk prefetch) launch for every expert up to its last
    line (an out-of-range address would fault) and leave the weights unchanged."""
    from moekv.experts.l2_prefetch import launch_l2_prefetch

    dev = torch.device("cuda")
    E, N, K = 8, 96, 200  # 96 x 200 bf16 = 38,400 bytes: 300 lines exactly
    w13 = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
    before = w13.clone()
    ids = torch.tensor([[7, 0], [3, 7]], device=dev)
    for bulk in (False, True):
        for lines in (1, 37, 300, 10**6):
            launch_l2_prefetch(ids, w13, lines, bulk=bulk)
        torch.cuda.synchronize()
    assert torch.equal(w13, before)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mb,when", [(None, "router"), (0.05, "attention")])
def test_cuda_l2_prefetch_keeps_tokens_and_logits_in_graphs(mb, when):
    """The engine with the prefetch (side stream forked and joined inside the captured decode step)
    gives the tokens and logits of the engine without it, and the hook really issued prefetches."""
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp)]
    want_logits = ref.score(PROMPTS)
    llm = LLM(model=MODEL, dtype="bfloat16", device="cuda", max_model_len=256, expert_l2_prefetch=True,
              expert_l2_prefetch_mb=mb)
    hook = llm.engine.runner.l2_prefetch
    assert llm.engine.runner.graphs is not None and hook is not None
    assert llm.engine.runner.model.hooks.before_layer is hook
    hook.when = when  # before any graph is captured
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == want
    assert hook.launches > 0 and hook.bytes_issued > 0 and hook._pending is None
    assert llm.engine.runner.graphs.graphs, "no decode step was captured"
    for a, b in zip(llm.score(PROMPTS), want_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # prefetch writes nothing the model reads
