"""Split-K paged decode attention over vq pages in fragment order, with a Gluon kernel.

vq stores keys k[t, c] = u[t, c] * tok_scale[t] * chan_scale[c] + mean[c] and values v[t, c] = u[t, c]
* tok_scale[t], u the codewords (rows of 256-entry codebooks of 8 channels, per layer, kv head and
channel group) of a token's 16 codes (moekv/kvcache/formats/vq.py). Per 64-token page the Gluon
kernel (vq_kernel.py) computes, exactly as this module's reference does:

  scores   s[t] = tok_scale_k[t] * (u_k[t] . (q * chan_scale)) + q . mean     (the channel affine in q)
  values   O += sum_t (p[t] * tok_scale_v[t]) u_v[t]                           (the token scale into P)

with the codewords read straight from the codebooks into the MMA fragments. The fp16 roundings are
those of q itself, of q * chan_scale and of p * tok_scale (`kernel_roundings=True` emulates them);
the products are summed in fp32. Online softmax in base 2; each split writes its partial (o, lse) as
moekv/ops/decode/paged.py's reduce reads them. The staged 16-bit tail (the newest page, tokens from
((len - 1) // 64) * 64 on) is one more split of the same launch, and sliding windows skip the pages
before the window and mask inside the first one, as nuq2's Gluon kernel does. With a residual window
(`residual`: the format's ring of the newest R tokens) the tail reads them from the ring, in one or
several splits each reading a contiguous share (launch.plan_splits), and the pages end where it begins
(tokens [0, min(((len - 1) // 64) * 64, max(len - R, 0))), as kivi2's).

Shapes: q [B, Hq, 128]; block_tables [B, max_pages] int32; context_lens [B]; G = Hq / Hkv in {1, 2, 4,
8}; staged = (k_stage, v_stage, seq_slots) [S, Hkv, 64, 128] 16-bit and [B]; residual = (k_ring,
v_ring) [S, Hkv, R, 128] 16-bit at the same slots (needs staged).
"""
from __future__ import annotations

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.decode.launch import sm_count
from moekv.ops.gluon.checks import Residual, Staged, check_extras, check_inputs, check_residual, check_tail_splits
from moekv.ops.gluon.launch import (
    MAX_SPLITS,
    check_launch,
    default_num_splits,
    default_tail_splits,
    fills_wave,
    gluon_missing,
    plan_launch,
    programs_per_sm,
    reduce_on_device,
    register_cap,
    ring_args,
)
from moekv.ops.gluon.splits import split_reference
from moekv.ops.gluon.vq_layout import CODEWORDS, GROUPS, SUB, VQFragmentPages, codewords, mean_by_channel

# ptxas's register cap: 128 (16 one-warp programs an SM, ~150 spill instructions in the page loop, to L1)
# against 185 registers uncapped: the codeword gathers are latency-bound and more programs hide more of it
# (docs/decisions.md, "vq: codebooks in shared memory, e4m3 codewords, CTAs of 4 warps")
DEFAULT_MAX_REGISTERS = 128
# the shared-codebook kernel's CTAs: 4 warps at a 168-register cap, three CTAs an SM (what shared memory
# holds: 64 kB of codebooks each), against 8 warps at 128 (two an SM) and 16 warps at 128 (one): the
# fastest or near it at most shapes (docs/performance.md, vq's launch study)
DEFAULT_WARPS = 4
SHARED_MAX_REGISTERS = 168
KERNEL_DEFAULT = -1  # max_registers: the chosen kernel's default cap
SHARED_MEMORY_PER_SM = 228 * 1024  # sm_90 (H100, H200); sm_80's is 164 kB
CODEBOOK_BYTES = 2 * GROUPS * CODEWORDS * SUB  # a head's key and value codebooks, e4m3: 64 kB
CTA_SHARED_BYTES = CODEBOOK_BYTES + 1024  # and the 1 kB the driver reserves a CTA
# where the kernel reads the codebooks: 'global' (vq_kernel), 'shared' (vq_smem_kernel, CTAs of
# DEFAULT_WARPS warps sharing a head's codebooks) or None: shared_codebooks_pay's choice. Shared wins where
# a launch fills the GPU or a CTA reads more pages than codebooks, global at batch 1 and short contexts
# (docs/decisions.md, "vq: codebooks in shared memory, e4m3 codewords, CTAs of 4 warps").
DEFAULT_CODEBOOKS = None


def _f16(x: torch.Tensor, on: bool) -> torch.Tensor:
    """x rounded to fp16 and back (the kernel's operand roundings) when `on`."""
    return x.to(torch.float16).to(x.dtype) if on else x


