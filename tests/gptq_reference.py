"""A plain float64 GPTQ, block by block, on transformers' own forward: the oracle of
tests/test_gptq_blockwise.py for moekv's models/gptq.round_blockwise (written independently of it:
transformers runs the model; the rounding is GPTQ's column loop without lazy blocks)."""
from __future__ import annotations

import torch

DAMP = 0.01
TINY = torch.finfo(torch.float32).tiny


def gptq_ref(w: torch.Tensor, h: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """w [N, K] rounded to int4 codes with a scale and zero point per group of `group` columns, each
    column's error spread over the later ones through the upper Cholesky factor of H^-1 (H damped by
    DAMP of its mean diagonal); round-to-nearest when H is 0. Scales are rounded to scale_dtype, as
    stored. -> (codes [N, K] int64, scales [N, G] fp64, zeros [N, G] fp64)."""
    W, H = w.double().clone(), h.double().clone()
    N, K = W.shape
    groups = -(-K // group)
    codes = torch.zeros(N, K, dtype=torch.int64)
    scales, zeros = torch.zeros(N, groups, dtype=torch.float64), torch.zeros(N, groups, dtype=torch.float64)
    if H.abs().sum() == 0:  # no inputs: round to nearest
        U = None
    else:
        dead = H.diagonal() == 0
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
        H = H + DAMP * H.diagonal().mean() * torch.eye(K, dtype=torch.float64)
        U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    for i in range(K):
        g = i // group
        if i % group == 0:
            cols = W[:, i:i + group]
            lo, hi = cols.amin(1).clamp_max(0.0), cols.amax(1).clamp_min(0.0)
            scales[:, g] = ((hi - lo) / 15).clamp_min(TINY).to(scale_dtype).double()
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(0, 15)
        s, z = scales[:, g], zeros[:, g]
        q = (W[:, i] / s + z).round().clamp(0, 15)
        codes[:, i] = q.long()
        if U is not None:
            err = (W[:, i] - (q - z) * s) / U[i, i]
            W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return codes, scales, zeros


def dequantize_ref(codes, scales, zeros, group: int) -> torch.Tensor:
    g = torch.arange(codes.shape[1]) // group
    return (codes.double() - zeros[:, g]) * scales[:, g]


@torch.no_grad()
def blockwise_gptq_ref(hf, prompts: list[list[int]], group: int, scale_dtype: torch.dtype,
                       sequential: bool = True, forced: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """GPTQ of a transformers Mixtral (float64, changed in place), decoder layer by decoder layer: the
    prompts run through the whole model (layers before l already rounded) while hooks add up layer l's
    inputs' second moments: q/k/v's input, o_proj's, each expert's routed rows for gate_up_proj and
    silu(gate) * up (from the unrounded gate_up_proj) for down_proj; then layer l is rounded and its
    weights replaced by their dequantized codes. The LM head last, on the final norm's output.
    sequential=False: every layer's second moments from the unrounded model (the all-at-once
    definition). forced (moekv's weight names -> weights): once layer l's codes are computed, layer l
    takes these weights instead of its own rounding (each layer's rounding checked on the inputs
    another implementation's earlier layers give, without the drift of a chain of near-ties).
    -> moekv's weight names -> codes [N, K] (experts [E, N, K])."""
    layers = hf.model.layers
    out: dict[str, torch.Tensor] = {}

    def collect(modules_and_fns):
        handles = [m.register_forward_pre_hook(fn) for m, fn in modules_and_fns]
        for p in prompts:
            hf(torch.tensor([p]))
        for h in handles:
            h.remove()

    def moments_of(layer, hs):
        attn, experts = layer.self_attn, layer.mlp.experts
        E = experts.gate_up_proj.shape[0]

        def add(key, x):
            x = x.reshape(-1, x.shape[-1]).double()
            hs[key] = hs.get(key, 0) + x.T @ x

        def on_experts(module, args):
            x, idx = args[0].reshape(-1, args[0].shape[-1]), args[1]
            for e in range(E):
                rows = (idx == e).any(-1)
                xe = x[rows]
                gate, up = (xe @ original[id(layer)][e].T).chunk(2, dim=-1)
                add(f"w13.{e}", xe)
                add(f"w2.{e}", torch.nn.functional.silu(gate) * up)

        return [(attn.q_proj, lambda m, a: add("qkv", a[0])), (attn.o_proj, lambda m, a: add("o", a[0])),
                (experts, on_experts)]

    def round_into(weight: torch.nn.Parameter, h) -> torch.Tensor:
        h = h if torch.is_tensor(h) else torch.zeros(weight.shape[1], weight.shape[1], dtype=torch.float64)
        codes, scales, zeros = gptq_ref(weight, h, group, scale_dtype)
        weight.copy_(dequantize_ref(codes, scales, zeros, group))
        return codes

    original = {id(layer): layer.mlp.experts.gate_up_proj.clone() for layer in layers}
    every = []
    if not sequential:
        every = [{} for _ in layers]
        collect([pair for layer, hs in zip(layers, every) for pair in moments_of(layer, hs)])
    for i, layer in enumerate(layers):
        if sequential:
            hs = {}
            collect(moments_of(layer, hs))
        else:
            hs = every[i]
        attn, experts = layer.self_attn, layer.mlp.experts
        out[f"layers.{i}.qkv_proj"] = torch.cat([round_into(attn.q_proj.weight, hs.get("qkv")),
                                                round_into(attn.k_proj.weight, hs.get("qkv")),
                                                round_into(attn.v_proj.weight, hs.get("qkv"))])
        out[f"layers.{i}.o_proj"] = round_into(attn.o_proj.weight, hs.get("o"))
        E = experts.gate_up_proj.shape[0]
        out[f"layers.{i}.w13"] = torch.stack([round_into(experts.gate_up_proj[e], hs.get(f"w13.{e}"))
                                              for e in range(E)])
        out[f"layers.{i}.w2"] = torch.stack([round_into(experts.down_proj[e], hs.get(f"w2.{e}")) for e in range(E)])
        if forced is not None:
            q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
            for part, w in zip((q, k, v), forced[f"layers.{i}.qkv_proj"].split([len(q), len(k), len(v)])):
                part.copy_(w)
            attn.o_proj.weight.copy_(forced[f"layers.{i}.o_proj"])
            experts.gate_up_proj.copy_(forced[f"layers.{i}.w13"])
            experts.down_proj.copy_(forced[f"layers.{i}.w2"])
    hs = {}
    collect([(hf.lm_head, lambda m, a: hs.__setitem__("h", hs.get("h", 0) + a[0][0].T @ a[0][0]))])
    out["lm_head"] = round_into(hf.lm_head.weight, hs["h"])
    return out
