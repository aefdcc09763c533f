"""The paged latent cache of multi-head latent attention (DeepSeek-V2/V3, layers/mla.py).

Per token and layer one entry of width W = kv_lora_rank + qk_rope_head_dim: the normalised latent
c_kv, then the rotated key every head shares. Attention reads it as one KV head: keys are the whole
entry, values its first kv_lora_rank columns (the absorbed form: queries already multiplied into
the latent space). Pages are the block manager's pages, one pool per layer, as for every format.

Two storages here, the low-bit ones (int4, and the 2-bit kivi2 / nuq2 latents) in latent_lowbit.py:
  - LatentFormat (bf16 / fp16 / fp32): latent_pages [N, P, W] in that dtype.
  - LatentFP8Format (fp8_e4m3): the latent in float8 e4m3 with one fp32 scale per token (amax / 448),
    the rotary key in bf16: latent_codes [N, P, R], latent_scales [N, P], rope_pages [N, P, r].
A token is quantized alone, so nothing is staged: every step writes its tokens straight into pages
(the 2-bit latents keep a 16-bit window of the newest tokens beside them: latent_lowbit.py).

The engine sees a KVFormat whose pools have num_kv_heads 1 and head_dim W (model_config.MLAConfig);
`write` takes the step's entries as k [T, 1, W] (v unused) and `attend` the absorbed queries
[T, H, W] -> [T, H, kv_lora_rank]. `gather` gives a sequence's entries for the expanded prefill.
"""
from __future__ import annotations

import copy

import torch

from moekv.context import Context
from moekv.kvcache.formats.dense import is_decode_only
from moekv.kvcache.formats.interface import PAGE_ALIGN_BYTES, GraphSupport, KVFormat, LayerKVCache
from moekv.ops.reference import (
    FP8_E4M3_MAX,
    MLA_DECODE_MMAS,
    causal_attention_ref,
    fp8_latent_dequantize_ref,
    fp8_latent_quantize_ref,
    mla_decode_mma_ref,
)

