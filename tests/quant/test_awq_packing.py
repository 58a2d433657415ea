"""The AWQ GEMM layout against a reference written here from the issue's description:

  qweight int32 [K, N/8]: the value of output column 8c + ORDER[i] in bits 4i..4i+3 of word c,
                          ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [K/G, N/8]: packed the same way, stored as they are (no minus one)
  scales  fp16 [K/G, N]; no g_idx
"""

from __future__ import annotations

import pytest
import torch

from quantkit.format.packing import dequantize, pack, to_quantized_weight, unpack
from quantkit.format.primitives import QuantizedWeight, QuantScheme, default_g_idx, rtn_quantize

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def reference_pack(values: torch.Tensor) -> torch.Tensor:
    """values [R, C] ints in 0..15 -> int32 [R, C/8], one Python int at a time."""
    r, c = values.shape
    out = torch.zeros(r, c // 8, dtype=torch.int32)
    for row in range(r):
        for word in range(c // 8):
            acc = 0
            for i in range(8):
                acc |= int(values[row, 8 * word + ORDER[i]]) << (4 * i)
            out[row, word] = acc - (1 << 32) if acc >= 1 << 31 else acc  # the same 32 bits as int32
    return out


def random_weight(n: int, k: int, group: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(4, group, sym=False)
    ng = k // group
    return QuantizedWeight(
        qweight=torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32),
        scales=(torch.rand(ng, n, generator=g) * 0.1 + 0.01).half().float(),
        zeros=torch.randint(0, 16, (ng, n), generator=g).float(),
        g_idx=default_g_idx(k, scheme), scheme=scheme,
    )


@pytest.mark.parametrize("n,k,group", [(16, 32, 32), (64, 128, 64), (24, 256, 128)])
def test_awq_pack_matches_reference(n, k, group):
    qw = random_weight(n, k, group)
    p = pack(qw, "awq")
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (k, n // 8)
    assert p.qzeros.dtype == torch.int32 and p.qzeros.shape == (k // group, n // 8)
    assert p.scales.dtype == torch.float16 and p.scales.shape == (k // group, n)
    assert p.g_idx is None
    assert torch.equal(p.qweight, reference_pack(qw.qweight.T))
    assert torch.equal(p.qzeros, reference_pack(qw.zeros.to(torch.int32)))  # no zero - 1 offset
    assert torch.equal(p.scales, qw.scales.half())


def test_awq_pack_known_word():
    # one row, output columns 0..7 hold 0..7: slots take columns 0,2,4,6,1,3,5,7 -> nibbles 0,2,4,6,1,3,5,7
    qw = random_weight(8, 32, 32)
    qw.qweight[:, 0] = torch.arange(8, dtype=torch.int32)
    word = int(pack(qw, "awq").qweight[0, 0]) & 0xFFFFFFFF
    assert word == 0x75316420


def test_awq_round_trip_is_exact_and_matches_dequantize():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    qw = rtn_quantize(w, QuantScheme(4, 64, sym=False))
    p = pack(qw, "awq")
    codes, zeros, scales, g_idx = unpack(p)
    assert torch.equal(codes, qw.qweight.T) and torch.equal(zeros.float(), qw.zeros)
    assert torch.equal(dequantize(p), qw.dequantize())
    back = to_quantized_weight(p)
    assert torch.equal(pack(back, "gptq_v2").qweight, pack(qw, "gptq_v2").qweight)  # same weights, GPTQ layout
    assert torch.equal(dequantize(pack(back, "gptq_v2")), dequantize(p))


def test_awq_layout_refuses_act_order():
    qw = random_weight(8, 64, 32)
    qw.g_idx = torch.tensor([1, 0] * 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="act-order"):
        pack(qw, "awq")
