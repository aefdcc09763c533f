#!/usr/bin/env python3
"""INT4 weight recipes on domain-moe: perplexity per held-out domain through the engine (CPU, fp32
activations, --mode prefill) for each way of rounding the experts, attention projections and LM head,
with the bits each recipe stores per weight.

The model loads once, 16-bit; each recipe quantizes the saved weights afresh and swaps them in
(the engine dispatches on the weight's type at every call, so the same engine serves every recipe).
A recipe names, per kind (experts, attention, head), a rounding and a group size:
  rtn      round-to-nearest, zero points (ops/quantized_weight.quantize_int4)
  gptq     GPTQ on the second moments of the inputs that the calibration text gives the weight in
           the 16-bit model, every layer's collected at once (fp64), natural column order
           (models/gptq.gptq_int4): how quantization_calibration rounded before it went block by block
  gptq-ao  GPTQ in descending order of H's diagonal ("act order"), group scales taken before any
           column moves (static groups, so the groups stay contiguous and the layout is unchanged)
  16       the weight stays 16-bit
Whole-model recipes: 'gptq-blocks128' is the engine's quantization_calibration (models/gptq.round_blockwise:
one decoder layer at a time, each on the inputs the layers rounded before it give, second moments added
in fp32); 'gptq-blocks128-fp64' the same with fp64 second moments. GPTQ recipes record the calibration's
seconds, the most second-moment bytes alive at once, and the process's peak RSS (meaningful for a recipe
run alone in its process: one --recipes name per run).
Second moments: collected by the engine's calibration (what `quantization_calibration` runs: the
experts' routed rows, the attention projections' inputs, the final norm's output for the LM head). Calibration
text: the training parts of the four domains (models/domain-moe/README.md: never the held-out text),
about 2,048 tokens each, concatenated (8,192 tokens: what the engine's quantization_calibration reads).

Bits per weight: 4 + 32 / group (a 16-bit scale and a 16-bit zero point per group), 16 for a 16-bit
weight; averaged over all the weights int4 would quantize, for domain-moe and for the Mixtral-8x7B
shape (where the experts are 96% of them).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/int4_recipes.py --recipes rtn128 rtn64 \\
        --out benchmarks/results/cpu/int4_recipes_domain-moe.json   # recipes already in --out are kept
"""
from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.eval.perplexity import perplexity_domains, text_files  # noqa: E402
from moekv.models import gptq  # noqa: E402
from moekv.models.gptq import ExpertInputs, InputMoments, gptq_int4  # noqa: E402
from moekv.models.quantize import replace_weight  # noqa: E402
from moekv.ops.quantized_weight import QuantizedWeight, pack_int4, quantize_int4, unpack_int4  # noqa: E402

MODEL = REPO / "models/domain-moe"
HELDOUT = MODEL / "heldout"
DATA = REPO.parent.parent / "shared" / "data"  # /work/shared/data from /work/wt/NAME
CALIB_TOKENS = 8192


def parse_recipe(name: str) -> dict:
    """'rtn128' -> every kind rtn in groups of 128; 'E:gptq-ao/128,A:rtn/128,H:rtn/64' per kind
    (E experts, A attention, H head; '16' for a 16-bit kind)."""
    if ":" not in name:
        rounding = "".join(c for c in name if not c.isdigit())
        group = int("".join(c for c in name if c.isdigit()))
        return {kind: (rounding, group) for kind in "EAH"}
    recipe = {}
    for part in name.split(","):
        kind, spec = part.split(":")
        if spec == "16":
            recipe[kind] = ("16", 0)
        else:
            rounding, group = spec.split("/")
            recipe[kind] = (rounding, int(group))
    return recipe


def bits(rounding: str, group: int) -> float:
    return 16.0 if rounding == "16" else 4 + 32 / group


def mean_bits(recipe: dict, counts: dict) -> float:
    return sum(bits(*recipe[k]) * counts[k] for k in "EAH") / sum(counts.values())


