"""The interface every KV format implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

PAGE_ALIGN_BYTES = 128  # pages start on 128-byte lines so kernels can issue full-line loads


@dataclass
class LayerKVCache:
    """One layer's page pool: the tensors a format allocates, by name (e.g. k_pages, v_pages)."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class KVFormat(ABC):
    name: str

    @abstractmethod
    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        """Bytes one page (K and V, one layer) occupies, every side table included."""

    def bits_per_element(self, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        """Every stored bit of a full page over its (tokens x kv_heads x head_dim x {K, V}) elements."""
        return 8 * self.page_bytes(num_kv_heads, block_size, head_dim) / (2 * block_size * num_kv_heads * head_dim)

    def check_layout(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        """Raise ValueError if a page would not be a whole number of 128-byte lines."""

    @abstractmethod
    def allocate(self, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device) -> LayerKVCache: ...

    @abstractmethod
    def write(self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at slot_mapping [T] (page * block_size + offset)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, context_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached context -> [T, Hq, D]."""
