"""`moekv eval ppl` (perplexity through the engine's KV cache) and `moekv eval routing` (agreement
with flat routing, per-layer output error, perplexity, locality, fan-out)."""
from __future__ import annotations

import argparse
import json
import math

from moekv.cli.engine_args import add_engine_args, engine_config_from


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from moekv.eval.perplexity import perplexity, perplexity_transformers, read_text_tokens
    from moekv.llm import LLM

    llm = LLM(**vars(engine_config_from(args)))
    result = perplexity(llm, args.text, window=args.window, stride=args.stride, max_tokens=args.max_tokens,
                        progress=not args.json, mode=args.mode)
    record = result.to_dict()
    if args.reference_transformers:
        ids = read_text_tokens(llm.tokenizer, args.text, args.max_tokens)
        ref_ppl, ref_tokens = perplexity_transformers(args.model, ids, result.window, result.stride,
                                                      dtype=llm.engine.runner.dtype, device=args.device,
                                                      progress=not args.json)
        assert ref_tokens == result.tokens
        record["transformers_ppl"] = ref_ppl
        record["relative_diff_vs_transformers"] = result.ppl / ref_ppl - 1
    if not args.json:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens of {args.text} "
              f"(window {result.window}, stride {result.stride}, KV {result.kv_cache_dtype} at "
              f"{result.bits_per_element:.2f} bits/element, {result.seconds:.1f} s)")
        if args.reference_transformers:
            print(f"transformers: {record['transformers_ppl']:.4f} "
                  f"({100 * record['relative_diff_vs_transformers']:+.4f}%)")
    print(json.dumps(record) if args.json else "")
    return 0


def _finite(obj):
    """JSON without Infinity: margins of +-inf become the strings 'inf' / '-inf'."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def cmd_eval_routing(args: argparse.Namespace) -> int:
    from moekv.eval.routing import evaluate_routing
    from moekv.llm import LLM

    llm = LLM(**vars(engine_config_from(args)))
    record = evaluate_routing(llm, args.text, max_tokens=args.max_tokens, window=args.window, stride=args.stride,
                              mode=args.mode, cluster_map=args.cluster_map, num_devices=args.num_devices,
                              progress=not args.json)
    if not args.json:
        print(f"routing {record['routing']}: perplexity {record['ppl']:.4f} "
              f"over {record['tokens']} tokens of {args.text}")
        print(f"top-k agreement with flat: {record['topk_agreement']['set']:.3f} identical sets, "
              f"{record['topk_agreement']['top1']:.3f} identical top-1")
        print(f"{'layer':>5} {'same set':>8} {'same top-1':>10} {'rel. error':>10} {'clusters/tok':>12}")
        for i, s in record["per_layer"].items():
            err = "-" if s["relative_error"] is None else f"{s['relative_error']:.4f}"
            print(f"{i:>5} {s['topk_set_agreement']:>8.3f} {s['top1_agreement']:>10.3f} {err:>10} "
                  f"{s['clusters_per_token']:>12.2f}")
        for label, table in (("this routing", record["placements"]), ("flat routing", record["flat_placements"])):
            for name, p in table.items():
                print(f"{label:<12} under {name:<9} placement ({p['num_devices']} devices): locality "
                      f"{p['locality']:.3f}, fan-out {p['fan_out']:.2f}, {p['cross_device_bytes_per_token']:,.0f} "
                      f"cross-device bytes/token")
        if "ep_bytes_per_token" in record:
            print(f"expert parallel: {record['ep_bytes_per_token']:,.0f} bytes/token really sent between the ranks "
                  f"(placement predicts {record['placements']['engine']['cross_device_bytes_per_token']:,.0f})")
        if "router_flops_per_token" in record:
            f = record["router_flops_per_token"]
            print(f"router FLOPs/token: {f['hierarchical']:,.0f} vs flat {f['flat']:,} "
                  f"({100 * f['saving']:+.1f}% saved)")
    print(json.dumps(_finite(record)) if args.json else "")
    return 0


def add_eval_routing_parser(eval_subparsers) -> argparse.ArgumentParser:
    """Register `eval routing` on the `moekv eval` sub-command parsers."""
    p = eval_subparsers.add_parser("routing", help="routing agreement with flat, per-layer error, perplexity, locality")
    add_engine_args(p)
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--max-tokens", type=int, default=16384, help="score at most this many tokens of the text")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: max_model_len)")
    p.add_argument("--stride", type=int, default=None, help="window advance (default: window / 2)")
    p.add_argument("--mode", default="prefill", choices=["decode", "prefill"],
                   help="prefill (default: routing does not depend on the KV cache) or decode")
    p.add_argument("--num-devices", type=int, default=None, help="devices of the placement (default: one per cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_eval_routing)
    return p


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register `eval` (with `eval ppl` and `eval routing`) on the `moekv` sub-command parsers."""
    ev = subparsers.add_parser("eval", help="quality measurements")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("ppl", help="perplexity of a text file through the engine's KV cache")
    add_engine_args(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens of the text")
    ppl.add_argument("--window", type=int, default=None, help="tokens per window (default: max_model_len)")
    ppl.add_argument("--stride", type=int, default=None, help="window advance (default: window / 2)")
    ppl.add_argument("--mode", default="decode", choices=["decode", "prefill"],
                     help="decode: scored tokens are fed one per step, reading the cache as generation does")
    ppl.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ppl.add_argument("--reference-transformers", action="store_true",
                     help="also score the same windows with transformers (needs it installed)")
    ppl.set_defaults(func=cmd_eval_ppl)
    add_eval_routing_parser(ev_sub)
    return ev
