"""Low-bit latent caches of multi-head latent attention (the 4- and 2-bit forms of latent.py's cache).

The latent c_kv (kv_lora_rank R columns) is quantized; the rotary key (r columns) stays in bf16, as
in the fp8 latent: its few columns carry the position, and at r = 64 of 576 they are 11% of the
elements (measured both ways: docs/decisions.md, "Low-bit latents").

  - LatentInt4Format ('int4'): per token, groups of G (32 or 64, kv_group_size) channels with an
    fp16 scale and minimum; codes two per byte, channel 2j in the low nibble of byte j. A token is
    quantized alone, so nothing is staged. Pools: latent_codes uint8 [N, P, R/2], latent_scale and
    latent_zero fp16 [N, P, R/G], rope_pages bf16 [N, P, r]. The Triton absorbed decode kernel reads
    it (ops/decode/mla.py).
  - Latent2BitFormat: 2-bit codes, value = offset + step * level[code] with one fp16 (offset, step)
    per group, and a 16-bit ring of each sequence's newest `residual` entries (the window KIVI
    keeps, kept with kvcache/formats/residual.py's ring functions as kivi2 / nuq2 / vq keep theirs:
    position p at row p % R_w, read instead of the pages for the newest R_w positions). Two groupings:
      * 'channel' (KIVI's keys): per channel over G consecutive tokens. A token group is re-coded
        from the ring plus the step's entries each time one of its tokens is written (its grid moves
        until it is whole), so the window must hold a whole group: R_w >= G, a multiple of G.
        Side pools [N, P/G, R].
      * 'token': per token over G channels, as int4; nothing waits for a group. Side [N, P, R/G].
    Two codebooks: 'uniform' (KIVI's min + k (max - min) / 3) and 'gaussian' (mean + std times the
    Lloyd-Max levels of a unit normal: after kv_a_layernorm a token's latent is near-Gaussian).
    The engine's names: kv_cache_dtype='kivi2' is KIVI's key recipe on the latent (channel, uniform:
    the baseline), 'nuq2' the non-uniform 2-bit latent (channel, gaussian). Per channel for both: a
    token's latent is RMS-normalised, so its scale varies little from token to token, while
    kv_a_layernorm's weight scales each channel for good (measured: docs/decisions.md, "Low-bit
    latents"); the per-token grouping is kept for those measurements. No fused decode kernel reads
    them yet: decode takes the reference path (eager steps, on CUDA too).

Bits per element count every byte: codes, the side tables (each pool's pages 128-byte aligned), the
bf16 rotary key, and for the 2-bit forms the ring (staging_bytes_per_seq, spread over the context
in bits_per_element_at).
"""
from __future__ import annotations

import torch

from moekv.kvcache.formats.dense import is_decode_only
from moekv.kvcache.formats.interface import GraphSupport, LayerKVCache
from moekv.kvcache.formats.latent import LatentFormat, align_page
from moekv.kvcache.formats.residual import read_ring, ring_bytes_per_seq, window_start, write_ring
from moekv.ops.reference import (
    latent_2bit_dequantize_ref,
    latent_2bit_quantize_ref,
    latent_int4_dequantize_ref,
    latent_int4_quantize_ref,
    pack_2bit_ref,
    unpack_2bit_ref,
)

GROUP_SIZES = (32, 64)
GROUPINGS = ("token", "channel")
CODEBOOKS = ("uniform", "gaussian")
ROPE_DTYPE = torch.bfloat16


