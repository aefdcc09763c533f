"""vq: vector quantization of K/V below 2 bits per element, with codebooks learned on calibration text.

Each token's head vector is cut into subvectors of d = 8 consecutive channels; each subvector is one
uint8 code into a 256-entry codebook of its (layer, K/V, kv head, channel group), learned offline by
`moekv calibrate` (the codebooks are shared by all pages, so they are not page bytes: 8/d = 1 bit per
element for the codes). Codewords are e4m3 (FP8) values, whatever precision a calibration file stores
them in: the Gluon kernels read a head's codebooks from shared memory, and 8 bytes a codeword instead of
16 halve those reads and let two CTAs share an SM. Before the lookup a vector is brought to unit RMS by
a per-(token, head) fp16 scale; keys are first centred by the page's per-channel means and divided by
calibrated per-channel scales, because a few key channels carry large, position-dependent
(post-RoPE) offsets that would otherwise spend the whole codebook. Bytes that the 128-byte padding
of a slab leaves free hold the elements with the largest VQ error in FP8, with uint16 positions.

Slab of one (page, kv head), block_size P, head_dim D (P=64, D=32: K 512 B, V 384 B, 1.75 bits):
  codes      uint8  [P, D/d]
  tok_scale  fp16   [P]     RMS of the (normalised) token vector
  chan_mean  fp8    [D]     keys only: the page's channel means
  out_val    fp8    [S]     S = the slots that fit in the padding (may be 0), unit-RMS units
  out_idx    uint16 [S]     position t*D + c inside the page-head; 0xFFFF = unused
"""
from __future__ import annotations

from pathlib import Path

import torch

from moekv.kvcache.calibration_io import (
    keys_fitted_before_rope,
    load_calibration,
    other_side,
    save_calibration,
    shard_head_tables,
)
from moekv.kvcache.formats.fragment import FragmentPagedFormat, GluonKernel
from moekv.kvcache.formats.interface import CalibrationFitter
from moekv.kvcache.formats.nuq2 import (
    FP8_MAX,
    NO_OUTLIER,
    apply_outliers,
    fit_slots_to_padding,
    outlier_fields,
    pick_largest,
    store_outliers,
)
from moekv.kvcache.formats.options import CALIBRATION, KEYS_BEFORE_ROPE
from moekv.kvcache.formats.paged import Field, PageLayout, per_shape
from moekv.kvcache.formats.residual import RESIDUAL_OPTION, ResidualWindow, gluon_ring
from moekv.kvcache.formats.sinks import SINK_OPTION, SinkTokens

CODEBOOK_SIZE = 256  # uint8 codes
SUB_DIM = 8  # channels per code: 1 bit/element for the codes (d = 4 would be 2 bits before any scale)
NEEDS_CALIBRATION = ("kv_cache_dtype='vq' needs a calibration: run `moekv calibrate --model PATH --text FILE "
                     "--out DIR` and pass kv_calibration=DIR")


