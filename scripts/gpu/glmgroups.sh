#!/bin/bash
# One GPU call (about 4 minutes on an H100) for query groups beyond the Gluon kernels' 8: GLM-4.5's 12
# query heads a KV head through the Gluon kernels in two parts (8 + 4 heads, each reading the pages once:
# fragment.attend_in_group_parts) with decode_kernel='gluon'; 'auto' lays GLM's pools out for Triton
# (fragment.GLUON_MAX_GROUP_PARTS = 1): this run says whether the parts are right and faster.
# 1. the gpu-marked tests it touches: each format's engine attend at groups 4 and 12 (one launch, then two)
#    against the reference path and the Triton kernel, tiered's page mass included; GLM-4.5's head geometry
#    at G = 12 through every format's Gluon kernels (in parts) and CUDA graphs; the CPU tests of the split.
# 2. GLM-4.5-Air's first 10 layers at (1, 4k) and (32, 32k) per KV format against the floor, with
#    --decode-kernel gluon (the parts), then as 'auto' lays them out (Triton), same run.
# Prediction (H100, ms, 32 x 32k; Triton rows of h100/decode_glm45air10l.json in brackets): a part's read
# costs what one Gluon launch at Mixtral's group costs at (32, 32k) (h100/decode_attention_gluon.json, 16 and
# 64 x 32k interpolated: nuq2 0.39, kivi2 0.32, int4 0.52, tiered ~0.5 ms a layer), two of them a layer plus
# the format's other work a layer as on Mixtral's shape, over a base of ~15.7 ms (weights and the step's
# other kernels, from the fp8_e4m3 row): nuq2 ~26 (43.37; 22-28, ~1.7x its floor), int4 ~27 (37.15; 25-30,
# ~1.55x), kivi2 ~23 (26.10; 21-25, ~1.45x), tiered ~28 (42.85; 25-31, ~1.8x). Batch 1 x 4k within 0.15 ms
# of the Triton rows (2.69-2.98): the KV is small there, and the second part adds 2 launches a layer.
# Each step writes its file to $OUT before the next starts. Run from the repository root:
#   bash scripts/gpu/glmgroups.sh
source "$(dirname "$0")/preamble.sh" glmgroups name,memory.total
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 150 python -m pytest -q -rf -p no:cacheprovider $PARALLEL tests/test_gluon_query_groups.py \
  tests/test_gluon_engine.py -k "query_groups or split or attend_takes_the_gluon_kernel" > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; el "split tests (engine attend at G = 4 and 12)"
timeout 120 python -m pytest -q -rf -p no:cacheprovider $PARALLEL tests/test_glm4_moe.py \
  -k "head_geometry_every_format and G12 or head_groups" > "$OUT/gpu_tests_glm.log" 2>&1
tail -3 "$OUT/gpu_tests_glm.log"; el "GLM head geometry (G = 12, every format, graphs)"
GLM="--random-weights --shape glm-4.5-air-10l --points 1:4096 32:32768 --iters 10 --no-transformers"
timeout 120 python benchmarks/e2e/bench_decode.py $GLM --formats nuq2 int4 kivi2 tiered --decode-kernel gluon \
  --out "$OUT/decode_glm45air10l_split.json" 2>&1 | grep -E "TPOT|skipped|GiB"; el "GLM-4.5-Air rows, Gluon in parts"
timeout 100 python benchmarks/e2e/bench_decode.py $GLM --formats nuq2 int4 kivi2 tiered \
  --out "$OUT/decode_glm45air10l_auto.json" 2>&1 | grep -E "TPOT|skipped|GiB"; el "GLM-4.5-Air rows, auto (Triton)"
