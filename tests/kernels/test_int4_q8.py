"""The int8-activation (W4A8) int4 kernels, for bf16 (AVX-512 VNNI) and fp32 (AVX2) activations, against their
pure-torch reference, and their paths through QuantLinear.

The reference (int4_cpu.int4_q8_reference) rounds x to int8 per row and group exactly as the kernels do, so
they agree with it to fp32 summation order; against the W4A16 reference they differ by x's rounding to 8 bits.
The bf16 kernel's tests skip where it is not built (it needs AVX-512 VNNI, VBMI and BF16); the fp32 one builds at
every level.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import int4_cpu
from quantkit.kernels.int4_cpu import int4_blocked_reference, int4_q8_reference, quantize_activations_reference, repack
from quantkit.kernels.linear_choice import LinearCase, choose
from tests_support.int4_checkpoints import checkpoint

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

TOL = dict(rtol=1e-4, atol=1e-3)  # fp32 sums of the same products in another order


def test_activations_round_to_int8_per_row_and_group():
    x = torch.tensor([[-2.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [4.0, -1.0, 3.0, 0.125, 1.0, 2.0, -8.0, 0.0]])
    xq, scale = quantize_activations_reference(x, 4)
    # amax 2: x * 63.5, ties to even (63.5 -> 64); an all-zero group: codes 0, scale 0
    assert xq[0].tolist() == [-127, 64, 32, 0, 0, 0, 0, 0]
    assert scale[0].tolist() == pytest.approx([2 / 127, 0.0])
    assert xq[1].tolist() == [127, -32, 95, 4, 16, 32, -127, 0]
    assert scale[1].tolist() == pytest.approx([4 / 127, 8 / 127])
    assert float((xq.reshape(2, 2, 4) * scale.unsqueeze(-1) - x.reshape(2, 2, 4)).abs().max()) <= 8 / 127 / 2


@pytest.fixture(scope="module")
def q8(cpu_level):
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    ext = int4_cpu.extension()
    if not hasattr(ext, "int4_linear_q8"):
        pytest.skip("the int8-activation int4 kernel is built only where the compiler targets AVX-512 VNNI, VBMI and BF16")
    return ext


SCHEMES = [("gptq", True, 32, False), ("gptq_v2", False, 32, True), ("awq", False, 32, False),
           ("gptq", False, 128, False), ("gptq", False, -1, False)]
# (N, K): N % 16 != 0, three groups of 32, many blocks; group 128 only where it divides K
CASES = [(n, k, *scheme) for n, k in [(40, 256), (64, 96), (272, 512)] for scheme in SCHEMES if scheme[2] != 128 or k % 128 == 0]


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 5, 8, 13, 33])
@pytest.mark.parametrize(("n", "k", "layout", "sym", "group_size", "act_order"), CASES)
def test_q8_kernel_matches_its_reference(q8, m, n, k, layout, sym, group_size, act_order):
    p = checkpoint(n, k, group_size, layout, sym, act_order, seed=m)
    w = repack(p)
    assert int4_cpu.q8_kernel(w)
    xb = (3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n))).bfloat16()
    xp = (xb.index_select(1, w.perm) if w.perm is not None else xb).contiguous()
    got = q8.int4_linear_q8(xp, w.packed, w.scale_zero, n, w.group_size)
    torch.testing.assert_close(got, int4_q8_reference(xp.float(), w), **TOL)
    rounded = q8.int4_linear_q8(xp, w.packed, w.scale_zero, n, w.group_size, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))
    # against W4A16: x's rounding to int8 (at most half a step of amax / 127 an element) is all that differs
    w4a16 = int4_blocked_reference(xb.float(), w, None)
    assert float((got - w4a16).norm() / w4a16.norm()) < 0.02


@pytest.fixture
def q8_amx(q8):
    """The bf16 int8-activation kernel with its AMX-INT8 tiles (kernels/csrc/int4_q8_amx.h) from one row on, where this
    CPU and Linux give the process AMX tiles."""
    if not (hasattr(q8.dev, "set_int4_q8_amx_from_m") and q8.has_amx()):
        pytest.skip("the AMX-INT8 tiles of the int8-activation kernel: not built at this CPU level, or no AMX granted")
    old = q8.dev.set_int4_q8_amx_from_m(1)
    yield q8
    q8.dev.set_int4_q8_amx_from_m(old)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 70])  # one or two row tiles a step; past 32 rows kept tiles
@pytest.mark.parametrize(("n", "k", "group_size", "fp32_scales"),
                         [(272, 512, 128, False), (40, 256, 64, True), (48, 384, -1, False), (16, 512, 256, False)])
def test_q8_amx_tiles_give_the_vnni_kernels_bits(q8_amx, m, n, k, group_size, fp32_scales):
    """The tiles sum the same int32 products of code and xq as vpdpbusd and scale each group in the same operations:
    the same fp32 outputs, bit for bit, and the reference's to summation order."""
    w = repack(checkpoint(n, k, group_size, "gptq", False, seed=m))
    sz = w.scale_zero.float() if fp32_scales else w.scale_zero
    x = (3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n + m))).bfloat16()
    tiles = q8_amx.int4_linear_q8(x, w.packed, sz, n, w.group_size)
    tiles_bf16 = q8_amx.int4_linear_q8(x, w.packed, sz, n, w.group_size, True)
    q8_amx.dev.set_int4_q8_amx_from_m(1 << 30)
    vectors = q8_amx.int4_linear_q8(x, w.packed, sz, n, w.group_size)
    assert torch.equal(tiles, vectors)
    assert torch.equal(tiles_bf16, vectors.to(torch.bfloat16))
    torch.testing.assert_close(tiles, int4_q8_reference(x.float(), w), **TOL)


