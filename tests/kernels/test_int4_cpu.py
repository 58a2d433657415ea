"""quantkit's AVX2 int4 CPU kernel (quantkit.kernels.int4_cpu) against its pure-torch reference and
the dequantized checkpoint weight (quantkit.format.packing.dequantize).

The layout tests are pure torch. The kernel tests compile kernels/csrc/int4_cpu.cpp once per
source change (~40 s, cached) and are marked slow; they skip with the builder's reason where this
machine has no toolchain.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.format.packing import dequantize, pack
from quantkit.format.primitives import QuantScheme, rtn_quantize
from quantkit.kernels import int4_cpu
from quantkit.kernels.int4_cpu import (dequantize_blocked, int4_blocked_linear, int4_blocked_reference,
                                       int4_linear_reference, pack_blocks, repack)
from tests_support.int4_checkpoints import checkpoint

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

TOL = dict(rtol=1e-4, atol=1e-3)  # fp32 sums of K products in another order


LAYOUTS = [("gptq", True), ("gptq", False), ("gptq_v2", False), ("awq", False)]


# AWQ has no act-order; one group spanning K has no order to permute
REPACK_CASES = [(layout, sym, g, act) for layout, sym in LAYOUTS for g in (32, 128, -1) for act in (False, True)
                if not (act and (layout == "awq" or g == -1))]


@pytest.mark.parametrize(("layout", "sym", "group_size", "act_order"), REPACK_CASES)
def test_repack_reads_back_the_checkpoint_weight(layout, sym, group_size, act_order):
    p = checkpoint(40, 256, group_size, layout, sym, act_order)  # 40 rows: a 16-row block half filled
    w = repack(p)
    want = dequantize(p)
    if act_order:
        assert w.perm is not None
        want = want[:, w.perm]
    torch.testing.assert_close(dequantize_blocked(w), want, rtol=0, atol=1e-5)


def test_pack_blocks_takes_any_row_count():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (21, 64), generator=gen)  # N not a multiple of 8 or 16
    scales, zeros = torch.rand(2, 21, generator=gen), torch.randint(0, 16, (2, 21), generator=gen)
    packed, sb = pack_blocks(codes, scales, zeros, 32)
    assert packed.shape == (2, 64, 8) and sb.shape == (2, 2, 2, 16) and sb.dtype == torch.float32  # not exact in fp16
    w = int4_cpu.Int4Blocked(packed, sb, 21, 32, None)
    want = (codes.float() - zeros.T.float().repeat_interleave(32, 1)) * scales.T.repeat_interleave(32, 1)
    torch.testing.assert_close(dequantize_blocked(w), want)
    assert pack_blocks(codes, scales.half(), zeros, 32)[1].dtype == torch.float16


def test_repack_refuses_other_bit_widths():
    p = pack(rtn_quantize(torch.randn(16, 64), QuantScheme(8, 32, True)), "gptq")
    with pytest.raises(ValueError, match="8-bit"):
        repack(p)


@pytest.fixture(scope="module")
def kernel(cpu_level):
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    return int4_cpu.extension()


SHAPES = [(40, 256), (64, 96), (272, 512)]  # (N, K): N % 16 != 0, three groups of 32, many blocks


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 8, 33, 64])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(("layout", "sym", "group_size", "act_order"), [
    ("gptq", True, 32, False), ("gptq_v2", False, 32, True), ("awq", False, 32, False), ("gptq", False, -1, False)])
def test_kernel_matches_the_reference(kernel, m, n, k, layout, sym, group_size, act_order):
    p = checkpoint(n, k, group_size, layout, sym, act_order, seed=m)
    w = repack(p)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    want = int4_blocked_reference(x, w, p.bias)
    torch.testing.assert_close(want, x @ dequantize(p).T + p.bias, **TOL)  # the reference is the checkpoint's
    kernel_want = int4_linear_reference(x, w, p.bias)  # below 4 rows: x in 16-bit fixed point
    torch.testing.assert_close(int4_blocked_linear(x, w, p.bias, dense_from_m=m + 1), kernel_want, **TOL)  # kernel
    torch.testing.assert_close(int4_blocked_linear(x, w, p.bias, dense_from_m=0), want, **TOL)  # dense tiles


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [64, 128])
def test_kernel_group_sizes_and_dense_tiles_past_one_tile(kernel, monkeypatch, group_size):
    monkeypatch.setattr(int4_cpu, "DENSE_TILE_ROWS", 48)  # 100 rows: three tiles, the last short
    p = checkpoint(104, 256, group_size, "gptq", False, seed=3)
    w = repack(p)
    x = torch.randn(5, 256)
    want = int4_blocked_reference(x, w, None)
    torch.testing.assert_close(int4_blocked_linear(x, w, None, dense_from_m=6), want, **TOL)
    torch.testing.assert_close(int4_blocked_linear(x, w, None, dense_from_m=0), want, **TOL)


@pytest.mark.slow
def test_kernel_takes_bf16_and_strided_inputs(kernel):
    p = checkpoint(48, 128, 32, "gptq", True)
    w = repack(p)
    wide = torch.randn(4, 256)
    x = wide[:, ::2]  # a strided view, as a slice of a fused projection gives
    want = int4_blocked_reference(x, w, None)
    torch.testing.assert_close(int4_blocked_linear(x, w, None), want, **TOL)
    xb = x.to(torch.bfloat16)
    got = int4_blocked_linear(xb, w, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), int4_blocked_reference(xb.float(), w, None), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_kernel_rejects_a_mismatched_layout(kernel):
    w = repack(checkpoint(32, 64, 32, "gptq", True))
    with pytest.raises(RuntimeError, match="packed"):
        kernel.int4_linear(torch.randn(1, 128), w.packed, w.scale_zero, 32, 32)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 8])
def test_kernel_takes_fp32_scales(kernel, m):
    gen = torch.Generator().manual_seed(m)
    codes = torch.randint(0, 16, (21, 64), generator=gen)
    scales, zeros = torch.rand(2, 21, generator=gen), torch.randint(0, 16, (2, 21), generator=gen)
    w = int4_cpu.Int4Blocked(*pack_blocks(codes, scales, zeros, 32), 21, 32, None)
    assert w.scale_zero.dtype == torch.float32
    x = torch.randn(m, 64, generator=gen)
    want = int4_blocked_reference(x, w, None)
    torch.testing.assert_close(int4_blocked_linear(x, w, None, dense_from_m=m + 1), int4_linear_reference(x, w, None),
                               **TOL)
    torch.testing.assert_close(int4_blocked_linear(x, w, None, dense_from_m=0), want, **TOL)


@pytest.fixture(scope="module")
def bf16_ext(kernel):
    if not hasattr(kernel, "int4_linear_bf16"):
        pytest.skip("the AVX-512 BF16 int4 kernel is built only where the compiler targets AVX-512 BF16")
    return kernel


@pytest.fixture
def bf16_kernel(bf16_ext):
    """The AVX-512 BF16 kernel: where the AMX path is built, it is switched off for the test."""
    old = bf16_ext.dev.set_amx(False)
    yield bf16_ext
    bf16_ext.dev.set_amx(old)


@pytest.fixture
def amx_kernel(bf16_ext):
    """The AMX kernel (kernels/csrc/int4_amx.h) from one row on, where this CPU and Linux give the process AMX tiles."""
    if not bf16_ext.has_amx():
        pytest.skip("the AMX int4 kernel needs a CPU with AMX-BF16 (and a Linux that grants the tiles)")
    old = bf16_ext.dev.set_int4_amx_from_m(1)
    yield bf16_ext
    bf16_ext.dev.set_int4_amx_from_m(old)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 33])  # 1-2 rows: 8 columns a step (unpack_eight), the rest a pair a step
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(("layout", "sym", "group_size", "act_order"), [
    ("gptq", True, 32, False), ("gptq_v2", False, 32, True), ("awq", False, 32, False), ("gptq", False, -1, False)])
def test_bf16_kernel_matches_the_reference(bf16_kernel, m, n, k, layout, sym, group_size, act_order):
    """bf16 x: the vdpbf16ps kernel's fp32 sums against the reference on the same (exactly widened) x."""
    p = checkpoint(n, k, group_size, layout, sym, act_order, seed=m)
    w = repack(p)
    assert int4_cpu.bf16_kernel(w)
    xb = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    xp = xb.index_select(1, w.perm) if w.perm is not None else xb
    got = bf16_kernel.int4_linear_bf16(xp.contiguous(), w.packed, w.scale_zero, n, w.group_size)  # fp32 [M, N]
    torch.testing.assert_close(got, int4_blocked_reference(xb.float(), w, None), **TOL)
    rounded = bf16_kernel.int4_linear_bf16(xp.contiguous(), w.packed, w.scale_zero, n, w.group_size, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))  # rounded as it is stored
    out = int4_blocked_linear(xb, w, p.bias, dense_from_m=m + 1)  # the same kernel through the wrapper
    assert out.dtype == torch.bfloat16  # rounded once: within a bf16 ulp (2^-8 relative) of the fp32 result
    torch.testing.assert_close(out.float(), int4_blocked_reference(xb.float(), w, p.bias).float(), rtol=8e-3, atol=1e-3)


