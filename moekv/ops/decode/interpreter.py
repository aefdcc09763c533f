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
