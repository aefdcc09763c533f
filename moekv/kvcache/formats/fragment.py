"""Paged formats whose pools can keep their pages in a Gluon decode kernel's fragment order, and
the choice between that order (the Gluon kernel) and slabs (the Triton kernel).

A format with a Gluon kernel declares it once, in its own file, as a GluonKernel (KVFormat.gluon_kernel):
where its page layout and decode entry live, which shapes it covers, whether decode_kernel='auto'
picks it. The generic code here reads that declaration; the layout and decode modules are imported
when first used, so a CPU process never imports Gluon.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moekv.kvcache.formats.dense import is_decode_only
from moekv.kvcache.formats.interface import LayerKVCache
from moekv.kvcache.formats.names import check_decode_kernel
from moekv.kvcache.formats.paged import PagedQuantFormat

# query heads per KV head the Gluon decode kernels take (a KV head's group is the MMA's N, up to 8)
GLUON_QUERY_GROUPS = (1, 2, 4, 8)
# a larger group runs a Gluon kernel once per part of it (query_group_parts), each part reading every page
# once more (GLM-4.5's 12 = 8 + 4: two reads). decode_kernel='auto' lays out for the Gluon kernels the groups
# they take in at most this many parts: two reads beat the Triton kernel's one where the cache is large (H100,
# GLM-4.5-Air's 10 layers at 32 x 32k: nuq2 20.6 against 36.0 ms, kivi2 18.5 against 26.1), and cost up to
# 0.2 ms a step at batch 1 x 4k; decode_kernel='gluon' takes any group in parts (docs/decisions.md, "Query
# groups beyond 8")
GLUON_MAX_GROUP_PARTS = 2


def query_group_parts(group: int) -> tuple[tuple[int, int], ...]:
    """A KV head's query group of `group` heads as the fewest parts the Gluon kernels take (each in
    GLUON_QUERY_GROUPS, largest first): (offset, size) pairs over the group's heads, 12 -> ((0, 8), (8, 4)),
    8 -> ((0, 8),). Every group has one (1, 2, 4, 8: its binary digits and its eights)."""
    if group < 1:
        raise ValueError(f"a query group has at least one head, got {group}")
    parts, offset = [], 0
    for size in sorted(GLUON_QUERY_GROUPS, reverse=True):
        while group - offset >= size:
            parts.append((offset, size))
            offset += size
    return tuple(parts)


def decode_kernel_for_model(choice: str, num_heads: int, num_kv_heads: int) -> str:
    """The decode kernel a model's pools are laid out for: 'auto' becomes 'triton' (slab pools, the
    Triton kernel, which pads any group) when the Gluon kernels would take the model's query heads per
    KV head in more than GLUON_MAX_GROUP_PARTS parts (query_group_parts: each part reads the pages once),
    or the heads are no whole number of groups; GLM-4.5's 96 / 8 = 12 (8 + 4) stays on them. Any other
    choice stands."""
    if choice == "auto" and (num_heads % num_kv_heads
                             or len(query_group_parts(num_heads // num_kv_heads)) > GLUON_MAX_GROUP_PARTS):
        return "triton"
    return choice


def attend_in_group_parts(q: torch.Tensor, num_kv_heads: int, sinks: torch.Tensor | None,
                          attend_part: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] through a Gluon kernel whose groups are GLUON_QUERY_GROUPS, for any
    group G = Hq / num_kv_heads: attend_part(q_part, sinks_part) -> [B, Hkv * g, D] runs the kernel on
    q_part [B, Hkv * g, D] (contiguous; sinks_part [Hkv * g] or None). A group the kernels take is one
    call on q and sinks as they are. A larger one is cut by query_group_parts: part (o, g) is the query
    heads o .. o + g of every KV head's group (q as [B, Hkv, G, D], sliced), its sinks the same heads, and
    its output fills those heads of the result. Each head's attention is its own softmax, so the parts'
    outputs need no merge; but each part reads every page of the context once, so G = 12 (8 + 4) reads
    the pages twice and G = 24 (8 + 8 + 8) three times."""
    B, Hq, D = q.shape
    G = Hq // num_kv_heads
    parts = query_group_parts(G)
    if len(parts) == 1:
        return attend_part(q, sinks)
    q_groups = q.unflatten(1, (num_kv_heads, G))
    sink_groups = None if sinks is None else sinks.view(num_kv_heads, G)
    out = q.new_empty(B, num_kv_heads, G, D)
    for o, g in parts:
        q_part = q_groups[:, :, o:o + g].reshape(B, num_kv_heads * g, D).contiguous()
        sinks_part = None if sink_groups is None else sink_groups[:, o:o + g].reshape(-1).contiguous()
        out[:, :, o:o + g] = attend_part(q_part, sinks_part).view(B, num_kv_heads, g, D)
    return out.view(B, Hq, D)


