"""Shard-only loading: a rank reads only its shard's rows of the checkpoint, and gets the same
parameters as cutting the whole loaded model (shard_model), for every architecture, tensor and
expert parallel (contiguous and cluster-map placements), 2 and 4 ranks."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moekv.engine.parallel import placement_of, shard_model
from moekv.layers.parallel import TPGroup, shard_plan
from moekv.models import loader
from moekv.models.loader import Shard, load_model, load_model_config

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "domain-moe"
CLUSTERS = REPO / "benchmarks" / "results" / "cpu" / "domain-moe.clusters4.safetensors"


class Cfg:
    """The EngineConfig fields placement_of reads (its parallel and router groups)."""

    def __init__(self, world: int, expert_parallel: bool, cluster_map=None) -> None:
        self.parallel = SimpleNamespace(tensor_parallel_size=world, enable_expert_parallel=expert_parallel)
        self.router = SimpleNamespace(cluster_map=cluster_map)


def both_ways(path, world: int, rank: int, expert_parallel: bool, cluster_map=None):
    """(cut of the whole model, shard-only load) of one rank, float32 on the CPU."""
    cfg = load_model_config(Path(path))
    tp = TPGroup(rank, world)
    moe_ids = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    placement = placement_of(Cfg(world, expert_parallel, cluster_map), cfg, moe_ids)
    whole = load_model(path, torch.float32, torch.device("cpu"), cfg)
    shard_model(whole, cfg, tp, placement)
    shard = Shard(cut=lambda m: shard_model(m, cfg, tp, placement), plan=lambda m: shard_plan(m, cfg, tp, placement))
    part = load_model(path, torch.float32, torch.device("cpu"), cfg, shard=shard)
    return whole, part


def assert_same(whole, part):
    a, b = dict(whole.named_parameters()), dict(part.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
    for wl, pl in zip(whole.layers, part.layers):
        assert wl.self_attn.num_heads == pl.self_attn.num_heads
        assert wl.self_attn.num_kv_heads == pl.self_attn.num_kv_heads


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_shard_only_load_equals_the_cut_whole_model(arch, expert_parallel, checkpoints):
    for rank in range(2):
        assert_same(*both_ways(checkpoints[arch], 2, rank, expert_parallel))


def test_four_ranks_with_replicated_kv_heads(mixtral_ckpt):
    for rank in range(4):
        assert_same(*both_ways(mixtral_ckpt, 4, rank, True))


def test_cluster_map_placement_reads_only_the_ranks_experts(monkeypatch):
    """domain-moe (16 experts a layer) with its 4-cluster map over 2 ranks: rank 1 reads none of rank
    0's experts' tensors, and gets the parameters the cut whole model has."""
    read = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            read.append(name)
            return self.inner.get_slice(name)

    whole, _ = both_ways(MODEL, 2, 1, True, CLUSTERS)
    monkeypatch.setattr(loader, "safe_open", Recording)
    cfg = load_model_config(MODEL)
    tp = TPGroup(1, 2)
    placement = placement_of(Cfg(2, True, CLUSTERS), cfg, list(range(cfg.num_layers)))
    shard = Shard(cut=lambda m: shard_model(m, cfg, tp, placement), plan=lambda m: shard_plan(m, cfg, tp, placement))
    part = load_model(MODEL, torch.float32, torch.device("cpu"), cfg, shard=shard)
    assert_same(whole, part)
    experts_read = {(int(n.split(".")[2]), int(n.split(".")[5])) for n in read if ".experts." in n}
    mine = {(layer, int(e)) for layer, where in placement.items() for e in torch.nonzero(where == 1).flatten()}
    assert experts_read == mine and 0 < len(mine) < cfg.num_layers * cfg.num_experts


@pytest.mark.parametrize("transposed", [False, True], ids=["stacked", "stacked-transposed"])
def test_stacked_expert_tensors(tmp_path, transposed):
    """domain-moe rewritten with its experts stacked per layer (gate_up_proj [E, 2I, H], down_proj
    [E, H, I], as transformers >= 5 may save them, or with the last two dims swapped; its
    shapes are not square, so a swap is visible): both ways agree, and the whole model equals the
    one loaded from the shipped per-expert checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(MODEL / "config.json", tmp_path / "config.json")
    tensors = load_file(str(MODEL / "model.safetensors"))
    cfg = load_model_config(tmp_path)
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        def w(e, name):
            return tensors[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{name}.weight"]

        gate_up = torch.stack([torch.cat([w(e, "w1"), w(e, "w3")]) for e in range(cfg.num_experts)])
        down = torch.stack([w(e, "w2") for e in range(cfg.num_experts)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.contiguous()
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = down.contiguous()
    save_file(stacked, str(tmp_path / "model.safetensors"))
    reference = load_model(MODEL, torch.float32, torch.device("cpu"))
    assert_same(reference, load_model(tmp_path, torch.float32, torch.device("cpu")))
    for expert_parallel, cluster_map in ((False, None), (True, None), (True, CLUSTERS)):
        for rank in range(2):
            assert_same(*both_ways(tmp_path, 2, rank, expert_parallel, cluster_map))
