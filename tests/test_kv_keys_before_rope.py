"""Keys stored before RoPE (kv_keys_before_rope, nuq2 and vq): pages hold the keys rotated back by their
positions, every reader rotates them again after the lookup (gather, the reference attention, the
Triton decode kernel), the 16-bit staging page keeps them as the layer wrote them (rotated).

The oracles are independent of the code under test: RoPE as complex multiplication in float64,
attention in float64 over keys rotated that way, and the format's own quantize -> dequantize of
the un-rotated keys. Without CUDA the decode kernel runs under TRITON_INTERPRET=1.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_kv_keys_before_rope.py
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.triton_kernels import DECODE_MODULES, kernel_modules, triton  # noqa: E402,F401 (before any kernel import)

# the interpreter switch above must be set before any moekv module decorates a kernel
# isort: split

import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.context import Context  # noqa: E402
from moekv.kvcache.calibration_io import CALIBRATION_FILE, RECORD_FILE  # noqa: E402
from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.kvcache.formats.vq import fit_codebook, fit_key_channel_scale  # noqa: E402
from moekv.ops.reference import rope_rotate_ref  # noqa: E402
from tests.kv_formats import step_context  # noqa: E402

decode = dict(zip(DECODE_MODULES, kernel_modules(*DECODE_MODULES)))
paged = decode["moekv.ops.decode.paged"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
THETA = 10000.0


def rope64(x: torch.Tensor, positions: torch.Tensor, theta: float = THETA) -> torch.Tensor:
    """x [T, H, D] rotated by RoPE (rotate-half pairs (i, i + D/2)) as complex numbers, in float64."""
    D = x.shape[-1]
    x = x.double()
    freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # [D/2]
    turn = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64),
                       positions.double()[:, None] * freq[None, :])  # [T, D/2]
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def pre_rope_keys(T: int, H: int, D: int, g: torch.Generator) -> torch.Tensor:
    """Keys before RoPE as real models have them: a few channels with a large constant offset (which
    RoPE turns into an offset that rotates with the position) and one wide channel."""
    k = torch.randn(T, H, D, generator=g)
    k[..., 3] += 6.0
    k[..., D // 2 + 5] -= 4.0
    k[..., 7] *= 5.0
    return k


def test_rope_rotate_ref_is_rope_and_its_inverse_undoes_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g, dtype=torch.float64)
    positions = torch.arange(1000, 1050)
    rotated = rope_rotate_ref(x, positions, THETA)
    # the angles in fp32 as the model computes them: 1e-4 rad at position 1000
    assert (rotated - rope64(x, positions)).abs().max() < 1e-3
    assert (rope_rotate_ref(rotated, positions, THETA, inverse=True) - x).abs().max() < 1e-6
    # the same call applies one rotation and its inverse in any dtype: the norms are kept
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)


def test_the_option_is_declared_checked_and_refused_where_not_taken():
    assert get_kv_format("nuq2", keys_before_rope=True).keys_before_rope
    assert not get_kv_format("nuq2").keys_before_rope
    with pytest.raises(ValueError, match="keys_before_rope"):
        get_kv_format("nuq2", keys_before_rope=1)
    with pytest.raises(ValueError, match="keys_before_rope"):  # tiered's low tier keeps post-RoPE keys
        get_kv_format("tiered", keys_before_rope=True)
    with pytest.raises(ValueError, match="keys_before_rope"):
        get_kv_format("kivi2", keys_before_rope=True)


def test_gluon_kernels_refuse_it_and_auto_takes_triton():
    fmt = get_kv_format("nuq2", decode_kernel="gluon", keys_before_rope=True)
    with pytest.raises(ValueError, match="keys_before_rope"):
        fmt.fragment_pages(64, 128, "cpu")
    auto = get_kv_format("nuq2", decode_kernel="auto", keys_before_rope=True)
    assert not auto.fragment_pages(64, 128, "cpu")
    assert "keys_before_rope" in auto.gluon_kernel.covers(auto, 64, 128)


# -- format level: what the pages hold, what gather gives ---------------------------------------------------
H, P, D = 2, 32, 64


def allocate(fmt, num_blocks=12, slots=4):
    cache = fmt.allocate(num_blocks, H, P, D, torch.device("cpu"), slots, torch.bfloat16)
    cache.rope_theta = THETA
    return cache


def rel(x, ref):
    return ((x.double() - ref.double()).pow(2).sum() / ref.double().pow(2).sum()).item()


@pytest.mark.parametrize("name", ["nuq2", "vq"])
def test_pages_hold_keys_before_rope_and_gather_rotates_them(name, vq_calibration):
    """One prefill of 150 tokens (4 full pages, 22 staged): the pages dequantize to the un-rotated
    keys (not the rotated ones), gather gives them rotated by their positions (float64 RoPE of the
    format's own round trip of the un-rotated keys), the staged tail as written; and storing them
    before RoPE loses less than storing the rotated keys (their offsets rotate with the position)."""
    g = torch.Generator().manual_seed(1)
    T = 150
    k_pre = pre_rope_keys(T, H, D, g)
    k = rope64(k_pre, torch.arange(T)).float()  # what the layer writes
    v = torch.randn(T, H, D, generator=g)
    table = [9, 2, 7, 0, 4]
    ctx = step_context([(1, table, 0, T)], P)
    # residual=0: every full page read back from its codes (a window would hand back its newest keys exact)
    options = {"calibration": vq_calibration(before_rope=True)} if name == "vq" else {"codebook": "page"}
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", keys_before_rope=True, residual=0, **options)
    cache = allocate(fmt)
    fmt.write(cache, k.bfloat16(), v.bfloat16(), ctx)

    stored = fmt.dequantize_pages(cache, "key", torch.tensor(table[:4]))  # [4, H, P, D]
    stored = stored.permute(0, 2, 1, 3).reshape(4 * P, H, D)
    staged_pre = rope_rotate_ref(k.bfloat16().float(), torch.arange(T), THETA, inverse=True)  # what was quantized
    # nuq2 0.10, vq 0.21 (a small test calibration) from the keys before RoPE; 1.5-1.7 from the rotated ones
    assert rel(stored, staged_pre[:4 * P]) < 0.3
    assert rel(stored, k[:4 * P]) > 1.0

    got = fmt.gather(cache, ctx, 0, T, "key")
    want = torch.cat([rope64(stored, torch.arange(4 * P)), k[4 * P:].bfloat16().double()])
    assert (got.double() - want).abs().max() < 1e-3  # the fp32 angles of the model against float64's
    assert torch.equal(got[4 * P:], k[4 * P:].bfloat16().float())  # the staged tail as written
    for n in (1, 31, 32, 33, 100, 128):
        assert torch.equal(fmt.gather(cache, ctx, 0, n, "key"), got[:n])

    options = {"calibration": vq_calibration(before_rope=False), "residual": 0} if name == "vq" else \
        {"codebook": "page", "residual": 0}
    post = get_kv_format(name, torch.bfloat16, decode_kernel="triton", **options)
    post_cache = allocate(post)
    post.write(post_cache, k.bfloat16(), v.bfloat16(), ctx)
    err_pre = rel(got[:4 * P], k[:4 * P])
    err_post = rel(post.gather(post_cache, ctx, 0, T, "key")[:4 * P], k[:4 * P])
    assert err_pre < 0.8 * err_post, (err_pre, err_post)


def test_decode_fills_store_what_a_prefill_stores():
    """A page filled by a decode step (quantize_filled_pages, positions found through the step's
    staging slots) is rotated back by its own positions: its slab equals the one a prefill of the
    same tokens stores. Two sequences decode; the one in the second row fills its second page."""
    g = torch.Generator().manual_seed(2)
    k = rope64(pre_rope_keys(2 * P, H, D, g), torch.arange(2 * P)).float().bfloat16()
    v = torch.randn(2 * P, H, D, generator=g).bfloat16()
    fmt = get_kv_format("nuq2", torch.bfloat16, decode_kernel="triton", keys_before_rope=True, codebook="page")
    whole = allocate(fmt)
    fmt.write(whole, k, v, step_context([(0, [3, 5], 0, 2 * P)], P))

    stepped = allocate(fmt)
    fmt.write(stepped, k[:-1], v[:-1], step_context([(2, [3, 5], 0, 2 * P - 1)], P))
    fmt.write(stepped, k[:10], v[:10], step_context([(1, [8], 0, 10)], P))  # the other sequence
    ctx = Context(positions=torch.tensor([10, 2 * P - 1]), slot_mapping=torch.tensor([8 * P + 10, 5 * P + P - 1]),
                  block_tables=torch.tensor([[8, 0], [3, 5]], dtype=torch.int32),
                  context_lens=torch.tensor([11, 2 * P], dtype=torch.int32),
                  query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), logits_indices=torch.tensor([0, 1]),
                  seq_slots=torch.tensor([1, 2]), max_query_len=1,
                  fill_slots=torch.tensor([2]), fill_pages=torch.tensor([5]))
    fmt.write(stepped, torch.stack([k[10], k[-1]]), torch.stack([v[10], v[-1]]), ctx)
    fmt.quantize_filled_pages([stepped], ctx)
    assert torch.equal(stepped["k_pages"][[3, 5]], whole["k_pages"][[3, 5]])
    assert torch.equal(stepped["v_pages"][[3, 5]], whole["v_pages"][[3, 5]])
    # the page read back is the keys as written, rotated: the positions of the second page, not the first's
    back = fmt.gather(stepped, ctx, 1, 2 * P, "key")
    assert rel(back[P:], k[P:].float()) < 0.1


def test_reference_attention_is_float64_attention_over_rotated_keys():
    """attend (the CPU path: dense attention over gather) of a chunk after a prefilled context
    equals float64 attention over the cached keys as float64 RoPE rotates the stored (un-rotated)
    pages, the rows staged before the step as staged (rotated, 16-bit), and the chunk's own keys as
    computed (step_kv)."""
    g = torch.Generator().manual_seed(3)
    k = rope64(pre_rope_keys(100, H, D, g), torch.arange(100)).float().bfloat16().float()
    v = torch.randn(100, H, D, generator=g).bfloat16().float()
    fmt = get_kv_format("nuq2", torch.float32, keys_before_rope=True, codebook="page", residual=0)
    cache = fmt.allocate(12, H, P, D, torch.device("cpu"), 3, torch.float32)
    cache.rope_theta = THETA
    table = [4, 1, 6, 2]
    fmt.write(cache, k[:70], v[:70], step_context([(2, table, 0, 70)], P))
    ctx = step_context([(2, table, 70, 100)], P)
    fmt.write(cache, k[70:], v[70:], ctx)
    q = torch.randn(30, 2 * H, D, generator=g)
    scale = D ** -0.5
    out = fmt.attend(q, cache, ctx, scale, None, (k[70:], v[70:]))

    # positions 0-63 as stored: pages 0-1; 64-69 as staged before the step (the step filled page 2,
    # 64-95, and quantized it, but the chunk reads the rows it found staged)
    stored_k, stored_v = (fmt.dequantize_pages(cache, kind, torch.tensor(table[:2])).permute(0, 2, 1, 3)
                          .reshape(2 * P, H, D) for kind in ("key", "value"))
    keys = torch.cat([rope64(stored_k, torch.arange(2 * P)), k[2 * P:].double()])
    values = torch.cat([stored_v.double(), v[2 * P:].double()])
    keys, values = (x.repeat_interleave(2, dim=1) for x in (keys, values))
    scores = torch.einsum("qhd,lhd->hql", q.double(), keys) * scale
    scores.masked_fill_(torch.arange(100)[None, :] > torch.arange(70, 100)[:, None], float("-inf"))
    ref = torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)
    assert (out.double() - ref).abs().max() < 1e-4


def test_a_cache_without_rope_theta_is_refused():
    fmt = get_kv_format("nuq2", keys_before_rope=True, codebook="page")
    cache = fmt.allocate(4, H, P, D, torch.device("cpu"), 2, torch.bfloat16)  # rope_theta not set
    k = torch.randn(P, H, D).bfloat16()
    with pytest.raises(ValueError, match="rope_theta"):
        fmt.write(cache, k, k, step_context([(0, [1], 0, P)], P))


# -- the Triton decode kernel ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vq_calibration(tmp_path_factory):
    """before_rope -> a vq calibration folder for (H, D) fitted on keys before / after RoPE, its record
    saying which."""
    root = tmp_path_factory.mktemp("vq_prerope")
    made = {}

    def make(before_rope: bool, hkv: int = H, dim: int = D) -> str:
        key = (before_rope, hkv, dim)
        if key not in made:
            folder = root / f"{'pre' if before_rope else 'post'}_h{hkv}d{dim}"
            folder.mkdir()
            tables = {}
            for layer in (0, 1):
                g = torch.Generator().manual_seed(20 + layer)
                T = 8 * 64
                k_pre = pre_rope_keys(T, hkv, dim, g)
                k = k_pre if before_rope else rope64(k_pre, torch.arange(T)).float()  # 8 pages of one sequence
                pages = k.reshape(8, 64, hkv, dim).transpose(1, 2).contiguous()
                values = torch.randn(8, hkv, 64, dim, generator=g)
                scale = fit_key_channel_scale(pages)
                tables[f"vq.layer{layer}.key.chan_scale"] = scale
                tables[f"vq.layer{layer}.key.codebook"] = fit_codebook(pages, "key", scale, 8, 2, 512, g)
                tables[f"vq.layer{layer}.value.codebook"] = fit_codebook(values, "value", None, 8, 2, 512, g)
            save_file(tables, str(folder / CALIBRATION_FILE))
            (folder / RECORD_FILE).write_text(json.dumps({"keys_before_rope": before_rope}))
            made[key] = str(folder)
        return made[key]
    return make


def decode_case(name, lens, hkv, group, dim, block_size, splits, block_n, options, window=None, seed=0,
                q_dtype=torch.float32, swap_ab=None):
    """A prefilled cache of sequences `lens` (keys rotated as the layer writes them), then one decode
    query each: the kernel's output and float64 dense attention over gather."""
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", keys_before_rope=True, **options)
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 2
    cache = fmt.allocate(num_blocks, hkv, block_size, dim, DEVICE, len(lens) + 2, torch.bfloat16)
    cache.rope_theta = THETA
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in pages]
    slots = list(range(len(lens) + 1, 1, -1))[:len(lens)]  # not the identity
    chunks = [(slots[b], tables[b], 0, n) for b, n in enumerate(lens)]
    ctx = step_context(chunks, block_size)
    k = torch.cat([rope64(pre_rope_keys(n, hkv, dim, g), torch.arange(n)).float() for n in lens])
    v = torch.randn(sum(lens), hkv, dim, generator=g)
    ctx = Context(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in
                    (ctx.positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, ctx.query_start_loc,
                     ctx.logits_indices, ctx.seq_slots, ctx.max_query_len)))
    fmt.write(cache, k.to(DEVICE, torch.bfloat16), v.to(DEVICE, torch.bfloat16), ctx)
    q = torch.randn(len(lens), hkv * group, dim, generator=g).to(DEVICE, q_dtype)
    scale = dim ** -0.5
    spec = fmt.decode_spec(block_size, dim)
    assert spec.key_rope and spec.key.fold_fn is None and spec.key.fix_fn is None
    out = paged.paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, scale, window,
                                       spec, num_splits=splits, block_n=block_n, swap_ab=swap_ab)
    keys = [fmt.gather(cache, ctx, b, n, "key").double() for b, n in enumerate(lens)]
    values = [fmt.gather(cache, ctx, b, n, "value").double() for b, n in enumerate(lens)]
    from moekv.ops.reference import decode_attention_ref

    ref = decode_attention_ref(q.double(), keys, values, scale, window)
    return out, ref, fmt, cache


