"""A calibrated KV format over 2 ranks: each rank keeps its KV heads' codebooks (vq: one per KV head),
so the shipped model with a calibration gives the one-process tokens and logits."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moekv import LLM, SamplingParams
from moekv.config import default_model_path
from moekv.kvcache.formats.vq import random_calibration
from moekv.models.loader import load_model_config

PROMPTS = ["It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, when it was "
           "checked by a violent gust of wind which swept up the streets, rattling along the housetops, and "
           "fiercely agitating the scanty flame of the lamps", "The sea"]


@pytest.mark.slow
def test_vq_calibrated_tables_split_by_kv_head(tmp_path):
    cfg = load_model_config(default_model_path())
    calibration = random_calibration(tmp_path, cfg.num_kv_heads, cfg.head_dim, num_layers=cfg.num_layers, iters=2,
                                     max_vectors=1024)
    tables = load_file(str(calibration / "kv_calibration.safetensors"))
    for name in ("vq.layer0.key.codebook", "vq.layer0.value.codebook", "vq.layer0.key.chan_scale"):
        assert not torch.equal(tables[name][0], tables[name][1])  # a rank given the other head's would differ
    kw = dict(model=default_model_path(), dtype="float32", max_model_len=512, num_kv_blocks=24, kv_cache_dtype="vq",
              kv_calibration=str(calibration))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)  # the long prompt fills a 64-token page: quantized
    ref = LLM(**kw)
    ref_tokens = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, greedy)]
    ref_logits = ref.score(PROMPTS)
    llm = LLM(tensor_parallel_size=2, distributed_timeout=60, **kw)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == ref_tokens
        for ours, theirs in zip(llm.score(PROMPTS), ref_logits):
            assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    finally:
        llm.engine.shutdown()
