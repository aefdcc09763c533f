"""DeepSeek-V2/V3 (multi-head latent attention over the paged latent cache) against transformers on
tiny random checkpoints in fp32: prompt logits (chunked prefill, expanded form) and greedy decode
(absorbed form), with and without q_lora_rank, YaRN, dense first layers, shared experts, V3's
group-limited routing with its selection bias; the fp8 latent; clear errors for what is refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moekv import LLM, SamplingParams
from moekv.kvcache.formats.latent import LatentFormat, LatentFP8Format
from moekv.kvcache.formats.latent_choice import latent_format_for
from moekv.models.loader import load_model_config
from moekv.models.model_config import UnsupportedModelError
from tests.checkpoints import build_deepseek_checkpoint, load_hf

PROMPTS = [
    [5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14],  # crosses a page boundary
    [9, 8, 7],
]

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (architecture, config overrides)
VARIANTS = {
    "v2_no_q_lora": ("deepseek_v2", {"q_lora_rank": None}),
    "v2_group_limited_greedy": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    "v3_q_lora": ("deepseek_v3", {}),
    "v3_yarn_rotate_half": ("deepseek_v3", {"rope_parameters": YARN, "rope_interleave": False, "q_lora_rank": None}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = build_deepseek_checkpoint(arch, tmp_path_factory.mktemp(request.param), **overrides)
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12)  # chunked prefill
    return request.param, path, hf, llm


def reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_logits_and_greedy_match_transformers(variant):
    """Prompt logits to 1e-4 (expanded prefill over the latent pages, chunked) and 12 greedy tokens
    token for token (absorbed decode), both prompts in one batch; every page back in the pool."""
    name, _, hf, llm = variant
    for prompt, logits in zip(PROMPTS, llm.score([{"prompt_token_ids": p} for p in PROMPTS])):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4, name
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == reference_greedy(hf, prompt, 12), name
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_mixed_steps_split_changes_nothing(variant, monkeypatch):
    """Decodes beside prefill chunks in one step, each part its own way (absorbed / expanded, as on
    CUDA), forced on the CPU: the tokens of the unsplit run, with some steps really split."""
    from moekv.layers.mla import MLAttention

    name, path, _, _ = variant
    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 1 for j in range(n)]} for i, n in enumerate((5, 40, 70))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **kwargs).generate(prompts, params)]
    llm = LLM(path, **kwargs)
    llm.engine.runner.split_mixed_steps = True
    split_steps, forward = [], MLAttention.forward

    def recording(self, x, ctx):
        if self.layer_idx == 0 and ctx.mixed is not None:
            split_steps.append((len(ctx.mixed.decode_rows), len(ctx.mixed.prefill_rows)))
        return forward(self, x, ctx)

    monkeypatch.setattr(MLAttention, "forward", recording)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, name
    assert split_steps and all(d >= 1 and p >= 2 for d, p in split_steps)


def test_config_reads_the_architecture(variant):
    """What the checkpoint asks for reaches ModelConfig: dense first layer, ungated shared expert, the
    latent entry as the cache's one head, V3's routing keys (absent from transformers' config.json)."""
    name, path, _, _ = variant
    cfg = load_model_config(path)
    assert cfg.moe_layers == [False, True, True]
    assert cfg.shared_expert_intermediate_size == 32 and not cfg.shared_expert_gated
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 32 + 8) and cfg.mla.latent_width == 40
    if name.startswith("v3"):
        assert (cfg.scoring_func, cfg.router_bias, cfg.n_group, cfg.topk_group) == ("sigmoid", True, 4, 2)
        assert cfg.routed_scaling_factor == 2.5
    elif name == "v2_group_limited_greedy":
        assert (cfg.scoring_func, cfg.router_bias, cfg.n_group, cfg.group_score) == ("softmax", False, 4, "max")
    else:
        assert (cfg.scoring_func, cfg.router_bias, cfg.n_group) == ("softmax", False, None)
    if name == "v3_yarn_rotate_half":
        assert cfg.mla.rope_scale == pytest.approx(1.0) and cfg.mla.softmax_scale > 24 ** -0.5
    total, active = cfg.parameter_counts()
    assert total == sum(p.numel() for p in load_hf(path).parameters())
    assert active < total


