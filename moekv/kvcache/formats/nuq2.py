"""nuq2: 2-bit codes into a 4-centroid non-uniform codebook, dense-and-sparse outliers in FP8.

Draft with knobs for measurement.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from moekv.kvcache.formats.base import Field, PagedQuantFormat, PageLayout

FP8_MAX = 448.0
NUM_CENTROIDS = 4
CODES_PER_BYTE = 4
NO_OUTLIER = 0xFFFF  # position of an unused outlier slot (a page-head holds at most 65535 elements)


# -- codes: 4 per byte, planar inside each token row -------------------------------------------
def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., P, D] in 0..3 -> bytes [..., P, D/4]; channel s*D/4 + j sits in bits 2s..2s+1 of
    byte j, so one wide load of a row and four uniform shifts give four contiguous channel runs."""
    quarters = codes.to(torch.uint8).chunk(CODES_PER_BYTE, dim=-1)  # 4 x [..., P, D/4]
    out = quarters[0].clone()
    for s in range(1, CODES_PER_BYTE):
        out |= quarters[s] << (2 * s)
    return out


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., P, D/4] -> codes [..., P, D] (int64)."""
    return torch.cat([(packed >> (2 * s)) & 3 for s in range(CODES_PER_BYTE)], dim=-1).long()


# -- 1-D k-means ---------------------------------------------------------------------------------
def lloyd_1d(z: torch.Tensor, weight: torch.Tensor, iters: int) -> torch.Tensor:
    """4 centroids per row of z [B, N] (elements with weight 0 ignored) -> [B, 4] sorted.

    Deterministic init at the inliers' 1/8, 3/8, 5/8, 7/8 quantiles; 1-D Lloyd keeps the order, so
    assignment is a comparison against the 3 midpoints. An empty cluster keeps its old centroid.
    """
    B, N = z.shape
    keep = weight > 0
    # quantiles of the inliers: sort with outliers pushed to +inf, index by rank among inliers
    ranked = torch.where(keep, z, torch.full_like(z, float("inf"))).sort(dim=-1).values
    count = keep.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    q = torch.tensor([0.125, 0.375, 0.625, 0.875], device=z.device)
    idx = (q * count).long().clamp(max=N - 1)  # [B, 4]
    c = ranked.gather(1, idx)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    w = weight.to(z.dtype)
    for _ in range(iters):
        code = assign(z, c)
        sums = torch.zeros_like(c).scatter_add_(1, code, z * w)
        cnts = torch.zeros_like(c).scatter_add_(1, code, w)
        c = torch.where(cnts > 0, sums / cnts.clamp(min=1e-12), c)
    return c.sort(dim=-1).values


def assign(z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest of the sorted centroids c [B, 4] for each z [B, N] -> codes [B, N] int64."""
    mids = (c[:, 1:] + c[:, :-1]) / 2  # [B, 3]
    return (z > mids[:, 0:1]).long() + (z > mids[:, 1:2]).long() + (z > mids[:, 2:3]).long()


