"""The Triton kernel of nuq2's sparse outlier term (moekv/ops/gluon/nuq2_sparse.py) against its
PyTorch oracle `outlier_corrections` (itself tested against dense attention in
test_gluon_nuq2_decode.py): under TRITON_INTERPRET=1 on CPU, compiled on a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import kernel_modules
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
    assert torch.equal(torch.as_tensor(np.asarray(byte)) * 4 + torch.as_tensor(np.asarray(field)), SLOT_OF_ELEMENT[kind])


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
