"""The outlier slots' sparse term of nuq2 decode as one Triton kernel (plain Triton, so it also runs
under TRITON_INTERPRET=1): what `nuq2_decode.outlier_corrections` computes, without a host sync.

Its cost follows the slot tokens, not the page: the layout keeps, per page-head, the distinct
tokens that hold a used outlier slot (`Nuq2FragmentPages.slot_tokens`, ascending, with a count),
and the number of used slots (`k_used`, `v_used`; the used slots come first in the out tables), so a
program reads the counts, a short token list and only the used slots (16 a chunk), then only those
tokens' code rows (32 bytes each, one byte gather per (token, 4 channels)).

Program (b * Hkv + h, split), after the Gluon main kernel, over its split's pages; per page, the
slot tokens R = 16 at a time (one tile for the usual ~10 key + ~5 value slots):
    s   = ((q * scale) . z_t + q . mean) * qk2          main-term score, recomputed from the key codes
    s'  = s + sum_{key slots of t} q[c] * scale[c] * (z_slot - centroid) * qk2
    L  += 2^(s' - m) - 2^(s - m)
    O  += (2^(s' - m) - 2^(s - m)) v_t + 2^(s' - m) dv_t
(v_t the value code row, dv_t the value slots' change at their channels; m an online max that
starts at the split's lse), then rescales the split's partial (o, lse) in place. The products are
tl.dot in fp32 with three-pass TF32 (input_precision "tf32x3": tensor cores, ~fp32 accuracy), so
the head group is padded to 16 (the smallest dot).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.kvcache.formats.nuq2 import NO_OUTLIER
from moekv.ops.gluon.checks import LOG2E, check_inputs
from moekv.ops.gluon.nuq2_layout import HEAD_DIM, PAGE_BYTES, PAGE_TOKENS, Nuq2FragmentPages

ROWS = 16  # slot tokens per step (the smallest tl.dot)


@triton.jit
def key_code_position(t, c):
    """(byte, field) of key element (token t, channel c) of a page-head in fragment order (nuq2_layout.py)."""
    byte = ((t // 16) * 512 + (t % 8) * 64 + ((c // 2) % 4) * 16 + ((c // 16) % 2) * 8 + ((c // 8) % 2) * 4
            + ((t // 8) % 2) * 2 + c % 2)
    return byte, (c // 64) * 2 + (c // 32) % 2


@triton.jit
def value_code_position(t, c):
    """(byte, field) of value element (token t, channel c) of a page-head in fragment order."""
    byte = ((2 * (t // 32) + (c // 16) % 2) * 512 + (c % 8) * 64 + ((t // 2) % 4) * 16 + ((t // 16) % 2) * 8
            + ((t // 8) % 2) * 4 + ((c // 8) % 2) * 2 + t % 2)
    return byte, (c // 64) * 2 + (c // 32) % 2


@triton.jit
def _code_at(codes, base, byte, field):
    return (tl.load(codes + base + byte).to(tl.int32) >> (2 * field)) & 3


@triton.jit
def _centroid(code, c0, c1, c2, c3):
    return tl.where(code == 0, c0, tl.where(code == 1, c1, tl.where(code == 2, c2, c3)))


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _slot_deltas(oidx, oval, ph, j, n_used, n_valid, S: tl.constexpr, codes, c0, c1, c2, c3, unit,
                 KEY: tl.constexpr, NO: tl.constexpr):
    """Slots j (a chunk) of page-head ph: (token, channel, used, exact value - centroid of its code)."""
    idx = tl.load(oidx + ph * S + j, mask=j < n_used, other=NO)
    used = (idx != NO) & (idx // 128 < n_valid)
    t = tl.where(used, idx // 128, 0)
    c = tl.where(used, idx % 128, 0)
    if KEY:
        byte, field = key_code_position(t, c)
    else:
        byte, field = value_code_position(t, c)
    code = _code_at(codes, ph * 2048, byte, field)
    z = tl.load(oval + ph * S + j, mask=used, other=0.0).to(tl.float32) * unit
    return tl.where(used, idx // 128, -1), c, used, tl.where(used, z - _centroid(code, c0, c1, c2, c3), 0.0)


@triton.jit
def nuq2_sparse_term_kernel(q_ptr, k_codes, v_codes, k_cent, v_cent, k_mean, k_scale, k_oval, k_oidx, v_oval, v_oidx,
                            slot_tokens, slot_counts, k_used, v_used, block_tables, stride_bt, context_lens, part_o,
                            part_lse, qk2, num_splits, HKV: tl.constexpr, G: tl.constexpr, SK: tl.constexpr,
                            SV: tl.constexpr, SK_PAD: tl.constexpr, SV_PAD: tl.constexpr, ST: tl.constexpr,
                            ST_PAD: tl.constexpr, NO: tl.constexpr):
    D: tl.constexpr = 128
    P: tl.constexpr = 64
    GP: tl.constexpr = 16
    R: tl.constexpr = 16  # slot tokens a tile
    C: tl.constexpr = 16  # used slots a chunk (the slot tables hold the used ones first)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    length = tl.load(context_lens + b)
    num_pages = tl.cdiv(length, P)
    per = tl.cdiv(num_pages, num_splits)
    p0 = tl.minimum(split * per, num_pages)
    p1 = tl.minimum(p0 + per, num_pages)
    if p0 < p1:
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        rr = tl.arange(0, R)
        jc = tl.arange(0, C)
        cl = tl.arange(0, 32)  # a code byte's channel c % 32; its four fields are c // 32
        f4 = tl.arange(0, 4)
        head = b.to(tl.int64) * (HKV * G) + h * G + g  # [GP]
        q = tl.load(q_ptr + head[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32)
        row = head * num_splits + split
        lse = tl.load(part_lse + row, mask=g < G, other=0.0)
        m = lse
        l_add = tl.zeros([GP], tl.float32)
        o_add = tl.zeros([GP, D], tl.float32)
        bt_row = block_tables + b.to(tl.int64) * stride_bt
        for pg in range(p0, p1):
            ph = tl.load(bt_row + pg).to(tl.int64) * HKV + h
            count = tl.load(slot_counts + ph)
            if count > 0:
                n_valid = length - pg * P
                nk = tl.load(k_used + ph)
                nv = tl.load(v_used + ph)
                kc0 = tl.load(k_cent + ph * 4).to(tl.float32)
                kc1 = tl.load(k_cent + ph * 4 + 1).to(tl.float32)
                kc2 = tl.load(k_cent + ph * 4 + 2).to(tl.float32)
                kc3 = tl.load(k_cent + ph * 4 + 3).to(tl.float32)
                vc0 = tl.load(v_cent + ph * 4).to(tl.float32)
                vc1 = tl.load(v_cent + ph * 4 + 1).to(tl.float32)
                vc2 = tl.load(v_cent + ph * 4 + 2).to(tl.float32)
                vc3 = tl.load(v_cent + ph * 4 + 3).to(tl.float32)
                k_unit = tl.maximum(tl.maximum(tl.abs(kc0), tl.abs(kc1)), tl.maximum(tl.abs(kc2), tl.abs(kc3)))
                v_unit = tl.maximum(tl.maximum(tl.abs(vc0), tl.abs(vc1)), tl.maximum(tl.abs(vc2), tl.abs(vc3)))
                k_unit = tl.maximum(k_unit, 1e-6)
                v_unit = tl.maximum(v_unit, 1e-6)
                sc = tl.load(k_scale + ph * D + d).to(tl.float32)
                mn = tl.load(k_mean + ph * D + d).to(tl.float32)
                q_scaled = q * sc[None, :]  # [GP, D]
                bias = tl.sum(q * mn[None, :], axis=1)  # [GP]
                for r0 in range(0, ST_PAD, R):  # bounded by constants: the interpreter's range wants plain ints
                    if r0 < count:
                        t_r = tl.load(slot_tokens + ph * ST + r0 + rr, mask=r0 + rr < count, other=P)  # [R]
                        r_ok = t_r < n_valid  # padding (P) and tokens past the context drop out
                        t_safe = tl.where(r_ok, t_r, 0)
                        # the tokens' code rows: 32 bytes each, field f of byte (t, c % 32) is channel 32 f + c % 32
                        kb_r, kf_r = key_code_position(t_safe[:, None], cl[None, :])
                        k_bytes = tl.load(k_codes + ph * 2048 + kb_r).to(tl.int32)  # [R, 32]
                        k_row = tl.reshape((k_bytes[:, None, :] >> (2 * f4)[None, :, None]) & 3, [R, D])
                        zk = _centroid(k_row, kc0, kc1, kc2, kc3)  # [R, D]
                        s_main = (_dot(zk, tl.trans(q_scaled)) + bias[None, :]) * qk2  # [R, GP]
                        # key slots' score change: q[g, c] * scale[c] * dz * qk2, summed per token
                        s_new = s_main
                        for j0 in range(0, SK_PAD, C):
                            if j0 < nk:
                                kt, kc, kok, dk = _slot_deltas(k_oidx, k_oval, ph, j0 + jc, nk, n_valid, SK, k_codes,
                                                               kc0, kc1, kc2, kc3, k_unit, True, NO)
                                q_at = tl.load(q_ptr + head[None, :] * D + kc[:, None],
                                               mask=(g < G)[None, :] & kok[:, None], other=0.0).to(tl.float32)
                                w_k = q_at * (tl.load(k_scale + ph * D + kc).to(tl.float32) * dk * qk2)[:, None]
                                hit_k = (kt[None, :] == t_r[:, None]).to(tl.float32)  # [R, C]
                                s_new += _dot(hit_k, w_k)
                        vb_r, vf_r = value_code_position(t_safe[:, None], cl[None, :])
                        v_bytes = tl.load(v_codes + ph * 2048 + vb_r).to(tl.int32)
                        v_row = _centroid(tl.reshape((v_bytes[:, None, :] >> (2 * f4)[None, :, None]) & 3, [R, D]),
                                          vc0, vc1, vc2, vc3)  # [R, D]
                        m_new = tl.maximum(m, tl.max(tl.where(r_ok[:, None], s_new, float("-inf")), axis=0))
                        alpha = tl.exp2(m - m_new)
                        l_add = l_add * alpha
                        o_add = o_add * alpha[:, None]
                        m = m_new
                        a = tl.where(r_ok[:, None], tl.exp2(s_new - m[None, :]), 0.0)  # [R, GP]
                        w = a - tl.where(r_ok[:, None], tl.exp2(s_main - m[None, :]), 0.0)
                        l_add += tl.sum(w, axis=0)
                        o_add += _dot(tl.trans(w), v_row)
                        # value slots' change at their channels, weighted by their token's new weight
                        for j0 in range(0, SV_PAD, C):
                            if j0 < nv:
                                vt, vc, vok, dv = _slot_deltas(v_oidx, v_oval, ph, j0 + jc, nv, n_valid, SV, v_codes,
                                                               vc0, vc1, vc2, vc3, v_unit, False, NO)
                                e_v = tl.where((vc[:, None] == d[None, :]) & vok[:, None], dv[:, None], 0.0)  # [C, D]
                                hit_v = (vt[None, :] == t_r[:, None]).to(tl.float32)  # [R, C]
                                o_add += _dot(_dot(tl.trans(a), hit_v), e_v)
        mass_old = tl.exp2(lse - m)
        mass = mass_old + l_add
        o_ptr = part_o + row[:, None] * D + d[None, :]
        o = tl.load(o_ptr, mask=(g < G)[:, None], other=0.0)
        tl.store(o_ptr, (o * mass_old[:, None] + o_add) / mass[:, None], mask=(g < G)[:, None])
        tl.store(part_lse + row, m + tl.log2(mass), mask=g < G)


def outlier_corrections_kernel(part_o: torch.Tensor, part_lse: torch.Tensor, q: torch.Tensor, frag: Nuq2FragmentPages,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               num_warps: int = 4) -> None:
    """nuq2_decode.outlier_corrections as one launch (fp32 partials, in place); no host sync.
    num_warps: per program (sm_90 build at nuq2's 80 + 32 slots: 255 registers at 2 and 4 warps with 88
    and 24 bytes of stack, 232 and none at 8)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, part_o.shape[2])
    if part_o.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError(f"nuq2 sparse term kernel: fp32 partials expected, got {part_o.dtype} and {part_lse.dtype}")
    SK, SV = frag.k_out_idx.shape[2], frag.v_out_idx.shape[2]
    if SK == 0 or SV == 0:  # nuq2_decode_attention sends such layouts to the PyTorch term
        raise ValueError(f"nuq2 sparse term kernel: needs key and value slots, the layout has {SK} and {SV}")
    assert PAGE_BYTES == 2048 and PAGE_TOKENS == 64 and HEAD_DIM == 128  # the kernel's constants
    num_splits = part_o.shape[2]
    ST = frag.slot_tokens.shape[2]
    heads = frag.k_out_idx.shape[:2]
    if frag.slot_tokens.shape != (*heads, SK + SV) or frag.slot_counts.shape != heads:
        raise ValueError(f"nuq2 sparse term kernel: slot lists {tuple(frag.slot_tokens.shape)} / "
                         f"{tuple(frag.slot_counts.shape)} do not fit the out_idx tables {tuple(frag.k_out_idx.shape)}")
    if not isinstance(nuq2_sparse_term_kernel, triton.runtime.jit.JITFunction):  # TRITON_INTERPRET=1
        from moekv.ops.decode.interpreter import patch_interpreter_index

        patch_interpreter_index()  # loops bounded by loaded values
    nuq2_sparse_term_kernel[(B * Hkv, num_splits)](
        q.contiguous(), frag.k_codes.view(torch.uint8), frag.v_codes.view(torch.uint8), frag.k_centroids,
        frag.v_centroids, frag.k_mean, frag.k_scale, frag.k_out_val, frag.k_out_idx, frag.v_out_val, frag.v_out_idx,
        frag.slot_tokens, frag.slot_counts, frag.k_used, frag.v_used, block_tables, block_tables.stride(0),
        context_lens, part_o, part_lse, scale * LOG2E, num_splits, HKV=Hkv, G=G, SK=SK, SV=SV,
        SK_PAD=max(16, triton.next_power_of_2(SK)), SV_PAD=max(16, triton.next_power_of_2(SV)), ST=ST,
        ST_PAD=max(16, triton.next_power_of_2(ST)), NO=NO_OUTLIER, num_warps=num_warps)
