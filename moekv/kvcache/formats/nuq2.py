"""nuq2: 2-bit codes into a 4-centroid non-uniform codebook, plus dense-and-sparse outliers in FP8.

Per (page, kv head) slab, P = block_size tokens, D = head_dim channels, N = P*D elements:

  codes       uint8  [P, D/4]  4 codes per byte, planar in each row (see pack_codes)
  chan_mean   fp8    [D]       keys only: the page's channel means   } keys have outlier channels
  chan_scale  fp8    [D]       keys only: the page's channel stds    } (offsets of several sigma)
  centroids   fp16   [4]       per-page k-means; absent when the codebook is calibrated
  out_val     fp8    [S]       outliers, in units of the codebook's largest |centroid|
  out_idx     uint16 [S]       their position t*D + c; 0xFFFF marks an unused slot

Keys are centred and scaled per channel over the page's tokens (robust moments, stored in FP8:
the same error as fp16 at half the bytes); values are coded as they are (a per-token value scale
cost more bytes than the error it saved: docs/decisions.md, "nuq2's slab"). An element is an
outlier when its normalised value lies more than tau (outlier_sigma) robust standard deviations
from its page-head's mean; the S slots (at most outlier_cap of them) keep the largest such deviations, which
leave the k-means fit (the code under a slotted element is whatever it is: the slot overrides it). S is at
least 0.5% of N for keys and grows to fill the 128-byte padding the slab pays for anyway; values get only
the padding's slots.

Codebooks: per page by 1-D k-means (Lloyd from the inliers' quantiles), or, when the calibration
folder holds nuq2 codebooks, per (layer, K/V, head) from `moekv calibrate`. Calibrated, the value
slab is codes only: at (64, 32) K 640 B + V 512 B = 2.25 bits/element instead of 2.5.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from moekv import envs
from moekv.kvcache.calibration_io import keys_fitted_before_rope, load_calibration, other_side, shard_head_tables
from moekv.kvcache.formats.fragment import FragmentPagedFormat, GluonKernel
from moekv.kvcache.formats.interface import CalibrationFitter
from moekv.kvcache.formats.options import CALIBRATION, KEYS_BEFORE_ROPE, KVOption, integer_at_least, one_of, positive
from moekv.kvcache.formats.paged import Field, PageLayout, per_shape
from moekv.kvcache.formats.residual import RESIDUAL_OPTION, ResidualWindow, gluon_ring
from moekv.kvcache.formats.sinks import SINK_OPTION, SinkTokens
from moekv.ops.nuq2_codes import CODES_PER_BYTE, NO_OUTLIER, pack_codes, unpack_codes  # noqa: F401 (re-exported)

FP8_MAX = 448.0  # largest finite E4M3 value
NUM_CENTROIDS = 4
KEY_MIN_OUTLIER_FRACTION = 0.005  # keys' tails cost the most; values take padding only (docs/decisions.md)
KMEANS_ITERS = 8  # 1-D Lloyd from quantiles converges in a few; more barely moved the error (docs/decisions.md)


def assign(z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest of the sorted centroids c [B, 4] for each z [B, N] -> codes [B, N] (int64)."""
    mids = (c[:, 1:] + c[:, :-1]) / 2  # [B, 3]: in 1-D the nearest centroid is a threshold test
    return (z > mids[:, 0:1]).long() + (z > mids[:, 1:2]).long() + (z > mids[:, 2:3]).long()


