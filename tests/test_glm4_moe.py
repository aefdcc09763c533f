"""Glm4MoeForCausalLM (GLM-4.5) against transformers on tiny random checkpoints, its KV formats,
its multi-token-prediction layers, its unsupported variants and its group placement.

Two checkpoints cover the features: `glm_a` (tests/checkpoints.py's glm4_moe: 1 KV head, head_dim
32 with RoPE on 16 of it, q/k-norm and q/k/v biases on, a dense first layer, 32 experts top-4 in 4
groups of which 2 are kept, routed_scaling_factor 2.5) and `glm_b` (8 KV heads = 8 query heads,
head_dim 16 with RoPE on 12, q/k-norm and biases off, no dense layer, 128 experts top-8 in 8 groups
of which 4 are kept, two shared experts, no renormalisation). Both draw a non-zero selection bias.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekv import LLM, SamplingParams
from moekv.models.loader import CheckpointError, load_model_config
from moekv.models.model_config import UnsupportedModelError
from tests.checkpoints import build_checkpoint, load_hf
from tests.kv_formats import engine_kwargs_for, self_contained_compressed
from tests.test_hf_parity import PROMPTS

VARIANTS = {
    "glm_a": {},
    "glm_b": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=16, use_qk_norm=False, attention_bias=False,
                  first_k_dense_replace=0, n_routed_experts=128, num_experts_per_tok=8, n_group=8, topk_group=4,
                  n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
}


@pytest.fixture(scope="module")
def glm_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    return {name: build_checkpoint("glm4_moe", root / name, seed=10 + i, **overrides)
            for i, (name, overrides) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="module", params=list(VARIANTS))
def glm_pair(request, glm_ckpts):
    path = glm_ckpts[request.param]
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12)  # chunked prefill
    return request.param, hf, llm


def test_config_maps_glm_features(glm_ckpts):
    a, b = (load_model_config(glm_ckpts[name]) for name in ("glm_a", "glm_b"))
    assert a.architecture == "Glm4MoeForCausalLM"
    assert (a.head_dim, a.rotary_dim, a.num_kv_heads, a.qk_norm, a.qkv_bias, a.o_bias) == (32, 16, 1, "per_head",
                                                                                          True, False)
    assert a.moe_layers == [False, True, True] and a.dense_intermediate_size == 96
    assert (a.scoring_func, a.router_bias, a.n_group, a.topk_group, a.routed_scaling_factor) == ("sigmoid", True, 4,
                                                                                                2, 2.5)
    assert a.shared_expert_intermediate_size == 16 and not a.shared_expert_gated and a.norm_topk_prob
    assert a.num_skipped_layers == 1  # transformers writes num_nextn_predict_layers=1
    assert (b.rotary_dim, b.num_kv_heads, b.qk_norm, b.qkv_bias) == (12, 8, None, False)
    assert b.moe_layers == [True] * 3 and b.shared_expert_intermediate_size == 32 and not b.norm_topk_prob
    assert (b.num_experts, b.top_k, b.n_group, b.topk_group) == (128, 8, 8, 4)


# GLM-4.5-Air's config.json as zai-org ships it (transformers 4 keys: partial_rotary_factor and rope_theta at
# the top level, rope_scaling null)
GLM_45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
              "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
              "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
              "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
              "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
              "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
              "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
              "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}


def test_glm_45_air_config(tmp_path):
    """The released GLM-4.5-Air config maps to 106B parameters with 12B active besides the embeddings, as
    its model card says, RoPE on 64 of 128, one dense layer and one MTP layer skipped."""
    (tmp_path / "config.json").write_text(json.dumps(GLM_45_AIR))
    cfg = load_model_config(tmp_path)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.num_skipped_layers) == (64, 1e6, 1)
    assert cfg.moe_layers[:2] == [False, True] and sum(cfg.moe_layers) == 45
    assert cfg.eos_token_ids == [151329, 151336, 151338] and cfg.torch_dtype == torch.bfloat16
    total, active = cfg.parameter_counts()
    assert 106e9 <= total < 107e9
    assert 12e9 <= active - 2 * cfg.vocab_size * cfg.hidden_size < 12.5e9


def test_logits_match_transformers(glm_pair):
    """Prompt logits through the paged cache (chunked prefill included) equal transformers' to 1e-4."""
    name, hf, llm = glm_pair
    assert llm.engine.runner.routing == "group_limited"
    ours = llm.score([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4, name


def test_greedy_generation_matches_transformers(glm_pair):
    """16 greedy tokens per prompt, in one batch, equal transformers.generate token for token."""
    name, hf, llm = glm_pair
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), name


def test_partial_rotary_reference_is_transformers_glm_rope():
    """ops/reference's partial RoPE equals transformers' Glm4Moe rotary embedding and
    apply_rotary_pos_emb (float64, head_dim 128 with 64 rotated as GLM-4.5 has it)."""
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    from moekv.ops.reference import apply_rotary_ref, rotary_cos_sin_ref

    cfg = glm.Glm4MoeConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    positions = torch.tensor([0, 3, 100, 4000])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 128, generator=g).double(), torch.randn(4, 1, 128, generator=g).double()
    cos, sin = glm.Glm4MoeRotaryEmbedding(cfg)(q, positions[None])
    q_hf, k_hf = glm.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = rotary_cos_sin_ref(positions, 64, cfg.rope_parameters["rope_theta"], torch.float64)
    torch.testing.assert_close(apply_rotary_ref(q, *ours), q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary_ref(k, *ours), k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_selection_bias_changes_choices(glm_ckpts):
    """The checkpoints' selection bias matters: without it the routers choose other experts for some
    tokens (so the parity above checks the bias, not a bias that changes nothing)."""
    from moekv.ops.reference import fused_routing_ref

    hf = load_hf(glm_ckpts["glm_a"])
    gate = hf.model.layers[1].mlp.gate
    x = torch.randn(64, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits = x @ gate.weight.T
    with_bias = fused_routing_ref(logits, 4, True, "sigmoid", gate.e_score_correction_bias, 4, 2, 2.5)[1]
    without = fused_routing_ref(logits, 4, True, "sigmoid", None, 4, 2, 2.5)[1]
    assert not torch.equal(with_bias.sort(1).values, without.sort(1).values)
    assert gate.e_score_correction_bias.abs().max() > 0


LONG_PROMPT = [(7 * i) % 300 + 2 for i in range(70)]  # fills a 64-token page
# every format but vq (it needs calibration tables: random ones below) and tiered (re-ranks its pages: its
# own options below)
def test_selection_bias_stays_float32_in_a_bf16_model(glm_ckpts):
    """A bf16 model keeps the checkpoint's float32 selection bias bit for bit (as transformers does),
    the router rows in bf16."""
    from moekv.models.loader import load_model, moe_layers

    path = glm_ckpts["glm_a"]
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    stored = load_file(str(path / "model.safetensors"))
    for i, moe in moe_layers(model).items():
        bias = moe.e_score_correction_bias
        assert bias.dtype == torch.float32 and moe.gate.dtype == torch.bfloat16
        assert torch.equal(bias, stored[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])


FORMATS = ["bf16", "fp16", *self_contained_compressed(), "vq", "tiered"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cpu_kv_format_runs_glm(glm_ckpts, fmt, tmp_path):
    """Each KV format the CPU runs serves GLM's partial-RoPE heads (head_dim 32, one KV head): the
    prompt's first token (computed from the K/V as computed) equals the float32 cache's, and the long
    prompt's continuation reads full (compressed) pages."""
    path = glm_ckpts["glm_a"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (*PROMPTS[:2], LONG_PROMPT)]
    ref = LLM(path, dtype="float32", max_model_len=128).generate(prompts, params)
    extra = {}
    if fmt == "vq":
        from moekv.kvcache.formats.vq import random_calibration

        extra = {"kv_calibration": str(random_calibration(tmp_path, 1, 32, num_layers=3, iters=1, max_vectors=256))}
    elif fmt == "tiered":
        extra = {"block_size": 16, "kv_rerank_interval": 2, "kv_tier1_fraction": 0.3}
    llm = LLM(path, dtype="float32", max_model_len=128, **engine_kwargs_for(fmt, **extra))
    outs = llm.generate(prompts, params)
    for out, want in zip(outs, ref):
        ids = out.outputs[0].token_ids
        assert len(ids) == 20 and all(0 <= t < 320 for t in ids)
        assert ids[0] == want.outputs[0].token_ids[0], fmt
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_head_groups_the_gluon_kernels_take_in_parts_stay_on_them_under_auto(glm_ckpts):
    """decode_kernel 'auto' stands for 12 query heads per KV head (GLM-4.5's 96 / 8), which the Gluon kernels
    take in two parts (8 + 4), and becomes 'triton' for 15 (four parts), as the engine builds the format;
    'gluon' stands."""
    from moekv.config import EngineConfig
    from moekv.engine.model_runner import kv_format_for
    from moekv.kvcache.formats.fragment import decode_kernel_for_model

    assert decode_kernel_for_model("auto", 96, 8) == "auto" and decode_kernel_for_model("auto", 120, 8) == "triton"
    assert decode_kernel_for_model("auto", 64, 8) == "auto" and decode_kernel_for_model("gluon", 120, 8) == "gluon"
    cfg = load_model_config(glm_ckpts["glm_a"])  # 4 / 1
    config = EngineConfig(kv_cache_dtype="nuq2")
    assert kv_format_for(config, torch.bfloat16, cfg).decode_kernel == "auto"
    cfg.num_heads = 12
    assert kv_format_for(config, torch.bfloat16, cfg).decode_kernel == "auto"
    cfg.num_heads = 15
    assert kv_format_for(config, torch.bfloat16, cfg).decode_kernel == "triton"
    config = EngineConfig(kv_cache_dtype="nuq2", decode_kernel="gluon")
    assert kv_format_for(config, torch.bfloat16, cfg).decode_kernel == "gluon"


def _add_mtp_layer(path, num_layers):
    """Write tensors of a multi-token-prediction layer after the decoder's, named as GLM-4.5 stores them."""
    tensors = load_file(str(path / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = f"model.layers.{num_layers}"
    extra = {f"{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden), f"{mtp}.enorm.weight": torch.ones(hidden),
             f"{mtp}.hnorm.weight": torch.ones(hidden), f"{mtp}.shared_head.norm.weight": torch.ones(hidden),
             f"{mtp}.input_layernorm.weight": torch.ones(hidden)}
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_mtp_layers_are_skipped(glm_ckpts, tmp_path):
    """The tensors of num_nextn_predict_layers layers after the decoder are skipped (`moekv info` says
    so: test_info_describes_glm); the same tensors in a checkpoint that declares no such layer, or a
    layer after the MTP ones, are an error naming them."""
    import shutil

    path = shutil.copytree(glm_ckpts["glm_a"], tmp_path / "with_mtp")
    _add_mtp_layer(path, 3)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    logits = LLM(path, dtype="float32", max_model_len=64).score(prompt)[0]
    want = LLM(glm_ckpts["glm_a"], dtype="float32", max_model_len=64).score(prompt)[0]
    assert torch.equal(logits, want)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight"):
        LLM(path, dtype="float32", max_model_len=64)
    config["num_nextn_predict_layers"], config["num_hidden_layers"] = 1, 2  # layer 3 is now past the MTP layer
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\."):
        LLM(path, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("change, message", [
    ({"partial_rotary_factor": 0.3}, "rotates 9 elements; accepted: a factor giving an even number"),
    ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 is not supported; accepted: \(0, 1\]"),
    ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported; accepted: 1 or more"),
    ({"rope_type": "yarn"}, "rope type 'yarn' is not supported yet; accepted: 'default'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; accepted: 'silu'"),
])
def test_unsupported_variants_name_what_is_accepted(glm_ckpts, tmp_path, change, message):
    config = json.loads((glm_ckpts["glm_a"] / "config.json").read_text())
    for key, value in change.items():
        if key in ("partial_rotary_factor", "rope_type"):
            config["rope_parameters"][key] = value
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(tmp_path)


def test_group_placement_bounds_devices_per_token(glm_ckpts, tmp_path):
    """eval routing under the grouped placement (each of the 4 expert groups on its own device):
    no token's experts span more than topk_group=2 devices, measured; flat routing and random
    placements span more, and cross more bytes."""
    from moekv.eval.routing import evaluate_routing
    from tests.checkpoints import CORPUS

    text = tmp_path / "text.txt"
    text.write_text(CORPUS)
    llm = LLM(glm_ckpts["glm_a"], dtype="float32", max_model_len=64)
    record = evaluate_routing(llm, text, max_tokens=120, progress=False, random_seeds=2)
    grouped, random = record["placements"]["grouped"], record["placements"]["random"]
    assert record["placement"] == "grouped" and grouped["num_devices"] == 4
    assert record["max_fan_out"] == grouped["max_fan_out"] <= 2
    assert all(layer["max_fan_out"] <= 2 for layer in grouped["per_layer"].values())
    assert random["max_fan_out"] > 2 and random["fan_out"] > grouped["fan_out"]
    assert grouped["cross_device_bytes_per_token"] < random["cross_device_bytes_per_token"]
    # the model's own routing without groups (its flat reference) crosses groups
    flat_grouped = record["flat_placements"]["grouped"]
    assert flat_grouped["max_fan_out"] > 2
    assert flat_grouped["cross_device_bytes_per_token"] > grouped["cross_device_bytes_per_token"]


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2+ep"])
def test_two_ranks_match_one_process(glm_ckpts, expert_parallel):
    """Tensor (and expert) parallelism over 2 CPU processes (gloo): glm_a's single KV head replicated on
    both ranks, q/k/v biases and per-head norms cut with their heads, the ungated shared expert and the
    dense layer cut along their intermediate dimension, the routers (with the bias) replicated."""
    from tests.test_parallel import run

    ref_tokens, ref_logits, _ = run(glm_ckpts["glm_a"])
    tokens, logits, stats = run(glm_ckpts["glm_a"], tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                                distributed_timeout=60)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert (ours - ref).abs().max() < 1e-5
    assert (stats.ep_bytes_sent is not None and stats.ep_bytes_sent > 0) == expert_parallel


def test_info_describes_glm(glm_ckpts):
    """`moekv info` names GLM's partial RoPE, ungated shared expert, routing and skipped MTP layer."""
    from tests.test_cli import run_cli

    r = run_cli("info", "--model", str(glm_ckpts["glm_a"]))
    assert r.returncode == 0, r.stderr
    assert "Glm4MoeForCausalLM" in r.stdout and "3 (2 with experts)" in r.stdout
    assert "4 query / 1 KV, head_dim 32, RoPE on its first 16" in r.stdout
    assert "shared expert 16 (ungated)" in r.stdout
    assert "sigmoid scores, selection bias, top-2 of 4 expert groups, weights x 2.5, renormalised" in r.stdout
    assert "MTP layers        1 after the decoder, not run" in r.stdout
    assert "nuq2" in r.stdout and "bytes/token" in r.stdout


# -- CUDA: the fused kernels (partial RoPE + KV write, group-limited routing with the bias, the MoE
# GEMM/GEMV with an ungated shared expert) and CUDA graphs ------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_matches_transformers(glm_ckpts):
    """float32 on CUDA (the Triton GEMMs may multiply in TF32): logits within 1e-3 of transformers, 8
    greedy tokens equal to the CPU path's for both checkpoints."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, path in glm_ckpts.items():
        hf = load_hf(path)
        gpu = LLM(path, dtype="float32", device="cuda", max_model_len=128)
        for prompt, logits in zip(PROMPTS, gpu.score(prompts)):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            assert (logits.cpu() - ref).abs().max().item() < 1e-3, name
        cpu = LLM(path, dtype="float32", max_model_len=128)
        got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
        want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
        assert got == want, name


@pytest.fixture(scope="module")
def hd128_ckpts(tmp_path_factory):
    """GLM-4.5's head_dim 128 (RoPE on 64) at 2 query heads per KV head (the Gluon kernels take it) and at
    12 (GLM-4.5's 96 / 8: on sm_90 the Gluon kernels in two parts, 8 + 4 heads; the Triton kernels elsewhere)."""
    root = tmp_path_factory.mktemp("glm_hd128")
    return {f"G{q // kv}": build_checkpoint("glm4_moe", root / f"G{q // kv}", seed=3, head_dim=128,
                                            num_attention_heads=q, num_key_value_heads=kv)
            for q, kv in ((4, 2), (12, 1))}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("group", ["G2", "G12"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "int4", "nuq2", "kivi2", "tiered"])
def test_cuda_bf16_glm_head_geometry_every_format(fmt, group, hd128_ckpts):
    """GLM-4.5's head geometry in bf16 on CUDA through each format's decode kernels and graphs: the
    first tokens agree with the bf16 cache's and every page returns."""
    path = hd128_ckpts[group]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (*PROMPTS, LONG_PROMPT)]
    engine = dict(dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=4)
    ref = LLM(path, kv_cache_dtype="bf16", **engine).generate(prompts, params)
    split = group == "G12" and fmt != "bf16"  # 'auto' takes Triton there: the Gluon parts asked for
    llm = LLM(path, **engine, **engine_kwargs_for(fmt, **({"decode_kernel": "gluon"} if split else {})))
    assert llm.engine.model_config.rotary_dim == 64
    for out, want in zip(llm.generate(prompts, params), ref):
        assert len(out.outputs[0].token_ids) == 16
        assert out.outputs[0].token_ids[:2] == want.outputs[0].token_ids[:2], fmt
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