def test_fp8_latent_stays_close_and_counts_its_bytes(variant):
    """The fp8 latent (per-token scale, bf16 rotary key): 644-ish bytes of 1152 at DeepSeek's shape,
    and on the tiny model the prompt logits stay near the fp32 cache's."""
    name, path, _, llm = variant
    fp8 = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12, kv_cache_dtype="fp8_e4m3")
    assert isinstance(fp8.engine.runner.kv_format, LatentFP8Format)
    errors = []
    for exact, approx in zip(llm.score([{"prompt_token_ids": p} for p in PROMPTS]),
                             fp8.score([{"prompt_token_ids": p} for p in PROMPTS])):
        errors.append((approx - exact).abs().max().item())
        assert errors[-1] < 0.2 * exact.abs().max().item(), name
    # the long prompt's later chunks read its earlier ones from fp8 pages; the short one is one exact chunk
    assert errors[0] > 1e-3 and errors[1] < 1e-5, name


@pytest.mark.parametrize("mma", ["bf16", "fp8", "fp8_queries", "fp8_probs"])
def test_decode_mma_rounds_the_absorbed_decode_only(variant, mma):
    """mla_decode_mma: the prompt (expanded prefill) is untouched, the decode steps' attention rounds its
    MMA operands (reference.mla_decode_mma_ref), so the sampled tokens' log-probabilities move a little;
    an unknown value is refused naming the accepted ones."""
    name, path, _, llm = variant
    rounded = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=12, mla_decode_mma=mma)
    assert rounded.engine.runner.kv_format.decode_mma == mma
    for exact, approx in zip(llm.score([{"prompt_token_ids": p} for p in PROMPTS]),
                             rounded.score([{"prompt_token_ids": p} for p in PROMPTS])):
        assert torch.equal(exact, approx), name
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    base = [o.outputs[0].cumulative_logprob for o in llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
    moved = [o.outputs[0].cumulative_logprob for o in rounded.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
    assert base[0] != moved[0] and abs(base[0] - moved[0]) < 0.5, (name, base, moved)
    with pytest.raises(ValueError, match="mla_decode_mma='fp4' is unknown"):
        LLM(path, dtype="float32", mla_decode_mma="fp4")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefix_caching_and_preemption(variant, kv_cache_dtype):
    """Latent pages shared by prefix caching, and sequences preempted and recomputed in a pool too
    small for all of them: with exact (fp32) pages the tokens of a plain run; with fp8 pages (where a
    cached prefix reads as an earlier chunk, quantized, unlike one exact prefill) the hits and
    preemptions happen and every page comes back."""
    name, path, _, _ = variant
    shared = [7, 3, 90, 91, 92, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # > one page of 16
    prompts = [{"prompt_token_ids": shared + tail} for tail in ([30, 31], [40], [50, 51, 52])]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # each grows into a third page
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_dtype=kv_cache_dtype, block_size=16)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    exact = kv_cache_dtype == "auto"
    plain = tokens(LLM(path, **kwargs))
    cached = LLM(path, enable_prefix_caching=True, **kwargs)
    first, second = tokens(cached), tokens(cached)  # the second run reads the first's shared pages
    assert cached.engine.stats().prefix_cache_hits > 0
    small = LLM(path, num_kv_blocks=5, max_num_batched_tokens=64, **kwargs)  # 3 sequences need 9 pages
    squeezed = tokens(small)
    assert small.engine.stats().num_preemptions > 0
    for llm in (cached, small):
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    if exact:
        assert first == second == squeezed == plain, name


def test_info_describes_the_latent_cache(variant, capsys):
    """`moekv info` names the latent attention and the latent cache's bytes per token (vq and tiered
    have no latent form)."""
    from moekv.cli import main

    _, path, _, _ = variant
    assert main(["info", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    assert "multi-head latent attention: kv_lora_rank 32 + rope 8" in text
    assert "bf16              240 bytes/token" in text  # 3 layers x 40 x 2 bytes
    assert "fp8_e4m3          156 bytes/token" in text  # 3 layers x (32 + 4 + 2 x 8)
    assert "int4              108 bytes/token" in text  # 3 x (16 codes + 4 scale, zero + 16 rope)
    assert "kivi2              84 bytes/token" in text  # 3 x (8 codes + 4 side + 16 rope), the window aside
    assert "vq         n/a: no latent-cache form" in text
    # one sequence's bits per element: 28 bytes a token-layer over 40 elements = 5.6 bits, plus the
    # 128-entry bf16 window (128 x 40 x 2 bytes) spread over 4096 (+0.5) or 32768 (+0.0625) tokens
    assert "5.60 bits/element   6.10 at 4k   5.66 at 32k" in text.split("kivi2")[-1]
    assert main(["info", "--model", str(path), "--kv-residual", "32"]) == 0
    text = capsys.readouterr().out
    assert "5.60 bits/element   5.72 at 4k" in text.split("nuq2")[-1]  # a 32-entry window: + 0.125 at 4k


def test_latent_formats_bytes():
    """Bytes per token at DeepSeek-V3's entry (512 + 64): bf16 1152; fp8 512 codes + 4 scale + 128 rope."""
    bf16, fp8 = LatentFormat(torch.bfloat16, 512), LatentFP8Format(512)
    assert bf16.page_bytes(1, 64, 576) == 64 * 1152
    assert fp8.page_bytes(1, 64, 576) == 64 * (512 + 4 + 128)
    assert bf16.bits_per_element(1, 64, 576) == 16
    assert fp8.bits_per_element(1, 64, 576) == pytest.approx(8 * 644 / 576)
    with pytest.raises(ValueError, match="no latent-cache form.*accepted"):
        latent_format_for("vq", torch.bfloat16, 512)


# what an MLA layer's decode may dispatch between its projections, the norms, the attention kernel and
# the experts (which CUDA runs as one launch each, the CPU through references): the RoPE (rotation and
# its two concatenations: 7 + 1), the entry's concatenation, q_nope through W_UK and the result beside
# q_rope, o_lat through W_UV, the latent write (one index_put)
GLUE_BUDGET = 13


def test_decode_layer_glue_stays_within_budget(tmp_path):
    """A bf16 V2 (no q_lora) one-token decode step on the CPU, its first MoE layer's ATen ops counted
    (benchmarks/tools/count_layer_ops.py): that layer reads the step's RoPE cos / sin from the dense
    layer before it (no cos, no sin of its own), writes the latent with one index_put (no slot // P,
    slot % P), and the glue it dispatches (mla.py, the RoPE's rotation, the format's write: the same
    ATen ops on CUDA) stays within GLUE_BUDGET."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
    from count_layer_ops import count_decode_layer, launching

    path = build_deepseek_checkpoint("deepseek_v2", tmp_path / "v2", q_lora_rank=None)
    llm = LLM(path, dtype="bfloat16", max_model_len=64, enforce_eager=True)
    ops = launching(count_decode_layer(llm, 1))
    assert not {op for op, _, _ in ops} & {"cos", "sin"}
    glue_sites = ("moekv/layers/mla.py:", "mla_rope_apply_ref", "moekv/kvcache/formats/latent.py:")
    glue = {k: n for k, n in ops.items() if k[0] != "linear"  # the projections: layers/attention.project
            and any(s in k[1] for s in glue_sites) and not k[1].endswith((" gather", " attend_reference"))}
    writes = [k for k in glue if k[1].endswith(" write")]
    assert [k[0] for k in writes] == ["index_put_"] and glue[writes[0]] == 1, writes
    assert 0 < sum(glue.values()) <= GLUE_BUDGET, sorted(glue.items())


def test_fused_glue_path_dispatches_four_launches(tmp_path, monkeypatch):
    """The path CUDA takes (fused_glue; ops/mla_rope_norm.py under the interpreter here), counted as
    above: between its projections an MLA layer dispatches the fused launch, q_nope's and o_lat's bmm and
    the latent's index_put, nothing else (the interpreter's own tensor ops count as the one launch)."""
    import moekv.layers.mla as mla

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
    from count_layer_ops import count_decode_layer, launching

    monkeypatch.setattr(mla, "fused_glue", lambda x, norm: norm.weight.dtype == x.dtype)
    path = build_deepseek_checkpoint("deepseek_v2", tmp_path / "v2", q_lora_rank=None)
    llm = LLM(path, dtype="float32", max_model_len=64, enforce_eager=True)
    ops = launching(count_decode_layer(llm, 1))
    glue = sorted(op for (op, site, _), n in ops.items() for _ in range(n) if op != "linear"
                  and ("moekv/layers/mla.py:" in site or ("formats/latent.py:" in site and site.endswith(" write"))))
    fused = [site for op, site, _ in ops if "mla_rope_norm.py" in site]
    assert glue == ["bmm", "bmm", "index_put_"] and fused, (glue, fused)


def test_rope_cos_sin_are_computed_once_a_step_and_follow_the_positions():
    """MLAttention.rope_cos_sin: a second layer of the same step gets the first one's tensors; a
    Context whose positions tensor was replaced gets them recomputed, equal to the reference's."""
    from moekv.context import Context
    from moekv.layers.mla import MLAttention
    from moekv.models.deepseek import config_from_hf
    from moekv.ops.reference import mla_rope_cos_sin_ref
    from tests.checkpoints import make_deepseek_config

    hf = make_deepseek_config("deepseek_v2").to_dict()
    hf["architectures"] = ["DeepseekV2ForCausalLM"]
    cfg = config_from_hf(hf)
    first, second = MLAttention(cfg, 0), MLAttention(cfg, 1)
    ctx = Context(*(torch.tensor([3, 9]),) * 7)
    cos, sin = first.rope_cos_sin(ctx, torch.bfloat16)
    again = second.rope_cos_sin(ctx, torch.bfloat16)
    assert again[0] is cos and again[1] is sin
    ctx.positions = torch.tensor([4, 7])
    cos, sin = second.rope_cos_sin(ctx, torch.bfloat16)
    ref = mla_rope_cos_sin_ref(ctx.positions, torch.tensor(cfg.mla.inv_freq), cfg.mla.rope_scale, torch.bfloat16)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])


@pytest.mark.parametrize("name", ["v2_no_q_lora", "v3_yarn_rotate_half"])
def test_fused_glue_path_matches_the_reference_path(tmp_path, monkeypatch, name):
    """The path CUDA takes (ops/mla_rope_norm.py under the Triton interpreter here; q_lat multiplied into
    its buffer) against the reference path, fp32: the same greedy tokens, prompt logits to 1e-5."""
    import moekv.layers.mla as mla

    arch, overrides = VARIANTS[name]
    path = build_deepseek_checkpoint(arch, tmp_path / name, **overrides)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run():
        llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=12)
        return llm.score(prompts), [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    ref_logits, ref_ids = run()
    calls = []
    monkeypatch.setattr(mla, "fused_glue", lambda x, norm: calls.append(1) or norm.weight.dtype == x.dtype)
    logits, ids = run()
    assert calls and ids == ref_ids
    for a, b in zip(logits, ref_logits):
        assert (a - b).abs().max().item() < 1e-5


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """A V3 checkpoint's MTP layer (model.layers.<num_hidden_layers>.*) loads as nothing; an extra
    tensor inside the decoder's layers is still refused."""
    from safetensors.torch import load_file, save_file

    from moekv.models.loader import CheckpointError, load_model

    path = build_deepseek_checkpoint("deepseek_v3", tmp_path / "v3")
    tensors = load_file(path / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
             "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4 * 28, 32)}
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    assert load_model(path, torch.float32, torch.device("cpu")) is not None
    save_file({**tensors, "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.2.eh_proj.weight"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_unsupported_variants_are_refused(tmp_path):
    """V2 with V3's routing or group_limited_greedy without groups, moe_layer_freq > 1, quantized
    weights and unknown rope types name what is accepted; so does tensor parallelism."""
    path = build_deepseek_checkpoint("deepseek_v2", tmp_path / "v2")
    base = json.loads((path / "config.json").read_text())
    for change, match in (({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
                          ({"topk_method": "group_limited_greedy", "n_group": None}, "needs n_group"),
                          ({"moe_layer_freq": 2}, "moe_layer_freq"),
                          ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights"),
                          ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type")):
        (path / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(UnsupportedModelError, match=match):
            load_model_config(path)
    (path / "config.json").write_text(json.dumps(base))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        LLM(path, dtype="float32", max_model_len=64, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_cuda_decode_kernel_matches_cpu_reference(tmp_path, kv_cache_dtype):
    """On CUDA decode takes the Triton latent kernel, on the CPU the reference: the same latent
    cache, the same greedy tokens and close prompt logits (fp32 model, eager steps)."""
    path = build_deepseek_checkpoint("deepseek_v3", tmp_path / "v3")
    # a small token budget: the short prompt decodes beside the long one's prefill chunks (mixed steps)
    kwargs = dict(dtype="float32", max_model_len=128, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=12)
    cpu, gpu = LLM(path, **kwargs), LLM(path, device="cuda", **kwargs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for a, b in zip(cpu.score(prompts), gpu.score(prompts)):
        assert (a - b.cpu()).abs().max().item() < 1e-3
    assert ([o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in gpu.generate(prompts, params)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cuda_graph_decode_matches_eager(tmp_path, kv_cache_dtype):
    """A bf16 model's decode steps replayed from CUDA graphs give the eager steps' tokens."""
    path = build_deepseek_checkpoint("deepseek_v3", tmp_path / "v3")
    kwargs = dict(dtype="bfloat16", device="cuda", max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    graphs, eager = LLM(path, **kwargs), LLM(path, enforce_eager=True, **kwargs)
    assert graphs.engine.runner.graphs is not None
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in eager.generate(prompts, params)])


def _greedy_logprobs(path, **kwargs) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = LLM(path, max_model_len=128, **kwargs).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _logprob_distance(ref, other) -> tuple[float, int]:
    """The largest |logprob| difference of the reference's greedy tokens over the positions where both
    generated the same tokens so far, and how many positions that was."""
    worst, n = 0.0, 0
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, other):
        for i, (a, b) in enumerate(zip(ref_ids, ids)):
            if a != b:
                break
            worst, n = max(worst, abs(ref_lp[i][a] - lp[i][a])), n + 1
    return worst, n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_decode_within_bf16_rounding(tmp_path):
    """A bf16 V2 (no q_lora) on CUDA decodes one token a step through the dense GEMV projections (MLA's
    and the shared expert's), the step's shared RoPE cos / sin and the latent kernel, from CUDA graphs:
    its greedy tokens' log-probabilities, while its tokens agree with the fp32 CPU engine's, stay within
    twice the CPU bf16 engine's distance from fp32 (plus 0.02)."""
    path = build_deepseek_checkpoint("deepseek_v2", tmp_path / "v2", q_lora_rank=None)
    ref = _greedy_logprobs(path, dtype="float32")
    cpu_bf16, cpu_n = _logprob_distance(ref, _greedy_logprobs(path, dtype="bfloat16"))
    gpu_bf16, gpu_n = _logprob_distance(ref, _greedy_logprobs(path, dtype="bfloat16", device="cuda"))
    assert cpu_n >= 4 and gpu_n >= 4, (cpu_n, gpu_n)
    assert gpu_bf16 <= 2 * cpu_bf16 + 0.02, (gpu_bf16, cpu_bf16)
