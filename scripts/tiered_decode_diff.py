"""tiered: the fused decode kernel against the reference path in the engine (test_cuda_graphs.py's hd32
checkpoint, no re-ranking), with prompts attending their own K/V exactly and read back through the
cache: each sequence's |logprob| differences until the first divergence, then, per attention call, the
kernel's output against the reference's on the same cache state. Needs a CUDA device:

    PYTHONPATH=. python scripts/tiered_decode_diff.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
from moekv import LLM, SamplingParams  # noqa: E402
from moekv.kvcache.formats.tiered import TieredFormat  # noqa: E402
from moekv.layers.attention import Attention  # noqa: E402
from tests.checkpoints import build_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 33, 90, 4], [9, 8, 7, 250, 3, 3, 31, 64, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54],
           [100 + i for i in range(41)]]
ckpt = build_checkpoint("mixtral", Path(tempfile.mkdtemp()) / "mixtral", seed=0, head_dim=32)
kw = dict(dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_dtype="tiered",
          kv_codebook="page", block_size=16, enforce_eager=True)
params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (90, 60, 40)]
use_kernel = TieredFormat.use_kernel
for exact in (True, False):
    outs = []
    for kernel in (True, False):
        TieredFormat.use_kernel = use_kernel if kernel else (lambda *a, **k: False)
        llm = LLM(ckpt, **kw)
        fmt = llm.engine.runner.model.attention_layers[0].hooks.kv_format
        fmt.rerank_interval = 1000000
        for m in llm.engine.runner.model.modules():
            if isinstance(m, Attention):
                m.hooks.exact_prefill = exact
        outs.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
        print("exact", exact, "kernel", kernel, "stats", {k: round(v, 3) for k, v in fmt.run_statistics(
            [a.hooks.kv_cache for a in llm.engine.runner.model.attention_layers]).items()})
        del llm
    for i, (a, b) in enumerate(zip(*outs)):
        ra, rb = a.outputs[0], b.outputs[0]
        diffs = []
        for j, (x, y) in enumerate(zip(ra.token_ids, rb.token_ids)):
            if x != y:
                break
            diffs.append(abs(ra.logprobs[j][x] - rb.logprobs[j][y]))
        worst = max(diffs)
        print(f"exact={exact} seq {i}: same first {len(diffs)} of {len(ra.token_ids)}; max diff {worst:.4f} "
              f"at {diffs.index(worst)}, mean {sum(diffs) / len(diffs):.4f}; "
              f"first 8: {[round(d, 3) for d in diffs[:8]]}")

# Per call: the kernel and the reference on the same cache state (each decode step of the kernel-run
# engine also computes the reference's output), so a difference here is the kernel's reading, not the
# trajectory's amplification of bf16 rounding.
attend = TieredFormat.attend
TieredFormat.use_kernel = use_kernel
for exact in (True, False):
    rel = []

    def probed(self, q, cache, ctx, scale, sliding_window, step_kv=None):
        out = attend(self, q, cache, ctx, scale, sliding_window, step_kv)
        if self.use_kernel(q, ctx, cache):
            ref = self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv)
            rel.append(((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
        return out

    TieredFormat.attend = probed
    llm = LLM(ckpt, **kw)
    llm.engine.runner.model.attention_layers[0].hooks.kv_format.rerank_interval = 1000000
    for m in llm.engine.runner.model.modules():
        if isinstance(m, Attention):
            m.hooks.exact_prefill = exact
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    rel.sort()
    print(f"exact={exact}: kernel vs reference on the same cache, {len(rel)} calls: max |diff| / max |out| "
          f"median {rel[len(rel) // 2]:.2e}, p99 {rel[int(len(rel) * 0.99)]:.2e}, max {rel[-1]:.2e}")
    del llm
TieredFormat.attend = attend