def check(out, ref, q_dtype=torch.float32):
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    rel_tol = 2e-3 if DEVICE.type == "cpu" and q_dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= rel_tol * (ref.abs().max().item() + 1e-6), f"max error {err:.3g}"


@pytest.mark.parametrize("swap_ab", [False, True], ids=["qk", "kq"])
def test_nuq2_kernel_rotates_keys_after_the_lookup(swap_ab):
    """Planar columns (4 planes), a tile inside one page and outlier slots in use; a sequence shorter
    than a page (the staged tail alone); the products in either orientation."""
    out, ref, fmt, cache = decode_case("nuq2", [150, 20], 2, 4, 64, 32, 2, 32, {"codebook": "page"},
                                       swap_ab=swap_ab)
    check(out, ref)
    used = fmt.layout("key", 32, 64).unpack(cache["k_pages"])["out_idx"]
    assert (used != 0xFFFF).any()  # the slots' corrections are exercised


def test_vq_kernel_rotates_keys_after_the_lookup(vq_calibration):
    """Channel-order columns, tiles over two pages (NPG > 1) and a sliding window."""
    out, ref, *_ = decode_case("vq", [150, 70], 2, 2, 64, 16, 2, 32,
                               {"calibration": vq_calibration(before_rope=True)}, window=90)
    check(out, ref)


