"""`moekv` command line: generate | info."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moekv.config import EngineConfig, default_model_path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(default_model_path()),
                   help="Hugging Face checkpoint folder (default: the bundled models/tiny-moe)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV format: auto | bf16 | fp16 | fp32 | fp8_e4m3 | int4 | nuq2 | vq | kivi2 | tiered")
    p.add_argument("--kv-group-size", type=int, default=32, help="int4: channels per scale group; kivi2: tokens (keys) and channels (values) per group (32 or 64)")
    p.add_argument("--kv-outlier-sigma", type=float, default=3.5, help="nuq2: outlier threshold in std devs")
    p.add_argument("--kv-calibration", default=None,
                   help="folder from `moekv calibrate` (default: the checkpoint's kv_calibration/ if it has one)")
    p.add_argument("--kv-codebook", default="auto", choices=["auto", "page", "calibrated"],
                   help="nuq2/tiered: per-page k-means, calibrated codebooks, or auto (calibrated when available)")
    p.add_argument("--kv-rerank-interval", type=int, default=32, help="tiered: decode steps between re-rankings")
    p.add_argument("--kv-tier1-fraction", type=float, default=0.15, help="tiered: share of pages kept in FP8")
    p.add_argument("--kv-residual", type=int, default=128, help="kivi2: newest tokens kept in 16-bit")
    p.add_argument("--routing", default="auto", help="auto | flat | group_limited | hierarchical (auto: group_limited "
                   "when the checkpoint has n_group/topk_group, else flat)")
    p.add_argument("--cluster-map", default=None, help="hierarchical: cluster map file from `moekv cluster`")
    p.add_argument("--clusters-per-token", type=int, default=None, help="hierarchical: most clusters per token (default: the map's)")
    p.add_argument("--cluster-admit-margin", type=float, default=None,
                   help="hierarchical: admit a further cluster while its coarse score is within this of the best (default: the map's)")
    p.add_argument("--n-group", type=int, default=None, help="group_limited: expert groups (default: the checkpoint's)")
    p.add_argument("--topk-group", type=int, default=None, help="group_limited: groups kept per token")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page (default: 16 for bf16/fp16/fp32, 64 for compressed formats)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay decode steps from CUDA graphs (default: graphs on CUDA where the KV format allows)")
    p.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="queue each decode step before the host has read the one before it (default: on CUDA)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of config.json's shape instead of the checkpoint's (benchmarks)")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        num_kv_blocks=args.num_kv_blocks, kv_group_size=args.kv_group_size,
                        kv_outlier_sigma=args.kv_outlier_sigma, kv_calibration=args.kv_calibration,
                        kv_codebook=args.kv_codebook,
                        kv_rerank_interval=args.kv_rerank_interval, kv_tier1_fraction=args.kv_tier1_fraction,
                        kv_residual=args.kv_residual, routing=args.routing, cluster_map=args.cluster_map,
                        clusters_per_token=args.clusters_per_token, cluster_admit_margin=args.cluster_admit_margin,
                        n_group=args.n_group, topk_group=args.topk_group,
                        enforce_eager=getattr(args, "enforce_eager", False),
                        async_scheduling=getattr(args, "async_scheduling", None),
                        load_format=getattr(args, "load_format", "auto"))


def cmd_generate(args: argparse.Namespace) -> int:
    from moekv.engine.llm_engine import LLMEngine
    from moekv.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
                            repetition_penalty=args.repetition_penalty)
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]), add_special_tokens=False)}
    engine.add_request("cli", prompt, params, output_kind="delta")  # printed as it comes; the final output has all
    if not args.chat and not args.quiet:
        print(args.prompt, end="", flush=True)
    start = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
            print(out.delta_text, end="", flush=True)
            final = out
    elapsed = time.perf_counter() - start
    print()
    if final is not None and not args.quiet:
        n = len(final.outputs[0].token_ids)
        print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, finish_reason={final.outputs[0].finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from moekv.config import shipped_kv_calibration
    from moekv.kvcache.formats import KV_FORMAT_NAMES, get_kv_format, kv_options_for
    from moekv.models.loader import load_model_config

    cfg = load_model_config(Path(args.model))
    total, active = cfg.parameter_counts()
    moe_layers = sum(cfg.moe_layers)
    rows = [
        ("architecture", cfg.architecture),
        ("layers", f"{cfg.num_layers} ({moe_layers} with experts)"),
        ("hidden size", cfg.hidden_size),
        ("attention heads", f"{cfg.num_heads} query / {cfg.num_kv_heads} KV, head_dim {cfg.head_dim}"),
        ("experts", f"{cfg.num_experts}, top-{cfg.top_k}, intermediate {cfg.moe_intermediate_size}"
                    + (f", shared expert {cfg.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size else "")),
        ("vocabulary", cfg.vocab_size),
        ("max positions", cfg.max_position_embeddings),
        ("parameters", f"{total:,} total, {active:,} active per token ({100 * active / total:.1f}%)"),
        ("checkpoint dtype", str(cfg.torch_dtype).replace("torch.", "")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nKV cache per token (all {cfg.num_layers} layers, K and V, block_size {args.block_size}):")
    for name in KV_FORMAT_NAMES:
        if name == "auto":
            continue
        try:
            fmt = get_kv_format(name, cfg.torch_dtype, **kv_options_for(name, dict(group_size=args.kv_group_size,
                                calibration=args.kv_calibration or shipped_kv_calibration(args.model))))
            fmt.check_layout(cfg.num_kv_heads, args.block_size, cfg.head_dim)
        except ValueError as e:  # e.g. needs calibration, or cannot lay out this block size
            print(f"  {name:<10} n/a: {e}")
            continue
        page = fmt.page_bytes(cfg.num_kv_heads, args.block_size, cfg.head_dim)
        per_token = cfg.num_layers * page / args.block_size
        bits = fmt.bits_per_element(cfg.num_kv_heads, args.block_size, cfg.head_dim)
        print(f"  {name:<10} {per_token:>10,.0f} bytes/token  {bits:5.2f} bits/element")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    import json

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekv", description="Inference engine for Mixture-of-Experts models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming tokens to the terminal")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--quiet", action="store_true", help="print only the generated text")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="quality measurements")
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
    from moekv.cli_routing import add_cluster_parser, add_eval_routing_parser

    add_eval_routing_parser(ev_sub, add_engine_args)
    add_cluster_parser(sub)

    info = sub.add_parser("info", help="architecture, parameter counts and KV bytes per token of a checkpoint")
    info.add_argument("--model", default=str(default_model_path()))
    info.add_argument("--block-size", type=int, default=64)
    info.add_argument("--kv-group-size", type=int, default=32)
    info.add_argument("--kv-calibration", default=None)
    info.set_defaults(func=cmd_info)

    from moekv.cli_calibrate import add_calibrate_parser

    add_calibrate_parser(sub)

    from moekv.cli_bench import add_bench_parser
    from moekv.cli_serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"moekv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