def mixtral_counts() -> dict:
    h, i, layers, experts, vocab, q, kv = 4096, 14336, 32, 8, 32000, 4096, 1024
    return {"E": layers * experts * 3 * h * i, "A": layers * (h * (q + 2 * kv) + q * h), "H": vocab * h}


def calibration_text(tokenizer) -> str:
    """CALIB_TOKENS / 4 tokens of each domain's training part (README: heldout/ is the novels' ends, Tiny
    Shakespeare's last 10%, every 20th stdlib module, math from seed 1235), one after the other. Cut by
    tokens, not characters: a domain's characters per token range from 1.4 (math) to 3.3 (prose), and
    the engine calibrates on the text's first CALIB_TOKENS tokens, so equal characters would leave the
    last domain out."""
    from prepare_domain_data import math_corpus

    per_domain = CALIB_TOKENS // 4
    sources = (
        (DATA / "text/pg2600.txt").read_text(encoding="utf-8")[200_000:260_000],
        (DATA / "text/tinyshakespeare.txt").read_text(encoding="utf-8")[100_000:160_000],
        (DATA / "code/cpython311_stdlib.txt").read_text(encoding="utf-8")[300_000:360_000],
        "".join(math_corpus(1234, 60_000)),  # the training seed
    )
    parts = []
    for text in sources:
        ids = tokenizer.encode(text)[:per_domain - 8]  # a few tokens of slack for the joins' re-tokenization
        parts.append(tokenizer.decode(ids))
    return "\n".join(parts)


def calibration_prompts(llm, text: str) -> list[dict]:
    """The text's first CALIB_TOKENS tokens as prompts of 512 tokens (what quantization_calibration runs)."""
    ids = llm.engine.tokenizer.encode(text)[:CALIB_TOKENS]
    return [{"prompt_token_ids": ids[i:i + 512]} for i in range(0, len(ids), 512) if len(ids[i:i + 512]) > 1]