def test_q8_amx_tiles_sum_full_scale_codes_exactly_and_leave_other_groups_to_vectors(q8_amx):
    """Every code 15 against x at +-amax over a group of 512 (the largest tile sums: 15 * 127 * 512), and a group of 32
    (not whole 64-column tile steps): the vector kernel's, the reference's."""
    n, k = 16, 1024
    packed, sz = int4_cpu.pack_blocks(torch.full((n, k), 15), torch.ones(2, n), torch.zeros(2, n), 512)
    x = torch.ones(20, k, dtype=torch.bfloat16)
    x[1] = -1
    got = q8_amx.int4_linear_q8(x, packed, sz, n, 512)
    assert got[0].tolist() == [15.0 * k] * n and got[1].tolist() == [-15.0 * k] * n
    w32 = repack(checkpoint(48, 256, 32, "gptq", False, seed=3))
    x32 = (3 * torch.randn(20, 256, generator=torch.Generator().manual_seed(4))).bfloat16()
    torch.testing.assert_close(q8_amx.int4_linear_q8(x32, w32.packed, w32.scale_zero, 48, 32),
                               int4_q8_reference(x32.float(), w32), **TOL)


def test_q8_kernel_rejects_groups_not_in_fours(q8):
    w = int4_cpu.Int4Blocked(torch.zeros(1, 12, 8, dtype=torch.uint8), torch.ones(1, 2, 2, 16, dtype=torch.float16),
                             16, 6, None)
    assert not int4_cpu.q8_kernel(w)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        q8.int4_linear_q8(torch.zeros(1, 12, dtype=torch.bfloat16), w.packed, w.scale_zero, 16, 6)
    choice = choose(LinearCase(4, 6, torch.bfloat16, int8_activations=True))  # falls back to the bf16 kernel
    assert choice.direct == "bf16" and "AVX-512 BF16" in choice.cpu_path
    assert any("int8-activation" in why and "not a multiple of 4" in why for why in choice.passed_over)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 7, 200])  # W4A8 at every M without AMX; with AMX dense tiles (W4A16) from 256 rows
