"""The int8-weight kernels (kernels/int8_cpu.py), for bf16 and for fp32 activations, against their pure-torch
reference, and their rounding.

The reference rounds x to 16-bit fixed point per row and group as the kernels do, dequantizes the layout (q * s)
and multiplies in fp32; the kernels' integer sums are exact, so they agree with it to fp32 summation order. The bf16
kernel's tests skip where it is not built (it needs AVX-512 VNNI and BF16); the fp32 kernel builds at every level.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import int4_cpu
from quantkit.kernels.int8_cpu import (Int8Blocked, Int8Linear, dequantize_int8_blocked, group_size_for,
                                       int8_blocked_reference, int8_head_unavailable, pack_int8,
                                       quantize_activations16_reference, quantize_int8)

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums of the same products in another order


def test_rounding_is_symmetric_per_row_and_group():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.3, 0.1, 4.0, 1.0, -1.0, 0.5]])
    q, s = quantize_int8(w, 4)
    assert q.dtype == torch.int8 and s.shape == (2, 2)
    assert q[0].tolist() == [127, -64, 32, 0, 0, 0, 0, 0]  # -63.5 and 31.75 round to even / nearest
    assert s[0].tolist() == pytest.approx([1 / 127, 0.0])  # a group of zeros: scale 0, codes 0
    assert q[1].tolist() == [-127, 64, 19, 6, 127, 32, -32, 16]
    err = (q.float().reshape(2, 2, 4) * s.unsqueeze(-1) - w.reshape(2, 2, 4)).abs()
    assert bool((err <= s.unsqueeze(-1) / 2 + 1e-7).all())


@pytest.mark.parametrize(("n", "k", "group_size"), [(40, 256, 128), (16, 64, 64), (33, 96, 32)])
def test_layout_round_trips(n, k, group_size):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    packed = pack_int8(w, group_size)
    q, s = quantize_int8(w, group_size)
    nb, groups = -(-n // 16), k // group_size
    assert packed.packed.shape == (nb, k // 4, 16, 4) and packed.scales.shape == packed.wsum.shape == (nb, groups, 16)
    assert torch.equal(dequantize_int8_blocked(packed), q.float() * s.repeat_interleave(group_size, dim=1))
    wsum = packed.wsum.permute(0, 2, 1).reshape(nb * 16, groups)[:n]
    assert torch.equal(wsum, q.to(torch.int32).reshape(n, groups, group_size).sum(-1))


def test_group_size_divides_k_in_fours_up_to_128():
    assert group_size_for(1024) == 128 and group_size_for(96) == 96 and group_size_for(64) == 64
    assert group_size_for(1000) == 100 and group_size_for(6) is None
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int8(torch.zeros(4, 6), 6)
    with pytest.raises(ValueError, match="at most 128"):
        pack_int8(torch.zeros(4, 512), 256)


def test_activations_round_to_16_bits_per_row_and_group():
    x = torch.tensor([[2.0, -1.0, 0.5, 1e-6, 0.0, 0.0, 0.0, 0.0]])
    xq, scale = quantize_activations16_reference(x, 4)
    assert xq[0].tolist() == [32767, -16384, 8192, 0, 0, 0, 0, 0]  # -16383.5 and 8191.75: to even / nearest
    assert scale[0].tolist() == pytest.approx([2 / 32767, 0.0])


@pytest.fixture(params=["vnni", "amx"])
def int8_ext(request):
    """The int8 kernel on its AVX-512 VNNI path (AMX off where built), then on AMX tiles from one row on (groups of
    a multiple of 64 columns; others keep the VNNI path), skipped where this CPU gives no AMX tiles."""
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    ext = int4_cpu.extension()
    if not hasattr(ext, "int8_linear_bf16"):
        pytest.skip("the int8 kernel is built only where the compiler targets AVX-512 BF16")
    amx = request.param == "amx"
    if amx and not (ext.has_amx() and hasattr(ext.dev, "set_int8_amx_from_m")):
        pytest.skip("AMX-INT8 tiles: none on this CPU or build, or Linux did not grant them")
    old_on = ext.dev.set_amx(amx)
    old_m = ext.dev.set_int8_amx_from_m(1) if hasattr(ext.dev, "set_int8_amx_from_m") else None
    yield ext
    ext.dev.set_amx(old_on)
    if old_m is not None:
        ext.dev.set_int8_amx_from_m(old_m)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 13, 16, 17, 33])
@pytest.mark.parametrize(("n", "k", "group_size"), [(40, 256, 128), (272, 512, 128), (50, 96, 96), (16, 64, 32),
                                                    (24, 40, 20), (33, 128, 64)])
def test_kernel_matches_its_reference(int8_ext, m, n, k, group_size):
    w = pack_int8(0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(m)), group_size)
    x = (3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n))).bfloat16()
    x[0, :group_size] = 0  # a group of zeros: scale 0
    got = int8_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, n, group_size)
    torch.testing.assert_close(got, int8_blocked_reference(x, w), **TOL)
    rounded = int8_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, n, group_size, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))
    # against x unrounded: the 16-bit rounding of x (at most amax / 65534 an element) is all that differs
    exact = x.float() @ dequantize_int8_blocked(w).T
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))


def test_full_scale_codes_do_not_overflow(int8_ext):
    """Every code at +-127 against x at its group's maximum: the largest sums the int32 accumulators hold."""
    k = 256
    w = pack_int8(torch.ones(16, k), 128)
    x = torch.ones(3, k, dtype=torch.bfloat16)
    x[1] = -1
    got = int8_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, 16, 128)
    torch.testing.assert_close(got, int8_blocked_reference(x, w), **TOL)
    assert got[0].tolist() == pytest.approx([k] * 16) and got[1].tolist() == pytest.approx([-k] * 16)