def _page_scores(qg: torch.Tensor, frag: VQFragmentPages, pages: torch.Tensor, rnd: bool) -> torch.Tensor:
    """qg [H, G, D] -> scores [n, H, G, 64] by the kernel's algebra, in qg's dtype."""
    dt = qg.dtype
    u = codewords(frag, "key", pages).to(dt)  # [n, H, P, D]
    q16 = _f16(qg, rnd)
    q_cs = _f16(q16 * frag.k_chan_scale.to(dt)[:, None, :], rnd)  # [H, G, D]
    ts = frag.k_tok_scale[pages].to(dt)  # [n, H, P]
    bias = torch.einsum("nhd,hgd->nhg", mean_by_channel(frag.k_mean[pages]).to(dt), q16)
    return torch.einsum("nhtd,hgd->nhgt", u, q_cs) * ts[:, :, None, :] + bias[..., None]


def _page_values(p: torch.Tensor, frag: VQFragmentPages, pages: torch.Tensor, rnd: bool) -> torch.Tensor:
    """p [n, H, G, 64] (softmax numerators, 0 at masked tokens) -> sum over the pages of (p * tok_scale)
    @ u_v: [H, G, D]."""
    u = codewords(frag, "value", pages).to(p.dtype)  # [n, H, P, D]
    ts = frag.v_tok_scale[pages].to(p.dtype)[:, :, None, :]  # [n, H, 1, P]
    p_scaled = _f16(p * torch.where(p > 0, ts, 0), rnd)
    return torch.einsum("nhgt,nhtd->hgd", p_scaled, u)


