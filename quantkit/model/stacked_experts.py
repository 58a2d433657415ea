"""A checkpoint that stacks its experts (gpt-oss: `<layer>.mlp.experts.gate_up_proj` [E, in, out] and
`gate_up_proj_bias` [E, out]), read as one linear per expert: `<layer>.mlp.experts.<e>.gate_up_proj.weight`
[out, in] and `.bias` [out], the names quantkit's MoE block (quantkit.model.moe), the quantizer, the checker and the
engine use, and the names quantkit's 4-bit checkpoints of such a model hold.

`PerExpertReader` wraps a ShardReader (or an Mxfp4Reader, whose stacked tensors are dequantized MXFP4): each stacked
tensor is replaced by its experts' tensors, each read alone (one expert's rows of the stacked tensor, not the
stack). Every other tensor reads as stored. The rows of gate_up keep the checkpoint's order (gate and up interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.format.arch import ExpertsSpec


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's weight or bias in a stacked tensor."""

    stacked: str  # the checkpoint's key
    expert: int
    bias: bool  # a bias [out] (else a weight, stored [in, out], read [out, in])


def expert_slices(keys, spec: ExpertsSpec, shape_of) -> dict[str, ExpertSlice]:
    """{per-expert key: where it lies} for every stacked projection among `keys` (shape_of(key) gives E)."""
    head = f".{spec.block}.{spec.experts}."
    out = {}
    for key in keys:
        prefix, found, leaf = key.rpartition(head)
        name, bias = (leaf[:-len("_bias")], True) if leaf.endswith("_bias") else (leaf, False)
        if not found or name not in spec.projections:
            continue
        for e in range(shape_of(key)[0]):
            out[f"{prefix}{head}{e}.{name}.{'bias' if bias else 'weight'}"] = ExpertSlice(key, e, bias)
    return out


class PerExpertReader:
    """A reader whose stacked expert tensors read as per-expert ones (see the module docstring); everything else is
    the wrapped reader's."""

    def __init__(self, base, spec: ExpertsSpec):
        self.base = base
        self.slices = expert_slices(base.keys(), spec, base.shape_of)
        self.stacked = {s.stacked for s in self.slices.values()}

    def __getattr__(self, name):  # path, close, total_bytes, ...: the wrapped reader's
        return getattr(self.base, name)

    def keys(self) -> list[str]:
        return [k for k in self.base.keys() if k not in self.stacked] + list(self.slices)

    def __contains__(self, key: str) -> bool:
        return key in self.slices or (key in self.base and key not in self.stacked)

    def shape_of(self, key: str) -> tuple[int, ...]:
        s = self.slices.get(key)
        if s is None:
            return self.base.shape_of(key)
        shape = self.base.shape_of(s.stacked)[1:]
        return shape if s.bias else (shape[1], shape[0])

    def dtype_of(self, key: str) -> torch.dtype:
        s = self.slices.get(key)
        return self.base.dtype_of(s.stacked if s else key)

    def get(self, key: str) -> torch.Tensor:
        s = self.slices.get(key)
        if s is None:
            return self.base.get(key)
        row = self.base.rows(s.stacked, torch.tensor([s.expert]))[0]
        return row if s.bias else row.t().contiguous()

    def entry(self, key: str):
        if key in self.slices:
            raise QuantkitError(f"{self.base.path}: {key} is one expert's part of a stacked tensor, not stored alone")
        return self.base.entry(key)

    def aligned(self, key: str) -> bool:
        return key not in self.slices and self.base.aligned(key)
