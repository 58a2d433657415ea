"""QuantLinear: a linear layer whose weight is a packed INT4/INT8 checkpoint tensor set."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.format.packing import PackedLinear, dequantize


class QuantLinear(nn.Module):
    """Holds qweight/qzeros/scales(/g_idx, bias) as buffers under the names the checkpoint uses.

    On CUDA the forward runs the W4A16 kernel on the packed weights. Elsewhere the weight is
    dequantized once, on first use, to the activation dtype (fp32 or bf16: fp16 matmul on CPU
    is too slow to serve) and cached.
    """

    def __init__(self, packed: PackedLinear, backend: str = "auto"):
        super().__init__()
        self.layout = packed.layout
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.backend = backend
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("qzeros", packed.qzeros)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("g_idx", packed.g_idx)
        self.register_buffer("bias", packed.bias)
        self._dense: torch.Tensor | None = None

    def packed(self) -> PackedLinear:
        return PackedLinear(self.layout, self.bits, self.group_size, self.qweight, self.qzeros, self.scales,
                            self.g_idx, self.bias)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W_hat [N, K] in `dtype` (cached for the last dtype asked)."""
        if self._dense is None or self._dense.dtype != dtype or self._dense.device != self.qweight.device:
            p = self.packed()
            cpu = PackedLinear(p.layout, p.bits, p.group_size, p.qweight.cpu(), p.qzeros.cpu(), p.scales.cpu(),
                               None if p.g_idx is None else p.g_idx.cpu())
            self._dense = dequantize(cpu, dtype).to(self.qweight.device)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.backend != "torch" and self.bits == 4:
            from quantkit.kernels import w4a16_matmul

            shape = x.shape
            out = w4a16_matmul(x.reshape(-1, shape[-1]), self.qweight, self.qzeros, self.scales,
                               layout=self.layout, group_size=self.group_size, g_idx=self.g_idx,
                               bias=self.bias, backend=self.backend)
            return out.reshape(*shape[:-1], self.out_features)
        w = self.dense_weight(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, w, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, layout={self.layout}")
