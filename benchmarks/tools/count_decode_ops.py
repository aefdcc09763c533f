#!/usr/bin/env python3
"""The kernels one decode layer of a bench_decode shape launches on the CUDA path, counted on a machine
without a GPU: the model is built on fake CUDA tensors (FakeTensorMode: shapes, dtypes and devices, no
data), so every `x.is_cuda` branch takes the GPU's way; each Triton launch is recorded by name and not
run, and every ATen op the step dispatches is recorded unless it launches no kernel (views, empty
allocations, shape queries: NO_KERNEL). What cuBLAS or a PyTorch op runs as several kernels (a split-K
GEMM and its reduce) counts once, so a count here is a lower bound of the profiler's.

    PYTHONPATH=. python benchmarks/tools/count_decode_ops.py --shape gpt-oss-20b --format bf16
        # per layer: each op, its count; then the totals of the layer and of the whole step
    PYTHONPATH=. python benchmarks/tools/count_decode_ops.py --shape deepseek-v2-lite --format bf16
        # bench_mla_decode's shapes too (the latent cache in the format's latent form)

Checked against the H100 profile of gpt-oss-20b's step (benchmarks/results/h100/profile_gpt_oss_20b_b1.txt:
845 kernels a step, 35 a layer, of which cuBLAS's split-K GEMM and its reduce count once here: 34) and
Mixtral's (12 a layer). tests/test_decode_kernel_count.py keeps the counts of a layer bounded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

# ATen ops that allocate, alias or describe a tensor without launching a kernel
NO_KERNEL = frozenset({
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "new_empty_strided.default", "view.default", "_unsafe_view.default", "reshape.default", "as_strided.default",
    "slice.Tensor", "select.int", "split.Tensor", "split_with_sizes.default", "unbind.int", "t.default",
    "transpose.int", "permute.default", "expand.default", "unsqueeze.default", "squeeze.dim", "squeeze.default",
    "alias.default", "detach.default", "lift_fresh.default", "_reshape_alias.default", "unflatten.int",
    "flatten.using_ints", "chunk.default", "narrow.default", "sym_size.int", "sym_stride.int", "sym_numel.default",
    "sym_storage_offset.default", "is_same_size.default", "_local_scalar_dense.default", "dim.default",
    "view_as.default", "device.default",
})


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched under it that launch a kernel, by name (`ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if name not in NO_KERNEL:
            self.ops["aten." + name] += 1
        return out


@contextmanager
def triton_launches(counter: Counter):
    """Every Triton kernel launch (JITFunction.run, autotuned or not) recorded in `counter` as
    'triton.<kernel name>' and skipped (the tensors are fake)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    classes = (JITFunction, InterpretedFunction)  # the latter: kernels decorated under TRITON_INTERPRET=1
    runs = [cls.run for cls in classes]

    def record(self, *args, **kwargs):
        counter["triton." + self.fn.__name__] += 1

    for cls in classes:
        cls.run = record
    try:
        yield
    finally:
        for cls, run in zip(classes, runs):
            cls.run = run


@contextmanager
def fake_h100():
    """torch.cuda's device queries answered as an H100's (sm_90, 132 SMs), so the launchers choose
    their H100 configurations without a device."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                            total_memory=80 * 2**30, L2_cache_size=50 * 2**20, shared_memory_per_block_optin=232448,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, warp_size=32)
    from moekv.ops.decode import launch

    # the decode launcher compiles its kernel to read its occupancy: a typical answer instead
    compiled_occupancy, launch.compiled_occupancy = launch.compiled_occupancy, lambda *a, **kw: (4, 0)
    patches = dict(get_device_capability=lambda device=None: (9, 0), get_device_properties=lambda device=None: props,
                   current_device=lambda: 0, get_device_name=lambda device=None: props.name,
                   device_count=lambda: 1)
    saved = {name: getattr(torch.cuda, name) for name in patches}
    for name, fn in patches.items():
        setattr(torch.cuda, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        launch.compiled_occupancy = compiled_occupancy


def _basic_index(x: torch.Tensor, key):
    """x[key] through ATen ops (select, slice, unsqueeze, index), and whether tensor indices were met:
    Python indexing of a fake CUDA tensor needs a CUDA device guard, which a CPU build of PyTorch lacks."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        used = sum(1 for k in key if k is not None and k is not Ellipsis)
        key = key[:i] + (slice(None),) * (x.dim() - used) + key[i + 1:]
    dim, tensors = 0, []
    for k in key:
        if k is None:
            x = torch.ops.aten.unsqueeze.default(x, dim)
            tensors.append(None)
            dim += 1
        elif isinstance(k, int):
            x = torch.ops.aten.select.int(x, dim, k)
        elif isinstance(k, slice):
            x = torch.ops.aten.slice.Tensor(x, dim, k.start, k.stop, k.step or 1)
            tensors.append(None)
            dim += 1
        else:
            tensors.append(k)
            dim += 1
    return x, tensors