def calibrate(llm, text: str) -> tuple[dict, dict]:
    """Second moments (fp64) of every quantizable weight's inputs over the calibration prompts
    (prefill), the model 16-bit, every layer's collected in the one pass (all at once, the engine's
    definition before it went block by block): ({weight name: H}, {seconds, second_moment_bytes})."""
    t0 = time.perf_counter()
    model = llm.engine.runner.model
    cfg = llm.engine.model_config
    moments = InputMoments(torch.float64)
    collectors = []
    for i, layer in enumerate(model.layers):
        hooks = layer.hooks
        hooks.experts = ExpertInputs(hooks.experts, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     torch.device("cpu"), torch.float64)
        collectors.append(hooks.experts)
        hooks.projection_observer = lambda name, x, i=i: moments.observe(f"layers.{i}.self_attn.{name}", x)
    model.hooks.hidden_observer = lambda hidden: moments.observe("lm_head", hidden)
    try:
        llm.generate(calibration_prompts(llm, text), SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        model.hooks.hidden_observer = None
        for layer, collector in zip(model.layers, collectors):
            layer.hooks.experts, layer.hooks.projection_observer = collector.inner, None
    hess = dict(moments.h)
    for i, collector in enumerate(collectors):
        hess[f"layers.{i}.mlp.w13"], hess[f"layers.{i}.mlp.w2"] = collector.h13, collector.h2
    return hess, {"collect_seconds": time.perf_counter() - t0,
                  "second_moment_bytes": sum(h.nbytes for h in hess.values())}


def calibrate_blockwise(llm, text: str, dtype: torch.dtype) -> dict:
    """The engine's quantization_calibration on the model's current (16-bit) weights: the calibration
    prompts recorded, then round_blockwise (second moments added in `dtype`), which rounds the
    experts, attention projections and LM head in place. -> {seconds, second_moment_bytes}."""
    t0 = time.perf_counter()
    runner = llm.engine.runner
    kept, gptq.HESSIAN_DTYPE = gptq.HESSIAN_DTYPE, dtype
    try:
        runner.start_weight_calibration()
        done = False
        try:
            llm.generate(calibration_prompts(llm, text), SamplingParams(max_tokens=1, temperature=0.0))
            done = True
        finally:
            stats = runner.finish_weight_calibration(round_weights=done)
    finally:
        gptq.HESSIAN_DTYPE = kept
    return {"seconds": time.perf_counter() - t0, "round_seconds": stats.seconds,
            "second_moment_bytes": stats.peak_bytes}


def named_weights(model) -> dict:
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.self_attn.qkv_proj"] = layer.self_attn.qkv_proj
        out[f"layers.{i}.self_attn.o_proj"] = layer.self_attn.o_proj
        out[f"layers.{i}.mlp.w13"] = layer.mlp.w13
        out[f"layers.{i}.mlp.w2"] = layer.mlp.w2
    out["lm_head"] = model.lm_head
    return out


def owner(model, name: str):
    *path, attr = name.split(".")
    module = model
    for p in path:
        module = module[int(p)] if p.isdigit() else getattr(module, p)
    return module, attr


def round_weight(w: torch.Tensor, rounding: str, group: int, hessian) -> QuantizedWeight | torch.Tensor:
    if rounding == "16":
        return w
    stacked = w.dim() == 3
    mats = list(w) if stacked else [w]
    hs = list(hessian) if stacked and hessian is not None else [hessian] * len(mats)
    if rounding == "rtn":
        parts = [quantize_int4(m, group, zero_point=True) for m in mats]
    elif rounding == "mse":
        parts = [mse_int4(m, group) for m in mats]
    elif rounding in ("gptq", "gptq-ao"):
        parts = [gptq_int4(m, h, group, act_order=rounding == "gptq-ao") for m, h in zip(mats, hs)]
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    if not stacked:
        return parts[0]
    return QuantizedWeight("int4", tuple(w.shape), torch.stack([p.codes for p in parts]),
                           torch.stack([p.scales for p in parts]), (1, group), torch.stack([p.zeros for p in parts]))


def mse_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    """Round-to-nearest with each group's range [lo, hi] shrunk by the factor (1.0 .. 0.70) that gives
    the group the least squared error (quantize_int4 of the shrunk range; values outside clamp)."""
    N, K = w.shape
    groups = -(-K // group)
    best, best_err = None, torch.full((N, groups), float("inf"))
    for ratio in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        pad = torch.nn.functional.pad(w, (0, -K % group)).reshape(N, groups, group)
        lo, hi = pad.amin(-1).clamp_max(0.0) * ratio, pad.amax(-1).clamp_min(0.0) * ratio
        scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        zeros = (-lo / scales).round().clamp(0, 15)
        q = ((pad / scales[..., None]).round() + zeros[..., None]).clamp(0, 15)
        err = ((q - zeros[..., None]) * scales[..., None] - pad).pow(2).sum(-1)
        cand = QuantizedWeight("int4", (N, K), pack_int4(q.reshape(N, -1)[:, :K].to(torch.int64)), scales, (1, group),
                               zeros)
        if best is None:
            best = cand
        take = err < best_err
        best_err = torch.where(take, err, best_err)
        codes = torch.where(take.repeat_interleave(group, 1)[:, :K], unpack_int4(cand.codes), unpack_int4(best.codes))
        best = QuantizedWeight("int4", (N, K), pack_int4(codes), torch.where(take, scales, best.scales), (1, group),
                               torch.where(take, zeros, best.zeros))
    return best


def apply(model, saved: dict, recipe: dict, hess: dict | None) -> None:
    for name, w in saved.items():
        kind = "H" if name == "lm_head" else "E" if ".mlp." in name else "A"
        rounding, group = recipe[kind]
        module, attr = owner(model, name)
        new = round_weight(w, rounding, group, None if hess is None else hess.get(name))
        if isinstance(new, QuantizedWeight):
            replace_weight(module, attr, new)
        else:
            module._modules.pop(attr, None)
            module._parameters[attr] = nn.Parameter(new, requires_grad=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", required=True, help="'16', 'rtn128', 'E:gptq-ao/128,A:rtn/128,H:rtn/64'")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--redo", nargs="*", default=[], help="recipes to measure again though --out holds them")
    p.add_argument("--out", required=True)
    p.add_argument("--write-calibration", metavar="TEXT_FILE",
                   help="also write the calibration text (for the engine's --quantization-calibration)")
    args = p.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {
        "device": "cpu", "torch": torch.__version__, "model": "models/domain-moe",
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/int4_recipes.py --recipes ... --out "
                   + str(args.out),
        "max_tokens": args.max_tokens, "mode": "prefill", "calibration": (
            f"{CALIB_TOKENS // 4 - 8:,} tokens each of ../shared/data/text/pg2600.txt from character 200,000, "
            f"tinyshakespeare.txt from 100,000, code/cpython311_stdlib.txt from 300,000 and the math generator's "
            f"training seed (1234), decoded and joined by newlines"),
        "recipes": {}}
    llm = LLM(str(MODEL), device="cpu")
    if args.write_calibration:
        Path(args.write_calibration).write_text(calibration_text(llm.engine.tokenizer), encoding="utf-8")
    model = llm.engine.runner.model
    saved = {n: w.data.clone() for n, w in named_weights(model).items()}
    counts_here = {"E": 0, "A": 0, "H": 0}
    for n, w in saved.items():
        counts_here["H" if n == "lm_head" else "E" if ".mlp." in n else "A"] += w.numel()
    texts = text_files(HELDOUT)
    hess = None
    blockwise = {"gptq-blocks128": torch.float32, "gptq-blocks128-fp64": torch.float64}
    for name in args.recipes:
        if name in record["recipes"] and name not in args.redo:
            print(f"{name}: kept from {out}")
            continue
        extra = {}
        if name in blockwise:
            recipe = {k: ("gptq-blocks", 128) for k in "EAH"}
            apply(model, saved, {k: ("16", 0) for k in "EAH"}, None)
            extra = calibrate_blockwise(llm, calibration_text(llm.engine.tokenizer), blockwise[name])
            quant_s = extra["seconds"]
        else:
            recipe = {k: ("16", 0) for k in "EAH"} if name == "16" else parse_recipe(name)
            if hess is None and any(r.startswith("gptq") for r, _ in recipe.values()):
                apply(model, saved, {k: ("16", 0) for k in "EAH"}, None)
                hess, extra = calibrate(llm, calibration_text(llm.engine.tokenizer))
                print(f"calibration: {extra['collect_seconds']:.0f} s", flush=True)
            t0 = time.perf_counter()
            apply(model, saved, recipe, hess)
            quant_s = time.perf_counter() - t0
            if extra:
                extra["seconds"] = extra["collect_seconds"] + quant_s
        results, total = perplexity_domains(llm, texts, max_tokens=args.max_tokens, progress=False, mode="prefill")
        entry = {"recipe": {k: list(v) for k, v in recipe.items()},
                 "bits_per_weight": mean_bits(recipe, counts_here), "bits_per_weight_mixtral_8x7b":
                 mean_bits(recipe, mixtral_counts()), "quantize_seconds": quant_s,
                 **({"calibration": extra | {"process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                             / 1024}} if extra else {}),
                 "ppl": {d: r.ppl for d, r in results.items()} | {"all": total.ppl},
                 "tokens": {d: r.tokens for d, r in results.items()}}
        base = record["recipes"].get("16")
        if base is not None:
            entry["change"] = {d: entry["ppl"][d] / base["ppl"][d] - 1 for d in entry["ppl"]}
        record["recipes"][name] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
        change = entry.get("change", {})
        print(f"{name:40s} {entry['bits_per_weight']:.3f} b ({entry['bits_per_weight_mixtral_8x7b']:.3f} Mixtral)  "
              + "  ".join(f"{d} {entry['ppl'][d]:.4f} ({100 * change.get(d, math.nan):+.2f}%)" for d in entry["ppl"]),
              flush=True)


if __name__ == "__main__":
    main()
