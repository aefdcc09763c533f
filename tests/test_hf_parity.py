"""moekv against transformers on the same checkpoint: logits and greedy generation."""
from __future__ import annotations

from pathlib import Path

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


@pytest.mark.slow
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


DOMAIN_MOE = Path(__file__).resolve().parent.parent / "models" / "domain-moe"


@pytest.fixture(scope="module")
def domain_moe_pair():
    """The shipped 4k-context, head_dim-128 model in float32, in transformers and in moekv."""
    hf = load_hf(DOMAIN_MOE)
    hf.generation_config.eos_token_id = None
    llm = LLM(str(DOMAIN_MOE), dtype="float32", max_model_len=1024, max_num_batched_tokens=256)
    return hf, llm


@pytest.mark.slow
def test_domain_moe_logits_and_greedy_match_transformers(domain_moe_pair):
    """Held-out code and prose prompts (hundreds of tokens, chunked prefill) score and continue as in transformers."""
    hf, llm = domain_moe_pair
    texts = [(DOMAIN_MOE / "heldout" / f"{name}.txt").read_text(encoding="utf-8")[:2000] for name in ("code", "prose")]
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False)[:n] for t, n in zip(texts, (600, 333))]
    assert all(len(p) in (600, 333) for p in prompts)
    ours = llm.score([{"prompt_token_ids": p} for p in prompts])
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape == (len(prompt), 4096)
        assert (logits - ref).abs().max().item() < 1e-3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              repetition_penalty=1.0)  # generation_config.json's sampling defaults off: greedy
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
