"""`moekv eval ppl` (perplexity through the engine's KV cache), `moekv eval routing` (agreement
with flat routing, per-layer output error, perplexity, locality, fan-out) and `moekv eval retrieval`
(passkey accuracy by context length and needle depth)."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from moekv.cli.engine_args import add_engine_args, llm_from
from moekv.cli.experts import add_eval_experts_parser


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from moekv.eval.perplexity import perplexity, text_files

    texts = text_files(args.text)  # checked before the model loads
    if len(args.text) > 1 or Path(args.text[0]).is_dir():
        return _eval_ppl_domains(args, texts)
    llm = llm_from(args)
    text = args.text[0]
    result = perplexity(llm, text, window=args.window, stride=args.stride, max_tokens=args.max_tokens,
                        progress=not args.json, mode=args.mode)
    record = result.to_dict()
    if args.reference_transformers:
        _add_transformers(args, llm, text, result, record)
    if not args.json:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens of {text} "
              f"(window {result.window}, stride {result.stride}, KV {result.kv_cache_dtype} at "
              f"{result.bits_per_element:.2f} bits/element, {result.seconds:.1f} s)")
        if args.reference_transformers:
            print(f"transformers: {record['transformers_ppl']:.4f} "
                  f"({100 * record['relative_diff_vs_transformers']:+.4f}%)")
    print(json.dumps(record) if args.json else "")
    return 0


def _add_transformers(args: argparse.Namespace, llm, text, result, record: dict) -> None:
    """transformers' perplexity of the same windows, and the relative difference, into record."""
    from moekv.eval.perplexity import perplexity_transformers, read_text_tokens

    ids = read_text_tokens(llm.tokenizer, text, args.max_tokens)
    ref_ppl, ref_tokens = perplexity_transformers(args.model, ids, result.window, result.stride,
                                                  dtype=llm.engine.runner.dtype, device=args.device,
                                                  progress=not args.json)
    assert ref_tokens == result.tokens
    record["transformers_ppl"] = ref_ppl
    record["relative_diff_vs_transformers"] = result.ppl / ref_ppl - 1


def _eval_ppl_domains(args: argparse.Namespace, texts: dict) -> int:
    """Several texts (or a folder): each one's perplexity, named by its stem, and the token-weighted total.
    The JSON record is the total's (the single-text fields) with "domains": {name: that text's record}."""
    from moekv.eval.perplexity import perplexity_domains

    llm = llm_from(args)
    results, total = perplexity_domains(llm, texts, window=args.window, stride=args.stride,
                                        max_tokens=args.max_tokens, progress=not args.json, mode=args.mode)
    record = total.to_dict()
    record["domains"] = {name: r.to_dict() for name, r in results.items()}
    if args.reference_transformers:
        for name, r in results.items():
            _add_transformers(args, llm, texts[name], r, record["domains"][name])
        ref_nll = sum(math.log(d["transformers_ppl"]) * d["tokens"] for d in record["domains"].values())
        record["transformers_ppl"] = math.exp(ref_nll / total.tokens)
        record["relative_diff_vs_transformers"] = total.ppl / record["transformers_ppl"] - 1
    if not args.json:
        width = max(8, *(len(n) for n in results))
        ref = " transformers" if args.reference_transformers else ""
        print(f"{'text':<{width}} {'tokens':>9} {'perplexity':>11}{ref}")
        for name, d in [*record["domains"].items(), ("total", record)]:
            line = f"{name:<{width}} {d['tokens']:>9,} {d['ppl']:>11.4f}"
            if args.reference_transformers:
                line += f" {d['transformers_ppl']:>12.4f} ({100 * d['relative_diff_vs_transformers']:+.4f}%)"
            print(line)
        print(f"(window {total.window}, stride {total.stride}, KV {total.kv_cache_dtype} at "
              f"{total.bits_per_element:.2f} bits/element, {total.seconds:.1f} s)")
    print(json.dumps(record) if args.json else "")
    return 0


