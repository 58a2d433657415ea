// The float linear for bf16 activations and bf16 weights on CPUs with AVX-512 BF16: x bf16 [M, K] @ W.T (+ bias)
// -> bf16 [M, N], fp32 sums rounded once to nearest even. Included by bf16_cpu.cpp (QUANTKIT_BF16_DOT). The
// engine runs a bf16 model's linears through it (kernels/bf16_cpu.py, Bf16DotLinear) in place of oneDNN's
// prepacked GEMM, which read the weights of a batch-1 decode step at about half the memory's pace on this
// project's CPU (docs/BENCHMARKS.md).
//
// Layout (pack_pairs): W [N, K] (K even) -> [NB, K / 2, 16, 2], NB = ceil(N / 16) blocks of 16 output rows (rows
// past N zero): for each pair of input columns k, k + 1 the 16 rows' two weights side by side, one 64-byte line.
// So one aligned load is a vdpbf16ps operand as stored (lane i accumulates x[k] w[i, k] + x[k + 1] w[i, k + 1]) and
// a block is one contiguous stream. Up to 15 rows of x (decode), the tiles are the int4 kernel's (tiles_bf16_avx512.h:
// 8, 4, then 1-3 rows of x per pass over a block, 16 independent chains) with the unpacking left out, fetching the
// stream ahead; from 16 rows (prefill, bound by the multiply-adds), tiles of 8 rows by 2 blocks.
//
// Products of bf16 values are exact in fp32, so the result is F.linear in fp32 on the same bf16 inputs up to the
// order of the sums, then rounded to bf16 as torch rounds (bf16_dot_reference in kernels/bf16_cpu.py).
#pragma once

#include "tiles_bf16_avx512.h"  // the tiles, where QUANTKIT_BF16_TILES

#if defined(QUANTKIT_BF16_TILES)
#define QUANTKIT_BF16_DOT 1

#include <immintrin.h>

#include <cstdint>

namespace bf16dot {

constexpr int kRows = 16;
// How far ahead of its loads a block's stream is fetched, in bf16 elements (2 KB, 32 lines): the hardware
// prefetcher alone left tiles of 4 and 8 rows waiting on memory (measured: 8 rows 1.0x -> 1.37x of oneDNN's
// prepacked GEMM over a decode step's linears, docs/BENCHMARKS.md).
constexpr int64_t kPrefetch = 1024;
// Rows of x per pass over the weights (rows x K elements): they stay in L2 while every block passes by.
constexpr int64_t kRowsPerPass = 131072;

struct Args {
  const uint16_t* x;   // bf16 bits [M, K]
  const uint16_t* w;   // bf16 bits [NB, K / 2, 16, 2]
  const float* bias;   // [NB * 16] (zero past N) or null
  float* out;          // unused: the result is bf16 (for_tiles' interface)
  uint16_t* out_bf16;  // [M, N]
  int64_t M, K, N;
};

// Rows m0..m0+MT-1 of x against block b: o[MT][16] receives the block's outputs.
template <int MT>
void tile(const Args& a, int64_t b, int64_t m0, float* o) {
  const uint16_t* w = a.w + b * a.K * kRows;
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  const __m512 bias = a.bias != nullptr ? _mm512_loadu_ps(a.bias + b * kRows) : _mm512_setzero_ps();
  tiles512::group_dots<MT, 2>(
      x, 0, a.K,
      [&](int64_t k, __m512bh (&c)[1]) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k * kRows + kPrefetch), _MM_HINT_T0);
        c[0] = (__m512bh)_mm512_loadu_si512(w + k * kRows);
      },
      [](int64_t) {}, [&](int m, __m512 d) { _mm512_storeu_ps(o + m * kRows, _mm512_add_ps(d, bias)); });
}

// Rows m0..m0+MT-1 of x against blocks b..b+NB-1 at once (the passes of large M, bound by their multiply-adds): each
// broadcast pair of x serves NB blocks, so a pass issues fewer loads per vdpbf16ps than the one-block tile.
// o[NB][MT][16] receives the outputs.
template <int MT, int NB>
void wide_tile(const Args& a, int64_t b, int64_t m0, float* o) {
  const uint16_t* w = a.w + b * a.K * kRows;
  const int64_t stride = a.K * kRows;  // from one block to the next
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  __m512 acc[NB][MT];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 2) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * stride + k * kRows);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = tiles512::pair(x[m] + k);
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 bias = a.bias != nullptr ? _mm512_loadu_ps(a.bias + (b + j) * kRows) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(o + (j * MT + m) * kRows, _mm512_add_ps(acc[j][m], bias));
  }
}

// The wide tile's shape: 8 rows by 2 blocks, 16 accumulators. Over the linears of a decode step, against oneDNN's
// prepacked GEMM: 1.33x at M = 16, 1.12x at 64, 1.01x from 256 on, where both run at the bf16 peak; the one-block
// tiles had given 1.01x, 0.88x and 0.93-0.96x there. 4 x 4, 6 x 3, 6 x 4, 8 x 3 and 4 x 6 measured the same within
// the noise (docs/BENCHMARKS.md).
constexpr int kWideRows = 8, kWideBlocks = 2;

// a for rows m0..m1-1 of x only
inline Args row_slice(const Args& a, int64_t m0, int64_t m1) {
  Args rows = a;
  rows.x = a.x + m0 * a.K;
  rows.out_bf16 = a.out_bf16 + m0 * a.N;
  rows.M = m1 - m0;
  return rows;
}

// Blocks b0..b1-1 of the result for rows m0..m1-1 of x.
inline void blocks(const Args& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  const Args rows = row_slice(a, m0, m1);
  int64_t b = b0;
  if (rows.M >= 2 * kWideRows) {  // whole tiles of kWideRows rows by kWideBlocks blocks, the rest below
    const int64_t mw = rows.M / kWideRows * kWideRows;
    float o[kWideBlocks * kWideRows * kRows];
    for (; b + kWideBlocks <= b1; b += kWideBlocks)
      for (int64_t r0 = 0; r0 < mw; r0 += kWideRows) {
        wide_tile<kWideRows, kWideBlocks>(rows, b, r0, o);
        for (int j = 0; j < kWideBlocks; ++j) {
          const int64_t n0 = (b + j) * kRows;
          tiles512::store_rows(nullptr, rows.out_bf16, a.N, n0, std::min<int64_t>(kRows, a.N - n0), r0, kWideRows,
                               o + j * kWideRows * kRows);
        }
      }
    if (mw < rows.M) {  // the last rows against the blocks done above
      const Args rest = row_slice(rows, mw, rows.M);
      for (int64_t c = b0; c < b; ++c)
        tiles512::for_tiles(rest, c, [&](auto mt, int64_t r0, float* o) { tile<decltype(mt)::value>(rest, c, r0, o); });
    }
  }
  for (; b < b1; ++b)
    tiles512::for_tiles(rows, b, [&](auto mt, int64_t r0, float* o) { tile<decltype(mt)::value>(rows, b, r0, o); });
}

}  // namespace bf16dot

#endif