def _slots(cache_tensor: torch.Tensor, block_table, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of a sequence's positions 0..length-1."""
    P = cache_tensor.shape[1]
    table = torch.as_tensor(block_table, device=cache_tensor.device)
    pos = torch.arange(length, device=cache_tensor.device)
    return table[pos // P].long(), pos % P


class LatentInt4Format(LatentFormat):
    """The latent in 4-bit codes, per token in groups of G channels with an fp16 scale and minimum."""

    name = "int4"

    def __init__(self, kv_lora_rank: int, group_size: int = 32) -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 latent: group_size={group_size!r} is not supported; accepted: {list(GROUP_SIZES)}")
        if kv_lora_rank % group_size:
            raise ValueError(f"int4 latent: kv_lora_rank={kv_lora_rank} is not a multiple of group_size={group_size}")
        self.dtype, self.kv_lora_rank, self.group = torch.uint8, kv_lora_rank, group_size

    def token_bytes(self, width: int) -> int:
        R = self.kv_lora_rank
        return R // 2 + 4 * (R // self.group) + 2 * (width - R)  # codes, scale + zero, bf16 rotary key

    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        side = align_page(block_size * (R // self.group) * 2)
        return align_page(block_size * R // 2) + 2 * side + align_page(block_size * 2 * r)

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        R, r, G = self.kv_lora_rank, head_dim - self.kv_lora_rank, self.group
        return LayerKVCache({
            "latent_codes": torch.zeros(num_blocks, block_size, R // 2, dtype=torch.uint8, device=device),
            "latent_scale": torch.zeros(num_blocks, block_size, R // G, dtype=torch.float16, device=device),
            "latent_zero": torch.zeros(num_blocks, block_size, R // G, dtype=torch.float16, device=device),
            "rope_pages": torch.zeros(num_blocks, block_size, r, dtype=ROPE_DTYPE, device=device),
        })

    def write(self, cache, k, v, ctx) -> None:
        R = self.kv_lora_rank
        entries = k.reshape(k.shape[0], -1)
        codes, scale, zero = latent_int4_quantize_ref(entries[:, :R], self.group)
        P = cache["latent_codes"].shape[1]
        pages, offsets = ctx.slot_mapping // P, ctx.slot_mapping % P
        cache["latent_codes"][pages, offsets] = codes
        cache["latent_scale"][pages, offsets] = scale
        cache["latent_zero"][pages, offsets] = zero
        cache["rope_pages"][pages, offsets] = entries[:, R:].to(ROPE_DTYPE)

    def gather(self, cache, block_table, length, dtype, seq_slot=None, context_len=None) -> torch.Tensor:
        pages, offsets = _slots(cache["latent_codes"], block_table, length)
        latent = latent_int4_dequantize_ref(cache["latent_codes"][pages, offsets],
                                            cache["latent_scale"][pages, offsets], cache["latent_zero"][pages, offsets])
        return torch.cat([latent.to(dtype), cache["rope_pages"][pages, offsets].to(dtype)], dim=-1)

    def stored(self, entries: torch.Tensor) -> torch.Tensor:
        R = self.kv_lora_rank
        latent = latent_int4_dequantize_ref(*latent_int4_quantize_ref(entries[:, :R], self.group))
        return torch.cat([latent.to(entries.dtype), entries[:, R:].to(ROPE_DTYPE).to(entries.dtype)], dim=-1)

    def kernel_tensors(self, cache):
        return {"latent": cache["latent_codes"], "rope": cache["rope_pages"], "scales": cache["latent_scale"],
                "zeros": cache["latent_zero"]}

    def fused_decode_unavailable(self, block_size: int, head_dim: int) -> str | None:
        from moekv.ops.decode.mla import kernel_shape_unsupported

        reason = kernel_shape_unsupported(self.kv_lora_rank, head_dim - self.kv_lora_rank)
        if reason is None and self.kv_lora_rank < 32:
            reason = f"the int4 latent kernel reads kv_lora_rank >= 32 (16 bytes a row), got {self.kv_lora_rank}"
        return None if reason is None else reason + " (reference path)"


class Latent2BitFormat(LatentFormat):
    """The latent in 2-bit codes with a 16-bit window of each sequence's newest entries."""

    graph_support = GraphSupport.EAGER_ONLY  # the reference path: no fused decode kernel reads it

    def __init__(self, kv_lora_rank: int, name: str, grouping: str, codebook: str, group_size: int = 32,
                 residual: int = 128) -> None:
        if grouping not in GROUPINGS:
            raise ValueError(f"{name} latent: grouping={grouping!r}; accepted: {list(GROUPINGS)}")
        if codebook not in CODEBOOKS:
            raise ValueError(f"{name} latent: codebook={codebook!r}; accepted: {list(CODEBOOKS)}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"{name} latent: group_size={group_size!r} is not supported; "
                             f"accepted: {list(GROUP_SIZES)}")
        if kv_lora_rank % 4 or (grouping == "token" and kv_lora_rank % group_size):
            raise ValueError(f"{name} latent: kv_lora_rank={kv_lora_rank} must be a multiple of 4 (codes per byte)"
                             + (f" and of group_size={group_size}" if grouping == "token" else ""))
        if not isinstance(residual, int) or isinstance(residual, bool) or residual < 0:
            raise ValueError(f"{name} latent: residual={residual!r} must be an integer >= 0")
        if grouping == "channel" and (residual < group_size or residual % group_size):
            raise ValueError(f"{name} latent: residual={residual} must be a multiple of group_size={group_size} "
                             "(>= one group: a token group waits in the 16-bit window until it is whole)")
        self.name, self.kv_lora_rank, self.dtype = name, kv_lora_rank, torch.uint8
        self.grouping, self.codebook, self.group, self.residual = grouping, codebook, group_size, residual

    # -- layout -----------------------------------------------------------------------------
    def token_bytes(self, width: int) -> int:
        R = self.kv_lora_rank
        return R // 4 + 4 * R // self.group + 2 * (width - R)  # codes, offset + step per G elements, rotary key

    def _side_shape(self, block_size: int) -> tuple[int, int]:
        R, G = self.kv_lora_rank, self.group
        return (block_size // G, R) if self.grouping == "channel" else (block_size, R // G)

    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        rows, cols = self._side_shape(block_size)
        return align_page(block_size * R // 4) + 2 * align_page(rows * cols * 2) + align_page(block_size * 2 * r)

    def staging_bytes_per_seq(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        return ring_bytes_per_seq(self.residual, head_dim)  # the ring: R_w entries, 16-bit

    def bits_per_element_at(self, context_len: int, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        if context_len < 1:
            raise ValueError(f"context_len={context_len} must be >= 1")
        pages = -(-context_len // block_size)
        stored = pages * self.page_bytes(num_kv_heads, block_size, head_dim) + self.staging_bytes_per_seq(
            num_kv_heads, block_size, head_dim)
        return 8 * stored / (context_len * head_dim)

    def check_layout(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        super().check_layout(num_kv_heads, block_size, head_dim)
        if self.grouping == "channel" and block_size % self.group:
            raise ValueError(f"{self.name} latent: block_size={block_size} must be a multiple of group_size="
                             f"{self.group} (a token group lies in one page)")

    def prefix_caching_unsupported(self) -> str | None:
        if self.residual == 0:
            return None
        return (f"its residual window (the newest {self.residual} latent entries in 16-bit) lives in a per-sequence "
                "ring that shared pages do not carry" + ("; use kv_residual=0 to share pages"
                                                         if self.grouping == "token" else ""))

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        self.check_layout(num_kv_heads, block_size, head_dim)
        R, r = self.kv_lora_rank, head_dim - self.kv_lora_rank
        side = self._side_shape(block_size)
        tensors = {
            "latent_codes": torch.zeros(num_blocks, block_size, R // 4, dtype=torch.uint8, device=device),
            "latent_offset": torch.zeros(num_blocks, *side, dtype=torch.float16, device=device),
            "latent_step": torch.zeros(num_blocks, *side, dtype=torch.float16, device=device),
            "rope_pages": torch.zeros(num_blocks, block_size, r, dtype=ROPE_DTYPE, device=device),
        }
        if self.residual:
            ring_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            tensors["ring"] = torch.zeros(max_num_seqs, self.residual, head_dim, dtype=ring_dtype, device=device)
        return LayerKVCache(tensors)

    # -- write ------------------------------------------------------------------------------
    def write(self, cache, k, v, ctx) -> None:
        """k: the step's entries [T, 1, W] or [T, W]. The pages first (a channel group is re-coded
        from the ring as it stood before this step), then the ring."""
        R = self.kv_lora_rank
        entries = k.reshape(k.shape[0], -1)
        P = cache["latent_codes"].shape[1]
        pages, offsets = ctx.slot_mapping // P, ctx.slot_mapping % P
        cache["rope_pages"][pages, offsets] = entries[:, R:].to(ROPE_DTYPE)
        if self.grouping == "token":
            T = entries.shape[0]
            codes, offset, step = latent_2bit_quantize_ref(entries[:, :R].reshape(T, R // self.group, self.group), -1,
                                                           self.codebook)
            cache["latent_codes"][pages, offsets] = pack_2bit_ref(codes.reshape(T, R))
            cache["latent_offset"][pages, offsets] = offset
            cache["latent_step"][pages, offsets] = step
        else:
            self._write_channel_groups(cache, entries, ctx)
        if self.residual:  # a decode step (one token a sequence with a slot): one indexed copy
            write_ring((cache["ring"],), (entries,), ctx, self.residual,
                       is_decode_only(entries, ctx) and ctx.seq_slots is not None)

    def _write_channel_groups(self, cache, entries, ctx) -> None:
        """Each token group the step touches re-coded whole: its earlier tokens from the ring (they
        are newer than the last whole group, so inside the window), the step's as computed."""
        R, G, Rw = self.kv_lora_rank, self.group, self.residual
        P = cache["latent_codes"].shape[1]
        host = ctx.host_lists()
        starts = host.query_start
        for b, (end, slot, table) in enumerate(zip(host.context_lens, host.seq_slots, host.block_tables)):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            first = end - (hi - lo)
            g0 = first // G * G
            old = read_ring(cache["ring"], slot, g0, first, Rw)[:, :R].float()
            span = torch.cat([old, entries[lo:hi, :R].float()])  # positions g0..end-1
            L, groups = end - g0, -(-(end - g0) // G)
            padded = torch.zeros(groups * G, R, device=span.device)
            padded[:L] = span
            mask = (torch.arange(groups * G, device=span.device) < L)[:, None].expand(-1, R)
            codes, offset, step = latent_2bit_quantize_ref(padded.view(groups, G, R), -2, self.codebook,
                                                           mask.reshape(groups, G, R))
            table_t = torch.as_tensor(table, device=span.device)
            pos = torch.arange(g0, end, device=span.device)
            cache["latent_codes"][table_t[pos // P].long(), pos % P] = pack_2bit_ref(codes.view(-1, R)[:L])
            gpos = torch.arange(g0, end, G, device=span.device)
            cache["latent_offset"][table_t[gpos // P].long(), (gpos % P) // G] = offset
            cache["latent_step"][table_t[gpos // P].long(), (gpos % P) // G] = step

    # -- read -------------------------------------------------------------------------------
    def _dequantize(self, cache, pages, offsets) -> torch.Tensor:
        codes = unpack_2bit_ref(cache["latent_codes"][pages, offsets])  # [L, R]
        L, R = codes.shape
        if self.grouping == "token":
            return latent_2bit_dequantize_ref(codes.view(L, R // self.group, self.group), cache["latent_offset"][
                pages, offsets], cache["latent_step"][pages, offsets], -1, self.codebook).view(L, R)
        groups = offsets // self.group
        return latent_2bit_dequantize_ref(codes[:, None], cache["latent_offset"][pages, groups],
                                          cache["latent_step"][pages, groups], -2, self.codebook)[:, 0]

    def gather(self, cache, block_table, length, dtype, seq_slot=None, context_len=None) -> torch.Tensor:
        """The first `length` entries; with seq_slot given, those among the sequence's newest
        `residual` (of context_len written, default length) from the ring."""
        pages, offsets = _slots(cache["latent_codes"], block_table, length)
        entries = torch.cat([self._dequantize(cache, pages, offsets), cache["rope_pages"][pages, offsets].float()], -1)
        if seq_slot is not None:
            start = window_start(self.residual, length if context_len is None else context_len, length)
            if start < length:
                entries[start:] = read_ring(cache["ring"], seq_slot, start, length, self.residual).float()
        return entries.to(dtype)

    def stored(self, entries: torch.Tensor) -> torch.Tensor:
        """Entries [T, W] of positions 0..T-1 as the pages read them back (the window aside)."""
        R, G = self.kv_lora_rank, self.group
        T = entries.shape[0]
        x = entries[:, :R].float()
        if self.grouping == "token":
            codes, offset, step = latent_2bit_quantize_ref(x.reshape(T, R // G, G), -1, self.codebook)
            latent = latent_2bit_dequantize_ref(codes, offset, step, -1, self.codebook).reshape(T, R)
        else:
            groups = -(-T // G)
            padded = torch.zeros(groups * G, R, device=x.device)
            padded[:T] = x
            mask = (torch.arange(groups * G, device=x.device) < T)[:, None].expand(-1, R).reshape(groups, G, R)
            codes, offset, step = latent_2bit_quantize_ref(padded.view(groups, G, R), -2, self.codebook, mask)
            latent = latent_2bit_dequantize_ref(codes, offset, step, -2, self.codebook).reshape(-1, R)[:T]
        return torch.cat([latent.to(entries.dtype), entries[:, R:].to(ROPE_DTYPE).to(entries.dtype)], dim=-1)

    def kernel_tensors(self, cache):
        raise NotImplementedError(f"the {self.name} latent has no fused decode kernel")

    def fused_decode_unavailable(self, block_size: int, head_dim: int) -> str | None:
        return f"no fused decode kernel reads the 2-bit latent ({self.name}) yet (reference path)"
