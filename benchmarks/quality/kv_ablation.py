#!/usr/bin/env python3
"""Which ingredients make a 2-bit KV cache keep domain-moe: an ablation by fake quantization on the CPU.

The model runs in `transformers` (float32) with an attention function that emulates how the engine
reads its cache once a prompt's prefill attends exact K/V:

- `exact-prefill` (the engine's reading): the prompt (the first half of each window) attends its exact
  K/V; each scored token t (the second half) attends the quantized K/V of every full page before its
  own page, and the exact K/V of its own (staging) page's tokens up to t. Extra exact tokens: the
  first S of the window (sinks) and the newest W before t (a ring of W tokens, as kivi2's residual
  window; kivi2 itself always has its R = 128). The K/V that every token computes (prompt exact,
  tail reading the quantized past) is what its page stores, quantized, as generation would.
- `prefill-quantized` (what kv_error_split.py and the engine's prefill windows measured): every full
  page is read quantized by every query, the query's own page included (kivi2: the window's newest
  R tokens exact, as one gather of the whole window returns its ring).

One forward pass per window: attention runs in page-sized query blocks, each over the exact and the
dequantized keys/values of the tokens before the block's end, choosing per (query, key) which one the
cache would give. Perplexity is scored on the second half of each window against the same windows
unquantized (through the same attention code).

A recipe quantizes keys and values by a moekv format (nuq2, kivi2, int4, fp8_e4m3, vq: their own
quantize -> dequantize, 64-token pages) or by a Lloyd-Max scalar code ('lm2', 'lm3': per-coordinate
Gaussian Lloyd-Max levels times a per-token fp16 RMS scale, 'lm2c': keys also centred per page and
coordinate by an fp8 mean), with these options on top:
  pre_rope   keys quantized before the rotary embedding (RoPE applied to the dequantized keys)
  rotate     a random Hadamard rotation (sign-randomised Walsh-Hadamard, seed 0, head_dim) of the
             keys after RoPE and of the values: rotate, quantize -> dequantize, rotate back (what
             attention in the rotated basis computes)
  sinks      the first S tokens of the sequence exact (16-bit)
  window     the newest W tokens exact besides the staging page
  outliers   a fraction f of each page-head's elements exact (fp16 value + uint16 position): keys
             ranked by |x - channel mean| / channel std over the page (a per-channel threshold),
             values by |x - token mean| / token std (per-token); the rest is quantized with the
             outliers clamped to the threshold so they set no range or centroid
  calib      nuq2 codebooks per (layer, K/V, KV head) fitted offline on training-domain text
             (models/domain-moe/README.md: the novels' heads, Tiny Shakespeare's first 90%, the
             stdlib modules not held out, the math generator's training seed), weighted 'plain',
             'cube' (nuq2's 1 + |z|^3) or 'fisher' (squared gradient of the loss w.r.t. each element)

Bits stored per element (K and V, one layer, one sequence) at context L, pages of P tokens:
  8 * [ (L // P) * Hkv * (K slab + V slab + 2 * outlier_bytes) + staging + ring + sinks ] / (2 * L * Hkv * D)
  slabs: the format's own layouts (PageLayout, slabs as on the CPU; calibrated nuq2 drops its
  centroids); staging: one 16-bit page of K and V (kivi2: plus its residual ring, as the format counts
  it); ring (window W) and sinks (S): W or S tokens of 16-bit K and V = 2 * Hkv * (W or S) * D * 2 bytes
  (counted on top of the quantized copies, as a ring beside the pages holds them);
  outliers: ceil(f * P * D) per page-head and kind, 4 bytes each (fp16 value, uint16 position);
  rotation, pre-RoPE keys, calibrated codebooks (per layer, not per sequence): 0.
For unchanged formats the formula gives the format's bits_per_element_at (checked at start).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/kv_ablation.py \\
        --out benchmarks/results/cpu/kv_ablation_domain-moe.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.nuq2 import fit_weight, lloyd_1d, normalize, outlier_mask

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "domain-moe"
DATA = REPO.parent.parent / "shared" / "data"  # /work/shared/data from a worktree (../shared/data from main)
PAGE = 64

# Lloyd-Max levels of a unit Gaussian (positive half; the code is symmetric)
LLOYD_MAX = {2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3439, 2.1520)}


# -- recipes --------------------------------------------------------------------------------------------
@dataclass
class Recipe:
    label: str
    key: str | None = "nuq2"  # format of the keys ('nuq2', 'kivi2', 'lm2', ..., None: exact)
    value: str | None = "nuq2"
    mode: str = "exact-prefill"
    pre_rope: bool = False
    rotate: bool = False
    sinks: int = 0
    window: int = 0
    outliers: float = 0.0
    calib: str | None = None  # nuq2 codebooks: None (per page), 'plain', 'cube', 'fisher'
    options: dict = field(default_factory=dict)  # format options, e.g. {"residual": 0} for kivi2


def N(label, **kw):
    return Recipe(label, **kw)


def default_recipes() -> list[Recipe]:
    kv = dict(key="kivi2", value="kivi2")
    return [
        # today's formats, both ways of reading the cache
        N("nuq2", mode="prefill-quantized"),
        N("kivi2 (R=128)", mode="prefill-quantized", **kv),
        N("nuq2"),
        N("kivi2 (R=128)", **kv),
        N("kivi2, R=0", options={"residual": 0}, **kv),
        N("int4", key="int4", value="int4"),
        # nuq2, one ingredient at a time
        N("nuq2 + pre-RoPE keys", pre_rope=True),
        N("nuq2 + Hadamard", rotate=True),
        N("lm2 + Hadamard (token RMS)", key="lm2", value="lm2", rotate=True),
        N("lm2c + Hadamard (keys centred)", key="lm2c", value="lm2", rotate=True),
        N("nuq2 + sinks 4", sinks=4),
        N("nuq2 + sinks 16", sinks=16),
        N("nuq2 + window 64", window=64),
        N("nuq2 + window 128", window=128),
        N("nuq2 + outliers 1%", outliers=0.01),
        N("nuq2 keys + kivi2 values", value="kivi2", options={"residual": 0}),
    ]


def kivi_recipes() -> list[Recipe]:
    kv = dict(key="kivi2", value="kivi2")
    return [  # kivi2, one ingredient at a time (its R=128 ring kept)
        N("kivi2 + pre-RoPE keys", pre_rope=True, **kv),
        N("kivi2 + Hadamard", rotate=True, **kv),
        N("kivi2 + sinks 16", sinks=16, **kv),
        N("kivi2 + outliers 1%", outliers=0.01, **kv),
    ]


def combined_recipes() -> list[Recipe]:
    return [
        N("nuq2 + pre-RoPE + sinks 16 + outliers 1%", pre_rope=True, sinks=16, outliers=0.01),
        N("lm3 + Hadamard", key="lm3", value="lm3", rotate=True),
    ]


def window_recipes() -> list[Recipe]:
    """The recent window with the ingredients that help beside it."""
    return [
        N("nuq2 + pre-RoPE + window 128", pre_rope=True, window=128),
        N("nuq2 + pre-RoPE + window 256", pre_rope=True, window=256),
        N("nuq2 + pre-RoPE + window 128 + outliers 1%", pre_rope=True, window=128, outliers=0.01),
        N("nuq2 + pre-RoPE + window 128 + calibrated fisher", pre_rope=True, window=128, calib="fisher"),
        N("nuq2 pre-RoPE keys + kivi2 values + window 128", value="kivi2", pre_rope=True, window=128,
          options={"residual": 0}),
        N("lm2 + Hadamard + window 128", key="lm2", value="lm2", rotate=True, window=128),
        N("lm3 + Hadamard + window 128", key="lm3", value="lm3", rotate=True, window=128),
        N("vq + pre-RoPE + window 128", key="vq", value="vq", pre_rope=True, window=128),
        N("vq + Hadamard + window 128", key="vq", value="vq", rotate=True, window=128),
        N("vq + pre-RoPE + window 256", key="vq", value="vq", pre_rope=True, window=256),
        N("vq + pre-RoPE + window 128 + outliers 1%", key="vq", value="vq", pre_rope=True, window=128,
          outliers=0.01),
        N("nuq2 + pre-RoPE + window 128 + calibrated cube", pre_rope=True, window=128, calib="cube"),
    ]


def calib_recipes() -> list[Recipe]:
    vq = dict(key="vq", value="vq")
    return [
        N("nuq2 + calibrated plain", calib="plain"),
        N("nuq2 + calibrated cube", calib="cube"),
        N("nuq2 + calibrated fisher", calib="fisher"),
        N("nuq2 + pre-RoPE + calibrated plain", pre_rope=True, calib="plain"),
        N("nuq2 + pre-RoPE + calibrated fisher", pre_rope=True, calib="fisher"),
        N("vq", **vq),
        N("vq + pre-RoPE keys", pre_rope=True, **vq),
        N("vq + Hadamard", rotate=True, **vq),
    ]


RECIPE_SETS = {"default": default_recipes, "kivi": kivi_recipes, "combined": combined_recipes,
               "calib": calib_recipes, "window": window_recipes}


PROMPT_PAGES: dict = {}  # quantizer signature -> {(signature, layer, window): dequantized prompt pages}
PROMPT_MEMO_QUANTIZERS = 6  # ~160 MB each for 10 windows of 4096


# -- quantizers -----------------------------------------------------------------------------------------
def hadamard(d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(H [d, d] orthonormal Walsh-Hadamard, signs [d] of +-1): x rotates to (x * signs) @ H, and y back
    to (y @ H) * signs (H is symmetric)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {d}")
    g = torch.Generator().manual_seed(seed)
    return h / math.sqrt(d), torch.randint(0, 2, (d,), generator=g).float() * 2 - 1


class LloydMax:
    """'lm2' / 'lm3' / 'lm2c': per-coordinate Gaussian Lloyd-Max levels times a per-token RMS (fp16);
    'c': keys first centred by their page's per-coordinate mean (fp8)."""

    def __init__(self, bits: int, centre: bool):
        half = torch.tensor(LLOYD_MAX[bits])
        self.levels = torch.cat([-half.flip(0), half])
        self.bits, self.centre = bits, centre

    def fakequant(self, x: torch.Tensor, kind: str) -> torch.Tensor:  # x [n, H, P, D]
        mean = 0.0
        if self.centre and kind == "key":
            mean = x.mean(dim=2, keepdim=True).to(torch.float8_e4m3fn).float()
        y = x - mean
        rms = y.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6).half().float()
        mids = (self.levels[1:] + self.levels[:-1]) / 2
        code = torch.bucketize(y / rms, mids)
        return self.levels[code] * rms + mean

    def slab_bytes(self, kind: str, P: int, D: int) -> int:
        fields = [self.bits * P * D // 8, 2 * P] + ([D] if self.centre and kind == "key" else [])
        used = 0
        for f in fields:
            used = -(-used // 16) * 16 + f
        return -(-used // 128) * 128


def clamp_outliers(x: torch.Tensor, kind: str, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H, P, D] -> (x with the chosen outliers clamped to the threshold, mask of the chosen ones).
    Keys: per channel (mean and std over the page's tokens), values: per token (over its channels)."""
    n, H, P, D = x.shape
    dim = 2 if kind == "key" else 3
    mean = x.mean(dim=dim, keepdim=True)
    std = x.std(dim=dim, keepdim=True, unbiased=False).clamp(min=1e-6)
    score = ((x - mean) / std).reshape(n * H, P * D)
    k = math.ceil(fraction * P * D)
    top = score.abs().topk(k + 1, dim=-1)
    thr = top.values[:, -1:]  # the largest score kept in the dense part
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top.indices[:, :k], True)
    clamped = torch.where(mask, score.clamp(-thr, thr), score).reshape(n, H, P, D) * std + mean
    return clamped, mask.reshape(n, H, P, D)


class Emulator:
    """Builds a recipe's quantizers and answers the attention function's questions for one run."""

    def __init__(self, recipe: Recipe | None, calibration: dict | None = None, Hkv: int = 2, D: int = 128):
        self.recipe = recipe
        self.H, self.signs = hadamard(D)
        self.q = {}
        if recipe is None:
            return
        for kind, name in (("key", recipe.key), ("value", recipe.value)):
            self.q[kind] = self._quantizer(name, kind, calibration)

    def _quantizer(self, name, kind, calibration):
        r = self.recipe
        if name is None:
            return None
        if name.startswith("lm"):
            return LloydMax(int(name[2]), name.endswith("c"))
        opts = {k: v for k, v in r.options.items() if not (name != "kivi2" and k == "residual")}
        if name == "vq":
            opts["calibration"] = calibration["vq_folder"]
        fmt = get_kv_format(name, torch.float32, **opts)
        if name == "nuq2" and r.calib:
            fmt.tables = calibration[r.calib]
            fmt.calibrated = True
        return fmt

    def ring(self) -> int:
        """Exact newest tokens besides the staging page: the recipe's window, or kivi2's residual."""
        r = self.recipe
        native = max((getattr(q, "residual", 0) for q in self.q.values() if q is not None), default=0)
        return max(r.window, native)

    def fakequant(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        """x [1, H, T, D] -> what the cache returns for its full pages (a partial last page as it is)."""
        q = self.q.get(kind)
        if q is None:
            return x
        _, H, T, D = x.shape
        n = T // PAGE
        pages = x[0, :, :n * PAGE].reshape(H, n, PAGE, D).transpose(0, 1).float()  # [n, H, P, D]
        if State.window_id is not None and self.recipe.mode == "exact-prefill" and T > State.half:
            # the prompt's pages are the same exact K/V in every exact-prefill recipe: quantize them
            # once per quantizer (the tail's pages depend on the recipe)
            key = (self.signature(kind), layer, State.window_id)
            memo = PROMPT_PAGES.setdefault(key[0], {})
            while len(PROMPT_PAGES) > PROMPT_MEMO_QUANTIZERS:
                PROMPT_PAGES.pop(next(iter(PROMPT_PAGES)))
            first = State.half // PAGE
            if key not in memo:
                memo[key] = self._pages(pages[:first], kind, layer)
            out = torch.cat([memo[key], self._pages(pages[first:], kind, layer)])
        else:
            out = self._pages(pages, kind, layer)
        out = out.transpose(0, 1).reshape(1, H, n * PAGE, D)
        return torch.cat([out.to(x.dtype), x[:, :, n * PAGE:]], dim=2)

    def signature(self, kind: str) -> tuple:
        r = self.recipe
        return (kind, r.key if kind == "key" else r.value, json.dumps(r.options, sort_keys=True), r.rotate,
                r.outliers, r.pre_rope and kind == "key", r.calib)

    def _pages(self, pages: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        """Full pages [n, H, P, D] through the recipe's quantize -> dequantize."""
        q = self.q[kind]
        if self.recipe.rotate:
            pages = (pages * self.signs) @ self.H
        if self.recipe.outliers:
            dense, mask = clamp_outliers(pages, kind, self.recipe.outliers)
        else:
            dense, mask = pages, None
        if isinstance(q, LloydMax):
            out = q.fakequant(dense, kind)
        else:
            out = q.dequantize(q.quantize(dense, kind, layer), kind, layer)
        if mask is not None:
            out = torch.where(mask, pages, out)
        if self.recipe.rotate:
            out = (out @ self.H) * self.signs
        return out

    # -- bits --------------------------------------------------------------------------------------------
    def slab_bytes(self, kind: str, Hkv: int, D: int) -> int:
        q = self.q[kind]
        if q is None:
            return 2 * PAGE * D
        if isinstance(q, LloydMax):
            return q.slab_bytes(kind, PAGE, D)
        return q.layout(kind, PAGE, D).slab_bytes

    def bits_at(self, L: int, Hkv: int = 2, D: int = 128) -> float:
        r = self.recipe
        page = Hkv * (self.slab_bytes("key", Hkv, D) + self.slab_bytes("value", Hkv, D))
        page += 2 * Hkv * 4 * math.ceil(r.outliers * PAGE * D)
        extra = 2 * Hkv * PAGE * D * 2  # the staging page
        extra += 2 * Hkv * (self.ring() + r.sinks) * D * 2
        return 8 * ((L // PAGE) * page + extra) / (2 * L * Hkv * D)


# -- the model ----------------------------------------------------------------------------------------
class State:
    emulator: Emulator | None = None
    stash: dict = {}
    capture: list | None = None  # calibration: (layer, k_pre, k, v) of every layer, grads kept
    half: int = 0  # the prompt's length in the window being run
    window_id: tuple | None = None  # (domain, i) of the window being run
    prompt: dict | None = None  # layer -> the prompt's (k_pre, cos, sin): written by a prompt pass, read by tails


def exact_mask(mode: str, b0: int, b1: int, T: int, half: int, sinks: int, ring: int) -> torch.Tensor | None:
    """[b1 - b0, b1] bool: which keys query block [b0, b1) reads exact (None: all of them)."""
    if mode == "exact-prefill" and b1 <= half:
        return None
    t = torch.arange(b0, b1)[:, None]
    j = torch.arange(b1)[None, :]
    if mode == "exact-prefill":
        m = j >= b0  # the staging page (blocks are pages)
        if ring:  # the newest tokens before each query
            m = m | (j > t - ring)
    else:  # one gather for the whole window: its partial last page and the ring's newest tokens exact
        m = j >= min((T // PAGE) * PAGE, T - ring)
    if sinks:
        m = m | (j < sinks)
    return m.expand(b1 - b0, b1)


def attend(q, k, v, kq, vq, scale, mode, sinks, ring, half):
    """q [1, Hq, Tq, D] (the last Tq of T positions), k/v exact and kq/vq dequantized [1, Hkv, T, D]
    -> [1, Tq, Hq, D]; half: the prompt's length."""
    _, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    first = T - Tq  # a multiple of PAGE: the prompt, when only the tail is run
    out = torch.empty(Hkv, G, Tq, D, dtype=q.dtype)
    qg = q[0].reshape(Hkv, G, Tq, D)
    for b0 in range(first, T, PAGE):
        b1 = min(T, b0 + PAGE)
        qb = qg[:, :, b0 - first:b1 - first] * scale  # [Hkv, G, n, D]
        causal = torch.arange(b1)[None, :] <= torch.arange(b0, b1)[:, None]  # [n, b1]
        m = exact_mask(mode, b0, b1, T, half, sinks, ring) if kq is not None else None
        if m is None or m.all():
            s = qb @ k[0, :, None, :b1].transpose(-1, -2)
        elif not m.any():
            s = qb @ kq[0, :, None, :b1].transpose(-1, -2)
        else:
            s = torch.where(m, qb @ k[0, :, None, :b1].transpose(-1, -2), qb @ kq[0, :, None, :b1].transpose(-1, -2))
        p = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
        if m is None or m.all():
            o = p @ v[0, :, None, :b1]
        elif not m.any():
            o = p @ vq[0, :, None, :b1]
        else:
            o = (p * m) @ v[0, :, None, :b1] + (p * ~m) @ vq[0, :, None, :b1]
        out[:, :, b0 - first:b1 - first] = o
    return out.reshape(Hq, Tq, D).transpose(0, 1)[None]


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, q, k, v, mask, scaling=None, **kw):
        layer = module.layer_idx
        if State.capture is not None:
            State.capture.append((layer, State.stash["k_pre"], k, v))
        em = State.emulator
        k_pre, cos, sin = (State.stash.get(name) for name in ("k_pre", "cos", "sin"))
        if State.prompt is not None and q.shape[2] == k.shape[2]:  # the prompt pass: keep what the tails need
            State.prompt[layer] = (k_pre, cos, sin)
        elif State.prompt is not None:  # a tail after the cached prompt: prepend the prompt's
            p_k, p_cos, p_sin = State.prompt[layer]
            k_pre, cos, sin = torch.cat([p_k, k_pre], 2), torch.cat([p_cos, cos], 1), torch.cat([p_sin, sin], 1)
        if em is not None and em.recipe is not None:
            r = em.recipe
            if r.pre_rope and em.q["key"] is not None:
                kq = State.rotate(k_pre, em.fakequant(k_pre, "key", layer), cos, sin)[1]
            else:
                kq = em.fakequant(k, "key", layer)
            vq = em.fakequant(v, "value", layer)
            return attend(q, k, v, kq, vq, scaling, r.mode, r.sinks, em.ring(), State.half), None
        return attend(q, k, v, None, None, scaling, "exact-prefill", 0, 0, State.half), None

    ALL_ATTENTION_FUNCTIONS.register("moekv_kv_ablation", attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="moekv_kv_ablation").eval()
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    State.rotate = rotate = modeling.apply_rotary_pos_emb

    def stash_and_rotate(q, k, cos, sin, *args, **kwargs):
        State.stash.update(k_pre=k, cos=cos, sin=sin)
        return rotate(q, k, cos, sin, *args, **kwargs)

    modeling.apply_rotary_pos_emb = stash_and_rotate
    return model


def nll(model, windows: dict[str, list[list[int]]], prompts: dict | None = None) -> dict[str, tuple[float, int]]:
    """Summed NLL and count of each domain's scored tokens (the second half of each window).
    prompts[(domain, i)]: window i's prompt pass (prompt_pass); the tail alone is run after it, which
    exact-prefill reading allows (the prompt attends exact K/V whatever the recipe)."""
    out = {}
    for name, rows in windows.items():
        total, count = 0.0, 0
        for i, ids in enumerate(rows):
            x = torch.tensor([ids])
            half = State.half = len(ids) // 2
            State.window_id = (name, i)
            with torch.no_grad():
                if prompts is None:
                    logits = model(x).logits[0, half - 1:-1].float()
                else:
                    cache, last, State.prompt = prompts[(name, i)]
                    tail = model(x[:, half:], cache=cache, use_cache=True).logits[0, :-1]
                    cache.crop(half - len(ids))  # drop the tail: a negative count removes tokens
                    State.prompt = None
                    logits = torch.cat([last, tail.float()])
            total += torch.nn.functional.cross_entropy(logits, x[0, half:], reduction="sum").item()
            count += len(ids) - half
        out[name] = (total, count)
    return out


def prompt_pass(model, windows: dict[str, list[list[int]]]) -> dict:
    """(domain, i) -> (the prompt's KV cache, its last position's logits [1, V], layer -> (k_pre, cos, sin))."""
    from transformers import DynamicCache

    out = {}
    for name, rows in windows.items():
        for i, ids in enumerate(rows):
            half = State.half = len(ids) // 2
            State.prompt, cache = {}, DynamicCache()
            with torch.no_grad():
                logits = model(torch.tensor([ids[:half]]), cache=cache, use_cache=True).logits
            out[(name, i)] = (cache, logits[0, -1:].float(), State.prompt)
            State.prompt = None
    return out


def ppl(nlls: dict) -> dict[str, float]:
    out = {k: math.exp(t / c) for k, (t, c) in nlls.items()}
    out["all"] = math.exp(sum(t for t, _ in nlls.values()) / sum(c for _, c in nlls.values()))
    return out


# -- data -----------------------------------------------------------------------------------------------
def scored_windows(tok, model_dir: Path, domains: list[str], n: int, window: int) -> dict[str, list[list[int]]]:
    out = {}
    for name in domains:
        path = DATA / "text" / "wikitext2_test.txt" if name == "wikitext" else model_dir / "heldout" / f"{name}.txt"
        ids = tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids
        out[name] = [ids[i * window:(i + 1) * window] for i in range(n)]
        if any(len(w) < window for w in out[name]):
            raise ValueError(f"{path} holds fewer than {n} windows of {window} tokens")
    return out


def calibration_windows(tok, window: int) -> dict[str, list[int]]:
    """One window of each domain's training part (scripts/prepare_domain_data.py's split)."""
    spec = importlib.util.spec_from_file_location("prepare_domain_data", REPO / "scripts" / "prepare_domain_data.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    domains = prep.load_domains(DATA, 195_000, 200_000, 1234, False)
    out = {}
    for name, (train, _) in domains.items():
        text = "".join(train)
        start = len(text) // 3  # away from the books' front matter and the first modules
        out[name] = tok.encode(text[start:start + 20 * window], add_special_tokens=False).ids[:window]
    return out


# -- calibration ---------------------------------------------------------------------------------------
def calibrate(model, windows: dict[str, list[int]]) -> dict:
    """nuq2 codebooks per (layer, K/V, KV head), keys before and after RoPE, weighted plain / cube /
    fisher -> {(weighting, pre_rope): {table name: centroids [H, 4] fp16}}."""
    captured = []
    for ids in windows.values():
        State.capture = []
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, x[0, 1:])
        tensors = [t for _, *ts in State.capture for t in ts]
        grads = torch.autograd.grad(loss, tensors)
        for i, (layer, *ts) in enumerate(State.capture):
            captured.append((layer, [t.detach() for t in ts], [g.detach() for g in grads[3 * i:3 * i + 3]]))
        State.capture = None
    tables: dict = {}
    for weighting in ("plain", "cube", "fisher"):
        for pre in (False, True):
            out = {}
            for layer in sorted({c[0] for c in captured}):
                rows = [c for c in captured if c[0] == layer]
                for kind, which in (("key", 0 if pre else 1), ("value", 2)):
                    x = torch.cat([to_pages(r[1][which]) for r in rows])  # [n, H, P, D]
                    g = torch.cat([to_pages(r[2][which]) for r in rows])
                    z, side = normalize(x, kind)
                    H = z.shape[1]
                    flat = z.transpose(0, 1).reshape(H, -1)
                    if weighting == "plain":
                        w = None
                    elif weighting == "cube":
                        w = fit_weight(flat, kind)
                    else:
                        gz = g * side["chan_scale"][:, :, None] if kind == "key" else g  # dL/dz = dL/dx * scale
                        w = gz.pow(2).transpose(0, 1).reshape(H, -1)
                        w = w / w.mean(-1, keepdim=True).clamp(min=1e-30)
                    c = lloyd_1d(flat, ~outlier_mask(flat, 3.5), iters=30, weight=w)
                    out[f"nuq2.layer{layer}.{kind}.centroids"] = c.to(torch.float16)
            tables[(weighting, pre)] = out
    H, signs = hadamard(captured[0][1][0].shape[-1])
    for basis in ("post", "pre", "rot"):
        tables[("vq", basis)] = fit_vq(captured, basis, (H, signs))
    return tables


def fit_vq(captured: list, basis: str, rotation: tuple) -> Path:
    """vq codebooks and key channel scales per layer (moekv.kvcache.formats.vq's fitting) on keys
    after RoPE ('post'), before it ('pre') or after it and Hadamard-rotated with the values ('rot');
    written to a temporary calibration folder."""
    import tempfile

    from moekv.kvcache.calibration_io import save_calibration
    from moekv.kvcache.formats.vq import SUB_DIM, fit_codebook, fit_key_channel_scale

    g = torch.Generator().manual_seed(0)
    tables = {}
    for layer in sorted({c[0] for c in captured}):
        rows = [c for c in captured if c[0] == layer]
        for kind, which in (("key", 0 if basis == "pre" else 1), ("value", 2)):
            x = torch.cat([to_pages(r[1][which]) for r in rows])
            if basis == "rot":
                x = (x * rotation[1]) @ rotation[0]
            scale = fit_key_channel_scale(x) if kind == "key" else None
            if scale is not None:
                tables[f"vq.layer{layer}.key.chan_scale"] = scale
            tables[f"vq.layer{layer}.{kind}.codebook"] = fit_codebook(x, kind, scale, SUB_DIM, 8, 4096, g)
    return save_calibration(tempfile.mkdtemp(prefix=f"kv_ablation_vq_{basis}_"), tables)


def to_pages(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> full pages [n, H, P, D] (float32)."""
    _, H, T, D = x.shape
    n = T // PAGE
    return x[0, :, :n * PAGE].reshape(H, n, PAGE, D).transpose(0, 1).float()


# -- main -----------------------------------------------------------------------------------------------
def check_bits() -> None:
    """The bits formula against the formats' own count for unchanged formats."""
    for name, opts in (("nuq2", {}), ("kivi2", {}), ("kivi2", {"residual": 0}), ("int4", {})):
        em = Emulator(Recipe(name, key=name, value=name, options=opts))
        fmt = get_kv_format(name, torch.float32, **opts)
        for L in (4096, 32768):
            ours, theirs = em.bits_at(L), fmt.bits_per_element_at(L, 2, PAGE, 128)
            if abs(ours - theirs) > 1e-9:
                raise AssertionError(f"{name} {opts} at {L}: formula {ours} != format {theirs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--domains", nargs="+", default=["prose", "drama", "code", "math", "wikitext"],
                   help="held-out/<name>.txt, or 'wikitext' (WikiText-2 test)")
    p.add_argument("--windows", type=int, default=2, help="windows per domain")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--sets", nargs="+", default=["default"], choices=sorted(RECIPE_SETS))
    p.add_argument("--only", nargs="*", help="labels to run, in this order (default: every recipe of the sets)")
    p.add_argument("--out", type=Path, required=True, help="JSON; recipes already in it are kept, not re-run")
    p.add_argument("--table", action="store_true", help="print --out's runs as a markdown table and stop")
    args = p.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.out.read_text())))
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.window // 2 % PAGE:
        raise ValueError(f"--window must split into page-aligned halves of {PAGE}-token pages")
    check_bits()
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    windows = scored_windows(tok, args.model, args.domains, args.windows, args.window)
    model = load(args.model)
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    setup = {"model": args.model.name, "dtype": "float32", "page": PAGE, "window": args.window,
             "windows_per_domain": args.windows, "domains": args.domains,
             "scored": "second half of each window"}
    if any(record.get(k) != v for k, v in setup.items()):
        record = dict(setup, runs=[])
    record["command"] = ("OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/kv_ablation.py --sets "
                         + " ".join(args.sets) + f" --windows {args.windows} --out {args.out}")
    start = time.perf_counter()
    if "unquantized" not in record:
        base = nll(model, windows)
        record["unquantized"] = ppl(base)
        record["unquantized_seconds"] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(record, indent=1))
    print("unquantized:", {k: round(v, 3) for k, v in record["unquantized"].items()}, flush=True)
    recipes = [r for s in args.sets for r in RECIPE_SETS[s]()]
    if args.only:  # in the order given
        recipes = [r for label in args.only for r in recipes if r.label == label]
    done = {(r["label"], r["mode"]) for r in record["runs"]}
    calibration = prompts = None
    for r in recipes:
        if (r.label, r.mode) in done:
            continue
        if needs_calibration(r) and calibration is None:
            t0 = time.perf_counter()
            calibration = calibrate(model, calibration_windows(tok, args.window // 2))
            print(f"(calibrated in {time.perf_counter() - t0:.0f} s)", flush=True)
        t0 = time.perf_counter()
        if r.mode == "exact-prefill" and prompts is None:
            prompts = prompt_pass(model, windows)
        State.emulator = Emulator(r, _calib_for(r, calibration))
        got = ppl(nll(model, windows, prompts if r.mode == "exact-prefill" else None))
        State.emulator = None
        base = record["unquantized"]
        change = {k: 100 * (got[k] / base[k] - 1) for k in got}
        em = Emulator(r, _calib_for(r, calibration))
        run = dict(asdict(r), ppl=got, change_percent=change, bits_4k=em.bits_at(4096), bits_32k=em.bits_at(32768),
                   seconds=round(time.perf_counter() - t0, 1))
        record["runs"].append(run)
        args.out.write_text(json.dumps(record, indent=1))
        print(f"{r.label} [{r.mode}] {run['bits_32k']:.3f} b (4k {run['bits_4k']:.3f}): "
              + ", ".join(f"{k} {v:+.1f}%" for k, v in change.items()) + f" ({run['seconds']:.0f} s)", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


def markdown_table(record: dict) -> str:
    domains = record["domains"]
    base = record["unquantized"]
    lines = ["| recipe | reading | bits at 32k (4k) | " + " | ".join(domains) + " | all |",
             "|---|---|---|" + "---|" * (len(domains) + 1),
             "| unquantized | | 16 | " + " | ".join(f"{base[d]:.4g}" for d in domains) + f" | {base['all']:.4g} |"]
    order = [(r.label, r.mode) for make in RECIPE_SETS.values() for r in make()]
    rank = {key: i for i, key in enumerate(order)}
    for r in sorted(record["runs"], key=lambda r: rank.get((r["label"], r["mode"]), len(order))):
        worst = max(r["change_percent"][d] for d in domains)
        cells = [f"{r['change_percent'][d]:+.1f}%" for d in domains]
        lines.append(f"| {r['label']} | {r['mode']} | {r['bits_32k']:.2f} ({r['bits_4k']:.2f}) | " + " | ".join(cells)
                     + f" | **{r['change_percent']['all']:+.1f}%** (worst {worst:+.1f}%) |")
    return "\n".join(lines)


def needs_calibration(r: Recipe) -> bool:
    return bool(r.calib) or "vq" in (r.key, r.value)


def _calib_for(r: Recipe, calibration: dict | None) -> dict | None:
    out = {}
    if r.calib:
        out[r.calib] = calibration[(r.calib, r.pre_rope)]
    if "vq" in (r.key, r.value):
        out["vq_folder"] = calibration[("vq", "rot" if r.rotate else "pre" if r.pre_rope else "post")]
    return out or None


if __name__ == "__main__":
    main()
