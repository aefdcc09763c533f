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
