"""Decode-attention kernels in Triton's Gluon dialect (triton.experimental.gluon): compressed KV
dequantized in registers straight into tensor-core operand fragments. Gluon compiles for NVIDIA
GPUs only (no CPU, no TRITON_INTERPRET): the layouts and references here are plain PyTorch and
import anywhere; the kernels import Gluon when first launched."""
