"""The Triton kernel of nuq2's sparse outlier term (moekv/ops/gluon/nuq2_sparse.py) against its
PyTorch oracle `outlier_corrections` (itself tested against dense attention in
test_gluon_nuq2_decode.py): under TRITON_INTERPRET=1 on CPU, compiled on a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import kernel_modules  # first: it switches the Triton interpreter on for CPU runs

# isort: split
from tests.test_gluon_nuq2_decode import D, P, build, dense_reference

(sparse,) = kernel_modules("moekv.ops.gluon.nuq2_sparse")

from moekv.ops.gluon.nuq2_decode import main_term_reference, outlier_corrections, reduce_partials  # noqa: E402
from moekv.ops.gluon.nuq2_layout import SLOT_OF_ELEMENT  # noqa: E402  (after kernel_modules)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["key", "value"])
def test_code_positions_match_the_layout(kind):
    """The kernel's (byte, field) formulas are nuq2_layout's slot map."""
    import numpy as np

    t = torch.arange(P)[:, None].expand(P, D).reshape(-1)
    c = torch.arange(D)[None, :].expand(P, D).reshape(-1)
    fn = sparse.key_code_position if kind == "key" else sparse.value_code_position
    byte, field = fn.fn(t, c) if hasattr(fn, "fn") else fn(t, c)
    position = torch.as_tensor(np.asarray(byte)) * 4 + torch.as_tensor(np.asarray(field))
    assert torch.equal(position, SLOT_OF_ELEMENT[kind])


@pytest.mark.parametrize("G", [1, 4, 8])
def test_kernel_matches_torch_sparse_term(G):
    Hkv = 8 // G if G > 1 else 2
    lens = [200, 64, 5 * 64 + 1]
    num_splits = 3
    fmt, frag, tables, lens_t, k_pages, v_pages = build(lens, Hkv, seed=20 + G, device=DEVICE)
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(G)).to(DEVICE)
    scale = D ** -0.5
    o, lse = main_term_reference(q, frag, tables, lens_t, scale, num_splits)  # fp32 partials
    o_ref, lse_ref = o.clone(), lse.clone()
    outlier_corrections(o_ref, lse_ref, q, frag, tables, lens_t, scale)
    sparse.outlier_corrections_kernel(o, lse, q, frag, tables, lens_t, scale)
    finite = lse_ref.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    ref = dense_reference(fmt, k_pages, v_pages, q.double(), tables, lens_t, scale)
    torch.testing.assert_close(reduce_partials(o.double(), lse.double()).cpu(), ref, rtol=1e-3, atol=1e-3)


def _with_slots(frag, k_idx, v_idx):
    """frag with its out_idx tables replaced (and the slot-token lists derived again)."""
    from moekv.ops.gluon.nuq2_layout import Nuq2FragmentPages

    tensors = {k: t for k, t in frag.tensors().items() if k not in ("slot_tokens", "slot_counts", "k_used", "v_used")}
    tensors.update(k_out_idx=k_idx.contiguous(), v_out_idx=v_idx.contiguous())
    return Nuq2FragmentPages(**tensors, calibrated=frag.calibrated)


@pytest.mark.parametrize("G, num_splits", [(1, 8), (4, 2), (8, 5)])
def test_kernel_on_placed_slots(G, num_splits):
    """Slots placed by hand: several key slots on one token, key and value slots on the same token,
    a value slot alone, a page-head without slots, slots past the context (the last page is partly
    valid), and splits with no pages (num_splits above a sequence's page count). Against the
    PyTorch term and dense attention over the pages the tables describe."""
    from moekv.ops.gluon.nuq2_layout import from_fragment_order

    NO = 0xFFFF
    Hkv = 2
    lens = [130, 64 * 4, 3]
    fmt, frag, tables, lens_t, _, _ = build(lens, Hkv, seed=40 + G, device=DEVICE)
    k_idx, v_idx = frag.k_out_idx.clone(), frag.v_out_idx.clone()
    p_last = int(tables[0, 2])  # sequence 0's last page: tokens 0 and 1 valid
    k_idx[p_last, 0] = NO
    k_idx[p_last, 0, :4] = torch.tensor([0 * D + 7, 0 * D + 91, 0 * D + 3, 1 * D + 7])  # 3 slots on token 0
    k_idx[p_last, 0, 4] = 40 * D + 5  # past the context
    v_idx[p_last, 0] = NO
    v_idx[p_last, 0, 1:4] = torch.tensor([0 * D + 1, 1 * D + 100, 50 * D + 2])  # same token as a key slot; past
    v_idx[p_last, 1, :2] = NO  # used slots after unused ones: the layout moves them first
    p_empty = int(tables[1, 1])
    k_idx[p_empty, 1] = NO  # no slots at all
    v_idx[p_empty, 1] = NO
    p_v = int(tables[1, 3])
    k_idx[p_v, 0] = NO  # value slots only
    frag = _with_slots(frag, k_idx, v_idx)
    assert int(frag.slot_counts[p_empty, 1]) == 0
    assert frag.slot_tokens[p_last, 0, :4].tolist() == [0, 1, 40, 50]
    assert int(frag.v_used[p_last, 0]) == 3 and frag.v_out_idx[p_last, 0, 0] == 0 * D + 1
    q = torch.randn(len(lens), Hkv * G, D, generator=torch.Generator().manual_seed(G)).to(DEVICE)
    scale = D ** -0.5
    o, lse = main_term_reference(q, frag, tables, lens_t, scale, num_splits)
    o_ref, lse_ref = o.clone(), lse.clone()
    outlier_corrections(o_ref, lse_ref, q, frag, tables, lens_t, scale)
    sparse.outlier_corrections_kernel(o, lse, q, frag, tables, lens_t, scale)
    finite = lse_ref.isfinite()
    assert not finite.all()  # some splits are empty
    assert torch.equal(lse.isfinite(), finite)
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    k_pages, v_pages = from_fragment_order(fmt, frag)
    ref = dense_reference(fmt, k_pages, v_pages, q.double(), tables, lens_t, scale)
    torch.testing.assert_close(reduce_partials(o.double(), lse.double()).cpu(), ref, rtol=1e-3, atol=1e-3)


def test_kernel_refuses_slot_lists_that_do_not_fit():
    fmt, frag, tables, lens_t, _, _ = build([64], 2, seed=3, device=DEVICE)
    frag.slot_tokens = frag.slot_tokens[..., :-1]
    o = torch.zeros(1, 2, 1, D, device=DEVICE)
    lse = torch.zeros(1, 2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="slot lists"):
        sparse.outlier_corrections_kernel(o, lse, torch.zeros(1, 2, D, device=DEVICE), frag, tables, lens_t, 0.1)


SPARSE_SM90_BUILD = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekv.ops.gluon.nuq2_sparse import nuq2_sparse_term_kernel
sig = {"q_ptr": "*bf16", "k_codes": "*u8", "v_codes": "*u8", "k_cent": "*fp16", "v_cent": "*fp16",
       "k_mean": "*fp8e4nv", "k_scale": "*fp8e4nv", "k_oval": "*fp8e4nv", "k_oidx": "*i32", "v_oval": "*fp8e4nv",
       "v_oidx": "*i32", "slot_tokens": "*i32", "slot_counts": "*i32", "k_used": "*i32", "v_used": "*i32",
       "block_tables": "*i32", "stride_bt": "i32",
       "context_lens": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "qk2": "fp32", "num_splits": "i32"}
ce = dict(HKV=8, G=8, SK=80, SV=32, SK_PAD=128, SV_PAD=32, ST=112, ST_PAD=128, NO=0xFFFF)  # nuq2's counts
sig.update({k: "constexpr" for k in ce})
k = compile(ASTSource(nuq2_sparse_term_kernel, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4))
print("mma.sync" in k.asm["ptx"], ".local" in k.asm["ptx"])
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """The sparse kernel builds for the H200 (sm_90): its reshapes and tf32x3 dots lower to tensor-core
    MMAs, with no local memory in the PTX. In a fresh interpreter (see test_gluon_nuq2_decode.py's
    build test for why)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SPARSE_SM90_BUILD], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "False"], run.stdout
