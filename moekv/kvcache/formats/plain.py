"""Uncompressed pages in bf16 / fp16 / fp32: the baseline format and the quality reference."""
from __future__ import annotations

import torch

from moekv.kvcache.formats.dense import dense_attention
from moekv.kvcache.formats.interface import PAGE_ALIGN_BYTES, GraphSupport, KVFormat, LayerKVCache, RopeWriteTarget
from moekv.ops.reference import gather_kv_ref, write_kv_pages_ref

_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class PlainKVFormat(KVFormat):
    # one scatter through slot_mapping, a token that fills its page like any other (fp32 pages have
    # no decode_spec: fused_decode_unavailable keeps them eager)
    graph_support = GraphSupport.DECODE_WITH_FILLS

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = _NAMES[dtype]

    def _head_page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        return 2 * num_kv_heads * self._head_page_bytes(block_size, head_dim)

    def check_layout(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        # Pages are laid out [page, kv_head, token, head_dim]: each (page, kv_head) slab is contiguous.
        slab = self._head_page_bytes(block_size, head_dim)
        if slab % PAGE_ALIGN_BYTES:
            need = -(-PAGE_ALIGN_BYTES // (head_dim * torch.empty((), dtype=self.dtype).element_size()))
            raise ValueError(
                f"block_size={block_size} gives {slab}-byte pages per KV head for head_dim={head_dim} in "
                f"{self.name}; pages must be a multiple of {PAGE_ALIGN_BYTES} bytes: use a block_size that is a "
                f"multiple of {need}")

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)  # [N, Hkv, P, D]
        return LayerKVCache({
            "k_pages": torch.zeros(shape, dtype=self.dtype, device=device),
            "v_pages": torch.zeros(shape, dtype=self.dtype, device=device),
        })

    def write(self, cache, k, v, ctx) -> None:
        write_kv_pages_ref(cache["k_pages"], cache["v_pages"], k, v, ctx.slot_mapping)

    def fused_rope_write_target(self, cache, k, ctx):
        return RopeWriteTarget(cache["k_pages"], cache["v_pages"], ctx.slot_mapping)

    def decode_spec(self, block_size, head_dim):
        from moekv.ops.decode.plain import plain_spec

        return plain_spec(self.dtype)

    def attend_reference(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        # paged_attention_ref's math, with the step's tables from the host lists (no sync a layer).
        # step_kv is not read: the pages hold the step's K/V as `write` stored them, in this format's
        # dtype (the model's, for "auto"), which every step reads alike
        def gather(b, length):
            table = ctx.block_tables[b]
            return gather_kv_ref(cache["k_pages"], table, length), gather_kv_ref(cache["v_pages"], table, length)

        return dense_attention(q, ctx, gather, scale, sliding_window, sinks)
