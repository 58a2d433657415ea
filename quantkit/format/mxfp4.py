"""MXFP4, the layout gpt-oss ships its experts in (OCP microscaling FP4), read into float.

For a stacked projection W [E, out, in] the checkpoint holds (transformers' and vLLM's names):
  <name>_blocks  uint8 [E, out, in / 32, 16]   32 FP4 (E2M1) codes a block, two a byte: the element at
                                                2j in the low nibble of byte j, 2j + 1 in the high one
  <name>_scales  uint8 [E, out, in / 32]        each block's E8M0 exponent, biased by 127
  value = FP4_VALUES[code] * 2 ** (scale - 127)
A float gpt-oss checkpoint stacks the same projection as `<name>` [E, in, out]; `mxfp4_pairs` names each pair by that
tensor and `dequantize_stacked` gives it. `encode` writes the layout (for test and benchmark checkpoints; quantkit's
own checkpoints are never MXFP4).
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


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32]): each block's
    scale the smallest power of two under which its largest magnitude fits FP4's 6, each value the nearest code."""
    x = w.float().contiguous().reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -SCALE_BIAS))
    exp = exp.clamp(-SCALE_BIAS, 127)
    scaled = x / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = torch.bucketize(scaled.abs(), midpoints).to(torch.uint8)  # the nearest magnitude's code, 0..7
    codes |= (scaled < 0).to(torch.uint8) << 3  # the sign bit
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + SCALE_BIAS).to(torch.uint8)


def encode_stacked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float checkpoint's stacked projection [E, in, out] as MXFP4 blocks and scales (of [E, out, in])."""
    return encode(w.transpose(-2, -1))
