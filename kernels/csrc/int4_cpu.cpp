// W4A16-style linear on CPU with AVX2 + FMA: x fp32 [M, K] @ W.T -> out fp32 [M, N], where W is
// 4-bit with per-group scales and zeros, kept packed in memory.
//
// Layout (built once at load by quantkit.kernels.int4_cpu.repack):
//   packed  uint8 [NB, K, 8]        NB = ceil(N / 16) blocks of 16 output rows; byte (b, k, j)
//                                   holds row 16b + j (low nibble) and row 16b + 8 + j (high
//                                   nibble) of input column k, so one 8-byte load unpacks to two
//                                   8-lane vectors of rows 16b..16b+7 and 16b+8..16b+15
//   sz      fp16 or fp32 [NB, G, 2, 16]   per group and row: scale s, then zero point z (rows past
//                                   N: 0); fp16 where the checkpoint's scales are exact in it
// Then W[n, k] = (q - z) * s, and for a group g of input columns
//   out[m, n] += s[n, g] * (sum_k x[m, k] q[n, k] - z[n, g] * xsum[m, g]),
// so the inner loop is a plain dot product of x with the integer codes, the group sums of x are
// computed once per call, and scales are applied once per group.
//
// Lanes are output rows: for each k, the 16 codes are unpacked once and multiplied with MT rows
// of x broadcast, so a tile of MT rows of x reads the weights once. U independent accumulator sets
// (unrolled over k) keep 2 * MT * U >= 8 FMA chains in flight. Work is split over the 16-row
// blocks with at::parallel_for (torch's thread pool and thread count).
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the int4 CPU kernel needs AVX2 and FMA (this CPU or compiler lacks them)"
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "int4_amx.h"  // the bf16-activation kernel on AMX tiles, where QUANTKIT_INT4_AMX
#include "int4_avx2.h"  // the fp32 kernel's tiles (AVX2 + FMA)
#include "int4_bf16_avx512.h"  // the bf16-activation kernel, where QUANTKIT_INT4_BF16
#include "int4_q8_avx2.h"  // the int8-activation kernel for fp32 activations (AVX2 + FMA)
#include "int4_x16_avx2.h"  // the fp32 kernel's decode-sized tiles, x in 16-bit fixed point (AVX2)
#include "int4_q8_amx.h"  // the int8-activation kernel on AMX-INT8 tiles, where QUANTKIT_INT4_Q8_AMX
#include "int4_q8_avx512.h"  // the int8-activation kernel, where QUANTKIT_INT4_Q8
#include "int8_amx.h"  // the int8-weight kernel on AMX tiles, where QUANTKIT_INT8_AMX
#include "int8_bf16_avx512.h"  // the int8-weight kernel for bf16 activations, where QUANTKIT_INT8_W
#include "int8_f32_avx2.h"  // the int8-weight kernel for fp32 activations (AVX2 + FMA)
#include "moe_int4.h"  // a mixture-of-experts block's 4-bit experts in one call, where QUANTKIT_INT4_BF16

namespace {

constexpr int kRows = 16;
using int4avx2::Args;
using int4avx2::block;

void check(const torch::Tensor& packed, const torch::Tensor& sz, int64_t k, int64_t n, int64_t gs) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 3 && packed.size(1) == k && packed.size(2) == 8,
              "packed must be uint8 [ceil(N/16), K, 8]");
  TORCH_CHECK(packed.size(0) * kRows >= n && packed.size(0) * kRows < n + kRows, "packed has the wrong row blocks");
  TORCH_CHECK(gs > 0 && k % gs == 0, "group size must divide K");
  TORCH_CHECK((sz.dtype() == torch::kFloat || sz.dtype() == torch::kHalf) && sz.dim() == 4 &&
                  sz.size(0) == packed.size(0) && sz.size(1) == k / gs && sz.size(2) == 2 && sz.size(3) == kRows,
              "scale_zero must be fp16 or fp32 [ceil(N/16), K/group, 2, 16]");
  TORCH_CHECK(packed.is_contiguous() && sz.is_contiguous(), "packed and scale_zero must be contiguous");
}

