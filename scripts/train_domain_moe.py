#!/usr/bin/env python3
"""Train models/domain-moe: a 4k-context, head_dim-128 Mixtral MoE on four domains, with retrieval.

Input: the folder written by scripts/prepare_domain_data.py (tokenizer, uint16 token streams per
domain, held-out text). Each training row is one domain's text (so experts can specialise by
domain); on top of plain language modelling, two kinds of rows teach retrieval:
  copy rows     (--copy-frac)     a span of 64-256 RANDOM tokens is written into the row and repeated
                                  later: the repeat is predictable only by copying (induction heads),
                                  never from memory; the first span is left out of the loss (noise).
                                  The tokens come from the --copy-vocab most frequent training ids
                                  (over all 4,095 ids, each id is too rare a target for the copy map
                                  to form: the copy loss stays at ln 4096, docs/decisions.md
                                  "domain-moe's training recipe"), and the
                                  copied span's mean loss is an extra term (--copy-loss-weight);
  passkey rows  (--passkey-frac)  moekv.eval.needle.build_prompt at a random length and depth with
                                  filler from a random training domain, followed by the key and '.';
                                  those tokens get an extra loss term (--answer-loss-weight).
Domain mixture (--domain-weights auto): rows are drawn from the domains in proportion to their
training tokens, and no domain is seen more than --max-passes times over the run's token budget
(--token-budget, which also sets the step count); if the budget would pass the cap, the capped
domains keep --max-passes and the rest of the tokens go to generated math (`domain_mixture`).
A length curriculum (--curriculum) starts with short rows and ends at 4096 with the same number of
tokens per step. The schedule (warmup, cosine, curriculum) runs on progress = max(step / max_steps,
elapsed / --time-budget-s), so a run cut by time still finishes its schedule. Router balance: the
usual per-layer Switch-Transformer load-balancing loss (coefficient --aux-loss-coef).

--arch deepseek-v3 trains the same way a DeepseekV3ForCausalLM instead (models/domain-mla): multi-head
latent attention (--kv-lora-rank, --qk-nope-head-dim, --qk-rope-head-dim, --v-head-dim, optional
--q-lora-rank), --first-k-dense-replace dense layers, then routed experts (sigmoid scores) with
--n-shared-experts always-on shared experts, group-limited routing (--n-group groups, a token keeps its
--topk-group best groups; --n-group 1 --topk-group 1 is the flat-routed twin, every other parameter the
same). transformers' V3 router trains as it is: the choice (groups, top-k) is a selection as in any
top-k MoE, the weights are the chosen experts' sigmoid scores, through which the router gets its
gradient. Its balance is DeepSeek-V3's: the selection bias e_score_correction_bias is moved by
--bias-update-rate after every step, towards the mean load (the aux-loss-free update), plus the
sequence-wise balance loss computed over the batch on the selection as routed (groups included) and the
normalised sigmoid scores (coefficient --aux-loss-coef, 1.0 = balanced).
Every --eval-every-tokens the held-out loss of each domain is measured and logged; the checkpoint
with the lowest mean held-out loss (unweighted over domains) is the one written out.

Output (--out, at most 8 files: what a GPU call can return):
  model.safetensors.part0, .part1   bf16 save_pretrained weights split in <= 15 MiB parts: the
                                    best held-out checkpoint so far (rewritten when it improves)
  config.json                       MixtralConfig
  train_log.jsonl                   one JSON object per logged step / evaluation
  eval.json                         final held-out loss per domain and passkey accuracy
  loss_curve.png                    (when matplotlib is there)
Join the parts with `cat model.safetensors.part* > model.safetensors`.

  python scripts/train_domain_moe.py --data /tmp/domain-data --out /tmp/run --token-budget 131072000
  python scripts/train_domain_moe.py --data /tmp/domain-smoke --out /tmp/run-smoke --smoke   # CPU, < 1 min
  python scripts/train_domain_moe.py --arch deepseek-v3 --data /tmp/domain-smoke --out /tmp/mla-smoke --smoke
  python scripts/train_domain_moe.py --data models/domain-moe --out /tmp/ev --evaluate-only models/domain-moe \
      --device cpu --eval-lengths 1024 --eval-keys 1     # re-evaluate a checkpoint (its folder holds heldout/)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # moekv.eval.needle: the passkey format shared with the eval
    sys.path.insert(0, str(REPO_ROOT))
from moekv.eval.needle import answer_is_correct, build_prompt, random_key  # noqa: E402

DOMAINS = ("prose", "drama", "code", "math")
# what --num-experts / --experts-per-tok / --intermediate-size / --tie-embeddings mean when not given
ARCH_DEFAULTS = {
    "mixtral": {"num_experts": 16, "experts_per_tok": 2, "intermediate_size": 176, "tie_embeddings": False},
    "deepseek-v3": {"num_experts": 32, "experts_per_tok": 4, "intermediate_size": 32, "tie_embeddings": True},
}
PART_BYTES = 15 * 1024 * 1024
EOT = "<|endoftext|>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="output folder of prepare_domain_data.py")
    p.add_argument("--out", type=Path, required=True)
    m = p.add_argument_group("model")
    m.add_argument("--arch", choices=tuple(ARCH_DEFAULTS), default="mixtral",
                   help="mixtral (models/domain-moe) or deepseek-v3 (MLA, group-limited routing: models/domain-mla)")
    m.add_argument("--hidden-size", type=int, default=256)
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--num-kv-heads", type=int, default=2, help="mixtral")
    m.add_argument("--head-dim", type=int, default=128, help="mixtral")
    m.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (mixtral 16, deepseek-v3 32)")
    m.add_argument("--experts-per-tok", type=int, default=None, help="mixtral 2, deepseek-v3 4")
    m.add_argument("--intermediate-size", type=int, default=None, help="per expert (mixtral 176, deepseek-v3 32)")
    m.add_argument("--max-position-embeddings", type=int, default=4096)
    m.add_argument("--rope-theta", type=float, default=50000.0)
    m.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the input embedding with the LM head (mixtral: no, deepseek-v3: yes, which keeps the "
                        "model under 5 M parameters)")
    v3 = p.add_argument_group("deepseek-v3 (--arch deepseek-v3)")
    v3.add_argument("--kv-lora-rank", type=int, default=128, help="the latent's width (cached per token)")
    v3.add_argument("--q-lora-rank", type=int, default=0, help="0: queries straight from the hidden state")
    v3.add_argument("--qk-nope-head-dim", type=int, default=64)
    v3.add_argument("--qk-rope-head-dim", type=int, default=32)
    v3.add_argument("--v-head-dim", type=int, default=64)
    v3.add_argument("--first-k-dense-replace", type=int, default=1, help="dense layers before the MoE layers")
    v3.add_argument("--dense-intermediate-size", type=int, default=512, help="the dense layers' MLP width")
    v3.add_argument("--n-shared-experts", type=int, default=1, help="shared experts, each --intermediate-size wide")
    v3.add_argument("--n-group", type=int, default=4, help="expert groups (1: flat routing)")
    v3.add_argument("--topk-group", type=int, default=2, help="groups a token keeps (1 with --n-group 1: flat)")
    v3.add_argument("--routed-scaling-factor", type=float, default=1.0)
    v3.add_argument("--bias-update-rate", type=float, default=1e-3,
                    help="DeepSeek-V3's aux-loss-free balance: each step every expert's selection bias moves by this "
                         "towards the mean load (0: off)")
    m.add_argument("--experts-impl", default="auto", help="auto (grouped_mm on CUDA if it works) | eager | grouped_mm")
    o = p.add_argument_group("optimisation")
    o.add_argument("--tokens-per-step", type=int, default=131072)
    o.add_argument("--curriculum", default="512:0.15,1024:0.15,2048:0.2,4096:0.5",
                   help="seq_len:fraction of progress, in order")
    o.add_argument("--token-budget", type=float, default=131072 * 1000,
                   help="training tokens; sets the step count (--tokens-per-step) and the pass cap's budget")
    o.add_argument("--curriculum-gate", type=float, default=None, metavar="NATS",
                   help="hold the curriculum's first length until the logged passkey answer loss is below NATS "
                        "(or --curriculum-gate-max of progress has passed); the later lengths then share what is left")
    o.add_argument("--curriculum-gate-max", type=float, default=0.6, help="progress at which the gate opens anyway")
    o.add_argument("--hold-lr-until-gate", action="store_true",
                   help="with --curriculum-gate: the peak lr while the gate is closed, the cosine over what is left "
                        "after it opens (the shipped run's lookup formed at steps 360-440 at lr 1.97e-3)")
    o.add_argument("--max-steps", type=int, default=None, help="default: --token-budget / --tokens-per-step")
    o.add_argument("--time-budget-s", type=float, default=1e9,
                   help="a safety cap on training time: the schedule ends early when it is reached")
    o.add_argument("--lr", type=float, default=2e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--warmup", type=float, default=0.03, help="fraction of progress")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--aux-loss-coef", type=float, default=0.01)
    d = p.add_argument_group("data mixture")
    d.add_argument("--domain-weights", default="auto",
                   help="auto (proportional to training tokens under --max-passes) or name:w,... (fixed)")
    d.add_argument("--max-passes", type=float, default=16.0,
                   help="auto weights: at most this many passes over a domain's training tokens in the budget")
    d.add_argument("--fill-domain", default="math", help="auto weights: the domain that takes what the cap leaves")
    d.add_argument("--copy-frac", type=float, default=0.1)
    d.add_argument("--copy-source", choices=("random", "text"), default="random",
                   help="copy rows repeat random token ids (default) or the row's own text (the shipped model)")
    d.add_argument("--passkey-frac", type=float, default=0.25)
    d.add_argument("--answer-loss-weight", type=float, default=1.0,
                   help="extra loss term: mean loss of the passkey answer tokens times this")
    d.add_argument("--copy-loss-weight", type=float, default=1.0,
                   help="extra loss term: mean loss of the copied spans' tokens times this (in the plain LM mean "
                        "they are ~2%% of the targets); 0: the LM mean only")
    d.add_argument("--copy-vocab", type=int, default=256,
                   help="random copy spans draw from this many most frequent training token ids; 0: from every id "
                        "1..vocab-1 (under which no copying formed)")
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--device", default="auto")
    r.add_argument("--log-every", type=int, default=20)
    r.add_argument("--eval-every-tokens", type=float, default=10e6,
                   help="held-out loss per domain (and a passkey spot check) every this many training tokens")
    r.add_argument("--eval-lengths", default="1024,2048,4096")
    r.add_argument("--eval-depths", default="0,0.25,0.5,0.75,1")
    r.add_argument("--eval-keys", type=int, default=5, help="passkeys per (length, depth, filler domain)")
    r.add_argument("--heldout-max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    r.add_argument("--evaluate-only", type=Path, default=None, metavar="MODEL_DIR",
                   help="no training: evaluate this checkpoint (held-out loss in float32 on CPU) into --out/eval.json")
    r.add_argument("--smoke", action="store_true", help="toy model and a few steps (CPU, < 1 min)")
    args = p.parse_args(argv)
    for key, value in ARCH_DEFAULTS[args.arch].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.hidden_size, args.num_layers, args.intermediate_size = 64, 2, 32
        args.num_heads, args.num_kv_heads, args.head_dim, args.num_experts = 2, 1, 32, 4
        if args.arch == "deepseek-v3":  # 8 experts: the groups (default 4, 2 kept) still bind top-3
            args.num_experts, args.experts_per_tok, args.intermediate_size = 8, 3, 16
            args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim = 32, 16, 8, 16
            args.dense_intermediate_size = 64
        args.max_position_embeddings = 512
        args.tokens_per_step, args.token_budget, args.log_every = 1024, 8 * 1024, 2
        args.eval_every_tokens = 3 * 1024
        args.curriculum = "128:0.5,256:0.5"
        args.eval_lengths, args.eval_depths, args.eval_keys = "256", "0,1", 1
        args.heldout_max_tokens = 1024
    args.curriculum_plan = parse_curriculum(args.curriculum)
    if args.max_steps is None:
        args.max_steps = max(1, int(args.token_budget // args.tokens_per_step))
    args.domain_weight_map = None if args.domain_weights == "auto" else parse_weights(args.domain_weights)
    if args.fill_domain not in DOMAINS:
        p.error(f"--fill-domain must be one of {', '.join(DOMAINS)}")
    if max(s for s, _ in args.curriculum_plan) > args.max_position_embeddings:
        p.error("a curriculum length exceeds --max-position-embeddings")
    if args.copy_frac + args.passkey_frac > 1:
        p.error("--copy-frac + --passkey-frac must be <= 1")
    if args.arch == "deepseek-v3":
        if args.n_group < 1 or args.num_experts % args.n_group:
            p.error(f"--n-group {args.n_group} must divide --num-experts {args.num_experts}")
        if not 1 <= args.topk_group <= args.n_group:
            p.error(f"--topk-group {args.topk_group} must be in [1, --n-group {args.n_group}]")
        if args.topk_group * (args.num_experts // args.n_group) < args.experts_per_tok:
            p.error(f"--topk-group {args.topk_group} groups of {args.num_experts // args.n_group} experts hold fewer "
                    f"than --experts-per-tok {args.experts_per_tok}")
        if args.num_experts // args.n_group < 2:
            p.error("a group needs at least 2 experts (a group's score is the sum of its best two)")
    return args


def parse_curriculum(spec: str) -> list[tuple[int, float]]:
    plan = []
    for item in spec.split(","):
        length, frac = item.split(":")
        plan.append((int(length), float(frac)))
    total = sum(f for _, f in plan)
    if total <= 0:
        raise ValueError(f"curriculum fractions must sum to > 0: {spec}")
    return [(length, f / total) for length, f in plan]


def parse_weights(spec: str) -> dict[str, float]:
    weights = {}
    for item in spec.split(","):
        name, w = item.split(":")
        if name not in DOMAINS:
            raise ValueError(f"unknown domain {name!r} (known: {', '.join(DOMAINS)})")
        weights[name] = float(w)
    return weights


def seq_len_at(plan: list[tuple[int, float]], progress: float) -> int:
    acc = 0.0
    for length, frac in plan:
        acc += frac
        if progress < acc:
            return length
    return plan[-1][0]


def gated_seq_len(plan: list[tuple[int, float]], progress: float, opened_at: float | None) -> int:
    """The curriculum with its first length held until a gate opened at progress `opened_at` (None: still
    closed); the phases after the first keep their relative shares of the progress left after max(opened_at,
    the first phase's planned end)."""
    first_end = plan[0][1]
    if opened_at is None:
        return plan[0][0]
    start = max(opened_at, first_end)
    if progress < start or len(plan) == 1:
        return plan[0][0]
    rest = plan[1:]
    scale = sum(f for _, f in rest)
    x = (progress - start) / max(1e-12, 1.0 - start)  # 0..1 over the later phases
    return seq_len_at([(length, f / scale) for length, f in rest], x)


def lr_at(progress: float, args: argparse.Namespace, decay_from: float | None = 0.0) -> float:
    """Warmup, then cosine to lr * min_lr_ratio over progress max(warmup, decay_from)..1; decay_from None:
    the peak lr (a curriculum gate still closed, with --hold-lr-until-gate)."""
    if progress < args.warmup:
        return args.lr * max(progress / args.warmup, 0.01)
    if decay_from is None:
        return args.lr
    start = max(args.warmup, decay_from)
    x = min(1.0, max(0.0, progress - start) / max(1e-9, 1.0 - start))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x)))