PLAIN_LATENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def align_page(nbytes: int) -> int:
    return -(-nbytes // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES


class LatentFormat(KVFormat):
    """The latent in a 16/32-bit float: the reference storage."""

    graph_support = GraphSupport.DECODE_WITH_FILLS  # one scatter through slot_mapping, no staging
    # the absorbed decode's MMA operands (EngineConfig.cache.mla_decode_mma; reference.MLA_DECODE_MMAS):
    # 'auto' = the queries' dtype, as the kernel computes them; others round the queries and probabilities
    decode_mma = "auto"

    def __init__(self, dtype: torch.dtype, kv_lora_rank: int) -> None:
        self.dtype, self.kv_lora_rank = dtype, kv_lora_rank
        self.name = {v: k for k, v in PLAIN_LATENTS.items()}[dtype]

    def with_decode_mma(self, mma: str) -> LatentFormat:
        """A copy of this format whose absorbed decode rounds its MMA operands as `mma` says (MLA_DECODE_MMAS)."""
        if mma not in MLA_DECODE_MMAS:
            raise ValueError(f"mla_decode_mma={mma!r} is unknown; accepted: {list(MLA_DECODE_MMAS)}")
        fmt = copy.copy(self)
        fmt.decode_mma = mma
        return fmt

    # -- layout -----------------------------------------------------------------------------
    def token_bytes(self, width: int) -> int:
        """Bytes one token's entry occupies (one layer)."""
        return width * torch.empty((), dtype=self.dtype).element_size()

    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        return align_page(block_size * self.token_bytes(head_dim))

    def bits_per_element(self, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        """Stored bits over the entry's elements (the latent and the rotary key; there is no V)."""
        return 8 * self.page_bytes(num_kv_heads, block_size, head_dim) / (block_size * head_dim)

    def bits_per_element_at(self, context_len: int, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        if context_len < 1:
            raise ValueError(f"context_len={context_len} must be >= 1")
        pages = -(-context_len // block_size)
        return 8 * pages * self.page_bytes(num_kv_heads, block_size, head_dim) / (context_len * head_dim)

    def check_layout(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        if num_kv_heads != 1:
            raise ValueError(f"the latent cache holds one entry per token (num_kv_heads=1), not {num_kv_heads}")
        if head_dim <= self.kv_lora_rank:
            raise ValueError(f"a latent entry of width {head_dim} leaves no rotary key after kv_lora_rank="
                             f"{self.kv_lora_rank}")

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        return LayerKVCache({"latent_pages": torch.zeros(num_blocks, block_size, head_dim, dtype=self.dtype,
                                                         device=device)})

    # -- write / read -----------------------------------------------------------------------
    def write(self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor | None, ctx: Context) -> None:
        """k: the step's entries [T, 1, W] or [T, W] (c_kv normalised, then the rotated key); v unused."""
        pages = cache["latent_pages"]
        # slot = page * P + offset: the pages as rows [N * P, W] (a view) take one index_put, no div / mod
        pages.view(-1, pages.shape[-1])[ctx.slot_mapping] = k.reshape(k.shape[0], -1).to(pages.dtype)

    def gather(self, cache: LayerKVCache, block_table: list[int] | torch.Tensor, length: int,
               dtype: torch.dtype, seq_slot: int | None = None, context_len: int | None = None) -> torch.Tensor:
        """A sequence's first `length` entries [length, W] in `dtype` (dequantized). seq_slot and
        context_len (the sequence's tokens written so far) matter to formats with a 16-bit window
        of the newest tokens (latent_lowbit.py); the others ignore them."""
        pages = cache["latent_pages"]
        P = pages.shape[1]
        table = torch.as_tensor(block_table, device=pages.device)
        pos = torch.arange(length, device=pages.device)
        return pages[table[pos // P].long(), pos % P].to(dtype)

    def stored(self, entries: torch.Tensor) -> torch.Tensor:
        """Entries [T, W] as this format stores and reads them back (what decode sees of a token)."""
        return entries.to(self.dtype).to(entries.dtype)

    # -- attention --------------------------------------------------------------------------
    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None) -> torch.Tensor:
        """Absorbed attention: q [T, H, W] (q_nope through W_UK, then q_rope) over each sequence's
        cached entries -> [T, H, kv_lora_rank] (still to go through W_UV). Decode-only steps on CUDA
        take the Triton kernel (ops/decode/mla.py) where it computes decode_mma's operands (its fp8-MMA
        form for mla_decode_mma='fp8' on the fp8 latent); every other step the reference."""
        if sliding_window is not None:
            raise ValueError("multi-head latent attention has no sliding window")
        if q.is_cuda and is_decode_only(q, ctx) and self.fused_decode_unavailable(0, q.shape[-1]) is None:
            fp8_mma = self.decode_mma == "fp8"
            if (self.decode_mma == "auto" or (self.decode_mma == "bf16" and q.dtype == torch.bfloat16)
                    or (fp8_mma and self.dtype == torch.float8_e4m3fn)):
                from moekv.ops.decode.mla import mla_decode

                return mla_decode(q, self.kernel_tensors(cache), ctx.block_tables, ctx.context_lens, scale,
                                  self.kv_lora_rank, fp8_mma=fp8_mma)
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv)

    def attend_reference(self, q, cache, ctx, scale, sliding_window, step_kv=None) -> torch.Tensor:
        """step_kv: (the step's entries [T, W] as computed, None): a prefill chunk reads its own
        tokens exactly (KVFormat.attend), earlier ones as stored. A decode row (one query of its
        sequence) with decode_mma other than 'auto' is computed as the kernel rounds its MMA operands
        (reference.mla_decode_mma_ref)."""
        R = self.kv_lora_rank
        out = q.new_empty(q.shape[0], q.shape[1], R)
        for lo, hi, entries in self.step_sequences(cache, ctx, step_kv, q.dtype):
            if self.decode_mma != "auto" and hi - lo == 1:
                out[lo] = mla_decode_mma_ref(q[lo], entries, R, scale, self.decode_mma, self.token_scales(entries))
            else:
                out[lo:hi] = causal_attention_ref(q[lo:hi], entries[:, None], entries[:, None, :R], scale)
        return out

    def token_scales(self, entries: torch.Tensor) -> torch.Tensor | None:
        """The per-token scales the decode kernel folds into scores and probabilities (None: it reads
        the latent as stored)."""
        return None

    def step_sequences(self, cache, ctx, step_kv, dtype):
        """(lo, hi, entries) for each sequence with query rows in this step: its rows lo:hi and its
        entries [length, W] (sequence_entries: this step's exact, earlier ones as stored)."""
        host = ctx.host_lists()
        starts = host.query_start
        for b, length in enumerate(host.context_lens):
            lo, hi = starts[b], starts[b + 1]
            if hi > lo:
                yield lo, hi, self.sequence_entries(cache, host.block_tables[b], length, lo, hi, step_kv, dtype,
                                                    host.seq_slots[b])

    def sequence_entries(self, cache, block_table, length: int, lo: int, hi: int, step_kv, dtype,
                         seq_slot: int | None = None) -> torch.Tensor:
        """Sequence b's entries [length, W]: its tokens of this step (rows lo:hi) exact when step_kv
        holds them and they are a prefill chunk (hi - lo > 1), the rest as stored."""
        if step_kv is None or hi - lo < 2:
            return self.gather(cache, block_table, length, dtype, seq_slot, length)
        new = step_kv[0][lo:hi].reshape(hi - lo, -1).to(dtype)
        first = length - (hi - lo)
        return new if first == 0 else torch.cat([self.gather(cache, block_table, first, dtype, seq_slot, length), new])

    def kernel_tensors(self, cache: LayerKVCache) -> dict[str, torch.Tensor]:
        """What the decode kernel reads: latent (R columns) and rope (r columns) views of the pages,
        and for fp8 the per-token scales."""
        pages = cache["latent_pages"]
        return {"latent": pages[..., :self.kv_lora_rank], "rope": pages[..., self.kv_lora_rank:]}

    def fused_decode_unavailable(self, block_size: int, head_dim: int) -> str | None:
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            return f"the latent decode kernel reads bf16 / fp16 / fp8 latents, not {self.name} (reference path)"
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        if R < 16 or R & (R - 1) or r < 1 or r & (r - 1):  # ops/decode/mla.kernel_shape_unsupported's rule
            return (f"the latent decode kernel takes kv_lora_rank a power of two >= 16 and qk_rope_head_dim a "
                    f"power of two; got {R} and {r} (reference path)")
        return None


class LatentFP8Format(LatentFormat):
    """The latent in float8 e4m3 with one fp32 scale per token; the rotary key stays in bf16
    (its few columns carry the position, and no per-channel outliers are spread over the latent's)."""

    name = "fp8_e4m3"
    ROPE_DTYPE = torch.bfloat16

    def __init__(self, kv_lora_rank: int) -> None:
        self.dtype, self.kv_lora_rank = torch.float8_e4m3fn, kv_lora_rank

    def token_bytes(self, width: int) -> int:
        return self.kv_lora_rank + 4 + 2 * (width - self.kv_lora_rank)  # codes, scale, bf16 rotary key

    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        # three arrays, each page of each 128-byte aligned
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        return align_page(block_size * R) + align_page(block_size * 4) + align_page(block_size * 2 * r)

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        return LayerKVCache({
            "latent_codes": torch.zeros(num_blocks, block_size, R, dtype=torch.float8_e4m3fn, device=device),
            "latent_scales": torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device),
            "rope_pages": torch.zeros(num_blocks, block_size, r, dtype=self.ROPE_DTYPE, device=device),
        })

    def write(self, cache, k, v, ctx) -> None:
        R = self.kv_lora_rank
        entries = k.reshape(k.shape[0], -1)
        codes, scales = fp8_latent_quantize_ref(entries[:, :R])
        slots = ctx.slot_mapping  # rows of the [N * P, ...] views, as in LatentFormat.write
        cache["latent_codes"].view(-1, R)[slots] = codes
        cache["latent_scales"].view(-1)[slots] = scales
        cache["rope_pages"].view(-1, entries.shape[1] - R)[slots] = entries[:, R:].to(self.ROPE_DTYPE)

    def gather(self, cache, block_table, length, dtype, seq_slot=None, context_len=None) -> torch.Tensor:
        codes = cache["latent_codes"]
        P = codes.shape[1]
        table = torch.as_tensor(block_table, device=codes.device)
        pos = torch.arange(length, device=codes.device)
        pages, offsets = table[pos // P].long(), pos % P
        latent = fp8_latent_dequantize_ref(codes[pages, offsets], cache["latent_scales"][pages, offsets])
        return torch.cat([latent.to(dtype), cache["rope_pages"][pages, offsets].to(dtype)], dim=-1)

    def stored(self, entries: torch.Tensor) -> torch.Tensor:
        R = self.kv_lora_rank
        latent = fp8_latent_dequantize_ref(*fp8_latent_quantize_ref(entries[:, :R]))
        return torch.cat([latent.to(entries.dtype), entries[:, R:].to(self.ROPE_DTYPE).to(entries.dtype)], dim=-1)

    def kernel_tensors(self, cache):
        return {"latent": cache["latent_codes"], "rope": cache["rope_pages"], "scales": cache["latent_scales"]}

    def token_scales(self, entries: torch.Tensor) -> torch.Tensor:
        """Each entry's scale, recovered from its dequantized latent (its largest code is 448: amax / 448;
        1 for an all-zero token, as fp8_latent_quantize_ref stores it)."""
        amax = entries[:, :self.kv_lora_rank].abs().amax(-1)
        return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
