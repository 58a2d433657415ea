"""The scale search's candidate-error kernel (quantkit.kernels.group_error) against its pure-torch reference, at every
CPU level this machine runs: each candidate's error equal up to the order of its sum (a few ulps), with and without
importance weights, for group lengths that leave a tail past the last whole vector."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import group_error

pytestmark = pytest.mark.usefixtures("cpu_level")


@pytest.fixture(scope="module")
def ext(cpu_level):
    if group_error.unavailable() is not None:
        pytest.skip(f"candidate-error kernel not built: {group_error.unavailable()}")
    return group_error.extension()


def _case(rows: int, g: int, c: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, g, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    w[0] = 0  # a flat group
    span = w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)
    scale = (span / 15).clamp(min=1e-4) * torch.linspace(1.0, 0.5, c)  # shrinking ranges, as the grid tries
    zero = torch.randint(0, 16, (rows, c), generator=gen).float()
    return w, scale.contiguous(), zero


@pytest.mark.parametrize("g", [128, 32, 100, 7])
@pytest.mark.parametrize("c", [1, 2, 13])
@pytest.mark.parametrize("weighted", [False, True])
def test_each_candidates_error_is_the_reference_up_to_the_order_of_the_sum(ext, g, c, weighted):
    w, scale, zero = _case(67, g, c, seed=g * 31 + c)
    imp = torch.rand(67, g, generator=torch.Generator().manual_seed(c)) if weighted else None
    got = ext.group_errors(w, torch.empty(0) if imp is None else imp, scale, zero, 15)
    want = group_error.group_error_reference(w.unsqueeze(-2), None if imp is None else imp.unsqueeze(-2),
                                             scale, zero, 15)
    assert got.shape == (67, c)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30)


def test_the_terms_are_the_references_bit_for_bit(ext):
    """One weight a group: no sum to reorder, so the error is the reference's exactly (the division, the rounding of
    ties to even, the clamps and the unfused arithmetic are torch's)."""
    w = torch.tensor([[0.5], [1.5], [2.5], [-2.5], [7.3], [-30.0], [1e-3], [0.0]])
    scale = torch.tensor([[1.0, 0.3], [1.0, 0.7], [1.0, 0.1], [1.0, 2.0], [0.9, 0.45], [1.0, 3.0], [0.01, 7e-4],
                          [1.0, 1.0]])
    zero = torch.tensor([[0.0, 8.0], [8.0, 3.0], [15.0, 0.0], [8.0, 1.0], [2.0, 8.0], [8.0, 0.0], [8.0, 15.0],
                         [8.0, 0.0]])
    got = ext.group_errors(w, torch.empty(0), scale, zero, 15)
    assert torch.equal(got, group_error.group_error_reference(w.unsqueeze(-2), None, scale, zero, 15))


def test_candidate_errors_takes_one_candidate_a_group_and_broadcasts(ext):
    w, scale, zero = _case(10, 64, 3, seed=1)
    one = group_error.candidate_errors(w, None, scale[:, 0].contiguous(), zero[:, 0].contiguous(), 15)
    torch.testing.assert_close(one, group_error.group_error_reference(w, None, scale[:, 0], zero[:, 0], 15),
                               rtol=1e-5, atol=0)
    imp = torch.rand(64)  # per input channel, broadcast over the rows
    many = group_error.candidate_errors(w, imp, scale, zero, 15)
    want = group_error.group_error_reference(w.unsqueeze(-2), imp, scale, zero, 15)
    torch.testing.assert_close(many, want, rtol=1e-5, atol=0)
    assert group_error.candidate_errors(w.double(), None, scale, zero, 15) is None  # not fp32: the caller's reference


def test_bad_tensors_are_refused_with_a_message(ext):
    w, scale, zero = _case(4, 32, 2, seed=2)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.group_errors(w.double(), torch.empty(0), scale, zero, 15)
    with pytest.raises(RuntimeError, match="rows"):
        ext.group_errors(w, torch.empty(0), scale[:3].contiguous(), zero[:3].contiguous(), 15)
    with pytest.raises(RuntimeError, match="one group length"):
        ext.group_errors(w, torch.rand(4, 16), scale, zero, 15)
