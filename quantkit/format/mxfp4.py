"""MXFP4, the layout gpt-oss ships its experts in (OCP microscaling FP4), read into float.

For a stacked projection W [E, out, in] the checkpoint holds (transformers' and vLLM's names):
  <name>_blocks  uint8 [E, out, in / 32, 16]   32 FP4 (E2M1) codes a block, two a byte: the element at
                                                2j in the low nibble of byte j, 2j + 1 in the high one
  <name>_scales  uint8 [E, out, in / 32]        each block's E8M0 exponent, biased by 127
  value = FP4_VALUES[code] * 2 ** (scale - 127)
A float gpt-oss checkpoint stacks the same projection as `<name>` [E, in, out]; `mxfp4_pairs` names each pair by that
tensor and `dequantize_stacked` gives it.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # elements sharing one scale
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config: dict) -> bool:
    """Whether config.json says the checkpoint's experts are MXFP4 (gpt-oss as OpenAI ships it)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (every value exact in bf16)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*scales.shape, BLOCK)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.reshape(*scales.shape[:-1], -1)


def dequantize_stacked(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A stacked projection's blocks [E, out, in / 32, 16] and scales -> [E, in, out], as a float checkpoint holds it."""
    return dequantize(blocks, scales, dtype).transpose(-2, -1).contiguous()


def mxfp4_pairs(keys) -> dict[str, tuple[str, str]]:
    """{float tensor name: (its blocks key, its scales key)} for each complete pair among `keys`."""
    keys = set(keys)
    pairs = {}
    for key in keys:
        if key.endswith(BLOCKS):
            name = key[:-len(BLOCKS)]
            if name + SCALES in keys:
                pairs[name] = (key, name + SCALES)
    return pairs
