"""Software prefetch for the Gluon decode kernels: while one page computes, the next page's side
tables (scales, zeros, means, codebooks, slot lists; int4's codes too, which it does not double-buffer
in registers) are asked of the memory system, so that the next page's own loads hit a cache instead of
each waiting a DRAM latency. Nothing waits for a prefetch and it writes no register: one instruction
covers a line a lane. The lane addresses are rebuilt where they are used behind `opaque` (hoisted out
of the page loop they held registers across it and made kivi2 and nuq2 spill). The kernels' PREFETCH
constexpr picks the level: 0 none, 2 into L2, 1 into L1 (and L2)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def lanes():
    """0..31, one a lane: the index prefetch addresses are built from."""
    return gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))


@gluon.jit
def opaque(x):
    """x (int32) through an asm move the compiler cannot see through: values built from it stay where
    they are used instead of being hoisted out of the loop into registers held across it."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def address(ptr):
    """A pointer's address as an int64 (byte arithmetic over tables of different types)."""
    return ptr.to(gl.int64, bitcast=True)


@gluon.jit
def prefetch(addr, LEVEL: gl.constexpr):
    """Each lane asks for the line holding its address (a [32] tensor built on lanes(): pointers or
    int64 byte addresses), no result. LEVEL 2: into L2; 1: into L1."""
    if addr.dtype.is_ptr():
        addr = address(addr)
    if LEVEL == 1:
        gl.inline_asm_elementwise("prefetch.global.L1 [$1]; // $0", "=r,l", [addr], dtype=gl.int32, is_pure=False,
                                  pack=1)
    else:
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addr], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def prefetch_four_tables(page, t0, t1, t2, t3, STRIDE: gl.constexpr, LEVEL: gl.constexpr):
    """Page-head `page`'s rows of four tables of the same 16-bit type and page stride STRIDE (at most
    256 elements: 512 bytes), 8 lanes a table, 64 bytes apart (int4's and kivi2's scales and zeros)."""
    ln = opaque(lanes())
    base = gl.where(ln < 8, t0, gl.where(ln < 16, t1, gl.where(ln < 24, t2, t3)))
    prefetch(base + page * STRIDE + (ln % 8) * 32, LEVEL)
