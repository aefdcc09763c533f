"""`moekv info`: architecture, parameter counts, weight bytes and their batch-1 floor for each
--quantization, and KV bytes per token of a checkpoint."""
from __future__ import annotations

import argparse
from pathlib import Path

from moekv.config import default_model_path
from moekv.kvcache.formats.names import DECODE_KERNELS, DEFAULT_DECODE_KERNEL


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:8.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:8.2f} MiB"


def cmd_info(args: argparse.Namespace) -> int:
    from moekv import envs
    from moekv.config import default_block_size, shipped_kv_calibration
    from moekv.kvcache.formats import KV_FORMAT_NAMES, get_kv_format, kv_options_for
    from moekv.models.loader import load_model_config
    from moekv.models.quantize import weight_footprint
    from moekv.ops.quantized_weight import QUANT_METHODS

    envs.check_decode_kernel_unset()  # one clear error, not one per format below
    cfg = load_model_config(Path(args.model))
    total, active = cfg.parameter_counts()
    moe_layers = sum(cfg.moe_layers)
    rows = [
        ("architecture", cfg.architecture),
        ("layers", f"{cfg.num_layers} ({moe_layers} with experts)"),
        ("hidden size", cfg.hidden_size),
        ("attention heads", _attention_text(cfg)),
        ("experts", f"{cfg.num_experts}, top-{cfg.top_k}, intermediate {cfg.moe_intermediate_size}"
                    + (f", shared expert {cfg.shared_expert_intermediate_size}"
                       + ("" if cfg.shared_expert_gated else " (ungated)")
                       if cfg.shared_expert_intermediate_size else "")),
        ("routing", _routing_row(cfg)),
        *([("attention", attention_features(cfg))] if attention_features(cfg) else []),
        ("vocabulary", cfg.vocab_size),
        ("max positions", cfg.max_position_embeddings),
        ("parameters", f"{total:,} total, {active:,} active per token ({100 * active / total:.1f}%)"),
        ("checkpoint dtype", str(cfg.torch_dtype).replace("torch.", "")),
    ]
    if cfg.num_skipped_layers:
        rows.append(("MTP layers", f"{cfg.num_skipped_layers} after the decoder, not run (speculative decoding): "
                                   f"their weights are skipped"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nWeights by --quantization (experts, attention projections and LM head quantized; a batch-1 decode "
          f"step's weight reads, and their floor at {args.bandwidth_tbs:g} TB/s):")
    for method in (None, *QUANT_METHODS):
        total_bytes, read = weight_footprint(cfg, method)
        print(f"  {method or '16-bit':<7} {_size(total_bytes)}  reads {_size(read)} per step  "
              f"floor {1e3 * read / (args.bandwidth_tbs * 1e12):.4g} ms")
    if cfg.mla is not None:
        return _latent_cache_rows(cfg, args.block_size, dict(group_size=args.kv_group_size,
                                                                residual=args.kv_residual))
    where = f"block_size {args.block_size}" if args.block_size else "each format at its default block_size"
    print(f"\nKV cache per token (all {cfg.num_layers} layers, K and V, {where}; bits per element of a full page, "
          f"then of one sequence at 4k and 32k tokens: its pages, staging page, 16-bit window and sinks):")
    for name in KV_FORMAT_NAMES:
        if name == "auto":
            continue
        block_size = args.block_size or default_block_size(name)  # the engine's default page
        try:
            options = dict(group_size=args.kv_group_size, residual=args.kv_residual, sink_tokens=args.kv_sink_tokens,
                           calibration=args.kv_calibration or shipped_kv_calibration(args.model))
            fmt = get_kv_format(name, cfg.torch_dtype, decode_kernel=args.decode_kernel,
                                **kv_options_for(name, options))
            fmt.check_layout(cfg.num_kv_heads, block_size, cfg.head_dim)
            if any(cfg.layer_windows) and fmt.sliding_window_unsupported():
                raise ValueError(f"{fmt.sliding_window_unsupported()} (this model has sliding-window layers)")
        except ValueError as e:  # e.g. needs calibration, or cannot lay out this block size
            print(f"  {name:<10} n/a: {e}")
            continue
        page = fmt.page_bytes(cfg.num_kv_heads, block_size, cfg.head_dim)
        per_token = cfg.num_layers * page / block_size
        bits = fmt.bits_per_element(cfg.num_kv_heads, block_size, cfg.head_dim)
        at = [fmt.bits_per_element_at(n, cfg.num_kv_heads, block_size, cfg.head_dim) for n in (4096, 32768)]
        print(f"  {name:<10} {per_token:>10,.0f} bytes/token  {bits:5.2f} bits/element  {at[0]:5.2f} at 4k  "
              f"{at[1]:5.2f} at 32k  (block_size {block_size})")
    return 0


def _routing_row(cfg) -> str:
    """How the checkpoint routes: scoring, selection bias, groups, scaling, renormalisation."""
    parts = [f"{cfg.scoring_func} scores"]
    if cfg.router_bias:
        parts.append("selection bias")
    if cfg.n_group and cfg.n_group > 1:
        parts.append(f"top-{cfg.topk_group} of {cfg.n_group} expert groups")
    if cfg.routed_scaling_factor != 1.0:
        parts.append(f"weights x {cfg.routed_scaling_factor:g}")
    parts.append("renormalised" if cfg.norm_topk_prob else "not renormalised")
    return ", ".join(parts)


def attention_features(cfg) -> str:
    """What a model's attention has beyond plain causal GQA (sliding windows, sinks, YaRN), or ''."""
    parts = []
    windows = [w for w in cfg.layer_windows if w is not None]
    if windows:
        parts.append(f"sliding window {windows[0]} on {len(windows)} of {cfg.num_layers} layers")
    if cfg.attention_sinks:
        parts.append("a sink logit per head")
    if cfg.yarn is not None:
        parts.append(f"YaRN RoPE (factor {cfg.yarn.factor:g})")
    return ", ".join(parts)


def _attention_text(cfg) -> str:
    m = cfg.mla
    if m is None:
        return (f"{cfg.num_heads} query / {cfg.num_kv_heads} KV, head_dim {cfg.head_dim}"
                + (f", RoPE on its first {cfg.rotary_dim}" if cfg.rotary_dim < cfg.head_dim else ""))
    q = "q_proj" if m.q_lora_rank is None else f"q_lora_rank {m.q_lora_rank}"
    return (f"{cfg.num_heads} query, multi-head latent attention: kv_lora_rank {m.kv_lora_rank} + rope "
            f"{m.qk_rope_head_dim} per token, qk_nope {m.qk_nope_head_dim}, v_head_dim {m.v_head_dim}, {q}")


def _latent_cache_rows(cfg, block_size: int | None, options: dict) -> int:
    """The latent cache's bytes per token in each storage an MLA model accepts (the others n/a): a full
    page's, then one sequence's at 4k and 32k tokens (its pages and the 2-bit latents' 16-bit window)."""
    from moekv.config import default_block_size
    from moekv.kvcache.formats import KV_FORMAT_NAMES
    from moekv.kvcache.formats.latent_choice import LOW_BIT_LATENTS, latent_format_for

    where = f"block_size {block_size}" if block_size else "each storage at its default block_size"
    print(f"\nLatent cache per token (all {cfg.num_layers} layers, one {cfg.head_dim}-wide entry, {where}; "
          f"bits per element of a full page, then of one sequence at 4k and 32k tokens, window included):")
    for name in KV_FORMAT_NAMES:
        if name == "auto":
            continue
        size = block_size or default_block_size(name)  # the engine's default page
        taken = {k: v for k, v in options.items() if k in LOW_BIT_LATENTS.get(name, ()) and v is not None}
        try:
            fmt = latent_format_for(name, cfg.torch_dtype, cfg.mla.kv_lora_rank, taken)
            fmt.check_layout(1, size, cfg.head_dim)
        except ValueError as e:
            print(f"  {name:<10} n/a: {'no latent-cache form' if 'no latent-cache form' in str(e) else e}")
            continue
        page = fmt.page_bytes(1, size, cfg.head_dim)
        bits = fmt.bits_per_element(1, size, cfg.head_dim)
        at = [fmt.bits_per_element_at(n, 1, size, cfg.head_dim) for n in (4096, 32768)]
        print(f"  {name:<10} {cfg.num_layers * page / size:>10,.0f} bytes/token  {bits:5.2f} bits/element  "
              f"{at[0]:5.2f} at 4k  {at[1]:5.2f} at 32k  (block_size {size})")
    return 0


def add_info_parser(subparsers) -> argparse.ArgumentParser:
    """Register `info` on the `moekv` sub-command parsers."""
    info = subparsers.add_parser("info", help="architecture, parameter counts and KV bytes per token of a checkpoint")
    info.add_argument("--model", default=str(default_model_path()),
                      help="Hugging Face checkpoint folder (default: the bundled models/domain-moe)")
    info.add_argument("--block-size", type=int, default=None,
                      help="tokens per page (default: the engine's, 16 for plain formats and 64 for compressed ones)")
    info.add_argument("--kv-group-size", type=int, default=32, help="elements per scale group of the grouped formats")
    info.add_argument("--kv-residual", type=int, default=None,
                      help="newest tokens kept in 16-bit by kivi2, nuq2 and vq (default: each format's own; 0: none)")
    info.add_argument("--kv-sink-tokens", type=int, default=None,
                      help="first tokens kept in 16-bit by kivi2, nuq2 and vq (default: each format's own, 0)")
    info.add_argument("--kv-calibration", default=None,
                      help="kv_calibration folder (default: the checkpoint's own, if it has one)")
    info.add_argument("--decode-kernel", choices=DECODE_KERNELS, default=DEFAULT_DECODE_KERNEL,
                      help="the decode kernel the pages are laid out for, as the engine's --decode-kernel "
                           "(its layout sets the bytes a page takes)")
    info.add_argument("--bandwidth-tbs", type=float, default=4.25,
                      help="memory bandwidth for the weight floors, TB/s (default: an H200's measured copy bandwidth)")
    info.set_defaults(func=cmd_info)

    return info