# -- k-means in d dimensions ---------------------------------------------------------------------
def nearest(x: torch.Tensor, codebook: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """x [G, N, d], codebook [G, C, d] -> index of the nearest codeword [G, N] (int64).
    Works on chunks of N so the [G, chunk, C] distance table stays small."""
    norms = (codebook * codebook).sum(-1)[:, None, :]  # [G, 1, C]
    return torch.cat([(norms - 2 * torch.einsum("gnd,gcd->gnc", part, codebook)).argmin(-1)
                      for part in x.split(chunk, dim=1)], dim=1)


def kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Codebooks [G, k, d] for the point sets x [G, N, d] (N >= 1): Lloyd from k random points;
    an emptied codeword restarts at a random point, so none is wasted."""
    G, N, d = x.shape
    pick = torch.stack([torch.randperm(max(N, k), generator=generator)[:k] % N for _ in range(G)])  # [G, k]
    c = x.gather(1, pick[..., None].expand(G, k, d)).clone()
    for _ in range(iters):
        code = nearest(x, c)  # [G, N]
        sums = torch.zeros_like(c).scatter_add_(1, code[..., None].expand(G, N, d), x)
        cnts = torch.zeros(G, k, dtype=x.dtype).scatter_add_(1, code, torch.ones_like(code, dtype=x.dtype))
        fresh = x.gather(1, torch.randint(0, N, (G, k, 1), generator=generator).expand(G, k, d))
        c = torch.where(cnts[..., None] > 0, sums / cnts.clamp(min=1)[..., None], fresh)
    return c


# -- normalisation (shared by the format and by calibration) -------------------------------------
def page_channel_mean(x: torch.Tensor) -> torch.Tensor:
    """x [n, H, P, D] -> the page's channel means [n, H, D], as stored (fp8)."""
    return x.mean(dim=2).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def unit_rms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H, P, D] -> (x / scale, scale [n, H, P] as stored in fp16); a zero token keeps scale ~0."""
    scale = x.pow(2).mean(-1).sqrt().clamp(min=1e-6).to(torch.float16).float()
    return x / scale[..., None], scale


def normalize(x: torch.Tensor, kind: str, chan_scale: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """x [n, H, P, D] -> (u [n, H, P, D] with unit-RMS tokens, side fields to store)."""
    fields = {}
    if kind == "key":
        mean = page_channel_mean(x)
        fields["chan_mean"] = mean
        x = (x - mean[:, :, None]) / chan_scale[None, :, None]  # chan_scale [H, D]
    u, fields["tok_scale"] = unit_rms(x)
    return u, fields


def to_groups(u: torch.Tensor, d: int) -> torch.Tensor:
    """u [n, H, P, D] -> subvectors [H, D/d, n*P, d] (one set per head and channel group)."""
    n, H, P, D = u.shape
    return u.reshape(n, H, P, D // d, d).permute(1, 3, 0, 2, 4).reshape(H, D // d, n * P, d)


def fit_key_channel_scale(pages: torch.Tensor) -> torch.Tensor:
    """Calibration: per-(head, channel) RMS of keys around their page means; pages [n, H, P, D] -> [H, D]."""
    centred = pages - page_channel_mean(pages)[:, :, None]
    return centred.pow(2).mean(dim=(0, 2)).sqrt().clamp(min=1e-6)


def reserved_codewords(d: int) -> torch.Tensor:
    """Codewords every codebook holds, so degenerate tokens come back exactly: the zero vector (a
    zero token) and +-(1, ..., 1) (a token constant across its channels, at unit RMS)."""
    return torch.stack([torch.zeros(d), torch.ones(d), -torch.ones(d)])


def e4m3_codewords(book: torch.Tensor) -> torch.Tensor:
    """Codebooks as the format uses them: each entry rounded to e4m3 (saturating at +-448), in fp32."""
    return book.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def fit_codebook(pages: torch.Tensor, kind: str, chan_scale: torch.Tensor | None, d: int, iters: int,
                 max_vectors: int, generator: torch.Generator) -> torch.Tensor:
    """Calibration: codebooks [H, D/d, 256, d] (e4m3 values, stored in fp16) from pages [n, H, P, D],
    fitted on what the format will quantize (normalised exactly as quantize() does)."""
    u, _ = normalize(pages, kind, chan_scale)
    groups = to_groups(u, d)  # [H, S, N, d]
    H, S, N, _ = groups.shape
    keep = torch.randperm(N, generator=generator)[:max_vectors]
    fixed = reserved_codewords(d)  # [3, d]
    books = [torch.cat([fixed, kmeans(g[keep][None], CODEBOOK_SIZE - len(fixed), iters, generator)[0]])
             for g in groups.reshape(H * S, N, d)]  # one group at a time: bounded memory
    return e4m3_codewords(torch.stack(books).reshape(H, S, CODEBOOK_SIZE, d)).to(torch.float16)


def fit_tables(pages: torch.Tensor, layer: int, kind: str, generator: torch.Generator, sub_dim: int, iters: int,
               max_vectors: int) -> dict[str, torch.Tensor]:
    """`moekv calibrate`'s fit (VQFormat.calibration_fitter): the layer's codebooks of one kind (channels
    per subvector, Lloyd iterations, vectors per codebook), and for keys their channel scales first."""
    tables, chan_scale = {}, None
    if kind == "key":
        chan_scale = tables[f"vq.layer{layer}.key.chan_scale"] = fit_key_channel_scale(pages)  # [Hkv, D]
    tables[f"vq.layer{layer}.{kind}.codebook"] = fit_codebook(  # [Hkv, D/d, C, d] e4m3 values in fp16
        pages, kind, chan_scale, sub_dim, iters, max_vectors, generator)
    return tables


def calibration_summary(tables: dict[str, torch.Tensor], options: dict, seed: int) -> dict:
    """What the calibration record says about vq's tables: the fit's options and the codebooks' bytes."""
    return {**options, "codebook_size": CODEBOOK_SIZE, "seed": seed,
            "codebook_bytes_fp16": sum(t.numel() * t.element_size() for n, t in tables.items()
                                       if n.endswith(".codebook"))}