// The int8 layout (kernels/int8_cpu.py, Int8Blocked) checked for K input columns, N output rows, groups of gs.
void check_int8(const torch::Tensor& packed, const torch::Tensor& scales, int64_t k, int64_t n, int64_t gs) {
  TORCH_CHECK(gs > 0 && gs % 4 == 0 && gs <= int8f::kMaxGroup && k % gs == 0,
              "the group size must be a multiple of 4, at most 128, and divide K");
  TORCH_CHECK(packed.dtype() == torch::kInt8 && packed.dim() == 4 && packed.size(1) * 4 == k &&
                  packed.size(2) == kRows && packed.size(3) == 4,
              "packed must be int8 [ceil(N/16), K/4, 16, 4]");
  TORCH_CHECK(packed.size(0) * kRows >= n && packed.size(0) * kRows < n + kRows, "packed has the wrong row blocks");
  TORCH_CHECK(scales.dtype() == torch::kFloat && scales.sizes() == std::vector<int64_t>({packed.size(0), k / gs, kRows}),
              "scales must be fp32 [ceil(N/16), K/group, 16]");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), "packed and scales must be contiguous");
}

}  // namespace

namespace {

// fn(b) for every block b, the blocks split over torch's threads
template <typename Fn>
void over_blocks(int64_t blocks, Fn fn) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(b);
  });
}

// fn(b, m0, m1) for every block b and every chunk [m0, m1) of the M rows, the blocks split over torch's threads and
// each thread taking its blocks one row chunk at a time: a chunk of about kChunkBytes of x (at 1 byte a column)
// stays in the core's L2 while the thread's blocks go past it, rather than all of x streaming past every block.
constexpr int64_t kChunkBytes = 256 << 10;

template <typename Fn>
void over_blocks_by_rows(int64_t blocks, int64_t m, int64_t k, Fn fn) {
  const int64_t chunk = std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(k, 1) / 4 * 4);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < m; m0 += chunk)
      for (int64_t b = b0; b < b1; ++b) fn(b, m0, std::min(m, m0 + chunk));
  });
}

template <typename T>
void run(const Args<T>& a, int64_t blocks) {
  over_blocks(blocks, [&](int64_t b) { block(a, b); });
}

template <typename T>
void dequantize_rows(const uint8_t* p, const T* sz, int64_t k, int64_t gs, int64_t n0, int64_t n1, float* out) {
  const int64_t groups = k / gs;
  at::parallel_for(n0, n1, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / kRows, j = r % kRows, shift = j < 8 ? 0 : 4;
      const uint8_t* row = p + b * k * 8 + j % 8;
      float* dst = out + (r - n0) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const T* s = sz + (b * groups + g) * 2 * kRows;
        const float scale = float(s[j]), zero = float(s[kRows + j]);
        for (int64_t c = g * gs; c < (g + 1) * gs; ++c) dst[c] = (float((row[c * 8] >> shift) & 15) - zero) * scale;
      }
    }
  });
}

// What the fp32-activation ops start from: x fp32 [M, K] checked and contiguous, the output fp32 [M, N] allocated.
struct F32Call {
  torch::Tensor x, out;
  int64_t m, k;

  F32Call(torch::Tensor x_, int64_t n) {
    TORCH_CHECK(x_.dtype() == torch::kFloat && x_.dim() == 2, "x must be fp32 [M, K]");
    x = x_.contiguous();
    m = x.size(0);
    k = x.size(1);
    out = torch::empty({m, n}, x.options());
  }
};

}  // namespace

namespace {

// Whether int4_linear runs the 16-bit fixed-point tiles (int4_x16_avx2.h) on M rows with groups of gs.
bool x16_tiles(int64_t m, int64_t gs) {
  return m <= int4x16::kMaxRows && gs % 4 == 0 && gs <= int4x16::kMaxGroup;
}

// x fp32 [M, K] rounded per row and group to 16-bit fixed point, @ W4.T by vpmaddwd (int4_x16_avx2.h).
torch::Tensor run_x16(const F32Call& c, const torch::Tensor& packed, const torch::Tensor& sz, int64_t n, int64_t gs) {
  const int64_t groups = c.k / gs;
  std::vector<int16_t> xq(c.m * 4 * c.k);
  std::vector<float> sx(c.m * groups), xqsum(c.m * groups);
  int4x16::quantize(c.x.data_ptr<float>(), c.m, c.k, gs, xq.data(), sx.data(), xqsum.data());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = c.out.data_ptr<float>();
  if (sz.dtype() == torch::kHalf) {
    const int4x16::Args<at::Half> args{xq.data(), sx.data(), xqsum.data(), w, sz.data_ptr<at::Half>(), out,
                                       c.m, c.k, n, groups, gs};
    over_blocks(packed.size(0), [&](int64_t b) { int4x16::block(args, b); });
  } else {
    const int4x16::Args<float> args{xq.data(), sx.data(), xqsum.data(), w, sz.data_ptr<float>(), out,
                                    c.m, c.k, n, groups, gs};
    over_blocks(packed.size(0), [&](int64_t b) { int4x16::block(args, b); });
  }
  return c.out;
}

}  // namespace

