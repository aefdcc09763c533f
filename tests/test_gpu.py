"""The CUDA path (same reference ops as the CPU path until the fused kernels land): it must give
the CPU's answers. Skipped, with the reason, on machines without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12]},
           {"prompt_token_ids": [9, 8, 7]}]


def test_cuda_logits_match_cpu(mixtral_ckpt):
    cpu = LLM(mixtral_ckpt, dtype="float32", max_model_len=64).score(PROMPTS)
    gpu = LLM(mixtral_ckpt, dtype="float32", device="cuda", max_model_len=64).score(PROMPTS)
    for a, b in zip(cpu, gpu):
        assert (a - b).abs().max().item() < 1e-3  # TF32 may be on for matmuls on the GPU


def test_cuda_bf16_generation_and_fp8_cache(mixtral_ckpt):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    bf16 = LLM(mixtral_ckpt, dtype="bfloat16", device="cuda", max_model_len=64, kv_cache_dtype="bf16")
    fp8 = LLM(mixtral_ckpt, dtype="bfloat16", device="cuda", max_model_len=64, kv_cache_dtype="fp8_e4m3")
    a = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, sp)]
    b = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, sp)]
    assert all(len(x) == 16 for x in a)
    assert [x[:4] for x in a] == [x[:4] for x in b]
    for llm in (bf16, fp8):
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
