"""Paged formats whose pools can keep their pages in a Gluon decode kernel's fragment order, and
the choice between that order (the Gluon kernel) and slabs (the Triton kernel)."""
from __future__ import annotations

import torch

from moekv.context import Context
from moekv.kvcache.formats.dense import is_decode_only
from moekv.kvcache.formats.interface import LayerKVCache
from moekv.kvcache.formats.names import check_decode_kernel
from moekv.kvcache.formats.paged import PagedQuantFormat


class FragmentPagedFormat(PagedQuantFormat):
    """A paged format whose pools can keep their pages in a Gluon decode kernel's fragment order
    (moekv/ops/gluon/<format>_layout.py) instead of slabs, for the shapes `fragment_pages` names
    (gluon_pages_wanted): such pools hold the layout's tables, pages are converted when written
    (store_slabs), read back by dequantize_pages, and decode-only steps on CUDA take the Gluon kernel
    (gluon_decode), every other step the reference path. Subclasses give the layout module, the
    kernel call and `fragment_marker`, a tensor only their fragment-order pools hold."""

    fragment_marker = "k_codes"

    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape keep their pages in fragment order."""
        raise NotImplementedError

    def fragment_layout(self):
        """The layout module: fragment_bytes_per_page_head, allocate_fragment_tables, kind_to_fragment,
        dequantize_fragment, fragment_view."""
        raise NotImplementedError

    def fragment_view(self, cache: LayerKVCache, page_ids: torch.Tensor | None = None):
        """The pool's fragment tables (pages page_ids, or all) as the layout's page object."""
        return self.fragment_layout().fragment_view(cache, page_ids)

    def to_fragment(self, cache: LayerKVCache, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Freshly quantized slabs of `kind` as the fragment tables' rows."""
        return self.fragment_layout().kind_to_fragment(self, kind, slabs)

    def gluon_decode(self, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
                     sliding_window: int | None, staged: tuple) -> torch.Tensor:
        """The Gluon kernel's decode attention over the pool, staged = (k_staging, v_staging, seq_slots)."""
        raise NotImplementedError

    def is_fragment_pool(self, cache: LayerKVCache) -> bool:
        return self.fragment_marker in cache.tensors

    def page_bytes(self, num_kv_heads, block_size, head_dim) -> int:
        if self.fragment_pages(block_size, head_dim):
            return num_kv_heads * self.fragment_layout().fragment_bytes_per_page_head(self)
        return super().page_bytes(num_kv_heads, block_size, head_dim)

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        fragment = self.fragment_pages(block_size, head_dim, device)
        cache = super().allocate(0 if fragment else num_blocks, num_kv_heads, block_size, head_dim, device,
                                 max_num_seqs, dtype)
        if fragment:  # the fragment-order tables instead of the slab pools
            del cache.tensors["k_pages"], cache.tensors["v_pages"]
            cache.tensors.update(self.fragment_layout().allocate_fragment_tables(self, num_blocks, num_kv_heads,
                                                                                 device))
        return cache

    def store_slabs(self, cache, name, page_ids, slabs) -> None:
        if not self.is_fragment_pool(cache):
            return super().store_slabs(cache, name, page_ids, slabs)
        for field, t in self.to_fragment(cache, "key" if name == "k" else "value", slabs).items():
            cache[field][page_ids] = t

    def dequantize_pages(self, cache, kind, page_ids):
        if not self.is_fragment_pool(cache):
            return super().dequantize_pages(cache, kind, page_ids)
        return self.fragment_layout().dequantize_fragment(self.fragment_view(cache, page_ids), kind)

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None):
        """Pages in fragment order: decode-only steps on CUDA take the Gluon kernel (the staged newest
        page, and a format's own 16-bit tail, as its extra split), everything else the reference path;
        slabs: the base class's."""
        if not self.is_fragment_pool(cache):
            return super().attend(q, cache, ctx, scale, sliding_window, step_kv)
        G = q.shape[1] // cache["k_staging"].shape[1]
        if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and G in (1, 2, 4, 8)
                and is_decode_only(q, ctx)):
            return self.gluon_decode(q, cache, ctx, scale, sliding_window,
                                     (cache["k_staging"], cache["v_staging"], ctx.seq_slots))
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv)


def gluon_pages_wanted(choice: str, covered: bool, device: torch.device | str | None, what: str,
                       by_default: bool = True) -> bool:
    """Whether a format's pools of a shape keep their pages in a Gluon decode kernel's fragment order
    (moekv/ops/gluon/), by the format's decode_kernel `choice`: 'triton' (slabs, the Triton kernel),
    'gluon' (fragment order wherever the shape is `covered`, CPU included: there the reference path
    reads it; a ValueError naming `what` the kernel covers otherwise), 'auto' (fragment order on sm_90
    CUDA devices with Gluon for covered shapes of a format whose Gluon kernel is its default,
    `by_default`; slabs elsewhere; the default)."""
    check_decode_kernel(choice)
    if choice == "triton":
        return False
    if choice == "gluon":
        if not covered:
            raise ValueError(f"decode_kernel='gluon': {what}")
        return True
    if not (covered and by_default) or not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    import importlib.util

    return importlib.util.find_spec("triton.experimental.gluon") is not None

