"""Paged decode attention: one query token per sequence against its paged, possibly compressed, KV.

    common.py       the format contract (DecodeSpec, TileReader) and the split-K loop's shared jit helpers
    paged.py        the kernel every format's pages go through, its reduce, `paged_decode_attention`
    tiered.py       the tiered format's kernel (pages of two tiers in one launch), `tiered_decode_attention`
    launch.py       splits, register caps and their caches; the per-device tuning (moekv/ops/configs/)
    plain.py, fp8.py, int4.py, kivi2.py, nuq2.py, vq.py
                    each format's tile readers and its spec builder (`<format>_spec`)
    codes.py        packed 4-/2-bit codes to fp16; slots.py: sparse outlier slots (nuq2, vq)
    interpreter.py  a fix Triton's CPU interpreter needs to run these kernels
"""