def test_kernel_rejects_a_wrong_layout(int8_ext):
    w = pack_int8(torch.randn(32, 64), 64)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales must be fp32"):
        int8_ext.int8_linear_bf16(x, w.packed, w.scales.half(), w.wsum, 32, 64)
    with pytest.raises(RuntimeError, match="wsum must be int32"):
        int8_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum.long(), 32, 64)
    with pytest.raises(RuntimeError, match="group size"):
        int8_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, 32, 48)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        int8_ext.int8_linear_bf16(x.float(), w.packed, w.scales, w.wsum, 32, 64)


def test_module_runs_a_float_linear_in_int8(int8_ext):
    linear = torch.nn.Linear(256, 100, bias=False)
    head = Int8Linear.from_linear(linear)
    assert head.group_size == 128 and head.weight_bytes() == 7 * 64 * 16 * 4 + 2 * (7 * 2 * 16 * 4)
    x = torch.randn(2, 3, 256).bfloat16()
    got = head(x)
    assert got.shape == (2, 3, 100) and got.dtype == torch.bfloat16
    w = pack_int8(linear.weight.detach(), 128)
    assert torch.equal(got.reshape(6, 100), int8_ext.int8_linear_bf16(x.reshape(6, 256), w.packed, w.scales, w.wsum,
                                                                       100, 128, True))
    # against the float head: the int8 rounding of W (at most s / 2 an element) is all that differs
    torch.testing.assert_close(got.float(), (x.float() @ linear.weight.T).detach(), rtol=0.02, atol=0.02)
    # fp32_out (the engine's lm_head): the same sums, not rounded to bf16 as they are stored
    sums = Int8Linear.from_linear(linear, fp32_out=True)(x)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), got)
    assert torch.equal(sums.reshape(6, 100), int8_ext.int8_linear_bf16(x.reshape(6, 256), w.packed, w.scales, w.wsum,
                                                                        100, 128, False))


def test_amx_tiles_give_the_vnni_kernels_bits():
    """Both paths sum q * digit exactly in int32 and scale each group's sum in the same order, so they agree bit for bit
    (a 1000-row head: 63 blocks, the last half filled and unpaired)."""
    ext = int4_cpu.extension()
    if ext is None or not hasattr(ext.dev, "set_int8_amx_from_m") or not ext.has_amx():
        pytest.skip("AMX-INT8 tiles: none on this CPU or build, or Linux did not grant them")
    w = pack_int8(0.05 * torch.randn(1000, 1024, generator=torch.Generator().manual_seed(0)), 128)
    x = torch.randn(20, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    old = ext.dev.set_int8_amx_from_m(1)
    try:
        tiles = ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, 1000, 128)
        ext.dev.set_amx(False)
        vectors = ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, 1000, 128)
    finally:
        ext.dev.set_amx(True)
        ext.dev.set_int8_amx_from_m(old)
    assert torch.equal(tiles, vectors)
    torch.testing.assert_close(tiles, int8_blocked_reference(x, w), **TOL)


@pytest.fixture
def f32_ext():
    """The extension with the int8 kernel for fp32 activations (every level it builds at)."""
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    return int4_cpu.extension()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17])
@pytest.mark.parametrize(("n", "k", "group_size"), [(40, 256, 128), (272, 512, 128), (50, 96, 96), (16, 64, 32),
                                                    (24, 40, 20), (33, 128, 64), (7, 12, 4)])
