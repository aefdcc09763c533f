"""The ATen ops one decoder layer dispatches in a batch-1 decode step, each with the moekv line that
issued it: on the CPU, on a tiny random DeepSeek-V2/V3 checkpoint (tests/checkpoints.py), through the
engine (LLM.generate). count_decode_ops.py counts the CUDA path's launches of a benchmark shape on fake
CUDA tensors; this one says where each op comes from on the path the CPU runs.

Counts come from a TorchDispatchMode around one layer's forward in one decode step; an op counts
as a launch unless its result aliases an input (views, casts to the same dtype) or it only
allocates (`--all` lists those too). The CPU runs the reference paths where CUDA takes a kernel
(the projections through layers/attention.project, RMSNorm, the experts, the absorbed attention, MLA's
RoPE and norm: ops/mla_rope_norm.py); the glue between them dispatches the same ATen ops on both.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/tools/count_layer_ops.py --arch deepseek_v2 \
        --overrides '{"q_lora_rank": null}' --layer 1
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that allocate without writing: no kernel
ALLOCATE = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}

PASS_THROUGH = {"project"}  # dispatch helpers: the line reported is their caller's


def _site() -> str:
    """The innermost moekv frame that issued the op (the imported moekv's: PYTHONPATH may name another
    tree's), past PASS_THROUGH helpers: 'moekv/path:line function'."""
    import moekv

    root = str(Path(moekv.__file__).resolve().parent)
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(root) and frame.name not in PASS_THROUGH:
            return f"moekv{frame.filename[len(root):]}:{frame.lineno} {frame.name}"
    return "?"


def _storages(value) -> set[int]:
    tensors = [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)] \
        if isinstance(value, (list, tuple)) else []
    return {t.untyped_storage().data_ptr() for t in tensors}


class OpCounter(TorchDispatchMode):
    """(aten op, moekv line, launches) -> count. `launches`: whether the op writes memory (on CUDA a
    kernel): False for views and no-op casts (the result aliases an input) and bare allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str, bool]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = set().union(*(_storages(a) for a in (*args, *kwargs.values())))
        writes_input = name.endswith("_") or "out" in kwargs
        aliases = bool(_storages(out)) and _storages(out) <= inputs
        self.ops[(name, _site(), writes_input or not (aliases or name in ALLOCATE))] += 1
        return out


def launching(ops: Counter) -> Counter:
    """The ops that launch a kernel on CUDA."""
    return Counter({k: n for k, n in ops.items() if k[2]})


def count_decode_layer(llm, layer: int, prompt: list[int] | None = None) -> Counter:
    """(aten op, moekv line) -> count for layer `layer`'s forward in the first one-token decode step of
    a single sequence."""
    from moekv import SamplingParams

    model = llm.engine.runner.model
    target = model.layers[layer]
    counters: list[Counter] = []
    state: dict[str, OpCounter | None] = {"mode": None}

    def pre(module, args):
        x = args[0]
        if x.shape[0] == 1 and not counters:  # the first one-token step: a decode
            state["mode"] = OpCounter()
            state["mode"].__enter__()

    def post(module, args, out):
        mode = state["mode"]
        if mode is not None:
            mode.__exit__(None, None, None)
            counters.append(mode.ops)
            state["mode"] = None

    handles = [target.register_forward_pre_hook(pre), target.register_forward_hook(post)]
    try:
        llm.generate([{"prompt_token_ids": prompt or [5, 17, 33, 90, 4]}],
                     SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finally:
        for h in handles:
            h.remove()
    if not counters:
        raise RuntimeError("no one-token step reached the layer")
    return counters[0]


def build_llm(arch: str, overrides: dict, dtype: str, kv_cache_dtype: str, workdir: Path):
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests/ (after PYTHONPATH: its moekv wins)
    from moekv import LLM
    from tests.checkpoints import build_deepseek_checkpoint

    path = build_deepseek_checkpoint(arch, workdir / arch, **overrides)
    return LLM(path, dtype=dtype, max_model_len=128, kv_cache_dtype=kv_cache_dtype, enforce_eager=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="deepseek_v2", choices=["deepseek_v2", "deepseek_v3"])
    p.add_argument("--overrides", default='{"q_lora_rank": null}', help="config fields, JSON")
    p.add_argument("--layer", type=int, default=1, help="1: the first MoE layer (layer 0 is dense)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--all", action="store_true", help="views and metadata ops too")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_llm(a.arch, json.loads(a.overrides), a.dtype, a.kv_cache_dtype, Path(tmp))
        ops = count_decode_layer(llm, a.layer)
    shown = ops if a.all else launching(ops)
    print(f"{a.arch} {a.overrides} layer {a.layer}, {a.dtype}, kv {a.kv_cache_dtype}: "
          f"{sum(launching(ops).values())} launching ops, {sum(ops.values())} in all")
    print(f"{'count':>5}  {'op':<28} site")
    for (op, site, launches), n in sorted(shown.items(), key=lambda kv: kv[0][1]):
        print(f"{n:>5}  {op:<28} {site}{'' if launches else '  (no kernel)'}")


if __name__ == "__main__":
    main()
