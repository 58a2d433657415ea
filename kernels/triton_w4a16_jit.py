"""Triton W4A16 dequant-matmul kernels: out[M, N] = x[M, K] @ W_hat.T (+ bias).

W_hat never exists in memory. Each program loads the packed 4-bit codes of one weight tile,
unpacks them with shifts and masks, subtracts the zero point and multiplies by the scale of
each row's group (fused in registers), then feeds the tile to `tl.dot` with an fp32
accumulator -- the structure of Triton's matmul tutorial with a dequantizing B loader.

Two kernels share that inner step (`_accumulate`):
  * `gemm_kernel`: one program per [BLOCK_M, BLOCK_N] output tile, program ids grouped
    GROUP_M tiles along M so neighbouring programs reuse the same weight columns in L2.
    For prefill / large M, where the product is compute bound.
  * `splitk_kernel`: decode (M <= 16). One program owns every row of x and a BLOCK_N slice
    of the output, and SPLIT_K programs share the K loop, adding their partial sums into an
    fp32 buffer with atomics. At M <= 16 the product is memory bound: the goal is enough
    programs in flight to stream the packed weight at full bandwidth even when N is small.

Layouts (see quantkit.format.packing), LAYOUT constexpr: 0 = "gptq" (v1, zeros stored minus
one), 1 = "gptq_v2", 2 = "awq" (GEMM order). Each packed word is loaded once and unpacked in
registers by a broadcast shift and a reshape; the unpacked tile then holds its rows (GPTQ) or
columns (AWQ) in packing order, and x, the scales, the bias and the output are indexed in that
same order (`tile_rows`, `tile_columns`), which leaves the product unchanged.

This module only defines kernels; quantkit.kernels.triton_w4a16 checks, allocates, launches.
It may be executed twice: normally, and as a private copy decorated under TRITON_INTERPRET=1
so the same kernels run on CPU tensors. For that copy to work even when triton itself was
imported without the variable, the kernels call only builtins of triton.language (tl.full,
not tl.zeros; integer arithmetic, not tl.cdiv): the @jit helpers of triton's standard
library were decorated at triton's import and cannot run inside the interpreter otherwise.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

@triton.jit
def _unpack_last(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 words [ROWS, COLS / 8] -> 4-bit codes [ROWS, COLS]; column 8c + i is slot i of word c."""
    shifts = tl.arange(0, 8) * 4
    return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (ROWS, COLS))


