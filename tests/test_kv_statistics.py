"""benchmarks/quality/kv_statistics.py: the energy-concentration statistics on constructed tensors
against hand computations, and the layer bookkeeping of the captured K/V."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quality"))

import kv_statistics as stats  # noqa: E402


def channels_1_to_8() -> torch.Tensor:
    """Two tokens, channel c (0-based) holds c + 1 in both: channel energy 2 (c + 1)^2, total 2 * 204."""
    row = torch.arange(1, 9, dtype=torch.float32)
    return torch.stack([row, -row])


def test_top_channel_share_by_hand():
    x = channels_1_to_8()
    assert stats.top_channel_share(x, 1) == pytest.approx(64 / 204)
    assert stats.top_channel_share(x, 2) == pytest.approx((64 + 49) / 204)
    assert stats.top_channel_share(x, 8) == pytest.approx(1.0)


def test_top_pair_share_pairs_channel_i_with_i_plus_half():
    x = channels_1_to_8()  # pairs (1, 5), (2, 6), (3, 7), (4, 8): energies 26, 40, 58, 80 (times 2)
    assert stats.top_pair_share(x, 1) == pytest.approx(80 / 204)
    assert stats.top_pair_share(x, 2) == pytest.approx((80 + 58) / 204)


def test_pair_share_is_unchanged_by_a_rotary_rotation_and_channel_share_is_not():
    torch.manual_seed(0)
    tokens, d = 256, 16
    x = torch.randn(tokens, d, dtype=torch.float64)
    x[:, 2] *= 8.0  # one outlier channel: RoPE spreads it over its pair (2, 2 + d/2)
    angle = torch.rand(tokens, d // 2, dtype=torch.float64) * 2 * math.pi
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = x * cos + torch.cat([-x[:, d // 2:], x[:, :d // 2]], -1) * sin  # rotate_half's convention
    assert stats.top_pair_share(rotated, 2) == pytest.approx(stats.top_pair_share(x, 2), rel=1e-12)
    assert stats.top_channel_share(rotated, 1) < 0.75 * stats.top_channel_share(x, 1)


def test_top_element_share_by_hand():
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # energies 9 and seven 1s: total 16
    assert stats.top_element_share(x, 0.125) == pytest.approx(9 / 16)  # ceil(0.125 * 8) = 1 element
    assert stats.top_element_share(x, 0.01) == pytest.approx(9 / 16)  # ceil(0.08) = 1 element
    assert stats.top_element_share(x, 0.25) == pytest.approx(10 / 16)


def test_channel_absmax_ratio_and_kurtosis_by_hand():
    x = torch.tensor([[1.0, -2.0, 3.0], [0.5, 1.0, -10.0]])  # channel absmax 1, 2, 10: median 2
    assert stats.channel_absmax_ratio(x) == pytest.approx(5.0)
    v = torch.tensor([-2.0, -1.0, 1.0, 2.0])  # m2 = 2.5, m4 = 8.5
    assert float(stats.kurtosis(v)) == pytest.approx(8.5 / 6.25)
    cols = torch.stack([v, 3 * v + 7], dim=1)  # kurtosis ignores shift and scale
    assert stats.kurtosis(cols, dim=0).tolist() == pytest.approx([8.5 / 6.25] * 2)


def test_gaussian_reference_matches_the_analytic_shares():
    x = torch.randn(200_000, 8, generator=torch.Generator().manual_seed(1))
    z = 2.5758293035489  # the 99.5% quantile: the top 1% of |x|
    phi = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    analytic = 2 * (z * phi + 0.005)  # E[x^2; |x| > z] for a standard normal
    assert stats.top_element_share(x, 0.01) == pytest.approx(analytic, rel=0.03)
    assert float(stats.kurtosis(x)) == pytest.approx(3.0, abs=0.05)


def test_per_head_tokens_takes_one_layers_forwards_in_order():
    num_layers = 2
    # forward f, layer l: [B=2, H=3, T=4, D=5] filled with 10 * f + l
    chunks = [torch.full((2, 3, 4, 5), 10.0 * f + layer) for f in range(3) for layer in range(num_layers)]
    out = stats.per_head_tokens(chunks, 1, num_layers)
    assert out.shape == (3, 3 * 2 * 4, 5)
    assert sorted(set(out.flatten().tolist())) == [1.0, 11.0, 21.0]


@pytest.mark.parametrize("call", [
    lambda x: stats.top_channel_share(x, 0),
    lambda x: stats.top_channel_share(x, 9),
    lambda x: stats.top_pair_share(x, 5),
    lambda x: stats.top_element_share(x, 0.0),
    lambda x: stats.top_pair_share(x[:, :7], 1),
])
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call(channels_1_to_8())
