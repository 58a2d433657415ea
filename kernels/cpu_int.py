"""Quantized linears on CPU that stay quantized: torch's CPU int4 and int8 kernels, the repacking
into their layouts, and a pure-torch dequantizer of the same layout (the large-M path and the oracle).

int4 (`torch.ops.aten._convert_weight_to_int4pack_for_cpu` / `_weight_int4pack_mm_for_cpu`):
  packed        uint8 [N, K / 2]       torch's CPU layout: blocks of 16 output rows; in block b,
                                       byte k * 8 + j holds row 16b + 2j (low nibble) and 16b + 2j + 1
                                       (high nibble) of input column k
  scales_zeros  [K / g, N, 2]          (scale, zero): W = (q - 8) * scale + zero, so a checkpoint's
                                       integer zero point z becomes the float zero (8 - z) * scale
  perm          int64 [K] or None      act-order: input columns sorted by group, applied once to W
                                       and to x on every call
int8 (`torch.ops.aten._weight_int8pack_mm`), per output channel only:
  weight        int8 [N, K]            q - z
  scales        [N]
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from quantkit.format.packing import PackedLinear, unpack

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16  # the CPU int4 layout packs output rows in blocks of 16


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], torch's CPU int4 layout
    scales_zeros: torch.Tensor  # [K / g, N, 2] in the activation dtype
    group_size: int
    perm: torch.Tensor | None  # int64 [K]


@dataclass
class Int8Weight:
    weight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N] in the activation dtype


def _group_len(p: PackedLinear, k: int) -> int:
    return k if p.group_size == -1 else p.group_size


def int4_unsupported(p: PackedLinear) -> str | None:
    """None when torch's CPU int4 kernel can run `p`, else why not."""
    if p.bits != 4:
        return f"{p.bits}-bit weights"
    g = _group_len(p, p.in_features)
    if g not in INT4_GROUP_SIZES:
        return f"group size {g} (the CPU int4 kernel takes {', '.join(map(str, INT4_GROUP_SIZES))})"
    if p.out_features % INT4_N_MULTIPLE:
        return f"out_features {p.out_features} is not a multiple of {INT4_N_MULTIPLE}"
    return None