// x fp32 [M, K] (columns already permuted for act-order) -> fp32 [M, N]: below 4 rows (and for groups in fours of at
// most 4096 columns) x in 16-bit fixed point by vpmaddwd (int4_x16_avx2.h), else fp32 FMA tiles (int4_avx2.h).
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs) {
  F32Call c(x, n);
  const int64_t m = c.m, k = c.k;
  check(packed, sz, k, n, gs);
  auto out = c.out;
  if (m == 0) return out;
  if (x16_tiles(m, gs)) return run_x16(c, packed, sz, n, gs);
  const auto xsum = c.x.view({m, k / gs, gs}).sum(-1).contiguous();  // [M, G]
  const float* xp = c.x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (sz.dtype() == torch::kHalf)
    run(Args<at::Half>{xp, xs, w, sz.data_ptr<at::Half>(), out.data_ptr<float>(), m, k, n, k / gs, gs}, packed.size(0));
  else
    run(Args<float>{xp, xs, w, sz.data_ptr<float>(), out.data_ptr<float>(), m, k, n, k / gs, gs}, packed.size(0));
  return out;
}

// The 16-bit fixed-point tiles at any M (what int4_linear runs below 4 rows): tests and benchmarks.
torch::Tensor int4_linear_x16(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs) {
  F32Call c(x, n);
  check(packed, sz, c.k, n, gs);
  TORCH_CHECK(gs % 4 == 0 && gs <= int4x16::kMaxGroup,
              "the 16-bit activation tiles take columns in fours: the group size must be a multiple of 4, at most 4096");
  if (c.m == 0) return c.out;
  return run_x16(c, packed, sz, n, gs);
}

#if defined(QUANTKIT_INT4_BF16)
namespace {

// What the bf16-activation ops start from: x bf16 [M, K] checked and contiguous, the output [M, N] allocated
// (bf16 with out_bf16, else fp32) and the raw pointers. Each op checks its own weight layout.
struct Bf16Call {
  torch::Tensor x, out;
  int64_t m, k;
  const uint16_t* xp;
  float* of;     // null with out_bf16
  uint16_t* ob;  // null without

  Bf16Call(torch::Tensor x_, int64_t n, bool out_bf16) {
    TORCH_CHECK(x_.dtype() == torch::kBFloat16 && x_.dim() == 2, "x must be bf16 [M, K]");
    x = x_.contiguous();
    m = x.size(0);
    k = x.size(1);
    out = torch::empty({m, n}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat));
    xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    of = out_bf16 ? nullptr : out.data_ptr<float>();
    ob = out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  }
};

// The packed int4 weight checked for a kernel that takes `columns` input columns a step.
void check_int4(const Bf16Call& c, const torch::Tensor& packed, const torch::Tensor& sz, int64_t n, int64_t gs,
                int64_t columns, const char* why) {
  check(packed, sz, c.k, n, gs);
  TORCH_CHECK(gs % columns == 0, why);
}

// fn(scales) with the scale/zero tensor's data as fp16 or fp32.
template <typename Fn>
void with_scales(const torch::Tensor& sz, Fn fn) {
  if (sz.dtype() == torch::kHalf)
    fn(sz.data_ptr<at::Half>());
  else
    fn(sz.data_ptr<float>());
}

}  // namespace