# 1-16 rows: one row tile; 17-32: two; past 32 the first step on a block pair keeps its unpacked tiles for the others
@pytest.mark.parametrize("m", [1, 2, 8, 16, 17, 32, 33, 70])
@pytest.mark.parametrize(("n", "k", "group_size", "fp32_scales"), [
    (40, 256, 32, False), (272, 512, 128, False), (48, 384, 64, True), (16, 128, 128, False)])
def test_amx_kernel_matches_the_reference(amx_kernel, m, n, k, group_size, fp32_scales):
    """AMX tiles: the same exact products (128 + code against bf16 x) and fp32 sums as the AVX-512 kernel, in another
    order; 40 and 272 rows leave a 16-row block half filled and a block pair unpaired."""
    p = checkpoint(n, k, group_size, "gptq_v2", False, False, seed=m)
    w = repack(p)
    if fp32_scales:
        w = int4_cpu.Int4Blocked(w.packed, w.scale_zero.float(), w.out_features, w.group_size, w.perm)
    assert int4_cpu.amx_kernel(w)
    xb = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    want = int4_blocked_reference(xb.float(), w, None)
    got = amx_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, n, group_size)
    torch.testing.assert_close(got, want, **TOL)
    rounded = amx_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, n, group_size, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))


def test_amx_kernel_is_not_the_avx512_one_and_groups_off_its_steps_fall_back(amx_kernel):
    """set_amx(False) reaches the kernel (the sums' order differs, so do the bits), and groups that are not whole
    32-column tile steps take the AVX-512 path with AMX on: both match the reference."""
    w = repack(checkpoint(272, 512, 128, "gptq", True, False, seed=3))
    xb = torch.randn(24, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    tiles = amx_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    assert amx_kernel.dev.set_amx(False) is True  # the default is on
    try:
        vectors = amx_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    finally:
        amx_kernel.dev.set_amx(True)
    want = int4_blocked_reference(xb.float(), w, None)
    torch.testing.assert_close(tiles, want, **TOL)
    torch.testing.assert_close(vectors, want, **TOL)
    assert not torch.equal(tiles, vectors)
    w20 = repack(checkpoint(48, 120, 20, "gptq_v2", False, False, seed=4))
    assert not int4_cpu.amx_kernel(w20)
    x20 = xb[:, :120].contiguous()
    torch.testing.assert_close(amx_kernel.int4_linear_bf16(x20, w20.packed, w20.scale_zero, 48, 20),
                               int4_blocked_reference(x20.float(), w20, None), **TOL)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_bf16_kernel_takes_even_groups_not_a_multiple_of_eight(bf16_kernel, m):
    """Groups of 6 and 10 columns: every tile falls back from 8 columns a step to a pair a step."""
    for group_size in (6, 10):
        p = checkpoint(48, 120, group_size, "gptq_v2", False, False, seed=group_size)
        w = repack(p)
        xb = torch.randn(m, 120, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 48, w.group_size)
        torch.testing.assert_close(got, int4_blocked_reference(xb.float(), w, None), **TOL)


@pytest.mark.parametrize(("m", "switch"), [(1, "set_lane_tiles"), (2, "set_lane_tiles"), (8, "set_wide_tiles"),
                                           (19, "set_wide_tiles")])
def test_bf16_kernel_switch_between_tiles_keeps_the_result(bf16_kernel, m, switch):
    """The benchmarks' baselines: set_lane_tiles(False) runs 1-2 rows a column pair a step, set_wide_tiles(False) 8
    rows and more one block a tile; both ways match the reference (272 rows: 17 blocks, one left unpaired)."""
    p = checkpoint(272, 512, 128, "gptq", True, False, seed=m)
    w = repack(p)
    xb = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
    want = int4_blocked_reference(xb.float(), w, None)
    assert getattr(bf16_kernel.dev, switch)(False) is True  # the default is on
    try:
        pair = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    finally:
        assert getattr(bf16_kernel.dev, switch)(True) is False
    lanes = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    torch.testing.assert_close(pair, want, **TOL)
    torch.testing.assert_close(lanes, want, **TOL)
    assert not torch.equal(pair, lanes)  # two summation orders: the switch reached the kernel

@pytest.mark.parametrize("m", [3, 4, 7, 8, 19])
def test_bf16_kernel_eight_columns_a_step_is_the_pair_steps_bit_for_bit(bf16_kernel, m):
    """From 3 rows the tiles unpack 8 columns a step (nibbles, pair_of) where the group size is a multiple of 8;
    set_eight_columns(False) unpacks a pair a step. The operands and the order of the sums are the same, so the two
    agree bit for bit, and both match the reference (272 rows: 17 blocks, one left unpaired by the wide tile)."""
    p = checkpoint(272, 512, 128, "gptq", True, False, seed=m)
    w = repack(p)
    xb = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
    assert bf16_kernel.dev.set_eight_columns(False) is True  # the default is on
    try:
        pairs = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    finally:
        assert bf16_kernel.dev.set_eight_columns(True) is False
    eights = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, 128)
    torch.testing.assert_close(eights, int4_blocked_reference(xb.float(), w, None), **TOL)
    assert torch.equal(eights, pairs)


