"""An int8-weight linear on CPU, for bf16 activations (kernels/csrc/int8_bf16_avx512.h, AVX-512 VNNI) and for fp32
ones (kernels/csrc/int8_f32_avx2.h, AVX2 + FMA), its layout, and the pure-torch reference of both.

The engine holds a 4-bit checkpoint's float lm_head this way on CPU (`EngineConfig.cpu_int8_lm_head`): a
decode step reads the whole head, 32000 x 1024 here, and in bf16 it is as many bytes as all the 4-bit layers
together; at Llama 3's vocabulary (128256) and hidden 2048 it is 1 GiB in fp32, twice the 4-bit layers. Int8 halves
the bf16 bytes and quarters the fp32 ones. The rounding is symmetric per row and group of input columns, as
llama.cpp's Q8_0: W[n, k] = q[n, k] * s[n, g], q = round(W / s) in [-127, 127], s = max |W| over the group / 127.

Layout (`Int8Blocked`), for W [N, K]:
  packed  int8  [NB, K / 4, 16, 4]   NB = ceil(N / 16) blocks of 16 output rows; for each 4 input columns the
                                     16 rows' four codes side by side (padded rows: 0)
  scales  fp32  [NB, G, 16]          per group and row
  wsum    int32 [NB, G, 16]          per group and row, the sum of its codes
Both kernels multiply the codes by x written as 16-bit fixed point per row and group
(`quantize_activations16_reference`): the bf16 one by two vpdpbusd (one per byte of x, no weight converted), the
fp32 one by vpmaddwd on the codes widened to 16 bits; their integer sums are exact, so they give the same bits. On
CPUs with AMX tiles, from 8 rows, the same codes are TDPBUSD B tiles as stored (kernels/csrc/int8_amx.h): the same
integer sums, so the same bits. torch's own `_weight_int8pack_mm` (per-row scales) was measured against oneDNN's prepacked bf16 on the lm_head's shape: ahead at M = 1, well
behind at M = 8 (docs/cpu-kernels.md has the figures), so quantkit reads its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.kernels.int4_cpu import ROWS, extension, quantize_activations_reference

GROUP_SIZE = 128  # input columns per scale: at most this (the kernel's int32 sums), a multiple of 4 dividing K


@dataclass
class Int8Blocked:
    packed: torch.Tensor  # int8 [NB, K / 4, 16, 4]
    scales: torch.Tensor  # fp32 [NB, G, 16]
    wsum: torch.Tensor  # int32 [NB, G, 16]
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


def group_size_for(k: int, group_size: int = GROUP_SIZE) -> int | None:
    """The largest multiple of 4 that divides K and is at most `group_size` (None: K is not a multiple of 4)."""
    return next((g for g in range(group_size - group_size % 4, 0, -4) if k % g == 0), None)


def pack_int8(w: torch.Tensor, group_size: int) -> Int8Blocked:
    """W [N, K] float (`group_size` a multiple of 4 dividing K, at most GROUP_SIZE) -> Int8Blocked."""
    n, k = w.shape
    if group_size % 4 or k % group_size or group_size > GROUP_SIZE:
        raise ValueError(f"int8 blocks take columns in fours: the group size ({group_size}) must be a multiple of 4, "
                         f"at most {GROUP_SIZE}, and divide K ({k})")
    q, s = quantize_int8(w, group_size)
    nb, groups = -(-n // ROWS), k // group_size
    pad = nb * ROWS - n
    wsum = q.to(torch.int32).reshape(n, groups, group_size).sum(-1, dtype=torch.int32)  # [N, G]
    q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(nb, ROWS, k // 4, 4)
    per_group = [torch.nn.functional.pad(t, (0, 0, 0, pad)).view(nb, ROWS, groups).permute(0, 2, 1).contiguous()
                 for t in (s, wsum)]
    return Int8Blocked(q.permute(0, 2, 1, 3).contiguous(), *per_group, n, group_size)


def dequantize_int8_blocked(w: Int8Blocked) -> torch.Tensor:
    """The pure-torch reader of the layout: W fp32 [N, K] = q * s."""
    nb, quads, _, _ = w.packed.shape
    q = w.packed.permute(0, 2, 1, 3).reshape(nb * ROWS, 4 * quads).float()  # [NB * 16, K]
    s = w.scales.permute(0, 2, 1).reshape(nb * ROWS, -1).repeat_interleave(w.group_size, dim=1)
    return (q * s)[: w.out_features]


def quantize_activations16_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies: x [M, K] per row and group as xq = round(x * 32767 / amax), scale amax / 32767
    (quantize_activations_reference at 16 bits)."""
    return quantize_activations_reference(x, group_size, 32767)