def lloyd_1d(z: torch.Tensor, keep: torch.Tensor, iters: int = KMEANS_ITERS,
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted centroids [B, 4] of the kept elements of each row of z [B, N] (keep [B, N] bool),
    minimising the squared error weighted by `weight` [B, N] (default 1).

    Deterministic start at the kept elements' 1/8, 3/8, 5/8, 7/8 quantiles; 1-D Lloyd preserves
    the order; an empty cluster keeps its centroid. A row with nothing kept gets zeros.
    """
    B, N = z.shape
    ranked = torch.where(keep, z, torch.full_like(z, math.inf)).sort(dim=-1).values  # kept first
    count = keep.sum(-1, keepdim=True)  # [B, 1]
    q = (2 * torch.arange(NUM_CENTROIDS, device=z.device) + 1) / (2 * NUM_CENTROIDS)  # no host copy: capturable
    c = ranked.gather(1, (q * count).long().clamp(max=N - 1))  # [B, 4]
    c = torch.where(count > 0, c, torch.zeros_like(c))
    w = keep.to(z.dtype) if weight is None else keep.to(z.dtype) * weight
    zw = z * w
    for _ in range(iters):
        code = assign(z, c)
        # each cluster's sums by a masked reduction: a scatter_add into 4 bins per row serialises
        # on atomics (docs/decisions.md: the formats' host work in bulk)
        members = [code == k for k in range(NUM_CENTROIDS)]
        sums = torch.stack([torch.where(m, zw, 0.0).sum(-1) for m in members], dim=-1)  # [B, 4]
        cnts = torch.stack([torch.where(m, w, 0.0).sum(-1) for m in members], dim=-1)
        c = torch.where(cnts > 0, sums / cnts.clamp(min=1e-12), c)
    return c.sort(dim=-1).values


def fit_weight(z: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Keys: weight each normalised element by 1 + |z|^3 in the k-means. Plain k-means shrinks
    the extremes toward the mean (each centroid is its cluster's mean), and the extremes of keys
    make the largest attention logits: unweighted, attention flattened and perplexity rose well
    beyond KIVI's keys at a lower MSE; of the weights tried 1 + |z|^3 lost the least. Values: plain
    k-means (weighting them hurt). The figures: docs/decisions.md, "nuq2's key centroids"."""
    return 1.0 + z.abs().pow(3) if kind == "key" else None


# -- sparse outliers (shared with vq) ---------------------------------------------------------------
def outlier_fields(slots: int) -> list[Field]:
    if not slots:
        return []
    return [Field("out_val", torch.float8_e4m3fn, (slots,)), Field("out_idx", torch.uint16, (slots,))]


def fit_slots_to_padding(fields_for: Callable[[int], list[Field]], min_slots: int, max_slots: int) -> int:
    """The most outlier slots whose slab is no larger than the one `min_slots` needs: the 128-byte
    padding of a slab holds outliers at no cost in bits."""
    slab = PageLayout(fields_for(min_slots)).slab_bytes
    slots = min_slots
    while slots < max_slots and PageLayout(fields_for(slots + 1)).slab_bytes == slab:
        slots += 1
    return slots


def pick_largest(score: torch.Tensor, eligible: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `slots` largest scores among the eligible ones of each row of [B, N] ->
    (positions [B, S], chosen [B, S] bool: False where fewer were eligible)."""
    top = torch.where(eligible, score, torch.full_like(score, -1.0)).topk(slots, dim=-1)
    return top.indices, top.values >= 0


def store_outliers(flat: torch.Tensor, idx: torch.Tensor, chosen: torch.Tensor, unit: torch.Tensor,
                   n: int, H: int) -> dict:
    """The slot fields for values flat [B=n*H, N] at positions idx [B, S] (chosen ones only), in
    units of unit [B, 1] (which the reader knows too), so FP8 sees magnitudes near 1 whatever the
    scale of the data (raw values of 1e-3 would fall into FP8's coarse subnormals)."""
    val = torch.where(chosen, flat.gather(1, idx) / unit, torch.zeros_like(idx, dtype=flat.dtype))
    pos = torch.where(chosen, idx, torch.full_like(idx, NO_OUTLIER))
    return {"out_val": val.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(n, H, -1),
            "out_idx": pos.to(torch.int32).to(torch.uint16).reshape(n, H, -1)}


def apply_outliers(z: torch.Tensor, fields: dict, unit: torch.Tensor) -> torch.Tensor:
    """Overwrite the slotted elements of z [n, H, P, D] with their FP8 values times unit [n*H, 1]."""
    n, H, P, D = z.shape
    N = P * D
    idx = fields["out_idx"].long().reshape(n * H, -1).clamp(max=N)  # unused slots -> spare column N
    val = fields["out_val"].float().reshape(n * H, -1) * unit
    hit = torch.zeros(n * H, N + 1, dtype=torch.bool, device=z.device).scatter_(1, idx, True)[:, :N]
    dense = torch.zeros(n * H, N + 1, device=z.device).scatter_(1, idx, val)[:, :N]
    return torch.where(hit, dense, z.reshape(n * H, N)).reshape(n, H, P, D)


# -- normalisation ------------------------------------------------------------------------------------
def robust_moments(x: torch.Tensor, dim, k: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over `dim`, re-estimated without the elements beyond k std of a first pass: one
    huge element must not inflate the scale that its smaller neighbours are judged and coded by."""
    mean = x.mean(dim=dim, keepdim=True)
    std = x.std(dim=dim, unbiased=False, keepdim=True)
    w = ((x - mean).abs() <= k * std).to(x.dtype)
    count = w.sum(dim=dim, keepdim=True).clamp(min=1)
    mean = (x * w).sum(dim=dim, keepdim=True) / count
    std = ((x - mean).pow(2) * w).sum(dim=dim, keepdim=True).div(count).sqrt()
    return mean, std


def normalize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, dict]:
    """x [n, H, P, D] -> (z the codebook sees, side fields). Keys: per channel over the page's tokens,
    mean and std stored in FP8; z uses the stored values, so their rounding costs no consistency."""
    if kind != "key":
        return x, {}
    mean, std = robust_moments(x, dim=2)  # [n, H, 1, D]
    mean = mean.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # a constant channel has std 0: floor it relative to the page-head's magnitude
    floor = 1e-3 * x.abs().amax(dim=(2, 3), keepdim=True) + 1e-12
    scale = torch.maximum(std, floor).clamp(max=FP8_MAX)
    scale = scale.to(torch.float8_e4m3fn).float().clamp(min=2.0 ** -9)  # smallest E4M3 subnormal
    return (x - mean) / scale, {"chan_mean": mean[:, :, 0], "chan_scale": scale[:, :, 0]}


def denormalize(z: torch.Tensor, fields: dict, kind: str) -> torch.Tensor:
    if kind != "key":
        return z
    return z * fields["chan_scale"].float()[:, :, None] + fields["chan_mean"].float()[:, :, None]


def centroid_unit(c: torch.Tensor) -> torch.Tensor:
    """The outliers' unit: the codebook's largest |centroid|, c [B, 4] -> [B, 1] (never 0)."""
    return c.abs().amax(-1, keepdim=True).clamp(min=1e-6)


def outlier_mask(flat: torch.Tensor, tau: float) -> torch.Tensor:
    """Elements of flat [B, N] more than tau (robust) standard deviations from their row's mean."""
    mean, std = robust_moments(flat, dim=-1)
    return (flat - mean).abs() > tau * std


def fit_centroids(pages: torch.Tensor, kind: str, tau: float = 3.5) -> torch.Tensor:
    """Calibration: one codebook per head [H, 4] (fp16) from pages [n, H, P, D], fitted on the
    normalised inliers exactly as the format normalises them."""
    z, _ = normalize(pages, kind)
    flat = z.transpose(0, 1).reshape(z.shape[1], -1)  # [H, n*P*D]
    return lloyd_1d(flat, ~outlier_mask(flat, tau), iters=30, weight=fit_weight(flat, kind)).to(torch.float16)


def fit_tables(pages: torch.Tensor, layer: int, kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`moekv calibrate`'s fit (NUQ2Format.calibration_fitter): the layer's codebooks of one kind."""
    return {f"nuq2.layer{layer}.{kind}.centroids": fit_centroids(pages, kind)}  # [Hkv, 4] fp16


def _gluon_covers(fmt: NUQ2Format, block_size: int, head_dim: int) -> str | None:
    if fmt.keys_before_rope:
        return ("nuq2's Gluon kernel reads keys stored after RoPE; keys_before_rope=True takes the Triton "
                "kernel (decode_kernel='triton' or 'auto')")
    if (block_size, head_dim) == (64, 128) and not fmt.codebooks_not_fp16():
        return None
    return ("nuq2's Gluon kernel covers block_size 64, head_dim 128 and fp16 codebooks, "
            f"got block_size {block_size}, head_dim {head_dim}")


CODEBOOKS = ("auto", "page", "calibrated")


# the outlier threshold of nuq2 and of tiered's nuq2 tier: default None, each format's own (the registry
# wants one declared default for every format that takes an option)
OUTLIER_SIGMA = KVOption("outlier_sigma", None, "nuq2/tiered: outlier threshold in robust std devs "
                         "(default: the format's own, 3.0 for nuq2 and tiered)",
                         lambda value: None if value is None else positive(value), kind=float)
# at most this many of a page-head's slots filled, a kind: its largest deviations beyond the threshold; the
# Gluon kernel adds slots in chunks of 16 a kind and runs a further chunk only where more are used, so 16
# bounds its slot work on any data (docs/decisions.md, "nuq2's outlier slots: the threshold against the
# kernel's time"). The slab keeps its slots (the bits do not change); the rest stay unused. Default None,
# each format's own (16 for nuq2, every slot for tiered's nuq2 tier); a cap at or above the slab's slots fills
# them all
OUTLIER_CAP = KVOption("outlier_cap", None, "nuq2/tiered: the most outlier slots a page-head fills a kind, its largest "
                       "deviations (default: the format's own, 16 for nuq2, every slot for tiered; 1024 fills every "
                       "slot of the page padding)",
                       lambda value: None if value is None else integer_at_least(1)(value), kind=int)


class NUQ2Format(SinkTokens, ResidualWindow, FragmentPagedFormat):
    name = "nuq2"
    # its pages converted from the slabs into the kernel's fragment order when written (nuq2_layout.py);
    # 'auto' takes it on sm_90 for the covered shape
    gluon_kernel = GluonKernel("moekv.ops.gluon.nuq2_layout", "moekv.ops.gluon.nuq2_decode:nuq2_decode_attention",
                               _gluon_covers, marker="k_slot_delta", decode_options=gluon_ring)
    # the newest tokens in 16-bit (residual.py): 128 took domain-moe's perplexity cost from +4.2% to
    # +1.9% at 2.41 bits a token at 32k (docs/decisions.md, "nuq2's and vq's residual window")
    default_residual = 128
    # 3.0 rather than 3.5: the extra outliers fill slots of the page padding that were empty, so they cost
    # no bits; domain-moe's worst domain went from +1.7% to +1.1% with no passkey lost (docs/decisions.md,
    # "nuq2's outliers beyond 3.0 standard deviations")
    default_outlier_sigma = 3.0
    # the 16 largest of those a page-head and kind: the Gluon kernel's first slot chunk, which it runs whatever
    # the count; filling every slot beyond 3.0 sigma cost the kernel 16-30% of its time and bought at most
    # 0.3 points of perplexity
    # (docs/decisions.md, "nuq2 fills at most 16 outlier slots a page-head and kind")
    default_outlier_cap = 16
    engine_options = (
        RESIDUAL_OPTION,
        SINK_OPTION,
        OUTLIER_SIGMA,
        OUTLIER_CAP,
        CALIBRATION,
        KVOption("codebook", "auto",
                 "nuq2/tiered: per-page k-means, calibrated codebooks, or auto (calibrated when available)",
                 one_of(*CODEBOOKS), choices=CODEBOOKS),
        KEYS_BEFORE_ROPE,
    )

    def __init__(self, outlier_sigma: float | None = None, calibration: str | Path | None = None,
                 codebook: str = "auto", quantize_kernel: bool | None = None, residual: int | None = None,
                 keys_before_rope: bool = False, sink_tokens: int | None = None,
                 outlier_cap: int | None = None) -> None:
        """codebook: 'page' (k-means per page), 'calibrated' (needs calibration), or 'auto'
        (calibrated when the calibration folder has nuq2 codebooks fitted on keys on the side of RoPE
        the pages store them, keys_before_rope; else per page).
        outlier_sigma: the outlier threshold in robust standard deviations (None: default_outlier_sigma).
        outlier_cap: the most slots a page-head fills a kind, its largest deviations (None: default_outlier_cap;
        a cap at or above the layout's slots fills them all).
        residual: the newest tokens kept in 16-bit (None: default_residual; 0: none).
        keys_before_rope: pages hold the keys as computed before RoPE, rotated by their positions
        after the lookup by every reader (PagedQuantFormat.keys_before_rope; no Gluon kernel).
        quantize_kernel: quantize pages on CUDA with the fused kernel (moekv/ops/nuq2_quantize.py);
        None reads MOEKV_NUQ2_QUANTIZE_KERNEL (moekv/envs.py: default on; 0 keeps the torch
        reference, for benchmarks that compare the two)."""
        if quantize_kernel is None:
            quantize_kernel = envs.nuq2_quantize_kernel()
        self.quantize_kernel = bool(quantize_kernel)
        self.set_residual(residual, self.default_residual)
        self.set_sinks(sink_tokens)
        if outlier_sigma is None:
            outlier_sigma = self.default_outlier_sigma
        if not outlier_sigma > 0:
            raise ValueError(f"outlier_sigma={outlier_sigma!r} must be > 0")
        if not isinstance(keys_before_rope, bool):
            raise ValueError(f"keys_before_rope={keys_before_rope!r} must be True or False")
        self.keys_before_rope = keys_before_rope
        self.tau = float(outlier_sigma)
        if outlier_cap is None:
            outlier_cap = self.default_outlier_cap
        reason = integer_at_least(1)(outlier_cap)
        if reason:
            raise ValueError(f"outlier_cap={outlier_cap!r} {reason}")
        self.outlier_cap = outlier_cap
        self.tables: dict[str, torch.Tensor] = {}
        if calibration is not None:
            self.tables = {k: v for k, v in load_calibration(calibration, "kv_cache_dtype='nuq2'").items()
                           if k.startswith("nuq2.")}
        # key codebooks fitted on keys on the other side of RoPE than the pages store them
        other_basis = calibration is not None and keys_fitted_before_rope(calibration) != keys_before_rope
        if codebook == "auto":
            codebook = "calibrated" if self.tables and not other_basis else "page"
        if codebook == "calibrated" and self.tables and other_basis:
            raise ValueError(f"codebook='calibrated' with keys_before_rope={keys_before_rope}: "
                             f"{other_side(calibration)}; or codebook='page'")
        if codebook not in ("page", "calibrated") or (codebook == "calibrated" and not self.tables):
            raise ValueError(f"codebook={codebook!r}: accepted 'page', 'auto', or 'calibrated' with a "
                             "kv_calibration folder written by `moekv calibrate`")
        self.calibrated = codebook == "calibrated"
        self._decode_tables: dict = {}  # (layer, device) -> decode_tables()
        self._codebooks: dict = {}  # (kind, layer, device) -> codebook()'s fp32 centroids there

    @property
    def layer_independent_quantize(self) -> bool:
        return not self.calibrated  # calibrated codebooks are per layer

    calibration_fitter = CalibrationFitter(fit_tables)

    def shard_tables(self, kv_heads, num_kv_heads) -> None:
        shard_head_tables(self.tables, kv_heads, num_kv_heads)  # the calibrated codebooks, [Hkv, 4] each

    # -- layout --------------------------------------------------------------------------------------
    def _fields(self, kind: str, P: int, D: int, slots: int) -> list[Field]:
        fields = [Field("codes", torch.uint8, (P, D // CODES_PER_BYTE))]
        if kind == "key":
            fields += [Field("chan_mean", torch.float8_e4m3fn, (D,)), Field("chan_scale", torch.float8_e4m3fn, (D,))]
        if not self.calibrated:
            fields.append(Field("centroids", torch.float16, (NUM_CENTROIDS,)))
        return fields + outlier_fields(slots)

    @per_shape
    def outlier_slots(self, kind: str, block_size: int, head_dim: int) -> int:
        N = block_size * head_dim
        least = math.ceil(KEY_MIN_OUTLIER_FRACTION * N) if kind == "key" else 0
        return fit_slots_to_padding(lambda s: self._fields(kind, block_size, head_dim, s), least, N)

    def filled_slots(self, kind: str, block_size: int, head_dim: int) -> int:
        """The most slots quantize fills a page-head: the layout's, or fewer under outlier_cap."""
        return min(self.outlier_slots(kind, block_size, head_dim), self.outlier_cap)

    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        if head_dim % CODES_PER_BYTE:
            raise ValueError(f"kv_cache_dtype='nuq2' needs head_dim divisible by 4, got {head_dim}")
        if block_size * head_dim >= NO_OUTLIER:
            raise ValueError(f"kv_cache_dtype='nuq2' indexes a page-head's elements with uint16: block_size * "
                             f"head_dim must be < {NO_OUTLIER}, got {block_size}*{head_dim}")
        return PageLayout(self._fields(kind, block_size, head_dim, self.outlier_slots(kind, block_size, head_dim)))

    def codebook(self, kind: str, layer: int | None, rows: int, device: torch.device | None = None) -> torch.Tensor:
        """Calibrated centroids of this layer and kind, one row per page-head: [rows, 4], on `device`
        (the calibration is loaded on the CPU; pages may live on the GPU)."""
        cb = self._codebook_table(kind, layer, device)
        return cb.repeat(rows // cb.shape[0], 1)

    def _codebook_table(self, kind: str, layer: int | None, device: torch.device | None) -> torch.Tensor:
        """The calibrated centroids [H, 4] fp32 on `device`, one copy per device, made before any
        CUDA-graph capture (warm-up)."""
        key = (kind, layer, torch.device(device) if device is not None else None)
        if key not in self._codebooks:
            self._codebooks[key] = self._centroids(kind, layer).float().to(device)
        return self._codebooks[key]

    def _centroids(self, kind: str, layer: int | None) -> torch.Tensor:
        """The calibrated centroids [H, 4] of this layer and kind, as stored."""
        name = f"nuq2.layer{layer}.{kind}.centroids"
        if name not in self.tables:
            raise ValueError(f"kv_cache_dtype='nuq2': the calibration has no {name!r} (made for another model?)")
        return self.tables[name]

    def decode_tables(self, layer: int | None, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Calibrated codebooks: what the fused decode kernel reads beside the pages (DecodeSpec.tables)
        for one layer, kept on `device` after the first call: the key and value centroids [Hkv, 4]
        fp16 (as calibrated: exact; decode_spec checks they are fp16)."""
        key = (layer, torch.device(device))
        if key not in self._decode_tables:
            self._decode_tables[key] = tuple(self._centroids(kind, layer).to(device, torch.float16).contiguous()
                                             for kind in ("key", "value"))
        return self._decode_tables[key]

    def codebooks_not_fp16(self) -> bool:
        """Calibrated codebooks stored in another dtype than fp16 (what `moekv calibrate` writes is
        fp16), which the kernels' fp16 lookups cannot read as they are."""
        return self.calibrated and any(t.dtype != torch.float16 for name, t in self.tables.items()
                                       if name.endswith(".centroids"))

    def decode_spec(self, block_size, head_dim):
        """The fused decode kernel (centroid lookup, the keys' channel affine folded into q, outlier
        slots as per-tile corrections; moekv/ops/decode/nuq2.py). Calibrated codebooks live outside
        the slab: the readers take each layer's from `decode_tables` (DecodeSpec.tables); codebooks
        not stored in fp16 (what `moekv calibrate` writes) keep the reference path, since the
        kernel's lookup is fp16."""
        if self.codebooks_not_fp16():
            return None
        from moekv.ops.decode.nuq2 import nuq2_spec

        return nuq2_spec(self, block_size, head_dim)

    # -- quantize / dequantize -----------------------------------------------------------------------
    def quantize(self, x, kind, layer=None):
        n, H, P, D = x.shape  # [n, Hkv, P, D]
        z, fields = normalize(x, kind)
        flat = z.reshape(n * H, P * D)  # [B, N]: one row per page-head
        slots = self.outlier_slots(kind, P, D)
        keep = torch.ones_like(flat, dtype=torch.bool)
        if slots:
            deviation = (flat - robust_moments(flat, dim=-1)[0]).abs()
            idx, chosen = pick_largest(deviation, outlier_mask(flat, self.tau), slots)
            chosen[:, self.filled_slots(kind, P, D):] = False  # largest first (topk's order)
            keep.scatter_(1, idx, ~chosen)  # slotted outliers leave the k-means fit
        if self.calibrated:
            c = self.codebook(kind, layer, n * H, x.device)
        else:
            c = lloyd_1d(flat, keep, weight=fit_weight(flat, kind)).to(torch.float16).float()  # [B, 4], as stored
            fields["centroids"] = c.reshape(n, H, NUM_CENTROIDS)
        if slots:
            fields.update(store_outliers(flat, idx, chosen, centroid_unit(c), n, H))
        fields["codes"] = pack_codes(assign(flat, c).reshape(n, H, P, D))
        return fields

    def quantize_packed(self, x, kind, layer=None):
        """On CUDA, one launch of the fused kernel (same fields as quantize + pack, up to the last
        bit of a centroid; tests/test_nuq2_quantize_kernel.py); elsewhere the reference."""
        from moekv.ops.nuq2_quantize import can_quantize, nuq2_quantize_packed

        P, D = x.shape[2], x.shape[3]
        if not (x.is_cuda and self.quantize_kernel and can_quantize(P, D)):
            return super().quantize_packed(x, kind, layer)
        table = self._codebook_table(kind, layer, x.device) if self.calibrated else None
        return nuq2_quantize_packed(x, kind, self.layout(kind, P, D), self.outlier_slots(kind, P, D), self.tau,
                                    KMEANS_ITERS, centroids=table, fill=self.filled_slots(kind, P, D))

    def dequantize(self, fields, kind, layer=None):
        codes = unpack_codes(fields["codes"])  # [n, H, P, D]
        n, H, P, D = codes.shape
        if self.calibrated:
            c = self.codebook(kind, layer, n * H, codes.device)
        else:
            c = fields["centroids"].float().reshape(n * H, NUM_CENTROIDS)
        z = c.gather(1, codes.reshape(n * H, P * D)).reshape(n, H, P, D)
        if "out_idx" in fields:
            z = apply_outliers(z, fields, centroid_unit(c))
        return denormalize(z, fields, kind)