def test_f32_kernel_matches_its_reference(f32_ext, m, n, k, group_size):
    w = pack_int8(0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(m)), group_size)
    x = 3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :group_size] = 0  # a group of zeros: scale 0
    got = f32_ext.int8_linear_f32(x, w.packed, w.scales, n, group_size)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, int8_blocked_reference(x, w), **TOL)
    exact = x @ dequantize_int8_blocked(w).T  # x unrounded: the 16-bit rounding of x is all that differs
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))


def test_f32_kernel_rounds_x_as_the_reference(f32_ext):
    """Ties of x * 32767 / amax (k + 0.5) round to even, as torch.round: one code a column tells the rounding apart."""
    k = 8
    w = pack_int8(torch.eye(k), 4)  # row n reads column n alone, at code 127 and scale 1/127
    x = torch.tensor([[32767.0, 0.5, 1.5, 2.5, 32767.0, -0.5, -1.5, 7.25]])
    got = f32_ext.int8_linear_f32(x, w.packed, w.scales, k, 4)
    xq, scale = quantize_activations16_reference(x, 4)
    assert xq[0, :4].tolist() == [32767, 0, 2, 2] and xq[0, 4:].tolist() == [32767, 0, -2, 7]
    assert torch.equal(got, int8_blocked_reference(x, w))


def test_f32_kernel_gives_the_bf16_kernels_bits(f32_ext):
    """On x exact in bf16 both kernels round x to the same digits, sum q * digit exactly in int32 and scale each group's
    sum in the same order: the same fp32 outputs (a 1000-row head: the last block half filled)."""
    if not hasattr(f32_ext, "int8_linear_bf16"):
        pytest.skip("the bf16 int8 kernel is built only where the compiler targets AVX-512 BF16")
    w = pack_int8(0.05 * torch.randn(1000, 512, generator=torch.Generator().manual_seed(0)), 128)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    old = f32_ext.dev.set_amx(False)
    try:
        bf16 = f32_ext.int8_linear_bf16(x, w.packed, w.scales, w.wsum, 1000, 128)
    finally:
        f32_ext.dev.set_amx(old)
    assert torch.equal(f32_ext.int8_linear_f32(x.float(), w.packed, w.scales, 1000, 128), bf16)


def test_f32_full_scale_codes_do_not_overflow(f32_ext):
    k = 256
    w = pack_int8(torch.ones(16, k), 128)
    x = torch.ones(3, k)
    x[1] = -1
    got = f32_ext.int8_linear_f32(x, w.packed, w.scales, 16, 128)
    assert got[0].tolist() == pytest.approx([k] * 16) and got[1].tolist() == pytest.approx([-k] * 16)
    torch.testing.assert_close(got, int8_blocked_reference(x, w), **TOL)


def test_f32_kernel_rejects_a_wrong_layout(f32_ext):
    w = pack_int8(torch.randn(32, 64), 64)
    x = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="scales must be fp32"):
        f32_ext.int8_linear_f32(x, w.packed, w.scales.half(), 32, 64)
    with pytest.raises(RuntimeError, match="group size"):
        f32_ext.int8_linear_f32(x, w.packed, w.scales, 32, 48)
    with pytest.raises(RuntimeError, match="wrong row blocks"):
        f32_ext.int8_linear_f32(x, w.packed, w.scales, 64, 64)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        f32_ext.int8_linear_f32(x.bfloat16(), w.packed, w.scales, 32, 64)


def test_module_runs_fp32_activations(f32_ext):
    linear = torch.nn.Linear(256, 100, bias=False)
    head = Int8Linear.from_linear(linear)
    x = torch.randn(2, 3, 256)
    got = head(x)
    assert got.shape == (2, 3, 100) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(6, 100), int8_blocked_reference(x.reshape(6, 256), head_layout(head)), **TOL)
    torch.testing.assert_close(got, (x @ linear.weight.T).detach(), rtol=0.02, atol=0.02)


def head_layout(head: Int8Linear) -> Int8Blocked:
    return Int8Blocked(head.packed, head.scales, head.wsum, head.out_features, head.group_size)


def test_head_unavailable_names_the_dtype(f32_ext):
    assert int8_head_unavailable(torch.device("cpu"), torch.float32, 2048) is None
    assert "in fours" in int8_head_unavailable(torch.device("cpu"), torch.float32, 2047)
    assert "bfloat16 or float32" in int8_head_unavailable(torch.device("cpu"), torch.float16)
    assert "bfloat16 or float32" in int8_head_unavailable(torch.device("meta"), torch.float32)
