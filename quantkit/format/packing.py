"""Every on-disk bit layout in one place: pack and unpack, vectorized.

GPTQ layout (AutoGPTQ / GPTQModel / vLLM / transformers), for a linear W [N, K]:
  qweight  int32 [K / pf, N]      word r holds input rows pf*r .. pf*r+pf-1 of column n,
                                   row pf*r+j in bits bits*j .. bits*j+bits-1 (low bits first)
  qzeros   int32 [G, N / pf]       packed along N the same way
  scales   fp16  [G, N]
  g_idx    int32 [K]               group of each input row
  pf = 32 / bits (8 for 4-bit). Format "gptq" (v1) stores zero - 1 (a symmetric 4-bit
  checkpoint has every qzeros word 0x77777777); "gptq_v2" stores the zeros as they are.

AWQ GEMM layout (AutoAWQ / vLLM / transformers), 4-bit only:
  qweight  int32 [K, N / 8]       word c holds output columns 8c..8c+7 of row k; the value of
                                   column 8c + AWQ_ORDER[i] sits in bits 4i .. 4i+3
  qzeros   int32 [G, N / 8]       packed the same way, stored as they are
  scales   fp16  [G, N]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.format.primitives import QuantizedWeight, QuantScheme

Layout = Literal["gptq", "gptq_v2", "awq"]
LAYOUTS: tuple[str, ...] = ("gptq", "gptq_v2", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_factor(bits: int) -> int:
    return 32 // bits


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32-bit patterns -> int32 with the same bits (two's complement)."""
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


# codes packed per step: the words are made in slices of about this many codes, so their temporaries stay small
# whatever the weight (int64 words at once were ~24 bytes a code: 1.4 GB for an 8B down_proj; bytewise packing's are
# a byte or two a code)
PACK_STEP_CODES = 1 << 22


