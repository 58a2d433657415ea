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
