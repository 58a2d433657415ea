"""A bf16-weight linear for CPUs without native bf16 (kernels/csrc/bf16_cpu.cpp, AVX-512 or AVX2 + FMA), and
its pure-torch reference.

On such a CPU the engine computes in fp32, and an unquantized lm_head held in fp32 is the largest weight
read per decoded token (131 MB for a 32000 x 1024 head). Held as the checkpoint's bf16 instead, each weight
widens to fp32 exactly inside the kernel: the result is fp32 F.linear on the widened weight (up to the
order of the sums) from half the bytes. The kernel reads the weight in panels of 16 rows laid out k-major
(`pack_weight`, done once by `Bf16Linear`), so one tile serves several rows of x and W is read once per call at
any M. `Bf16Linear` is a drop-in for nn.Linear (no bias: lm_heads have none); whether it pays is measured
(python -m quantkit.bench.bf16_head), not assumed.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension

EXTENSION = "quantkit_bf16"
SOURCES = ("bf16_cpu.cpp",)


def extension():
    """The compiled kernel module, or None (then `unavailable()` says why)."""
    return load_cpu_extension(EXTENSION, SOURCES)


def unavailable() -> str | None:
    return None if extension() is not None else cpu_extension_unavailable(EXTENSION)


def bf16_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K], weight bf16 [N, K] -> fp32 [M, N]: the weight widened to fp32, then F.linear."""
    return nn.functional.linear(x, weight.float())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] -> the kernel's panels bf16 [ceil(N / 16), K, 16] (rows past N zero)."""
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the bf16 CPU kernel is unavailable: {unavailable()}")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_weight takes a bf16 weight [N, K], got {weight.dtype} {tuple(weight.shape)}")
    return ext.pack(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x fp32 [..., K] @ W.T -> fp32 [..., N] through the kernel, W given as pack_weight(W)."""
    if x.dtype != torch.float32 or x.shape[-1] != packed.shape[1]:
        raise ValueError(f"bf16_linear takes fp32 x [M, K] and a bf16 weight [N, K], got {x.dtype} "
                         f"{tuple(x.shape)} for K = {packed.shape[1]}")
    y = extension().bf16_linear(x.reshape(-1, x.shape[-1]), packed, out_features)
    return y.reshape(*x.shape[:-1], out_features)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] @ weight.T, weight bf16 [N, K] -> fp32 [M, N] through the kernel (packing W first)."""
    if x.dtype != torch.float32 or weight.dtype != torch.bfloat16 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"bf16_linear takes fp32 x [M, K] and bf16 weight [N, K], got {x.dtype} {tuple(x.shape)} "
                         f"and {weight.dtype} {tuple(weight.shape)}")
    return packed_linear(x, pack_weight(weight), weight.shape[0])


class Bf16Linear(nn.Module):
    """nn.Linear without bias whose weight stays bf16, held in the kernel's panels; fp32 activations in and out."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed_weight", pack_weight(weight.to(torch.bfloat16).contiguous()))

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight [N, K], unpacked (a copy)."""
        p = self.packed_weight
        return p.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.out_features)
