"""The tiers of a tiered-format page: the values of the per-page tier table TieredFormat keeps
(moekv/kvcache/formats/tiered_policy.py decides them) and its decode kernels read on the device
(moekv/ops/decode/tiered.py, moekv/ops/gluon/tiered_*.py), here so the kernels need no import of the
format's modules."""
TIER_NONE, TIER_FP8, TIER_LOW = 0, 1, 2  # free or being filled; FP8; the low (nuq2) tier
