#!/usr/bin/env python3
"""Time and memory of quantization_calibration's GPTQ block by block (models/gptq.round_blockwise) at a
real model's shapes: the engine starts on a Mixtral-shaped model with random weights
(load_format='dummy', --layers of its decoder layers) and a calibration text of 8,192 random tokens,
as `--quantization int4 --quantization-calibration TEXT` runs it. Records the seconds of each block and
of the whole start, the most second-moment bytes alive at once, and the device's peak allocated memory
(CUDA) beside the weights' 16-bit bytes.

    PYTHONPATH=. python benchmarks/quality/bench_gptq_blocks.py --shape mixtral-8x7b --layers 2 \\
        --out benchmarks/results/h100/gptq_blocks_mixtral-8x7b.json
    PYTHONPATH=. python benchmarks/quality/bench_gptq_blocks.py --tiny --device cpu --out /tmp/g.json  # smoke
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))

from bench_engine import write_checkpoint_folder  # noqa: E402

from moekv import LLM  # noqa: E402
from moekv.engine.llm_engine import CALIBRATION_TOKENS  # noqa: E402

# each shape: Mixtral-8x7B's config.json (bench_decode.SHAPES) with these fields changed
SHAPES = {"mixtral-8x7b": {},
          "mixtral-8x22b": dict(vocab_size=32768, hidden_size=6144, num_attention_heads=48, num_key_value_heads=8,
                                head_dim=128, intermediate_size=16384, max_position_embeddings=65536)}
TINY = dict(hidden_size=256, intermediate_size=512, vocab_size=1000, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the shape shrunk (hidden 256, I 512): a CPU smoke test")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    folder = write_checkpoint_folder(Path(args.out).parent / f"_gptq_{args.shape}", "mixtral-8x7b")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_hidden_layers=args.layers, **SHAPES[args.shape])
    cfg.update(TINY if args.tiny else {})
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = random.Random(0)
    text = folder / "calibration.txt"
    text.write_text(" ".join(f"t{rng.randrange(3, cfg['vocab_size'])}" for _ in range(CALIBRATION_TOKENS)))
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", device=args.device, dtype="bfloat16" if cuda else "float32",
              quantization="int4", quantization_calibration=str(text), max_model_len=1024, num_kv_blocks=640,
              enforce_eager=True)
    start_s = time.perf_counter() - t0
    stats = llm.engine.calibration_stats
    H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_params = E * 3 * H * I + H * (q + 2 * kv) + q * H
    record = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "shape": args.shape, "tiny": args.tiny,
        "layers": args.layers, "calibration_tokens": CALIBRATION_TOKENS,
        "engine_start_s": start_s, "round_blockwise_s": stats.seconds, "block_s": stats.block_seconds,
        "second_moment_bytes_peak": stats.peak_bytes, "second_moment_matrices_peak": stats.peak_matrices,
        "weights_16bit_bytes_per_layer": 2 * layer_params,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
