"""A fix to Triton's CPU interpreter (TRITON_INTERPRET=1) that the decode kernels need to run there.

Why: Triton 3.6's interpreter keeps a scalar as a 1-element numpy array and turns it into a loop bound
with int(array), which numpy >= 2.3 refuses for arrays of one dimension. The decode kernels' loops are
bounded by loaded values (a sequence's length, its split's share of tiles), so under the interpreter
every launch would fail. `patch_interpreter_index` gives the interpreter's tensors an __index__ that
reads the element instead.

When: only under the interpreter. The launchers call it on their first interpreted launch (their kernel
is then not a JITFunction); compiled kernels never see it, and it changes nothing but that conversion.
"""
from __future__ import annotations

_INTERPRETER_PATCHED = False


def patch_interpreter_index() -> None:
    """Make the interpreter's tensors convert to an index by reading their one element (once a process)."""
    global _INTERPRETER_PATCHED
    if _INTERPRETER_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _INTERPRETER_PATCHED = True


_BF16_DOT_PATCHED = False


def patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's tl.dot read bf16 operands as their values (once a process).

    Why: Triton 3.6's interpreter stores bf16 tensors as their uint16 bit patterns and its dot multiplies
    those integers (a 16 x 16 product of N(0, 1) entries comes out near 1e10). A bf16 value is its bits
    shifted into the top half of a float32, exactly, so the patched dot widens bf16 operands that way and
    multiplies in float32 (as the MMA accumulates bf16 products). Only under the interpreter; it changes
    no other operand type."""
    global _BF16_DOT_PATCHED
    if _BF16_DOT_PATCHED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar == tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _BF16_DOT_PATCHED = True


_FP8_CAST_PATCHED = False


def patch_interpreter_fp8_cast() -> None:
    """Make the interpreter round to float8 e4m3 (tl.float8e4nv) as the GPU does (once a process).

    Why: Triton 3.6's interpreter converts a float to e4m3 by cutting its bits: a mantissa rounded up
    past 0b111 wraps to 0b000 without raising the exponent (1.98 becomes 1.0, 0.49 becomes 0.25), and
    values below e4m3's smallest normal (2^-6) come out wrong. The GPU's conversion (cvt.rn.satfinite)
    rounds to nearest even and saturates at +-448. The patched conversion does that through torch's
    float8_e4m3fn after clamping to +-448. Only under the interpreter, only conversions to e4m3."""
    global _FP8_CAST_PATCHED
    if _FP8_CAST_PATCHED:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_fp_to_fp, original_trunc = builder.create_fp_to_fp, builder.create_fp_trunc

    def as_float32(handle) -> np.ndarray:
        if handle.dtype.scalar == tl.bfloat16:
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data.astype(np.float32)

    def to_e4m3(src) -> interpreter.TensorHandle:
        x = torch.from_numpy(np.ascontiguousarray(as_float32(src))).clamp(-448.0, 448.0)
        codes = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(codes, tl.float8e4nv)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16):
            return to_e4m3(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_fp_trunc(self, src, dst_type):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16):
            return to_e4m3(src)
        return original_trunc(self, src, dst_type)

    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_fp_trunc = create_fp_trunc
    _FP8_CAST_PATCHED = True