# --------------------------------------------------------------------------- #
# Rows (pure functions of a random generator; unit-tested in tests/test_domain_data.py)
# --------------------------------------------------------------------------- #
def window(stream: np.ndarray, length: int, rng: random.Random) -> list[int]:
    start = rng.randrange(0, len(stream) - length + 1)
    return stream[start : start + length].tolist()


def copy_row(stream: np.ndarray, length: int, rng: random.Random, vocab_size: int,
             source: str = "random", pool: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """A window of `stream` whose span [a, a+s) is repeated over [b, b+s), b >= a+s.

    source "random": the span is s random token ids, written at both places, so the repeat can only be
    predicted by copying; drawn from `pool` (ids, e.g. `copy_pool`'s frequent ones) or, with no pool,
    from 1..vocab_size-1; "text": the window's own text at [a, a+s) (the shipped model's rows, whose
    spans the model could recall from memory instead).
    Returns (ids, copied positions [b, b+s), noise positions: [a, a+s) for random spans (targets no
    model can predict), none for text).
    """
    ids = window(stream, length, rng)
    s = rng.randint(min(64, length // 4), min(256, length // 4))
    a = rng.randrange(0, length - 2 * s + 1)
    b = rng.randrange(a + s, length - s + 1)
    if source == "text":
        ids[b : b + s] = ids[a : a + s]
        return ids, list(range(b, b + s)), []
    if source != "random":
        raise ValueError(f"copy source {source!r}: use 'random' or 'text'")
    if pool is None:
        span = [rng.randrange(1, vocab_size) for _ in range(s)]
    else:
        span = [pool[rng.randrange(len(pool))] for _ in range(s)]
    ids[a : a + s] = span
    ids[b : b + s] = span
    return ids, list(range(b, b + s)), list(range(a, a + s))


def copy_pool(streams: dict, vocab_size: int, n: int, exclude: Sequence[int] = (0,)) -> list[int] | None:
    """The `n` most frequent token ids over the training streams (ids in `exclude` left out), ties by id;
    None for n <= 0 (copy spans then draw from the whole vocabulary)."""
    if n <= 0:
        return None
    counts = np.zeros(vocab_size, dtype=np.int64)
    for stream in streams.values():
        counts += np.bincount(np.asarray(stream, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    counts[list(exclude)] = -1
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return [int(i) for i in order[: min(n, vocab_size - len(set(exclude)))]]


def domain_mixture(sizes: dict[str, int], budget: float, max_passes: float,
                   fill: str) -> tuple[dict[str, float], dict[str, float]]:
    """(row weight per domain, passes over each domain's training tokens) for a run of `budget` tokens.

    Weights are proportional to the domains' training tokens, which gives every domain budget / total
    passes, while that is at most `max_passes`. Above it every domain but `fill` is held at
    `max_passes` and `fill` takes the remaining tokens (its passes are then above the cap:
    `generated_math_tokens` says how many fresh tokens bring them back under it).
    """
    if max_passes <= 0 or budget <= 0:
        raise ValueError(f"budget ({budget}) and max_passes ({max_passes}) must be > 0")
    if fill not in sizes:
        raise ValueError(f"fill domain {fill!r} is not among {sorted(sizes)}")
    total = sum(sizes.values())
    if budget / total <= max_passes:
        weights = {n: size / total for n, size in sizes.items()}
    else:
        weights = {n: max_passes * size / budget for n, size in sizes.items() if n != fill}
        weights[fill] = 1.0 - sum(weights.values())
        if weights[fill] < 0:  # only if the other domains alone exceed the budget at the cap (impossible here)
            raise ValueError("the capped domains exceed the budget")
    passes = {n: weights[n] * budget / sizes[n] for n in sizes}
    return {n: weights[n] for n in sizes}, passes


def generated_math_tokens(sizes: dict[str, int], budget: float, max_passes: float, fill: str) -> int:
    """Fresh `fill` tokens to add so that no domain passes `max_passes` (0 when the cap holds already)."""
    _, passes = domain_mixture(sizes, budget, max_passes, fill)
    if passes[fill] <= max_passes:
        return 0
    return math.ceil(budget / max_passes - sum(sizes.values()))


def extend_math(stream: np.ndarray, encode, eot_id: int, n_tokens: int, seed: int) -> np.ndarray:
    """`stream` followed by at least n_tokens of fresh exercises (prepare_domain_data's generator, a seed
    neither its training part (seed) nor its held-out part (seed + 1) uses)."""
    if n_tokens <= 0:
        return stream
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prepare_domain_data import math_document

    rng = random.Random(f"fresh-math-{seed}")
    extra: list[int] = []
    while len(extra) < n_tokens:
        extra.append(eot_id)
        extra.extend(encode(math_document(rng, rng.randrange(10, 41))))
    return np.concatenate([stream, np.asarray(extra, dtype=stream.dtype)])


def passkey_row(encode, stream: np.ndarray, length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """build_prompt at a random prompt length and depth, then the key and '.', then filler up to `length`.

    Returns (ids, answer positions): the positions of the key's tokens and of the '.' that ends the
    answer (where the key stops: a model that retrieves the key but runs on with more digits fails
    `answer_is_correct`).
    """
    key = random_key(rng)
    answer = encode(key)
    tail = encode(".\n")
    min_prompt = len(encode("\n")) + 64  # room for some filler
    prompt_len = rng.randint(min(length // 4, length - len(answer) - len(tail)) if length >= 256 else min_prompt,
                             length - len(answer) - len(tail))
    depth = rng.random()
    filler = window(stream, length, rng)
    prompt = build_prompt(encode, filler, prompt_len, depth, key)
    ids = prompt.ids + answer + tail
    positions = list(range(len(prompt.ids), len(prompt.ids) + len(answer) + 1))  # the key, then tail[0]
    rest = length - len(ids)
    if rest > 0:
        ids += window(stream, rest, rng)
    return ids[:length], positions


def make_batch(streams: dict, encode, length: int, n_rows: int, weights: dict[str, float], args,
               rng: random.Random, vocab_size: int, pool: Sequence[int] | None = None):
    """(ids (n_rows, length) long, copy mask, answer mask, noise mask, domain index per row).

    Noise positions (copy rows' random first span) are left out of the LM loss.
    """
    names = list(weights)
    w = [weights[n] for n in names]
    ids = np.zeros((n_rows, length), dtype=np.int64)
    copy_mask = np.zeros((n_rows, length), dtype=bool)
    answer_mask = np.zeros((n_rows, length), dtype=bool)
    noise_mask = np.zeros((n_rows, length), dtype=bool)
    dom = []
    for i in range(n_rows):
        name = rng.choices(names, w)[0]
        dom.append(DOMAINS.index(name))
        u = rng.random()
        if u < args.passkey_frac:
            row, pos = passkey_row(encode, streams[name], length, rng)
            answer_mask[i, pos] = True
        elif u < args.passkey_frac + args.copy_frac:
            row, pos, noise = copy_row(streams[name], length, rng, vocab_size, args.copy_source, pool)
            copy_mask[i, pos] = True
            noise_mask[i, noise] = True
        else:
            row = window(streams[name], length, rng)
        ids[i] = row
    return (torch.from_numpy(ids), torch.from_numpy(copy_mask), torch.from_numpy(answer_mask),
            torch.from_numpy(noise_mask), dom)


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
def build_model(args, vocab_size: int, eot_id: int):
    if args.arch == "deepseek-v3":
        return build_deepseek_v3(args, vocab_size, eot_id)
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        num_local_experts=args.num_experts, num_experts_per_tok=args.experts_per_tok,
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-5, tie_word_embeddings=args.tie_embeddings, router_aux_loss_coef=args.aux_loss_coef,
        output_router_logits=False, sliding_window=None,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
    )
    return MixtralForCausalLM(config)


def build_deepseek_v3(args, vocab_size: int, eot_id: int):
    """DeepseekV3ForCausalLM of the flags: topk_method noaux_tc (sigmoid scores, selection bias, groups scored
    by their best two), norm_topk_prob; n_group 1 / topk_group 1 routes over every expert (the flat twin)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
        kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank or None,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
        first_k_dense_replace=args.first_k_dense_replace, intermediate_size=args.dense_intermediate_size,
        n_routed_experts=args.num_experts, num_experts_per_tok=args.experts_per_tok,
        moe_intermediate_size=args.intermediate_size, n_shared_experts=args.n_shared_experts,
        n_group=args.n_group, topk_group=args.topk_group, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=args.routed_scaling_factor,
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-5, tie_word_embeddings=args.tie_embeddings, num_nextn_predict_layers=0,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
    )
    return DeepseekV3ForCausalLM(config)


def choose_experts_impl(model, args, device: torch.device) -> str:
    """grouped_mm on CUDA when a forward+backward with it runs; eager otherwise."""
    wanted = args.experts_impl
    if wanted == "auto":
        wanted = "grouped_mm" if device.type == "cuda" else "eager"
    if wanted == "eager":
        model.set_experts_implementation("eager")
        return "eager"
    try:
        model.set_experts_implementation(wanted)
        ids = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(input_ids=ids).logits.float().mean().backward()
        model.zero_grad(set_to_none=True)
        return wanted
    except Exception as e:  # keep training: a slower kernel beats a lost call
        print(f"[train] experts implementation {wanted} failed ({type(e).__name__}: {e}); using eager", flush=True)
        model.zero_grad(set_to_none=True)
        model.set_experts_implementation("eager")
        return "eager"


def balance_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss per layer, averaged over layers (1.0 = balanced)."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices.flatten()
        frac = torch.zeros(num_experts, device=probs.device).scatter_add_(
            0, chosen, torch.ones_like(chosen, dtype=probs.dtype)) / chosen.numel()
        losses.append(num_experts * torch.sum(frac * probs.mean(dim=0)))
    return torch.stack(losses).mean()


class RouterBalance:
    """The balance terms of a training step, for either architecture.

    mixtral: `balance_loss` of the router logits the forward returns. deepseek-v3: forward hooks on the
    routers keep each training forward's (logits, chosen experts); `loss` is the sequence-wise balance loss
    of DeepSeek-V3 over the batch (the chosen experts' share times the mean normalised sigmoid score, summed
    over experts, times the expert count: 1.0 = balanced), `after_step` moves each expert's selection bias
    by `rate` towards the mean load, and `max_load` reports the busiest expert's load over the mean load
    (worst layer) since the last call.
    """

    def __init__(self, model, args) -> None:
        self.arch, self.rate = args.arch, args.bias_update_rate
        self.num_experts, self.top_k = args.num_experts, args.experts_per_tok
        self.routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loads = [None] * len(self.routers)
        records = self.records

        def keep(module, inputs, output):  # a plain function: deep copies of the model (evaluation) share it
            if module.training and torch.is_grad_enabled():
                records.append((module, output[0], output[2]))

        for router in self.routers:
            router.register_forward_hook(keep)

    def forward_kwargs(self) -> dict:
        return {"output_router_logits": True} if self.arch == "mixtral" else {}

    def loss(self, out) -> torch.Tensor:
        if self.arch == "mixtral":
            return balance_loss(out.router_logits, self.num_experts, self.top_k)
        losses = []
        for _, logits, chosen in self.records:
            scores = torch.sigmoid(logits.float())
            share = scores / scores.sum(-1, keepdim=True)
            frac = torch.bincount(chosen.flatten(), minlength=self.num_experts).float() / chosen.numel()
            losses.append(self.num_experts * torch.sum(frac * share.mean(0)))
        return torch.stack(losses).mean()

    @torch.no_grad()
    def after_step(self) -> None:
        for module, _, chosen in self.records:
            load = torch.bincount(chosen.flatten(), minlength=self.num_experts).float()
            if self.rate:  # sign(mean - load), exact on integer counts
                module.e_score_correction_bias += self.rate * torch.sign(load.sum() - self.num_experts * load)
            i = self.routers.index(module)
            self.loads[i] = load if self.loads[i] is None else self.loads[i] + load
        self.records.clear()

    def max_load(self) -> float | None:
        """The busiest expert's load / the mean load, worst layer, since the last call (None: no record)."""
        if not self.routers or any(load is None for load in self.loads):
            return None
        worst = max(float(load.max() / load.mean()) for load in self.loads)
        self.loads = [None] * len(self.routers)
        return worst

    def bias_range(self) -> float | None:
        if not self.routers:
            return None
        return max(float(r.e_score_correction_bias.max() - r.e_score_correction_bias.min()) for r in self.routers)


# --------------------------------------------------------------------------- #
# Saving (bf16 save_pretrained, split in parts a GPU call can return)
# --------------------------------------------------------------------------- #
def save_parts(model, out: Path, step: int) -> None:
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    routers = dict(model.named_modules())
    for name, router in bf16.named_modules():  # V3's router weights and selection biases stay float32, as
        if type(router).__name__ == "DeepseekV3TopkRouter":  # DeepSeek ships them (bf16 would move the bias)
            router.weight.data = routers[name].weight.detach().float().clone()
            router.e_score_correction_bias.data = routers[name].e_score_correction_bias.detach().float().clone()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        bf16.save_pretrained(tmp)
        data = (Path(tmp) / "model.safetensors").read_bytes()
        n_parts = 0
        for i in range(0, len(data), PART_BYTES):
            part = Path(tmp) / f"model.safetensors.part{n_parts}"
            part.write_bytes(data[i : i + PART_BYTES])
            os.replace(part, out / part.name)
            n_parts += 1
        for stale in out.glob("model.safetensors.part*"):
            if int(stale.name.rsplit("part", 1)[1]) >= n_parts:
                stale.unlink()
        os.replace(Path(tmp) / "config.json", out / "config.json")
    print(f"[train] saved step {step}: {len(data) / 1e6:.1f} MB in {n_parts} parts", flush=True)


# --------------------------------------------------------------------------- #
# Evaluation
# --------------------------------------------------------------------------- #
@torch.no_grad()
def heldout_losses(model, tok, data: Path, window_len: int, device, max_tokens: int | None = None,
                   cache: dict | None = None) -> dict:
    """Token-weighted next-token loss per domain on non-overlapping windows of the held-out text."""
    model.eval()
    out = {}
    cache = {} if cache is None else cache
    for name in DOMAINS:
        if name not in cache:
            cache[name] = tok.encode((data / "heldout" / f"{name}.txt").read_text(encoding="utf-8")).ids[:max_tokens]
        ids = cache[name]
        total, count = 0.0, 0
        for i in range(0, len(ids) - 1, window_len):
            w = torch.tensor([ids[i : i + window_len]], device=device)
            if w.size(1) < 2:
                continue
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=w).logits
            total += F.cross_entropy(logits[0, :-1].float(), w[0, 1:], reduction="sum").item()
            count += w.size(1) - 1
        out[name] = {"loss": total / count, "tokens": count}
    model.train()
    return out


@torch.no_grad()
def passkey_eval(model, tok, data: Path, lengths, depths, keys_per_cell: int, device, seed: int,
                 dtype=torch.bfloat16) -> dict:
    """Greedy passkey accuracy (model cast to `dtype`) over held-out filler of every domain."""
    def encode(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    m = copy.deepcopy(model).to(dtype).eval()
    rng = random.Random(seed)
    fillers = {n: encode((data / "heldout" / f"{n}.txt").read_text(encoding="utf-8")) for n in DOMAINS}
    cells, per_domain = [], {n: [0, 0] for n in DOMAINS}
    for length in lengths:
        for depth in depths:
            ok = 0
            n = 0
            for name, filler in fillers.items():
                prompts = []
                for _ in range(keys_per_cell):
                    start = rng.randrange(0, max(1, len(filler) - length))
                    prompts.append(build_prompt(encode, filler[start : start + length], length, depth,
                                                random_key(rng)))
                ids = torch.tensor([p.ids for p in prompts], device=device)
                gen = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                                 pad_token_id=m.config.eos_token_id)
                for p, row in zip(prompts, gen[:, ids.size(1):].tolist()):
                    good = answer_is_correct(tok.decode(row), p.key)
                    ok += good
                    per_domain[name][0] += good
                    per_domain[name][1] += 1
                n += len(prompts)
            cells.append({"length": length, "depth": depth, "correct": ok, "total": n, "accuracy": ok / n})
    by_length = {}
    for c in cells:
        agg = by_length.setdefault(c["length"], [0, 0])
        agg[0] += c["correct"]
        agg[1] += c["total"]
    del m
    return {"dtype": str(dtype).replace("torch.", ""), "cells": cells,
            "by_length": {str(k): v[0] / v[1] for k, v in by_length.items()},
            "by_filler_domain": {k: v[0] / max(1, v[1]) for k, v in per_domain.items()}}


def plot_curve(log_path: Path, png: Path, title: str = "domain-moe") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[train] matplotlib missing: no loss_curve.png", flush=True)
        return
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["tokens"] / 1e6 for r in train]
    ax[0].plot(x, [r["lm_loss"] for r in train], label="train LM loss (all rows)")
    if any(r["copy_loss"] for r in train):  # 0 throughout: a run without copy rows
        ax[0].plot(x, [r["copy_loss"] for r in train], label="loss on copied spans", alpha=0.7)
    ax[0].plot(x, [r["answer_loss"] for r in train], label="loss on passkey answers", alpha=0.7)
    held = [r for r in rows if r.get("kind") == "heldout"]
    for name in DOMAINS:
        pts = [(r["tokens"] / 1e6, r["losses"][name]["loss"]) for r in held if name in r["losses"]]
        if pts:
            ax[0].plot(*zip(*pts), marker="o", ms=3, label=f"held-out {name}")
    kept = [r for r in held if r.get("best")]
    if kept:
        ax[0].axvline(kept[-1]["tokens"] / 1e6, color="grey", ls=":", label="kept checkpoint")
    handles, labels = ax[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax[0].legend(uniq.values(), uniq.keys(), fontsize=7)
    ax[0].set_xlabel("training tokens (M)")
    ax[0].set_ylabel("nats / token")
    ax[0].set_ylim(0, 8)
    ax[1].plot(x, [r["seq_len"] for r in train], label="sequence length")
    ax[1].set_xlabel("training tokens (M)")
    ax[1].set_ylabel("sequence length")
    ax2 = ax[1].twinx()
    ax2.plot(x, [r["lr"] for r in train], color="tab:orange", label="learning rate")
    ax2.set_ylabel("learning rate")
    fig.suptitle(f"{title} training")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def evaluate_only(args, device: torch.device) -> dict:
    """Held-out loss per domain and passkey accuracy of a saved checkpoint (the final evaluation of a run)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(args.evaluate_only, dtype=torch.float32).to(device)
    window_len = model.config.max_position_embeddings
    held = heldout_losses(model, tok, args.data, window_len, device, args.heldout_max_tokens)
    print("[eval] held-out loss: " + ", ".join(f"{k} {v['loss']:.4f}" for k, v in held.items()), flush=True)
    pk = passkey_eval(model, tok, args.data, [int(x) for x in args.eval_lengths.split(",")],
                      [float(x) for x in args.eval_depths.split(",")], args.eval_keys, device, args.seed + 999)
    print(f"[eval] passkey ({pk['dtype']}) by length: {pk['by_length']}", flush=True)
    result = {"model": str(args.evaluate_only), "device": str(device), "heldout": held, "heldout_window": window_len,
              "passkey": pk}
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> dict:
    from tokenizers import Tokenizer

    args = parse_args(argv)
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    if args.evaluate_only is not None:
        return evaluate_only(args, device)
    log_path = args.out / "train_log.jsonl"
    log_path.write_text("")

    def log(obj: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(obj) + "\n")

    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)

    def encode(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    streams = {n: np.load(args.data / f"train_{n}.npy") for n in DOMAINS}
    sizes = {n: len(s) for n, s in streams.items()}
    if args.domain_weight_map is None:
        extra = generated_math_tokens(sizes, args.token_budget, args.max_passes, args.fill_domain)
        if extra and args.fill_domain == "math":
            streams["math"] = extend_math(streams["math"], encode, eot_id, extra, args.seed)
            sizes["math"] = len(streams["math"])
        weights, passes = domain_mixture(sizes, args.max_steps * args.tokens_per_step, args.max_passes,
                                         args.fill_domain)
    else:
        weights = args.domain_weight_map
        planned = args.max_steps * args.tokens_per_step / sum(weights.values())
        passes = {n: weights.get(n, 0.0) * planned / sizes[n] for n in DOMAINS}
    print("[train] data: " + ", ".join(f"{n} {sizes[n]:,} tokens (weight {weights.get(n, 0):.3f}, "
                                       f"{passes[n]:.1f} passes)" for n in DOMAINS), flush=True)

    model = build_model(args, tok.get_vocab_size(), eot_id).to(device)
    impl = choose_experts_impl(model, args, device)
    balance = RouterBalance(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] {n_params / 1e6:.2f}M parameters, experts {impl}, device {device}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    mixture = {"train_tokens": sizes, "weights": weights, "passes": passes,
               "planned_tokens": args.max_steps * args.tokens_per_step}
    log({"kind": "config", "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "params": n_params, "experts_impl": impl, "torch": torch.__version__, "mixture": mixture,
         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})

    heldout_cache: dict = {}
    best: dict | None = None
    best_state: dict | None = None

    def checkpoint(step: int, tokens: int, seq_len: int) -> dict:
        """Held-out loss per domain; the weights are written out when their mean is the best so far."""
        nonlocal best, best_state
        t0 = time.time()
        held = heldout_losses(model, tok, args.data, args.max_position_embeddings, device,
                              args.heldout_max_tokens, heldout_cache)
        mean = sum(v["loss"] for v in held.values()) / len(held)
        pk = passkey_eval(model, tok, args.data, [seq_len], [0.5], 2, device, args.seed + step)
        improved = best is None or mean < best["mean_loss"]
        if improved:
            best = {"step": step, "tokens": tokens, "mean_loss": mean, "losses": held}
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            save_parts(model, args.out, step)
        record = {"kind": "heldout", "step": step, "tokens": tokens, "losses": held, "mean_loss": mean,
                  "best": improved, "passkey_by_length": pk["by_length"], "seconds": round(time.time() - t0, 2)}
        log(record)
        print(f"[eval] step {step}: held-out " + ", ".join(f"{k} {v['loss']:.3f}" for k, v in held.items())
              + f"; mean {mean:.3f}{' (best)' if improved else ''}; passkey at {seq_len}: {pk['by_length']}",
              flush=True)
        return record

    rng = random.Random(args.seed)
    step, tokens, t_train0, eval_s = 0, 0, time.time(), 0.0
    next_eval = args.eval_every_tokens
    last: dict | None = None
    vocab_size = tok.get_vocab_size()
    pool = copy_pool(streams, vocab_size, args.copy_vocab, (eot_id,))
    acc = dict.fromkeys(("lm", "copy", "ans", "bal", "n", "copy_n", "ans_n"), 0.0)
    eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    seq_len = args.curriculum_plan[0][0]
    gate_opened_at = None if args.curriculum_gate is not None else 0.0
    while True:
        elapsed = time.time() - t_train0
        progress = max(step / args.max_steps, elapsed / args.time_budget_s)
        if progress >= 1.0:
            break
        if gate_opened_at is None and progress >= args.curriculum_gate_max:
            gate_opened_at = progress
            log({"kind": "gate", "step": step, "tokens": tokens, "progress": progress, "reason": "max"})
        seq_len = gated_seq_len(args.curriculum_plan, progress, gate_opened_at)
        n_rows = max(1, args.tokens_per_step // seq_len)
        lr = lr_at(progress, args, gate_opened_at if args.hold_lr_until_gate else 0.0)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, copy_mask, ans_mask, noise_mask, _ = make_batch(streams, encode, seq_len, n_rows, weights, args, rng,
                                                             vocab_size, pool)
        ids = ids.to(device, non_blocking=True)
        copy_mask = copy_mask.to(device)[:, 1:]
        ans_mask = ans_mask.to(device)[:, 1:]
        keep = ~noise_mask.to(device)[:, 1:]  # targets inside a random span are noise: no LM loss there
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids, **balance.forward_kwargs())
        per_tok = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, out.logits.size(-1)),
                                  ids[:, 1:].reshape(-1), reduction="none").view(ids.size(0), -1)
        lm = (per_tok * keep).sum() / keep.sum().clamp(min=1)
        n_ans = ans_mask.sum()
        ans = (per_tok * ans_mask).sum() / n_ans.clamp(min=1)
        bal = balance.loss(out)
        n_copy = copy_mask.sum()
        cp = (per_tok * copy_mask).sum() / n_copy.clamp(min=1)
        loss = lm + args.answer_loss_weight * ans + args.copy_loss_weight * cp + args.aux_loss_coef * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        balance.after_step()
        step += 1
        tokens += ids.numel()
        # accumulate on the device: no host sync between log lines
        acc["lm"] += lm.detach()
        acc["bal"] += bal.detach()
        acc["n"] += 1
        acc["copy"] += (per_tok.detach() * copy_mask).sum()
        acc["copy_n"] += n_copy
        acc["ans"] += (per_tok.detach() * ans_mask).sum()
        acc["ans_n"] += n_ans
        if step % args.log_every == 0:
            acc = {k: float(v) for k, v in acc.items()}
            el = time.time() - t_train0
            row = {"kind": "train", "step": step, "tokens": tokens, "seq_len": seq_len, "lr": lr,
                   "lm_loss": acc["lm"] / acc["n"], "copy_loss": acc["copy"] / max(1, acc["copy_n"]),
                   "answer_loss": acc["ans"] / max(1, acc["ans_n"]), "balance": acc["bal"] / acc["n"],
                   "grad_norm": gnorm.item(), "elapsed_s": round(el, 1),
                   "tokens_per_s": round(tokens / max(1e-9, el - eval_s))}
            if balance.routers:  # deepseek-v3: the busiest expert over the mean, the selection biases' spread
                row.update(max_load=balance.max_load(), bias_range=balance.bias_range())
            log(row)
            if gate_opened_at is None and row["answer_loss"] < args.curriculum_gate and acc["ans_n"] > 0:
                gate_opened_at = progress
                log({"kind": "gate", "step": step, "tokens": tokens, "progress": progress, "reason": "answer_loss"})
                print(f"[train] curriculum gate open at step {step} (answer loss {row['answer_loss']:.3f})", flush=True)
            print(f"[train] step {step} len {seq_len} lr {lr:.2e} lm {row['lm_loss']:.3f} copy "
                  f"{row['copy_loss']:.3f} answer {row['answer_loss']:.3f} bal {row['balance']:.3f} "
                  f"{row['tokens_per_s']:,} tok/s {el:.0f}s", flush=True)
            acc = dict.fromkeys(acc, 0.0)
        if tokens >= next_eval:
            t0 = time.time()
            last = checkpoint(step, tokens, seq_len)
            next_eval += args.eval_every_tokens
            eval_s += time.time() - t0
    train_s = time.time() - t_train0
    print(f"[train] {step} steps, {tokens:,} tokens in {train_s:.0f}s ({eval_s:.0f}s of it evaluating)", flush=True)
    if last is None or last["step"] != step:
        last = checkpoint(step, tokens, seq_len)  # the last one is written out only if it is the best
    model.load_state_dict(best_state)
    print(f"[train] kept step {best['step']} ({best['tokens']:,} tokens): mean held-out {best['mean_loss']:.4f} "
          f"(last: {last['mean_loss']:.4f})", flush=True)

    t_eval = time.time()
    pk = passkey_eval(model, tok, args.data, eval_lengths, [float(x) for x in args.eval_depths.split(",")],
                      args.eval_keys, device, args.seed + 999)
    print(f"[eval] passkey ({pk['dtype']}) by length: {pk['by_length']}; by filler: {pk['by_filler_domain']}",
          flush=True)
    result = {"steps": step, "tokens": tokens, "train_seconds": round(train_s, 1), "eval_seconds_in_training":
              round(eval_s, 1), "final_eval_seconds": round(time.time() - t_eval, 1), "params": n_params,
              "experts_impl": impl, "mixture": mixture, "kept": {k: best[k] for k in ("step", "tokens", "mean_loss")},
              "heldout": best["losses"], "heldout_last": {"step": last["step"], "losses": last["losses"],
                                                          "mean_loss": last["mean_loss"]},
              "heldout_window": args.max_position_embeddings, "passkey": pk, "arch": args.arch,
              "curriculum_gate_opened_at": gate_opened_at}
    if args.arch == "deepseek-v3":
        result["routing"] = {"n_group": args.n_group, "topk_group": args.topk_group, "top_k": args.experts_per_tok,
                             "num_experts": args.num_experts, "bias_update_rate": args.bias_update_rate,
                             "aux_loss_coef": args.aux_loss_coef, "bias_range": balance.bias_range()}
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_curve(log_path, args.out / "loss_curve.png", "domain-moe" if args.arch == "mixtral" else
               f"domain-mla ({args.n_group} groups, {args.topk_group} kept)")
    print(f"[done] total {time.time() - t_start:.0f}s", flush=True)
    return result


if __name__ == "__main__":
    main()
