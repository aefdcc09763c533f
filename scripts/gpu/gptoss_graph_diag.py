"""Where tests/test_gpt_oss.py::test_cuda_bf16_graphs_match_eager[bf16] parts (it failed on an H100;
its fp8_e4m3 / int4 / kivi2 / nuq2 cases pass). The [bf16] case is the only one that also checks fp32
logits on CUDA against transformers, and bf16 pages are the only ones the Triton decode kernel reads
without a 16-bit staging tail; this prints, on the test's own checkpoint (head_dim 64, window 8):

1. bf16 decode, graphs against eager, per KV format (bf16, fp8_e4m3) and batch (the three prompts
   together, and each alone): the first position where the greedy tokens part, the eager top-2 gap
   there, and the largest |logprob difference| before it;
2. fp32 on CUDA against transformers (its version first): each prompt's largest |logits difference|
   per position, with chunked prefill (12-token budget, as the test) and whole prompts (128).

    PYTHONPATH=. python scripts/gpu/gptoss_graph_diag.py --out $OUT/gptoss_graph_diag.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moekv import LLM, SamplingParams  # noqa: E402
from tests.test_gpt_oss import PROMPTS, build_gpt_oss, hf_model  # noqa: E402


def parting(a, b) -> dict:
    ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    lps_a, lps_b = a.outputs[0].logprobs, b.outputs[0].logprobs
    worst = 0.0
    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            top = sorted(lps_a[i].values(), reverse=True)
            return dict(parts_at=i, eager=ids_a[i:i + 4], graphs=ids_b[i:i + 4], eager_top2_gap=top[0] - top[1],
                        max_logprob_diff_before=worst)
        worst = max(worst, abs(lps_a[i][x] - lps_b[i][y]))
    return dict(parts_at=None, max_logprob_diff=worst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    ckpt = build_gpt_oss(Path(tempfile.mkdtemp()) / "hd64", seed=4, head_dim=64)  # the test's fixture
    # the reference's version: 5.17 (the GPU image's) ignores config.json's swiglu_limit, which hf_model sets
    record = {"device": torch.cuda.get_device_name(), "transformers": transformers.__version__,
              "graphs_vs_eager": [], "fp32_vs_transformers": []}
    print(json.dumps({"transformers": transformers.__version__}), flush=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for fmt in ("bf16", "fp8_e4m3"):
        kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4, kv_cache_dtype=fmt)
        eager, graphs = LLM(str(ckpt), enforce_eager=True, **kwargs), LLM(str(ckpt), **kwargs)
        for batch in ("together", "alone"):
            groups = [PROMPTS] if batch == "together" else [[q] for q in PROMPTS]
            for group in groups:
                prompts = [{"prompt_token_ids": q} for q in group]
                for q, a, b in zip(group, eager.generate(prompts, params), graphs.generate(prompts, params)):
                    row = dict(format=fmt, batch=batch, prompt=PROMPTS.index(q), **parting(a, b))
                    record["graphs_vs_eager"].append(row)
                    print(json.dumps(row), flush=True)
        del eager, graphs
        torch.cuda.empty_cache()
    hf = hf_model(ckpt)
    for budget in (12, 128):
        llm = LLM(str(ckpt), dtype="float32", device="cuda", max_model_len=128, max_num_batched_tokens=budget)
        ours = llm.score([{"prompt_token_ids": q} for q in PROMPTS])
        for i, (q, logits) in enumerate(zip(PROMPTS, ours)):
            with torch.no_grad():
                ref = hf(torch.tensor([q])).logits[0].float()
            diff = (logits.float().cpu() - ref).abs().max(dim=-1).values
            row = dict(budget=budget, prompt=i, max_diff=diff.max().item(), per_position=[round(d, 6) for d in
                                                                                           diff.tolist()])
            record["fp32_vs_transformers"].append(row)
            print(json.dumps(row), flush=True)
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