def int8_blocked_reference(x: torch.Tensor, w: Int8Blocked) -> torch.Tensor:
    """The oracle: x [M, K] rounded as quantize_activations16_reference, @ dequantize_int8_blocked(w).T in fp32."""
    xq, scale = quantize_activations16_reference(x, w.group_size)
    m, k = x.shape
    xd = (xq.reshape(m, k // w.group_size, w.group_size) * scale.unsqueeze(-1)).reshape(m, k)
    return xd @ dequantize_int8_blocked(w).T


def int8_kernel_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the int8 kernel for activations of `dtype` is built on this machine: bf16 where the extension targets
    AVX-512 VNNI and BF16, fp32 at every level it builds for (AVX2 + FMA and up)."""
    return hasattr(extension(), _KERNELS.get(dtype, ""))


_KERNELS = {torch.bfloat16: "int8_linear_bf16", torch.float32: "int8_linear_f32"}  # activation dtype -> the op
_NEEDS = {torch.bfloat16: "AVX-512 VNNI and BF16", torch.float32: "AVX2 and FMA"}


def int8_head_unavailable(device: torch.device, dtype: torch.dtype, in_features: int | None = None) -> str | None:
    """Why a float lm_head cannot be held in int8 here (None: it can): the int8 kernels compute on CPU, with bf16
    or fp32 activations, where they are built (bf16: AVX-512 VNNI and BF16; fp32: AVX2 and FMA), over an input
    size that is a multiple of 4."""
    if device.type != "cpu" or dtype not in _KERNELS:
        return f"the int8 lm_head runs on CPU in bfloat16 or float32 (here: {device.type}, {dtype})"
    if not int8_kernel_available(dtype):
        return f"the int8 kernel for {str(dtype).removeprefix('torch.')} activations ({_NEEDS[dtype]}) is not " \
               "built on this machine"
    if in_features is not None and group_size_for(in_features) is None:
        return f"the int8 kernel takes input columns in fours (hidden size {in_features})"
    return None


class Int8Linear(nn.Module):
    """A bias-free linear holding its weight as Int8Blocked: x [..., K] bf16 -> [..., N] bf16 (the kernel's fp32
    sums rounded as it stores them; with `fp32_out`, fp32: the sums as they are), or fp32 -> fp32. Needs
    `int8_kernel_available(x.dtype)`."""

    def __init__(self, w: Int8Blocked, fp32_out: bool = False):
        super().__init__()
        self.out_features = w.out_features
        self.in_features = 4 * w.packed.shape[1]
        self.group_size = w.group_size
        self.fp32_out = fp32_out
        self.register_buffer("packed", w.packed)
        self.register_buffer("scales", w.scales)
        self.register_buffer("wsum", w.wsum)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, fp32_out: bool = False) -> Int8Linear:
        g = group_size_for(linear.in_features, group_size)
        if g is None:
            raise ValueError(f"int8 blocks take columns in fours: in_features {linear.in_features} is not a multiple of 4")
        return cls(pack_int8(linear.weight.detach(), g), fp32_out)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.wsum))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype == torch.float32:
            out = extension().int8_linear_f32(flat, self.packed, self.scales, self.out_features, self.group_size)
        else:
            out = extension().int8_linear_bf16(flat.to(torch.bfloat16), self.packed, self.scales, self.wsum,
                                               self.out_features, self.group_size, not self.fp32_out)
        return out.reshape(*x.shape[:-1], self.out_features)
