"""Placement: which device (EP rank) holds each expert, and what a routing decision costs under it.

One cluster per device by default (cluster c -> device c mod D), so a token routed inside one
cluster touches one device. For a batch of decisions expert_ids [T, k] (best first):
- locality: share of the token's k assignments that live on the device of its top-1 expert;
- fan-out: mean number of distinct devices a token's experts occupy (max_fan_out: the most any
  token's did, which group-limited routing under its grouped placement bounds by topk_group);
- cross-device bytes per token: a token is processed on its top-1 expert's device and its hidden
  state goes to, and its expert output comes back from, every other device it uses:
  2 x H x bytes per element per remote device, summed over the MoE layers.
A random placement (equal expert counts per device, drawn independently per layer) is the baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Placement:
    device_of_expert: dict[int, torch.Tensor]  # MoE layer -> [E] int64 device of each expert
    num_devices: int
    name: str

    @classmethod
    def from_clusters(cls, cluster_map, num_devices: int | None = None) -> "Placement":
        """Cluster c of every layer on device c mod num_devices (default: one cluster per device)."""
        num_devices = num_devices or cluster_map.num_clusters
        if cluster_map.num_clusters % num_devices:
            raise ValueError(f"num_devices={num_devices} must divide the number of clusters "
                             f"({cluster_map.num_clusters})")
        return cls({i: layer.cluster_of_expert() % num_devices for i, layer in cluster_map.layers.items()},
                   num_devices, "clustered")

    @classmethod
    def random(cls, layers: list[int], num_experts: int, num_devices: int, seed: int = 0) -> "Placement":
        if num_experts % num_devices:
            raise ValueError(f"num_devices={num_devices} must divide num_experts={num_experts}")
        gen = torch.Generator().manual_seed(seed)
        devices = {}
        for i in layers:
            d = torch.empty(num_experts, dtype=torch.long)
            d[torch.randperm(num_experts, generator=gen)] = torch.arange(num_experts) % num_devices
            devices[i] = d
        return cls(devices, num_devices, f"random(seed={seed})")


class PlacementStats:
    """Accumulates locality, fan-out and remote devices per token over batches of decisions."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.local = self.assignments = self.devices = self.tokens = 0
        self.per_layer: dict[int, list[float]] = {}  # layer -> [local, assignments, devices, tokens]
        self.max_devices: dict[int, int] = {}  # layer -> the most devices one token's experts occupied

    def add(self, layer_idx: int, expert_ids: torch.Tensor) -> None:
        dev = self.placement.device_of_expert[layer_idx].to(expert_ids.device)[expert_ids]  # [T, k]
        local = int((dev == dev[:, :1]).sum())
        used = torch.zeros(dev.shape[0], self.placement.num_devices, dtype=torch.bool, device=dev.device)
        used.scatter_(1, dev, True)
        devices = int(used.sum())
        if dev.shape[0]:
            self.max_devices[layer_idx] = max(self.max_devices.get(layer_idx, 0), int(used.sum(1).max()))
        row = self.per_layer.setdefault(layer_idx, [0, 0, 0, 0])
        for j, v in enumerate((local, dev.numel(), devices, dev.shape[0])):
            row[j] += v

    @staticmethod
    def _summary(local, assignments, devices, tokens) -> dict:
        return {"locality": local / max(assignments, 1), "fan_out": devices / max(tokens, 1)}

    def summary(self, hidden_size: int, bytes_per_element: int = 2) -> dict:
        """locality and fan_out over all MoE layers; cross-device bytes per token summed over layers
        (and per layer)."""
        totals = [sum(row[j] for row in self.per_layer.values()) for j in range(4)]
        out = self._summary(*totals)
        out["max_fan_out"] = max(self.max_devices.values(), default=0)
        per_token = 2 * hidden_size * bytes_per_element
        remote_per_token = sum((row[2] - row[3]) / max(row[3], 1) for row in self.per_layer.values())
        out["cross_device_bytes_per_token"] = per_token * remote_per_token
        out["per_layer"] = {i: {**self._summary(*row), "max_fan_out": self.max_devices.get(i, 0),
                                "cross_device_bytes_per_token": per_token * (row[2] - row[3]) / max(row[3], 1)}
                            for i, row in sorted(self.per_layer.items())}
        out["placement"] = self.placement.name
        out["num_devices"] = self.placement.num_devices
        return out


class LocalityCounter:
    """Running locality and fan-out of the decisions a model makes while it serves, kept in device
    tensors: adding a batch is in-place device work (no host sync), so a CUDA graph captures it and
    every replay counts again. The engine installs one observer per MoE layer (`observer`) before
    it captures graphs; `snapshot()` reads the totals back (a sync).

    counted_rows: how many leading rows of the step are real tokens (a replayed decode step pads
    its batch to a bucket with rows that must not count); the engine sets it before every step."""

    def __init__(self, placement: Placement, device: torch.device) -> None:
        self.device_of_expert = {i: d.to(device) for i, d in placement.device_of_expert.items()}
        self.num_devices = placement.num_devices
        self.placement_name = placement.name
        # local assignments, assignments, (token, device) pairs used, tokens
        self.totals = torch.zeros(4, dtype=torch.float64, device=device)
        self.counted_rows = torch.zeros((), dtype=torch.long, device=device)

    def count_rows(self, rows: int) -> None:
        """The next steps' first `rows` rows are real (stream-ordered before them)."""
        self.counted_rows.fill_(rows)

    def observer(self, layer_idx: int) -> "LayerLocalityObserver":
        return LayerLocalityObserver(self, layer_idx)

    def add(self, layer_idx: int, expert_ids: torch.Tensor) -> None:
        dev = self.device_of_expert[layer_idx][expert_ids]  # [T, k]
        real = torch.arange(dev.shape[0], device=dev.device) < self.counted_rows  # [T]
        used = torch.zeros(dev.shape[0], self.num_devices, dtype=torch.bool, device=dev.device)
        used.scatter_(1, dev, True)
        tokens = real.sum()
        batch = torch.stack([((dev == dev[:, :1]) & real[:, None]).sum(), tokens * dev.shape[1],
                             (used & real[:, None]).sum(), tokens])
        self.totals += batch.to(torch.float64)

    def snapshot(self) -> dict:
        local, assignments, devices, tokens = self.totals.tolist()
        return {"locality": local / assignments if assignments else float("nan"),
                "fan_out": devices / tokens if tokens else float("nan"), "decisions": int(tokens)}


class LayerLocalityObserver:
    """One MoE layer's RoutingObserver (routing/base.py): adds its decisions to a LocalityCounter."""

    def __init__(self, counter: LocalityCounter, layer_idx: int) -> None:
        self.counter, self.layer_idx = counter, layer_idx

    def __call__(self, weights: torch.Tensor, expert_ids: torch.Tensor) -> None:
        self.counter.add(self.layer_idx, expert_ids)