@pytest.mark.parametrize("group_size", [128, 20])  # 8 columns a step, and a pair a step
def test_bf16_kernel_rows_past_the_first_eight_reuse_the_unpacked_operands_bit_for_bit(bf16_kernel, group_size):
    """From 16 rows the first wide tile on a block pair keeps its unpacked operands and the other tiles read them
    back: each row's sums are those of the same rows run alone (8 rows: unpacked by their own tile), bit for bit."""
    p = checkpoint(272, 640, group_size, "gptq", True, False, seed=group_size)
    w = repack(p)
    xb = torch.randn(27, 640, generator=torch.Generator().manual_seed(group_size)).bfloat16()
    together = bf16_kernel.int4_linear_bf16(xb, w.packed, w.scale_zero, 272, group_size)
    for m0 in (0, 8, 16):
        alone = bf16_kernel.int4_linear_bf16(xb[m0:m0 + 8], w.packed, w.scale_zero, 272, group_size)
        assert torch.equal(together[m0:m0 + 8], alone)
    torch.testing.assert_close(together, int4_blocked_reference(xb.float(), w, None), **TOL)


@pytest.mark.parametrize("fp32_scales", [False, True])
def test_dequantize_pairs_is_the_dequantized_tile_in_the_bf16_kernels_layout(bf16_kernel, fp32_scales):
    from quantkit.kernels.bf16_cpu import bf16_dot_available, pack_pairs

    if not bf16_dot_available():
        pytest.skip("the bf16 dot kernel needs AVX-512 BF16")
    w = repack(checkpoint(104, 256, 64, "gptq_v2", False, True, seed=5))  # act-order: columns already permuted
    if fp32_scales:
        w = int4_cpu.Int4Blocked(w.packed, w.scale_zero.float(), w.out_features, w.group_size, w.perm)
    for n0, n1 in [(0, 104), (0, 48), (48, 104), (96, 104)]:  # the last blocks short of 16 rows
        got = bf16_kernel.int4_dequantize_pairs(w.packed, w.scale_zero, 104, 64, n0, n1)
        dense = bf16_kernel.int4_dequantize(w.packed, w.scale_zero, 104, 64, n0, n1).bfloat16()
        assert torch.equal(got.permute(0, 2, 1, 3).reshape(-1, 256)[: n1 - n0], dense)  # bit for bit
        if (n1 - n0) % 16 == 0:  # (a short last block holds the next rows' values, or zeros, past n1)
            assert torch.equal(got, pack_pairs(dense))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        bf16_kernel.int4_dequantize_pairs(w.packed, w.scale_zero, 104, 64, 8, 40)


