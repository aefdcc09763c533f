"""moekv against transformers on the same checkpoint: logits and greedy generation."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from tests.checkpoints import ARCHS, load_hf

PROMPTS = [
    [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14],  # crosses a page boundary
    [9, 8, 7],
    [250, 3, 3, 3, 3, 3, 31, 64, 128, 256, 17, 71, 72, 73, 74, 75],  # exactly one page of 16
]


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, checkpoints):
    path = checkpoints[request.param]
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None  # compare fixed-length continuations
    # a small token budget forces chunked prefill of the longest prompt
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12)
    return request.param, hf, llm


def test_logits_match_transformers(arch_pair):
    """Prompt logits through the paged cache (chunked prefill included) equal transformers' to 1e-4."""
    _, hf, llm = arch_pair
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_greedy_generation_matches_transformers(arch_pair):
    """32 greedy tokens per prompt, in one batch, equal transformers.generate token for token."""
    _, hf, llm = arch_pair
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert out.outputs[0].finish_reason == "length"


def test_text_prompts_match_transformers_tokenization(checkpoints):
    """A string prompt is tokenized as transformers' tokenizer does and continues identically."""
    from transformers import AutoTokenizer

    path = checkpoints["mixtral"]
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype="float32", max_model_len=128)
    text = "It was the best of times, it was"
    out = llm.generate(text, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok(text)["input_ids"]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
