"""Triton kernels in the CPU test suite.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors. The
variable must be set before `triton.jit` decorates a kernel, so a test module imports this module
before the kernel modules, and gets them through `kernel_modules`: a module imported earlier in the
session (by another test, with kernels decorated for a GPU) is reloaded. Interpreter tests run in
fp32/fp16 (its bf16 dot is wrong, DESIGN.md section 6).
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")


SHARED = ("moekv.ops.pdl",)  # Triton helpers most kernel modules import: always reloaded first
# the decode-attention package, dependencies first (kernel_modules(*DECODE_MODULES) reloads them in this order)
DECODE_MODULES = tuple(f"moekv.ops.decode.{name}" for name in ("common", "launch", "interpreter", "codes", "slots",
                                                                 "plain", "fp8", "int4", "kivi2", "nuq2", "vq", "paged",
                                                                 "tiered"))


def kernel_modules(*names: str):
    """The named modules, in the order given (dependencies first: a module that imports kernels from
    another is reloaded after it), each reloaded when it still holds GPU-decorated kernels."""
    from triton.runtime.jit import JITFunction

    modules = []
    for name in SHARED + names:
        module = importlib.import_module(name)
        if INTERPRET and any(isinstance(v, JITFunction) for v in vars(module).values()):
            module = importlib.reload(module)
        modules.append(module)
    return modules[len(SHARED):]
