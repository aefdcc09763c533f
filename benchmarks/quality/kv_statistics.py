#!/usr/bin/env python3
"""Key and value statistics of a checkpoint, per layer and KV head: how much of the energy sits in the
largest channels and elements, keys before and after RoPE, values; what the KV formats have to
represent, beside what KVQuant and KIVI report for 7-13B models (docs/quality.md).

The model runs in `transformers` (float32) on the first --window tokens of each held-out domain. Keys
are taken as they enter and leave the model's `apply_rotary_pos_emb` (before and after RoPE), values
as v_proj writes them. Over all tokens of all windows, per (layer, KV head):
- top-k channels: the share of the energy (sum of squares) in the k channels that hold most of it
  (a channel is one coordinate of head_dim, over every token);
- top-k rotary pairs: the same for the pairs RoPE rotates together (channels i and i + head_dim/2);
  a token's energy in a pair does not change under RoPE, so this figure is the same before and after;
- top 1% of elements: the share of the energy in the largest 1% of elements by magnitude (what a
  per-vector dense-and-sparse split with 1% outliers takes out);
- channel absmax ratio: the largest channel's max |x| over the median channel's (KIVI's outlier channels);
- kurtosis: E[(x - mean)^4] / var^2 of all elements, and averaged over channels (3 for a Gaussian).
A Gaussian tensor of the same shape gives the reference row (`gaussian`).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/kv_statistics.py \\
        --out benchmarks/results/cpu/kv_statistics_domain-moe.json \\
        --plot benchmarks/results/cpu/kv_statistics_domain-moe.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_paths import repo_path, repo_relative  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "domain-moe"
KINDS = ("keys_pre_rope", "keys_post_rope", "values")


def top_channel_share(x: torch.Tensor, k: int) -> float:
    """x [tokens, channels]: share of the total energy in the k channels holding most of it."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k={k} must lie in [1, channels={x.shape[-1]}]")
    energy = x.double().pow(2).sum(0)
    return float(energy.topk(k).values.sum() / energy.sum())


def top_pair_share(x: torch.Tensor, k: int) -> float:
    """x [tokens, channels]: share of the energy in the k rotary pairs (channels i and i + channels/2,
    the halves `rotate_half` swaps) holding most of it."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary pairs need an even channel count, got {d}")
    energy = x.double().pow(2).sum(0)
    pairs = energy[:d // 2] + energy[d // 2:]
    if not 1 <= k <= d // 2:
        raise ValueError(f"k={k} must lie in [1, pairs={d // 2}]")
    return float(pairs.topk(k).values.sum() / pairs.sum())


def top_element_share(x: torch.Tensor, fraction: float) -> float:
    """Share of the energy in the largest ceil(fraction * numel) elements by magnitude."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    energy = x.double().pow(2).flatten()
    n = math.ceil(fraction * energy.numel())
    return float(energy.topk(n).values.sum() / energy.sum())


def channel_absmax_ratio(x: torch.Tensor) -> float:
    """x [tokens, channels]: the largest channel's max |x| over the median channel's."""
    absmax = x.double().abs().amax(0)
    return float(absmax.max() / absmax.median())