def test_quantlinear_with_int8_activations_runs_the_q8_kernel_fused_or_not(q8, m):
    from quantkit.model.quant_linear import QuantLinear

    parts = []
    for n in (64, 32, 32):
        p = checkpoint(n, 256, 64, "gptq", True, seed=n)
        p.bias = None
        q = QuantLinear(p)
        assert "int8-activation" in q.repack_for_cpu(torch.bfloat16, int8_activations=True)
        assert q._direct.int8_activations
        parts.append(q)
    fused = QuantLinear.concat(parts)
    assert fused._direct is not None and fused._direct.int8_activations
    x = (2 * torch.randn(2, m, 256, generator=torch.Generator().manual_seed(m))).bfloat16()
    got = fused(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, m, 128)
    torch.testing.assert_close(got, torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
    flat, out = x.reshape(-1, 256).float(), got.reshape(-1, 128).float()
    if flat.shape[0] < fused._direct.max_m:  # W4A8, rounded to bf16 once
        want = torch.cat([int4_q8_reference(flat, p._cpu) for p in parts], dim=-1)
        torch.testing.assert_close(out, want, rtol=8e-3, atol=2e-2)
    else:  # W4A16 on bf16 tiles of the dequantized weight
        want = torch.cat([int4_blocked_reference(flat, p._cpu, None) for p in parts], dim=-1)
        assert float((out - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("m", [3, 40, 300, 600])  # below and above the W4A16 paths' dense crossovers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_prefill_runs_the_steps_prompt_rows_w4a8_and_the_rest_w4a16(cpu_level, dtype, m):
    """QuantLinear.repack_for_cpu(int8_prefill=True): rows the current forward names prompt rows go through the W4A8
    kernel (AVX-512 VNNI for bf16, AVX2 for fp32), the others take the W4A16 path exactly as without it; inputs
    that are not the step's rows (another count) and forwards that name none run W4A16 throughout. Fused
    projections keep the split."""
    from quantkit.kernels.linear_choice import prompt_q8_unavailable
    from quantkit.model.prompt_rows import PromptRows, prompt_rows
    from quantkit.model.quant_linear import QuantLinear

    if (why := prompt_q8_unavailable(dtype)) is not None:
        pytest.skip(why)

    def linear(n, seed, prefill):
        p = checkpoint(n, 256, 64, "gptq", True, seed=seed)
        p.bias = None
        q = QuantLinear(p)
        q.repack_for_cpu(dtype, int8_prefill=prefill)
        return q

    split = [linear(n, n, True) for n in (64, 32)]
    plain = [linear(n, n, False) for n in (64, 32)]
    assert all(q.prompt_q8 is not None and not q._direct.int8_activations for q in split)
    assert all(q.prompt_q8 is None for q in plain)
    fused, fused_plain = QuantLinear.concat(split), QuantLinear.concat(plain)
    assert fused.prompt_q8 is not None
    x = (2 * torch.randn(m, 256, generator=torch.Generator().manual_seed(m))).to(dtype)
    spans = [(1, False), (m - 2, True), (1, False)]  # a decode, a prompt chunk, a decode
    rows = PromptRows.of_spans(spans)
    assert rows.prompt.tolist() == list(range(1, m - 1)) and rows.others.tolist() == [0, m - 1]
    w4a16 = fused_plain(x)
    torch.testing.assert_close(fused(x), w4a16, rtol=0, atol=0)  # no prompt rows named: as without
    with prompt_rows(rows):
        got = fused(x)
        torch.testing.assert_close(fused(x[:-1]), fused_plain(x[:-1]), rtol=0, atol=0)  # not the step's rows
    # the other rows: the W4A16 path's call on them alone (a kernel's sums may group differently at another M)
    torch.testing.assert_close(got[rows.others], fused_plain(x[rows.others]), rtol=0, atol=0)
    prompt = x[rows.prompt]
    if prompt.shape[0] < fused.prompt_q8.max_m:
        want = torch.cat([int4_q8_reference(prompt.float(), q._cpu) for q in split], dim=-1)
        tol = dict(rtol=8e-3, atol=2e-2) if dtype == torch.bfloat16 else TOL  # bf16: the output's rounding
        torch.testing.assert_close(got[rows.prompt].float(), want, **tol)
        assert not torch.equal(got[rows.prompt], w4a16[rows.prompt])
    else:  # AMX: the dense tiles take prompts this long in bf16
        torch.testing.assert_close(got[rows.prompt], fused_plain(prompt), rtol=0, atol=0)
    with prompt_rows(PromptRows(m)):  # every row a prompt's: one call
        torch.testing.assert_close(fused(x[None])[0], fused.prompt_q8(x) if m < fused.prompt_q8.max_m else w4a16,
                                   rtol=0, atol=0)


def test_prompt_q8_by_default_without_amx_or_on_amx_int8_tiles(q8):
    from quantkit.kernels.linear_choice import prompt_q8_not_default, prompt_q8_unavailable

    amx = hasattr(q8, "has_amx") and q8.has_amx()
    assert prompt_q8_unavailable() is None
    assert (prompt_q8_not_default() is None) == (not amx or hasattr(q8, "int4_q8_amx_takes"))


@pytest.mark.parametrize(("group_size", "tiles_kept"), [(128, False), (32, True), (4, False)])
def test_a_default_prompt_split_never_takes_rows_off_amx_tiles(q8, group_size, tiles_kept):
    """repack_for_cpu(int8_prefill=True, by_default=True): on AMX, a linear on the bf16 tiles sends its prompt rows
    to the W4A8 kernel only where that runs on AMX-INT8 tiles (groups of 64s), not to the slower VNNI kernel (groups
    of 32); off AMX tiles (groups of 4: the AVX-512 BF16 kernel) the split holds. Asked (by_default False), it
    always holds."""
    from quantkit.model.quant_linear import QuantLinear

    if not (hasattr(q8, "has_amx") and q8.has_amx()):
        pytest.skip("the AMX tiles are not granted here")

    def linear(by_default):
        p = checkpoint(48, 256, group_size, "gptq", True, seed=group_size)
        p.bias = None
        q = QuantLinear(p)
        q.repack_for_cpu(torch.bfloat16, int8_prefill=True, by_default=by_default)
        return q

    default, asked = linear(True), linear(False)
    assert asked.prompt_q8 is not None
    assert (default.prompt_q8 is None) == tiles_kept
    assert ("AMX" in default.cpu_path) == (group_size % 32 == 0)


def test_fp32_prompts_run_w4a8_by_default_at_every_level(q8_f32):
    from quantkit.kernels.linear_choice import prompt_q8_not_default

    assert prompt_q8_not_default(torch.float32) is None  # AMX or not: the fp32 W4A16 kernel never runs faster


@pytest.fixture(scope="module")
def q8_f32(cpu_level):
    """The AVX2 int8-activation kernel for fp32 activations (built at every level)."""
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    return int4_cpu.extension()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 33])
@pytest.mark.parametrize(("n", "k", "layout", "sym", "group_size", "act_order"),
                         [*CASES, (48, 40, "gptq", True, 20, False)])  # a group of 5 quads: one partial int16 run
def test_f32_q8_kernel_matches_its_reference(q8_f32, m, n, k, layout, sym, group_size, act_order):
    p = checkpoint(n, k, group_size, layout, sym, act_order, seed=m)
    w = repack(p)
    x = 3 * torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    if m > 1:
        x[0, : w.group_size] = 0  # a group of zeros: scale 0
    xp = (x.index_select(1, w.perm) if w.perm is not None else x).contiguous()
    got = q8_f32.int4_linear_q8_f32(xp, w.packed, w.scale_zero, n, w.group_size)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, int4_q8_reference(xp, w), **TOL)
    w4a16 = int4_blocked_reference(x, w, None)  # x's rounding to int8 is all that differs
    assert float((got - w4a16).norm() / w4a16.norm()) < 0.02


