"""The kernels one batch-1 decode layer launches on the CUDA path, counted on the CPU by
benchmarks/tools/count_decode_ops.py (fake CUDA tensors: every op and Triton launch recorded, none
run), so glue kernels do not creep back into the layer unseen: each small PyTorch kernel costs about
2 us of a step's time at batch 1 (the H100 profile of gpt-oss-20b's step had 23 of them a layer,
1.1 ms a step). The bound is Mixtral's layer: two fused norms, the QKV and output GEMVs, fused RoPE
+ KV write, decode attention and its reduce, router GEMV, fused top-k, the two expert GEMVs and the
top-k sum: 12 launches, each one of moekv's Triton kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "tools" / "count_decode_ops.py"
MOE_LAYER_KERNELS = 12


def count(shape: str) -> dict:
    """The tool's {'layer': {op: n}, 'step': {op: n}} for a 2-layer model of the shape, in a fresh
    process (the tool patches torch.cuda's queries and Triton's launcher while it counts)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(TOOL), "--shape", shape, "--format", "bf16", "--batch", "1",
                          "--context", "4096", "--layers", "2", "--json"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "gpt-oss-20b"])
def test_decode_layer_launches_only_moekv_kernels(shape):
    """gpt-oss's YaRN RoPE, sinks, windows and biases ride in the same kernels as Mixtral's layer:
    no PyTorch kernel in the layer, at most Mixtral's 12 launches."""
    layer = count(shape)["layer"]
    glue = {op: n for op, n in layer.items() if not op.startswith("triton.")}
    assert not glue, f"{shape}: PyTorch kernels in a decode layer: {glue}"
    assert sum(layer.values()) <= MOE_LAYER_KERNELS, f"{shape}: {sum(layer.values())} kernels a layer: {layer}"
    for kernel in ("triton._rope_kv_write_kernel", "triton._router_gemv_kernel", "triton._paged_decode_kernel"):
        assert layer.get(kernel) == 1, f"{shape}: {kernel} not launched once: {layer}"


# DeepSeek-V2-Lite's MoE layer (bench_mla_decode's shape): its projections as dense GEMVs (q, kv_a, o and the
# shared expert's two), ops/mla_rope_norm, the latent kernel and its reduce, the norms, router, top-k and
# expert GEMVs, and the PyTorch kernels still left: the absorbed products (two bmm), the latent write, the
# shared expert's silu and product and its add to the routed experts' output
MLA_LAYER_KERNELS = 21
MLA_LAYER_TORCH_OPS = {"aten.bmm.out": 2, "aten.index_put_.default": 1, "aten.silu.default": 1,
                       "aten.mul.Tensor": 1, "aten.add.Tensor": 1}


def test_mla_decode_layer_launches():
    """DeepSeek-V2-Lite's layer: the RoPE, kv_a_layernorm and the entry in one launch (no cos / sin, no
    concatenation, no slot arithmetic), every projection a dense GEMV, at most MLA_LAYER_KERNELS launches,
    the PyTorch kernels no more than MLA_LAYER_TORCH_OPS names."""
    layer = count("deepseek-v2-lite")["layer"]
    torch_ops = {op: n for op, n in layer.items() if not op.startswith("triton.")}
    assert all(n <= MLA_LAYER_TORCH_OPS.get(op, 0) for op, n in torch_ops.items()), torch_ops
    assert sum(layer.values()) <= MLA_LAYER_KERNELS, f"{sum(layer.values())} kernels a layer: {layer}"
    assert layer.get("triton._mla_rope_norm_kernel") == 1 and layer.get("triton._dense_gemv_kernel") == 5, layer
