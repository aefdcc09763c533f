"""Split-K paged decode attention over nuq2 pages in fragment order, with a Gluon main kernel.

nuq2 keys are k = mean + scale * z with z = centroid[code] (or an outlier slot's value), per
channel per page; values are v = centroid[code] (or a slot's value). The work splits in two terms:

  main term (the Gluon kernel, every token): per 64-token page, the channel affine is folded into
    q, so the tile is the codebook alone:  q.k = (q * scale) . centroid[code] + q . mean  (the
    second a per-page constant per query head); scores and values straight from 2-bit codes
    dequantized in registers into mma_v2 operand fragments; online softmax; a split's partial
    (o, lse) in base 2, as moekv/ops/decode_attention.py's reduce reads them;
  sparse term (`outlier_corrections`, outside the tile loop): only the tokens that hold an outlier
    slot. With s the main-term score of such a token, s' = s + q[c] * scale[c] * (z_slot - centroid)
    summed over its key slots, and dv its value slots' (value - centroid) at their channels, the
    split's sums change by exactly
        L' = L + sum_t (2^s'_t - 2^s_t),   O' = O + sum_t ((2^s'_t - 2^s_t) v_t + 2^s'_t dv_t)
    (a token whose key is not an outlier has s' = s and only adds its dv).

`nuq2_decode_split_reference` is the oracle of both (plain PyTorch); `nuq2_decode_attention` runs
the Gluon kernel, the sparse term's Triton kernel (nuq2_sparse.py) and the reduce on an NVIDIA GPU
(sm_80+; Gluon has no CPU or interpreter backend). Not yet here: the staged 16-bit tail (the newest page) and
sliding windows.

Shapes: q [B, Hq, D]; block_tables [B, max_pages] int32 (physical page ids); context_lens [B]
(tokens in pages; the last page may be partly valid); G = Hq / Hkv in {1, 2, 4, 8}; partials
part_o [B, Hq, NS, D] (normalised) and part_lse [B, Hq, NS] (log2 of the split's softmax mass in
units of the base-2 scores s * scale * log2(e)); an empty split has o = 0 and lse = -inf.
"""
from __future__ import annotations

import math

import torch

from moekv.kvcache.formats.nuq2 import NO_OUTLIER
from moekv.ops.gluon.checks import LOG2E, check_inputs
from moekv.ops.gluon.nuq2_layout import HEAD_DIM, PAGE_TOKENS, SLOT_OF_ELEMENT, Nuq2FragmentPages, codes_from_fragment


