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


def decode_kernel_for_model(choice: str, num_heads: int, num_kv_heads: int) -> str:
    """The decode kernel a model's pools are laid out for: 'auto' becomes 'triton' (slab pools, the
    Triton kernel, which pads any group) when no Gluon kernel takes the model's query heads per KV
    head (GLM-4.5: 96 / 8 = 12), whose fragment-order pools only the reference path would read; any
    other choice stands."""
    if choice == "auto" and num_heads // num_kv_heads not in GLUON_QUERY_GROUPS:
        return "triton"
    return choice


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

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        """Pages in fragment order: decode-only steps on CUDA take the Gluon kernel (the staged newest
        page, and a format's own 16-bit tail, as its extra split), everything else the reference path;
        slabs: the base class's."""
        if not self.is_fragment_pool(cache):
            return super().attend(q, cache, ctx, scale, sliding_window, step_kv, sinks)
        G = q.shape[1] // cache["k_staging"].shape[1]
        if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and G in GLUON_QUERY_GROUPS
                and is_decode_only(q, ctx)):
            kernel = self.gluon_kernel
            options = kernel.decode_options(self, cache) if kernel.decode_options is not None else {}
            return kernel.decode_entry()(q, self.fragment_view(cache), ctx.block_tables, ctx.context_lens, scale,
                                         staged=(cache["k_staging"], cache["v_staging"], ctx.seq_slots),
                                         sliding_window=sliding_window, sinks=sinks, **options)
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv, sinks)
