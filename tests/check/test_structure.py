"""The structure checks of `quantkit check` and its independent dequantization, one packed
linear at a time: each corruption a checkpoint can carry is named, a sound layer passes."""

from __future__ import annotations

import pytest
import torch

from quantkit.check.structure import (
    LinearTensors,
    expected_shapes,
    independent_dequantize,
    structure_problems,
)
from quantkit.format.packing import dequantize, pack
from quantkit.format.primitives import QuantScheme, rtn_quantize

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 2}


def packed(layout: str, n: int = 64, k: int = 128, group: int = 32, sym: bool = True, act_order: bool = False,
           bits: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    qw = rtn_quantize(w, QuantScheme(bits=bits, group_size=group, sym=sym))
    if act_order:  # a permuted g_idx, as GPTQ with desc_act writes it
        qw.g_idx = qw.g_idx[torch.randperm(k, generator=gen)]
    return pack(qw, layout)


def tensors(p, **changes) -> LinearTensors:
    fields = dict(qweight=p.qweight, qzeros=p.qzeros, scales=p.scales, g_idx=p.g_idx)
    fields.update(changes)
    return LinearTensors(**fields)


def problems(p, n=64, k=128, layout=None, bits=None, group=32, sym=True, desc_act=False, **changes):
    return structure_problems(tensors(p, **changes), (n, k), layout=layout or p.layout, bits=bits or p.bits,
                              group_size=group, sym=sym, desc_act=desc_act)


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("sym", [True, False])
def test_independent_dequantization_agrees_with_the_packing_module(layout, sym):
    if layout == "gptq" and not sym:
        layout = "gptq_v2"  # v1 cannot store a zero point of 0
    p = packed(layout, sym=sym)
    w = independent_dequantize(tensors(p), layout=layout, bits=4, group_size=32)
    torch.testing.assert_close(w, dequantize(p), rtol=0, atol=0)


def test_independent_dequantization_follows_an_act_order_g_idx():
    p = packed("gptq", act_order=True)
    torch.testing.assert_close(independent_dequantize(tensors(p), layout="gptq", bits=4, group_size=32),
                               dequantize(p), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq"])
def test_a_sound_layer_has_no_problems(layout):
    assert problems(packed(layout)) == []


def test_act_order_g_idx_is_accepted_only_with_desc_act():
    p = packed("gptq", act_order=True)
    assert problems(p, desc_act=True) == []
    assert any("desc_act" in msg for msg in problems(p, desc_act=False))


def test_zeroed_or_non_finite_scales_are_problems():
    p = packed("gptq")
    assert any("scales" in msg and "> 0" in msg for msg in problems(p, scales=torch.zeros_like(p.scales)))
    bad = p.scales.clone()
    bad[0, 0] = float("inf")
    assert any("not finite" in msg for msg in problems(p, scales=bad))


def test_zero_points_out_of_range_in_gptq_v1():
    # v1 stores zero - 1: a stored 0xF is a zero point of 16, past 4 bits
    p = packed("gptq_v2", sym=False)
    v1_words = torch.full_like(p.qzeros, -1)  # every nibble 0xF
    msgs = problems(p, layout="gptq", sym=False, qzeros=v1_words)
    assert any("zero points" in msg and "16" in msg for msg in msgs)
    assert problems(p, layout="gptq_v2", sym=False, qzeros=v1_words) == []  # v2: 15 is in range


def test_config_claims_are_checked_against_the_tensors():
    p = packed("gptq_v2", sym=False)
    assert any("sym" in msg for msg in problems(p, sym=True))  # config says sym, zeros vary
    assert any("bits" in msg for msg in problems(packed("gptq"), bits=8))
    assert any("group" in msg for msg in problems(packed("gptq"), group=64))
    assert any("shape" in msg for msg in problems(packed("gptq"), n=128))  # config wants N=128


def test_g_idx_inconsistent_with_the_group_size_is_a_problem():
    p = packed("gptq")
    g_idx = p.g_idx.clone()
    g_idx[:40] = 0  # group 0 now holds 40 rows, group 1 only 24
    assert any("g_idx" in msg for msg in problems(p, desc_act=True, g_idx=g_idx))
    assert any("g_idx" in msg for msg in problems(p, g_idx=torch.full_like(p.g_idx, 7)))  # past the groups


def test_wrong_dtypes_are_problems():
    p = packed("gptq")
    assert any("qweight" in msg and "int32" in msg for msg in problems(p, qweight=p.qweight.to(torch.int64)))
    assert any("scales" in msg for msg in problems(p, scales=p.scales.to(torch.int32)))


def test_expected_shapes_come_from_the_config():
    shapes = expected_shapes(CONFIG)
    assert shapes["self_attn.q_proj"] == (128, 128)
    assert shapes["self_attn.k_proj"] == (64, 128) and shapes["self_attn.v_proj"] == (64, 128)
    assert shapes["self_attn.o_proj"] == (128, 128)
    assert shapes["mlp.gate_proj"] == (256, 128) and shapes["mlp.down_proj"] == (128, 256)
    assert expected_shapes({**CONFIG, "head_dim": 16})["self_attn.q_proj"] == (64, 128)