def test_f32_q8_full_scale_codes_do_not_overflow(q8_f32):
    """Every code 15 against x at +-amax over a group of 128: the largest int16 runs (8 quads) and int32 sums."""
    n, k = 16, 256
    codes, zeros = torch.full((n, k), 15), torch.zeros(2, n)
    packed, sz = int4_cpu.pack_blocks(codes, torch.ones(2, n), zeros, 128)
    w = int4_cpu.Int4Blocked(packed, sz, n, 128, None)
    x = torch.ones(3, k)
    x[1] = -1
    got = q8_f32.int4_linear_q8_f32(x, w.packed, w.scale_zero, n, 128)
    assert got[0].tolist() == pytest.approx([15 * k] * n) and got[1].tolist() == pytest.approx([-15 * k] * n)
    torch.testing.assert_close(got, int4_q8_reference(x, w), **TOL)


def test_f32_q8_gives_the_avx512_kernels_bits(q8_f32):
    """On x exact in bf16 both kernels round x to the same int8 codes, sum code * xq exactly in int32 and scale each
    group in the same order: the same fp32 outputs."""
    if not hasattr(q8_f32, "int4_linear_q8"):
        pytest.skip("the AVX-512 int8-activation kernel is built only where the compiler targets AVX-512 VNNI, VBMI "
                    "and BF16")
    w = repack(checkpoint(272, 512, 128, "gptq", False, seed=0))
    x = (3 * torch.randn(9, 512, generator=torch.Generator().manual_seed(1))).bfloat16()
    assert torch.equal(q8_f32.int4_linear_q8_f32(x.float(), w.packed, w.scale_zero, 272, 128),
                       q8_f32.int4_linear_q8(x, w.packed, w.scale_zero, 272, 128))