// Rows n0..n1-1 of W4 (n0 a multiple of 16) dequantized to bf16 in the bf16 kernel's pair layout, [ceil((n1 - n0) /
// 16), K / 2, 16, 2] (rows past n1 in the last block: the next rows' values, or zero past N), for
// quantkit_bf16.bf16_dot_linear with N = n1 - n0.
torch::Tensor int4_dequantize_pairs(torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs, int64_t n0,
                                    int64_t n1) {
  const int64_t k = packed.size(1);
  check(packed, sz, k, n, gs);
  TORCH_CHECK(0 <= n0 && n0 < n1 && n1 <= n && n0 % kRows == 0, "rows n0..n1 must lie in [0, N), n0 a multiple of 16");
  TORCH_CHECK(gs % 2 == 0, "the pair layout takes column pairs: the group size must be even");
  const int64_t b0 = n0 / kRows, blocks = (n1 - n0 + kRows - 1) / kRows, groups = k / gs;
  auto out = torch::empty({blocks, k / 2, kRows, 2}, packed.options().dtype(torch::kBFloat16));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_scales(sz, [&](auto* s) {
    at::parallel_for(0, blocks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        int4bf16::dequantize_pairs(w + (b0 + c) * k * 8, s + (b0 + c) * groups * 2 * kRows, k, gs, o + c * k * kRows);
    });
  });
  return out;
}

// x bf16 [M, K] (columns already permuted for act-order) -> [M, N] by vdpbf16ps (int4_bf16_avx512.h): fp32, or
// with out_bf16 the fp32 sums rounded to bf16 as they are stored (what .to(torch.bfloat16) of the fp32 result gives).
torch::Tensor int4_linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs,
                               bool out_bf16) {
  Bf16Call c(x, n, out_bf16);
  check_int4(c, packed, sz, n, gs, 2, "the bf16 kernel takes column pairs: the group size must be even");
  if (c.m == 0) return c.out;
  std::vector<float> xsum(c.m * (c.k / gs));  // [M, G]
  int4bf16::group_sums(c.xp, c.m, c.k, gs, xsum.data());
  with_scales(sz, [&](auto* s) {
    const int4bf16::Args<std::remove_const_t<std::remove_pointer_t<decltype(s)>>> args{
        c.xp, xsum.data(), packed.data_ptr<uint8_t>(), s, c.of, c.ob, c.m, c.k, n, c.k / gs, gs};
    at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) { int4bf16::any_blocks(args, b0, b1); });
  });
  return c.out;
}

#endif

#if defined(QUANTKIT_INT8_AMX)
// From this many rows of x, int8_linear_bf16 runs on AMX tiles where they apply (int8amx::usable): python -m
// quantkit.bench.int8_head on this project's CPU (docs/BENCHMARKS.md); a switch so that a benchmark can move it.
inline int64_t& int8_amx_from_m() {
  static int64_t m = 8;
  return m;
}
#endif

#if defined(QUANTKIT_INT8_W)
// x bf16 [M, K] @ W8.T -> fp32 (or bf16) [M, N], W8 int8 [ceil(N/16), K/4, 16, 4] with fp32 scales and int32 code
// sums [ceil(N/16), K/gs, 16] (int8_bf16_avx512.h).
torch::Tensor int8_linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor wsum,
                               int64_t n, int64_t gs, bool out_bf16) {
  Bf16Call c(x, n, out_bf16);
  check_int8(packed, scales, c.k, n, gs);
  TORCH_CHECK(wsum.dtype() == torch::kInt && wsum.sizes() == scales.sizes() && wsum.is_contiguous(),
              "wsum must be int32 [ceil(N/16), K/group, 16], contiguous");
  if (c.m == 0) return c.out;
  const int64_t groups = c.k / gs;
#if defined(QUANTKIT_INT8_AMX)
  if (c.m >= int8_amx_from_m() && int8amx::usable(gs)) {
    const int64_t mp = int8amx::padded_rows(c.m);
    std::vector<uint8_t> planes(2 * mp * c.k);
    std::vector<float> sx(c.m * groups);
    int8amx::digit_planes(c.xp, c.m, c.k, gs, planes.data(), sx.data());
    const int8amx::Args args{planes.data(), sx.data(), packed.data_ptr<int8_t>(), scales.data_ptr<float>(), c.of,
                             c.ob, c.m, mp, c.k, n, groups, gs};  // no wsum: AMX's signed high bytes need none
    at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) { int8amx::blocks(args, b0, b1); });
    return c.out;
  }
