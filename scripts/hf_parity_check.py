#!/usr/bin/env python3
"""A checkpoint through moekv and through transformers: prompt logits and greedy tokens side by side.

Both in float32 on the CPU (the engine's reference path): the prompt is the start of a held-out text,
its logits are compared position by position (largest absolute difference), then both continue it
greedily for --tokens tokens. Exit status 1 when the tokens differ or the logits are further apart than
--atol. A check run by hand and by scripts/gpu/mla_train.sh on the models it trains.

  PYTHONPATH=. python scripts/hf_parity_check.py --model models/domain-mla --text models/domain-moe/heldout/prose.txt
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True, help="the prompt is this text's first --prompt-tokens tokens")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens compared")
    p.add_argument("--atol", type=float, default=1e-3, help="largest logit difference accepted")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from moekv import LLM, SamplingParams

    llm = LLM(str(args.model), dtype="float32", device="cpu", max_model_len=args.prompt_tokens + args.tokens + 16)
    prompt = llm.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.prompt_tokens]
    ours_logits = llm.score([{"prompt_token_ids": prompt}])[0].float()
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                                      ignore_eos=True))[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref_logits = hf(ids).logits[0].float()
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                          min_new_tokens=args.tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=hf.config.pad_token_id)[0, len(prompt):].tolist()
    diff = (ours_logits - ref_logits).abs().max().item()
    record = {"model": str(args.model), "prompt_tokens": len(prompt), "max_logit_diff": diff,
              "moekv_tokens": list(ours), "transformers_tokens": ref, "tokens_equal": list(ours) == ref,
              "ok": list(ours) == ref and diff <= args.atol}
    print(json.dumps(record))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
