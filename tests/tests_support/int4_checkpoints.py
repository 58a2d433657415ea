"""Packed 4-bit linears for the CPU kernel tests."""

from __future__ import annotations

import torch

from quantkit.format.packing import pack
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize


def checkpoint(n: int, k: int, group_size: int, layout: str, sym: bool, act_order: bool = False, seed: int = 0):
    """A packed 4-bit linear [N, K]; with act_order, a shuffled g_idx as GPTQ's desc_act writes it."""
    gen = torch.Generator().manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k, generator=gen), QuantScheme(4, group_size, sym))
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
        qw = QuantizedWeight(qw.qweight, qw.scales, qw.zeros, g_idx, qw.scheme)
    p = pack(qw, layout)
    p.bias = torch.randn(n, generator=gen)
    return p