#endif
  std::vector<uint32_t> xd(c.m * c.k / 2);  // [K / 4, M, 2]
  std::vector<float> sx(c.m * groups);
  int8w::digits(c.xp, c.m, c.k, gs, xd.data(), sx.data());
  const int8w::Args args{xd.data(), sx.data(), packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                         wsum.data_ptr<int32_t>(), c.of, c.ob, c.m, c.k, n, groups, gs};
  over_blocks(packed.size(0), [&](int64_t b) { int8w::block(args, b); });
  return c.out;
}
#endif

// x fp32 [M, K] @ W8.T -> fp32 [M, N], W8 int8 [ceil(N/16), K/4, 16, 4] with fp32 scales [ceil(N/16), K/gs, 16]
// (int8_f32_avx2.h).
torch::Tensor int8_linear_f32(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n, int64_t gs) {
  F32Call c(x, n);
  check_int8(packed, scales, c.k, n, gs);
  if (c.m == 0) return c.out;
  std::vector<int16_t> xq(c.m * c.k);
  std::vector<float> sx(c.m * (c.k / gs));
  vec2::quantize16(c.x.data_ptr<float>(), c.m, c.k, gs, xq.data(), sx.data());
  const int8f::Args args{xq.data(), sx.data(), packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                         c.out.data_ptr<float>(), c.m, c.k, n, c.k / gs, gs};
  over_blocks(packed.size(0), [&](int64_t b) { int8f::block(args, b); });
  return c.out;
}

// x fp32 [M, K] (columns already permuted for act-order), quantized per row and group to int8 -> fp32 [M, N] by
// vpmaddubsw (int4_q8_avx2.h).
torch::Tensor int4_linear_q8_f32(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs) {
  F32Call c(x, n);
  check(packed, sz, c.k, n, gs);
  TORCH_CHECK(gs % 4 == 0, "the int8-activation kernel takes columns in fours: the group size must be a multiple of 4");
  if (c.m == 0) return c.out;
  const int64_t groups = c.k / gs;
  std::vector<int8_t> xq(c.m * c.k);
  std::vector<float> sx(c.m * groups), xqsum(c.m * groups);
  const float* xf = c.x.data_ptr<float>();
  at::parallel_for(0, c.m, 16, [&](int64_t m0, int64_t m1) {  // rows of a prefill chunk over the threads
    int4q8avx2::quantize(xf + m0 * c.k, m1 - m0, c.k, gs, xq.data() + m0 * c.k, sx.data() + m0 * groups,
                         xqsum.data() + m0 * groups);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = c.out.data_ptr<float>();
  if (sz.dtype() == torch::kHalf) {
    const int4q8avx2::Args<at::Half> args{xq.data(), sx.data(), xqsum.data(), w, sz.data_ptr<at::Half>(), out,
                                          c.m, c.k, n, groups, gs};
    over_blocks_by_rows(packed.size(0), c.m, c.k, [&](int64_t b, int64_t m0, int64_t m1) {
      int4q8avx2::block(args, b, m0, m1);
    });
  } else {
    const int4q8avx2::Args<float> args{xq.data(), sx.data(), xqsum.data(), w, sz.data_ptr<float>(), out,
                                       c.m, c.k, n, groups, gs};
    over_blocks_by_rows(packed.size(0), c.m, c.k, [&](int64_t b, int64_t m0, int64_t m1) {
      int4q8avx2::block(args, b, m0, m1);
    });
  }
  return c.out;
}

#if defined(QUANTKIT_INT4_Q8_AMX)
// From this many rows of x, int4_linear_q8 runs on AMX-INT8 tiles where they apply (int4q8amx::usable), with the same
// bits as vpdpbusd. From one row: over the 1B shape's linears (weights past the caches) the tiles lead at every M,
// 1.08-1.16x at 1-2 rows, 1.3-2.5x from 4 (benchmarks/int4_q8_amx.py; docs/BENCHMARKS.md); only a weight that stays
// in L2 between calls (2048 x 2048, 1 MiB a core) runs one row faster on vpdpbusd. A switch for the benchmark.
inline int64_t& int4_q8_amx_from_m() {
  static int64_t m = 1;
  return m;
}
#endif

#if defined(QUANTKIT_INT4_Q8)
// x bf16 [M, K] (columns already permuted for act-order), quantized per row and group to int8 -> fp32 (or bf16)
// [M, N] by vpdpbusd (int4_q8_avx512.h), or AMX-INT8 tiles from int4_q8_amx_from_m() rows (int4_q8_amx.h).
torch::Tensor int4_linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs,
                             bool out_bf16) {
  Bf16Call c(x, n, out_bf16);
  check_int4(c, packed, sz, n, gs, 4,
             "the int8-activation kernel takes columns in fours: the group size must be a multiple of 4");
  if (c.m == 0) return c.out;
  const int64_t groups = c.k / gs;
  std::vector<int8_t> xq(c.m * c.k);
  std::vector<float> sx(c.m * groups), xqsum(c.m * groups);
  int4q8::quantize(c.xp, c.m, c.k, gs, xq.data(), sx.data(), xqsum.data());
  with_scales(sz, [&](auto* s) {
    const int4q8::Args<std::remove_const_t<std::remove_pointer_t<decltype(s)>>> args{
        xq.data(), sx.data(), xqsum.data(), packed.data_ptr<uint8_t>(), s, c.of, c.ob, c.m, c.k, n, groups, gs};
#if defined(QUANTKIT_INT4_Q8_AMX)
    if (c.m >= int4_q8_amx_from_m() && int4q8amx::usable(gs)) {
      at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) { int4q8amx::blocks(args, b0, b1); });
      return;
    }
#endif
    over_blocks(packed.size(0), [&](int64_t b) { int4q8::block(args, b); });
  });
  return c.out;
}
#endif

