"""Low-bit latent variants of an MLA model, beyond the engine's names: the 2-bit latent's grouping
(per channel over 32 tokens as KIVI's keys, or per token over 32 channels) x codebook (uniform min/max
or Gaussian Lloyd-Max levels) x 16-bit window, and the rotary key kept in bf16 or fake-quantized to
int4 / 2-bit per token. Each variant is a latent cache format (kvcache/formats/latent_lowbit.py) the
engine runs, so every scored token reads the cache as decode does (--ppl-mode decode-tail of
domain_model_tables.py): per domain the perplexity, and the KL divergence of each scored
distribution from the bf16 latent's.

    PYTHONPATH=. python benchmarks/quality/latent_variants.py --model models/domain-mla --device cuda \
        --out benchmarks/results/<device>/latent_variants.json

--random-v3 DIR builds a tiny random DeepSeek-V3 checkpoint there (tests/checkpoints.py with domain-mla's
kv_lora_rank 128; its rotary key 8 wide) and scores random token windows: a smoke of the
machinery, not a quality result (random weights attend almost uniformly). --gamma-spread S multiplies
its kv_a_layernorm weights by exp(S * N(0, 1)) per channel, the per-channel scale a trained latent's
norm learns (the case for per-channel groups).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from result_paths import repo_relative

from moekv import LLM
from moekv.engine import model_runner
from moekv.eval.perplexity import nll_from_logits, text_files
from moekv.kvcache.formats.latent_choice import latent_format_for
from moekv.kvcache.formats.latent_lowbit import Latent2BitFormat, LatentInt4Format
from moekv.ops.reference import (
    latent_2bit_dequantize_ref,
    latent_2bit_quantize_ref,
    latent_int4_dequantize_ref,
    latent_int4_quantize_ref,
)

REPO = Path(__file__).resolve().parents[2]


def rope_fake_quant(base: type, bits: int) -> type:
    """`base` with its rotary key quantized per token (one group of r channels) before it is stored:
    what storing it in int4 (bits 4) or 2-bit uniform codes (bits 2) would lose; bytes not counted."""

    class RopeQuantized(base):
        def write(self, cache, k, v, ctx):
            R = self.kv_lora_rank
            entries = k.reshape(k.shape[0], -1).clone()
            rope = entries[:, R:].float()
            if bits == 4:
                back = latent_int4_dequantize_ref(*latent_int4_quantize_ref(rope, rope.shape[-1]))
            else:
                back = latent_2bit_dequantize_ref(*latent_2bit_quantize_ref(rope, -1, "uniform"), -1, "uniform")
            entries[:, R:] = back.to(entries.dtype)
            super().write(cache, entries, v, ctx)

    return RopeQuantized


def variants(rank: int, window: int) -> dict:
    """name -> a factory of the format (called with the model's dtype)."""
    out = {
        "bf16": lambda dtype: latent_format_for("bf16", dtype, rank),
        "fp8_e4m3": lambda dtype: latent_format_for("fp8_e4m3", dtype, rank),
        "int4_g32": lambda dtype: LatentInt4Format(rank, 32),
        "int4_g64": lambda dtype: LatentInt4Format(rank, 64),
        "int4_g32_rope_int4": lambda dtype: rope_fake_quant(LatentInt4Format, 4)(rank, 32),
    }
    for grouping in ("channel", "token"):
        for codebook in ("uniform", "gaussian"):
            name = f"2bit_{grouping}_{codebook}"
            out[f"{name}_w{window}"] = (lambda g, c: lambda dtype: Latent2BitFormat(rank, "x", g, c, 32, window))(
                grouping, codebook)
            if grouping == "token":  # a channel group needs the window to wait in
                out[f"{name}_w0"] = (lambda c: lambda dtype: Latent2BitFormat(rank, "x", "token", c, 32, 0))(codebook)
    out[f"2bit_token_gaussian_w{window}_rope_int4"] = lambda dtype: rope_fake_quant(Latent2BitFormat, 4)(
        rank, "x", "token", "gaussian", 32, window)
    out[f"2bit_token_gaussian_w{window}_rope_2bit"] = lambda dtype: rope_fake_quant(Latent2BitFormat, 2)(
        rank, "x", "token", "gaussian", 32, window)
    return out


@contextmanager
def latent_format(factory):
    """The engine's latent format replaced by factory(model dtype) while an LLM is built."""
    chosen = model_runner.latent_format_for
    model_runner.latent_format_for = lambda name, dtype, rank, options=None: factory(dtype)
    try:
        yield
    finally:
        model_runner.latent_format_for = chosen


def random_v3(out: Path, gamma_spread: float) -> Path:
    if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
        sys.path.insert(0, str(REPO))
    from safetensors.torch import load_file, save_file

    from tests.checkpoints import build_deepseek_checkpoint

    # kv_lora_rank only: the config's derived head sizes are set at construction
    path = build_deepseek_checkpoint("deepseek_v3", out, kv_lora_rank=128, q_lora_rank=None)
    if gamma_spread:
        gen = torch.Generator().manual_seed(1)
        for file in path.glob("*.safetensors"):
            tensors = load_file(file)
            for name in [n for n in tensors if n.endswith("kv_a_layernorm.weight")]:
                w = tensors[name]
                tensors[name] = (w.float() * torch.exp(gamma_spread * torch.randn(w.shape, generator=gen))).to(w.dtype)
            save_file(tensors, file, metadata={"format": "pt"})
    return path


def windows_of(llm, domains: dict[str, Path] | None, window: int, per_domain: int, vocab: int) -> dict[str, list]:
    if domains is None:  # random tokens
        gen = torch.Generator().manual_seed(0)
        return {"random": [torch.randint(0, vocab, (window,), generator=gen).tolist() for _ in range(per_domain)]}
    out = {}
    for name, path in domains.items():
        ids = llm.engine.tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace"),
                                          add_special_tokens=False)
        out[name] = [ids[i * window:(i + 1) * window] for i in range(min(per_domain, len(ids) // window))]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "domain-mla"))
    p.add_argument("--random-v3", default=None, metavar="DIR", help="build and score a tiny random V3 checkpoint")
    p.add_argument("--gamma-spread", type=float, default=0.0)
    p.add_argument("--heldout", default=str(REPO / "models" / "domain-moe" / "heldout"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--window", type=int, default=4096, help="tokens per scored window")
    p.add_argument("--tail", type=int, default=256, help="scored tokens per window, each fed by a decode step")
    p.add_argument("--windows", type=int, default=4, help="windows per domain")
    p.add_argument("--residual", type=int, default=128, help="the 2-bit variants' 16-bit window")
    p.add_argument("--variants", nargs="+", default=None, help="a subset of the names (default: all)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model = random_v3(Path(args.random_v3), args.gamma_spread) if args.random_v3 else Path(args.model)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    cfg = json.loads((model / "config.json").read_text())
    table = variants(cfg["kv_lora_rank"], args.residual)
    names = args.variants or list(table)
    if names[0] != "bf16":
        names = ["bf16", *[n for n in names if n != "bf16"]]
    record = {"model": str(model) if args.random_v3 else model.name, "device": args.device, "dtype": dtype,
              "gamma_spread": args.gamma_spread if args.random_v3 else None, "args": vars(args), "variants": {}}
    reference: dict[str, list[torch.Tensor]] = {}
    texts = None
    first = args.window - 1 - args.tail  # logits row r predicts token r + 1; rows from `first` on are decode steps
    for name in names:
        start = time.perf_counter()
        with latent_format(table[name]):
            llm = LLM(model=str(model), device=args.device, dtype=dtype, max_model_len=args.window, max_num_seqs=64,
                      block_size=64)  # the compressed formats' pages
        if texts is None:
            texts = windows_of(llm, None if args.random_v3 else text_files(args.heldout), args.window, args.windows,
                               cfg["vocab_size"])
        fmt, mcfg = llm.engine.runner.kv_format, llm.engine.model_config
        row = {"bits_per_element": fmt.bits_per_element(1, llm.engine.config.cache.block_size, mcfg.head_dim),
               "bits_per_element_at_window": fmt.bits_per_element_at(args.window, 1,
                                                                      llm.engine.config.cache.block_size,
                                                                      mcfg.head_dim), "domains": {}}
        for domain, prompts in texts.items():
            logits = llm.score([{"prompt_token_ids": ids} for ids in prompts], decode_from=[first] * len(prompts))
            tails = [rows[first:args.window - 1] for rows in logits]
            nll = sum(float(nll_from_logits(t, torch.tensor(ids[first + 1:args.window])))
                      for t, ids in zip(tails, prompts))
            entry = {"ppl": math.exp(nll / (args.tail * len(prompts))), "tokens": args.tail * len(prompts)}
            if name == "bf16":
                reference[domain] = tails
            else:
                kl = [(r.log_softmax(-1).exp() * (r.log_softmax(-1) - t.log_softmax(-1))).sum(-1).mean().item()
                      for r, t in zip(reference[domain], tails)]
                entry["kl_from_bf16"] = sum(kl) / len(kl)
                base = record["variants"]["bf16"]["domains"][domain]["ppl"]
                entry["ppl_change_pct"] = 100 * (entry["ppl"] / base - 1)
            row["domains"][domain] = entry
        row["seconds"] = round(time.perf_counter() - start, 1)
        record["variants"][name] = row
        print(f"{name}: {row['bits_per_element']:.2f} bits ({row['bits_per_element_at_window']:.2f} at the window); "
              + ", ".join(f"{d} ppl {e['ppl']:.3f}" + (f" KL {e['kl_from_bf16']:.4f}" if "kl_from_bf16" in e else "")
                          for d, e in row["domains"].items()), flush=True)
        Path(args.out).write_text(json.dumps(repo_relative(record), indent=1))
        del llm


if __name__ == "__main__":
    main()
