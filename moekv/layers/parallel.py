"""Tensor and expert parallelism inside the layers: how a module's weights are cut over the ranks
of a group, and the collectives its forward needs (torch.distributed; gloo on the CPU, NCCL on CUDA).

Every rank runs the same forward over the same tokens (SPMD). Attention keeps its rank's query
heads and the KV heads they read (KV heads are replicated when the group is larger than
num_kv_heads), and o_proj's columns for those heads: each rank's output is a partial sum, summed
by one all-reduce. A dense MLP (and, without expert parallelism, every expert) keeps a slice of
the intermediate dimension, again a partial sum. With expert parallelism each rank holds whole
experts (a placement: which rank holds each expert) and the router runs replicated; the routed
tokens either all stay on every rank (each rank adds its experts' share, summed by the layer's
all-reduce) or are dispatched: each token is owned by the rank of its top-1 expert, which sends
its hidden state to every other rank holding one of its experts and receives their weighted
outputs back (point-to-point sends of exactly the routed rows: gloo has no all_to_all of uneven
lists). The bytes each rank sends are counted per layer.

Inside a captured decode step (a CUDA graph, or the same static-buffer step run eagerly on the CPU)
no collective may depend on data-dependent sizes or host syncs, so there the dispatch is static
(`StaticDispatch`): two all_to_all_single exchanges of fixed [world, T, H] buffers (T = the
bucket's tokens: a token visits each rank at most once), the rows of tokens that do not visit a
peer zeroed, and the routed rows counted on the device (only the step's real rows, not its
padding: the count is what the dynamic dispatch would have sent, so the counters do not depend on
which path ran).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moekv.ops.reference import silu_and_mul_ref


@dataclass
class TPGroup:
    """The ranks one model is spread over: this process's rank, their number, and the process
    group its collectives run on."""

    rank: int
    world_size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from rank 0 to every rank, in place (the group's rank 0 is global rank 0)."""
        dist.broadcast(x, src=0, group=self.group)
        return x


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[range, range]:
    """(query heads, KV heads) rank keeps. Query heads are split evenly (num_heads % world == 0);
    KV heads too when world <= num_kv_heads (num_kv_heads % world == 0), else each rank keeps the one
    KV head its query heads read (world % num_kv_heads == 0: each KV head on world / num_kv_heads ranks)."""
    if num_heads % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the model's num_attention_heads={num_heads}")
    per_rank = num_heads // world
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if world <= num_kv_heads:
        if num_kv_heads % world:
            raise ValueError(f"tensor_parallel_size={world} must divide the model's num_key_value_heads="
                             f"{num_kv_heads} (or be a multiple of it: KV heads are then replicated)")
        kv_per_rank = num_kv_heads // world
        return q, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world} is larger than num_key_value_heads={num_kv_heads} and not a "
                         "multiple of it: KV heads cannot be replicated evenly")
    group = num_heads // num_kv_heads
    return q, range(q.start // group, q.start // group + 1)


def check_tp_shapes(cfg, world: int, expert_parallel: bool) -> None:
    """Refuse, before anything is loaded, a group size the model's shapes do not split by."""
    if cfg.mla is not None:
        raise ValueError(f"tensor_parallel_size={world} is not supported for {cfg.architecture} (multi-head latent "
                         "attention is not split over ranks); accepted: 1")
    kv_heads_of_rank(cfg.num_heads, cfg.num_kv_heads, 0, world)
    if cfg.dense_intermediate_size and any(not m for m in cfg.moe_layers) and cfg.dense_intermediate_size % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the dense MLP's intermediate_size="
                         f"{cfg.dense_intermediate_size}")
    if cfg.shared_expert_intermediate_size % world:
        raise ValueError(f"tensor_parallel_size={world} must divide shared_expert_intermediate_size="
                         f"{cfg.shared_expert_intermediate_size}")
    if not expert_parallel and cfg.moe_intermediate_size % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the experts' intermediate size "
                         f"{cfg.moe_intermediate_size} (or enable_expert_parallel=True: whole experts per rank)")
    if expert_parallel and cfg.num_experts % world:
        raise ValueError(f"enable_expert_parallel with tensor_parallel_size={world} needs num_experts="
                         f"{cfg.num_experts} divisible by it")