// Rows n0..n1-1 of W as fp32 [n1 - n0, K] (the large-M path: dequantize a tile, then a dense matmul).
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t gs, int64_t n0, int64_t n1) {
  const int64_t k = packed.size(1);
  check(packed, sz, k, n, gs);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= n, "row range out of bounds");
  auto w = torch::empty({n1 - n0, k}, torch::dtype(torch::kFloat));
  if (sz.dtype() == torch::kHalf)
    dequantize_rows(packed.data_ptr<uint8_t>(), sz.data_ptr<at::Half>(), k, gs, n0, n1, w.data_ptr<float>());
  else
    dequantize_rows(packed.data_ptr<uint8_t>(), sz.data_ptr<float>(), k, gs, n0, n1, w.data_ptr<float>());
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto dev = m.def_submodule("dev", "development-only tuning switches, for benchmarks and tests; production code "
                             "never calls them");
  amx::bind_switches(m, dev);  // the int4 and int8 kernels' AMX paths
  m.def("int4_linear", &int4_linear, "x fp32 [M, K] @ W4.T -> fp32 [M, N] (AVX2/FMA; below 4 rows x in 16-bit "
        "fixed point per row and group)");
  m.def("int4_linear_x16", &int4_linear_x16, "x fp32 [M, K] rounded per row and group to 16-bit fixed point @ W4.T "
        "-> fp32 [M, N] (AVX2; int4_linear's tiles below 4 rows)");
  m.def("int4_x16_takes", &x16_tiles, "whether int4_linear runs m rows of x on groups of gs columns on its 16-bit "
        "fixed-point tiles", py::arg("m"), py::arg("gs"));
  m.def("int4_moe_f32", &int4_moe_f32, "x fp32 [T, H], the router's choices [T, k] and weights [T, k], the experts' "
        "gate|up and down stacked [E, ...] -> fp32 [T, H] (AVX2/FMA; moe_int4_cpu.cpp)", py::arg("x"),
        py::arg("chosen"), py::arg("weights"), py::arg("w1"), py::arg("s1"), py::arg("gs1"), py::arg("w2"),
        py::arg("s2"), py::arg("gs2"));
  m.def("int4_dequantize", &int4_dequantize, "rows n0..n1 of W4 as fp32 [n1 - n0, K]");
  m.def("int4_linear_q8_f32", &int4_linear_q8_f32, "x fp32 [M, K] rounded to int8 per row and group @ W4.T -> fp32 "
        "[M, N] (AVX2/FMA; int4_q8_avx2.h)");
  m.def("int8_linear_f32", &int8_linear_f32, "x fp32 [M, K] @ W8.T -> fp32 [M, N] (AVX2/FMA; int8_f32_avx2.h)");
  dev.def("set_stream_ahead", [](int64_t bytes) { return std::exchange(stream::ahead(), bytes); },
        "the tiles that stream their codes (stream_ahead.h: 1-3 rows of x; on AMX the int4 tiles and the int8 head "
        "up to 16 rows): prefetch them this many bytes ahead of the loads (0: none); returns the previous setting");
