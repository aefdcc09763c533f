#!/usr/bin/env python3
"""The Gluon nuq2 decode kernel against torch SDPA (bf16, flash) and the Triton nuq2 kernel, in one run.

32 query / 8 KV heads, head_dim 128, pages of 64, one query per sequence, (batch, context) in
(1, 4096), (16, 32768), (64, 32768), (1, 131072). 512 distinct random pages (keys with two outlier
channels and a few huge elements, so that outlier slots are used), quantized by nuq2 on the GPU,
repeated over the pool behind a shuffled block table; the Gluon path reads them in fragment order
(moekv/ops/gluon/nuq2_layout.py), the Triton kernel (moekv.ops.decode_attention.paged_decode_attention
with nuq2's DecodeSpec) as nuq2 slabs plus its bf16 staging page.

Correctness first: at every shape, sequence 0 through the whole Gluon path (kernel with the outlier
slots folded in, reduce) against dense attention over nuq2's dequantized pages (fp32). Then times
(median of triton.testing.do_bench_cudagraph, CUDA-graph replay; plain do_bench beside it as
eager_ms): SDPA, the Triton kernel at its default launch (newest page from bf16 staging), the Gluon
kernel + reduce at a few split counts and register caps (best reported, all kept), and the Gluon path
with the staged bf16 tail as its extra split (gluon_staged_ms: what the engine launches, the same
work as the Triton kernel). Beside each: bytes read and the byte floor (bytes / the bandwidth of a 4 GiB
device copy measured in the same run). Before the shapes: what converting freshly quantized pages
into fragment order costs beside quantizing them (the engine does it at quantize-on-write time).

    python benchmarks/kernels/bench_gluon_decode.py            # writes $OUT/gluon_decode.json (or /tmp)
    python benchmarks/kernels/bench_gluon_decode.py --shapes 16x32768 --splits 16 32 64
    python benchmarks/kernels/bench_gluon_decode.py --only-gluon --shapes 16x32768 1x131072   # short: SDPA
        and the Gluon path only (no Triton nuq2 kernel, default split count, one register cap)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops.gluon.nuq2_decode import (  # noqa: E402
    default_num_splits,
    nuq2_decode_attention,
    nuq2_decode_partials,
    reduce_on_device,
)
from moekv.ops.gluon.nuq2_layout import (  # noqa: E402
    NO_SLOT,
    Nuq2FragmentPages,
    dequantize_fragment,
    kind_to_fragment,
    to_fragment_order,
)
from moekv.ops.reference import decode_attention_ref  # noqa: E402

HQ, HKV, D, P = 32, 8, 128, 64
SHAPES = [(1, 4096), (16, 32768), (64, 32768), (1, 131072)]
UNIQUE_PAGES = 512
REGISTER_CAPS = [0, 128]  # ptxas's choice (162-203 with the slot fold) and a cap (more programs per SM)


def bench(fn) -> float:
    """Median ms of fn replayed from a CUDA graph: at batch 1 an eager launch's host overhead (the
    Gluon launcher's argument handling, SDPA's dispatch) exceeds the GPU time and varies with the
    host's load from run to run."""
    import triton.testing

    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def bench_eager(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device) -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_eager(lambda: dst.copy_(src))
    src = dst = None  # free the buffers (rebound, not del: the timed lambda closes over them)
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / (ms * 1e-3)


