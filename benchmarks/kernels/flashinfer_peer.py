"""FlashInfer's paged decode attention as a peer of bench_decode_attention.py (`--peers flashinfer`).

BatchDecodeWithPagedKVCacheWrapper (flashinfer-python 0.5.0) on the benchmark's heads, NHD pages of
the benchmark's block size scattered over the pool by a random permutation, KV in bf16 or in FP8
e4m3 (one per-tensor scale for K and one for V, q in bf16). Both of its kernels are tried: the
CUDA-core decode kernel and the tensor-core one (use_tensor_cores, FlashInfer's FA2 prefill kernel
run with one query). The caller passes its own module (`bench`) for the head counts, random pages,
timer and error tolerance, so the peer is measured and judged exactly as the formats are.
"""
from __future__ import annotations

import sys
import time
import traceback
from types import ModuleType

import torch

from moekv.ops.reference import decode_attention_ref

KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
TENSOR_CORE_SETTINGS = (False, True)


def flashinfer_version() -> tuple[str | None, str | None]:
    """(version, None) when flashinfer imports, else (None, the reason)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - not installed, or its import needs CUDA / a missing dependency
        return None, f"import flashinfer failed: {_message(e)}"
    return flashinfer.__version__, None


def flashinfer_rows(batch: int, context: int, block_size: int, device, gen, bandwidth: float, base: dict,
                    cudagraph: bool, bench: ModuleType) -> list[dict]:
    """One row per KV dtype (bf16, fp8_e4m3) for one (batch, context) shape; never raises."""
    version, reason = flashinfer_version()
    rows = []
    for label, kv_dtype in KV_DTYPES.items():
        row = {"format": f"flashinfer_{label}", "batch": batch, "context": context, "baseline_ms": base["ms"],
               "flashinfer": version}
        if version is None:
            rows.append({**row, "status": "skipped", "reason": reason})
            continue
        try:
            row = bench_kv_dtype(row, kv_dtype, batch, context, block_size, device, gen, bandwidth, base,
                                 cudagraph, bench)
        except Exception as e:  # noqa: BLE001 - one dtype's failure must not stop the benchmark
            traceback.print_exc(file=sys.stderr)
            row = {**row, "status": "error", "reason": _message(e)}
        finally:
            torch.cuda.empty_cache()  # the pages of (64, 32768) are 8.6 GB in bf16
        rows.append(row)
    return rows


def build_paged_kv(batch: int, context: int, block_size: int, kv_dtype: torch.dtype, device, gen, bench: ModuleType):
    """NHD k/v caches [num_pages, block_size, Hkv, D] in kv_dtype (random pages as build_cache makes
    them, UNIQUE_PAGES repeated over the pool), FlashInfer's page table (indptr, indices,
    last_page_len) over a random permutation of the pool, and the per-tensor K and V scales."""
    pages_per_seq = -(-context // block_size)
    num_pages = batch * pages_per_seq + 1  # one spare page, as build_cache keeps
    unique = min(bench.UNIQUE_PAGES, num_pages)
    repeat = torch.arange(num_pages, device=device) % unique
    caches, scales = [], []
    for x in bench.random_kv(unique, block_size, device, gen):  # [n, Hkv, P, D] fp32
        x = x.transpose(1, 2).contiguous()  # NHD: [n, P, Hkv, D]
        scale = x.abs().amax().item() / FP8_MAX if kv_dtype == torch.float8_e4m3fn else 1.0
        caches.append(take_pages((x / scale).to(kv_dtype), repeat))
        scales.append(scale)
        del x
    indices = torch.randperm(num_pages - 1, device=device, generator=gen)[:batch * pages_per_seq].to(torch.int32)
    indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * pages_per_seq
    last_page_len = torch.full((batch,), context - (pages_per_seq - 1) * block_size, device=device, dtype=torch.int32)
    return caches, scales, (indptr, indices, last_page_len), pages_per_seq


def take_pages(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pages[index] through a byte view: CUDA indexing has lacked float8 kernels in some torch builds."""
    return pages.contiguous().view(torch.uint8)[index].view(pages.dtype)


