"""An int8-weight linear for bf16 activations on CPU (kernels/csrc/int8_bf16_avx512.h, AVX-512 BF16), its
layout, and the pure-torch reference of that layout.

The engine holds a 4-bit checkpoint's float lm_head this way on CPU (`EngineConfig.cpu_int8_lm_head`): a
decode step reads the whole head, 32000 x 1024 here, and in bf16 it is as many bytes as all the 4-bit layers
together. Int8 halves them. The rounding is symmetric per row and group of input columns, as llama.cpp's
Q8_0: W[n, k] = q[n, k] * s[n, g], q = round(W / s) in [-127, 127], s = max |W| over the group / 127.

Layout (`Int8Blocked`), for W [N, K]:
  packed  int8 [NB, K / 2, 16, 2]   NB = ceil(N / 16) blocks of 16 output rows; for each column pair the 16
                                    rows' two codes side by side (padded rows: 0)
  scales  fp32 [NB, G, 16]          per group and row
torch's own `_weight_int8pack_mm` (per-row scales) was measured against oneDNN's prepacked bf16 on the
lm_head's shape: 1.1x at M = 1 but 0.45x at M = 8 (docs/BENCHMARKS.md), so quantkit reads its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.kernels.int4_cpu import ROWS, extension

GROUP_SIZE = 128  # input columns per scale (K itself where it does not divide K)


@dataclass
class Int8Blocked:
    packed: torch.Tensor  # int8 [NB, K / 2, 16, 2]
    scales: torch.Tensor  # fp32 [NB, G, 16]
    out_features: int
    group_size: int


def quantize_int8(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q int8 [N, K], s fp32 [N, G]): q = round(W / s) (ties to even), s = max |W| / 127 per
    row and group of `group_size` columns (a group of zeros: s = 0, q = 0)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    s = groups.abs().amax(dim=-1) / 127.0  # [N, G]
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).unsqueeze(-1)
    q = torch.round(groups * inv).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), s


def group_size_for(k: int, group_size: int = GROUP_SIZE) -> int:
    """`group_size` where it divides K, else K (one scale per row); the kernel takes column pairs, so K even."""
    return group_size if k % group_size == 0 else k


def pack_int8(w: torch.Tensor, group_size: int) -> Int8Blocked:
    """W [N, K] float (K even, `group_size` dividing K) -> Int8Blocked."""
    n, k = w.shape
    if k % 2 or k % group_size or group_size % 2:
        raise ValueError(f"int8 blocks take column pairs: K {k} and group size {group_size} must be even, "
                         "and the group size must divide K")
    q, s = quantize_int8(w, group_size)
    nb = -(-n // ROWS)
    pad = nb * ROWS - n
    q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(nb, ROWS, k // 2, 2)
    s = torch.nn.functional.pad(s, (0, 0, 0, pad)).view(nb, ROWS, k // group_size)
    return Int8Blocked(q.permute(0, 2, 1, 3).contiguous(), s.permute(0, 2, 1).contiguous(), n, group_size)


def dequantize_int8_blocked(w: Int8Blocked) -> torch.Tensor:
    """The pure-torch reader of the layout: W fp32 [N, K] = q * s."""
    nb, half_k, _, _ = w.packed.shape
    q = w.packed.permute(0, 2, 1, 3).reshape(nb * ROWS, 2 * half_k).float()  # [NB * 16, K]
    s = w.scales.permute(0, 2, 1).reshape(nb * ROWS, -1).repeat_interleave(w.group_size, dim=1)
    return (q * s)[: w.out_features]


def int8_blocked_reference(x: torch.Tensor, w: Int8Blocked) -> torch.Tensor:
    """The oracle: x [M, K] @ dequantize_int8_blocked(w).T in fp32."""
    return x.float() @ dequantize_int8_blocked(w).T


def int8_kernel_available() -> bool:
    """Whether the AVX-512 BF16 int8 kernel is built on this machine."""
    return hasattr(extension(), "int8_linear_bf16")


def int8_head_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a float lm_head cannot be held in int8 here (None: it can): the int8 kernel computes on CPU, with
    bf16 activations, where it is built (AVX-512 BF16)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"the int8 lm_head runs on CPU in bfloat16 (here: {device.type}, {dtype})"
    if not int8_kernel_available():
        return "the AVX-512 BF16 int8 kernel is not built on this machine"
    return None


class Int8Linear(nn.Module):
    """A bias-free linear for bf16 activations holding its weight as Int8Blocked: x [..., K] bf16 -> [..., N]
    bf16 (the kernel's fp32 sums rounded as it stores them). Needs `int8_kernel_available()`."""

    def __init__(self, w: Int8Blocked):
        super().__init__()
        self.in_features, self.out_features = 2 * w.packed.shape[1], w.out_features
        self.group_size = w.group_size
        self.register_buffer("packed", w.packed)
        self.register_buffer("scales", w.scales)
        self._op = extension().int8_linear_bf16

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE) -> Int8Linear:
        return cls(pack_int8(linear.weight.detach(), group_size_for(linear.in_features, group_size)))

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self._op(flat, self.packed, self.scales, self.out_features, self.group_size, True)
        return out.reshape(*x.shape[:-1], self.out_features)
