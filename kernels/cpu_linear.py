"""Float linears on CPU through oneDNN with the weight prepacked once (what vLLM's CPU backend does).

`torch.ops.mkldnn._reorder_linear_weight` reorders W [N, K] into oneDNN's blocked layout once;
`torch.ops.mkldnn._linear_pointwise` then skips the per-call reorder F.linear pays. Linears that
share an input (q/k/v, gate/up) can be prepacked as one (`PrepackedLinear.concat`): one oneDNN call
instead of three, which at one token per step is what a decode pays most for besides the weights. Measured on
this project's CPU (AVX2, fp32, 2 threads, 2816 x 1024): 1.85x at M=1, 1.8x at M=64, 1.03x at
M=2048 (docs/BENCHMARKS.md). The reference is F.linear on the original weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def prepack_supported(dtype: torch.dtype) -> bool:
    """oneDNN prepacking for `dtype` on this CPU (bf16 only where oneDNN computes it natively)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_LINEAR = torch.ops.mkldnn._linear_pointwise


class PrepackedLinear(nn.Module):
    """A drop-in for nn.Linear on CPU: x [..., K] -> [..., N], weight prepacked at construction."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.out_splits = (self.out_features,)  # with concat: each source linear's share of the output

    @staticmethod
    def supports(linear: nn.Linear) -> bool:  # (every shape: the engine asks each float linear kind the same)
        return True

    @classmethod
    def concat(cls, linears: Sequence[nn.Linear]) -> PrepackedLinear:
        """One prepacked linear computing `linears` (same input size) side by side: its output
        [..., sum N_i] splits by `out_splits` into theirs, each row the same dot products as theirs."""
        packed = cls(concat_linears(linears))
        packed.out_splits = tuple(m.out_features for m in linears)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # _buffers read directly: two Module.__getattr__ lookups a call add up over an engine step's 33 calls
        buffers = self._buffers
        if x.dim() == 2:  # the engine's flat batch [T, K]
            return _LINEAR(x, buffers["packed_weight"], buffers["bias"], "none", [], "")
        shape = x.shape
        out = _LINEAR(x.reshape(-1, shape[-1]), buffers["packed_weight"], buffers["bias"], "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def concat_linears(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing `linears` (same input size, all or none with a bias) side by side."""
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        raise ValueError("concatenated linears need one input size and all or none with a bias")
    merged = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                       bias=linears[0].bias is not None, device="meta")
    merged.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if merged.bias is not None:
        merged.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return merged


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)
