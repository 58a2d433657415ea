"""The bf16-weight CPU linears against their pure-torch references: Bf16Linear (fp32 activations, the weight widened
to fp32, then F.linear) and Bf16DotLinear (bf16 activations, fp32 sums rounded to bf16)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import bf16_cpu
from quantkit.kernels.bf16_cpu import (Bf16DotLinear, Bf16Linear, bf16_dot_available, bf16_dot_reference, bf16_linear,
                                       bf16_linear_reference, pack_pairs, pack_weight, unavailable)

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=f"bf16 CPU kernel: {unavailable()}"),
              pytest.mark.usefixtures("cpu_level")]  # at each CPU level this machine runs (conftest.py)


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


# Bf16DotLinear: bf16 activations and weights (AVX-512 BF16)

dot_missing = pytest.mark.usefixtures("needs_bf16_dot")


@pytest.fixture(params=["default", "avx512", "amx"])
def dot_path(request, needs_bf16_dot):
    """Bf16DotLinear's kernel as the engine runs it (AMX tiles from a few rows where granted), with AMX off (the
    AVX-512 BF16 tiles at every M), and with AMX from one row on (skipped where this CPU gives no AMX tiles)."""
    ext = bf16_cpu.extension()
    if request.param == "default":
        yield request.param
        return
    if not ext.has_amx():
        if request.param == "amx":
            pytest.skip("AMX tiles: none on this CPU, or Linux did not grant them")
        yield request.param  # nothing to switch off
        return
    old_on, old_m = ext.dev.set_amx(request.param == "amx"), ext.dev.set_amx_from_m(1)
    yield request.param
    ext.dev.set_amx(old_on)
    ext.dev.set_amx_from_m(old_m)


@dot_missing
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 12, 17, 24, 33, 300])  # every tile; 16 on: 8 x 2 blocks; 300: 3
@pytest.mark.parametrize("n,k,bias", [(1000, 1024, False), (33, 100, True), (7, 2, False), (130, 1024, True),
                                      (20, 2816, False), (48, 96, True)])  # AMX: K a multiple of 32 (100 and 2: not)
def test_bf16_dot_linear_matches_reference(dot_path, m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16).requires_grad_(False)
    lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    if bias:
        lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g).bfloat16()  # x: [M, K]
    want = bf16_dot_reference(x, lin.weight, lin.bias)
    got = Bf16DotLinear(lin)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 sums in another order, each rounded to bf16 once: at most one bf16 ulp apart (2^-7 relative)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@dot_missing
def test_bf16_dot_layout_gives_the_weight_back_and_pads_with_zeros():
    w = torch.randn(20, 8).bfloat16()
    packed = pack_pairs(w)
    assert packed.shape == (2, 4, 16, 2)  # [ceil(N / 16), K / 2, 16, 2]
    assert torch.equal(packed[0, 1, 3], w[3, 2:4])  # block 0, columns 2-3, row 3
    assert torch.equal(packed[1, :, :4].permute(1, 0, 2).reshape(4, 8), w[16:]) and not packed[1, :, 4:].any()
    lin = torch.nn.Linear(8, 20, bias=False).to(torch.bfloat16)
    assert torch.equal(Bf16DotLinear(lin).weight, lin.weight)


@dot_missing
def test_bf16_dot_concat_splits_into_each_linears_own_output():
    lins = [torch.nn.Linear(64, n, bias=True).to(torch.bfloat16).requires_grad_(False) for n in (48, 16, 16)]
    fused = Bf16DotLinear.concat(lins)
    assert fused.out_splits == (48, 16, 16)
    x = torch.randn(5, 64).bfloat16()
    for got, lin in zip(fused(x).split(fused.out_splits, dim=-1), lins):
        assert torch.equal(got, Bf16DotLinear(lin)(x))  # the same sums in the same order: bit-equal


@dot_missing
def test_bf16_dot_takes_leading_dims_and_refuses_what_it_cannot_run():
    lin = torch.nn.Linear(32, 24, bias=False).to(torch.bfloat16)
    dot = Bf16DotLinear(lin)
    x = torch.randn(2, 3, 32).bfloat16()
    assert torch.equal(dot(x), dot(x.reshape(6, 32)).reshape(2, 3, 24))
    with pytest.raises(ValueError, match="bf16 x"):
        dot(torch.randn(2, 32))  # fp32 activations
    with pytest.raises(ValueError, match="K even"):
        pack_pairs(torch.randn(4, 7).bfloat16())
    assert not Bf16DotLinear.supports(torch.nn.Linear(7, 4))


@dot_missing
def test_amx_and_avx512_tiles_differ_only_in_the_order_of_the_sums():
    """set_amx reaches the kernel: the two paths' fp32 sums differ in their last bits, never by more than one bf16 ulp."""
    ext = bf16_cpu.extension()
    if not ext.has_amx():
        pytest.skip("AMX tiles: none on this CPU, or Linux did not grant them")
    lin = torch.nn.Linear(1024, 272, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(2)).bfloat16()
    tiles = Bf16DotLinear(lin)(x)
    assert ext.dev.set_amx(False) is True  # the default is on
    try:
        vectors = Bf16DotLinear(lin)(x)
    finally:
        ext.dev.set_amx(True)
    assert not torch.equal(tiles, vectors)
    torch.testing.assert_close(tiles.float(), vectors.float(), rtol=2 ** -7, atol=1e-6)


def test_quantkit_cpu_amx_0_keeps_every_extension_off_its_amx_paths():
    """The environment's escape hatch: QUANTKIT_CPU_AMX=0 (read once per process) and no extension reports AMX tiles,
    so the AVX-512 (or AVX2) kernels run; without it, every extension agrees with the bf16 one."""
    import os
    import subprocess
    import sys

    from quantkit.kernels import int4_cpu
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    exts = [bf16_cpu.extension(), int4_cpu.extension(), cpu_attention()]
    if any(ext is None for ext in exts):
        pytest.skip("the C++ kernels do not build here")
    if not exts[0].has_amx():
        pytest.skip("AMX tiles: none on this CPU, or Linux did not grant them")
    assert all(ext.has_amx() for ext in exts)
    code = ("from quantkit.kernels import bf16_cpu, int4_cpu; from quantkit.kernels.paged_attention_cpu import "
            "cpu_attention; print([e.has_amx() for e in (bf16_cpu.extension(), int4_cpu.extension(), cpu_attention())])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "QUANTKIT_CPU_AMX": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[False, False, False]"
