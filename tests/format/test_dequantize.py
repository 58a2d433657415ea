"""QuantizedWeight.dequantize: scale * (q - zero) per column's group, bit for bit as the gathered reference, made in
one [N, K] buffer (no [N, K] gathers of the scales and zeros beside it, where groups are consecutive columns)."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.primitives import QuantizedWeight, QuantScheme, default_g_idx
from tests_support.peak_rss import peak_rss_kib, reset_peak_rss_kib


def reference(qw: QuantizedWeight) -> torch.Tensor:
    """The gathered form: every column's scale and zero as [N, K] tensors."""
    s = qw.scales[qw.g_idx.long()].T
    z = qw.zeros[qw.g_idx.long()].T
    return s * (qw.qweight.float() - z)


def random_weight(n: int, k: int, group: int, act_order: bool, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(bits=4, group_size=group, sym=False)
    groups = scheme.num_groups(k)
    g_idx = default_g_idx(k, scheme)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                           torch.rand(groups, n, generator=gen) * 0.01 + 1e-4,
                           torch.randint(0, 16, (groups, n), generator=gen).float(), g_idx, scheme)


@pytest.mark.parametrize("k,group,act_order", [(256, 32, False), (256, 128, False), (256, -1, False),
                                               (100, 32, False), (256, 32, True), (256, 128, True)])
def test_dequantize_is_the_gathered_reference_bit_for_bit(k, group, act_order):
    qw = random_weight(48, k, group, act_order)
    out = qw.dequantize()
    assert out.dtype == torch.float32 and out.shape == (48, k)
    assert torch.equal(out, reference(qw))


def test_dequantize_holds_one_output_sized_buffer():
    qw = random_weight(4096, 4096, 128, act_order=False)  # out: 64 MiB fp32
    before = reset_peak_rss_kib()
    out = qw.dequantize()
    grown_mib = (peak_rss_kib() - before) / 1024
    assert out.shape == (4096, 4096)
    assert grown_mib < 64 * 1.5, f"dequantize of a 64 MiB weight raised the peak by {grown_mib:.0f} MiB"
