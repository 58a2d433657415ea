"""Packing against a reference written here from the documented GPTQ and AWQ layouts."""

import pytest
import torch

from quantkit.format.packing import AWQ_ORDER, PackedLinear, dequantize, pack, pack_cols, unpack, unpack_cols
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize


def ref_gptq_qweight(codes_nk: torch.Tensor, bits: int) -> list[list[int]]:
    """Word r of column n holds input rows pf*r+j in bits bits*j.. (low first), as Python ints."""
    n, k = codes_nk.shape
    pf = 32 // bits
    words = [[0] * n for _ in range(k // pf)]
    for r in range(k // pf):
        for col in range(n):
            v = 0
            for j in range(pf):
                v |= int(codes_nk[col, pf * r + j]) << (bits * j)
            words[r][col] = v
    return words


def ref_pack_along_n(values_gn: torch.Tensor, bits: int, order=None) -> list[list[int]]:
    g, n = values_gn.shape
    pf = 32 // bits
    order = order or list(range(pf))
    out = [[0] * (n // pf) for _ in range(g)]
    for row in range(g):
        for c in range(n // pf):
            v = 0
            for i in range(pf):
                v |= int(values_gn[row, pf * c + order[i]]) << (bits * i)
            out[row][c] = v
    return out


def as_u32(t: torch.Tensor) -> list[list[int]]:
    return [[x & 0xFFFFFFFF for x in row] for row in t.tolist()]


def random_qw(n=16, k=64, bits=4, group=32, sym=False, seed=0) -> QuantizedWeight:
    torch.manual_seed(seed)
    return rtn_quantize(torch.randn(n, k), QuantScheme(bits, group, sym))


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v2_layout_matches_reference(bits):
    qw = random_qw(bits=bits, sym=False)
    p = pack(qw, "gptq_v2")
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (64 * bits // 32, 16)
    assert as_u32(p.qweight) == ref_gptq_qweight(qw.qweight, bits)
    assert as_u32(p.qzeros) == ref_pack_along_n(qw.zeros.long(), bits)
    assert p.scales.dtype == torch.float16 and p.scales.shape == (2, 16)
    assert p.g_idx.tolist() == [i // 32 for i in range(64)]


def test_gptq_v1_stores_zero_minus_one_and_sym4_is_0x77777777():
    qw = random_qw(sym=True)
    p = pack(qw, "gptq")
    assert all(w == 0x77777777 for row in as_u32(p.qzeros) for w in row)
    assert as_u32(p.qzeros) == ref_pack_along_n(qw.zeros.long() - 1, 4)


def test_gptq_v1_refuses_zero_point_zero():
    qw = random_qw(sym=False)
    qw.zeros[0, 0] = 0
    with pytest.raises(ValueError, match="gptq_v2"):
        pack(qw, "gptq")


def test_awq_layout_matches_reference_order_and_no_offset():
    qw = random_qw(sym=False)
    p = pack(qw, "awq")
    assert p.qweight.shape == (64, 2) and p.g_idx is None
    assert as_u32(p.qweight) == ref_pack_along_n(qw.qweight.T.long(), 4, list(AWQ_ORDER))
    assert as_u32(p.qzeros) == ref_pack_along_n(qw.zeros.long(), 4, list(AWQ_ORDER))


def test_awq_nibble_positions_by_hand():
    # W [N=8, K=32] where output column n holds the code n everywhere; word c=0 of any row must
    # hold column ORDER[i] in bits 4i..4i+3, i.e. nibbles 0,2,4,6,1,3,5,7 from the low end.
    codes = torch.arange(8, dtype=torch.int32).view(8, 1).expand(8, 32).contiguous()
    qw = QuantizedWeight(codes, torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(32, dtype=torch.int32),
                         QuantScheme(4, 32, False))
    word = pack(qw, "awq").qweight[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq"])
def test_round_trip_exact(layout):
    qw = random_qw(sym=layout == "gptq", n=24, k=128)
    p = pack(qw, layout)
    codes, zeros, scales, g_idx = unpack(p)
    assert torch.equal(codes.T, qw.qweight)
    assert torch.equal(zeros.float(), qw.zeros)
    assert torch.equal(dequantize(p), qw.dequantize())


def test_act_order_g_idx_round_trip_and_awq_refuses_it():
    qw = random_qw(sym=True)
    perm = torch.randperm(64)
    qw.g_idx = qw.g_idx[perm]
    p = pack(qw, "gptq")
    assert torch.equal(dequantize(p), qw.dequantize())
    with pytest.raises(ValueError, match="act-order"):
        pack(qw, "awq")


def test_per_channel_group():
    qw = rtn_quantize(torch.randn(8, 64), QuantScheme(4, -1, True))
    p = pack(qw, "gptq")
    assert p.scales.shape == (1, 8)
    assert torch.equal(dequantize(p), qw.dequantize())
    assert isinstance(p, PackedLinear) and p.in_features == 64 and p.out_features == 8



def test_packing_stays_on_the_weights_device():
    """The pipeline packs on its compute device (a GPU): every tensor packing makes must live where the codes live.
    The meta device stands in for a GPU on CPU-only machines: mixing it with a CPU tensor raises, as CUDA does."""
    qw = random_qw()
    on_meta = QuantizedWeight(qw.qweight.to("meta"), qw.scales.to("meta"), qw.zeros.to("meta"), qw.g_idx.to("meta"),
                              qw.scheme)
    packed = pack(on_meta, "gptq_v2")
    codes, zeros, _, _ = unpack(packed)
    awq_words = pack_cols(on_meta.qweight.T, 4, AWQ_ORDER)
    for t in (packed.qweight, packed.qzeros, codes, zeros, awq_words, unpack_cols(awq_words, 4, AWQ_ORDER)):
        assert t.device.type == "meta"


def test_quantized_weights_hold_their_codes_in_a_byte():
    """A layer's QuantizedWeights wait for packing until the whole layer is done: int32 codes took as much memory as
    the fp32 layer itself. Codes given in any integer dtype are kept as uint8, and pack the same."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    qw = rtn_quantize(w, QuantScheme(4, 32, False))
    assert qw.qweight.dtype == torch.uint8 and int(qw.qweight.max()) <= 15
    wide = QuantizedWeight(qw.qweight.to(torch.int32), qw.scales, qw.zeros, qw.g_idx, qw.scheme)
    assert wide.qweight.dtype == torch.uint8
    assert torch.equal(pack(wide, "gptq_v2").qweight, pack(qw, "gptq_v2").qweight)
    torch.testing.assert_close(qw.dequantize(), wide.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("producer", ["rtn", "searched", "gptq", "gptq_act_order"])
def test_every_producer_makes_its_codes_a_byte_wide_itself(producer, monkeypatch):
    """RTN, the scale search and GPTQ hand QuantizedWeight uint8 codes (no int32 copy of a weight's codes beside its
    fp32 weight); the narrowing in __post_init__ stays a guard."""
    from quantkit.quant.gptq import GPTQOptions, gptq_quantize
    from quantkit.quant.scale_search import searched_quantize

    given = []
    post_init = QuantizedWeight.__post_init__

    def spy(self):
        given.append(self.qweight.dtype)
        post_init(self)

    monkeypatch.setattr(QuantizedWeight, "__post_init__", spy)
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 64, generator=gen), torch.randn(256, 64, generator=gen)
    scheme = QuantScheme(4, 32, False)
    made = {
        "rtn": lambda: rtn_quantize(w, scheme),
        "searched": lambda: searched_quantize(w, scheme),
        "gptq": lambda: gptq_quantize(w, 2 * x.T @ x / 256, scheme, GPTQOptions()).weight,
        "gptq_act_order": lambda: gptq_quantize(w, 2 * x.T @ x / 256, scheme, GPTQOptions(act_order=True)).weight,
    }[producer]()
    assert given == [torch.uint8] and made.qweight.dtype == torch.uint8 and int(made.qweight.max()) <= 15


@pytest.mark.parametrize("shape", [(64, 40), (16, 8), (8, 1000)])
def test_packing_in_slices_gives_the_words_of_one_pass(monkeypatch, shape):
    """Codes are packed a slice at a time (PACK_STEP_CODES) to bound the int64 temporaries: the same words."""
    from quantkit.format import packing

    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    whole_rows, whole_cols = packing.pack_rows(codes, 4), packing.pack_cols(codes, 4, AWQ_ORDER)
    monkeypatch.setattr(packing, "PACK_STEP_CODES", 50)  # slices of a few rows or columns, the last one short
    assert torch.equal(packing.pack_rows(codes, 4), whole_rows)
    assert torch.equal(packing.pack_cols(codes, 4, AWQ_ORDER), whole_cols)
    assert torch.equal(packing.unpack_rows(whole_rows, 4), codes.to(torch.int32))
