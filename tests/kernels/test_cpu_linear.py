"""oneDNN-prepacked float linears against F.linear (the reference)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.kernels.cpu_linear import PrepackedLinear, linear_reference, prepack_supported


@pytest.mark.skipif(not prepack_supported(torch.float32), reason="this torch has no oneDNN")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 256), (33, 256), (2, 5, 256)])
def test_prepacked_linear_matches_reference(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    x = torch.randn(*shape)
    got = PrepackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, linear_reference(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not prepack_supported(torch.float32), reason="this torch has no oneDNN")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [1, 33])
def test_concat_prepacked_splits_into_each_linears_output(bias, tokens):
    # q/k/v-like: out sizes 96, 32, 32 over one input [tokens, 256]
    torch.manual_seed(0)
    linears = [nn.Linear(256, n, bias=bias) for n in (96, 32, 32)]
    fused = PrepackedLinear.concat(linears)
    assert fused.out_splits == (96, 32, 32)
    x = torch.randn(tokens, 256)
    for got, m in zip(fused(x).split(fused.out_splits, dim=-1), linears):
        torch.testing.assert_close(got, linear_reference(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(got, PrepackedLinear(m)(x))  # same dot products: greedy decoding does not move


def test_concat_rejects_mixed_inputs():
    with pytest.raises(ValueError, match="one input size"):
        PrepackedLinear.concat([nn.Linear(8, 4), nn.Linear(16, 4)])