#if defined(QUANTKIT_INT4_BF16)
  m.def("int4_dequantize_pairs", &int4_dequantize_pairs,
        "rows n0..n1 of W4 as bf16 in the bf16 kernel's pair layout [ceil((n1 - n0) / 16), K / 2, 16, 2]");
  dev.def("set_wide_tiles", [](bool on) { return std::exchange(int4bf16::wide_tiles(), on); },
        "8 rows of x and more: pairs of blocks a tile (True, the default) or one; returns the previous setting");
  dev.def("set_eight_columns", [](bool on) { return std::exchange(int4bf16::eight_columns(), on); },
        "the 8-row tile: 8 columns a step where the group size allows (True, the default) or a pair; returns the "
        "previous setting");
  dev.def("set_lane_tiles", [](bool on) { return std::exchange(int4bf16::lane_tiles(), on); },
        "1-2 rows of x: 8 columns a step (True, the default) or a pair a step; returns the previous setting");
#if defined(QUANTKIT_INT4_AMX)
  dev.def("set_int4_amx_from_m", [](int64_t m) { return std::exchange(int4bf16::amx_from_m(), m); },
        "the rows of x from which int4_linear_bf16 runs on AMX tiles; returns the previous value");
#endif
#if defined(QUANTKIT_INT4_Q8_AMX)
  dev.def("set_int4_q8_amx_from_m", [](int64_t m) { return std::exchange(int4_q8_amx_from_m(), m); },
        "the rows of x from which int4_linear_q8 runs on AMX-INT8 tiles; returns the previous value");
#endif
#if defined(QUANTKIT_INT8_AMX)
  dev.def("set_int8_amx_from_m", [](int64_t m) { return std::exchange(int8_amx_from_m(), m); },
        "the rows of x from which int8_linear_bf16 runs on AMX tiles; returns the previous value");
#endif
  m.def("int4_moe_bf16", &int4_moe_bf16, "x bf16 [T, H], the router's choices [T, k] and weights [T, k], the experts' "
        "gate|up and down stacked [E, ...] -> bf16 [T, H] (AVX-512 BF16; moe_int4_cpu.cpp)", py::arg("x"),
        py::arg("chosen"), py::arg("weights"), py::arg("w1"), py::arg("s1"), py::arg("gs1"), py::arg("w2"),
        py::arg("s2"), py::arg("gs2"));
  m.def("int4_linear_bf16", &int4_linear_bf16, "x bf16 [M, K] @ W4.T -> fp32 (or bf16) [M, N] (AVX-512 BF16)",
        py::arg("x"), py::arg("packed"), py::arg("scale_zero"), py::arg("n"), py::arg("group_size"),
        py::arg("out_bf16") = false);
#endif
#if defined(QUANTKIT_INT8_W)
  m.def("int8_linear_bf16", &int8_linear_bf16, "x bf16 [M, K] @ W8.T -> fp32 (or bf16) [M, N] (AVX-512 VNNI)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("wsum"), py::arg("n"), py::arg("group_size"),
        py::arg("out_bf16") = false);
#endif
#if defined(QUANTKIT_INT4_Q8)
  m.def("int4_linear_q8", &int4_linear_q8, "x bf16 [M, K], quantized to int8 per row and group, @ W4.T -> fp32 "
        "(or bf16) [M, N] (AVX-512 VNNI)", py::arg("x"), py::arg("packed"), py::arg("scale_zero"), py::arg("n"),
        py::arg("group_size"), py::arg("out_bf16") = false);
#endif
#if defined(QUANTKIT_INT4_Q8_AMX)
  m.def("int4_q8_amx_takes", [](int64_t gs) { return int4q8amx::usable(gs); },
        "whether int4_linear_q8 runs groups of gs columns on AMX-INT8 tiles (from int4_q8_amx_from_m rows): whole "
        "64-column tile steps, and the tiles granted and on");
#endif
}