@contextmanager
def fake_cuda_indexing():
    """Tensor.__getitem__ / __setitem__ of CUDA tensors routed through ATen ops (see _basic_index)."""
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def get(self, key):
        if not self.is_cuda:
            return getitem(self, key)
        x, tensors = _basic_index(self, key)
        if any(t is not None for t in tensors):
            x = torch.ops.aten.index.Tensor(x, tensors)
        return x

    def put(self, key, value):
        if not self.is_cuda:
            return setitem(self, key, value)
        x, tensors = _basic_index(self, key)
        if not torch.is_tensor(value):
            value = torch.full((), value, dtype=self.dtype, device=self.device)
        if any(t is not None for t in tensors):
            torch.ops.aten.index_put_.default(x, tensors, value)
        else:
            torch.ops.aten.copy_.default(x, value)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get, put
    try:
        yield
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem


def fake_model(cfg, device: torch.device):
    """The MoEDecoder of cfg in bf16, its parameters created on `device` under the caller's
    FakeTensorMode (the loader's meta-then-to_empty route cannot swap in fake tensors), with the
    executors and routers the loader gives it."""
    from moekv.models.decoder import MoEDecoder
    from moekv.models.loader import install_routers, local_experts, moe_layers

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = MoEDecoder(cfg)
    finally:
        torch.set_default_dtype(default)
    for moe in moe_layers(model).values():
        moe.hooks.experts = local_experts(device)
    install_routers(model, cfg, routing="auto")
    return model.eval()


def model_parts(shape: str, fmt_name: str, num_layers: int):
    """(ModelConfig, KV format, page size) of a bench_decode shape, or of a bench_mla_decode one (DeepSeek's:
    the latent cache in `fmt_name`'s latent form)."""
    import bench_decode as bd
    import bench_mla_decode as bm

    if shape in bm.SHAPES:
        from moekv.kvcache.formats.latent_choice import latent_format_for

        cfg = bm.config({**bm.SHAPES[shape][0], **(bm.SHAPES[shape][1] or {}), "num_hidden_layers": num_layers})
        return cfg, latent_format_for(fmt_name, torch.bfloat16, cfg.mla.kv_lora_rank), bm.BLOCK_SIZE
    return bd.model_config(shape, num_layers), bd.get_kv_format(fmt_name, torch.bfloat16), bd.page_size(fmt_name)


def count_step(shape: str, fmt_name: str, batch: int, context: int, num_layers: int) -> tuple[Counter, Counter]:
    """(ops of the whole decode step, ops of the last layer alone) for a model of `num_layers` layers."""
    import bench_decode as bd
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cuda")
    step_ops: Counter = Counter()
    layer_ops: Counter = Counter()
    cfg, fmt, block_size = model_parts(shape, fmt_name, num_layers)  # real tensors: configs read values
    host_ctx = bd.decode_context(batch, context, block_size, torch.device("cpu"))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_h100(), fake_cuda_indexing(), fake, triton_launches(Counter()), torch.no_grad():
        # the step's metadata: its shapes and dtypes only (fake tensors hold no values)
        ctx = dataclasses.replace(host_ctx, **{f.name: torch.empty_like(getattr(host_ctx, f.name), device=device)
                                               for f in dataclasses.fields(host_ctx)
                                               if isinstance(getattr(host_ctx, f.name), torch.Tensor)})
        model = fake_model(cfg, device)
        bd.install_caches(model, cfg, fmt, batch, context, block_size, device)
        ids = torch.zeros(batch, dtype=torch.long, device=device)
        model.compute_logits(model(ids, ctx))  # warm-up: per-device tables built on first use are not counted
        last = model.layers[-1]
        forward = last.forward
        last_layer_triton: Counter = Counter()

        def counted_forward(*a, **kw):
            with OpCounter() as c, triton_launches(c.ops):
                out = forward(*a, **kw)
            layer_ops.update(c.ops)
            # ATen ops reach both dispatch modes; the layer's Triton launches only its own counter
            last_layer_triton.update({k: n for k, n in c.ops.items() if k.startswith("triton.")})
            return out

        with OpCounter() as c, triton_launches(c.ops):
            last.forward = counted_forward
            try:
                model.compute_logits(model(ids, ctx))
            finally:
                del last.forward
        step_ops.update(c.ops)
        step_ops.update(last_layer_triton)
    return step_ops, layer_ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gpt-oss-20b")
    p.add_argument("--format", default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2, help="layers of the model built (the last one is listed)")
    p.add_argument("--json", action="store_true", help="print {'layer': {op: count}, 'step': {op: count}}")
    args = p.parse_args()
    step, layer = count_step(args.shape, args.format, args.batch, args.context, args.layers)
    if args.json:
        print(json.dumps({"layer": dict(layer), "step": dict(step)}))
        return
    print(f"{args.shape}, {args.format}, batch {args.batch}, context {args.context}: one decode layer "
          f"(layer {args.layers - 1})")
    for name, n in sorted(layer.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:4d}  {name}")
    print(f"  {sum(layer.values()):4d}  kernels a layer")
    print(f"  {sum(step.values()):4d}  kernels a step of {args.layers} layers (embedding, norm, LM head included)")


if __name__ == "__main__":
    main()
