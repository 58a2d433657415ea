"""The fp32 int4 linear's decode-sized tiles (kernels/csrc/int4_x16_avx2.h): x written per row and group as 16-bit
fixed point and multiplied with the 4-bit codes by vpmaddwd, against their pure-torch reference
(int4_cpu.int4_x16_reference: the same rounding of x, then fp32), and int4_linear's switch to them below 4 rows.
They build at every level (AVX2 and up)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import int4_cpu
from quantkit.kernels.int4_cpu import int4_blocked_reference, int4_x16_reference, pack_blocks, repack
from tests_support.int4_checkpoints import checkpoint

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

TOL = dict(rtol=1e-4, atol=1e-3)  # fp32 sums of the same products in another order

SCHEMES = [("gptq", True, 32, False), ("gptq_v2", False, 32, True), ("awq", False, 32, False),
           ("gptq", False, 128, False), ("gptq", False, -1, False)]
CASES = [(n, k, *scheme) for n, k in [(40, 256), (64, 96), (272, 512)] for scheme in SCHEMES
         if scheme[2] != 128 or k % 128 == 0]


@pytest.fixture(scope="module")
def kernel(cpu_level):
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    return int4_cpu.extension()


def _inputs(n, k, layout, sym, group_size, act_order, m):
    """The weight, x, and x in the packed column order (act-order permuted), which the kernels take."""
    w = repack(checkpoint(n, k, group_size, layout, sym, act_order, seed=m))
    x = 3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    return w, x, (x.index_select(1, w.perm) if w.perm is not None else x).contiguous()


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k", "layout", "sym", "group_size", "act_order"), CASES)
def test_x16_tiles_match_their_reference(kernel, m, n, k, layout, sym, group_size, act_order):
    w, x, xp = _inputs(n, k, layout, sym, group_size, act_order, m)
    got = kernel.int4_linear_x16(xp, w.packed, w.scale_zero, w.out_features, w.group_size)
    torch.testing.assert_close(got, int4_x16_reference(xp, w), **TOL)
    # and within x's 16-bit rounding of the fp32 product (the FMA tiles' arithmetic)
    exact = int4_blocked_reference(x, w, None)
    assert float((got - exact).abs().max()) < 2e-4 * float(exact.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
def test_int4_linear_runs_them_below_four_rows(kernel, m):
    w, x, _ = _inputs(272, 512, "gptq", False, 128, False, m)
    got = kernel.int4_linear(x, w.packed, w.scale_zero, w.out_features, w.group_size)
    x16 = kernel.int4_linear_x16(x, w.packed, w.scale_zero, w.out_features, w.group_size)
    if m < 4:
        assert torch.equal(got, x16)
    else:  # the fp32 FMA tiles: x as it is
        assert not torch.equal(got, x16)
        torch.testing.assert_close(got, int4_blocked_reference(x, w, None), **TOL)


@pytest.mark.slow
def test_groups_not_in_fours_run_the_fma_tiles(kernel):
    gen = torch.Generator().manual_seed(6)
    codes, zeros = torch.randint(0, 16, (40, 96), generator=gen), torch.randint(0, 16, (16, 40), generator=gen)
    w = int4_cpu.Int4Blocked(*pack_blocks(codes, torch.rand(16, 40, generator=gen), zeros, 6), 40, 6, None)
    x = torch.randn(1, 96, generator=gen)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        kernel.int4_linear_x16(x, w.packed, w.scale_zero, 40, 6)
    got = kernel.int4_linear(x, w.packed, w.scale_zero, 40, 6)
    torch.testing.assert_close(got, int4_blocked_reference(x, w, None), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("group_size", [4096, 8192])
def test_the_largest_sums_stay_exact_and_larger_groups_run_the_fma_tiles(kernel, group_size, sign):
    """Every code 15 and every x at its group's max (or min): a row's int32 sum over a group of 4096 columns is
    4096 * 15 * 32767 = 2.01e9 < 2^31 (exact: 15 * 4096 a row), while the tiles' unmasked sums of whole bytes
    (255 a column) wrap around on the way; a group of 8192 would not fit, and runs in fp32."""
    k = group_size
    codes = torch.full((16, k), 15)
    w = int4_cpu.Int4Blocked(*pack_blocks(codes, torch.ones(1, 16), torch.zeros(1, 16), k), 16, k, None)
    x = torch.full((1, k), float(sign))
    got = kernel.int4_linear(x, w.packed, w.scale_zero, 16, k)
    assert torch.equal(got, torch.full((1, 16), sign * 15.0 * k))
    if group_size > 4096:
        with pytest.raises(RuntimeError, match="at most 4096"):
            kernel.int4_linear_x16(x, w.packed, w.scale_zero, 16, k)


def test_the_dispatch_says_where_it_runs_them(kernel):
    """int4_x16_takes (what int4_cpu.x16_tiles_take asks): below 4 rows, groups in fours of at most 4096 columns."""
    assert kernel.int4_x16_takes(1, 128) and kernel.int4_x16_takes(3, 4096)
    assert not kernel.int4_x16_takes(4, 128)
    assert not kernel.int4_x16_takes(1, 6) and not kernel.int4_x16_takes(1, 8192)
