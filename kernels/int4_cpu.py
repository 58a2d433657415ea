"""quantkit's own 4-bit CPU linear (kernels/csrc/int4_cpu.cpp, AVX2 + FMA; for bf16 activations on CPUs
with AVX-512 BF16, kernels/csrc/int4_bf16_avx512.h, and from 2 rows on CPUs with AMX tiles,
kernels/csrc/int4_amx.h), its packed layout, and the pure-torch reference of that layout.

torch's `_weight_int4pack_mm_for_cpu` has no fast path without AVX-512 (slower than fp32 dense at M = 1 on
this project's AVX2 CPU); this kernel reads the 4-bit weight directly with fp32 activations (docs/cpu-kernels.md
has the figures).

Layout (`Int4Blocked`), for a weight W [N, K] with groups of `group_size` input columns:
  packed      uint8 [NB, K, 8]          NB = ceil(N / 16) blocks of 16 output rows; byte (b, k, j)
                                        holds row 16b + j (low nibble) and 16b + 8 + j (high nibble)
  scale_zero  fp16  [NB, G, 2, 16]      per group and row: scale s, then the zero point z; padded
                                        rows are 0 (fp32 when a scale is not exact in fp16)
  perm        int64 [K] or None         act-order: input columns sorted by group; x is permuted once
                                        per call, W once at repack
W[n, k] = (q - z) * s, exactly as the checkpoint dequantizes. Every 4-bit GPTQ (v1/v2, act-order), AWQ and compressed-tensors
PackedLinear repacks into it, for any N and any group size that divides K.

Large M (prefill chunks): the kernel unpacks the weight once per 4 rows of x, so past a crossover
measured on this CPU (DENSE_FROM_M) it is cheaper to dequantize a tile of rows and multiply densely.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from quantkit.format.packing import PackedLinear, unpack
from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension
from quantkit.kernels.cpu_int import group_order

EXTENSION = "quantkit_int4"
SOURCES = ("int4_cpu.cpp", "moe_int4_cpu.cpp")  # one module; the experts' op: moe_int4.py
ROWS = 16  # output rows per block
# From M = DENSE_FROM_M on, dequantize-a-tile-then-matmul beats the kernel (python
# benchmarks/int4_cpu.py on this project's CPU, 2 threads, the four shapes; docs/BENCHMARKS.md).
DENSE_FROM_M = 512
# bf16 activations on a CPU whose oneDNN computes bf16 natively (AVX-512 BF16 / AMX): the dense path
# is a bf16 GEMM on the dequantized tile, ahead of the AVX2 kernel from M = 64 (behind at 32), and of
# the AVX-512 BF16 kernel from M = 192 (behind at 128), on the four shapes measured (benchmarks/int4_cpu.py;
# docs/cpu-kernels.md).
DENSE_FROM_M_BF16 = 48
# With the AVX-512 BF16 kernel, the dense path dequantizes into the bf16 kernel's layout and runs it: the two cross at
# 128-160 rows over the benchmark model's linears (measured at commit e02ec4c, python -m quantkit.bench.int4_tiles; docs/cpu-kernels.md).
DENSE_FROM_M_BF16_KERNEL = 160
# With AMX tiles (kernels/csrc/int4_amx.h), the kernel's exact per-group sums lose to the dense path's single pass over
# bf16 tiles (bf16_dot_linear on AMX too) at a few hundred rows, later at the 1B shape than at the 8B: one layer's four
# linears, dense / kernel time at 256, 512, 768, 1024 rows 1.28x, 1.15x, 1.16x, 0.82x at the Llama-3.2-1B shape and
# 1.25x, 0.90x, 0.90x, 0.86x at the Llama-3.1-8B shape (an earlier run: 1.09x at 512, 0.88x at 768) (python
# benchmarks/amx_dense_crossover.py --shape 1b|8b, Xeon AMX, 2 threads, 2026-12-07; docs/BENCHMARKS.md "Where prefill
# chunks go dense on AMX"). (The 90M test model's linears, hidden 1024, crossed at 256: commit e02ec4c.)
DENSE_FROM_M_AMX = 640
# With int8 activations asked (W4A8) and no AMX, the VNNI kernel's 64 multiply-adds an instruction stay ahead of the
# dense tiles' bf16 GEMM at every M: 310-385 against 186-219 GMAC/s from M = 64 to 2048 on Llama-3.2-1B's linears
# (python benchmarks/int4_cpu.py --dtype bfloat16 --shapes 16384x2048,2048x8192,3072x2048 --ms 64,160,512,2048,
# EPYC BF16; docs/BENCHMARKS.md), so its direct call takes prefill chunks too. With AMX the VNNI kernel hands large M
# to the dense tiles (DENSE_FROM_M_AMX; it is not measured against them).
NEVER_DENSE = 1 << 62
# fp32 activations with int8 activations asked (the AVX2 W4A8 kernel, kernels/csrc/int4_q8_avx2.h): ahead of the fp32
# kernel and of the fp32 dense tiles at every M, 1.19-2.92x the faster of the two from M = 1 to 2048 on Llama-3.2-1B's
# linears (python benchmarks/int4_cpu.py --shapes 16384x2048,2048x8192,3072x2048 --ms 1,8,64,256,512,2048, EPYC
# AVX2; docs/BENCHMARKS.md), so its direct call takes prefill chunks too.
DENSE_FROM_M_Q8_AVX2 = NEVER_DENSE
# W4A8 on AMX-INT8 tiles (kernels/csrc/int4_q8_amx.h) against the dense bf16 tiles, same runs: dense / kernel time
# at 256, 512, 768, 1024, 1536, 2048 rows 1.46x, 1.39x, 1.34x, 0.98x, 1.01x, 0.74x at the 1B shape; 2.04x, 1.35x,
# 1.19x, 1.20x, 1.09x (to 1536) at the 8B shape.
DENSE_FROM_M_Q8_AMX = 1280
DENSE_TILE_ROWS = 1024  # rows of W dequantized at once on the large-M path (bounds the fp32 copy)


@dataclass
class Int4Blocked:
    packed: torch.Tensor  # uint8 [NB, K, 8]
    scale_zero: torch.Tensor  # fp16 (or fp32) [NB, G, 2, 16]
    out_features: int
    group_size: int  # columns per group (K for one group per row)
    perm: torch.Tensor | None  # int64 [K]


def extension():
    """The compiled kernel module, or None (then `unavailable()` says why)."""
    return load_cpu_extension(EXTENSION, SOURCES)


def unavailable() -> str | None:
    """None when the kernel builds and loads on this machine, else the reason."""
    return None if extension() is not None else cpu_extension_unavailable(EXTENSION)


def pack_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15), scales and zeros [G, N] -> (packed uint8 [NB, K, 8], scale_zero [NB, G, 2, 16])."""
    n, k = codes.shape
    nb = -(-n // ROWS)
    pad = nb * ROWS - n
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad)).view(nb, 2, 8, k)  # [NB, hi/lo, j, K]
    packed = (c[:, 0] | (c[:, 1] << 4)).transpose(1, 2).contiguous()  # [NB, K, 8]
    s = scales.float()
    exact = torch.equal(s.half().float(), s)  # fp16 checkpoints' scales always are
    sz = torch.stack((s, zeros.float())).to(torch.float16 if exact else torch.float32)  # [2, G, N]
    sz = torch.nn.functional.pad(sz, (0, pad)).view(2, k // group_size, nb, ROWS)
    return packed, sz.permute(2, 1, 0, 3).contiguous()


def repack(p: PackedLinear) -> Int4Blocked:
    """A 4-bit PackedLinear (GPTQ v1/v2 incl. act-order, AWQ, compressed-tensors) -> Int4Blocked."""
    if p.bits != 4:
        raise ValueError(f"the int4 CPU kernel takes 4-bit weights, not {p.bits}-bit")
    codes, zeros, scales, g_idx = unpack(p)  # [K, N], [G, N], [G, N], [K]
    k = codes.shape[0]
    g = k if p.group_size == -1 else p.group_size
    codes, perm = group_order(codes, g_idx, g)
    packed, sz = pack_blocks(codes.T, scales, zeros, g)
    return Int4Blocked(packed, sz, p.out_features, g, perm)


def concat_blocked(parts: list[Int4Blocked]) -> Int4Blocked | None:
    """`parts` side by side along N (q/k/v or gate/up of one layer as one call), or None where they cannot
    share one layout: a part whose rows do not fill its last block of 16, or different input sizes, group
    sizes, scale dtypes or act-order permutations."""
    first = parts[0]
    if any(p.out_features % ROWS for p in parts) \
            or len({(p.packed.shape[1], p.group_size, p.scale_zero.dtype, p.perm is None) for p in parts}) != 1 \
            or (first.perm is not None and not all(torch.equal(first.perm, p.perm) for p in parts[1:])):
        return None
    return Int4Blocked(torch.cat([p.packed for p in parts]), torch.cat([p.scale_zero for p in parts]),
                       sum(p.out_features for p in parts), first.group_size, first.perm)


@dataclass(frozen=True)
class DirectCall:
    """What a forward on `w` with activations of `dtype` calls when it goes straight to a kernel: below `max_m` rows,
    no act-order permutation (no Python between the module and the kernel). `op` is, for bf16, the AVX-512 BF16
    kernel, or with `int8_activations` the AVX-512 VNNI one, which rounds x to int8 per row and group first (W4A8);
    for fp32, the AVX2 kernel, or the AVX2 int8-activation one (W4A8)."""

    op: object
    packed: torch.Tensor
    scale_zero: torch.Tensor
    out_features: int
    group_size: int
    max_m: int
    int8_activations: bool = False
    dtype: torch.dtype = torch.bfloat16
    tail: tuple = ()  # the op's arguments after the group size (bf16: round the fp32 sums to bf16 as it stores)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed, self.scale_zero, self.out_features, self.group_size, *self.tail)

    def on(self, w: Int4Blocked) -> DirectCall:
        """The same call (kernel, crossover) on another weight of the same layout: a fused or stacked one."""
        return replace(self, packed=w.packed, scale_zero=w.scale_zero, out_features=w.out_features,
                       group_size=w.group_size)


# (kind, activations) -> the extension's op that a module calls directly (kernels/linear_choice.py's `direct`)
_DIRECT_OPS = {("q8", torch.bfloat16): "int4_linear_q8", ("bf16", torch.bfloat16): "int4_linear_bf16",
               ("q8", torch.float32): "int4_linear_q8_f32", ("f32", torch.float32): "int4_linear"}


def direct_op(kind: str, dtype: torch.dtype) -> str | None:
    """The extension's op that `dtype` activations reach straight from the module for the `kind` kernel ("q8",
    "bf16", "f32"); None where that kernel takes no such activations."""
    return _DIRECT_OPS.get((kind, dtype))


def direct_call(w: Int4Blocked, kind: str, max_m: int, dtype: torch.dtype = torch.bfloat16) -> DirectCall:
    """The call a forward on `w` with `dtype` activations makes below `max_m` rows (the kernel's row of
    kernels/linear_choice.py): `kind` "q8" runs an int8-activation kernel (AVX-512 VNNI for bf16, AVX2 for fp32),
    "bf16" the AVX-512 BF16 one, "f32" the AVX2 one."""
    op = getattr(extension(), _DIRECT_OPS[kind, dtype])
    return DirectCall(op, w.packed, w.scale_zero, w.out_features, w.group_size, max_m, kind == "q8", dtype,
                      (True,) if dtype == torch.bfloat16 else ())


def dequantize_blocked(w: Int4Blocked) -> torch.Tensor:
    """The pure-torch reader of the layout: W fp32 [N, K] (columns in the permuted order when act-order)."""
    nb, k, _ = w.packed.shape
    codes = torch.stack((w.packed & 15, w.packed >> 4), dim=1)  # [NB, 2, K, 8]
    codes = codes.permute(0, 1, 3, 2).reshape(nb * ROWS, k).float()  # [NB * 16, K]
    sz = w.scale_zero.float().permute(2, 0, 3, 1).reshape(2, nb * ROWS, -1)  # [2, NB * 16, G]
    s, z = (t.repeat_interleave(w.group_size, dim=1) for t in sz)
    return ((codes - z) * s)[: w.out_features]


def int4_blocked_reference(x: torch.Tensor, w: Int4Blocked, bias: torch.Tensor | None) -> torch.Tensor:
    """The oracle: x [M, K] @ dequantize_blocked(w).T (+ bias), in fp32, returned in x's dtype."""
    xf = x.float() if w.perm is None else x.float().index_select(1, w.perm)
    out = xf @ dequantize_blocked(w).T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def quantize_activations_reference(x: torch.Tensor, group_size: int, qmax: int = 127
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8-activation kernel multiplies (qmax 127; the int8-weight kernel's 16-bit x: 32767): x [M, K]
    per row and group of `group_size` columns as xq = round(x * qmax / amax) (ties to even) and scale amax / qmax
    (amax = max |x| of the group; a group of zeros gives codes 0 and scale 0). Returns xq [M, K] (integers in
    [-qmax, qmax], fp32) and scale [M, G] fp32."""
    m, k = x.shape
    groups = x.float().reshape(m, k // group_size, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # a true division, as the kernel's (torch computes q / t as t.reciprocal() * q, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, float(qmax)) / amax, torch.zeros_like(amax))
    return torch.round(groups * inv).clamp(-qmax, qmax).reshape(m, k), (amax / float(qmax)).squeeze(-1)


def _rounded_x_reference(x: torch.Tensor, w: Int4Blocked, qmax: int) -> torch.Tensor:
    xq, scale = quantize_activations_reference(x, w.group_size, qmax)
    m, k = x.shape
    xd = (xq.reshape(m, k // w.group_size, w.group_size) * scale.unsqueeze(-1)).reshape(m, k)
    return xd @ dequantize_blocked(w).T


def int4_q8_reference(x: torch.Tensor, w: Int4Blocked) -> torch.Tensor:
    """The oracle of the int8-activation kernel: x rounded as quantize_activations_reference, then
    @ dequantize_blocked(w).T in fp32. x [M, K] is in the packed column order (act-order permuted)."""
    return _rounded_x_reference(x, w, 127)


def int4_x16_reference(x: torch.Tensor, w: Int4Blocked) -> torch.Tensor:
    """The oracle of the fp32 kernel's decode-sized tiles (kernels/csrc/int4_x16_avx2.h): x rounded to 16-bit fixed
    point per row and group (quantize_activations_reference with qmax 32767), then @ dequantize_blocked(w).T in fp32.
    x [M, K] is in the packed column order (act-order permuted)."""
    return _rounded_x_reference(x, w, 32767)


def x16_tiles_take(w: Int4Blocked, m: int = 1) -> bool:
    """Whether the fp32 kernel runs `m` rows of x against `w` on its 16-bit fixed-point tiles (kernels/csrc/
    int4_x16_avx2.h: below 4 rows, groups in fours of at most 4096 columns), as its dispatch decides it."""
    ext = extension()
    return ext is not None and bool(ext.int4_x16_takes(m, w.group_size))


def int4_linear_reference(x: torch.Tensor, w: Int4Blocked, bias: torch.Tensor | None) -> torch.Tensor:
    """The oracle of the fp32 kernel (`int4_linear`) on x [M, K] in the checkpoint's column order: int4_x16_reference
    where it runs the 16-bit fixed-point tiles, else int4_blocked_reference."""
    if x16_tiles_take(w, x.shape[0]):
        out = int4_x16_reference(x.float() if w.perm is None else x.float().index_select(1, w.perm), w)
        return (out if bias is None else out + bias.float()).to(x.dtype)
    return int4_blocked_reference(x, w, bias)


def q8_kernel(w: Int4Blocked) -> bool:
    """Whether the int8-activation (AVX-512 VNNI) kernel takes w: built here, and groups in fours."""
    return hasattr(extension(), "int4_linear_q8") and w.group_size % 4 == 0


def q8_amx_kernel(w: Int4Blocked) -> bool:
    """Whether the int8-activation kernel runs `w` on AMX-INT8 tiles (kernels/csrc/int4_q8_amx.h), as its dispatch
    decides it (`int4_q8_amx_takes`: built for a CPU with AMX, the tile state granted, groups of whole 64-column tile
    steps)."""
    ext = extension()
    return q8_kernel(w) and hasattr(ext, "int4_q8_amx_takes") and ext.int4_q8_amx_takes(w.group_size)


def dense_threshold(dtype: torch.dtype, bf16_kernel: bool = False, amx: bool = False) -> int:
    """The M from which `int4_blocked_linear` dequantizes tiles instead of running a kernel (`bf16_kernel`:
    bf16 activations run the AVX-512 BF16 kernel; `amx`: from a few rows on AMX tiles, `amx_kernel`)."""
    if dtype == torch.bfloat16 and bf16_kernel:
        return DENSE_FROM_M_AMX if amx else DENSE_FROM_M_BF16_KERNEL
    native_bf16 = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return DENSE_FROM_M_BF16 if native_bf16 else DENSE_FROM_M


def amx_kernel(w: Int4Blocked) -> bool:
    """Whether bf16 activations on `w` run on AMX tiles from a few rows (kernels/csrc/int4_amx.h): built for a CPU
    with AMX-BF16, Linux granted this process the tile state, and groups of whole 32-column tile steps."""
    ext = extension()
    return ext is not None and hasattr(ext, "has_amx") and ext.has_amx() and w.group_size % 32 == 0


def bf16_kernel(w: Int4Blocked) -> bool:
    """Whether bf16 activations run the AVX-512 BF16 kernel (vdpbf16ps, kernels/csrc/int4_bf16_avx512.h) on
    `w`: built on CPUs with AVX-512 BF16, for even group sizes (it takes input columns in pairs)."""
    return hasattr(extension(), "int4_linear_bf16") and w.group_size % 2 == 0


def _dense_tiles(ext, x: torch.Tensor, w: Int4Blocked) -> torch.Tensor:
    """x [M, K] @ W.T with W dequantized DENSE_TILE_ROWS rows at a time, in x's dtype (the large-M path). bf16 x
    where the bf16 kernel runs: each tile dequantized straight into its layout and multiplied by it
    (`int4_dequantize_pairs`, `Bf16DotLinear`'s kernel); else fp32 tiles (cast to x's dtype) and F.linear."""
    from quantkit.kernels import bf16_cpu

    pairs = (x.dtype == torch.bfloat16 and w.group_size % 2 == 0 and hasattr(ext, "int4_dequantize_pairs")
             and bf16_cpu.bf16_dot_available())
    n, out = w.out_features, x.new_empty(x.shape[0], w.out_features)
    for n0 in range(0, n, DENSE_TILE_ROWS):
        n1 = min(n, n0 + DENSE_TILE_ROWS)
        if pairs:
            tile = ext.int4_dequantize_pairs(w.packed, w.scale_zero, n, w.group_size, n0, n1)
            part = bf16_cpu.extension().bf16_dot_linear(x, tile, n1 - n0, None)
        else:
            tile = ext.int4_dequantize(w.packed, w.scale_zero, n, w.group_size, n0, n1).to(x.dtype)
            part = torch.nn.functional.linear(x, tile)
        if n1 - n0 == n:
            return part
        out[:, n0:n1] = part
    return out


def int4_blocked_linear(x: torch.Tensor, w: Int4Blocked, bias: torch.Tensor | None,
                        dense_from_m: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ W.T (+ bias) -> [M, N] in x's dtype.

    M < dense_from_m (default: `dense_threshold`): a kernel on the packed weight, accumulating in
    fp32 (bf16 x: the AVX-512 BF16 one where `bf16_kernel(w)`; else the AVX2 one on x widened to fp32);
    from it, dequantize tiles and multiply densely in x's dtype (bf16 tiles for bf16 x: oneDNN's bf16 GEMM).
    Raises RuntimeError when the extension is not built (callers check `unavailable()` first).
    """
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the int4 CPU kernel is unavailable: {unavailable()}")
    use_bf16 = x.dtype == torch.bfloat16 and bf16_kernel(w)
    if dense_from_m is None:
        dense_from_m = dense_threshold(x.dtype, use_bf16, use_bf16 and amx_kernel(w))
    xp = x.index_select(1, w.perm) if w.perm is not None else x.contiguous()
    if xp.shape[0] < dense_from_m:
        if use_bf16:  # without a bias to add in fp32, the kernel rounds to bf16 as it stores
            out = ext.int4_linear_bf16(xp, w.packed, w.scale_zero, w.out_features, w.group_size, bias is None)
        else:
            out = ext.int4_linear(xp.float(), w.packed, w.scale_zero, w.out_features, w.group_size)
    else:
        out = _dense_tiles(ext, xp, w)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)
