"""A checkpoint whose MoE experts are MXFP4 (gpt-oss as OpenAI ships it), read as the float checkpoint it stands for.

Each `<name>_blocks` / `<name>_scales` pair appears as one tensor `<name>` [E, in, out] in bf16 (the stacked layout
of a bf16 gpt-oss checkpoint), dequantized when read (quantkit.format.mxfp4); every other tensor reads as stored.
So the engine, eval and plan take such a checkpoint as they take a float one: quantkit reads MXFP4 but never writes
it, and config.json's `quant_method: mxfp4` describes no packed linear (read_quant_info gives None).
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.format import mxfp4
from quantkit.model.checkpoint import ShardReader, TensorEntry


class Mxfp4Reader(ShardReader):
    def __init__(self, path: Path):
        super().__init__(path)
        self.pairs = mxfp4.mxfp4_pairs(self.entries)  # {float name: (blocks key, scales key)}
        if not self.pairs:
            raise QuantkitError(f"{self.path}: config.json says mxfp4, but no *_blocks / *_scales tensors are stored")
        self.hidden = {k for pair in self.pairs.values() for k in pair}

    def keys(self) -> list[str]:
        return [k for k in self.entries if k not in self.hidden] + sorted(self.pairs)

    def __contains__(self, key: str) -> bool:
        return key in self.pairs or (key in self.entries and key not in self.hidden)

    def shape_of(self, key: str) -> tuple[int, ...]:
        if key not in self.pairs:
            return super().shape_of(key)
        *stack, out, groups, _ = super().shape_of(self.pairs[key][0])
        return (*stack, groups * mxfp4.BLOCK, out)

    def dtype_of(self, key: str) -> torch.dtype:
        return torch.bfloat16 if key in self.pairs else super().dtype_of(key)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.pairs:
            return super().get(key)
        blocks, scales = self.pairs[key]
        return mxfp4.dequantize_stacked(super().get(blocks), super().get(scales))

    def rows(self, key: str, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` along dim 0 (experts) of a tensor; of a dequantized one, only those experts' blocks are read."""
        if key not in self.pairs:
            return super().rows(key, index)
        blocks, scales = self.pairs[key]
        return mxfp4.dequantize_stacked(super().rows(blocks, index), super().rows(scales, index))

    def _entry(self, key: str) -> TensorEntry:
        if key in self.pairs:  # in-place reads (mapped, rows, a stored copy) see the bytes as stored
            raise QuantkitError(f"{self.path}: {key} is stored as MXFP4 and is read dequantized, not in place")
        return super()._entry(key)