def _gluon_covers(fmt: VQFormat, block_size: int, head_dim: int) -> str | None:
    if fmt.keys_before_rope:
        return ("vq's Gluon kernels read keys stored after RoPE; keys_before_rope=True takes the Triton "
                "kernel (decode_kernel='triton' or 'auto')")
    slots = max(fmt.outlier_slots(kind, block_size, head_dim) for kind in ("key", "value"))
    if (block_size, head_dim, fmt.sub_dim, slots) == (64, 128, 8, 0):  # no outlier slots fit the slabs there
        return None
    return ("vq's Gluon kernel covers block_size 64, head_dim 128 and 8-channel codes, "
            f"got block_size {block_size}, head_dim {head_dim}, {fmt.sub_dim}-channel codes")


class VQFormat(SinkTokens, ResidualWindow, FragmentPagedFormat):
    name = "vq"
    # its pages converted from the slabs into the kernel's fragment order when written; the view of a
    # pool carries its layer's codebooks and key channel scales (vq_layout.py)
    gluon_kernel = GluonKernel("moekv.ops.gluon.vq_layout", "moekv.ops.gluon.vq_decode:vq_decode_attention",
                               _gluon_covers, decode_options=gluon_ring)
    needs_calibration = True
    # the newest tokens in 16-bit (residual.py): on domain-moe vq wants 256 where nuq2 settles at 128
    # (docs/decisions.md, "nuq2's and vq's residual window")
    default_residual = 256
    engine_options = (CALIBRATION, RESIDUAL_OPTION, KEYS_BEFORE_ROPE, SINK_OPTION)
    # graph_support as every paged format: decode_spec()'s tables are copied to the device on the
    # first call, which the CUDA-graph runner's warm-up (before capture) makes
    layer_independent_quantize = False  # codebooks per layer

    calibration_fitter = CalibrationFitter(fit_tables, {"sub_dim": SUB_DIM, "iters": 16, "max_vectors": 16384},
                                           calibration_summary)

    def __init__(self, calibration: str | Path | None = None, residual: int | None = None,
                 keys_before_rope: bool = False, sink_tokens: int | None = None) -> None:
        """calibration: the folder from `moekv calibrate`; residual: the newest tokens kept in 16-bit
        (None: default_residual; 0: none); keys_before_rope: pages hold the keys as computed before
        RoPE, rotated by their positions after the lookup by every reader
        (PagedQuantFormat.keys_before_rope; no Gluon kernel); the calibration's key tables should then
        be fitted on un-rotated keys (`moekv calibrate --keys-before-rope`)."""
        self.set_residual(residual, self.default_residual)
        self.set_sinks(sink_tokens)
        if calibration is None:
            raise ValueError(NEEDS_CALIBRATION)
        if not isinstance(keys_before_rope, bool):
            raise ValueError(f"keys_before_rope={keys_before_rope!r} must be True or False")
        self.keys_before_rope = keys_before_rope
        if keys_fitted_before_rope(calibration) != keys_before_rope:
            raise ValueError(f"kv_cache_dtype='vq' with keys_before_rope={keys_before_rope}: {other_side(calibration)}")
        self.tables = {name: e4m3_codewords(t) if name.endswith(".codebook") else t
                       for name, t in load_calibration(calibration, "kv_cache_dtype='vq'").items()}
        self.calibration = Path(calibration)
        self.sub_dim = self.codebook("key", 0).shape[-1]  # as calibrated (SUB_DIM by default)
        self._on_device: dict = {}  # (name, device) -> fp32 copy; ("decode", layer, device) -> decode tables

    # -- calibration tables ------------------------------------------------------------------------
    def shard_tables(self, kv_heads, num_kv_heads) -> None:
        shard_head_tables(self.tables, kv_heads, num_kv_heads)  # codebooks and key channel scales, per KV head

    def _table(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        if name not in self.tables:
            raise ValueError(f"kv_cache_dtype='vq': the calibration in {str(self.calibration)!r} has no {name!r} "
                             "(made for another model?); run `moekv calibrate` for this model")
        table = self.tables[name]
        if device is None or torch.device(device) == table.device:
            return table.float()
        key = (name, torch.device(device))
        if key not in self._on_device:  # one copy per device, not one per call
            self._on_device[key] = table.float().to(device)
        return self._on_device[key]

    def codebook(self, kind: str, layer: int | None, device: torch.device | None = None) -> torch.Tensor:
        return self._table(f"vq.layer{layer}.{kind}.codebook", device)  # [H, D/d, C, d]

    def chan_scale(self, layer: int | None, device: torch.device | None = None) -> torch.Tensor:
        return self._table(f"vq.layer{layer}.key.chan_scale", device)  # [H, D]

    def decode_tables(self, layer: int | None, device: torch.device,
                      codebook_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
        """What the fused decode kernels read beside the pages (DecodeSpec.tables), per layer, kept on
        `device` after the first call: key codebooks [H, D/d, 256, d], key channel scales [H, D] fp32,
        value codebooks; the codebooks in codebook_dtype (fp16 for the Triton kernel, float8_e4m3fn
        for the Gluon ones: both exact, the codewords being e4m3 values)."""
        key = ("decode", layer, torch.device(device), codebook_dtype)
        if key not in self._on_device:
            self._on_device[key] = (
                self.codebook("key", layer).to(device, codebook_dtype).contiguous(),
                self.chan_scale(layer).to(device, torch.float32).contiguous(),
                self.codebook("value", layer).to(device, codebook_dtype).contiguous())
        return self._on_device[key]

    def decode_spec(self, block_size, head_dim):
        """The fused decode kernel: codebook gathers, the keys' channel affine folded into q, outlier
        slots as per-tile corrections (moekv/ops/decode/vq.py); the codebooks and channel
        scales come from decode_tables for the cache's layer."""
        from moekv.ops.decode.vq import vq_spec

        return vq_spec(self, block_size, head_dim)

    def codebook_bytes(self) -> int:
        """Bytes of every codebook and channel scale (shared by all pages, outside the page bits)."""
        return sum(t.numel() * t.element_size() for name, t in self.tables.items() if name.startswith("vq."))

    def check_layout(self, num_kv_heads, block_size, head_dim) -> None:
        super().check_layout(num_kv_heads, block_size, head_dim)
        if block_size * head_dim >= NO_OUTLIER:
            raise ValueError(f"kv_cache_dtype='vq' indexes a page-head's elements with uint16: block_size * "
                             f"head_dim must be < {NO_OUTLIER}, got {block_size}*{head_dim}")
        shape = tuple(self.codebook("key", 0).shape)
        expected = (num_kv_heads, head_dim // self.sub_dim, CODEBOOK_SIZE, self.sub_dim)
        if shape != expected:
            raise ValueError(f"kv_cache_dtype='vq': the calibration in {str(self.calibration)!r} holds codebooks "
                             f"of shape {shape}, this model needs {expected}; calibrate for this model")

    # -- layout --------------------------------------------------------------------------------------
    def _fields(self, kind: str, P: int, D: int, slots: int) -> list[Field]:
        fields = [Field("codes", torch.uint8, (P, D // self.sub_dim)), Field("tok_scale", torch.float16, (P,))]
        if kind == "key":
            fields.append(Field("chan_mean", torch.float8_e4m3fn, (D,)))
        return fields + outlier_fields(slots)

    @per_shape
    def outlier_slots(self, kind: str, block_size: int, head_dim: int) -> int:
        return fit_slots_to_padding(lambda s: self._fields(kind, block_size, head_dim, s), 0, block_size * head_dim)

    @per_shape
    def layout(self, kind, block_size, head_dim) -> PageLayout:
        if head_dim % self.sub_dim:
            raise ValueError(f"kv_cache_dtype='vq' needs head_dim divisible by {self.sub_dim}, got {head_dim}")
        return PageLayout(self._fields(kind, block_size, head_dim, self.outlier_slots(kind, block_size, head_dim)))

    # -- quantize / dequantize -----------------------------------------------------------------------
    def quantize(self, x, kind, layer=None):
        n, H, P, D = x.shape  # [n, Hkv, P, D]
        u, fields = normalize(x, kind, self.chan_scale(layer, x.device) if kind == "key" else None)
        cb = self.codebook(kind, layer, x.device)  # [H, S, C, d]
        groups = to_groups(u, self.sub_dim)  # [H, S, n*P, d]
        code = nearest(groups.reshape(-1, n * P, self.sub_dim), cb.reshape(-1, CODEBOOK_SIZE, self.sub_dim))
        fields["codes"] = code.reshape(H, D // self.sub_dim, n, P).permute(2, 0, 3, 1).to(torch.uint8)
        slots = self.outlier_slots(kind, P, D)
        if slots:  # the padding's slots take the elements the codebook reconstructs worst
            # rank by error in the data's units: a token's scale (and a key channel's) multiplies it
            weight = fields["tok_scale"][..., None] * (self.chan_scale(layer, x.device)[None, :, None]
                                                       if kind == "key" else 1.0)
            err = ((u - self._decode(fields["codes"], cb)).abs() * weight).reshape(n * H, P * D)
            idx, chosen = pick_largest(err, err > 0, slots)
            unit = torch.ones(n * H, 1, device=x.device)  # u is already unit-RMS per token
            fields.update(store_outliers(u.reshape(n * H, P * D), idx, chosen, unit, n, H))
        return fields

    def _decode(self, codes: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        """codes [n, H, P, D/d] -> unit-RMS vectors u [n, H, P, D] (before outliers and scales)."""
        n, H, P, S = codes.shape
        d = cb.shape[-1]
        flat = codes.long().permute(1, 3, 0, 2).reshape(H * S, n * P, 1).expand(-1, -1, d)
        u = cb.reshape(H * S, CODEBOOK_SIZE, d).gather(1, flat)  # [H*S, n*P, d]
        return u.reshape(H, S, n, P, d).permute(2, 0, 3, 1, 4).reshape(n, H, P, S * d)

    def dequantize(self, fields, kind, layer=None):
        device = fields["codes"].device
        u = self._decode(fields["codes"], self.codebook(kind, layer, device))  # [n, H, P, D]
        if "out_idx" in fields:
            u = apply_outliers(u, fields, torch.ones(u.shape[0] * u.shape[1], 1, device=u.device))
        x = u * fields["tok_scale"].float()[..., None]
        if kind == "key":
            x = x * self.chan_scale(layer, device)[None, :, None] + fields["chan_mean"].float()[:, :, None]
        return x


def random_calibration(folder: str | Path, num_kv_heads: int, head_dim: int, num_layers: int = 1, iters: int = 2,
                       max_vectors: int = 2048, seed: int = 0) -> Path:
    """A calibration folder for benchmarks and kernel tests (no model): codebooks and key channel
    scales fitted on Gaussian pages (keys with two offset channels per head, as post-RoPE keys have),
    the same for every layer. Returns the folder."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(16, num_kv_heads, 64, head_dim, generator=g)
    keys = pages.clone()
    keys[..., 7 % head_dim] *= 8
    keys[..., (head_dim // 2 + 27) % head_dim] += 6
    scale = fit_key_channel_scale(keys)
    k_book = fit_codebook(keys, "key", scale, SUB_DIM, iters, max_vectors, g)
    v_book = fit_codebook(pages, "value", None, SUB_DIM, iters, max_vectors, g)
    tables = {}
    for layer in range(num_layers):  # a copy each: safetensors refuses tensors that share memory
        tables[f"vq.layer{layer}.key.chan_scale"] = scale.clone()
        tables[f"vq.layer{layer}.key.codebook"] = k_book.clone()
        tables[f"vq.layer{layer}.value.codebook"] = v_book.clone()
    return save_calibration(folder, tables)