def test_f32_q8_rejects_groups_not_in_fours(q8_f32):
    w = int4_cpu.Int4Blocked(torch.zeros(1, 12, 8, dtype=torch.uint8), torch.ones(1, 2, 2, 16, dtype=torch.float16),
                             16, 6, None)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        q8_f32.int4_linear_q8_f32(torch.zeros(1, 12), w.packed, w.scale_zero, 16, 6)
    choice = choose(LinearCase(4, 6, torch.float32, int8_activations=True))  # falls back to the fp32 kernel
    assert choice.cpu_path == "int4 (quantkit AVX2 kernel)" and choice.direct == "f32"
    assert any("AVX2 int8-activation" in why and "not a multiple of 4" in why for why in choice.passed_over)


@pytest.mark.parametrize("m", [1, 7, 200])
def test_quantlinear_with_int8_activations_in_fp32_runs_the_avx2_q8_kernel(q8_f32, m):
    """fp32 activations with int8 activations asked: the AVX2 W4A8 row, straight from the module, fused or not;
    without asking, the fp32 kernel (W4A16) as before."""
    from quantkit.model.quant_linear import QuantLinear

    parts, plain = [], []
    for n in (64, 32, 32):
        p = checkpoint(n, 256, 64, "gptq", True, seed=n)
        p.bias = None
        q = QuantLinear(p)
        assert q.repack_for_cpu(torch.float32, int8_activations=True) == "int4 (quantkit AVX2 int8-activation kernel)"
        assert q._direct.int8_activations and q._direct.dtype == torch.float32
        parts.append(q)
        r = QuantLinear(p)
        assert r.repack_for_cpu(torch.float32) == "int4 (quantkit AVX2 kernel)"
        assert not r._direct.int8_activations and r._direct.dtype == torch.float32
        plain.append(r)
    fused = QuantLinear.concat(parts)
    assert fused._direct is not None and fused._direct.int8_activations and fused._direct.dtype == torch.float32
    x = 2 * torch.randn(2, m, 256, generator=torch.Generator().manual_seed(m))
    got = fused(x)
    assert got.dtype == torch.float32 and got.shape == (2, m, 128)
    torch.testing.assert_close(got, torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
    flat = x.reshape(-1, 256)
    want = torch.cat([int4_q8_reference(flat, p._cpu) for p in parts], dim=-1)
    if flat.shape[0] < fused._direct.max_m:
        torch.testing.assert_close(got.reshape(-1, 128), want, **TOL)
    w4a16 = torch.cat([q(x) for q in plain], dim=-1)
    assert not torch.equal(got, w4a16) and float((got - w4a16).norm() / w4a16.norm()) < 0.02
