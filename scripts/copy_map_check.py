#!/usr/bin/env python3
"""CPU check of the copy rows' learnability (issue 23; docs/decisions.md, "domain-moe's training recipe"):
train_domain_moe's Mixtral at a toy size, trained only on repeated random spans, with the span tokens
drawn from a pool of P ids.

Rows of 128 tokens: noise ids 1..4095, a span of 32 pool ids at `a`, the same span at `b`; the loss is
the mean over the repeat after its first token (the targets copying predicts). --offset fixed puts the
span at 10 and 60 (a constant offset: only the copy map ids -> logits has to form); --offset random
draws a in 0..29 and b - (a + 32) in 0..29 (the attention must find the earlier occurrence by content:
an induction head). One thread; ~0.3-1 s a step on a shared 2-core CPU.

  python scripts/copy_map_check.py --pool 64 --steps 300      # fixed offset: 4.19 -> 0.00 by step ~125
  python scripts/copy_map_check.py --pool 4095 --steps 300    # fixed offset: 8.35 flat (ln 4095 = 8.32)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_domain_moe as T  # noqa: E402


def main(argv: list[str] | None = None) -> list[tuple[int, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", type=int, default=64, help="span tokens are ids 1..POOL")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--offset", choices=("fixed", "random"), default="fixed")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = T.parse_args(["--data", "x", "--out", "/tmp/unused", "--hidden-size", "128", "--num-layers", "2",
                         "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "32", "--num-experts", "4",
                         "--intermediate-size", "128", "--max-position-embeddings", "256", "--curriculum", "128:1"])
    model = T.build_model(args, 4096, 0)
    model.set_experts_implementation("eager")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    length, s, rows = 128, 32, a.rows
    curve, t0 = [], time.time()
    for step in range(1, a.steps + 1):
        ids = torch.randint(1, 4096, (rows, length))
        toks = torch.randint(1, a.pool + 1, (rows, s))
        mask = torch.zeros(rows, length - 1, dtype=torch.bool)
        for i in range(rows):
            if a.offset == "fixed":
                start, rep = 10, 60
            else:
                start = int(torch.randint(0, 30, ()))
                rep = start + s + int(torch.randint(0, 30, ()))
            ids[i, start : start + s] = toks[i]
            ids[i, rep : rep + s] = toks[i]
            mask[i, rep : rep + s - 1] = True  # predicting ids[rep+1 .. rep+s-1]
        logits = model(input_ids=ids).logits[:, :-1]
        per_tok = F.cross_entropy(logits.reshape(-1, 4096), ids[:, 1:].reshape(-1), reduction="none")
        loss = per_tok.view(rows, -1)[mask].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            curve.append((step, loss.item()))
            print(f"pool {a.pool} offset {a.offset} step {step} copy loss {loss.item():.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    return curve


if __name__ == "__main__":
    main()
