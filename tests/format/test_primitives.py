"""rtn_quantize, every group of a slice of rows at once, against min-max and rounding one group at a time."""

import pytest
import torch

from quantkit.format import primitives
from quantkit.format.primitives import QuantScheme, minmax_params, quantize_codes, rtn_quantize


def rtn_one_group_at_a_time(w: torch.Tensor, scheme: QuantScheme):
    """The reference: each group [N, G] on its own, through minmax_params and quantize_codes."""
    w = w.float()
    g = scheme.group_len(w.shape[1])
    scales, zeros, codes = [], [], []
    for start in range(0, w.shape[1], g):
        block = w[:, start:start + g]
        s, z = minmax_params(block, scheme.bits, scheme.sym)
        scales.append(s)
        zeros.append(z)
        codes.append(quantize_codes(block, s, z, scheme.maxq))
    return torch.cat(codes, dim=1).to(torch.uint8), torch.stack(scales), torch.stack(zeros)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("shape,group", [((48, 256), 64), ((7, 96), 32), ((5, 100), -1), ((6, 72), 32)])
def test_rtn_quantize_is_the_one_group_at_a_time_reference_bit_for_bit(monkeypatch, dtype, sym, shape, group):
    monkeypatch.setattr(primitives, "RTN_STEP_ELEMENTS", 1000)  # several row slices, the last one short
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)).mul_(0.05).to(dtype)
    w[0, :8] = 0  # a group holding zeros, and (with sym) a flat start
    w[1] *= 40  # a row of large weights
    scheme = QuantScheme(4, group, sym)
    before = w.clone()
    qw = rtn_quantize(w, scheme)
    codes, scales, zeros = rtn_one_group_at_a_time(w, scheme)
    assert torch.equal(w, before)  # the caller's weight is left alone
    assert qw.qweight.dtype == torch.uint8 and torch.equal(qw.qweight, codes)
    assert torch.equal(qw.scales, scales) and torch.equal(qw.zeros, zeros)
    assert qw.scales.is_contiguous() and qw.zeros.is_contiguous()