# (name, lens, Hkv, G, D, P, splits, BLOCK_N): tiles inside a page from its start or not, over 2-4
# pages, head_dim 32 / 64 / 128, one split or several
GRID = [
    ("nuq2", [64], 2, 4, 64, 32, 1, 16),
    ("nuq2", [96, 40, 1], 2, 4, 32, 32, 3, 64),
    ("nuq2", [75], 1, 4, 128, 16, 2, 64),
    ("vq", [64], 2, 4, 64, 32, 1, 16),
    ("vq", [96, 40, 1], 2, 1, 32, 16, 3, 64),
    ("vq", [75], 1, 4, 128, 32, 2, 32),
]


@pytest.mark.parametrize("case", range(len(GRID)))
def test_kernel_grid(case, vq_calibration):
    name, lens, hkv, group, dim, block_size, splits, block_n = GRID[case]
    options = {"calibration": vq_calibration(True, hkv, dim)} if name == "vq" else {"codebook": "page"}
    out, ref, *_ = decode_case(name, lens, hkv, group, dim, block_size, splits, block_n, options, seed=case)
    check(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["nuq2", "vq"])
def test_kernel_at_the_benchmark_shape_in_bf16(name, vq_calibration):
    """32 query / 8 KV heads, head_dim 128, pages of 64, the launch's own tile and splits, bf16 q."""
    options = {"calibration": vq_calibration(True, 8, 128)} if name == "vq" else {"codebook": "page"}
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", keys_before_rope=True, **options)
    spec = fmt.decode_spec(64, 128)
    out, ref, *_ = decode_case(name, [1000, 300, 64], 8, 4, 128, 64, None, None, options, q_dtype=torch.bfloat16)
    assert spec.key_rope
    check(out, ref, torch.bfloat16)