class NUQ2Format(PagedQuantFormat):
    name = "nuq2"

    def __init__(self, outlier_sigma: float = 3.5, calibration: str | Path | None = None,
                 outlier_fraction: float = 0.005, kmeans_iters: int = 8,
                 key_stats: str = "fp16", key_mean: bool = True, value_norm: str = "none",
                 codebook: str = "page", value_outliers: bool = True, **_) -> None:
        self.tau = float(outlier_sigma)
        self.outlier_fraction = outlier_fraction
        self.kmeans_iters = kmeans_iters
        self.key_stats = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}[key_stats]
        self.key_mean = key_mean
        self.value_norm = value_norm
        self.codebook = codebook
        self.value_outliers = value_outliers
        self.calib = None
        if calibration is not None:
            from safetensors.torch import load_file
            self.calib = load_file(str(Path(calibration) / "kv_calibration.safetensors"))

    def _page_cb(self, kind):
        return self.codebook == "page" or (self.codebook == "calib_value" and kind == "key")

    # -- layout ----------------------------------------------------------------------------------
    def _fields(self, kind, P, D, slots):
        f = [Field("codes", torch.uint8, (P, D // CODES_PER_BYTE))]
        if kind == "key":
            if self.key_mean:
                f.append(Field("chan_mean", self.key_stats, (D,)))
            f.append(Field("chan_scale", self.key_stats, (D,)))
        elif self.value_norm == "token":
            f.append(Field("tok_scale", torch.float16, (P,)))
        if self._page_cb(kind):
            f.append(Field("centroids", torch.float16, (NUM_CENTROIDS,)))
        if slots:
            f += [Field("out_val", torch.float8_e4m3fn, (slots,)), Field("out_idx", torch.uint16, (slots,))]
        return f

    def outlier_slots(self, kind, P, D) -> int:
        if kind == "value" and not self.value_outliers:
            return 0
        slots = max(1, math.ceil(self.outlier_fraction * P * D))
        slab = PageLayout(self._fields(kind, P, D, slots)).slab_bytes
        while slots < P * D and PageLayout(self._fields(kind, P, D, slots + 1)).slab_bytes == slab:
            slots += 1  # padding the slab needs anyway holds more outliers for free
        return slots

    def layout(self, kind, block_size, head_dim) -> PageLayout:
        if head_dim % CODES_PER_BYTE:
            raise ValueError(f"nuq2 needs head_dim divisible by 4, got {head_dim}")
        if block_size * head_dim > NO_OUTLIER:
            raise ValueError(f"nuq2 indexes outliers with uint16: block_size*head_dim must be < 65535")
        return PageLayout(self._fields(kind, block_size, head_dim, self.outlier_slots(kind, block_size, head_dim)))

    # -- quantize ----------------------------------------------------------------------------------
    def _normalize(self, x, kind, layer):
        """-> z [n, H, P, D], side fields, (mul, add) so that x = z * mul + add."""
        fields = {}
        if kind == "key":
            mean = x.mean(dim=2) if self.key_mean else torch.zeros_like(x[:, :, 0])  # [n, H, D]
            std = x.std(dim=2, unbiased=False)
            floor = 1e-3 * x.abs().amax(dim=(2, 3), keepdim=False)[..., None] + 1e-8
            scale = torch.maximum(std, floor)
            if self.key_stats == torch.float8_e4m3fn:
                scale = scale.clamp(max=FP8_MAX)
                mean = mean.clamp(-FP8_MAX, FP8_MAX)
            scale = scale.to(self.key_stats).float().clamp(min=1e-8)
            mean = mean.to(self.key_stats).float()
            if self.key_mean:
                fields["chan_mean"] = mean
            fields["chan_scale"] = scale
            return (x - mean[:, :, None]) / scale[:, :, None], fields, scale[:, :, None], mean[:, :, None]
        if self.value_norm == "token":
            s = x.abs().amax(dim=-1).clamp(min=1e-8).to(torch.float16).float()  # [n, H, P]
            fields["tok_scale"] = s
            return x / s[..., None], fields, s[..., None], torch.zeros_like(s)[..., None]
        return x, fields, torch.ones_like(x[:, :, :1, :1]), torch.zeros_like(x[:, :, :1, :1])

    def quantize(self, x, kind, layer=None):
        n, H, P, D = x.shape
        z, fields, _, _ = self._normalize(x, kind, layer)
        flat = z.reshape(n * H, P * D)  # [B, N]
        slots = self.outlier_slots(kind, P, D)
        keep = torch.ones_like(flat, dtype=torch.bool)
        if slots:
            mu = flat.mean(-1, keepdim=True)
            sd = flat.std(-1, unbiased=False, keepdim=True)
            dev = (flat - mu).abs()
            over = dev > self.tau * sd + 1e-12
            # the `slots` largest deviations among those over tau
            top = torch.where(over, dev, torch.full_like(dev, -1.0)).topk(slots, dim=-1)
            chosen = top.values >= 0  # [B, S]
            idx = torch.where(chosen, top.indices, torch.full_like(top.indices, NO_OUTLIER))
            keep.scatter_(1, top.indices, ~chosen)
            # restore keep for unchosen (scatter above wrote True there, which it already was)
            val = flat.gather(1, top.indices).clamp(-FP8_MAX, FP8_MAX)
            val = torch.where(chosen, val, torch.zeros_like(val))
            fields["out_val"] = val.to(torch.float8_e4m3fn).reshape(n, H, slots)
            fields["out_idx"] = idx.to(torch.int32).to(torch.uint16).reshape(n, H, slots)
        if self._page_cb(kind):
            c = lloyd_1d(flat, keep, self.kmeans_iters).to(torch.float16).float()  # [B, 4]
            fields["centroids"] = c.reshape(n, H, NUM_CENTROIDS)
        else:
            c = self._calib_centroids(kind, layer, n)  # [B, 4]
        codes = assign(flat, c).reshape(n, H, P, D)
        fields["codes"] = pack_codes(codes)
        return fields

    def _calib_centroids(self, kind, layer, n):
        cb = self.calib[f"nuq2.layer{layer}.{kind}.centroids"].float()  # [H, 4]
        return cb.repeat(n, 1)

    def dequantize(self, fields, kind, layer=None):
        codes = unpack_codes(fields["codes"])  # [n, H, P, D]
        n, H, P, D = codes.shape
        if self._page_cb(kind):
            c = fields["centroids"].float().reshape(n * H, NUM_CENTROIDS)
        else:
            c = self._calib_centroids(kind, layer, n)
        z = c.gather(1, codes.reshape(n * H, P * D))  # [B, N]
        if "out_idx" in fields:
            idx = fields["out_idx"].long().reshape(n * H, -1)
            val = fields["out_val"].float().reshape(n * H, -1)
            # unused slots (NO_OUTLIER) land in a spare column that is dropped
            idx = idx.clamp(max=P * D)
            mask = torch.zeros(n * H, P * D + 1, dtype=torch.bool, device=z.device).scatter_(1, idx, True)[:, :-1]
            dense = torch.zeros(n * H, P * D + 1, device=z.device).scatter_(1, idx, val)[:, :-1]
            z = torch.where(mask, dense, z)
        z = z.reshape(n, H, P, D)
        if kind == "key":
            mean = fields["chan_mean"].float() if "chan_mean" in fields else 0.0
            scale = fields["chan_scale"].float()
            return z * scale[:, :, None] + (mean[:, :, None] if torch.is_tensor(mean) else 0.0)
        if "tok_scale" in fields:
            return z * fields["tok_scale"].float()[..., None]
        return z
