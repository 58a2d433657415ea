"""bf16-weight linears on CPU (kernels/csrc/bf16_cpu.cpp) and their pure-torch references.

`Bf16DotLinear`, where the CPU computes bf16 natively (AVX-512 BF16): bf16 activations and weights, fp32 sums,
a bf16 result, on a layout of its own (`pack_pairs`: 16 output rows by 2 input columns per 64-byte line, each
line one `vdpbf16ps` operand as stored). Where the CPU has AMX tiles and Linux grants them to the process, the same
layout is read as TDPBF16PS B operands (16 lines a tile, kernels/csrc/amx_bf16.h) from one row of x on (`has_amx`,
`dev.set_amx` on the extension, a development-only switch). The engine runs a bf16 model's float linears through it instead of oneDNN's prepacked
GEMM: it reads the weights of a decode step closer to the memory's pace and comes within 0.9x of oneDNN on
prefill-sized batches (python benchmarks/bf16_dot.py, docs/BENCHMARKS.md).

`Bf16Linear`, for CPUs without native bf16 (AVX-512 or AVX2 + FMA):

On such a CPU the engine computes in fp32, and an unquantized lm_head held in fp32 is the largest weight
read per decoded token (131 MB for a 32000 x 1024 head). Held as the checkpoint's bf16 instead, each weight
widens to fp32 exactly inside the kernel: the result is fp32 F.linear on the widened weight (up to the
order of the sums) from half the bytes. The kernel reads the weight in panels of 16 rows laid out k-major
(`pack_weight`, done once by `Bf16Linear`), so one tile serves several rows of x and W is read once per call at
any M. `Bf16Linear` is a drop-in for nn.Linear (no bias: lm_heads have none); whether it pays was measured
(at commit e02ec4c, python -m quantkit.bench.bf16_head; docs/cpu-kernels.md), not assumed.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def bf16_dot_available() -> bool:
    """Whether `Bf16DotLinear` runs here: the extension built, with its AVX-512 BF16 kernel."""
    ext = extension()
    return ext is not None and ext.has_bf16_dot()


def bf16_dot_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x bf16 [M, K] @ weight.T (+ bias) in fp32, rounded to bf16: what the kernel computes up to the order of sums."""
    y = nn.functional.linear(x.float(), weight.float())
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] (K even) -> the kernel's blocks bf16 [ceil(N / 16), K / 2, 16, 2] (rows past N zero)."""
    if not bf16_dot_available():
        raise RuntimeError(f"the bf16 dot kernel is unavailable: {unavailable() or 'this CPU has no AVX-512 BF16'}")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack_pairs takes a bf16 weight [N, K] with K even, got {weight.dtype} {tuple(weight.shape)}")
    return extension().pack_pairs(weight.contiguous())


class Bf16DotLinear(nn.Module):
    """A drop-in for a bf16 nn.Linear on CPU: x bf16 [..., K] -> bf16 [..., N], weight packed at construction."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_pairs(linear.weight.detach().to(torch.bfloat16)))
        bias = None
        if linear.bias is not None:  # fp32, padded to the blocks, added to the fp32 sums
            bias = torch.zeros(self.packed_weight.shape[0] * 16)
            bias[: self.out_features] = linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.out_splits = (self.out_features,)  # with concat: each source linear's share of the output

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % 2 == 0

    @classmethod
    def concat(cls, linears: Sequence[nn.Linear]) -> Bf16DotLinear:
        """One linear computing `linears` (same input size) side by side; its output splits by `out_splits`."""
        from quantkit.kernels.cpu_linear import concat_linears

        fused = cls(concat_linears(linears))
        fused.out_splits = tuple(m.out_features for m in linears)
        return fused

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight [N, K], unpacked (a copy)."""
        p = self.packed_weight
        return p.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # (read directly, as PrepackedLinear does: an engine step makes 33 calls)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.bfloat16 or flat.shape[-1] != self.in_features:
            raise ValueError(f"Bf16DotLinear takes bf16 x [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        y = extension().bf16_dot_linear(flat, buffers["packed_weight"], self.out_features, buffers["bias"])
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