# -- the engine (the shipped model: real attention, head_dim 128) ---------------------------------------
def test_engine_reads_pre_rope_pages_rotated(monkeypatch):
    """Prompts prefilled in chunks of 64 (later chunks read earlier pages through gather): with keys
    stored before RoPE their next-token distributions stay nearer the float32 cache's (mean KL) than
    with keys stored after RoPE, and far nearer than the same pages read without their rotation."""
    prompts = [[(7 * j + 13 * s) % 300 + 5 for j in range(n)] for s, n in ((1, 200), (2, 150))]

    def score(**kwargs):
        llm = LLM(dtype="float32", block_size=32, max_model_len=256, max_num_batched_tokens=64, **kwargs)
        return llm, llm.score([{"prompt_token_ids": p} for p in prompts])

    _, want = score(kv_cache_dtype="fp32")

    def kl(got):
        return sum(float(F.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True, reduction="batchmean"))
                   for g, w in zip(got, want)) / len(want)

    llm, pre = score(kv_cache_dtype="nuq2", kv_keys_before_rope=True)
    _, post = score(kv_cache_dtype="nuq2")
    assert kl(pre) < kl(post), (kl(pre), kl(post))  # 0.15 against 0.17
    from moekv.kvcache.formats import paged as paged_formats

    rotate = paged_formats.rotate_key_pages
    monkeypatch.setattr(paged_formats, "rotate_key_pages",  # written before RoPE, read without it
                        lambda x, starts, theta, inverse=False: rotate(x, starts, theta, inverse) if inverse else x)
    assert kl(llm.score([{"prompt_token_ids": p} for p in prompts])) > 2 * kl(pre)  # 0.52


