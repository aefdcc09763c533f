#!/usr/bin/env python3
"""Where a KV format's perplexity goes: keys or values, quantized after RoPE (as moekv stores them) or
before it (as KVQuant stores keys), on a checkpoint's held-out text.

The model runs in `transformers` (float32) with an attention function that passes the keys and/or the
values of every layer through a moekv format's quantize -> dequantize, page by page (64-token pages by
default; a window's every full page, as a prefill of a long prompt stores them). With `--pre-rope` the
keys are quantized before the rotary embedding is applied to them (the model's `apply_rotary_pos_emb`
is wrapped), which moekv's kernels do not read: it measures what storing keys that way would buy.
Perplexity is scored on the second half of each window (the first half is context), against the same
windows unquantized.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/kv_error_split.py \\
        --out benchmarks/results/cpu/kv_error_split_domain-moe.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moekv.kvcache.formats import get_kv_format

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "domain-moe"
# (label, format, kinds quantized, keys before RoPE)
DEFAULT_RUNS = [
    ("nuq2, keys", "nuq2", ("key",), False),
    ("nuq2, values", "nuq2", ("value",), False),
    ("nuq2, both", "nuq2", ("key", "value"), False),
    ("kivi2, keys", "kivi2", ("key",), False),
    ("kivi2, values", "kivi2", ("value",), False),
    ("nuq2, keys before RoPE", "nuq2", ("key",), True),
    ("kivi2, keys before RoPE", "kivi2", ("key",), True),
    ("nuq2, both, keys before RoPE", "nuq2", ("key", "value"), True),
]


def quantize_pages(x: torch.Tensor, fmt, kind: str, page: int) -> torch.Tensor:
    """x [B, H, T, D] through fmt's quantize -> dequantize in pages of `page` tokens (a partial last
    page is left as it is, as the engine stages it in 16 bits)."""
    B, H, T, D = x.shape
    n = T // page
    pages = x[:, :, :n * page].reshape(B, H, n, page, D).permute(0, 2, 1, 3, 4).reshape(B * n, H, page, D)
    out = fmt.dequantize(fmt.quantize(pages.float(), kind), kind)
    out = out.reshape(B, n, H, page, D).permute(0, 2, 1, 3, 4).reshape(B, H, n * page, D)
    return torch.cat([out.to(x.dtype), x[:, :, n * page:]], dim=2)


class Quantizer:
    """What the patched attention applies: None, or (fmt, kinds, pre_rope, page)."""

    def __init__(self):
        self.setting = None

    def keys_before_rope(self, k):
        fmt, kinds, pre, page = self.setting or (None, (), False, 0)
        return quantize_pages(k, fmt, "key", page) if pre and "key" in kinds else k

    def after_rope(self, k, v):
        fmt, kinds, pre, page = self.setting or (None, (), False, 0)
        if "key" in kinds and not pre:
            k = quantize_pages(k, fmt, "key", page)
        if "value" in kinds:
            v = quantize_pages(v, fmt, "value", page)
        return k, v


def load(model_dir: Path, quantizer: Quantizer):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, q, k, v, mask, **kw):
        k, v = quantizer.after_rope(k, v)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    ALL_ATTENTION_FUNCTIONS.register("moekv_kv_quant", attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="moekv_kv_quant").eval()
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    rotate = modeling.apply_rotary_pos_emb

    def rotate_quantized(q, k, cos, sin, *args, **kwargs):
        return rotate(q, quantizer.keys_before_rope(k), cos, sin, *args, **kwargs)

    modeling.apply_rotary_pos_emb = rotate_quantized
    return model


def perplexity(model, windows: dict[str, list[list[int]]]) -> dict[str, float]:
    out = {}
    for name, rows in windows.items():
        nll, count = 0.0, 0
        for ids in rows:
            x = torch.tensor([ids])
            half = len(ids) // 2
            with torch.no_grad():
                logits = model(x).logits[0, half - 1:-1].float()
            nll += torch.nn.functional.cross_entropy(logits, x[0, half:], reduction="sum").item()
            count += len(ids) - half
        out[name] = math.exp(nll / count)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--domains", nargs="+", default=["prose", "code", "math"], help="held-out/<name>.txt")
    p.add_argument("--windows", type=int, default=2, help="windows per domain")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    windows = {}
    for name in args.domains:
        ids = tok.encode((args.model / "heldout" / f"{name}.txt").read_text(encoding="utf-8"),
                         add_special_tokens=False).ids
        windows[name] = [ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    quantizer = Quantizer()
    model = load(args.model, quantizer)
    start = time.perf_counter()
    base = perplexity(model, windows)
    print("unquantized:", {k: round(v, 3) for k, v in base.items()}, flush=True)
    record = {"model": args.model.name, "dtype": "float32", "page": args.page, "window": args.window,
              "windows_per_domain": args.windows, "scored": "second half of each window",
              "command": "python benchmarks/quality/kv_error_split.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "model")),
              "unquantized": base, "runs": []}
    for label, name, kinds, pre in DEFAULT_RUNS:
        quantizer.setting = (get_kv_format(name, torch.float32), kinds, pre, args.page)
        ppl = perplexity(model, windows)
        change = {k: 100 * (ppl[k] / base[k] - 1) for k in ppl}
        record["runs"].append({"label": label, "format": name, "kinds": list(kinds), "keys_before_rope": pre,
                               "ppl": ppl, "change_percent": change})
        print(f"{label}: " + ", ".join(f"{k} {v:+.1f}%" for k, v in change.items()), flush=True)
        args.out.write_text(json.dumps(record, indent=1))
    quantizer.setting = None
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