@pytest.mark.slow
def test_bf16_dense_tiles_run_the_bf16_kernel_past_one_tile(bf16_kernel, monkeypatch):
    """bf16 x from dense_from_m on: tiles dequantized into the bf16 kernel's layout (int4_dequantize_pairs)."""
    monkeypatch.setattr(int4_cpu, "DENSE_TILE_ROWS", 48)  # 104 rows: three tiles, the last short
    p = checkpoint(104, 256, 64, "gptq", True, seed=4)
    w = repack(p)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    calls = []
    real = bf16_kernel.int4_dequantize_pairs
    monkeypatch.setattr(int4_cpu, "extension", lambda: type("Ext", (), {
        **{name: getattr(bf16_kernel, name) for name in dir(bf16_kernel) if not name.startswith("_")},
        "int4_dequantize_pairs": staticmethod(lambda *a: calls.append(a[4:]) or real(*a))}))
    got = int4_blocked_linear(x, w, None, dense_from_m=0)  # (a bias is added after, in x's dtype, on every path)
    assert calls == [(0, 48), (48, 96), (96, 104)]
    assert got.dtype == torch.bfloat16 and got.shape == (37, 104)
    # the dense path's arithmetic: the dequantized weights rounded to bf16, fp32 sums, the output rounded to bf16
    tile = real(w.packed, w.scale_zero, 104, 64, 0, 104).permute(0, 2, 1, 3).reshape(-1, 256)[:104].float()
    want = torch.nn.functional.linear(x.float(), tile)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-5)  # one bf16 step