def test_engine_decode_steps_match_one_token_prefill_steps():
    """Greedy decoding (decode steps: the pages they fill quantized after the last layer, positions
    from the staging slots) gives the tokens that scoring the same sequence one token a step (the
    prefill path's write) picks: both store and read every page alike. The prompt is prefilled one
    token a step too, so both runs see the same K/V; pages fill at 32, 64 and 96."""
    prompt = [(7 * j + 13) % 300 + 5 for j in range(40)]
    kwargs = dict(dtype="float32", block_size=32, max_model_len=128, kv_cache_dtype="nuq2", kv_keys_before_rope=True,
                  max_num_batched_tokens=1)
    llm = LLM(**kwargs)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    generated = list(out[0].outputs[0].token_ids)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    logits = LLM(**kwargs).score([{"prompt_token_ids": prompt + generated}])[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == generated


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_decode_kernel_matches_the_reference_path(monkeypatch):
    """On CUDA (bf16, CUDA graphs) decode steps over nuq2 pages stored before RoPE through the Triton
    kernel give the next-token distributions of the same steps through the reference path (gather,
    which the format takes without a decode_spec): 384 decode steps over a 640-token prompt of
    held-out prose, pages filled and quantized by the graph steps."""
    from moekv.config import default_model_path
    from moekv.kvcache.formats.nuq2 import NUQ2Format

    text = (default_model_path() / "heldout" / "prose.txt").read_text()
    kwargs = dict(device="cuda", kv_cache_dtype="nuq2", kv_codebook="page", kv_keys_before_rope=True,
                  max_model_len=1024, kv_cache_memory_gb=1.0)

    def score():
        import gc

        llm = LLM(**kwargs)
        ids = llm.tokenizer.encode(text)[:1024]
        assert llm.engine.runner.kv_format.keys_before_rope
        out = llm.score([{"prompt_token_ids": ids}], decode_from=[640])[0][640:].float().log_softmax(-1)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return out

    fused = score()
    monkeypatch.setattr(NUQ2Format, "decode_spec", lambda self, block_size, head_dim: None)
    reference = score()
    agree = (fused.argmax(-1) == reference.argmax(-1)).float().mean().item()
    kl = F.kl_div(fused, reference, log_target=True, reduction="batchmean").item()
    assert agree > 0.95 and kl < 1e-2, (agree, kl)


# -- calibration on keys before RoPE ------------------------------------------------------------------------
def test_calibrate_fits_keys_before_rope_and_vq_reads_them(mixtral_ckpt, tmp_path):
    """`calibrate(keys_before_rope=True)` keeps the key pages rotated back by their positions in each
    window (float64 RoPE of them gives the observed keys again), records it, and vq takes that
    calibration only with kv_keys_before_rope (and the other one only without)."""
    from moekv.tools.calibrate import calibrate, collect_pages

    text = tmp_path / "calib.txt"
    text.write_text("It was the best of times, it was the worst of times, it was the age of wisdom. " * 12)
    llm = LLM(mixtral_ckpt, dtype="float32", kv_cache_dtype="fp32", max_num_seqs=1)
    ids = llm.tokenizer.encode(text.read_text())[:256]
    post = collect_pages(llm, ids, 128, 32, 64, seed=0, progress=False)
    pre = collect_pages(llm, ids, 128, 32, 64, seed=0, progress=False, keys_before_rope=True)
    theta = llm.engine.model_config.rope_theta
    k_pre, k_post = pre.collected(0, "key"), post.collected(0, "key")  # [n, Hkv, P, D], the same pages
    assert not torch.allclose(k_pre, k_post, atol=1e-2)
    # each window of 128 starts at position 0: its pages at 0, 32, 64, 96, picked in one order per window
    for page_pre, page_post in zip(k_pre, k_post):
        positions = next(torch.arange(start, start + 32) for start in (0, 32, 64, 96)
                         if torch.allclose(rope64(page_pre.transpose(0, 1), torch.arange(start, start + 32), theta),
                                           page_post.transpose(0, 1).double(), atol=1e-4))
        assert positions is not None
    assert torch.equal(pre.collected(0, "value"), post.collected(0, "value"))

    out = calibrate(mixtral_ckpt, text, tmp_path / "pre", max_tokens=512, window=128, block_size=32, progress=False,
                    keys_before_rope=True, vq_iters=2, vq_max_vectors=1024)
    assert json.loads((out / RECORD_FILE).read_text())["keys_before_rope"] is True
    with pytest.raises(ValueError, match="before RoPE; pass kv_keys_before_rope=True"):
        get_kv_format("vq", calibration=str(out))  # fitted before RoPE, read as after
    llm = LLM(mixtral_ckpt, kv_cache_dtype="vq", kv_calibration=str(out), kv_keys_before_rope=True,
              max_model_len=128, block_size=32, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": list(range(2, 80))}],
                        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 24
    nuq2 = get_kv_format("nuq2", calibration=str(out))  # auto: its key codebooks are of the other side
    assert not nuq2.calibrated
    with pytest.raises(ValueError, match="keys_before_rope"):
        get_kv_format("nuq2", calibration=str(out), codebook="calibrated")
    assert get_kv_format("nuq2", calibration=str(out), keys_before_rope=True).calibrated


# -- the compiled kernel (sm_90), built without a GPU ------------------------------------------------------
SM90_BUILD = r'''
import json, os, re, shutil, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import moekv.ops.decode.paged as paged
from moekv.kvcache.formats import get_kv_format
from moekv.kvcache.formats.vq import random_calibration

class Captured(Exception):
    pass

def capture(kernel, kernel_args, *args, **kwargs):  # the launch's arguments, instead of launching
    raise Captured(kernel_args(4)[3])

paged.launch_split_kernel = capture
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8",
         torch.int32: "i32", torch.int64: "i64"}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
post = random_calibration(tempfile.mkdtemp(), 8, 128)
pre = tempfile.mkdtemp()
shutil.copy(os.path.join(post, "kv_calibration.safetensors"), pre)
open(os.path.join(pre, "kv_calibration.json"), "w").write(json.dumps({"keys_before_rope": True}))
for name, options in (("nuq2", {"codebook": "page"}), ("nuq2", {"codebook": "page", "keys_before_rope": True}),
                      ("vq", {"calibration": str(post)}), ("vq", {"calibration": pre, "keys_before_rope": True})):
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", **options)
    cache = fmt.allocate(8, 8, 64, 128, torch.device("cpu"), 3, torch.bfloat16)
    cache.rope_theta = 1e6
    try:
        paged.paged_decode_attention(torch.zeros(2, 32, 128, dtype=torch.bfloat16), cache,
                                     torch.zeros(2, 4, dtype=torch.int32), torch.tensor([200, 100], dtype=torch.int32),
                                     torch.arange(2), 0.1, None, fmt.decode_spec(64, 128), block_n=64, use_asm=True)
    except Captured as e:
        args = e.args[0]
    kernel = paged._paged_decode_kernel
    signature, constexprs = {}, {}
    for p, a in zip(kernel.params, args):
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", a
        else:
            signature[p.name] = ("*" + TYPES[a.dtype] if isinstance(a, torch.Tensor) else "i32" if isinstance(a, int)
                                 else "fp32")
    k = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=2))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    print(name, "sin.approx.f32" in k.asm["ptx"], len(re.findall(r"\b(LDL|STL)\b", sass)), sass.count("\n"))
'''


@pytest.mark.slow
def test_kernel_builds_for_sm90_without_a_gpu():
    """The Triton decode kernel with keys before RoPE builds for the H200 (sm_90) with the ptxas Triton
    ships (nuq2 and vq, at the benchmark's shape, inline PTX on): sin / cos are the hardware's
    approximations (libdevice's add a local-memory path), and the kernel is within 1.5x of the one
    without the option in instructions and local-memory accesses. About a minute on one CPU core."""
    from tests.gluon_cases import run_sm90_build

    words = run_sm90_build(SM90_BUILD)
    rows = [words[i:i + 4] for i in range(0, len(words), 4)]
    assert [(r[0], r[1]) for r in rows] == [("nuq2", "False"), ("nuq2", "True"), ("vq", "False"), ("vq", "True")]
    for base, rope in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert int(rope[2]) <= 1.5 * int(base[2]) + 16, (base, rope)  # LDL / STL
        assert int(rope[3]) <= 1.5 * int(base[3]), (base, rope)  # SASS lines