def _in_slices(pack_slice, codes: torch.Tensor, dim: int) -> torch.Tensor:
    """pack_slice applied to slices of `codes` [R, C] along `dim` (independent of each other), joined along it."""
    across = codes.shape[1 - dim]
    step = max(1, PACK_STEP_CODES // max(across, 1))
    if codes.shape[dim] <= step:
        return pack_slice(codes)
    return torch.cat([pack_slice(part) for part in codes.split(step, dim=dim)], dim=dim)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 0: codes [R, C] -> int32 [R / pf, C]; row pf*r+j goes to bits bits*j.. of word r."""
    return _in_slices(lambda part: _pack_rows(part, bits), codes, dim=1)


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    pf = pack_factor(bits)
    r, c = codes.shape
    if _bytewise(bits):  # [R/pf, 4, per, C] -> bytes [R/pf, 4, C] -> [R/pf, C, 4] -> one word each
        byte = _bytes(codes.to(torch.uint8).reshape(r // pf, 4, 8 // bits, c), bits, dim=2)
        return _words(byte.transpose(1, 2)).view(r // pf, c)
    shifts = (torch.arange(pf, dtype=torch.int64, device=codes.device) * bits).view(1, pf, 1)
    words = (codes.to(torch.int64).view(r // pf, pf, c) << shifts).sum(dim=1)
    return _to_int32(words)


def _bytewise(bits: int) -> bool:
    """Whether codes of `bits` pack a byte at a time: 8 / bits codes to a byte (low bits first), four bytes to a
    word as it lies in memory, which is the word's value on a little-endian CPU (every x86-64 one)."""
    return 8 % bits == 0 and sys.byteorder == "little"


def _words(byte: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] -> int32 [..., 1], each word its four bytes (copied to fresh rows: a view of bytes as words
    needs the words' own strides)."""
    return torch.empty(byte.shape, dtype=torch.uint8, device=byte.device).copy_(byte).view(torch.int32)


def _bytes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 codes with 8 / bits of them along `dim` -> one byte each, the first in the low bits; `dim` dropped."""
    parts = codes.unbind(dim)
    byte = parts[0].clone()
    for i, part in enumerate(parts[1:], start=1):
        byte.bitwise_or_(part << (bits * i))
    return byte


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_rows: int32 [R / pf, C] -> int32 codes [R, C]."""
    pf = pack_factor(bits)
    shifts = (torch.arange(pf, dtype=torch.int32, device=words.device) * bits).view(1, pf, 1)
    codes = (words.unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(-1, words.shape[1])


def pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack along dim 1: codes [R, C] -> int32 [R, C / pf].

    Without `order`, column pf*c+j goes to bits bits*j (GPTQ qzeros). With `order` (AWQ), the
    value of column pf*c + order[i] goes to bits bits*i.
    """
    return _in_slices(lambda part: _pack_cols(part, bits, order), codes, dim=0)


def _pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None) -> torch.Tensor:
    pf = pack_factor(bits)
    r, c = codes.shape
    wide = torch.uint8 if _bytewise(bits) else torch.int64
    grouped = codes.to(wide).reshape(r, c // pf, pf)
    if order is not None:
        grouped = grouped[:, :, list(order)]
    if _bytewise(bits):  # [R, C/pf, 4, per] -> bytes [R, C/pf, 4] -> one word each
        byte = _bytes(grouped.reshape(r, c // pf, 4, 8 // bits), bits, dim=3)
        return _words(byte).view(r, c // pf)
    shifts = (torch.arange(pf, dtype=torch.int64, device=codes.device) * bits).view(1, 1, pf)
    return _to_int32((grouped << shifts).sum(dim=2))


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of pack_cols: int32 [R, C / pf] -> int32 codes [R, C]."""
    pf = pack_factor(bits)
    shifts = (torch.arange(pf, dtype=torch.int32, device=words.device) * bits).view(1, 1, pf)
    grouped = (words.unsqueeze(2) >> shifts) & (2**bits - 1)  # [R, C/pf, pf], slot i
    if order is not None:
        inverse = [0] * pf
        for slot, col in enumerate(order):
            inverse[col] = slot
        grouped = grouped[:, :, inverse]
    return grouped.reshape(words.shape[0], -1)


@dataclass
class PackedLinear:
    """The tensors of one quantized linear exactly as a checkpoint stores them."""

    layout: str
    bits: int
    group_size: int  # -1: one group spanning K
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        if self.layout == "awq":
            return self.qweight.shape[0]
        return self.qweight.shape[0] * pack_factor(self.bits)

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """State-dict entries under `prefix` (e.g. 'model.layers.0.self_attn.q_proj')."""
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.qzeros": self.qzeros, f"{prefix}.scales": self.scales}
        if self.g_idx is not None:
            out[f"{prefix}.g_idx"] = self.g_idx
        if self.bias is not None:
            out[f"{prefix}.bias"] = self.bias
        return out


def packable(out_features: int, in_features: int, scheme: QuantScheme, layout: str = "gptq") -> str | None:
    """None when W [N, K] can be packed in `layout`, else the reason it cannot."""
    pf = pack_factor(scheme.bits)
    g = scheme.group_len(in_features)
    if in_features % g:
        return f"in_features {in_features} is not a multiple of the group size {g}"
    if in_features % pf:
        return f"in_features {in_features} is not a multiple of {pf}"
    if out_features % pf:
        return f"out_features {out_features} is not a multiple of {pf}"
    if layout == "awq" and scheme.bits != 4:
        return "the AWQ layout holds 4-bit weights only"
    return None


def pack(qw: QuantizedWeight, layout: str, bias: torch.Tensor | None = None) -> PackedLinear:
    """Pack a QuantizedWeight into a checkpoint layout."""
    bits = qw.scheme.bits
    zeros = qw.zeros.round().to(torch.int64)  # [G, N]
    scales = qw.scales.to(torch.float16)
    if layout == "awq":
        if qw.act_order:
            raise ValueError("the AWQ layout has no g_idx, so act-order weights cannot be written to it")
        return PackedLinear(
            layout, bits, qw.scheme.group_size,
            qweight=pack_cols(qw.qweight.T.contiguous(), bits, AWQ_ORDER),  # codes [K, N] packed along N
            qzeros=pack_cols(zeros, bits, AWQ_ORDER),
            scales=scales, g_idx=None, bias=bias,
        )
    if layout == "gptq":
        if (zeros == 0).any():
            raise ValueError("a zero point of 0 cannot be stored in GPTQ v1 (zero - 1 underflows); use gptq_v2")
        zeros = zeros - 1
    elif layout != "gptq_v2":
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return PackedLinear(
        layout, bits, qw.scheme.group_size,
        qweight=pack_cols(qw.qweight, bits).T.contiguous(),  # pack_rows of codes [K, N]: words, not bytes, transposed
        qzeros=pack_cols(zeros, bits),
        scales=scales, g_idx=qw.g_idx.to(torch.int32), bias=bias,
    )


def unpack(p: PackedLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [K, N] int32, zeros [G, N] int32 (true zero points), scales [G, N] fp16, g_idx [K] int64."""
    if p.layout == "awq":
        codes = unpack_cols(p.qweight, p.bits, AWQ_ORDER)
        zeros = unpack_cols(p.qzeros, p.bits, AWQ_ORDER)
    else:
        codes = unpack_rows(p.qweight, p.bits)
        zeros = unpack_cols(p.qzeros, p.bits)
        if p.layout == "gptq":
            zeros = zeros + 1
    k = codes.shape[0]
    if p.g_idx is not None:
        g_idx = p.g_idx.long()
    else:
        g = k if p.group_size == -1 else p.group_size
        g_idx = torch.arange(k, device=codes.device) // g
    return codes, zeros, p.scales, g_idx


def dequantize(p: PackedLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_hat [N, K] in `dtype`, computed in fp32 (the dense weight a float linear would hold)."""
    codes, zeros, scales, g_idx = unpack(p)
    w_kn = scales.float()[g_idx] * (codes.float() - zeros.float()[g_idx])  # [K, N]
    return w_kn.T.contiguous().to(dtype)


def to_quantized_weight(p: PackedLinear) -> QuantizedWeight:
    """Back to the in-memory form (codes [N, K]); used for re-packing into another layout."""
    codes, zeros, scales, g_idx = unpack(p)
    scheme = QuantScheme(bits=p.bits, group_size=p.group_size, sym=False)
    return QuantizedWeight(codes.T.contiguous(), scales.float(), zeros.float(), g_idx.to(torch.int32), scheme)


def check_shapes(p: PackedLinear, out_features: int, in_features: int) -> None:
    """ValueError naming the tensor when `p` does not hold a [out_features, in_features] weight in its
    layout, bits and group size (a config that disagrees with the tensors)."""
    n, k, pf = out_features, in_features, pack_factor(p.bits)
    g = k if p.group_size == -1 else p.group_size
    groups = -(-k // g)
    qweight = (k, n // pf) if p.layout == "awq" else (k // pf, n)
    expect = {"qweight": qweight, "scales": (groups, n), "qzeros": (groups, n // pf)}
    for name, shape in expect.items():
        t = getattr(p, name)
        if t is None:
            raise ValueError(f"{name} is missing")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} is {list(t.shape)}, but a {p.bits}-bit [{n}, {k}] weight at group size "
                             f"{p.group_size} in the {p.layout} layout has {list(shape)}")
    if p.g_idx is not None and (p.g_idx.numel() != k or int(p.g_idx.min()) < 0 or int(p.g_idx.max()) >= groups):
        raise ValueError(f"g_idx has {p.g_idx.numel()} entries up to {int(p.g_idx.max())}; expected {k} below {groups}")