def test_bf16_kernel_rejects_odd_groups(bf16_kernel):
    # one block of 16 rows, K = 6 in two groups of 3: the kernel takes input columns in pairs
    w = int4_cpu.Int4Blocked(torch.zeros(1, 6, 8, dtype=torch.uint8), torch.ones(1, 2, 2, 16, dtype=torch.float16),
                             16, 3, None)
    assert not int4_cpu.bf16_kernel(w)  # the wrapper keeps the AVX2 kernel for it
    with pytest.raises(RuntimeError, match="even"):
        bf16_kernel.int4_linear_bf16(torch.zeros(1, 6, dtype=torch.bfloat16), w.packed, w.scale_zero, 16, 3)
    assert int4_blocked_linear(torch.ones(2, 6, dtype=torch.bfloat16), w, None).shape == (2, 16)


def test_concat_blocked_is_the_parts_side_by_side():
    """q/k/v or gate/up as one weight: the layout of each part, one after the other along N."""
    parts = [repack(checkpoint(n, 256, 64, "gptq", False, seed=n)) for n in (64, 32, 32)]
    w = int4_cpu.concat_blocked(parts)
    assert w.out_features == 128
    torch.testing.assert_close(dequantize_blocked(w), torch.cat([dequantize_blocked(p) for p in parts]))
    ordered = [repack(checkpoint(32, 256, 64, "gptq", True, act_order=True, seed=1))] * 2  # one permutation
    assert int4_cpu.concat_blocked(ordered).perm is ordered[0].perm


@pytest.mark.parametrize("why", ["rows", "group", "perm"])
def test_concat_blocked_refuses_what_cannot_share_a_layout(why):
    a = repack(checkpoint(32, 256, 64, "gptq", True, seed=0))
    b = {"rows": lambda: repack(checkpoint(40, 256, 64, "gptq", True)),  # its last block half filled
         "group": lambda: repack(checkpoint(32, 256, 128, "gptq", True)),
         "perm": lambda: repack(checkpoint(32, 256, 64, "gptq", True, act_order=True))}[why]()
    assert int4_cpu.concat_blocked([a, b]) is None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 200])  # the direct bf16 call (no bias), and past it the dense tiles
@pytest.mark.parametrize("bias", [False, True])
def test_fused_quantlinear_equals_its_parts(kernel, dtype, m, bias):
    """QuantLinear.concat (the engine's fused q/k/v): the parts' outputs side by side."""
    from quantkit.model.quant_linear import QuantLinear

    parts = []
    for n in (64, 32, 32):
        p = checkpoint(n, 256, 64, "gptq", True, seed=n)
        p.bias = p.bias if bias else None
        q = QuantLinear(p)
        q.repack_for_cpu(dtype)
        parts.append(q)
    fused = QuantLinear.concat(parts)
    assert fused is not None and fused.out_features == 128 and fused.qweight is None
    direct = not bias and (int4_cpu.bf16_kernel(fused._cpu) if dtype == torch.bfloat16 else dtype == torch.float32)
    assert (fused._direct is not None) == direct
    x = torch.randn(2, m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = torch.cat([p(x) for p in parts], dim=-1)
    got = fused(x)
    assert got.dtype == dtype and got.shape == (2, m, 128)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
