"""2-bit codes in a fragment order, what nuq2's and kivi2's layouts share (nuq2_layout.py, kivi2_layout.py
each define their order): a page-head's 64 x 128 codes packed into 512 int32 words, slot
4 * byte + field (field f in bits 2f..2f+1 of the byte) holding the code of the element t * D + c its
order names; the orders' index tables are copied to a device once."""
from __future__ import annotations

import torch

from moekv.ops.gluon.tables import HEAD_DIM, PAGE_TOKENS, check_kind

PAGE_BYTES = PAGE_TOKENS * HEAD_DIM // 4  # 2048: 4 rows of 512 bytes a page-head
WORDS_PER_PAGE = PAGE_BYTES // 4
# fragment orders by name: (element of slot, slot of element), each {kind: [P * D] long}
ORDERS: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
_ON_DEVICE: dict[tuple[str, str, str, torch.device], torch.Tensor] = {}


def register_order(order: str, element_of_slot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Name an order by its element of each slot {kind: [P * D] long} -> its inverse (slot of each element)."""
    slot_of_element = {kind: torch.argsort(e) for kind, e in element_of_slot.items()}
    ORDERS[order] = (element_of_slot, slot_of_element)
    return slot_of_element


def _index_on(table: str, kind: str, device: torch.device, order: str) -> torch.Tensor:
    """An order's element-of-slot / slot-of-element [kind] on `device`, copied once: a copy from the host
    inside a CUDA graph capture (the engine converts the pages a captured step fills) is refused."""
    key = (order, table, kind, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = ORDERS[order][0 if table == "element" else 1][kind].to(device)
    return _ON_DEVICE[key]


def prepare_device(device: torch.device, order: str) -> None:
    """Put an order's index tables on `device` now (before any capture that converts pages)."""
    for kind in ("key", "value"):
        _index_on("element", kind, device, order)
        _index_on("slot", kind, device, order)


def codes_to_fragment(codes: torch.Tensor, kind: str, order: str) -> torch.Tensor:
    """codes [..., 64, 128] in 0..3 -> int32 words [..., 512] in fragment order (slot 4 * byte + field
    holds the code of element ORDERS[order][0][kind][slot])."""
    check_kind(kind)
    if codes.shape[-2:] != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"codes_to_fragment: codes must end in [{PAGE_TOKENS}, {HEAD_DIM}], got {tuple(codes.shape)}")
    lead = codes.shape[:-2]
    flat = codes.reshape(*lead, PAGE_TOKENS * HEAD_DIM).to(torch.uint8)
    slots = flat[..., _index_on("element", kind, codes.device, order)].reshape(*lead, PAGE_BYTES, 4)
    packed = slots[..., 0] | (slots[..., 1] << 2) | (slots[..., 2] << 4) | (slots[..., 3] << 6)
    return packed.contiguous().view(torch.int32)


def codes_from_fragment(words: torch.Tensor, kind: str, order: str) -> torch.Tensor:
    """int32 words [..., 512] in fragment order -> codes [..., 64, 128] (int64)."""
    check_kind(kind)
    lead = words.shape[:-1]
    packed = words.contiguous().view(torch.uint8)  # [..., 2048]
    slots = torch.stack([(packed >> (2 * f)) & 3 for f in range(4)], dim=-1).reshape(*lead, PAGE_TOKENS * HEAD_DIM)
    return slots[..., _index_on("slot", kind, words.device, order)].reshape(*lead, PAGE_TOKENS, HEAD_DIM).long()