def kurtosis(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """E[(x - mean)^4] / var^2 (population moments) over all elements, or along `dim`."""
    x = x.double()
    centred = x - (x.mean() if dim is None else x.mean(dim, keepdim=True))
    m2 = centred.pow(2).mean() if dim is None else centred.pow(2).mean(dim)
    m4 = centred.pow(4).mean() if dim is None else centred.pow(4).mean(dim)
    return m4 / m2.pow(2)


def statistics(x: torch.Tensor, top_channels: int = 4, top_fraction: float = 0.01) -> dict[str, float]:
    """Every statistic of one head's x [tokens, channels]."""
    return {f"top{top_channels}_channel_share": top_channel_share(x, top_channels),
            f"top{top_channels}_pair_share": top_pair_share(x, top_channels),
            f"top{100 * top_fraction:g}pct_element_share": top_element_share(x, top_fraction),
            "channel_absmax_ratio": channel_absmax_ratio(x),
            "kurtosis": float(kurtosis(x)),
            "channel_kurtosis_mean": float(kurtosis(x, dim=0).mean())}


class Capture:
    """Collects each layer's keys around RoPE and values, [B, H, T, D] per forward, in layer order."""

    def __init__(self):
        self.keys_pre: list[torch.Tensor] = []
        self.keys_post: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []


def load(model_dir: Path, capture: Capture):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    rotate = modeling.apply_rotary_pos_emb

    def rotate_recorded(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = rotate(q, k, cos, sin, *args, **kwargs)
        capture.keys_pre.append(k.detach())
        capture.keys_post.append(k_out.detach())
        return q_out, k_out

    modeling.apply_rotary_pos_emb = rotate_recorded
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for layer in model.model.layers:
        def record_values(_module, _inputs, out):
            b, t, _ = out.shape
            capture.values.append(out.detach().view(b, t, -1, head_dim).transpose(1, 2))
        layer.self_attn.v_proj.register_forward_hook(record_values)
    return model


def per_head_tokens(chunks: list[torch.Tensor], layer: int, num_layers: int) -> torch.Tensor:
    """Every forward's [B, H, T, D] of one layer -> [H, all tokens, D]."""
    mine = chunks[layer::num_layers]
    return torch.cat([c.permute(1, 0, 2, 3).reshape(c.shape[1], -1, c.shape[3]) for c in mine], dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--window", type=int, default=4096, help="tokens read from each held-out domain")
    p.add_argument("--top-channels", type=int, default=4)
    p.add_argument("--top-fraction", type=float, default=0.01)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", type=Path, default=None, metavar="PNG")
    p.add_argument("--replot", action="store_true", help="only draw --plot from an existing --out")
    args = p.parse_args()
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot PNG")
        plot(json.loads(args.out.read_text()), args.plot)
        return

    from tokenizers import Tokenizer

    from moekv.eval.perplexity import text_files

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    capture = Capture()
    model = load(args.model, capture)
    domains = text_files(args.model / "heldout")
    with torch.no_grad():
        for path in domains.values():
            ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).ids
            model(torch.tensor([ids[:args.window]]), use_cache=False)
    num_layers = model.config.num_hidden_layers
    kw = {"top_channels": args.top_channels, "top_fraction": args.top_fraction}
    layers = []
    for layer in range(num_layers):
        entry = {}
        for kind, chunks in zip(KINDS, (capture.keys_pre, capture.keys_post, capture.values)):
            x = per_head_tokens(chunks, layer, num_layers)
            entry[kind] = [statistics(x[h], **kw) for h in range(x.shape[0])]
        layers.append(entry)
    shape = per_head_tokens(capture.values, 0, num_layers).shape
    gaussian = statistics(torch.randn(shape[1], shape[2], generator=torch.Generator().manual_seed(0)), **kw)
    record = {"model": args.model.name, "dtype": "float32", "window": args.window,
              "domains": {name: repo_path(path) for name, path in domains.items()},
              "tokens_per_head": shape[1], "head_dim": shape[2],
              "command": "python benchmarks/quality/kv_statistics.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("out", "model", "plot", "replot")),
              "gaussian": gaussian, "layers": layers}
    args.out.write_text(json.dumps(repo_relative(record), indent=1))
    for i, entry in enumerate(layers):
        print(f"layer {i}: " + "; ".join(
            f"{kind} " + ", ".join(f"{k} {sum(h[k] for h in heads) / len(heads):.3f}" for k in heads[0])
            for kind, heads in entry.items()))
    print("gaussian: " + ", ".join(f"{k} {v:.3f}" for k, v in gaussian.items()))
    if args.plot:
        plot(record, args.plot)


def plot(record: dict, png: Path) -> None:
    """Per layer (mean over KV heads): top-channel and top-1% element energy shares and the channel
    absmax ratio, keys before and after RoPE and values, the Gaussian reference dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = record["layers"]
    names = list(layers[0]["values"][0])
    shown = [names[0], names[2], "channel_absmax_ratio"]
    fig, axes = plt.subplots(1, len(shown), figsize=(11, 3.4))
    x = range(len(layers))
    for ax, stat in zip(axes, shown):
        for i, kind in enumerate(KINDS):
            means = [sum(h[stat] for h in layer[kind]) / len(layer[kind]) for layer in layers]
            ax.plot(x, [100 * m for m in means] if "share" in stat else means, marker="o", color=f"C{i}",
                    label=kind.replace("_", " "))
        ref = record["gaussian"][stat]
        ax.axhline(100 * ref if "share" in stat else ref, color="gray", linestyle="--", label="gaussian")
        ax.set_xticks(list(x))
        ax.set_xlabel("layer")
        ax.set_ylabel(stat.replace("_", " ") + (" (%)" if "share" in stat else ""))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{record['model']}: key and value energy concentration (mean over KV heads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
