"""quantkit.format.mxfp4: gpt-oss's MXFP4 experts dequantized as transformers dequantizes them, bit for bit."""

from __future__ import annotations

import pytest
import torch

from quantkit.format import mxfp4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_stacked_is_transformers_conversion(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)  # [E, out, in / 32, 16]
    scales = torch.randint(100, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize_stacked(blocks, scales, dtype)
    assert ours.shape == (3, 128, 10) and ours.dtype == dtype  # [E, in, out], as a float gpt-oss stacks it
    assert torch.equal(ours, convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype))


def test_codes_and_scales_decode_low_nibble_first():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # element 0: code 15 (-6), element 1: code 2 (1.0)
    scales = torch.tensor([128], dtype=torch.uint8)  # 2 ** 1
    values = mxfp4.dequantize(blocks, scales, torch.float32)  # one block of 32
    assert values.shape == (32,) and values[:3].tolist() == [-12.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, torch.zeros(2, dtype=torch.uint8))


def test_pairs_name_the_float_tensor_each_blocks_and_scales_stand_for():
    keys = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", "a.gate_up_proj_bias", "b.down_proj_blocks"]
    assert mxfp4.mxfp4_pairs(keys) == {"a.gate_up_proj": ("a.gate_up_proj_blocks", "a.gate_up_proj_scales")}
    assert mxfp4.is_mxfp4({"quantization_config": {"quant_method": "mxfp4"}})
    assert not mxfp4.is_mxfp4({"quantization_config": {"quant_method": "gptq"}}) and not mxfp4.is_mxfp4({})