def vq_decode_split_reference(q: torch.Tensor, frag: VQFragmentPages, block_tables: torch.Tensor,
                              context_lens: torch.Tensor, scale: float, num_splits: int,
                              staged: Staged | None = None, sliding_window: int | None = None,
                              kernel_roundings: bool = False, residual: Residual | None = None,
                              tail_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (o normalised, lse in base 2), split by split, in q's dtype; with
    `staged`, splits num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (and `residual`'s
    ring), each its share. kernel_roundings: round the operands as the kernel does (fp16 q, q * chan_scale
    and p * tok_scale)."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits, "vq")
    check_extras(staged, sliding_window, B, Hkv)
    check_tail_splits(tail_splits, check_residual(residual, staged, Hkv, "vq"))
    return split_reference(q, Hkv, block_tables, context_lens, scale, num_splits, staged, sliding_window,
                           lambda qg, pages: _page_scores(qg, frag, pages, kernel_roundings),
                           lambda p, pages: _page_values(p, frag, pages, kernel_roundings), residual, tail_splits)


# -- the GPU path ------------------------------------------------------------------------------------
def shared_ctas_per_sm(warps: int, max_registers: int | None) -> int:
    """CTAs of the shared-codebook kernel an sm_90 SM holds: by shared memory (64 kB of codebooks each)
    and by registers at the cap."""
    return max(1, min(SHARED_MEMORY_PER_SM // CTA_SHARED_BYTES, programs_per_sm(max_registers) // warps))


def shared_splits(B: int, Hkv: int, max_pages: int, staged: bool, device, warps: int, ctas_per_sm: int) -> int:
    """The split count of the shared-codebook kernel: default_num_splits over a wave of its CTAs
    (ctas_per_sm an SM), in whole CTAs: rounded up, or down where rounding up would pass MAX_SPLITS
    with the tail's split or start a second wave for a few CTAs (at (1, 128k) on an H100 with one CTA
    an SM: 136 CTAs of 8 splits against the 132 SMs)."""
    wave = sm_count(device) * ctas_per_sm
    splits = default_num_splits(B, Hkv, max_pages, int(staged), wave * warps)
    rows = max(1, B * Hkv)
    ctas = -(-splits // warps)
    if ctas > 1 and (ctas * warps + int(staged) > MAX_SPLITS or rows * ctas > wave >= rows * (ctas - 1)):
        ctas -= 1
    return ctas * warps


def shared_codebooks_pay(B: int, Hkv: int, max_pages: int, staged: bool, device, warps: int = DEFAULT_WARPS,
                         max_registers: int | None = SHARED_MAX_REGISTERS, splits: int | None = None) -> bool:
    """Whether the shared-codebook kernel is the default: where the one-warp kernel's launch (its split
    count at DEFAULT_MAX_REGISTERS) would fill a wave of the device (launch.fills_wave: the CTAs'
    codebook copies then overlap other CTAs' pages), or where a CTA's splits read at least as many page
    bytes as the codebooks it copies (at (1, 128k) 11 pages a split; at (1, 4k) two, 19 kB of pages a CTA
    against its 64 kB copy, where the one-warp kernel is faster). splits: the shared kernel's split
    count if the caller has it (shared_splits)."""
    wave = sm_count(device) * programs_per_sm(DEFAULT_MAX_REGISTERS)
    if fills_wave(B * Hkv, default_num_splits(B, Hkv, max_pages, int(staged), wave) + int(staged), wave):
        return True
    if splits is None:
        splits = shared_splits(B, Hkv, max_pages, staged, device, warps, shared_ctas_per_sm(warps, max_registers))
    return warps * -(-max_pages // splits) * VQFragmentPages.kernel_bytes_per_page_head() >= CODEBOOK_BYTES


def vq_decode_partials(q: torch.Tensor, frag: VQFragmentPages, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                       max_registers: int | None = KERNEL_DEFAULT, staged: Staged | None = None,
                       sliding_window: int | None = None, codebooks: str | None = DEFAULT_CODEBOOKS,
                       warps: int = DEFAULT_WARPS, residual: Residual | None = None,
                       tail_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernels' partials (part_o, part_lse), fp32 (CUDA only); with `staged`, splits
    num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (and `residual`'s ring), each a share
    of it (tail_splits: None for launch.plan_splits' rule, or with shared codebooks
    launch.default_tail_splits in the tail's own launch; more than 1 needs the ring). max_registers:
    ptxas's cap for the pages' kernel (None: its choice; KERNEL_DEFAULT: DEFAULT_MAX_REGISTERS or
    SHARED_MAX_REGISTERS). codebooks: 'global' (vq_kernel: one-warp programs gathering codewords through
    L1/L2) or 'shared' (vq_smem_kernel: CTAs of `warps` warps sharing the head's codebooks in shared
    memory, the tail's splits by vq_kernel in a second launch); None: shared where shared_codebooks_pay."""
    B, Hkv, G = check_launch("vq", q, frag, block_tables, context_lens, num_splits, staged, sliding_window)
    R = check_residual(residual, staged, Hkv, "vq")
    shared_cap = SHARED_MAX_REGISTERS if max_registers == KERNEL_DEFAULT else max_registers
    shared_ns = num_splits
    if codebooks != "global" and num_splits is None:  # the shared kernel's split count, also what its choice weighs
        shared_ns = shared_splits(B, Hkv, block_tables.shape[1], staged is not None, q.device, warps,
                                  shared_ctas_per_sm(warps, shared_cap))
    if codebooks is None:
        codebooks = "shared" if shared_codebooks_pay(B, Hkv, block_tables.shape[1], staged is not None, q.device,
                                                     warps, shared_cap, shared_ns) else "global"
    if codebooks not in ("global", "shared"):
        raise ValueError(f"vq Gluon decode: codebooks={codebooks!r}, expected 'global', 'shared' or None")
    try:
        from moekv.ops.gluon.vq_kernel import vq_decode_kernel
        from moekv.ops.gluon.vq_smem_kernel import vq_smem_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("vq", e) from e
    shared = codebooks == "shared"
    if max_registers == KERNEL_DEFAULT:
        max_registers = SHARED_MAX_REGISTERS if shared else DEFAULT_MAX_REGISTERS
    if shared:
        num_splits = shared_ns
        if tail_splits is None and staged is not None:  # the tail's own launch: room in a wave of its programs
            tail_wave = sm_count(q.device) * programs_per_sm(DEFAULT_MAX_REGISTERS)
            tail_splits = default_tail_splits(B * Hkv, 0, R, tail_wave)
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers, R,
                      tail_splits)
    k_ring, v_ring, ring_strides = ring_args(run, residual)
    tables = (frag.k_codes, frag.v_codes, frag.k_tok_scale, frag.v_tok_scale, frag.k_mean, frag.k_codebook,
              frag.k_chan_scale, frag.v_codebook, q.contiguous(), block_tables, block_tables.stride(0), context_lens)
    if shared:
        vq_smem_decode_kernel[(B * Hkv, -(-run.num_splits // warps))](
            *tables, run.part_o, run.part_lse, scale * LOG2E, run.window, run.num_splits, run.ns_total, R,
            HKV=Hkv, G=G, W=warps, STAGED=staged is not None, RING=R > 0, num_warps=warps,
            **register_cap(max_registers))
    if not shared or staged is not None:  # the one-warp kernel: every split, or the tail's splits alone
        grid = (B * Hkv, run.tail_splits) if shared else run.grid
        vq_decode_kernel[grid](
            *tables, run.seq_slots, run.k_stage, run.v_stage, *run.stage_strides, k_ring, v_ring, *ring_strides, R,
            run.part_o, run.part_lse, scale * LOG2E, run.window, run.num_splits, run.ns_total,
            run.num_splits if shared else 0, HKV=Hkv, G=G, STAGED=staged is not None, RING=R > 0, num_warps=1,
            **register_cap(DEFAULT_MAX_REGISTERS if shared else max_registers))
    return run.part_o, run.part_lse


def vq_decode_attention(q: torch.Tensor, frag: VQFragmentPages, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                        max_registers: int | None = KERNEL_DEFAULT, staged: Staged | None = None,
                        sliding_window: int | None = None, out: torch.Tensor | None = None,
                        codebooks: str | None = DEFAULT_CODEBOOKS, warps: int = DEFAULT_WARPS,
                        residual: Residual | None = None, sinks: torch.Tensor | None = None,
                        tail_splits: int | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over vq pages in fragment order (and, with `staged`, the 16-bit
    tail and `residual`'s ring, in tail_splits programs) -> [B, Hq, 128] in q's dtype: the Gluon kernel(s)
    and the reduce, no host sync. CUDA only. sinks [Hq]: each head's sink logit, joining the reduce."""
    part_o, part_lse = vq_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers,
                                          staged, sliding_window, codebooks, warps, residual, tail_splits)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q) if out is None else out, sinks)
