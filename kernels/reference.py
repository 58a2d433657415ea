"""Pure-torch W4A16 dequant-matmul: the test oracle for the Triton kernels and the CPU path."""

from __future__ import annotations

import torch

from quantkit.format.packing import PackedLinear, dequantize


def w4a16_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    layout: str,
    group_size: int = 128,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    bits: int = 4,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype; W dequantized in fp32, product in fp32."""
    p = PackedLinear(layout, bits, group_size, qweight.cpu(), qzeros.cpu(), scales.cpu(),
                     None if g_idx is None else g_idx.cpu())
    w = dequantize(p, torch.float32).to(x.device)  # [N, K]
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