@dataclass(frozen=True)
class GluonKernel:
    """A format's Gluon decode kernel (KVFormat.gluon_kernel), declared once in the format's file.

    layout: the module of its page layout (moekv.ops.gluon.<format>_layout), which provides, with one
    signature for every format: fragment_bytes_per_page_head(fmt), allocate_fragment_tables(fmt,
    num_blocks, num_kv_heads, device), kind_to_fragment(fmt, kind, slabs, layer) (a kind's freshly
    quantized slabs as the tables' rows), fragment_view(fmt, tensors, page_ids, layer) (the pool's
    tables as the kernel's page object) and dequantize_fragment(view, kind).
    decode: 'module:function', the decode attention over such a pool: function(q, view, block_tables,
    context_lens, scale, staged=(k_staging, v_staging, seq_slots), sliding_window=...,
    **decode_options(fmt, cache)).
    covers(fmt, block_size, head_dim): why the kernel does not cover pools of this shape and the
    format's options (a sentence naming what it covers), or None where it does.
    default_on: whether decode_kernel='auto' lays covered pools out for it on sm_90 ('gluon' always
    does). marker: a tensor only its fragment-order pools hold. decode_options: extra keyword
    arguments of the decode entry for one pool (kivi2: its residual ring), or None.
    """

    layout: str
    decode: str
    covers: Callable[[Any, int, int], str | None]
    default_on: bool = True
    marker: str = "k_codes"
    decode_options: Callable[[Any, LayerKVCache], dict[str, Any]] | None = None

    def layout_module(self):
        return importlib.import_module(self.layout)

    def decode_entry(self) -> Callable:
        """The decode function, looked up at each call (tests patch it on its module)."""
        module, _, function = self.decode.partition(":")
        return getattr(importlib.import_module(module), function)

    def wanted(self, fmt, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether fmt's pools of this shape (on `device`) keep their pages in this kernel's fragment
        order, by fmt.decode_kernel: gluon_pages_wanted."""
        return gluon_pages_wanted(fmt.decode_kernel, self.covers(fmt, block_size, head_dim), device, self.default_on)


def gluon_pages_wanted(choice: str, not_covered: str | None, device: torch.device | str | None,
                       by_default: bool = True) -> bool:
    """Whether a format's pools of a shape keep their pages in a Gluon decode kernel's fragment order
    (moekv/ops/gluon/), by the format's decode_kernel `choice`: 'triton' (slabs, the Triton kernel),
    'gluon' (fragment order wherever the shape is covered, `not_covered` None, CPU included: there
    the reference path reads it; a ValueError with the reason `not_covered` otherwise), 'auto'
    (fragment order on sm_90 CUDA devices with Gluon for covered shapes of a format whose Gluon kernel
    is its default, `by_default`; slabs elsewhere; the default)."""
    check_decode_kernel(choice)
    if choice == "triton":
        return False
    if choice == "gluon":
        if not_covered is not None:
            raise ValueError(f"decode_kernel='gluon': {not_covered}")
        return True
    if not_covered is not None or not by_default or not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return importlib.util.find_spec("triton.experimental.gluon") is not None


class FragmentPagedFormat(PagedQuantFormat):
    """A paged format whose pools can keep their pages in its Gluon decode kernel's fragment order
    (its gluon_kernel's layout) instead of slabs, for the shapes `fragment_pages` names: such pools
    hold the layout's tables, pages are converted when written (store_slabs), read back by
    dequantize_pages, and decode-only steps on CUDA take the Gluon kernel, every other step the
    reference path. A subclass declares `gluon_kernel`; nothing else here is per format."""

    gluon_kernel: GluonKernel

    def fragment_view(self, cache: LayerKVCache, page_ids: torch.Tensor | None = None):
        """The pool's fragment tables (pages page_ids, or all) as the layout's page object."""
        return self.gluon_kernel.layout_module().fragment_view(self, cache, page_ids, cache.layer)

    def to_fragment(self, cache: LayerKVCache, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Freshly quantized slabs of `kind` as the fragment tables' rows."""
        return self.gluon_kernel.layout_module().kind_to_fragment(self, kind, slabs, cache.layer)

    def page_bytes(self, num_kv_heads, block_size, head_dim) -> int:
        if self.fragment_pages(block_size, head_dim):
            return num_kv_heads * self.gluon_kernel.layout_module().fragment_bytes_per_page_head(self)
        return super().page_bytes(num_kv_heads, block_size, head_dim)

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        fragment = self.fragment_pages(block_size, head_dim, device)
        cache = super().allocate(0 if fragment else num_blocks, num_kv_heads, block_size, head_dim, device,
                                 max_num_seqs, dtype)
        if fragment:  # the fragment-order tables instead of the slab pools
            del cache.tensors["k_pages"], cache.tensors["v_pages"]
            cache.tensors.update(self.gluon_kernel.layout_module().allocate_fragment_tables(
                self, num_blocks, num_kv_heads, device))
        return cache

    def store_slabs(self, cache, name, page_ids, slabs) -> None:
        if not self.is_fragment_pool(cache):
            return super().store_slabs(cache, name, page_ids, slabs)
        for field, t in self.to_fragment(cache, "key" if name == "k" else "value", slabs).items():
            cache[field][page_ids] = t

    def dequantize_pages(self, cache, kind, page_ids):
        if not self.is_fragment_pool(cache):
            return super().dequantize_pages(cache, kind, page_ids)
        return self.gluon_kernel.layout_module().dequantize_fragment(self.fragment_view(cache, page_ids), kind)

    def gluon_step(self, q: torch.Tensor, ctx) -> bool:
        """Whether attention over a fragment-order pool takes the Gluon kernel: decode-only steps with
        fp16 / bf16 queries on CUDA (any query group: attend_in_group_parts)."""
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and is_decode_only(q, ctx)

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        """Pages in fragment order: decode-only steps on CUDA take the Gluon kernel (the staged newest
        page, and a format's own 16-bit tail, as its extra split; a query group beyond the kernel's 8 in
        parts, each reading the pages once: attend_in_group_parts), everything else the reference path;
        slabs: the base class's."""
        if not self.is_fragment_pool(cache):
            return super().attend(q, cache, ctx, scale, sliding_window, step_kv, sinks)
        if self.gluon_step(q, ctx):
            kernel = self.gluon_kernel
            options = kernel.decode_options(self, cache) if kernel.decode_options is not None else {}
            entry, view = kernel.decode_entry(), self.fragment_view(cache)
            staged = (cache["k_staging"], cache["v_staging"], ctx.seq_slots)

            def attend_part(q_part, sinks_part):
                return entry(q_part, view, ctx.block_tables, ctx.context_lens, scale, staged=staged,
                             sliding_window=sliding_window, sinks=sinks_part, **options)

            return attend_in_group_parts(q, cache["k_staging"].shape[1], sinks, attend_part)
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv, sinks)