def unique_pages(fmt, device, gen):
    """UNIQUE_PAGES pages of keys and values -> their nuq2 slabs (uint8 [n, Hkv, slab])."""
    shape = (UNIQUE_PAGES, HKV, P, D)
    k = torch.randn(shape, device=device, generator=gen)
    k[..., 7] *= 8
    k[..., D // 2 + 27] += 6
    huge = torch.randint(0, k.numel(), (UNIQUE_PAGES * 8,), device=device, generator=gen)
    k.view(-1)[huge] *= 10
    v = torch.randn(shape, device=device, generator=gen)
    v.view(-1)[huge[: UNIQUE_PAGES * 2]] *= 8
    return fmt.quantize_packed(k, "key"), fmt.quantize_packed(v, "value")


def sdpa_ms(batch, context, device, gen) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, HQ, 1, D, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, HKV, context, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms, eager = bench(run), bench_eager(run)
    q = k = v = None  # free the tensors (rebound, not del: run closes over them)
    torch.cuda.empty_cache()
    return ms, eager


def triton_nuq2_ms(fmt, k_slabs, v_slabs, repeat, tables, lens, q, scale) -> dict:
    """The Triton nuq2 kernel at its default launch (last page from bf16 staging, as the engine does)."""
    from moekv.ops.decode.launch import LAST_LAUNCH
    from moekv.ops.decode.paged import paged_decode_attention

    batch = q.shape[0]
    cache = fmt.allocate(repeat.shape[0], HKV, P, D, q.device, batch, torch.bfloat16)
    cache["k_pages"].copy_(k_slabs[repeat])
    cache["v_pages"].copy_(v_slabs[repeat])
    cache["k_staging"].normal_()
    cache["v_staging"].normal_()
    spec = fmt.decode_spec(P, D)
    slots = torch.arange(batch, device=q.device)
    run = lambda: paged_decode_attention(q, cache, tables, lens, slots, scale, None, spec)  # noqa: E731
    run()
    launch = dict(LAST_LAUNCH)
    ms, eager = bench(run), bench_eager(run)
    cache = None  # free the pages (rebound, not del: run closes over them)
    torch.cuda.empty_cache()
    return {"ms": ms, "eager_ms": eager, "num_splits": launch.get("num_splits"),
            "max_registers": launch.get("max_registers")}


def check_sequence0(fmt, frag_u, frag, repeat, tables, lens, q, scale) -> dict:
    """Sequence 0 through the Gluon path against dense attention over nuq2's dequantized pages (fp32;
    dequantize_fragment equals nuq2's dequantize, tested on CPU), and over the pages without their
    outlier slots (how far off the slots' fold would be if it were missing)."""
    n = int(lens[0])
    ids = repeat[tables[0, : -(-n // P)].long()]
    kd, vd = dequantize_fragment(frag_u, "key"), dequantize_fragment(frag_u, "value")
    k = kd[ids].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
    v = vd[ids].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]
    ref = decode_attention_ref(q[:1].float(), [k], [v], scale)
    out = nuq2_decode_attention(q[:1], frag, tables[:1], lens[:1], scale)
    kb, vb = dequantize_fragment(frag_u, "key", outliers=False), dequantize_fragment(frag_u, "value", outliers=False)
    bare = decode_attention_ref(q[:1].float(), [kb[ids].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]],
                                [vb[ids].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:n]], scale)
    rel = lambda x: float((x.float() - ref).norm() / ref.norm())  # noqa: E731
    used_k = int((frag_u.k_out_idx != NO_SLOT).sum()) / frag_u.k_out_idx[..., 0].numel()
    used_v = int((frag_u.v_out_idx != NO_SLOT).sum()) / frag_u.v_out_idx[..., 0].numel()
    return {"rel_err": rel(out), "rel_err_of_pages_without_slots": rel(bare),
            "max_abs_err": float((out.float() - ref).abs().max()), "used_key_slots_per_page_head": used_k,
            "used_value_slots_per_page_head": used_v}


def run_shape(batch, context, splits, device, gen, bandwidth, only_gluon=False) -> dict:
    # slab pools (the Triton row allocates one); the Gluon rows convert the slabs to fragment order themselves
    fmt = get_kv_format("nuq2", torch.bfloat16, decode_kernel="triton", codebook="page")
    scale = D ** -0.5
    pages_per = -(-context // P)
    num_blocks = batch * pages_per + 1
    k_slabs, v_slabs = unique_pages(fmt, device, gen)
    frag_u = to_fragment_order(fmt, k_slabs, v_slabs)
    repeat = torch.arange(num_blocks, device=device) % UNIQUE_PAGES
    frag = Nuq2FragmentPages(**{name: t[repeat] for name, t in frag_u.tensors().items()}, calibrated=False)
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen)[: batch * pages_per]
    tables = perm.view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    row = {"batch": batch, "context": context}
    row["check_seq0"] = check_sequence0(fmt, frag_u, frag, repeat, tables, lens, q, scale)
    print("  check", row["check_seq0"], flush=True)

    row["sdpa_ms"], row["sdpa_eager_ms"] = sdpa_ms(batch, context, device, gen)
    sdpa_bytes = 2 * batch * HKV * context * D * 2 + 2 * batch * HQ * D * 2
    row["sdpa_floor_ms"] = sdpa_bytes / bandwidth * 1e3

    if only_gluon:
        row["triton_nuq2"] = {"skipped": "--only-gluon"}
    else:
        try:
            row["triton_nuq2"] = triton_nuq2_ms(fmt, k_slabs, v_slabs, repeat, tables, lens, q, scale)
        except Exception as e:  # noqa: BLE001  (recorded, the Gluon rows still count)
            row["triton_nuq2"] = {"error": repr(e)[:500]}
    slab = fmt.layout("key", P, D).slab_bytes + fmt.layout("value", P, D).slab_bytes
    row["triton_nuq2"]["bytes"] = batch * HKV * pages_per * slab + 2 * batch * HQ * D * 2

    gl_bytes = batch * HKV * pages_per * frag.code_bytes_per_page_head() + 2 * batch * HQ * D * 2
    row["gluon_bytes"] = gl_bytes
    row["gluon_floor_ms"] = gl_bytes / bandwidth * 1e3
    out = torch.empty_like(q)
    sweep = {}
    default = default_num_splits(batch, HKV, pages_per)
    tried = {*(splits or []), default} if only_gluon else {*(splits or []), default, max(1, default // 2), default * 2}
    for ns in sorted(tried):
        if ns > pages_per:
            continue
        for regs in REGISTER_CAPS[-1:] if only_gluon else REGISTER_CAPS:
            for c0 in (False, True):  # slots: chunks while used ones remain / the first chunk always
                fn = lambda ns=ns, regs=regs, c0=c0: reduce_on_device(  # noqa: E731
                    *nuq2_decode_partials(q, frag, tables, lens, scale, ns, regs, slot_chunk0=c0), out)
                key = f"{ns}/{regs}/{int(c0)}"
                sweep[key] = bench(fn)
                print(f"    gluon splits={ns} max_registers={regs} slot_chunk0={c0}: {sweep[key] * 1e3:.1f} us",
                      flush=True)
    best = min(sweep, key=sweep.get)
    best_ns, best_regs, best_c0 = best.split("/")
    best_ns, best_regs, best_c0 = int(best_ns), int(best_regs), best_c0 == "1"
    row["gluon"] = {"ms": sweep[best], "num_splits": best_ns, "max_registers": best_regs, "slot_chunk0": best_c0,
                    "default_splits": default, "default_ms": sweep.get(f"{default}/128/1"),
                    "sweep_ms (splits/max_registers/slot_chunk0)": sweep}
    best_fn = lambda: reduce_on_device(  # noqa: E731
        *nuq2_decode_partials(q, frag, tables, lens, scale, best_ns, best_regs, slot_chunk0=best_c0), out)
    if not only_gluon:
        row["gluon"]["eager_ms"] = bench_eager(best_fn)
    row["gluon_kernel_only_ms"] = bench(lambda: nuq2_decode_partials(q, frag, tables, lens, scale, best_ns, best_regs,
                                                                     slot_chunk0=best_c0))
    # what the engine launches: pages up to the newest one, that one from bf16 staging (the extra split)
    k_st = torch.randn(batch, HKV, P, D, device=device, dtype=torch.bfloat16, generator=gen)
    v_st = torch.randn_like(k_st)
    staged = (k_st, v_st, torch.arange(batch, device=device))
    full = lambda: nuq2_decode_attention(q, frag, tables, lens, scale, None, staged=staged, out=out)  # noqa: E731
    row["gluon_staged_ms"] = bench(full)  # the engine's launch: default splits, cap and slot chunks
    row["gluon_staged_splits"] = default_num_splits(batch, HKV, pages_per, 1)
    row["ratio_gluon_staged_vs_sdpa"] = row["sdpa_ms"] / row["gluon_staged_ms"]
    print(f"  SDPA {row['sdpa_ms'] * 1e3:.1f} us | Gluon {row['gluon']['ms'] * 1e3:.1f} us (kernel alone "
          f"{row['gluon_kernel_only_ms'] * 1e3:.1f}), staged {row['gluon_staged_ms'] * 1e3:.1f} us = "
          f"{row['ratio_gluon_staged_vs_sdpa']:.2f}x SDPA", flush=True)
    if "ms" in row["triton_nuq2"]:
        row["ratio_gluon_staged_vs_triton_nuq2"] = row["triton_nuq2"]["ms"] / row["gluon_staged_ms"]
    row["ratio_gluon_vs_sdpa"] = row["sdpa_ms"] / row["gluon"]["ms"]
    if "ms" in row["triton_nuq2"]:
        row["ratio_triton_nuq2_vs_sdpa"] = row["sdpa_ms"] / row["triton_nuq2"]["ms"]
        row["ratio_gluon_vs_triton_nuq2"] = row["triton_nuq2"]["ms"] / row["gluon"]["ms"]
    row["gluon_share_of_floor"] = row["gluon_floor_ms"] / row["gluon"]["ms"]
    frag = frag_u = k_slabs = v_slabs = None  # free them (rebound, not del: the timed lambdas close over them)
    torch.cuda.empty_cache()
    return row


def conversion_cost(device, gen) -> dict:
    """What keeping the engine's pools in fragment order costs at quantize-on-write time: the pages a
    decode step fills (n pages of 8 KV heads, all layers' fills in one batch), quantized to slabs by
    nuq2 and converted (kind_to_fragment), K and V, graph-replayed ms."""
    # slab pools (the Triton row allocates one); the Gluon rows convert the slabs to fragment order themselves
    fmt = get_kv_format("nuq2", torch.bfloat16, decode_kernel="triton", codebook="page")
    out = {}
    for n in (16, 512):  # e.g. 16 sequences filling a page in one layer; 16 in each of 32 layers
        x = torch.randn(n, HKV, P, D, device=device, generator=gen)
        x[..., 7] *= 8
        slabs = {kind: fmt.quantize_packed(x, kind) for kind in ("key", "value")}
        out[f"{n}_pages"] = {
            "quantize_ms": bench(lambda: [fmt.quantize_packed(x, kind) for kind in ("key", "value")]),  # noqa: B023
            "convert_ms": bench(lambda: [kind_to_fragment(fmt, kind, slabs[kind])  # noqa: B023
                                         for kind in ("key", "value")])}
        print(f"  {n} pages x {HKV} heads: quantize {out[f'{n}_pages']['quantize_ms'] * 1e3:.1f} us, convert "
              f"{out[f'{n}_pages']['convert_ms'] * 1e3:.1f} us", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="BATCHxCONTEXT, e.g. 16x32768")
    ap.add_argument("--splits", nargs="*", type=int, default=None, help="extra Gluon split counts to try")
    ap.add_argument("--only-gluon", action="store_true",
                    help="SDPA and the Gluon path only: no Triton nuq2 kernel, no split / register-cap sweep")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gluon_decode.json, else /tmp)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon_decode: needs a CUDA device (Gluon kernels do not run on CPU)")
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    except ValueError:
        sys.exit(f"bench_gluon_decode: --shapes wants BATCHxCONTEXT items (e.g. 16x32768), got {args.shapes}")
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "gluon_decode.json"))
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    import triton

    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "heads": [HQ, HKV], "head_dim": D, "page": P,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
    print("copy bandwidth GB/s", round(record["copy_bandwidth_GBps"]), flush=True)
    try:
        record["fragment_conversion"] = conversion_cost(device, gen)
    except Exception as e:  # noqa: BLE001  (recorded; the shapes still run)
        record["fragment_conversion"] = {"error": repr(e)[:500]}
    record["rows"] = []
    for batch, context in shapes:
        print(f"shape {batch} x {context}", flush=True)
        try:
            row = run_shape(batch, context, args.splits, device, gen, record["copy_bandwidth_GBps"] * 1e9,
                            args.only_gluon)
        except Exception as e:  # noqa: BLE001  (the other shapes still run)
            import traceback

            traceback.print_exc()
            row = {"batch": batch, "context": context, "error": repr(e)[:1000]}
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        out_path.write_text(json.dumps(record, indent=1))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