# -- splits -------------------------------------------------------------------------------------------
def split_pages(num_pages: int, num_splits: int, split: int) -> tuple[int, int]:
    """Pages [p0, p1) of a split: the sequence's pages cut into num_splits contiguous shares."""
    per = -(-num_pages // num_splits)
    p0 = min(split * per, num_pages)
    return p0, min(p0 + per, num_pages)


# -- the main term (what the kernel computes) --------------------------------------------------------
def _page_scores_main(q_b: torch.Tensor, frag: Nuq2FragmentPages, pages: torch.Tensor, G: int) -> torch.Tensor:
    """Main-term scores (before the softmax scale) of one sequence's pages: q_b [Hq, D] ->
    [n, Hkv, G, 64] = (q * scale) . centroid[code] + q . mean, in q_b's dtype."""
    codes = codes_from_fragment(frag.k_codes[pages], "key")  # [n, Hkv, P, D]
    n, H = codes.shape[:2]
    c = frag.k_centroids[pages].to(q_b.dtype).reshape(n * H, 4)
    z = c.gather(1, codes.reshape(n * H, -1)).reshape(n, H, PAGE_TOKENS, HEAD_DIM)
    qg = q_b.reshape(H, G, HEAD_DIM)
    q_scaled = qg[None] * frag.k_scale[pages].to(q_b.dtype)[:, :, None, :]  # [n, H, G, D]
    bias = torch.einsum("hgd,nhd->nhg", qg, frag.k_mean[pages].to(q_b.dtype))
    return torch.einsum("nhgd,nhtd->nhgt", q_scaled, z) + bias[..., None]


def _page_values_main(frag: Nuq2FragmentPages, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Main-term values [n, Hkv, 64, D]: centroid[code]."""
    codes = codes_from_fragment(frag.v_codes[pages], "value")
    n, H = codes.shape[:2]
    c = frag.v_centroids[pages].to(dtype).reshape(n * H, 4)
    return c.gather(1, codes.reshape(n * H, -1)).reshape(n, H, PAGE_TOKENS, HEAD_DIM)


def main_term_reference(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (outlier slots left out), computed in q's dtype (float64 in tests)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits)
    Hq = q.shape[1]
    part_o = torch.zeros(B, Hq, num_splits, HEAD_DIM, dtype=q.dtype, device=q.device)
    part_lse = torch.full((B, Hq, num_splits), -math.inf, dtype=q.dtype, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        num_pages = -(-length // PAGE_TOKENS)
        pages = block_tables[b, :num_pages].long()
        s = _page_scores_main(q[b], frag, pages, G) * (scale * LOG2E)  # [n, H, G, P] base 2
        s = s.permute(1, 2, 0, 3).reshape(Hkv, G, num_pages * PAGE_TOKENS)
        s[..., length:] = -math.inf
        v = _page_values_main(frag, pages, q.dtype).permute(1, 0, 2, 3).reshape(Hkv, -1, HEAD_DIM)
        for sp in range(num_splits):
            p0, p1 = split_pages(num_pages, num_splits, sp)
            if p0 == p1:
                continue
            ss = s[..., p0 * PAGE_TOKENS:p1 * PAGE_TOKENS]
            m = ss.amax(-1, keepdim=True)
            p = torch.exp2(ss - m)
            mass = p.sum(-1)
            o = torch.einsum("hgt,htd->hgd", p, v[:, p0 * PAGE_TOKENS:p1 * PAGE_TOKENS]) / mass[..., None]
            part_o[b, :, sp] = o.reshape(Hq, HEAD_DIM)
            part_lse[b, :, sp] = (m[..., 0] + torch.log2(mass)).reshape(Hq)
    return part_o, part_lse


# -- the sparse term ----------------------------------------------------------------------------------
def _slot_codes(words: torch.Tensor, kind: str, element: torch.Tensor) -> torch.Tensor:
    """Codes at element t * D + c of page-heads words [M, 512] (fragment order), element [M, ...] -> same."""
    slot = SLOT_OF_ELEMENT[kind].to(words.device)[element]  # 4 * byte + field
    packed = words.contiguous().view(torch.uint8)  # [M, 2048]
    byte = packed.gather(1, (slot // 4).reshape(slot.shape[0], -1)).reshape(slot.shape).long()
    return (byte >> (2 * (slot % 4))) & 3


def _used_slots(frag: Nuq2FragmentPages, name: str, pages: torch.Tensor, length: int):
    """The used outlier slots of a sequence's pages [n] within its `length` tokens:
    (page j, head h, token t, channel c, z_slot - centroid[code]) as 1-D tensors."""
    idx = getattr(frag, f"{name}_out_idx")[pages].long()  # [n, H, S]
    n, H, S = idx.shape
    j = torch.arange(n, device=idx.device)[:, None, None].expand(n, H, S)
    used = (idx != NO_OUTLIER) & (j * PAGE_TOKENS + idx // HEAD_DIM < length)
    c_tab = getattr(frag, f"{name}_centroids")[pages].float()  # [n, H, 4]
    unit = c_tab.abs().amax(-1, keepdim=True).clamp(min=1e-6)  # nuq2.centroid_unit
    z_slot = getattr(frag, f"{name}_out_val")[pages].float() * unit
    words = getattr(frag, f"{name}_codes")[pages].reshape(n * H, -1)
    positions = idx.clamp(max=PAGE_TOKENS * HEAD_DIM - 1).reshape(n * H, S)
    codes = _slot_codes(words, "key" if name == "k" else "value", positions)
    delta = z_slot - c_tab.gather(2, codes.reshape(n, H, S))
    h = torch.arange(H, device=idx.device)[None, :, None].expand(n, H, S)
    return j[used], h[used], idx[used] // HEAD_DIM, idx[used] % HEAD_DIM, delta[used]


def outlier_corrections(part_o: torch.Tensor, part_lse: torch.Tensor, q: torch.Tensor, frag: Nuq2FragmentPages,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> None:
    """Add the outlier slots' sparse term to main-term partials, in place (see the module
    docstring). Works in part_o's dtype on any device; its cost follows the used slots, not the
    context. The main-term scores of the slot tokens are recomputed here from their code rows."""
    _, Hkv, G = check_inputs(q, frag, block_tables, context_lens, part_o.shape[2])
    num_splits = part_o.shape[2]
    dt = part_o.dtype
    qk2 = scale * LOG2E
    for b, length in enumerate(context_lens.tolist()):
        num_pages = -(-length // PAGE_TOKENS)
        pages = block_tables[b, :num_pages].long()
        kj, kh, kt, kc, kd = _used_slots(frag, "k", pages, length)
        vj, vh, vt, vc, vd = _used_slots(frag, "v", pages, length)
        if not len(kj) and not len(vj):
            continue
        key_of = lambda j, h, t: (j * Hkv + h) * PAGE_TOKENS + t  # noqa: E731
        tokens, inverse = torch.unique(torch.cat([key_of(kj, kh, kt), key_of(vj, vh, vt)]), return_inverse=True)
        ki, vi = inverse[:len(kj)], inverse[len(kj):]
        U = len(tokens)
        tj, th, tt = tokens // (Hkv * PAGE_TOKENS), (tokens // PAGE_TOKENS) % Hkv, tokens % PAGE_TOKENS
        qg = q[b].to(dt).reshape(Hkv, G, HEAD_DIM)
        # main-term scores of the slot tokens, from their key code rows
        rows = tt[:, None] * HEAD_DIM + torch.arange(HEAD_DIM, device=q.device)[None, :]  # [U, D] elements
        page_head = pages[tj] * Hkv + th
        k_words = frag.k_codes.reshape(-1, frag.k_codes.shape[-1])[page_head]
        zk = frag.k_centroids.reshape(-1, 4)[page_head].to(dt).gather(1, _slot_codes(k_words, "key", rows))
        k_scale = frag.k_scale.reshape(-1, HEAD_DIM)[page_head].to(dt)
        k_row = zk * k_scale + frag.k_mean.reshape(-1, HEAD_DIM)[page_head].to(dt)
        s = torch.einsum("ugd,ud->ug", qg[th], k_row) * qk2  # [U, G]
        # the key slots' change of score: q[c] * scale[c] * (z_slot - centroid)
        k_scale_at = frag.k_scale[pages[kj], kh, kc].to(dt)
        ds = torch.zeros(U, G, dtype=dt, device=q.device)
        ds.index_add_(0, ki, qg[kh, :, kc] * (k_scale_at * kd.to(dt))[:, None] * qk2)
        s_new = s + ds
        # main-term value rows of the tokens whose score changed; the value slots' change at their channels
        v_words = frag.v_codes.reshape(-1, frag.v_codes.shape[-1])[page_head]
        v_row = frag.v_centroids.reshape(-1, 4)[page_head].to(dt).gather(1, _slot_codes(v_words, "value", rows))
        dv = torch.zeros(U, HEAD_DIM, dtype=dt, device=q.device)
        dv.index_put_((vi, vc), vd.to(dt), accumulate=True)
        # per split, rescaled to m' = max(lse, the split's new scores) so that no power overflows
        split = tj // -(-num_pages // num_splits)  # split_pages' shares
        lse = part_lse[b].reshape(Hkv, G, num_splits)
        m = lse.clone()  # [H, G, NS]
        flat = ((th * G)[:, None] + torch.arange(G, device=q.device)[None]) * num_splits + split[:, None]  # [U, G]
        m.view(-1).scatter_reduce_(0, flat.reshape(-1), s_new.reshape(-1), reduce="amax")
        m_u = m.view(-1)[flat]  # [U, G]
        a = torch.exp2(s_new - m_u)
        w = a - torch.exp2(s - m_u)
        mass_old = torch.exp2(lse - m)  # [H, G, NS] (0 for an empty split: lse = -inf)
        mass = mass_old.clone()
        mass.view(-1).index_add_(0, flat.reshape(-1), w.reshape(-1))
        o = part_o[b].reshape(Hkv, G, num_splits, HEAD_DIM) * mass_old[..., None]
        contrib = w[..., None] * v_row[:, None, :] + a[..., None] * dv[:, None, :]  # [U, G, D]
        o.view(-1, HEAD_DIM).index_add_(0, flat.reshape(-1), contrib.reshape(-1, HEAD_DIM))
        touched = torch.zeros_like(mass, dtype=torch.bool)
        touched.view(-1)[flat.reshape(-1)] = True
        new_o = o / mass[..., None]
        new_lse = m + torch.log2(mass)
        part_o[b] = torch.where(touched[..., None], new_o, part_o[b].reshape(Hkv, G, num_splits, HEAD_DIM)
                                ).reshape(part_o[b].shape)
        part_lse[b] = torch.where(touched, new_lse, lse).reshape(part_lse[b].shape)


def reduce_partials(part_o: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Merge the splits: [B, Hq, NS, D], [B, Hq, NS] -> [B, Hq, D] (what decode_attention's reduce computes)."""
    w = torch.exp2(part_lse - part_lse.amax(-1, keepdim=True))
    return (w[..., None] * part_o).sum(2) / w.sum(-1)[..., None]


def nuq2_decode_split_reference(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, num_splits: int,
                                outliers: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of the Gluon path, split by split: main term (fold of the keys' channel affine into
    q, codebook tiles), then the outlier slots' sparse term. Computed in q's dtype."""
    part_o, part_lse = main_term_reference(q, frag, block_tables, context_lens, scale, num_splits)
    if outliers:
        outlier_corrections(part_o, part_lse, q, frag, block_tables, context_lens, scale)
    return part_o, part_lse


# -- the GPU path ------------------------------------------------------------------------------------
TARGET_PROGRAMS = 4096  # one-warp programs per launch the default split count aims at (~3 waves on an H200)


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int) -> int:
    """Splits per (sequence, KV head): about TARGET_PROGRAMS programs, each with at least 2 pages."""
    want = -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    return max(1, min(want, -(-max_pages // 2), 1024))


def nuq2_decode_partials(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                         max_registers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's main-term partials (part_o, part_lse), fp32 (CUDA only). max_registers:
    ptxas's cap (None: its choice, ~140 a thread; 128 spills 8 bytes for one more program per SM)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits or 1)
    if not q.is_cuda:
        raise ValueError("nuq2 Gluon decode runs on CUDA devices only (Gluon has no CPU or interpreter backend); "
                         "nuq2_decode_split_reference computes the same on any device")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"nuq2 Gluon decode: q must be fp16 or bf16, got {q.dtype}")
    try:
        from moekv.ops.gluon.nuq2_kernel import nuq2_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise RuntimeError(f"nuq2 Gluon decode needs triton.experimental.gluon (Triton >= 3.6): {e}") from e
    num_splits = num_splits or default_num_splits(B, Hkv, block_tables.shape[1])
    Hq = q.shape[1]
    part_o = torch.empty(B, Hq, num_splits, HEAD_DIM, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    nuq2_decode_kernel[(B * Hkv, num_splits)](
        frag.k_codes, frag.v_codes, frag.k_centroids.view(torch.int32), frag.v_centroids.view(torch.int32),
        frag.k_mean, frag.k_scale, q.contiguous(), block_tables, block_tables.stride(0), context_lens,
        part_o, part_lse, scale * LOG2E, 0, num_splits, HKV=Hkv, G=G, num_warps=1,
        **({"maxnreg": int(max_registers)} if max_registers else {}))
    return part_o, part_lse


def reduce_on_device(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The paged decode kernel's reduce (the partials have its layout) into out [B, Hq, D]."""
    from moekv.ops.decode.paged import reduce_partials

    reduce_partials(part_o, part_lse, out, part_o.shape[2], pdl=False)
    return out


def nuq2_decode_attention(q: torch.Tensor, frag: Nuq2FragmentPages, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                          outliers: bool = True, sparse_kernel: bool = True,
                          max_registers: int | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over nuq2 pages in fragment order -> [B, Hq, 128] in q's
    dtype: the Gluon main term, the outlier slots' sparse term (outliers=False leaves it out: exact
    only for pages without used slots), the reduce; three launches, no host sync. CUDA only. The
    sparse term's kernel visits only the slot tokens (nuq2_sparse.py) but still recomputes their
    scores and value rows from codes, so it costs a multiple of the main term (docs/journal.md).
    sparse_kernel=False: the sparse term in PyTorch (outlier_corrections: a host sync per sequence)."""
    part_o, part_lse = nuq2_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers)
    has_both_slot_kinds = frag.k_out_idx.shape[2] > 0 and frag.v_out_idx.shape[2] > 0
    if outliers and sparse_kernel and has_both_slot_kinds:
        from moekv.ops.gluon.nuq2_sparse import outlier_corrections_kernel

        outlier_corrections_kernel(part_o, part_lse, q, frag, block_tables, context_lens, scale)
    elif outliers:  # the PyTorch term also serves layouts without key or without value slots
        outlier_corrections(part_o, part_lse, q, frag, block_tables, context_lens, scale)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q))