def _rows(t: torch.Tensor, index) -> nn.Parameter:
    return nn.Parameter(t.detach()[index].contiguous(), requires_grad=False)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose elements are spread over the ranks (OLMoE's q/k norm over the
    whole projection): each rank holds a slice of the weight; the sum of squares is all-reduced.
    replication: how many ranks hold each element (KV heads replicated over several ranks)."""

    def __init__(self, weight: torch.Tensor, eps: float, full_size: int, tp: TPGroup, replication: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.eps, self.full_size, self.tp, self.replication = eps, full_size, tp, replication

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)
        self.tp.all_reduce(sq)
        var = sq / (self.full_size * self.replication)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)


def attention_rows(cfg, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows of qkv_proj, rows of q (o_proj's columns), rows of k or v) that rank keeps."""
    q_heads, kv_heads = kv_heads_of_rank(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world_size)
    D, q_size, kv_size = cfg.head_dim, cfg.q_size, cfg.kv_size
    q_rows = torch.arange(q_heads.start * D, q_heads.stop * D)
    kv_rows = torch.arange(kv_heads.start * D, kv_heads.stop * D)
    return torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows]), q_rows, kv_rows


def shard_attention(attn, cfg, tp: TPGroup) -> None:
    """Keep rank's query heads, the KV heads they read, and o_proj's columns for its heads."""
    q_size, kv_size = cfg.q_size, cfg.kv_size
    q_heads, kv_heads = kv_heads_of_rank(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world_size)
    rows, q_rows, kv_rows = attention_rows(cfg, tp)
    attn.qkv_proj = _rows(attn.qkv_proj, rows)
    if attn.qkv_bias is not None:
        attn.qkv_bias = _rows(attn.qkv_bias, rows)
    attn.o_proj = nn.Parameter(attn.o_proj.detach()[:, q_rows].contiguous(), requires_grad=False)
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    attn.q_size, attn.kv_size = len(q_rows), len(kv_rows)
    if attn.qk_norm == "full":
        replication = max(tp.world_size // cfg.num_kv_heads, 1)
        attn.q_norm = ShardedRMSNorm(attn.q_norm.weight.detach()[q_rows], attn.q_norm.eps, q_size, tp)
        attn.k_norm = ShardedRMSNorm(attn.k_norm.weight.detach()[kv_rows], attn.k_norm.eps, kv_size, tp, replication)
    attn.hooks.tp = tp


def _gate_up_rows(intermediate: int, rank: int, world: int) -> torch.Tensor:
    per = intermediate // world
    gate = torch.arange(rank * per, (rank + 1) * per)
    return torch.cat([gate, intermediate + gate])


def shard_mlp(mlp, tp: TPGroup) -> None:
    """A GatedMLP keeps a slice of its intermediate dimension: its output is a partial sum (the
    caller all-reduces)."""
    inter = mlp.down_proj.shape[1]
    rows = _gate_up_rows(inter, tp.rank, tp.world_size)
    mlp.gate_up_proj = _rows(mlp.gate_up_proj, rows)
    mlp.down_proj = nn.Parameter(mlp.down_proj.detach()[:, rows[: len(rows) // 2]].contiguous(), requires_grad=False)


def shard_moe(moe, tp: TPGroup, device_of_expert: torch.Tensor | None, dispatch: bool) -> None:
    """Without a placement (device_of_expert None): every expert keeps a slice of its intermediate
    dimension (tensor parallel). With one ([E] rank of each expert): rank keeps its whole experts."""
    if moe.shared_expert is not None:
        shard_mlp(moe.shared_expert, tp)
    if device_of_expert is None:
        inter = moe.w2.shape[2]
        rows = _gate_up_rows(inter, tp.rank, tp.world_size)
        moe.w13 = nn.Parameter(moe.w13.detach()[:, rows].contiguous(), requires_grad=False)
        moe.w2 = nn.Parameter(moe.w2.detach()[:, :, rows[: len(rows) // 2]].contiguous(), requires_grad=False)
    else:
        local = torch.nonzero(device_of_expert == tp.rank).flatten()
        moe.w13 = _rows(moe.w13, local)
        moe.w2 = _rows(moe.w2, local)
        moe.hooks.experts = ExpertParallel(tp, device_of_expert, dispatch)
    moe.hooks.tp = tp


def shard_plan(model, cfg, tp: TPGroup,
               placement: dict[int, torch.Tensor] | None) -> dict[str, tuple[int, torch.Tensor]]:
    """What shard_model keeps of each parameter it cuts, by the parameter's name in the whole model:
    (dim, the indices kept along it, ascending). Parameters not named are kept whole. `model` is
    the whole model (on the meta device is enough: only its structure is read)."""
    from moekv.layers.mlp import GatedMLP
    from moekv.layers.moe import SparseMoE

    plan: dict[str, tuple[int, torch.Tensor]] = {}

    def mlp(prefix: str, inter: int) -> None:
        rows = _gate_up_rows(inter, tp.rank, tp.world_size)
        plan[f"{prefix}.gate_up_proj"] = (0, rows)
        plan[f"{prefix}.down_proj"] = (1, rows[: len(rows) // 2])

    for i, layer in enumerate(model.layers):
        rows, q_rows, kv_rows = attention_rows(cfg, tp)
        a = f"layers.{i}.self_attn"
        plan[f"{a}.qkv_proj"] = (0, rows)
        if layer.self_attn.qkv_bias is not None:
            plan[f"{a}.qkv_bias"] = (0, rows)
        plan[f"{a}.o_proj"] = (1, q_rows)
        if layer.self_attn.qk_norm == "full":
            plan[f"{a}.q_norm.weight"] = (0, q_rows)
            plan[f"{a}.k_norm.weight"] = (0, kv_rows)
        m = f"layers.{i}.mlp"
        if isinstance(layer.mlp, SparseMoE):
            if layer.mlp.shared_expert is not None:
                mlp(f"{m}.shared_expert", layer.mlp.shared_expert.down_proj.shape[1])
            if placement is None:
                rows = _gate_up_rows(layer.mlp.w2.shape[2], tp.rank, tp.world_size)
                plan[f"{m}.w13"] = (1, rows)
                plan[f"{m}.w2"] = (2, rows[: len(rows) // 2])
            else:
                local = torch.nonzero(placement[i] == tp.rank).flatten()
                plan[f"{m}.w13"] = (0, local)
                plan[f"{m}.w2"] = (0, local)
        elif isinstance(layer.mlp, GatedMLP):
            mlp(m, layer.mlp.down_proj.shape[1])
    return plan


def local_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      local_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_ref over this rank's experts only: local_ids [T, k] index w13/w2, -1 = elsewhere."""
    out = torch.zeros_like(x)
    for expert in torch.unique(local_ids[local_ids >= 0]).tolist():
        token_idx, slot = torch.where(local_ids == expert)
        h = silu_and_mul_ref(F.linear(x[token_idx], w13[expert]))
        out.index_add_(0, token_idx, F.linear(h, w2[expert]) * weights[token_idx, slot, None].to(x.dtype))
    return out


def run_local_experts(x, w13, w2, weights, local_ids):
    if x.is_cuda:  # the fused kernel over the local experts; other ranks' assignments weigh 0
        from moekv.ops.fused_moe import fused_moe

        mask = local_ids >= 0
        return fused_moe(x, w13, w2, torch.where(mask, weights, torch.zeros_like(weights)),
                         torch.where(mask, local_ids, torch.zeros_like(local_ids)))
    return local_experts_ref(x, w13, w2, weights, local_ids)


class StaticDispatch:
    """Shared by a model's ExpertParallel layers: whether the step now running is a static one
    (a captured or emulated decode step: `active`), and how many of its leading rows are real
    (`rows`, a device scalar set before each step, read by the captured step at replay)."""

    def __init__(self, device: torch.device) -> None:
        self.active = False
        self.rows = torch.zeros((), dtype=torch.long, device=device)

    def count_rows(self, rows: int) -> None:
        """The next static steps' first `rows` rows are real (stream-ordered before them)."""
        self.rows.fill_(rows)


class ExpertParallel:
    """One MoE layer's experts over the ranks of a group (device_of_expert [E]: the rank of each): the
    layer's ExpertExecutor (layers/moe.py) with expert parallelism.

    dispatch False: every rank runs its experts on all the step's tokens, and the layer's
    all-reduce sums the shares. dispatch True: each token is owned by its top-1 expert's rank; the
    owner sends the token's hidden state to each other rank holding one of its experts, which sends
    back its experts' weighted sum; the owner's rows hold the token's routed output, the other
    ranks' rows zero (the layer's all-reduce then gives every rank the whole output).
    bytes_sent / bytes_received count the routed rows this rank sent and received: host ints for
    the eager (dynamic) steps plus a device counter for the static ones (`static`: a
    StaticDispatch shared by the model's layers; while it is active the dispatch is shape-static)."""

    def __init__(self, tp: TPGroup, device_of_expert: torch.Tensor, dispatch: bool) -> None:
        self.tp, self.dispatch = tp, dispatch
        self.device_of_expert = device_of_expert.clone()
        local = torch.nonzero(device_of_expert == tp.rank).flatten()
        self.local_of_expert = torch.full_like(device_of_expert, -1)
        self.local_of_expert[local] = torch.arange(len(local))
        self.dynamic_bytes = 0  # eager steps (host int)
        # static steps: bytes of the routed real rows, counted on the device (a graph replays the count);
        # sent and received are equal, as in the dynamic path (each row sent to a helper comes back)
        self.static_bytes = torch.zeros((), dtype=torch.long)
        self.static: StaticDispatch | None = None

    @property
    def bytes_sent(self) -> int:
        return self.dynamic_bytes + int(self.static_bytes.item())  # (a device read: stats only)

    @property
    def bytes_received(self) -> int:
        return self.bytes_sent  # pairs are symmetric: each sent row comes back

    def to(self, device: torch.device) -> "ExpertParallel":
        self.device_of_expert = self.device_of_expert.to(device)
        self.local_of_expert = self.local_of_expert.to(device)
        self.static_bytes = self.static_bytes.to(device)
        return self

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor:
        local_ids = self.local_of_expert[expert_ids]  # [T, k], -1 where another rank holds the expert
        if not self.dispatch:
            return run_local_experts(x, w13, w2, weights, local_ids)
        if self.static is not None and self.static.active:
            return self.static_dispatch(x, w13, w2, weights, expert_ids, local_ids, self.static.rows)
        rank, world = self.tp.rank, self.tp.world_size
        dev = self.device_of_expert[expert_ids]  # [T, k]
        owner = dev[:, 0]
        used = torch.zeros(dev.shape[0], world, dtype=torch.bool, device=dev.device)
        used.scatter_(1, dev, True)
        # tokens of each (owner, helper) pair: the same lists on both sides (routing is replicated)
        sends = {d: torch.nonzero((owner == rank) & used[:, d]).flatten() for d in range(world) if d != rank}
        recvs = {s: torch.nonzero((owner == s) & used[:, rank]).flatten() for s in range(world) if s != rank}
        H = x.shape[1]
        row_bytes = H * x.element_size()
        inbox = {s: torch.empty(len(idx), H, dtype=x.dtype, device=x.device) for s, idx in recvs.items()}
        self._exchange({d: x[idx].contiguous() for d, idx in sends.items()}, inbox)
        # the routed output of the tokens this rank owns: its own experts' share ...
        mine = owner == rank
        out = run_local_experts(x, w13, w2, weights, torch.where(mine[:, None], local_ids, -1))
        # ... and, for each owner that sent tokens here, this rank's experts' share of them
        replies = {s: run_local_experts(inbox[s], w13, w2, weights[idx], local_ids[idx]) for s, idx in recvs.items()}
        back = {d: torch.empty(len(idx), H, dtype=x.dtype, device=x.device) for d, idx in sends.items()}
        self._exchange(replies, back)
        for d, idx in sends.items():
            out.index_add_(0, idx, back[d])
        n_sent = sum(len(i) for i in sends.values()) + sum(len(i) for i in recvs.values())
        self.dynamic_bytes += n_sent * row_bytes
        return out

    def static_dispatch(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        expert_ids: torch.Tensor, local_ids: torch.Tensor, real_rows: torch.Tensor) -> torch.Tensor:
        """The dispatch with every shape fixed by x's [T, H] (no host sync, no data-dependent size):
        what __call__'s dynamic path computes, for the first `real_rows` rows (a device scalar; the
        rest are a graph bucket's padding rows: not sent, not counted, their output not used).

        Each exchange is one all_to_all_single of a [world, T, H] buffer: block d holds, at row t,
        token t's row for rank d, zero where token t does not visit d (the capacity per peer is T:
        a token visits each rank at most once). Helpers compute on T rows (a token's row from its
        owner), the owner adds each peer's reply in rank order, as the dynamic path does."""
        rank, world = self.tp.rank, self.tp.world_size
        T, H = x.shape
        ranks = torch.arange(world, device=x.device)
        dev = self.device_of_expert[expert_ids]  # [T, k]
        owner = dev[:, 0]
        used = torch.zeros(T, world, dtype=torch.bool, device=x.device)
        used.scatter_(1, dev, True)
        real = torch.arange(T, device=x.device) < real_rows  # [T]
        mine = owner == rank
        # send[d, t]: token t, owned here, visits rank d (d != rank); helps[t]: token t, owned by
        # another rank, visits this one
        send = (mine & real)[None, :] & used.T & (ranks != rank)[:, None]  # [W, T]
        helps = ~mine & used[:, rank] & real  # [T]
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        outbox = torch.where(send[..., None], x[None], zero).contiguous()  # [W, T, H]
        inbox = torch.empty(outbox.shape, dtype=x.dtype, device=x.device)
        self._all_to_all(inbox, outbox)
        # the routed output of the tokens this rank owns: its own experts' share ...
        out = run_local_experts(x, w13, w2, weights, torch.where(mine[:, None], local_ids, -1))
        # ... and this rank's experts' share of the tokens other ranks sent: row t from its owner
        rows = inbox.gather(0, owner.view(1, T, 1).expand(1, T, H)).squeeze(0)  # [T, H]
        reply = run_local_experts(rows, w13, w2, weights, torch.where(helps[:, None], local_ids, -1))
        to_owner = (owner[None, :] == ranks[:, None]) & helps[None, :]  # [W, T]
        replies = torch.where(to_owner[..., None], reply[None], zero).contiguous()
        back = torch.empty(replies.shape, dtype=x.dtype, device=x.device)
        self._all_to_all(back, replies)
        for d in range(world):
            if d != rank:
                out = out + torch.where(send[d, :, None], back[d], zero)
        self.static_bytes += (send.sum() + helps.sum()) * (H * x.element_size())
        return out

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Block d of input ([W, T, H]) to rank d; block s of output from rank s."""
        W, T, H = input.shape
        dist.all_to_all_single(output.view(W * T, H), input.view(W * T, H), group=self.tp.group)

    def _exchange(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor]) -> None:
        """Send outgoing[peer] to each peer and receive incoming[peer] from it (empty ones skipped)."""
        ops = [dist.P2POp(dist.isend, t, peer, group=self.tp.group) for peer, t in outgoing.items() if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.tp.group) for peer, t in incoming.items() if t.numel()]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