def group_order(codes: torch.Tensor, g_idx: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """codes [K, N]; the input columns in group order, and the permutation (None when already in order)."""
    k = codes.shape[0]
    in_order = torch.arange(k) // g
    if torch.equal(g_idx, in_order):
        return codes, None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise ValueError("g_idx does not give every group exactly group_size input columns")
    return codes[perm], perm


def repack_int4(p: PackedLinear, dtype: torch.dtype) -> Int4Weight:
    """A GPTQ (v1/v2, act-order) or AWQ PackedLinear -> torch's CPU int4 layout."""
    reason = int4_unsupported(p)
    if reason:
        raise ValueError(f"cannot repack for the CPU int4 kernel: {reason}")
    codes, zeros, scales, g_idx = unpack(p)  # [K, N], [G, N], [G, N], [K]
    g = _group_len(p, codes.shape[0])
    codes, perm = group_order(codes, g_idx, g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.T.contiguous(), 1)
    s = scales.float()
    sz = torch.stack((s, (8 - zeros.float()) * s), dim=-1)  # [G, N, 2]
    return Int4Weight(packed, sz.to(dtype).contiguous(), g, perm)


def repack_int8(p: PackedLinear, dtype: torch.dtype) -> Int8Weight:
    """A per-channel 8-bit PackedLinear -> int8 (q - z) and per-channel scales."""
    if p.bits != 8 or (p.group_size != -1 and p.group_size < p.in_features):
        raise ValueError("the CPU int8 kernel takes per-channel 8-bit weights only")
    codes, zeros, scales, _ = unpack(p)  # [K, N], [1, N], [1, N]
    w = codes - zeros  # [K, N]
    if w.min() < -128 or w.max() > 127:
        raise ValueError("q - zero does not fit in int8")
    return Int8Weight(w.T.contiguous().to(torch.int8), scales[0].to(dtype).contiguous())


def _unpack_blocks(packed: torch.Tensor, rows: int, paired: bool) -> torch.Tensor:
    """uint8 [R, K / 2] of blocks of `rows` output rows -> codes [R, K]. Byte j of column k holds
    rows 2j (low nibble) and 2j + 1 (high) when `paired`, else rows j and rows / 2 + j."""
    r, k = packed.shape[0], packed.shape[1] * 2
    b = packed.reshape(r // rows, k, rows // 2)
    nibbles = torch.stack((b & 15, b >> 4), dim=3 if paired else 2)  # [R / rows, K, ...]
    return nibbles.permute(0, 2, 3, 1).reshape(r, k)


@functools.cache
def _block_rows() -> int:
    """Rows per block of torch's CPU int4 packing on this machine: 64 with its AVX-512 kernels, else 32."""
    codes = torch.zeros(64, 64, dtype=torch.int32)
    codes[32, 0] = 15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return 64 if int(packed[0, 0]) == 0xF0 else 32


def unpack_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 layout uint8 [N, K / 2] -> codes uint8 [N, K] (pure torch).

    Output rows go in blocks of 64 where torch runs its AVX-512 kernels (else 32), each byte holding
    rows j and j + 32 (16); the rows past the last full block form one block of byte-paired rows.
    """
    rows = _block_rows()
    m = packed.shape[0] // rows * rows
    head = _unpack_blocks(packed[:m], rows, paired=False)
    if m == packed.shape[0]:
        return head
    tail = _unpack_blocks(packed[m:], packed.shape[0] - m, paired=True)
    return torch.cat((head, tail))


def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` from the CPU int4 layout (columns in the permuted order when act-order)."""
    codes = unpack_int4pack(w.packed)
    n, k = codes.shape
    sz = w.scales_zeros.to(dtype)  # [G, N, 2]
    q = codes.view(n, k // w.group_size, w.group_size).to(dtype) - 8
    out = q * sz[..., 0].T.unsqueeze(-1) + sz[..., 1].T.unsqueeze(-1)
    return out.view(n, k)


@functools.cache
def _layout_matches(rows: int) -> bool:
    codes = torch.randint(0, 16, (rows, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return torch.equal(unpack_int4pack(packed).to(torch.int32), codes)


def layout_matches(n: int) -> bool:
    """Whether this torch packs N rows the way unpack_int4pack reads them (probed once per process)."""
    return _layout_matches(n % _block_rows() + _block_rows())  # a full block and this N's tail


def best_ms(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


CROSSOVER_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@functools.cache
def int4_kernel_max_m(n: int, k: int, group_size: int, dtype: torch.dtype) -> int:
    """The largest M (of CROSSOVER_MS) at which torch's int4 kernel beats dequantize-then-matmul on
    this CPU for an [N, K] weight, measured once per shape and dtype in this process (0: never).
    Stops at the first M where the dense path wins (the kernel's cost grows faster with M)."""
    if not layout_matches(n):
        return max(CROSSOVER_MS)
    g = torch.Generator().manual_seed(0)
    w = Int4Weight(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1),
        torch.rand(k // group_size, n, 2, generator=g).to(dtype), group_size, None)
    best = 0
    for m in CROSSOVER_MS:
        x = torch.randn(m, k, generator=g).to(dtype)
        kernel = best_ms(lambda: int4_linear(x, w, None, kernel_max_m=m))
        dense = best_ms(lambda: int4_linear(x, w, None, kernel_max_m=0))
        if kernel > dense:
            break
        best = m
    return best


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, kernel_max_m: int) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype.

    M <= kernel_max_m: torch's int4 kernel on the packed weight. Larger M (prefill chunks): the
    weight is dequantized for this call only and multiplied densely, when that layout is readable.
    """
    # torch's int4 and int8 kernels read x as a dense row-major [M, K]: a strided view (a slice of a
    # fused projection, a transposed activation) must be made contiguous first.
    x = x.index_select(1, w.perm) if w.perm is not None else x.contiguous()
    if x.shape[0] <= kernel_max_m or not layout_matches(w.packed.shape[0]):
        sz = w.scales_zeros if w.scales_zeros.dtype == x.dtype else w.scales_zeros.to(x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size, sz)
    else:
        out = torch.nn.functional.linear(x, dequantize_int4(w, x.dtype))
    return out if bias is None else out + bias


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    scales = w.scales if w.scales.dtype == x.dtype else w.scales.to(x.dtype)
    out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), w.weight, scales)
    return out if bias is None else out + bias


def quant_linear_reference(x: torch.Tensor, p: PackedLinear) -> torch.Tensor:
    """The oracle: x [M, K] @ dequantize(p).T (+ bias), computed in fp32, returned in x's dtype."""
    from quantkit.format.packing import dequantize

    out = x.float() @ dequantize(p, torch.float32).T
    if p.bias is not None:
        out = out + p.bias.float()
    return out.to(x.dtype)
