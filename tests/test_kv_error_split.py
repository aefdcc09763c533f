"""benchmarks/quality/kv_error_split.py: the page split it quantizes with, and its hooks into a
transformers model (keys after RoPE through the attention function, keys before RoPE through the
rotary embedding)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quality"))

import kv_error_split as split  # noqa: E402

from moekv.kvcache.formats import get_kv_format  # noqa: E402


class Recorder:
    """A stand-in format: dequantize(quantize(x)) = x + 1000 * (page number + 1), pages recorded."""

    def __init__(self):
        self.pages = None

    def quantize(self, x, kind):
        self.pages = x.clone()
        return {"x": x}

    def dequantize(self, fields, kind):
        n = fields["x"].shape[0]
        return fields["x"] + 1000.0 * torch.arange(1, n + 1, dtype=torch.float32)[:, None, None, None]


def test_pages_are_consecutive_tokens_and_a_partial_page_is_left_as_is():
    B, H, T, D, P = 2, 3, 70, 4, 16  # 4 full pages a sequence, 6 tokens left over
    x = torch.randn(B, H, T, D)
    fmt = Recorder()
    out = split.quantize_pages(x, fmt, "key", P)
    assert fmt.pages.shape == (B * 4, H, P, D)
    for b in range(B):
        for i in range(4):
            assert torch.equal(fmt.pages[b * 4 + i], x[b, :, i * P:(i + 1) * P])
            assert torch.allclose(out[b, :, i * P:(i + 1) * P] - x[b, :, i * P:(i + 1) * P],
                                  torch.full((H, P, D), 1000.0 * (b * 4 + i + 1)))
    assert torch.equal(out[:, :, 64:], x[:, :, 64:])


def test_hooks_change_the_model_only_where_asked(mixtral_ckpt, monkeypatch):
    """Unquantized runs match transformers' own sdpa; nuq2 on keys after RoPE, on keys before RoPE and
    on values each change the perplexity, and differently."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral import modeling_mixtral

    # load() wraps the module's rotary function: restored after the test, for the other tests' models
    monkeypatch.setattr(modeling_mixtral, "apply_rotary_pos_emb", modeling_mixtral.apply_rotary_pos_emb)

    torch.manual_seed(0)
    windows = {"text": [torch.randint(2, 300, (128,)).tolist()]}
    quantizer = split.Quantizer()
    model = split.load(Path(mixtral_ckpt), quantizer)
    base = split.perplexity(model, windows)["text"]
    plain = AutoModelForCausalLM.from_pretrained(mixtral_ckpt, dtype=torch.float32, attn_implementation="sdpa")
    assert abs(split.perplexity(plain.eval(), windows)["text"] - base) <= 1e-4 * base
    nuq2 = get_kv_format("nuq2", torch.float32, codebook="page")
    seen = []
    for kinds, pre in ((("key",), False), (("key",), True), (("value",), False)):
        quantizer.setting = (nuq2, kinds, pre, 32)
        seen.append(split.perplexity(model, windows)["text"])
    quantizer.setting = None
    assert split.perplexity(model, windows)["text"] == base
    assert all(abs(p - base) > 1e-6 * base for p in seen)
    assert len({round(p, 6) for p in seen}) == 3
