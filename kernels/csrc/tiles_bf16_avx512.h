// The building blocks every AVX-512 BF16 linear kernel shares (int4_bf16_avx512.h, int4_q8_avx512.h,
// int8_bf16_avx512.h, bf16_dot_avx512.h and the AMX kernels' stores): bf16 widening and max |x|, the (x[k], x[k + 1])
// operand of vdpbf16ps, the tile loop over a group's column pairs with independent chains (group_dots), and the
// walk over a block of 16 output rows in tiles of 8, 4 and 1-3 rows of x with its stores (for_tiles, store_rows).
// Compiled where the compiler targets AVX-512 BF16/BW/VL (QUANTKIT_BF16_TILES).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANTKIT_BF16_TILES 1

#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "stream_ahead.h"

namespace tiles512 {

constexpr int kRows = 16;  // output rows of a block: one fp32 vector

inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline float widen1(uint16_t b) {  // one bf16 -> fp32 (exact)
  const uint32_t bits = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// max |x| over n bf16 values (the scale of a group the int8-activation kernels round x in)
inline float abs_max(const uint16_t* p, int64_t n) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 mx = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(widen16(p + c), abs_mask));
  float amax = _mm512_reduce_max_ps(mx);
  for (; c < n; ++c) amax = std::max(amax, std::fabs(widen1(p[c])));
  return amax;
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// (x[k], x[k + 1]) in every lane pair
inline __m512bh pair(const uint16_t* x) {
  int32_t two;
  std::memcpy(&two, x, sizeof two);
  return (__m512bh)_mm512_set1_epi32(two);
}

// Tiles of 4 or more rows are bound by their multiply-adds, and the hardware prefetcher alone left the next
// block's codes cold (measured: M = 16 on cold weights 0.37 -> 0.26 ms with this, docs/BENCHMARKS.md); at 1-2
// rows the loop streams and the extra prefetches cost. Column k of the block after `w` (K columns of 8 bytes).
inline void prefetch_next_block(const uint8_t* w, int64_t K, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(w + (K + k) * 8), _MM_HINT_T0);
}

// Independent vdpbf16ps chains for a tile of MT rows: U * MT >= 16 (two issue a cycle at a latency of about 6 on
// AVX-512 BF16 cores; 8 chains left the M = 8 tile at 69% of the bf16 peak, docs/BENCHMARKS.md).
template <int MT>
constexpr int chains() { return MT >= 8 ? 2 : (MT >= 4 ? 4 : 8); }

// finish(m, d) for each of MT rows of x, d = the sum over the column pairs (k, k + 1) of k0..k1-1 of
// x[m][k..k+1] . codes(k), where codes(k, c) fills c[C / 2] with the 16 rows' bf16 weight pairs of columns k..k+C-1
// (C = 2: one pair, unpack_pair; C = 8: four, nibbles and pair_of; k1 - k0 a multiple of C); prefetch(k) runs once
// per 2U columns from k (a tile of 4 or more rows fetches the next block's weights: see prefetch_next_block). The
// sums run in the same order for either C. (finish takes one row's sum at a time: an array of MT sums beside the
// accumulators and the tile's outputs spilled registers at MT = 8, 8% slower.)
template <int MT, int C, typename Codes, typename Prefetch, typename Finish>
inline void group_dots(const uint16_t* const* x, int64_t k0, int64_t k1, Codes codes, Prefetch prefetch,
                       Finish finish) {
  constexpr int U = chains<MT>();
  static_assert((2 * U) % C == 0, "a step of the unrolled loop takes whole sets of C columns");
  __m512 acc[U][MT];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_setzero_ps();
  auto dots = [&](int u, int64_t k, const __m512bh& c) {  // columns k, k + 1 into chain u
    for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_dpbf16_ps(acc[u][m], pair(x[m] + k), c);
  };
  int64_t k = k0;
  for (; k + 2 * U <= k1; k += 2 * U) {
    if constexpr (MT >= 4) prefetch(k);
    for (int h = 0; h < 2 * U / C; ++h) {
      __m512bh c[C / 2];
      codes(k + C * h, c);
      for (int i = 0; i < C / 2; ++i) dots(h * C / 2 + i, k + C * h + 2 * i, c[i]);
    }
  }
  for (; k < k1; k += C) {
    __m512bh c[C / 2];
    codes(k, c);
    for (int i = 0; i < C / 2; ++i) dots(0, k + 2 * i, c[i]);
  }
  for (int m = 0; m < MT; ++m) {
    __m512 d = acc[0][m];
    for (int u = 1; u < U; ++u) d = _mm512_add_ps(d, acc[u][m]);
    finish(m, d);
  }
}

// Rows m0..m0+mt-1 of a block's outputs o[mt][16] into out (fp32) or out_bf16 (rounded to nearest even, as
// torch rounds fp32 to bf16) at columns n0..n0+rows-1 of an [M, N] result.
inline void store_rows(float* out, uint16_t* out_bf16, int64_t N, int64_t n0, int64_t rows, int64_t m0, int64_t mt,
                       const float* o) {
  if (out_bf16 != nullptr) {
    const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
    for (int64_t m = 0; m < mt; ++m) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + m * kRows));
      _mm256_mask_storeu_epi16(out_bf16 + (m0 + m) * N + n0, live, h);
    }
    return;
  }
  for (int64_t m = 0; m < mt; ++m) std::memcpy(out + (m0 + m) * N + n0, o + m * kRows, rows * sizeof(float));
}

// Block b's outputs for every row of x (a.M rows; a.N, a.out and a.out_bf16 of an Args): 8 rows per
// unpacking of the block's codes, then 4, then the rest; tile(std::integral_constant<int, MT>, m0, o) fills
// o[MT][16] with rows m0..m0+MT-1.
template <typename A, typename Tile>
void for_tiles(const A& a, int64_t b, Tile tile) {
  float o[8 * kRows];
  const int64_t n0 = b * kRows, rows = std::min<int64_t>(kRows, a.N - n0);
  auto run = [&](auto mt, int64_t m0) {
    tile(mt, m0, o);
    store_rows(a.out, a.out_bf16, a.N, n0, rows, m0, decltype(mt)::value, o);
  };
  int64_t m0 = 0;
  for (; m0 + 8 <= a.M; m0 += 8) run(std::integral_constant<int, 8>{}, m0);
  for (; m0 + 4 <= a.M; m0 += 4) run(std::integral_constant<int, 4>{}, m0);
  switch (a.M - m0) {
    case 3: run(std::integral_constant<int, 3>{}, m0); break;
    case 2: run(std::integral_constant<int, 2>{}, m0); break;
    case 1: run(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

}  // namespace tiles512

#endif
