"""Plain-PyTorch references for every op: the spec, the test oracle, and the CPU path.

Shape legend: T = tokens in the step, B = sequences, H = hidden size, Hq / Hkv = query / KV heads,
D = head_dim, E = experts, k = experts per token, I = expert intermediate size,
N = pages in the pool, P = tokens per page (block_size).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moekv.ops.quantized_weight import QuantizedWeight


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as Llama-family models do)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual step between sublayers: (x + delta, rms_norm_ref(x + delta)), the sum rounded to
    x's dtype first (as `x = x + f(x)` then a norm computes it)."""
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def rotary_cos_sin_ref(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                       inv_freq: torch.Tensor | None = None, scale: float = 1.0):
    """cos, sin [T, D] for the non-interleaved ("rotate half") RoPE layout. For partial RoPE pass
    the rotary dims R as head_dim: [T, R], frequencies theta^(-2i/R). Scaled RoPE (YaRN): inv_freq
    [D/2] (fp32) replaces those frequencies and cos, sin are multiplied by scale (in fp32, before
    the cast to dtype)."""
    if inv_freq is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R] with R <= D: the first R elements of each head are rotated
    (rotate-half within them), the other D - R pass unchanged (partial RoPE)."""
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return torch.cat((apply_rotary_ref(x[..., :rot_dim], cos, sin), x[..., rot_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_rotate_ref(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """x [T, heads, D] rotated (rotate-half RoPE) by its positions [T], or rotated back (inverse),
    in x's dtype: the angles as rotary_cos_sin_ref computes them (fp32), cos/sin then in x's
    dtype, so the rotation is the model's and the inverse undoes it up to rounding."""
    cos, sin = rotary_cos_sin_ref(positions, x.shape[-1], theta, torch.float32)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return apply_rotary_ref(x, cos, -sin if inverse else sin)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def topk_softmax_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Flat router: softmax over experts in fp32, keep the top k, optionally renormalise.

    router_logits [T, E] -> (weights [T, k] fp32, expert_ids [T, k] int64).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_matrix(w: torch.Tensor | QuantizedWeight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] matrix of a stacked [E, N, K] weight; a quantized one dequantized to dtype."""
    return w[expert].dequantize(dtype) if isinstance(w, QuantizedWeight) else w[expert]


def linear_ref(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None):
    """F.linear; a quantized weight is dequantized to x's dtype first (the weight-only quantized
    matmul's reference: the kernels compute the same products in fp32)."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Experts step: sum_k weight_k * down(silu(gate(x)) * up(x)) for each token's k experts.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I], each a tensor or a
    QuantizedWeight of that shape; topk_weights [T, k]; topk_ids [T, k]. Loops over the experts that
    received tokens.
    """
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        h = silu_and_mul_ref(F.linear(x[token_idx], expert_matrix(w13, expert, x.dtype)))
        y = F.linear(h, expert_matrix(w2, expert, x.dtype)) * topk_weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def clamped_swiglu_moe_ref(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                           b2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts step: sum_k weight_k * (down(h) + b2) with gate, up = w13 x + b13 (halves),
    h = clamped_swiglu_ref(gate, up). x [T, H]; w13 [E, 2I, H] (gate rows then up rows, as
    fused_moe_ref's); b13 [E, 2I]; w2 [E, H, I]; b2 [E, H] (w13, w2 tensors or QuantizedWeights);
    topk_weights, topk_ids [T, k]."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids.reshape(-1)).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], expert_matrix(w13, expert, x.dtype), b13[expert]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu_ref(gate, up, alpha, limit), expert_matrix(w2, expert, x.dtype), b2[expert])
        y = y * topk_weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Row layout of the grouped GEMM: pairs p = t * k + slot grouped by expert (experts in order,
    pairs ascending), each expert's run padded to a multiple of block_m with the sentinel M = T*k.

    topk_ids [T, k] -> sorted_ids [P] int32, block_expert_ids [P / block_m] int32 (-1 past the
    padded end), num_tokens_post_padded [1] int32; P = M + min(E, M) * (block_m - 1) rounded up to
    block_m (a bound known from shapes alone)."""
    flat = topk_ids.reshape(-1).tolist()
    M = len(flat)
    P = -(-(M + min(num_experts, M) * (block_m - 1)) // block_m) * block_m
    sorted_ids, block_expert_ids = [], []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        padded = pairs + [M] * (-len(pairs) % block_m)
        sorted_ids += padded
        block_expert_ids += [expert] * (len(padded) // block_m)
    used = len(sorted_ids)
    sorted_ids += [M] * (P - used)
    block_expert_ids += [-1] * (P // block_m - len(block_expert_ids))
    as_int32 = lambda v: torch.tensor(v, dtype=torch.int32, device=topk_ids.device)  # noqa: E731
    return as_int32(sorted_ids), as_int32(block_expert_ids), as_int32([used])


def write_kv_pages_ref(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V into their pages.

    k_pages, v_pages [N, Hkv, P, D]; k, v [T, Hkv, D]; slot_mapping [T] = page * P + offset.
    """
    page_size = k_pages.shape[2]
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    k_pages[pages, :, offsets, :] = k.to(k_pages.dtype)
    v_pages[pages, :, offsets, :] = v.to(v_pages.dtype)


def rope_kv_write_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, staged: bool = False,
                      k_ring: torch.Tensor | None = None, v_ring: torch.Tensor | None = None,
                      rotary_dim: int | None = None, inv_freq: torch.Tensor | None = None,
                      scale: float = 1.0) -> torch.Tensor:
    """RoPE on q, k [T, heads, D] (the first rotary_dim elements of each head; None: all; inv_freq and
    scale: scaled RoPE, as rotary_cos_sin_ref takes them), then the rotated k and v stored in the
    cache; returns the rotated q.

    staged=False: k_cache, v_cache are pages [N, Hkv, P, D], index = slot_mapping [T].
    staged=True: staging pages [S, Hkv, P, D], index = seq_slots [T] (one token per sequence) at
    offset position % P; k_ring, v_ring [S, Hkv, R, D] (optional) also get it at position % R.
    """
    cos, sin = rotary_cos_sin_ref(positions, rotary_dim or q.shape[-1], theta, q.dtype, inv_freq, scale)
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    if not staged:
        write_kv_pages_ref(k_cache, v_cache, k, v, index)
        return q
    for cache, x in ((k_cache, k), (v_cache, v), (k_ring, k), (v_ring, v)):
        if cache is not None:
            cache[index, :, positions % cache.shape[2]] = x.to(cache.dtype)
    return q


def gather_kv_ref(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from its pages: pages [N, Hkv, P, D] -> [length, Hkv, D]."""
    page_size = pages.shape[2]
    positions = torch.arange(length, device=pages.device)
    return pages[block_table[positions // page_size], :, positions % page_size, :]


def paged_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context, read from pages.

    q [T, Hq, D] (the step's queries, sequences back to back); block_tables [B, max_pages];
    context_lens [B] = tokens in the cache for each sequence after this step's write;
    query_start_loc [B+1]: sequence b owns q[query_start_loc[b]:query_start_loc[b+1]], which are
    its last positions. Serves prefill, chunked prefill and decode alike. Returns [T, Hq, D].
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lengths = context_lens.tolist()
    for b, length in enumerate(lengths):
        if starts[b + 1] == starts[b]:
            continue
        k = gather_kv_ref(k_pages, block_tables[b], length)
        v = gather_kv_ref(v_pages, block_tables[b], length)
        out[starts[b]:starts[b + 1]] = causal_attention_ref(q[starts[b]:starts[b + 1]], k, v, scale, sliding_window,
                                                            sinks)
    return out


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's causal attention: q [Tq, Hq, D], its last Tq positions, over k, v [L, Hkv, D]
    (cast to q's dtype; GQA: each KV head serves Hq / Hkv query heads) -> [Tq, Hq, D]. No host sync.
    sinks [Hq]: a logit per head that joins each row's softmax as a key of value 0 (gpt-oss)."""
    num_q, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    if sinks is not None:
        return _attention_with_sinks_ref(q, k, v, scale, sliding_window, sinks)
    # [1, H, L, D]: SDPA's fused CUDA kernels take 4-D inputs only; 3-D ones fall back to the
    # math path, which materialises the [H, Tq, L] scores in fp32 (most of a bf16 prefill step)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    mask = None
    if num_q != length or sliding_window is not None:  # (a whole prompt: plain causal, flash SDPA on CUDA)
        q_pos = torch.arange(length - num_q, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [Tq, L]
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    # on CUDA not cuDNN's attention: it builds a graph for every sequence length it has not seen
    with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o[0].transpose(0, 1)


SINK_QUERY_CHUNK = 512  # query rows per product in _attention_with_sinks_ref: bounds its [H, rows, L] scores


def _attention_with_sinks_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              sliding_window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """causal_attention_ref with a sink logit per head (k, v already [L, Hq, D]): scores explicit
    (SDPA takes no extra logit), in fp32 at least, a chunk of query rows at a time."""
    num_q, length = q.shape[0], k.shape[0]
    work = torch.promote_types(q.dtype, torch.float32)
    kw, vw = k.to(work), v.to(work)
    sink = sinks.to(work)[:, None, None]  # [Hq, 1, 1]
    k_pos = torch.arange(length, device=q.device)[None, :]
    out = torch.empty_like(q)
    for lo in range(0, num_q, SINK_QUERY_CHUNK):
        hi = min(lo + SINK_QUERY_CHUNK, num_q)
        q_pos = torch.arange(length - num_q + lo, length - num_q + hi, device=q.device)[:, None]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,lhd->hql", q[lo:hi].to(work), kw) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)  # the sink keeps every row finite
        p = torch.exp(scores - top)
        denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
        out[lo:hi] = torch.einsum("hql,lhd->qhd", p / denom, vw).to(q.dtype)
    return out


# SDPA backends for prefill on CUDA. PyTorch prefers cuDNN's attention on Hopper, which builds (and
# caches) an execution graph for each query/key length it has not seen: a few hundred ms each (sglang#4650;
# docs/decisions.md, "Prefill attention: 4-D SDPA inputs, no cuDNN backend"), paid by every prompt of an
# unseen length. Flash and memory-efficient attention have no such step.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# -- routing (moekv/routing; kernels in ops/fused_routing.py and ops/rms_norm_coarse_gate.py) ------
# C = clusters of a layer, M = experts per cluster, Kc = clusters a token may keep.

def stable_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, best first; equal values go to the lower index (the kernels' rule)."""
    values, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def _scores_ref(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"scoring={scoring!r} is not supported; accepted: 'softmax', 'sigmoid'")


GROUP_SCORES = ("top2_sum", "max")  # how group-limited routing scores a group of experts


def check_group_score(group_score: str) -> str:
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score={group_score!r} is not supported; accepted: {list(GROUP_SCORES)}")
    return group_score


def fused_routing_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                      bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                      scaling_factor: float = 1.0, group_score: str = "top2_sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Flat and group-limited routing (DeepSeek-V3's `noaux_tc` when n_group > 1) as one op.

    router_logits [T, E] -> scores (softmax or sigmoid, fp32); bias [E] (e_score_correction_bias) is
    added for the choice only. Experts form n_group contiguous groups; a group's score is the sum of
    its top-2 biased scores (group_score 'top2_sum', DeepSeek-V3) or its best one ('max',
    DeepSeek-V2's `group_limited_greedy`); the topk_group best groups stay and the top_k best experts
    inside them are chosen (others are -inf, never 0: a negative biased score must not lose to a dropped group).
    Weights are the un-biased scores, renormalised (+1e-20) if asked, times scaling_factor.
    Ties go to the lower index. -> (weights [T, k] fp32, expert_ids [T, k] int64), best first.
    """
    scores = _scores_ref(router_logits, scoring)  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        num_tokens, num_experts = choice.shape
        per_group = num_experts // n_group
        grouped = choice.view(num_tokens, n_group, per_group)
        best = 2 if check_group_score(group_score) == "top2_sum" else 1
        group_scores = stable_topk_ref(grouped, min(best, per_group))[0].sum(-1)  # [T, G]
        kept = stable_topk_ref(group_scores, topk_group)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = stable_topk_ref(choice, top_k)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def cluster_routing_ref(hidden: torch.Tensor, cluster_scores: torch.Tensor, gate_by_cluster: torch.Tensor,
                        cluster_experts: torch.Tensor, top_k: int, renormalize: bool, max_clusters: int,
                        admit_margin: float, scoring: str = "softmax", bias: torch.Tensor | None = None,
                        scaling_factor: float = 1.0, return_kept: bool = False):
    """Hierarchical routing: a few clusters per token, then only their experts scored.

    hidden [T, H] (the normalised state the router reads); cluster_scores [T, C] (coarse gate: an
    estimate of each cluster's log routing mass); gate_by_cluster [C, M, H] the router rows of each
    cluster's experts; cluster_experts [C, M] their expert ids; bias [E] or None (choice only).

    Clusters: the best by coarse score is always kept and its M logits computed exactly; the next
    ones (up to max_clusters, in coarse order) are kept while score >= best - admit_margin - slack,
    where slack = logsumexp - max of the best cluster's logits: when that cluster's mass is spread
    over several experts its coarse score overstates its top expert, and a rival cluster is closer
    than the scores say. Softmax scoring normalises over the kept experts and scales by the coarse
    estimate of the kept clusters' share of the mass (which cancels when renormalised). Candidates
    are ordered (kept rank, position in cluster); ties go to the earlier one.
    -> (weights [T, k] fp32, expert_ids [T, k] int64[, kept clusters [T, Kc] int64, -1 = not kept])
    """
    order_scores, order = stable_topk_ref(cluster_scores.float(), max_clusters)  # [T, Kc]
    num_tokens, num_kept = order.shape
    logits = hidden.new_full((num_tokens, num_kept, gate_by_cluster.shape[1]), float("-inf"), dtype=torch.float32)

    def score_rank(j: int, rows: torch.Tensor) -> None:  # logits of each token's j-th cluster, token by cluster
        for c in order[rows, j].unique().tolist():
            tokens = torch.nonzero(rows & (order[:, j] == c)).flatten()
            logits[tokens, j] = hidden[tokens].float() @ gate_by_cluster[c].float().T

    score_rank(0, torch.ones_like(order[:, 0], dtype=torch.bool))
    slack = torch.logsumexp(logits[:, 0], -1) - logits[:, 0].max(-1).values  # [T]
    keep = (order_scores >= (order_scores[:, :1] - admit_margin - slack[:, None])) & (order_scores > float("-inf"))
    keep[:, 0] = True
    for j in range(1, num_kept):
        score_rank(j, keep[:, j])
    logits = logits.flatten(1)  # [T, Kc*M], -inf where a cluster was not kept
    ids = cluster_experts[order].flatten(1)  # [T, Kc*M]
    if scoring == "softmax":
        coarse = torch.softmax(cluster_scores.float(), dim=-1).gather(1, order)
        kept_share = (coarse * keep).sum(-1, keepdim=True)  # [T, 1]
        scores = torch.softmax(logits, dim=-1) * kept_share
    else:
        scores = _scores_ref(logits, scoring)
    choice = scores if bias is None else scores + bias.float()[ids]
    choice = choice.masked_fill(logits == float("-inf"), float("-inf"))
    pos = stable_topk_ref(choice, top_k)[1]
    weights = scores.gather(1, pos)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    out = (weights * scaling_factor, ids.gather(1, pos))
    return out + (torch.where(keep, order, torch.full_like(order, -1)),) if return_kept else out


def rms_norm_coarse_gate_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, coarse_weight: torch.Tensor,
                             coarse_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm before a hierarchical MoE layer and its coarse gate, read from one pass over x.

    x [T, H]; coarse_weight [C, H]; coarse_bias [C] -> (normalised x [T, H] in x.dtype, cluster
    scores [T, C] fp32)."""
    normed = rms_norm_ref(x, norm_weight, eps)
    return normed, F.linear(normed.float(), coarse_weight.float(), None if coarse_bias is None else coarse_bias.float())


def decode_attention_ref(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                         sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the paged decode kernel (moekv/ops/decode/paged.py): each sequence's one
    query (its last position) over its whole context, computed in q's dtype (float64 in tests).

    q [B, Hq, D]; keys[b], values[b] [L_b, Hkv, D]: sequence b's context as its format dequantizes
    it (`PagedQuantFormat.gather`: pages, then the staged newest tokens; `gather_kv_ref` for plain
    pages). The same math as `paged_attention_ref` with one query per sequence. Returns [B, Hq, D].
    """
    out = torch.empty_like(q)
    for b, (k, v) in enumerate(zip(keys, values)):
        length = k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.to(q.dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.to(q.dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale  # [Hq, L]
        if sliding_window is not None:
            scores[:, :max(0, length - sliding_window)] = float("-inf")
        if sinks is not None:  # one more key per head with logit sinks[h] and value 0
            scores = torch.cat([scores, sinks.to(scores.dtype)[:, None]], dim=1)
            out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1)[:, :-1], v)
            continue
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn


def fp8_latent_quantize_ref(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's fp8 latent: one scale per token. latent [T, R] -> (codes [T, R] float8_e4m3fn,
    scales [T] fp32 = amax / 448, 1 for an all-zero token)."""
    x = latent.float()
    amax = x.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    codes = (x / scales[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def fp8_latent_dequantize_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., R] float8_e4m3fn, scales [...] -> the latent [..., R] fp32."""
    return codes.float() * scales.float()[..., None]


def mla_decode_ref(q: torch.Tensor, latents: list[torch.Tensor], kv_lora_rank: int, scale: float) -> torch.Tensor:
    """The reference of the absorbed MLA decode kernel (moekv/ops/decode/mla.py): each sequence's one
    query over its latent entries, computed in q's dtype (float64 in tests).

    q [B, H, W] (q_nope through W_UK: R columns, then the rotated q_rope); latents[b] [L_b, W]:
    sequence b's entries as its latent format reads them back (keys: the whole entry; values: the
    first R = kv_lora_rank columns, shared by every head). Returns [B, H, R]."""
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for b, entries in enumerate(latents):
        entries = entries.to(q.dtype)
        scores = torch.einsum("hw,lw->hl", q[b], entries) * scale  # [H, L]
        out[b] = torch.softmax(scores, dim=-1) @ entries[:, :kv_lora_rank]
    return out


# the absorbed MLA decode's MMA operands (EngineConfig.cache.mla_decode_mma) -> (queries, probabilities):
# None = unrounded (the reference's own dtype), else the type each MMA operand is rounded to
MLA_DECODE_MMAS = {"auto": (None, None), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"),
                   "fp8_queries": ("fp8", "bf16"), "fp8_probs": ("bf16", "fp8")}


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3fn (nearest even; |x| <= 448 expected) and back, in x's dtype."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def mla_query_fp8_ref(q_lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed decode's latent queries in e4m3 for fp8 MMAs: q_lat [..., R] -> (codes [..., R]
    float8_e4m3fn, scales [...] fp32 = amax / 448 per (token, head), 1 for an all-zero row)."""
    x = q_lat.float()
    amax = x.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (x / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scales


def mla_decode_mma_ref(q: torch.Tensor, entries: torch.Tensor, kv_lora_rank: int, scale: float, mma: str,
                       token_scales: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """One sequence's absorbed decode with the split kernel's MMA operands rounded as `mma` says
    (MLA_DECODE_MMAS), computed as ops/decode/mla.py's one split does: tiles of block_n entries, an
    online softmax (each tile's probabilities against the running max), the sum of probabilities
    unrounded, the rounded ones feeding the value MMA. q [H, W] (R = kv_lora_rank latent columns, then
    the rotary ones); entries [L, W] as stored; token_scales [L]: the fp8 latent's per-token scales,
    whose codes the kernel multiplies (entries = codes x scale: the scale is folded into the scores
    and into the probabilities), None for a 16-bit latent. Returns [H, R] in q's dtype.

    Rounding: 'bf16' queries all W columns to bf16; 'fp8' queries the latent columns to e4m3 with one
    scale per head (mla_query_fp8_ref), the rotary columns to bf16 (the rotary key is bf16 in every
    latent format). Probabilities times the token's scale: to bf16; to e4m3 after multiplying by
    448 / (the tile's largest token scale, 1 for a 16-bit latent), so each tile's largest possible
    value (probability 1 at that token) is e4m3's largest, with the factor divided back out of the
    product. The kernel's splits each keep their own running max; this is one split."""
    q_fmt, p_fmt = MLA_DECODE_MMAS[mma]
    R = kv_lora_rank
    dtype = q.dtype
    q_lat, q_rope = q[:, :R], q[:, R:]
    if q_fmt == "bf16":
        q_lat, q_rope = q_lat.to(torch.bfloat16).to(dtype), q_rope.to(torch.bfloat16).to(dtype)
    elif q_fmt == "fp8":
        codes, q_scales = mla_query_fp8_ref(q_lat)
        q_lat = codes.to(dtype) * q_scales.to(dtype)[:, None]
        q_rope = q_rope.to(torch.bfloat16).to(dtype)
    entries = entries.to(dtype)
    L, H = entries.shape[0], q.shape[0]
    scores = (q_lat @ entries[:, :R].T + q_rope @ entries[:, R:].T) * scale  # [H, L]
    tiles = -(-L // block_n)
    pad = tiles * block_n - L
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(H, tiles, block_n)
    m = scores.amax(-1).cummax(-1).values  # [H, tiles]: the running max after each tile
    p = torch.exp(scores - m[..., None])  # [H, tiles, block_n], each tile against its running max
    decay = torch.exp(m - m[:, -1:])  # each tile's weight at the end (the kernel's alphas multiplied)
    l_sum = (p.sum(-1) * decay).sum(-1)  # [H]
    s_tok = torch.ones(L, dtype=dtype, device=q.device) if token_scales is None else token_scales.to(dtype)
    s_tok = torch.nn.functional.pad(s_tok, (0, pad), value=0.0).view(tiles, block_n)
    pv = p * s_tok  # the value MMA's probabilities (fp8 latent: the token scale folded in)
    if p_fmt == "bf16":
        pv = pv.to(torch.bfloat16).to(dtype)
    elif p_fmt == "fp8":
        fold = FP8_E4M3_MAX / s_tok.amax(-1).clamp_min(torch.finfo(dtype).tiny)  # [tiles]
        pv = e4m3_round(pv * fold[:, None]) / fold[:, None]
    codes = entries[:, :R] / torch.where(s_tok.flatten()[:L] > 0, s_tok.flatten()[:L], 1.0)[:, None]
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).view(tiles, block_n, R)
    acc = torch.einsum("htn,tnr,ht->hr", pv, codes, decay)
    return acc / l_sum[:, None]


def mla_rope_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin for MLA's rotary part [T, 1, r/2] at positions [T]: the angles positions *
    inv_freq in inv_freq's dtype, cos and sin scaled by `scale` (YaRN), then cast to dtype. Computed
    once a step (layers/mla.MLAttention.rope_cos_sin) and applied by mla_rope_apply_ref."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # [T, r/2]
    return (freqs.cos() * scale).to(dtype)[:, None, :], (freqs.sin() * scale).to(dtype)[:, None, :]


def mla_rope_apply_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on MLA's rotary part x [T, heads, r] by cos, sin [T, 1, r/2] (mla_rope_cos_sin_ref). interleave:
    pairs (x0, x1), (x2, x3), ... rotate together, and the result is laid out evens first, then odds (q and
    k alike, so q . k is that of the pairs kept in place); else rotate-half pairs (x_i, x_{i + r/2})."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_rope_norm_ref(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                      eps: float, num_heads: int, nope: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/mla_rope_norm.py's reference, the ops layers/mla.py runs off CUDA: q [T, H * (nope + r)] and
    kv [T, R + r] -> (q_abs [T, H, R + r]: zeros, then q's rotary part rotated; entries [T, R + r]:
    rms_norm_ref of c_kv by weight [R], then the shared key rotated). cos / sin [T, 1, r/2]."""
    T, R = q.shape[0], weight.shape[0]
    q_rope = q.view(T, num_heads, -1)[..., nope:]
    c_kv, k_rope = kv.split([R, kv.shape[-1] - R], -1)
    rotated = mla_rope_apply_ref(torch.cat([q_rope, k_rope[:, None]], dim=1), cos, sin, interleave)
    q_abs = torch.cat([q.new_zeros(T, num_heads, R), rotated[:, :num_heads]], dim=-1)
    return q_abs, torch.cat([rms_norm_ref(c_kv, weight, eps), rotated[:, num_heads]], dim=-1)


def latent_int4_quantize_ref(latent: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's int4 latent: per token, groups of `group` channels, each with an fp16 scale and minimum.
    latent [T, R] -> (codes [T, R/2] uint8: channel 2j in the low nibble of byte j, 2j+1 in the high;
    scale [T, R/group] fp16, zero [T, R/group] fp16 (the group's minimum)). Codes are computed against
    the fp16 scale and minimum the readers see; a constant group gets scale 0 and codes 0."""
    x = latent.float()
    T, R = x.shape
    groups = x.view(T, R // group, group)
    zero = groups.amin(-1).clamp(-65504.0, 65504.0).to(torch.float16)
    scale = ((groups.amax(-1) - zero.float()) / 15).clamp(0, 65504.0).to(torch.float16)
    s, z = scale.float()[..., None], zero.float()[..., None]
    codes = torch.where(s > 0, ((groups - z) / torch.where(s > 0, s, 1.0)).round().clamp(0, 15), 0.0)
    codes = codes.to(torch.uint8).view(T, R)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale, zero


def latent_int4_dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [..., R/2] uint8, scale and zero [..., R/group] fp16 -> the latent [..., R] fp32."""
    values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).float()  # [..., R]
    groups = values.unflatten(-1, (scale.shape[-1], -1))
    return (groups * scale.float()[..., None] + zero.float()[..., None]).flatten(-2)


# 2-bit latent codebooks: value = offset + step * LEVELS[code], offset and step fp16 per group.
# uniform: KIVI's min / (max - min) / 3 grid; gaussian: the Lloyd-Max quantizer of a unit normal
# (offset the group's mean, step its standard deviation), least squared error for Gaussian data
LATENT_2BIT_LEVELS = {"uniform": (0.0, 1.0, 2.0, 3.0), "gaussian": (-1.5104, -0.4528, 0.4528, 1.5104)}


def latent_2bit_quantize_ref(x: torch.Tensor, dim: int, codebook: str,
                             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-bit codes of x with one (offset, step) per slice reduced over `dim`: dim -1 groups channels
    of one token, dim -2 tokens of one channel (KIVI's keys). mask (x's shape, bool): the elements
    that count in the statistics (the rest are coded but do not shape the grid: a partly written
    token group). Returns codes uint8 (x's shape, 0..3), offset and step fp16 (dim removed)."""
    x = x.float()
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    count = keep.sum(dim).clamp(min=1)
    if codebook == "uniform":
        lo = torch.where(keep, x, torch.inf).amin(dim)
        hi = torch.where(keep, x, -torch.inf).amax(dim)
        lo = torch.where(torch.isfinite(lo), lo, 0.0)
        hi = torch.where(torch.isfinite(hi), hi, lo)
        offset, step = lo, (hi - lo) / 3
    elif codebook == "gaussian":
        mean = torch.where(keep, x, 0.0).sum(dim) / count
        var = torch.where(keep, (x - mean.unsqueeze(dim)) ** 2, 0.0).sum(dim) / count
        offset, step = mean, var.sqrt()
    else:
        raise ValueError(f"codebook={codebook!r}: accepted {list(LATENT_2BIT_LEVELS)}")
    offset = offset.clamp(-65504.0, 65504.0).to(torch.float16)
    step = step.clamp(0, 65504.0).to(torch.float16)
    levels = torch.tensor(LATENT_2BIT_LEVELS[codebook], device=x.device)
    z = (x - offset.float().unsqueeze(dim)) / torch.where(step > 0, step.float(), 1.0).unsqueeze(dim)
    # nearest level: the levels are sorted, so a threshold test at their midpoints
    mids = (levels[1:] + levels[:-1]) / 2
    codes = (z[..., None] > mids).sum(-1)
    # step 0 (constant slice): the code whose level is nearest 0 decodes to the offset itself
    codes = torch.where(step.unsqueeze(dim) > 0, codes, int(levels.abs().argmin()))
    return codes.to(torch.uint8), offset, step


def latent_2bit_dequantize_ref(codes: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, dim: int,
                               codebook: str) -> torch.Tensor:
    """codes (0..3, unpacked) with offset and step broadcast over `dim` -> values fp32."""
    levels = torch.tensor(LATENT_2BIT_LEVELS[codebook], device=codes.device)
    return offset.float().unsqueeze(dim) + step.float().unsqueeze(dim) * levels[codes.long()]


def pack_2bit_ref(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] uint8 in 0..3 -> [..., D/4]: channel 4j+i in bits 2i..2i+1 of byte j (kivi2's order)."""
    return codes[..., 0::4] | (codes[..., 1::4] << 2) | (codes[..., 2::4] << 4) | (codes[..., 3::4] << 6)


def unpack_2bit_ref(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/4] uint8 -> codes [..., D]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 0x3).flatten(-2)


F16_DOTS_TARGET_EXP = 8  # int4_f16_dots_ref and quant_tiles.f16_activations scale a K step's max |x| into [2^8, 2^9)


def int4_f16_dots_ref(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, x: torch.Tensor,
                      group: int, block_k: int) -> torch.Tensor:
    """numpy emulation of the int4 GEMV's packed-half dot (`quant_tiles.int4_f16_dots`), operation for
    operation: int4 codes packed 8 an int32 (words [N, K / 8]), scales / zeros [N, K / group] (zeros None:
    symmetric, 8), x [K] (rounded to fp32 first, as the kernel loads it) -> the kernel's fp32 row dots [N] (fp64
    tensor holding fp32 values). Each K step of block_k columns: x times 2^e, the power of two that puts its max
    |x| in [2^8, 2^9), rounded to fp16 in pairs (x[8w + i], x[8w + i + 4]); each word's nibbles as fp16 halves
    1024 + n (nibbles 0 / 4 and 2 / 6, after a shift by 8) and 1024 + 16 n (1 / 5, 3 / 7), then n - 8 exactly;
    the two halves' four products accumulated in fp16 (a multiply then three fused multiply-adds, one rounding
    each), the halves summed in fp32; per group the fp32 sum of its words' dots times 2^-e, less (z - 8) times
    the group's fp32 sum of x, times the scale."""
    f16, f32 = np.float16, np.float32
    w = words.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    N, W = w.shape
    K = 8 * W
    xs = x.float().cpu().numpy().astype(f32)
    s = scales.float().cpu().numpy().astype(f32)
    z = np.full_like(s, 8.0) if zeros is None else zeros.float().cpu().numpy().astype(f32)

    def halves(bits):  # uint32 [N, W] -> fp16 (low, high)
        return ((bits & 0xFFFF).astype(np.uint16).view(f16), (bits >> 16).astype(np.uint16).view(f16))

    magic = 0x64006400
    lo0, hi0 = halves((w & 0x000F000F) | magic)  # 1024 + n0, 1024 + n4
    lo1, hi1 = halves((w & 0x00F000F0) | magic)  # 1024 + 16 n1, 1024 + 16 n5
    lo2, hi2 = halves(((w >> 8) & 0x000F000F) | magic)  # n2, n6
    lo3, hi3 = halves(((w >> 8) & 0x00F000F0) | magic)  # n3, n7

    def centre(h, odd):  # exact: sub.f16x2 with 1032, or fma.f16x2 by 1/16 less 72
        return (h.astype(np.float64) / 16 - 72 if odd else h.astype(np.float64) - 1032).astype(f16)

    d_lo = [centre(lo0, False), centre(lo1, True), centre(lo2, False), centre(lo3, True)]  # nibbles 0..3
    d_hi = [centre(hi0, False), centre(hi1, True), centre(hi2, False), centre(hi3, True)]  # nibbles 4..7
    out = np.zeros(N, dtype=f32)
    for k0 in range(0, K, block_k):
        cols = slice(k0 // 8, min(K, k0 + block_k) // 8)
        xk = xs[k0:k0 + block_k]
        amax = f32(np.abs(xk).max())
        e = max(int((amax.view(np.int32) >> 23) & 0xFF), 9)  # amax's biased exponent, as the kernel reads it
        up, down = f32(np.ldexp(1.0, 127 + F16_DOTS_TARGET_EXP - e)), f32(np.ldexp(1.0, e - 127 - F16_DOTS_TARGET_EXP))
        xh = (xk * up).astype(f16).reshape(-1, 8)  # [words, 8]

        def chain(d, lanes):  # one half's 4 products in fp16, rounded after each operation
            acc = (d[0][:, cols].astype(np.float64) * xh[None, :, lanes[0]]).astype(f16)
            for j in (1, 2, 3):
                acc = (d[j][:, cols].astype(np.float64) * xh[None, :, lanes[j]] + acc.astype(np.float64)).astype(f16)
            return acc.astype(f32)

        word = chain(d_lo, (0, 1, 2, 3)) + chain(d_hi, (4, 5, 6, 7))  # [N, words] fp32
        per_group = min(group, block_k) // 8
        pad = -word.shape[1] % per_group  # a last group cut by K: its missing words add 0, as the kernel's masks do
        sums = np.pad(word, ((0, 0), (0, pad))).reshape(N, -1, per_group).sum(-1, dtype=f32)  # [N, groups in step]
        x_sums = np.pad(xk, (0, 8 * pad)).reshape(-1, per_group * 8).sum(-1, dtype=f32)
        g0 = k0 // group
        sg, zg = s[:, g0:g0 + sums.shape[1]], z[:, g0:g0 + sums.shape[1]]
        out += ((sums * down - (zg - f32(8)) * x_sums[None, :]) * sg).sum(-1, dtype=f32)
    return torch.from_numpy(out.astype(np.float64))


def f16_error_bound(words: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """A bound on |int4_f16_dots_ref - the dequantized dot| [N] (fp64): each fp16 half takes 4 roundings of
    relative size <= 2^-11 on partial sums bounded by sum |n - 8| |x| (2^-9 of it, x scaled exactly; x's fp16
    rounding is exact above fp16's subnormals, 22 binades below the step's max), times each group's scale; plus
    fp32's roundings on the word and group sums, 2^-20 of the same."""
    from moekv.ops.quantized_weight import unpack_int4

    n = unpack_int4(words).double()  # [N, K]
    terms = F.pad((n - 8).abs() * x.double().abs()[None, :], (0, -n.shape[1] % group))
    terms = terms.reshape(n.shape[0], -1, group).sum(-1)  # [N, groups]
    return (2.0 ** -9 + 2.0 ** -20) * (terms * scales.double().abs()).sum(-1)
