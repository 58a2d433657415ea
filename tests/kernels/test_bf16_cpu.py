"""The bf16-weight CPU linear against its pure-torch reference (weight widened to fp32, then F.linear)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.bf16_cpu import Bf16Linear, bf16_linear, bf16_linear_reference, pack_weight, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"bf16 CPU kernel: {unavailable()}")


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 13, 17, 64, 130])
@pytest.mark.parametrize("n,k", [(1000, 1024), (33, 100), (7, 8), (130, 40), (67, 1040)])
def test_bf16_linear_matches_reference(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)  # x: [M, K] fp32
    w = torch.randn(n, k, generator=g).bfloat16()  # w: [N, K] bf16
    torch.testing.assert_close(bf16_linear(x, w), bf16_linear_reference(x, w), rtol=1e-5, atol=1e-4)


def test_module_keeps_the_weight_bf16_and_takes_leading_dims():
    w = torch.randn(64, 32).bfloat16()
    lin = Bf16Linear(w)
    assert lin.weight.dtype == torch.bfloat16 and torch.equal(lin.weight, w)  # the panels give W back
    assert lin.packed_weight.shape == (4, 32, 16)  # [ceil(N / 16), K, 16]
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(lin(x), bf16_linear_reference(x.reshape(6, 32), w).reshape(2, 3, 64))


def test_panels_pad_rows_past_n_with_zeros():
    w = torch.randn(20, 8).bfloat16()
    packed = pack_weight(w)
    assert packed.shape == (2, 8, 16)
    assert torch.equal(packed[1, :, :4], w[16:].T) and not packed[1, :, 4:].any()


def test_wrong_dtypes_are_refused():
    with pytest.raises(ValueError, match="bf16 weight"):
        bf16_linear(torch.randn(1, 8), torch.randn(4, 8))
