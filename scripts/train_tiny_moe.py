#!/usr/bin/env python3
"""Train a tiny Mixtral-style MoE language model (and its tokenizer) from scratch.

The result is a standard Hugging Face checkpoint folder: `AutoTokenizer` and
`AutoModelForCausalLM.from_pretrained(out)` load it. It is the small test model
for the moekv engine, so it must stay small (<= 32 MB) and its experts should be
well balanced (later work clusters them), hence the router aux loss.

Steps:
  1. read the text files, strip Project Gutenberg boilerplate, hold out the
     last 5% of each file (cut at a newline) for validation;
  2. train a byte-level BPE tokenizer on the training split only;
  3. pack the tokenized training text (files separated by <|endoftext|>) and
     train MixtralForCausalLM on random 512-token windows (AdamW, warmup +
     cosine, bf16 autocast on CUDA with fp32 master weights);
  4. evaluate in fp32 on non-overlapping windows of the held-out split, save
     bf16 safetensors, tokenizer files, train_log.json, loss_curve.png and a
     model card README.md.

Example (CPU smoke test):
  python scripts/train_tiny_moe.py --steps 20 --batch-size 4 --seq-len 128 \
      --hidden-size 64 --intermediate-size 64 --num-layers 2 --vocab-size 1024 \
      --out /tmp/tiny-smoke

Runs with torch >= 2.11, transformers >= 5.17, tokenizers >= 0.22.
`wikitext2_test.txt` is never read: it is kept for evaluation elsewhere.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_common import EOT, save_tokenizer, strip_gutenberg, train_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "text"
DEFAULT_FILES = ["pg1399.txt", "pg2554.txt", "pg2600.txt", "tinyshakespeare.txt"]
FORBIDDEN_SUBSTRING = "wikitext"  # evaluation-only data, never for training
MB = 1000 * 1000  # size limit is in decimal megabytes (the stricter reading)


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    d.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="training files inside --data-dir")
    d.add_argument("--holdout-frac", type=float, default=0.05, help="last fraction of each file kept for validation")

    t = p.add_argument_group("tokenizer")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--min-frequency", type=int, default=2)

    m = p.add_argument_group("model")
    m.add_argument("--hidden-size", type=int, default=256)
    m.add_argument("--intermediate-size", type=int, default=192, help="per expert")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--num-heads", type=int, default=8)
    m.add_argument("--num-kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--num-experts", type=int, default=16)
    m.add_argument("--experts-per-tok", type=int, default=2)
    m.add_argument("--max-position-embeddings", type=int, default=512)
    m.add_argument("--rope-theta", type=float, default=10000.0)
    m.add_argument("--rms-norm-eps", type=float, default=1e-5)
    m.add_argument("--router-aux-loss-coef", type=float, default=0.01)
    m.add_argument(
        "--experts-impl",
        default=None,
        choices=["eager", "grouped_mm", "batched_mm"],
        help="transformers experts kernel used for training (default: transformers' own choice)",
    )

    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=800, help="maximum optimizer steps (the data is small: more overfits)")
    o.add_argument("--batch-size", type=int, default=64)
    o.add_argument("--seq-len", type=int, default=512)
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    o.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of planned steps, at most 200")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--time-budget-minutes", type=float, default=None, help="stop training cleanly after this")
    o.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    o.add_argument("--no-keep-best", action="store_true", help="save the last weights, not the best-val ones")

    r = p.add_argument_group("run")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "tiny-moe")
    r.add_argument("--eval-every", type=int, default=100, help="steps between validation passes")
    r.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--max-size-mb", type=float, default=32.0, help="fail if the output folder is larger")
    args = p.parse_args(argv)

    if args.seq_len > args.max_position_embeddings:
        p.error("--seq-len must not exceed --max-position-embeddings")
    if any(FORBIDDEN_SUBSTRING in f.lower() for f in args.files):
        p.error("wikitext files are evaluation-only and must never be used for training")
    args.eval_batch_size = args.eval_batch_size or args.batch_size
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- #
# Data
# --------------------------------------------------------------------------- #
def split_holdout(text: str, frac: float) -> tuple[str, str]:
    """Split off the last `frac` of the characters, moving the cut to the next newline."""
    cut = int(len(text) * (1.0 - frac))
    newline = text.find("\n", cut)
    cut = newline + 1 if newline != -1 else cut
    return text[:cut], text[cut:]


def load_corpus(data_dir: Path, files: list[str], frac: float) -> list[dict]:
    docs = []
    for name in files:
        path = data_dir / name
        assert FORBIDDEN_SUBSTRING not in path.name.lower()
        raw = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        text = strip_gutenberg(raw)
        train, val = split_holdout(text, frac)
        docs.append({"name": name, "train": train, "val": val, "raw_chars": len(raw)})
        print(f"  {name}: {len(raw):,} chars raw, {len(train):,} train / {len(val):,} val after stripping")
    return docs


def encode_stream(tok, texts: list[str], eot_id: int) -> torch.Tensor:
    """Concatenate documents as <eot> doc <eot> doc ... (GPT-2 style separators).

    Each whole document is encoded in one piece so tokens match what the
    tokenizer gives on the full text (no chunk-boundary artefacts).
    """
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eot_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of the packed stream; random offsets act as cheap augmentation."""
    starts = torch.randint(0, len(stream) - seq_len + 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping windows covering the whole validation stream (last one may be short)."""
    windows = [stream[i : i + seq_len] for i in range(0, len(stream), seq_len)]
    return [w for w in windows if len(w) >= 2]


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #
def check_tokenizer_roundtrip(out: Path, sample: str) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)
    ids = hf_tok(sample)["input_ids"]
    assert hf_tok.decode(ids) == sample, "tokenizer does not round-trip"
    assert hf_tok.eos_token == EOT and hf_tok.bos_token == EOT and hf_tok.pad_token == EOT
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "user: Hi\nassistant:", repr(chat)
    print(f"  AutoTokenizer OK: {type(hf_tok).__name__}, {len(hf_tok)} tokens, {len(sample)} chars -> {len(ids)} ids")


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
def build_config(args: argparse.Namespace, vocab_size: int, eot_id: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.experts_per_tok,
        max_position_embeddings=args.max_position_embeddings,
        # transformers 5.x keeps rope_theta inside rope_parameters.
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=args.rms_norm_eps,
        tie_word_embeddings=False,
        router_aux_loss_coef=args.router_aux_loss_coef,
        # The saved config is for inference: no router logits by default.
        # Training asks for them per call (output_router_logits=True).
        output_router_logits=False,
        sliding_window=None,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )


def build_model(config, experts_impl: str | None):
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM(config)
    if experts_impl is not None:
        model.set_experts_implementation(experts_impl)
    return model


def count_params(model) -> dict:
    """Total params and params active per token (non-expert + top_k/E of expert weights)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = (total - expert) + expert * cfg.num_experts_per_tok / cfg.num_local_experts
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    return {"total": total, "expert": expert, "non_expert": total - expert, "active": int(active), "embeddings": embed}


def make_optimizer(model, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    # Decay matrices (incl. 3-D expert weights); keep norms' gains undecayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(step: int, warmup: int, planned: int, base_lr: float, min_ratio: float) -> float:
    """Linear warmup, then cosine from base_lr down to min_ratio * base_lr at `planned`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, planned - warmup))
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def autocast_ctx(device: torch.device, enabled: bool = True):
    # bf16 autocast only on CUDA; CPU trains plain fp32 (fast enough for smoke tests, and exact).
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer balance loss computed per layer, then averaged (1.0 = perfectly balanced).

    transformers' own `aux_loss` pools the routing statistics of all layers
    before multiplying, so one layer can starve experts as long as another
    layer makes up for it. The downstream work clusters experts layer by
    layer, so balance is enforced in every layer here.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # (tokens, E)
        chosen = probs.topk(top_k, dim=-1).indices.flatten()
        ones = torch.ones_like(chosen, dtype=probs.dtype)
        frac_tokens = torch.zeros(num_experts, device=probs.device).scatter_add_(0, chosen, ones) / chosen.numel()
        losses.append(num_experts * torch.sum(frac_tokens * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction=reduction
    )


# --------------------------------------------------------------------------- #
# Evaluation
# --------------------------------------------------------------------------- #
@torch.no_grad()
def evaluate(model, windows, batch_size, device, use_autocast, num_experts=None) -> dict:
    """Token-weighted mean next-token loss over the windows; optional per-layer expert load."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    load = None
    # Group windows by length so the short tail window gets its own batch.
    by_len: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            ids = torch.stack(group[i : i + batch_size]).to(device)
            with autocast_ctx(device, use_autocast):
                out = model(input_ids=ids, use_cache=False, output_router_logits=num_experts is not None)
            total_loss += next_token_loss(out.logits, ids, reduction="sum").item()
            total_tokens += ids.numel() - ids.size(0)
            if num_experts is not None:
                load = accumulate_expert_load(load, out.router_logits, model.config.num_experts_per_tok, num_experts)
    model.train(was_training)
    result = {"loss": total_loss / total_tokens, "tokens": total_tokens}
    if load is not None:
        result["expert_load"] = (load / load.sum(dim=1, keepdim=True)).tolist()
    return result


def accumulate_expert_load(load, router_logits, top_k: int, num_experts: int) -> torch.Tensor:
    """Count top-k routing decisions per (layer, expert)."""
    counts = torch.stack(
        [torch.bincount(lg.topk(top_k, dim=-1).indices.flatten(), minlength=num_experts).cpu() for lg in router_logits]
    ).double()
    return counts if load is None else load + counts


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #
class StepPlanner:
    """Decides how many steps fit: min(--steps, what the time budget allows).

    The cosine schedule is stretched over the planned steps, so it is
    re-estimated from the measured step rate (evals included) as training goes.
    """

    def __init__(self, max_steps: int, budget_s: float | None, warmup_arg: int | None):
        self.max_steps = max_steps
        self.budget_s = budget_s
        self.warmup_arg = warmup_arg
        self.planned = max_steps
        self.t0 = time.perf_counter()
        self.rate_t0, self.rate_step0 = None, None

    @property
    def warmup(self) -> int:
        if self.warmup_arg is not None:
            return self.warmup_arg
        return max(1, min(200, self.planned // 20))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self) -> bool:
        return self.budget_s is not None and self.elapsed() >= self.budget_s

    def update(self, step: int) -> None:
        """Call after finishing `step` steps. Skips the first few (slow, allocator warmup)."""
        if self.budget_s is None:
            return
        if self.rate_t0 is None:
            if step >= 5:
                self.rate_t0, self.rate_step0 = time.perf_counter(), step
            return
        done = step - self.rate_step0
        if done < 10:
            return
        sec_per_step = (time.perf_counter() - self.rate_t0) / done
        remaining = 0.98 * self.budget_s - self.elapsed()
        fit = step + max(0, int(remaining / sec_per_step))
        self.planned = max(step, min(self.max_steps, fit))  # never below the steps already done


def train(model, train_stream, val_windows, args, device) -> dict:
    opt = make_optimizer(model, args, device)
    fwd = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.time_budget_minutes * 60 if args.time_budget_minutes else None
    plan = StepPlanner(args.steps, budget_s, args.warmup_steps)
    curve, evals = [], []
    best = {"loss": float("inf"), "step": None, "state": None}
    tokens_per_step = args.batch_size * args.seq_len
    stop_reason = "max steps"

    from tqdm.auto import tqdm

    # Redraw rarely when logging to a file (keeps logs short).
    bar = tqdm(total=plan.planned, desc="train", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)
    model.train()
    step, tokens_seen, t_last, tok_last = 0, 0, time.perf_counter(), 0
    while step < plan.planned:
        if plan.out_of_time():
            stop_reason = "time budget"
            break
        lr = lr_at(step, plan.warmup, plan.planned, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = sample_batch(train_stream, args.batch_size, args.seq_len, gen).to(device, non_blocking=True)
        with autocast_ctx(device):
            out = fwd(input_ids=ids, use_cache=False, output_router_logits=True)
        ce = next_token_loss(out.logits, ids)
        aux = load_balancing_loss(out.router_logits, args.num_experts, args.experts_per_tok)
        loss = ce + args.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += tokens_per_step

        if step % args.log_every == 0 or step == 1:
            now = time.perf_counter()
            tps = (tokens_seen - tok_last) / max(1e-9, now - t_last)
            t_last, tok_last = now, tokens_seen
            point = {
                "step": step,
                "train_loss": ce.item(),
                "aux_loss": aux.item(),
                "grad_norm": grad_norm.item(),
                "lr": lr,
                "tokens_per_s": tps,
                "elapsed_s": plan.elapsed(),
            }
            curve.append(point)
            bar.set_postfix(
                loss=f"{point['train_loss']:.3f}", aux=f"{point['aux_loss']:.3f}", tok_s=f"{tps:,.0f}", refresh=False
            )

        if step % args.eval_every == 0:
            record_eval(model, val_windows, args, device, step, plan, evals, best, bar)

        plan.update(step)
        if bar.total != plan.planned:
            bar.total = plan.planned
        bar.update(1)
    bar.close()
    if stop_reason != "time budget" and step < args.steps:
        stop_reason = "time budget (schedule fitted to the budget)"

    # Always finish the curve with a validation point for the last weights.
    if not evals or evals[-1]["step"] != step:
        record_eval(model, val_windows, args, device, step, plan, evals, best, None)
    train_time = plan.elapsed()
    if not args.no_keep_best and best["state"] is not None and best["step"] != step:
        print(f"  restoring best-val weights from step {best['step']} (val {best['loss']:.4f})")
        model.load_state_dict(best["state"])
    return {
        "steps": step,
        "planned_steps": plan.planned,
        "stop_reason": stop_reason,
        "tokens_seen": tokens_seen,
        "train_time_s": train_time,
        "curve": curve,
        "evals": evals,
        "selected_step": step if args.no_keep_best else best["step"],
    }


def record_eval(model, val_windows, args, device, step, plan, evals, best, bar) -> None:
    """Periodic validation (bf16 autocast on CUDA, cheap); remember the best weights."""
    res = evaluate(model, val_windows, args.eval_batch_size, device, use_autocast=True)
    evals.append({"step": step, "val_loss": res["loss"], "elapsed_s": plan.elapsed()})
    msg = f"step {step}: val loss {res['loss']:.4f} (ppl {math.exp(res['loss']):.2f})"
    (bar.write if bar is not None else print)(msg)
    if res["loss"] < best["loss"]:
        best.update(loss=res["loss"], step=step)
        if not args.no_keep_best:
            best["state"] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- #
# Saving and reporting
# --------------------------------------------------------------------------- #
def save_model(model, out: Path, eot_id: int) -> None:
    """Save a bf16 copy (keeps the folder small) plus an explicit generation config."""
    from transformers import GenerationConfig

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.config.output_router_logits = False
    bf16.config.use_cache = True
    bf16.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False
    )
    bf16.save_pretrained(out, safe_serialization=True)
    bf16.generation_config.save_pretrained(out)


def folder_size(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def plot_loss(curve: list[dict], evals: list[dict], selected_step: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([p["step"] for p in curve], [p["train_loss"] for p in curve], label="train loss", lw=1)
    ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="val loss", ms=4)
    if selected_step is not None:
        ax.axvline(selected_step, color="grey", ls="--", lw=0.8, label=f"saved weights (step {selected_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny-moe training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


MODEL_CARD = """\
---
library_name: transformers
pipeline_tag: text-generation
tags:
- mixtral
- moe
- tiny
- from-scratch
---

# {name}

A tiny Mixtral-architecture mixture-of-experts language model trained from scratch,
together with its byte-level BPE tokenizer, as a test model for the moekv inference
engine. It writes 19th-century-novel-flavoured English; it is not useful for anything
else.

## Data

- Training: `{files}` (Project Gutenberg novels and Tiny Shakespeare); Project
  Gutenberg header/footer boilerplate stripped where present.
- Validation: the last {holdout_pct:g}% (by characters, cut at a newline) of each of those
  files, held out from both tokenizer and model training.
- `wikitext2_test.txt` was never read for training or for the tokenizer.
- Tokens (this tokenizer): {train_tokens:,} train, {val_tokens:,} validation.
  Documents are packed as `<|endoftext|> doc <|endoftext|> doc ...`.

## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {vocab_size:,} tokens. `<|endoftext|>`
(id {eot_id}) is bos, eos and pad. The tokenizer adds no special tokens on its own;
a simple chat template renders `role: content` lines and ends with `assistant:`.

## Model

| | |
|---|---|
| architecture | `MixtralForCausalLM` |
| parameters (total) | {total_params:,} ({total_m:.2f} M) |
| parameters active per token | {active_params:,} ({active_m:.2f} M) |
| expert parameters | {expert_params:,} |
| hidden size | {hidden_size} |
| layers | {num_layers} |
| attention heads / kv heads / head dim | {num_heads} / {num_kv_heads} / {head_dim} |
| experts per layer / active per token | {num_experts} / {top_k} |
| expert intermediate size | {intermediate_size} |
| context length | {max_pos} (RoPE theta {rope_theta:g}) |
| tied embeddings | no |
| weights on disk | bfloat16 safetensors ({weights_mb:.1f} MB) |

Active parameters = non-expert parameters + top_k / num_experts x expert parameters.
Training added a per-layer Switch-Transformer load-balancing loss (coefficient
{aux_coef:g}) so that the experts of every layer are evenly used; final share of
routing decisions per expert on the validation split: {load_summary}. The saved
config has `output_router_logits: false`.

## Training

```
{command}
```

- Hardware: {device}; training wall time {train_min:.1f} min ({steps:,} steps,
  {tokens_seen:,} tokens seen, stop: {stop_reason}).
- AdamW (lr {lr:g}, betas 0.9/0.95, weight decay {wd:g}), warmup + cosine decay,
  grad clip {clip:g}, batch {batch} x {seq_len} tokens{precision}.
- Saved weights: step {selected_step} (best periodic validation loss).
- torch {torch_version}, transformers {transformers_version}.

![loss curve](loss_curve.png)

## Evaluation

Validation split (held-out {holdout_pct:g}%), non-overlapping {seq_len}-token windows,
transformers forward in eval mode with fp32 weights (before the bf16 cast for saving):

| metric | value |
|---|---|
| validation loss (nats/token) | {val_loss:.4f} |
| validation perplexity | {val_ppl:.2f} |

## Evaluation with moekv

_Figures are added by `moekv eval ppl`._

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("{load_path}")
model = AutoModelForCausalLM.from_pretrained("{load_path}")
ids = tok("It was a dark and stormy night", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40)[0]))
```
"""


def display_path(out: Path) -> str:
    """Repo-relative path when the folder is inside the repo (the card should not name this machine)."""
    try:
        return str(out.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(out)


def write_model_card(out: Path, log: dict) -> None:
    cfg, params, args = log["model_config"], log["params"], log["args"]
    text = MODEL_CARD.format(
        name=out.name,
        files="`, `".join(args["files"]),
        holdout_pct=100 * args["holdout_frac"],
        train_tokens=log["data"]["train_tokens"],
        val_tokens=log["data"]["val_tokens"],
        vocab_size=cfg["vocab_size"],
        eot_id=cfg["eos_token_id"],
        total_params=params["total"],
        total_m=params["total"] / 1e6,
        active_params=params["active"],
        active_m=params["active"] / 1e6,
        expert_params=params["expert"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        max_pos=cfg["max_position_embeddings"],
        rope_theta=args["rope_theta"],
        weights_mb=log["weights_bytes"] / MB,
        aux_coef=cfg["router_aux_loss_coef"],
        load_summary=load_summary(log["final_expert_load"]),
        command=log["command"],
        device=log["device"],
        train_min=log["train_time_s"] / 60,
        steps=log["steps"],
        tokens_seen=log["tokens_seen"],
        stop_reason=log["stop_reason"],
        lr=args["lr"],
        wd=args["weight_decay"],
        clip=args["grad_clip"],
        batch=args["batch_size"],
        seq_len=args["seq_len"],
        precision=", bf16 autocast with fp32 master weights" if "cuda" in log["device_type"] else ", fp32",
        selected_step=log["selected_step"],
        torch_version=log["versions"]["torch"],
        transformers_version=log["versions"]["transformers"],
        val_loss=log["final_val_loss"],
        val_ppl=log["final_val_ppl"],
        load_path=display_path(out),
    )
    (out / "README.md").write_text(text)


def check_reload(out: Path, device: torch.device) -> str:
    """Load the saved folder with the Auto classes and greedy-generate a few tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).to(device).eval()
    ids = tok("It was", return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tok.decode(gen[0])


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tokenizers
    import transformers

    t_start = time.perf_counter()
    device = pick_device(args.device)
    seed_everything(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # training speed; final eval turns it off
        torch.backends.cudnn.allow_tf32 = True
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"device: {device_description(device)}; torch {torch.__version__}, transformers {transformers.__version__}")

    print(f"reading {args.data_dir}")
    docs = load_corpus(args.data_dir, args.files, args.holdout_frac)

    t0 = time.perf_counter()
    tok = train_tokenizer([d["train"] for d in docs], args.vocab_size, args.min_frequency)
    eot_id = tok.token_to_id(EOT)
    save_tokenizer(tok, out, args.max_position_embeddings)
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f}s")
    check_tokenizer_roundtrip(out, docs[0]["val"][:1000])

    train_stream = encode_stream(tok, [d["train"] for d in docs], eot_id)
    val_stream = encode_stream(tok, [d["val"] for d in docs], eot_id)
    val_windows = eval_windows(val_stream, args.seq_len)
    print(f"tokens: {len(train_stream):,} train, {len(val_stream):,} val ({len(val_windows)} windows)")

    config = build_config(args, tok.get_vocab_size(), eot_id)
    model = build_model(config, args.experts_impl).to(device)
    params = count_params(model)
    weights_bytes_est = 2 * params["total"]
    print(
        f"model: {params['total'] / 1e6:.2f}M params, {params['active'] / 1e6:.2f}M active/token, "
        f"~{weights_bytes_est / MB:.1f} MB in bf16; "
        f"experts impl: {getattr(model.config, '_experts_implementation', '?')}"
    )
    if weights_bytes_est > args.max_size_mb * MB:
        print(f"ERROR: bf16 weights alone exceed --max-size-mb {args.max_size_mb}", file=sys.stderr)
        return 2

    result = train(model, train_stream, val_windows, args, device)

    # Final evaluation: eval mode, fp32 weights, no autocast, no TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    final = evaluate(model, val_windows, args.eval_batch_size, device, use_autocast=False, num_experts=args.num_experts)
    val_ppl = math.exp(final["loss"])
    print(f"final val loss {final['loss']:.4f}, ppl {val_ppl:.2f} (fp32, {final['tokens']:,} predicted tokens)")
    print_expert_load(final["expert_load"])

    save_model(model, out, eot_id)
    plot_loss(result["curve"], result["evals"], result["selected_step"], out / "loss_curve.png")
    weights_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    log = {
        "command": command,
        "argv": sys.argv if argv is None else argv,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_config": model.config.to_dict(),
        "params": params,
        "data": {
            "files": args.files,
            "holdout_frac": args.holdout_frac,
            "per_file": [
                {"name": d["name"], "raw_chars": d["raw_chars"], "train_chars": len(d["train"]),
                 "val_chars": len(d["val"])}
                for d in docs
            ],
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "val_windows": len(val_windows),
        },
        "tokenizer_vocab_size": tok.get_vocab_size(),
        **{k: result[k] for k in ("steps", "planned_steps", "stop_reason", "tokens_seen", "train_time_s",
                                  "selected_step")},
        "epochs_seen": result["tokens_seen"] / len(train_stream),
        "wall_time_s": None,  # filled below
        "device": device_description(device),
        "device_type": device.type,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "loss_curve": result["curve"],
        "val_curve": result["evals"],
        "final_val_loss": final["loss"],
        "final_val_ppl": val_ppl,
        "final_val_tokens": final["tokens"],
        "final_expert_load": final["expert_load"],
        "weights_bytes": weights_bytes,
    }
    log["model_config"]["output_router_logits"] = False  # as saved
    write_model_card(out, log)
    log["wall_time_s"] = time.perf_counter() - t_start
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")

    size = folder_size(out)
    print(f"saved to {out}: {size / MB:.2f} MB total ({weights_bytes / MB:.2f} MB weights)")
    for f in sorted(out.iterdir()):
        print(f"  {f.name:28s} {f.stat().st_size:>12,d} B")
    print(f"reload + greedy sample: {check_reload(out, device)!r}")
    if size > args.max_size_mb * MB:
        print(f"ERROR: output folder is {size / MB:.2f} MB > {args.max_size_mb} MB limit", file=sys.stderr)
        return 3
    return 0


def load_summary(load: list[list[float]]) -> str:
    lo = min(min(layer) for layer in load)
    hi = max(max(layer) for layer in load)
    return f"min {lo:.3f}, max {hi:.3f} across layers (uniform {1 / len(load[0]):.3f})"


def print_expert_load(load: list[list[float]]) -> None:
    """Per-layer share of routing decisions; balanced = 1/num_experts each."""
    for i, layer in enumerate(load):
        lo, hi = min(layer), max(layer)
        print(f"  layer {i} expert load: min {lo:.3f} max {hi:.3f} (uniform {1 / len(layer):.3f})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