def bench_kv_dtype(row: dict, kv_dtype: torch.dtype, batch: int, context: int, block_size: int, device, gen,
                   bandwidth: float, base: dict, cudagraph: bool, bench: ModuleType) -> dict:
    import flashinfer

    num_heads, num_kv_heads, head_dim = bench.NUM_HEADS, bench.NUM_KV_HEADS, bench.HEAD_DIM
    sm_scale = head_dim ** -0.5
    fp8 = kv_dtype == torch.float8_e4m3fn
    (k_cache, v_cache), (k_scale, v_scale), (indptr, indices, last_page_len), pages_per_seq = build_paged_kv(
        batch, context, block_size, kv_dtype, device, gen, bench)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)  # given to run(): no allocation in the timed region
    # K and V of every token in kv_dtype, q and out in bf16
    nbytes = batch * num_kv_heads * context * head_dim * 2 * kv_dtype.itemsize + 2 * batch * num_heads * head_dim * 2
    row.update(bits_per_element=8 * kv_dtype.itemsize, bytes=nbytes, floor_ms=nbytes / bandwidth * 1e3,
               kv_layout="NHD", page_size=block_size)
    if fp8:
        row.update(k_scale=k_scale, v_scale=v_scale,
                   note="run() applies v_scale to the output in a second kernel (flashinfer 0.5.0), timed with it")

    # the reference of sequence 0 over its dequantized pages, in fp32
    seq0_pages = indices[:pages_per_seq].long()
    k0 = take_pages(k_cache, seq0_pages).flatten(0, 1)[:context].float() * k_scale  # [context, Hkv, D]
    v0 = take_pages(v_cache, seq0_pages).flatten(0, 1)[:context].float() * v_scale
    ref = decode_attention_ref(q[:1].float(), [k0], [v0], sm_scale)
    del k0, v0
    row["ref_max_abs"] = ref.abs().max().item()
    tolerance = bench.tolerance(row["ref_max_abs"])

    scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    runs, results = {}, []
    for tensor_cores in TENSOR_CORE_SETTINGS:
        entry = {"use_tensor_cores": tensor_cores}
        try:
            started = time.perf_counter()  # plan() builds (nvcc) and loads the JIT module on first use
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", use_tensor_cores=tensor_cores)
            wrapper.plan(indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, block_size,
                         pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                         sm_scale=sm_scale)

            def run(wrapper=wrapper):
                return wrapper.run(q, (k_cache, v_cache), out=out, **scales)
            run()
            torch.cuda.synchronize()
            entry["jit_s"] = round(time.perf_counter() - started, 2)
            entry["max_abs_err"] = (out[:1].float() - ref).abs().max().item()
            entry.update(time_launch(run, cudagraph, bench))
            runs[tensor_cores] = run
        except Exception as e:  # noqa: BLE001 - a setting that does not build or run is reported, not fatal
            traceback.print_exc(file=sys.stderr)
            entry["error"] = _message(e)
        results.append(entry)
    row.update(configs=results, jit_s=round(sum(r.get("jit_s", 0.0) for r in results), 2))
    ok = [r for r in results if "ms" in r and r["max_abs_err"] <= tolerance]
    wrong = [r for r in results if "ms" in r and r["max_abs_err"] > tolerance]
    if not ok:
        reason = (f"every setting disagrees with the reference (max error {min(r['max_abs_err'] for r in wrong):.3g})"
                  if wrong else results[0].get("error"))
        return {**row, "status": "wrong" if wrong else "error", "reason": reason}
    best = min(ok, key=lambda r: r["ms"])
    row.update(status="peer", ms=best["ms"], speedup=base["ms"] / best["ms"], gbps=nbytes / best["ms"] * 1e-6,
               eager_ms=bench.timer(runs[best["use_tensor_cores"]], cudagraph=False),
               use_tensor_cores=best["use_tensor_cores"], timer=best["timer"],
               max_abs_err=max(r["max_abs_err"] for r in ok), wrong_launches=wrong or None)
    return row


def time_launch(run, cudagraph: bool, bench: ModuleType) -> dict:
    """ms with the benchmark's timer; under CUDA graphs when asked, plain do_bench if capture fails."""
    if cudagraph:
        try:
            return {"ms": bench.timer(run, cudagraph=True), "timer": "do_bench_cudagraph"}
        except Exception as e:  # noqa: BLE001 - some launch paths cannot be captured
            traceback.print_exc(file=sys.stderr)
            torch.cuda.synchronize()
            return {"ms": bench.timer(run, cudagraph=False), "timer": "do_bench", "graph_error": _message(e)}
    return {"ms": bench.timer(run, cudagraph=False), "timer": "do_bench"}


def _message(e: BaseException) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}"
