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