def _at_least(low: int):
    """argparse type: an integer >= low (so `--stride 0` is an error, not the default)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: an integer >= {low}")
        return value
    return parse


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

    llm = llm_from(args)
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
                      f"{p['locality']:.3f}, fan-out {p['fan_out']:.2f} (max {p['max_fan_out']}), "
                      f"{p['cross_device_bytes_per_token']:,.0f} cross-device bytes/token")
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
    p.add_argument("--window", type=_at_least(2), default=None, help="tokens per window (default: max_model_len)")
    p.add_argument("--stride", type=_at_least(1), default=None, help="window advance (default: window / 2)")
    p.add_argument("--mode", default="prefill", choices=["decode", "prefill"],
                   help="prefill (default: routing does not depend on the KV cache) or decode")
    p.add_argument("--num-devices", type=int, default=None, help="devices of the placement (default: one per cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_eval_routing)
    return p


def _depth(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"depth must be in [0, 1], got {s}")
    return value


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    import sys

    from moekv.eval.retrieval import evaluate_retrieval, plot_heatmap

    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise FileNotFoundError(f"--plot {args.plot}: its folder does not exist")
    if args.seed != 0:  # (the engine seed's default) --seed once meant the keys' seed here
        print(f"note: --seed {args.seed} seeds the engine's sampler, as in every moekv command (retrieval answers "
              f"greedily: it changes nothing here); the keys' and filler offsets' seed is --key-seed", file=sys.stderr)
    llm = llm_from(args)
    result = evaluate_retrieval(llm, args.text, lengths=args.lengths, depths=args.depths, trials=args.trials,
                                seed=args.key_seed, answer_tokens=args.answer_tokens, progress=not args.json)
    if args.plot:
        plot_heatmap(result, args.plot)
    if not args.json:
        print(f"passkey retrieval, KV {result.kv_cache_dtype} ({result.bits_per_element:.2f} bits/element), "
              f"{result.trials} trials per cell, filler from {args.text}")
        print(f"{'depth':>6} " + " ".join(f"{n:>7}" for n in result.lengths))
        for depth, row in zip(result.depths, result.grid()):
            print(f"{depth:>6g} " + " ".join(f"{100 * a:>6.0f}%" for a in row))
        print(f"{'all':>6} " + " ".join(f"{100 * result.accuracy_by_length[str(n)]:>6.1f}%"
                                         for n in result.lengths))
        print(f"accuracy {100 * result.accuracy:.1f}% over {len(result.answers)} prompts ({result.seconds:.1f} s)")
        if args.plot:
            print(f"heat map: {args.plot}", file=sys.stderr)
    print(json.dumps(result.to_dict()) if args.json else "")
    return 0


def add_eval_retrieval_parser(eval_subparsers) -> argparse.ArgumentParser:
    """Register `eval retrieval` on the `moekv eval` sub-command parsers."""
    from moekv.eval.retrieval import DEFAULT_ANSWER_TOKENS, DEFAULT_DEPTHS

    p = eval_subparsers.add_parser("retrieval", help="passkey retrieval accuracy by context length and needle depth")
    add_engine_args(p)
    p.add_argument("--text", required=True, help="UTF-8 text file the filler is taken from (unseen in training)")
    p.add_argument("--lengths", type=_at_least(1), nargs="+", default=None,
                   help="context lengths in tokens, prompt and answer together (default: a quarter, half and all "
                        "of max_model_len: 1024 2048 4096 for domain-moe)")
    p.add_argument("--depths", type=_depth, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="needle depths in [0, 1] (default: 0.0 0.1 ... 1.0)")
    p.add_argument("--trials", type=_at_least(1), default=10, help="keys per (length, depth) cell")
    p.add_argument("--key-seed", type=int, default=0,
                   help="seed of the keys and filler offsets (--seed is the engine's)")
    p.add_argument("--answer-tokens", type=_at_least(1), default=DEFAULT_ANSWER_TOKENS,
                   help="tokens generated per prompt (greedy)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a heat map (depth x length)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_eval_retrieval)
    return p


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register `eval` (with `eval ppl`, `eval routing` and `eval retrieval`) on the `moekv` sub-command parsers."""
    ev = subparsers.add_parser("eval", help="quality measurements")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("ppl", help="perplexity of a text file through the engine's KV cache",
                            description="Perplexity of a text through the engine's KV cache. The default --mode decode "
                                        "runs one engine step per scored token, as generation reads the cache; "
                                        "--mode prefill is faster and optimistic for compressed formats. The "
                                        "progress bar counts scored tokens.")
    add_engine_args(ppl)
    ppl.add_argument("--text", required=True, action="append",
                     help="UTF-8 text file, or a folder of .txt files; repeat it to score several texts: each "
                          "one's perplexity (named by file stem) and their token-weighted total")
    ppl.add_argument("--max-tokens", type=int, default=None,
                     help="score at most this many tokens of the text (default: all of it)")
    ppl.add_argument("--window", type=_at_least(2), default=None, help="tokens per window (default: max_model_len)")
    ppl.add_argument("--stride", type=_at_least(1), default=None, help="window advance (default: window / 2)")
    ppl.add_argument("--mode", default="decode", choices=["decode", "prefill"],
                     help="decode: each window's context is one prefill, then its scored tokens are fed "
                          "one engine step each (up to 32 windows side by side), reading the KV cache as generation "
                          "does; it costs one step per scored token (domain-moe on a 2-core CPU: about 150 tokens/s). "
                          "prefill: each window in a few prefill steps, some 25x faster there, but optimistic for the "
                          "compressed formats (a prefill chunk attends to its own tokens' K/V unquantized)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ppl.add_argument("--reference-transformers", action="store_true",
                     help="also score the same windows with transformers (needs it installed)")
    ppl.set_defaults(func=cmd_eval_ppl)
    add_eval_routing_parser(ev_sub)
    add_eval_retrieval_parser(ev_sub)
    add_eval_experts_parser(ev_sub)
    return ev
