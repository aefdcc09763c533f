"""The cluster map file: for each MoE layer, a partition of its experts into C equal clusters and a
coarse gate (C rows, one bias each) that scores the clusters from the router's input.

Stored as safetensors: tensors `layers.<l>.experts` [C, M] int64, `layers.<l>.coarse_weight` [C, H],
`layers.<l>.coarse_bias` [C], `layers.<l>.admit_margin` [1] (the layer's calibrated margin for
admitting a further cluster; inf = all clusters, -inf = one), `layers.<l>.router_probe` [E, 16] (the first
router columns, to tell this checkpoint from another of the same shape); metadata (strings) names
the model it was made for (architecture, num_layers, num_experts, hidden_size, top_k), the most
clusters a token may use, and a JSON summary of the calibration.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "moekv-cluster-map"
VERSION = "1"
PROBE_COLUMNS = 16


class ClusterMapError(ValueError):
    """A cluster map that does not fit the model (or is not a cluster map); the message says why."""


@dataclass
class LayerClusters:
    experts: torch.Tensor  # [C, M] int64 expert ids, each expert exactly once
    coarse_weight: torch.Tensor  # [C, H] fp32
    coarse_bias: torch.Tensor  # [C] fp32
    router_probe: torch.Tensor | None = None  # [E, PROBE_COLUMNS] fp32
    admit_margin: float = float("inf")  # see cluster_routing_ref (inf: all clusters, -inf: one)

    @property
    def num_clusters(self) -> int:
        return int(self.experts.shape[0])

    def cluster_of_expert(self) -> torch.Tensor:
        """[E] int64: the cluster each expert belongs to."""
        out = torch.empty(self.experts.numel(), dtype=torch.long)
        out[self.experts.flatten()] = torch.arange(self.num_clusters).repeat_interleave(self.experts.shape[1])
        return out


@dataclass
class ClusterMap:
    architecture: str
    num_layers: int
    num_experts: int
    hidden_size: int
    top_k: int
    layers: dict[int, LayerClusters]  # MoE layer index -> its clusters
    clusters_per_token: int = 0  # most clusters a token may use; 0 = all C
    summary: dict = field(default_factory=dict)

    @property
    def num_clusters(self) -> int:
        return next(iter(self.layers.values())).num_clusters

    def validate(self) -> None:
        """Every layer: C equal clusters covering each expert exactly once; gate shapes agree."""
        if not self.layers:
            raise ClusterMapError("the cluster map holds no layers")
        for idx, layer in self.layers.items():
            experts = layer.experts
            if experts.dim() != 2 or experts.numel() != self.num_experts:
                raise ClusterMapError(f"layer {idx}: clusters hold {experts.numel()} expert slots in shape "
                                      f"{tuple(experts.shape)}; "
                                      f"expected C equal clusters of {self.num_experts} experts")
            if sorted(experts.flatten().tolist()) != list(range(self.num_experts)):
                raise ClusterMapError(f"layer {idx}: clusters must cover experts "
                                      f"0..{self.num_experts - 1} exactly once")
            if experts.shape[1] < self.top_k:
                raise ClusterMapError(f"layer {idx}: clusters of {experts.shape[1]} experts "
                                      f"cannot hold top_k={self.top_k}")
            C = experts.shape[0]
            if tuple(layer.coarse_weight.shape) != (C, self.hidden_size) or tuple(layer.coarse_bias.shape) != (C,):
                raise ClusterMapError(f"layer {idx}: coarse gate has shape {tuple(layer.coarse_weight.shape)} / "
                                      f"{tuple(layer.coarse_bias.shape)}; expected ({C}, {self.hidden_size}) / ({C},)")
            if layer.admit_margin != layer.admit_margin:
                raise ClusterMapError(f"layer {idx}: admit_margin is NaN")
            if C != self.num_clusters:
                raise ClusterMapError(f"layer {idx} has {C} clusters, other layers {self.num_clusters}")

    def check_model(self, model_cfg, routers: dict[int, torch.Tensor] | None = None, source: str = "") -> None:
        """Reject a map made for another model: architecture, sizes, MoE layers, and (given the
        model's router weights, layer -> [E, H]) the router columns it was made from."""
        where = f"cluster map {source}" if source else "cluster map"
        made_for = (f"{self.architecture} with {self.num_layers} layers, {self.num_experts} experts per layer, "
                    f"hidden size {self.hidden_size}, top-{self.top_k}")
        model = (f"{model_cfg.architecture} with {model_cfg.num_layers} layers, {model_cfg.num_experts} experts per "
                 f"layer, hidden size {model_cfg.hidden_size}, top-{model_cfg.top_k}")
        if (self.architecture, self.num_layers, self.num_experts, self.hidden_size, self.top_k) != (
                model_cfg.architecture, model_cfg.num_layers, model_cfg.num_experts, model_cfg.hidden_size,
                model_cfg.top_k):
            raise ClusterMapError(f"{where} was made for {made_for}; this model is {model}: "
                                  f"run `moekv cluster` on this model")
        moe_layers = [i for i, m in enumerate(model_cfg.moe_layers) if m]
        if sorted(self.layers) != moe_layers:
            raise ClusterMapError(f"{where} covers layers {sorted(self.layers)}; "
                                  f"this model's MoE layers are {moe_layers}")
        for idx, gate in (routers or {}).items():
            probe = self.layers[idx].router_probe
            if probe is None:
                continue
            ours = gate.detach().float().cpu()[:, :PROBE_COLUMNS]
            scale = ours.abs().max().item() + 1e-12
            diff = (probe - ours).abs().max().item()
            if diff > 1e-2 * scale:  # bf16 vs fp32 loading differs by < 0.4%
                raise ClusterMapError(f"{where}: the router weights of layer {idx} differ from those the map was made "
                                      f"from (max difference {diff:.3g}, {diff / scale:.1%} of their range): it "
                                      f"belongs to another checkpoint of the same shape; "
                                      f"run `moekv cluster` on this model")

    # -- file ------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        self.validate()
        tensors = {}
        for idx, layer in self.layers.items():
            tensors[f"layers.{idx}.experts"] = layer.experts.to(torch.int64).contiguous()
            tensors[f"layers.{idx}.coarse_weight"] = layer.coarse_weight.float().contiguous()
            tensors[f"layers.{idx}.coarse_bias"] = layer.coarse_bias.float().contiguous()
            tensors[f"layers.{idx}.admit_margin"] = torch.tensor([float(layer.admit_margin)])
            if layer.router_probe is not None:
                tensors[f"layers.{idx}.router_probe"] = layer.router_probe.float().contiguous()
        meta = {"format": FORMAT, "version": VERSION, "architecture": self.architecture,
                "num_layers": str(self.num_layers), "num_experts": str(self.num_experts),
                "hidden_size": str(self.hidden_size), "top_k": str(self.top_k),
                "clusters_per_token": str(self.clusters_per_token),
                "summary": json.dumps(self.summary)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ClusterMap":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cluster map not found: {path} (make one with `moekv cluster`)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own types for a file of another kind
            raise ClusterMapError(f"{path} is not a cluster map (cannot read it as safetensors: {e})") from e
        if meta.get("format") != FORMAT:
            raise ClusterMapError(f"{path} is not a cluster map (metadata format={meta.get('format')!r}, "
                                  f"expected {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise ClusterMapError(f"{path}: cluster map version {meta.get('version')!r} is not supported; "
                                  f"accepted: {VERSION}")
        layer_ids = sorted({int(name.split(".")[1]) for name in tensors})
        try:
            layers = {i: LayerClusters(tensors[f"layers.{i}.experts"], tensors[f"layers.{i}.coarse_weight"],
                                       tensors[f"layers.{i}.coarse_bias"], tensors.get(f"layers.{i}.router_probe"),
                                       float(tensors[f"layers.{i}.admit_margin"][0]))
                      for i in layer_ids}
            cmap = cls(architecture=meta["architecture"], num_layers=int(meta["num_layers"]),
                       num_experts=int(meta["num_experts"]), hidden_size=int(meta["hidden_size"]),
                       top_k=int(meta["top_k"]), layers=layers, clusters_per_token=int(meta["clusters_per_token"]),
                       summary=json.loads(meta.get("summary") or "{}"))
        except (KeyError, ValueError) as e:
            raise ClusterMapError(f"{path}: cluster map is incomplete or malformed ({e!r})") from e
        cmap.validate()
        return cmap
