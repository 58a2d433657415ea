"""GPTQ's running Hessian (quantkit.quant.gptq.accumulate_hessian) made symmetric in place: the numbers of the
whole-matrix form h.tril() + h.tril(-1).T, bit for bit, without its K x K temporaries."""

from __future__ import annotations

import pytest
import torch

from quantkit.quant.gptq import HESSIAN_COLUMN_BLOCKS, accumulate_hessian, empty_hessian, mirror_lower
from tests_support.peak_rss import peak_rss_kib, reset_peak_rss_kib


def whole_matrix_mirror(h: torch.Tensor) -> torch.Tensor:
    lower = h.tril()
    return lower + lower.tril(-1).T


@pytest.mark.parametrize("k,step", [(7, 2), (32, 8), (130, 33), (130, 130), (64, 1)])
def test_mirror_in_place_is_the_whole_matrix_form_bit_for_bit(k, step):
    h = torch.randn(k, k, generator=torch.Generator().manual_seed(k))  # not symmetric: every entry is seen
    expected = whole_matrix_mirror(h)
    mirror_lower(h, step)
    assert torch.equal(h, expected)


def test_running_hessian_over_batches_is_the_whole_matrix_forms():
    """Batch after batch (the upper triangle, stale between batches, is never read by the next one)."""
    gen = torch.Generator().manual_seed(0)
    k = 130
    step = -(-k // HESSIAN_COLUMN_BLOCKS)
    h, n, ref = empty_hessian(k), 0, empty_hessian(k)
    for m in (50, 77, 3):
        x = torch.randn(m, k, generator=gen)
        h, n_next = accumulate_hessian(h, n, x)
        for i in range(0, k, step):
            ref[i:, i:i + step].addmm_(x[:, i:].T, x[:, i:i + step], beta=n / (n + m), alpha=2.0 / (n + m))
        ref = whole_matrix_mirror(ref)
        n = n_next
        assert torch.equal(h, ref)


def test_accumulating_a_large_hessian_holds_no_copy_of_it():
    k = 4096  # H: 64 MiB fp32
    h = empty_hessian(k)
    x = torch.randn(64, k)
    accumulate_hessian(h, 0, x)
    before = reset_peak_rss_kib()
    accumulate_hessian(h, 64, x)
    grown_mib = (peak_rss_kib() - before) / 1024
    assert grown_mib < 64 * 0.5, f"accumulating into a 64 MiB Hessian raised the peak by {grown_mib:.0f} MiB"
