"""Expert parallel token dispatch over 2 gloo processes: the bytes the ranks really send, against
what the placement statistics (routing/placement.py) predict from the same routing decisions."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.eval.routing import evaluate_routing
from moekv.routing.cluster_map import ClusterMap, LayerClusters
from tests.checkpoints import CORPUS

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [12, 13, 14]}]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=48,
              tensor_parallel_size=2, enable_expert_parallel=True, distributed_timeout=60)


@pytest.fixture(scope="module")
def cluster_map(tmp_path_factory):
    """4 clusters of 2 experts per layer (cluster c on rank c mod 2), a random coarse gate, up to 2
    clusters a token (the second admitted within a margin)."""
    g = torch.Generator().manual_seed(0)
    layers = {i: LayerClusters(torch.randperm(8, generator=g).view(4, 2), torch.randn(4, 64, generator=g),
                               torch.zeros(4), admit_margin=1.0) for i in range(2)}
    cmap = ClusterMap("MixtralForCausalLM", 2, 8, 64, 2, layers, clusters_per_token=2)
    return cmap.save(tmp_path_factory.mktemp("cmap") / "map.safetensors")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "eval.txt"
    path.write_text(CORPUS)
    return path


def routed(model, text, **kwargs):
    """(eval routing record, greedy tokens) of a 2-rank expert-parallel engine."""
    llm = LLM(model=str(model), **ENGINE, **kwargs)
    try:
        record = evaluate_routing(llm, text, max_tokens=160, window=64, progress=False, random_seeds=0)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
        return record, tokens
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def flat(mixtral_ckpt, text, cluster_map):
    return routed(mixtral_ckpt, text, routing="flat", cluster_map=cluster_map)


@pytest.fixture(scope="module")
def hierarchical(mixtral_ckpt, text, cluster_map):
    return routed(mixtral_ckpt, text, routing="hierarchical", cluster_map=cluster_map)


@pytest.mark.slow
def test_real_bytes_equal_the_placement_prediction(flat, hierarchical):
    for record, _ in (flat, hierarchical):
        # the engine's placement is the map's: cluster c on rank c mod 2
        assert record["placements"]["engine"]["locality"] == record["placements"]["clustered"]["locality"]
        for layer in record["per_layer"].values():
            assert layer["ep_bytes_per_token"] == pytest.approx(layer["simulated_bytes_per_token"], rel=1e-12)
        assert record["ep_bytes_per_token"] == pytest.approx(
            record["placements"]["engine"]["cross_device_bytes_per_token"], rel=1e-12)
    # (a token's hidden state, 64 fp32, goes out and its experts' output comes back: 512 bytes per remote rank)
    assert flat[0]["ep_bytes_per_token"] > 0 and hierarchical[0]["ep_bytes_per_token"] > 0


def test_hierarchical_routing_sends_fewer_bytes_than_flat(flat, hierarchical):
    assert hierarchical[0]["ep_bytes_per_token"] < 0.8 * flat[0]["ep_bytes_per_token"]
    assert hierarchical[0]["fan_out"] < flat[0]["fan_out"]


def test_cluster_placement_gives_the_tokens_of_a_contiguous_one(mixtral_ckpt, flat):
    llm = LLM(model=str(mixtral_ckpt), **ENGINE)  # no cluster map: experts 0-3 on rank 0, 4-7 on rank 1
    try:
        assert llm.engine.runner.expert_placement[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))]
    finally:
        llm.engine.shutdown()
    assert tokens == flat[1]