@triton.jit
def tile_rows(k0, BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr):
    """The input rows (K indices) of a tile, in the order the unpacked weight tile holds them.

    GPTQ packs 8 rows a word, so a tile unpacks as [8, BLOCK_K / 8] (slot j of word r is row
    8r + j): position j * (BLOCK_K / 8) + r holds row k0 + 8r + j. x is loaded in the same order,
    so the dot product is unchanged. AWQ tiles keep the natural order.
    """
    idx = tl.arange(0, BLOCK_K)
    if LAYOUT == 2:
        rows = k0 + idx
    else:
        rows = k0 + 8 * (idx % (BLOCK_K // 8)) + idx // (BLOCK_K // 8)
    return rows


@triton.jit
def tile_columns(n0, BLOCK_N: tl.constexpr, LAYOUT: tl.constexpr):
    """The output columns of a tile, in the order the unpacked weight and zeros hold them.

    AWQ stores column 8c + AWQ_ORDER[i] in slot i of word c, with AWQ_ORDER = (0, 2, 4, 6, 1,
    3, 5, 7) = 2 * (i % 4) + i // 4; scales, bias and the output use the same order. GPTQ
    columns are natural.
    """
    idx = tl.arange(0, BLOCK_N)
    if LAYOUT == 2:
        slot = idx % 8
        cols = n0 + 8 * (idx // 8) + 2 * (slot % 4) + slot // 4
    else:
        cols = n0 + idx
    return cols


@triton.jit
def _weight_tile(qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, offs_k, offs_n, k0, n0, K, N,
                 stride_qw, stride_qz, stride_s,
                 GROUP_SIZE: tl.constexpr, LAYOUT: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W_hat.T at rows offs_k [BLOCK_K] x columns offs_n [BLOCK_N] -> fp32 (0 past K or N).

    Each packed word is loaded once and unpacked in registers (8 codes a word).
    """
    mask_k = offs_k < K
    mask_n = offs_n < N
    word_cols = n0 // 8 + tl.arange(0, BLOCK_N // 8)  # zeros (both layouts) and AWQ qweight words
    word_cols_mask = word_cols < N // 8
    if LAYOUT == 2:
        # awq qweight: int32 [K, N / 8], 8 columns a word -> words [BLOCK_K, BLOCK_N / 8]
        words = tl.load(qweight_ptr + offs_k[:, None] * stride_qw + word_cols[None, :],
                        mask=mask_k[:, None] & word_cols_mask[None, :], other=0)
        q = _unpack_last(words, BLOCK_K, BLOCK_N)
    else:
        # gptq qweight: int32 [K / 8, N], 8 rows a word -> words [BLOCK_K / 8, BLOCK_N]
        word_rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qweight_ptr + word_rows[:, None] * stride_qw + offs_n[None, :],
                        mask=(word_rows < K // 8)[:, None] & mask_n[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((words[None, :, :] >> shifts[:, None, None]) & 0xF, (BLOCK_K, BLOCK_N))
    if not HAS_G_IDX and GROUP_SIZE % BLOCK_K == 0:
        # The whole K block lies in one group: one row of zeros and scales, broadcast over K.
        # A split-K block may start past K: its group row does not exist, so it must not load
        # (garbage there could be NaN, and 0 * NaN poisons the sum).
        g = k0 // GROUP_SIZE
        in_k = (word_cols * 0 + k0) < K  # k0 < K, as a vector
        zw = tl.load(qzeros_ptr + g * stride_qz + word_cols, mask=word_cols_mask & in_k, other=0)
        z = tl.reshape(_unpack_last(zw[None, :], 1, BLOCK_N), (1, BLOCK_N))
        s = tl.load(scales_ptr + g * stride_s + offs_n, mask=mask_n & ((offs_n * 0 + k0) < K), other=0.0)
        s = s.to(tl.float32)[None, :]
    else:
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)  # [BLOCK_K] act-order groups
        else:
            g = offs_k // GROUP_SIZE
        zw = tl.load(qzeros_ptr + g[:, None] * stride_qz + word_cols[None, :],
                     mask=mask_k[:, None] & word_cols_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N / 8]
        z = _unpack_last(zw, BLOCK_K, BLOCK_N)
        s = tl.load(scales_ptr + g[:, None] * stride_s + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    if LAYOUT == 0:
        z = z + 1  # GPTQ v1 stores zero - 1
    return (q - z).to(tl.float32) * s


@triton.jit
def _accumulate(acc, x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, offs_m, offs_n, k0, n0, M, N, K,
                stride_xm, stride_xk, stride_qw, stride_qz, stride_s,
                GROUP_SIZE: tl.constexpr, LAYOUT: tl.constexpr, HAS_G_IDX: tl.constexpr,
                FP32_DOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 += x[offs_m, block k0] @ W_hat.T[block k0, offs_n]."""
    offs_k = tile_rows(k0, BLOCK_K, LAYOUT)
    x_mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_mask, other=0.0)
    w = _weight_tile(qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, offs_k, offs_n, k0, n0, K, N,
                     stride_qw, stride_qz, stride_s, GROUP_SIZE, LAYOUT, HAS_G_IDX, BLOCK_K, BLOCK_N)
    if FP32_DOT:
        # fp32 inputs, and the interpreter (where a bf16 tl.dot is silently wrong)
        acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
    else:
        # fp16 / bf16 on a GPU: tensor cores, fp32 accumulation
        acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


@triton.jit
def gemm_kernel(
    # pointers: x [M, K]; packed weight as stored; g_idx [K] int32; bias [N]; out [M, N] x.dtype
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, bias_ptr, out_ptr,
    # sizes (M_BUCKET only keys the autotuner)
    M, N, K, M_BUCKET,
    # strides, in elements
    stride_xm, stride_xk, stride_qw, stride_qz, stride_s, stride_om,
    # the checkpoint and the call
    GROUP_SIZE: tl.constexpr, LAYOUT: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    # Grouped ordering: GROUP_M consecutive programs walk down M over the same N columns.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = tile_columns(n0, BLOCK_N, LAYOUT)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for i in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        acc = _accumulate(acc, x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, offs_m, offs_n,
                          i * BLOCK_K, n0, M, N, K, stride_xm, stride_xk, stride_qw, stride_qz, stride_s,
                          GROUP_SIZE, LAYOUT, HAS_G_IDX, FP32_DOT, BLOCK_K, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def splitk_kernel(
    # pointers: as gemm_kernel; with SPLIT_K > 1, out [M, N] is an fp32 buffer of zeros the
    # programs add into (with SPLIT_K == 1 it is the x.dtype output, stored once)
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, bias_ptr, out_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_xk, stride_qw, stride_qz, stride_s, stride_om,
    GROUP_SIZE: tl.constexpr, LAYOUT: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    # BLOCK_M covers every row of x (M <= 16; 16 is the smallest tl.dot tile)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = tile_columns(n0, BLOCK_N, LAYOUT)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    # Program pid_k takes K blocks pid_k, pid_k + SPLIT_K, ...; blocks past K are fully masked.
    for i in range(0, (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K)):
        acc = _accumulate(acc, x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, offs_m, offs_n,
                          (i * SPLIT_K + pid_k) * BLOCK_K, n0, M, N, K, stride_xm, stride_xk, stride_qw,
                          stride_qz, stride_s, GROUP_SIZE, LAYOUT, HAS_G_IDX, FP32_DOT, BLOCK_K, BLOCK_N)
    if HAS_BIAS:
        first = (pid_k == 0).to(tl.float32)  # the bias is added once, by the first K slice
        acc += first * tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)  # out [M, N] x.dtype
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)  # out [M, N] fp32 zeros


# --- autotuning -------------------------------------------------------------------------------

def bench_any_device(kernel_call, quantiles):
    """The autotuner's timer: Triton's CUDA-event do_bench on a GPU, wall time elsewhere.

    triton.testing.do_bench needs a GPU driver; under the interpreter one timed call per
    config is enough (the ranking there is not meaningful, only that tuning works).
    """
    if torch.cuda.is_available():
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)
    start = time.perf_counter()
    kernel_call()
    ms = (time.perf_counter() - start) * 1e3
    return [ms for _ in quantiles]


def _cfg(num_warps: int, num_stages: int, **meta) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the tutorial's families plus small-M tiles.
GEMM_CONFIGS = [
    _cfg(w, s, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
    for bm, bn, bk, w, s in [
        (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 256, 32, 4, 4),
        (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (32, 128, 64, 4, 4),
        (32, 64, 128, 4, 4),
    ]
]
# (BLOCK_N, BLOCK_K, SPLIT_K): decode tiles; BLOCK_M is fixed at 16 by the launcher. The
# launcher picks split or not (an fp32 buffer plus a memset and a cast, or none) before tuning.
SPLITK_CONFIGS = [
    _cfg(4, s, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk)
    for bn in (32, 64, 128) for bk in (64, 128, 256) for sk in (2, 4, 8) for s in (3,)
]
GEMV_CONFIGS = [
    _cfg(w, s, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1)
    for bn in (32, 64, 128) for bk in (64, 128, 256) for w, s in ((4, 3), (4, 4))
]


def prune_gemm(configs, named_args, **kwargs):
    """Drop tiles much taller than the batch: they only multiply masked rows."""
    tall = max(32, int(named_args["M_BUCKET"]))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= tall]
    return kept or configs[-1:]


def prune_splitk(configs, named_args, **kwargs):
    """Drop splits that would leave some programs without a single K block."""
    k = int(named_args["K"])
    kept = [c for c in configs if c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"] <= max(k, c.kwargs["BLOCK_K"])]
    return kept or configs[:1]


# Shapes, and what changes the inner loop's cost (act-order gathers, group loads, layout).
TUNING_KEY = ["M_BUCKET", "N", "K", "GROUP_SIZE", "LAYOUT", "HAS_G_IDX"]

gemm_kernel_tuned = triton.autotune(
    configs=GEMM_CONFIGS, key=TUNING_KEY, prune_configs_by={"early_config_prune": prune_gemm},
    do_bench=bench_any_device,
)(gemm_kernel)

gemv_kernel_tuned = triton.autotune(
    configs=GEMV_CONFIGS, key=TUNING_KEY, do_bench=bench_any_device,
)(splitk_kernel)

splitk_kernel_tuned = triton.autotune(
    configs=SPLITK_CONFIGS, key=TUNING_KEY, prune_configs_by={"early_config_prune": prune_splitk},
    reset_to_zero=["out_ptr"], do_bench=bench_any_device,
)(splitk_kernel)
