"""A load generator for an OpenAI-compatible server, like `vllm bench serve` with its random
dataset: prompts of exactly --input-len tokens, --output-len tokens each (ignore_eos), sent at a
Poisson --request-rate and/or at most --max-concurrency at a time, streamed, and timed per token.

TTFT: send -> first streamed token; ITL: between streamed tokens; TPOT per request:
(e2e - TTFT) / (output tokens - 1); e2e: send -> last byte. Reported as mean, median and p99 (ms).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

# a word list for prompt text: real words tokenize like real text, random letters would not
WORDS = ("the of and to in is was he that it for on with as his they at be this from had by not but what "
         "all were when we there can an your which their said if do will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long little very after "
         "words called just where most know get through back much before go good new write our used me man "
         "too any day same right look think also around another came come work three word must because does "
         "part even place well such here take why things help put years different away again off went old").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def server_model(client, model: str | None) -> tuple[str, int | None]:
    """The model to ask for (the server's first, if none given) and its max_model_len."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    cards = r.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    if card is None:
        raise ValueError(f"the server does not serve --model {model!r}; it serves {[c['id'] for c in cards]}")
    return card["id"], card.get("max_model_len")


async def random_prompts(client, model: str, num: int, input_len: int, rng: random.Random) -> list[list[int]]:
    """num prompts of exactly input_len token ids: windows at random offsets of one tokenized text."""
    text = " ".join(rng.choice(WORDS) for _ in range(2 * input_len + 64))
    r = await client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    pool = r.json()["tokens"]
    pool = pool * (1 + input_len // max(1, len(pool)))
    prompts = []
    for _ in range(num):
        start = rng.randrange(len(pool) - input_len + 1)
        prompts.append(pool[start:start + input_len])
    return prompts


async def send_one(client, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    result.error = data["error"].get("message", str(data["error"]))
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices"):  # one chunk per generated token
                    t = time.perf_counter()
                    if chunks == 0:
                        result.ttft = t - start
                    else:
                        result.itl.append(t - last)
                    last, chunks = t, chunks + 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "the stream carried no tokens"
    except Exception as e:  # a failed request is counted and reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


def _stats(values: list[float], name: str) -> dict[str, float | None]:
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    record = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
              "total_input_tokens": total_in, "total_output_tokens": total_out,
              "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
              "total_token_throughput": (total_in + total_out) / duration}
    record.update(_stats([r.ttft for r in ok], "ttft"))
    record.update(_stats(tpots, "tpot"))
    record.update(_stats([t for r in ok for t in r.itl], "itl"))
    record.update(_stats([r.latency for r in ok], "e2el"))
    record["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return record


async def run_benchmark(url: str, model: str | None = None, num_prompts: int = 100, input_len: int = 128,
                        output_len: int = 64, request_rate: float = math.inf, max_concurrency: int | None = None,
                        seed: int = 0, progress: bool = True, timeout: float = 600.0,
                        api_key: str | None = None) -> dict:
    """api_key: sent as `Authorization: Bearer` on every request (a server started with --api-key)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # never queue in the client
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits, headers=headers) as client:
        model, max_model_len = await server_model(client, model)
        if max_model_len is not None and input_len + output_len > max_model_len:
            raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds the server's "
                             f"max_model_len={max_model_len}")
        prompts = await random_prompts(client, model, num_prompts, input_len, rng)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=num_prompts, desc="bench serve", disable=not progress, file=sys.stderr)

        async def one(prompt: list[int]) -> RequestResult:
            if gate is None:
                result = await send_one(client, model, prompt, output_len)
            else:
                async with gate:
                    result = await send_one(client, model, prompt, output_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(request_rate):  # Poisson arrivals: exponential gaps
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    record = summarize(results, duration)
    record.update({"model": model, "url": url, "num_prompts": num_prompts, "input_len": input_len,
                   "output_len": output_len, "request_rate": request_rate if math.isfinite(request_rate) else "inf",
                   "max_concurrency": max_concurrency, "seed": seed})
    return record


def format_report(r: dict) -> str:
    def num(v, fmt=".2f"):
        return "n/a" if v is None else format(v, fmt)

    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{r['completed']}", f"{'Failed requests:':<40}{r['failed']}",
             f"{'Maximum request concurrency:':<40}{r['max_concurrency'] or 'unlimited'}",
             f"{'Request rate (req/s):':<40}{r['request_rate']}",
             f"{'Benchmark duration (s):':<40}{r['duration_s']:.2f}",
             f"{'Total input tokens:':<40}{r['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{r['total_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{r['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<40}{r['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<40}{r['total_token_throughput']:.2f}"]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{num(r[f'{stat}_{key}_ms'])}")
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in r["errors"]]
    return "\n".join(lines)
