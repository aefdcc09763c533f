"""The int4 GEMV's packed-half dot (`quant_tiles.int4_f16_dots`) against float64, beside int4's own quantization
error, on CPU: `reference.int4_f16_dots_ref` emulates the kernel's arithmetic operation for operation (np.float16,
one rounding per instruction) on random Mixtral-8x7B-shaped rows quantized in groups of 128, symmetric and with
zero points, with three kinds of activations:

- `hidden`: a normed hidden state (gate/up, K = 4096): N(0, 1), 8 channels x 30;
- `swiglu`: a SwiGLU output (down, K = 14336): silu(g) * u with g, u ~ N(0, 1);
- `outliers`: SwiGLU outputs with heavy tails and 16 features of |x| in 1,000-5,000 (down, K = 14336).

Per case, relative to the rows' rms of the exact dot: the fp16 path's rms and max error against the dequantized
weights in float64, and int4's (the dequantized weights against the unquantized ones, both in float64); and the
largest error as a fraction of the bound 2^-9 sum |n - 8| |x| (tests/test_f16_dots.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/tools/f16_dots_error.py [--rows 256]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moekv.ops.quantized_weight import quantize_int4
from moekv.ops.reference import f16_error_bound, int4_f16_dots_ref


def activations(kind: str, K: int, g: torch.Generator) -> torch.Tensor:
    if kind == "hidden":
        x = torch.randn(K, generator=g)
        x[torch.randperm(K, generator=g)[:8]] *= 30
    elif kind == "swiglu":
        x = F.silu(torch.randn(K, generator=g)) * torch.randn(K, generator=g)
    else:
        t = torch.distributions.StudentT(3.0).sample((K,)) * 0.3
        x = F.silu(t) * torch.randn(K, generator=g)
        idx = torch.randperm(K, generator=g)[:16]
        x[idx] = (torch.rand(16, generator=g) * 4000 + 1000) * torch.sign(torch.randn(16, generator=g))
    return x.to(torch.bfloat16).float()  # the model's activations are bf16


def case(kind: str, K: int, rows: int, zero_point: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    w = torch.randn(rows, K, generator=g) / K ** 0.5
    x = activations(kind, K, g)
    q = quantize_int4(w, 128, zero_point=zero_point)
    exact = q.dequantize(torch.float64) @ x.double()
    true = w.double() @ x.double()
    f16 = int4_f16_dots_ref(q.codes, q.scales, q.zeros, x, 128, 1024)
    rms = exact.pow(2).mean().sqrt()
    bound = f16_error_bound(q.codes, q.scales, x, 128)
    return dict(kind=kind, K=K, zero_point=zero_point, max_abs_x=x.abs().max().item(),
                f16_rms=((f16 - exact).pow(2).mean().sqrt() / rms).item(),
                f16_max=((f16 - exact).abs().max() / rms).item(),
                int4_rms=((exact - true).pow(2).mean().sqrt() / rms).item(),
                of_bound=((f16 - exact).abs() / bound).max().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    args = p.parse_args()
    print("kind      K      zeros  max|x|   fp16 rms  fp16 max  int4 rms  fp16/int4  max err / bound")
    for kind, K in (("hidden", 4096), ("swiglu", 14336), ("outliers", 14336)):
        for zp in (False, True):
            r = case(kind, K, args.rows, zp)
            print(f"{kind:9} {K:6} {zp!s:6} {r['max_abs_x']:7.1f}  {r['f16_rms']:.2e}  {r['f16_max']:.2e}  "
                  f"{r['int4_rms']:.2e}  {r['f16_rms'] / r['int4_rms']:.1e}    {r['of_bound']:.3f}", flush=True)


if __name__ == "__main__":
    main()
