#!/usr/bin/env python3
"""Does domain-moe have attention sinks, is a sequence's first page quantized worse than the others,
and why does a 2-bit format miss passkeys whose needle sits at depth 0?

The model runs in `transformers` (float32) over held-out prose windows and passkey prompts (the needle
at depth 0, at depth 0.01584, which at 4096 tokens puts it at token 64, the second page's first, and
at 0.25 and 0.5; the model's held-out prose as filler; moekv.eval.needle's format, no BOS token, as
`moekv eval retrieval` builds them); an attention function records every layer's queries, keys (after
RoPE, as the pages store them) and values. Reported:

- sinks: per layer, the attention mass on token 0 and on tokens 0-3 (mean over heads and the queries
  from 256 on; the largest head's too), and token 0's key and value norms over the median token's;
- pages: per layer and kind, the relative error ||x^ - x|| / ||x|| of each 64-token page through a
  format's quantize -> dequantize (nuq2 with per-page codebooks at its default outlier threshold,
  kivi2): page 0; page 0's tokens [S, 64) when the page's statistics leave its first S tokens out (the
  page quantized is then tokens [S, S + 64), a full page without them); the later pages' median;
- needles: per passkey depth, layer and query head, for the prompt's last query: the attention mass on
  the needle's tokens and the logit margin of its best needle key over the best other key, with exact
  K/V and with nuq2's (every full page quantized, the partial last one exact), and the needle tokens'
  key error.

The result file's summary holds the means over the prompts (and the smallest margin over them), by
keys such as `pages:nuq2:key:layer2:depth0.0`, `sinks:layer0:prose`, `needle:depth0.0:layer2:head3`.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/kv_sink_error.py \\
        --out benchmarks/results/cpu/kv_sink_error_domain-moe.json
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moekv.eval.needle import NEEDLE_TEMPLATE, build_prompt, random_key
from moekv.kvcache.formats import get_kv_format

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "domain-moe"
PAGE = 64
ANSWER_TOKENS = 8  # as moekv.eval.retrieval: a prompt of L - 8 tokens


def load(model_dir: Path, record: list):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, q, k, v, mask, **kw):
        record.append((q[0].detach().clone(), k[0].detach().clone(), v[0].detach().clone()))  # [H(kv), T, D]
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    ALL_ATTENTION_FUNCTIONS.register("moekv_kv_record", attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="moekv_kv_record").eval()


def roundtrip(fmt, x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [Hkv, T, D] -> its full pages quantize -> dequantize (the partial last page as it is)."""
    H, T, D = x.shape
    n = T // PAGE
    pages = x[:, :n * PAGE].reshape(H, n, PAGE, D).transpose(0, 1).float()
    out = fmt.dequantize(fmt.quantize(pages, kind), kind).transpose(0, 1).reshape(H, n * PAGE, D)
    return torch.cat([out, x[:, n * PAGE:]], dim=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def page_errors(fmt, x: torch.Tensor, kind: str, sinks: list[int]) -> dict:
    """x [Hkv, T, D] of one layer: page 0's error, page 0 without its first S tokens in the statistics
    (error on tokens [S, 64)), and the later pages' median and largest."""
    xh = roundtrip(fmt, x, kind)
    n = x.shape[1] // PAGE
    later = [rel(xh[:, i * PAGE:(i + 1) * PAGE], x[:, i * PAGE:(i + 1) * PAGE]) for i in range(1, n)]
    out = {"page0": rel(xh[:, :PAGE], x[:, :PAGE]), "later_median": float(torch.tensor(later).median()),
           "later_max": max(later)}
    for s in sinks:
        out[f"page0_from_{s}_with_sinks"] = rel(xh[:, s:PAGE], x[:, s:PAGE])
        shifted = roundtrip(fmt, x[:, s:s + PAGE], kind)  # a whole page that starts after the sinks
        out[f"page0_from_{s}_without_sinks"] = rel(shifted[:, :PAGE - s], x[:, s:PAGE])
    return out


def sink_mass(q: torch.Tensor, k: torch.Tensor, first: int = 256, chunk: int = 512) -> dict:
    """Causal attention mass on token 0 and tokens 0-3 of the queries from `first` on: q [H, T, D],
    k [Hkv, T, D] -> mean and largest head's mean."""
    H, T, D = q.shape
    kk = k.repeat_interleave(H // k.shape[0], dim=0)
    m0, m4 = torch.zeros(H), torch.zeros(H)
    for lo in range(first, T, chunk):
        hi = min(T, lo + chunk)
        s = (q[:, lo:hi] @ kk.transpose(1, 2)) * D ** -0.5  # [H, n, T]
        s = s.masked_fill(torch.arange(T)[None, None] > torch.arange(lo, hi)[None, :, None], float("-inf"))
        w = s.softmax(-1)
        m0 += w[..., 0].sum(-1)
        m4 += w[..., :4].sum((-1, -2))
    m0, m4 = m0 / (T - first), m4 / (T - first)
    return {"token0_mass": m0.mean().item(), "token0_mass_max_head": m0.max().item(),
            "first4_mass": m4.mean().item(), "first4_mass_max_head": m4.max().item()}


def needle_stats(q, k, v, kh, at: int, n: int) -> list[dict]:
    """Per query head, the last query's mass on the needle [at, at + n) and its logit margin (best
    needle key over best other key), with exact keys k and with quantized keys kh; needle key error."""
    H, T, D = q.shape
    g = H // k.shape[0]
    out = []
    needle = torch.zeros(T, dtype=torch.bool)
    needle[at:at + n] = True
    for h in range(H):
        row = {"head": h}
        for tag, keys in (("exact", k), ("nuq2", kh)):
            s = (keys[h // g] @ q[h, -1]) * D ** -0.5
            row[f"mass_{tag}"] = s.softmax(-1)[needle].sum().item()
            row[f"margin_{tag}"] = (s[needle].max() - s[~needle].max()).item()
        row["needle_key_error"] = rel(kh[h // g, at:at + n], k[h // g, at:at + n])
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=4, help="prose windows, and passkey prompts per depth")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.01584, 0.25, 0.5])
    p.add_argument("--sinks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    prose = encode((args.model / "heldout" / "prose.txt").read_text(encoding="utf-8"))
    needle_len = len(encode(NEEDLE_TEMPLATE.format(key="12345")))
    rng = random.Random("kv-sink-error")
    inputs = []  # (label, depth or None, ids, needle position)
    draws = [(rng.randrange(len(prose) - args.length), random_key(rng)) for _ in range(args.prompts)]
    for off, _ in draws:
        inputs.append(("prose", None, prose[off:off + args.length], None))
    for depth in args.depths:  # the same filler and key at every depth, as eval retrieval draws them
        for off, key in draws:
            prompt = build_prompt(encode, prose[off:off + args.length], args.length - ANSWER_TOKENS, depth, key)
            inputs.append((f"depth{depth}", depth, prompt.ids, prompt.needle_position))
    formats = {"nuq2": get_kv_format("nuq2", torch.float32, codebook="page"),
               "kivi2": get_kv_format("kivi2", torch.float32)}
    recorded: list = []
    model = load(args.model, recorded)
    start = time.perf_counter()
    rows, needles = [], []
    for label, depth, ids, at in inputs:
        recorded.clear()
        with torch.no_grad():
            model(torch.tensor([ids]))
        for layer, (q, k, v) in enumerate(recorded):
            base = {"input": label, "layer": layer}
            if depth is None:
                norms = {f"token0_{kind}_norm_over_median":
                         (x[:, 0].norm(dim=-1) / x.norm(dim=-1).median(dim=-1).values).mean().item()
                         for kind, x in (("key", k), ("value", v))}
                rows.append({**base, "what": "sinks", **sink_mass(q, k), **norms})
            for name, fmt in formats.items():
                for kind, x in (("key", k), ("value", v)):
                    rows.append({**base, "what": "pages", "format": name, "kind": kind,
                                 **page_errors(fmt, x, kind, args.sinks)})
            if depth is not None:
                kh = roundtrip(formats["nuq2"], k, "key")
                for r in needle_stats(q, k, v, kh, at, needle_len):
                    needles.append({"depth": depth, "layer": layer, "needle_position": at, **r})
    summary: dict = {}

    def add(key, row):
        s = summary.setdefault(key, {})
        for m, val in row.items():
            if isinstance(val, float):
                s.setdefault(m, []).append(val)

    for r in rows:
        add(":".join(str(x) for x in (r["what"], r.get("format"), r.get("kind"), f"layer{r['layer']}", r["input"])
                     if x is not None), r)
    for r in needles:
        add(f"needle:depth{r['depth']}:layer{r['layer']}:head{r['head']}", r)
    summary = {k: {m: sum(v) / len(v) for m, v in s.items()}
               | {"min_" + m: min(v) for m, v in s.items() if "margin" in m} for k, s in summary.items()}
    for k, s in summary.items():
        print(k, " ".join(f"{m}={v:.3f}" for m, v in s.items()), flush=True)
    command = "python benchmarks/quality/kv_sink_error.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("out", "model"))
    args.out.write_text(json.dumps({"model": args.model.name, "dtype": "float32", "page": PAGE,
                                    "length": args.length, "prompts": args.prompts, "command": command,
                                    "summary": summary}, indent=1))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
