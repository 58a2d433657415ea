"""The CPU int4/int8 paths (quantkit.kernels.cpu_int) against the pure-torch reference and the
dequantized checkpoint weight (quantkit.format.packing.dequantize)."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.packing import dequantize, pack
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize
from quantkit.kernels.cpu_int import (
    dequantize_int4,
    int4_linear,
    int4_unsupported,
    int8_linear,
    quant_linear_reference,
    repack_int4,
    repack_int8,
    unpack_int4pack,
)

K = 256


def act_order_weight(n: int, g: int, seed: int = 0) -> QuantizedWeight:
    """A 4-bit weight whose g_idx is shuffled, as GPTQ with desc_act writes it."""
    gen = torch.Generator().manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, K, generator=gen), QuantScheme(4, g, False))
    g_idx = (torch.arange(K) // g)[torch.randperm(K, generator=gen)].to(torch.int32)
    return QuantizedWeight(qw.qweight, qw.scales, qw.zeros, g_idx, qw.scheme)


@pytest.mark.parametrize("n", [32, 48, 80, 96, 112, 128])  # 32- or 64-row blocks (AVX2, AVX-512), tails of 16-48 rows
def test_unpack_int4pack_inverts_torch_packing(n):
    codes = torch.randint(0, 16, (n, K), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # packed: [N, K / 2] uint8
    assert torch.equal(unpack_int4pack(packed).to(torch.int32), codes)


CASES = [(layout, g) for layout in ("gptq", "gptq_v2", "awq") for g in (32, 128, -1)]
CASES += [("act_order", 32), ("act_order", 128)]  # one group spanning K has no order to permute


@pytest.mark.parametrize(("layout", "group_size"), CASES)
@pytest.mark.parametrize("n", [48, 64])
def test_int4_matches_reference_and_dequantized_weight(layout, group_size, n):
    if layout == "act_order":
        p = pack(act_order_weight(n, group_size), "gptq_v2")
    else:
        p = pack(rtn_quantize(torch.randn(n, K), QuantScheme(4, group_size, layout == "gptq")), layout)
    p.bias = torch.randn(n)
    w = repack_int4(p, torch.float32)
    want_w = dequantize(p)  # [N, K] in the checkpoint's column order
    got_w = dequantize_int4(w, torch.float32)
    if w.perm is not None:
        want_w = want_w[:, w.perm]
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)
    for m in (1, 7):
        x = torch.randn(m, K)
        want = quant_linear_reference(x, p)
        torch.testing.assert_close(int4_linear(x, w, p.bias, kernel_max_m=m), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(int4_linear(x, w, p.bias, kernel_max_m=0), want, rtol=1e-4, atol=1e-4)


def test_int4_bf16_activations_close_to_reference():
    gen = torch.Generator().manual_seed(0)
    p = pack(rtn_quantize(torch.randn(64, K, generator=gen), QuantScheme(4, 64, True)), "gptq")
    w = repack_int4(p, torch.bfloat16)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    want = quant_linear_reference(x.float(), p)  # outputs ~ sqrt(K) in size
    for max_m in (3, 0):
        got = int4_linear(x, w, None, kernel_max_m=max_m)
        assert got.dtype == torch.bfloat16
        # bf16 keeps 8 significant bits: errors scale with the outputs' size, not a fixed atol
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


def test_int4_unsupported_says_why():
    assert "group size 16" in int4_unsupported(pack(rtn_quantize(torch.randn(32, K), QuantScheme(4, 16, True)), "gptq"))
    assert "multiple of 16" in int4_unsupported(pack(rtn_quantize(torch.randn(24, K), QuantScheme(4, 32, True)), "gptq"))
    assert "8-bit" in int4_unsupported(pack(rtn_quantize(torch.randn(32, K), QuantScheme(8, -1, True)), "gptq"))


def test_strided_activations_are_accepted():
    # e.g. x = qkv[:, :K] or a transposed view: torch's kernels refuse non-contiguous inputs
    p4 = pack(rtn_quantize(torch.randn(48, K), QuantScheme(4, 64, True)), "gptq")
    p8 = pack(rtn_quantize(torch.randn(48, K), QuantScheme(8, -1, True)), "gptq")
    x = torch.randn(K, 5).T  # [5, K], column-major
    assert not x.is_contiguous()
    for max_m in (5, 0):
        got = int4_linear(x, repack_int4(p4, torch.float32), None, kernel_max_m=max_m)
        torch.testing.assert_close(got, quant_linear_reference(x, p4), rtol=1e-4, atol=1e-4)
    got8 = int8_linear(x, repack_int8(p8, torch.float32), None)
    torch.testing.assert_close(got8, quant_linear_reference(x, p8), rtol=1e-4, atol=1e-4)


def test_int8_per_channel_matches_reference_and_grouped_is_refused():
    p = pack(rtn_quantize(torch.randn(48, K), QuantScheme(8, -1, True)), "gptq")
    w = repack_int8(p, torch.float32)
    x = torch.randn(5, K)
    torch.testing.assert_close(int8_linear(x, w, None), quant_linear_reference(x, p), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="per-channel"):
        repack_int8(pack(rtn_quantize(torch.randn(48, K), QuantScheme(8, 64, True)), "gptq"), torch.float32)

