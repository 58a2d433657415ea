// The int8-weight linear for fp32 activations on every CPU the extension builds for (AVX2 + FMA): x fp32 [M, K]
// @ W.T -> fp32 [M, N], W held as int8 codes with one fp32 scale per row and group of input columns (symmetric, as
// llama.cpp's Q8_0): W[n, k] = q[n, k] * s[n, g]. Included by int4_cpu.cpp. The fp32 engine (CPUs without native
// bf16) runs a 4-bit checkpoint's float lm_head through it: a quarter of the bytes of fp32, half of bf16, and a
// decode step reads the whole head (at vocabulary 128256 and hidden 2048, 1 GiB in fp32: twice the 4-bit layers).
//
// Layout: int8_bf16_avx512.h's (kernels/int8_cpu.py, Int8Blocked): packed int8 [NB, K / 4, 16, 4], for each 4
// input columns the 16 rows' four codes side by side; scales fp32 [NB, G, 16]. The code sums (wsum) are not read.
// x is written per row and group as 16-bit fixed point (vec2::quantize16), as the AVX-512 kernel writes it. A step
// takes one column quad of four output rows: 16 codes widened to int16 (vpmovsxbw) and one vpmaddwd against the row
// of x's 4 digits broadcast gives, per row, two int32 partial sums (columns 0-1 and 2-3); the group's sums are exact
// in int32 (at most 2 * 127 * 32767 * 32 < 2^31 a lane), so the result is int8_blocked_reference's up to fp32
// summation order, and each group is scaled in the same order as the AVX-512 kernel's (fma of the integer sum by
// s * sx into the row's fp32 total).
#pragma once

#include <immintrin.h>

#include "vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace int8f {

constexpr int kRows = 16;
constexpr int64_t kMaxGroup = 128;

struct Args {
  const int16_t* xq;  // [M, K] 16-bit codes of x
  const float* sx;    // [M, G]
  const int8_t* w;    // [NB, K / 4, 16, 4]
  const float* s;     // [NB, G, 16]
  float* out;         // [M, N]
  int64_t M, K, N, G, gs;
};

// The 16 rows' sums of one row of x over a group, from the four accumulators of 4 rows x 2 column pairs each:
// rows 0-7 into lo, 8-15 into hi.
inline void row_sums(const __m256i acc[4], __m256i& lo, __m256i& hi) {
  // hadd gives rows (0, 1, 4, 5 | 2, 3, 6, 7); the 64-bit permute puts them in order
  lo = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), 0xD8);
  hi = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2], acc[3]), 0xD8);
}

// Rows m0..m0+MT-1 of x (MT <= 2: 4 int32 accumulators a row, with the codes, fill the 16 registers) against block
// b: o[MT][16] receives the block's outputs.
template <int MT>
void tile(const Args& a, int64_t b, int64_t m0, float* o) {
  const int8_t* w = a.w + b * a.K * kRows;
  const float* s = a.s + b * a.G * kRows;
  __m256 out[MT][2];
  for (int m = 0; m < MT; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_si256();
    for (int64_t k = g * a.gs, k1 = k + a.gs; k < k1; k += 4) {
      const int8_t* quad = w + k * kRows;  // 64 bytes: 16 rows x 4 codes
      __m256i codes[4];
      for (int j = 0; j < 4; ++j)
        codes[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quad + 16 * j)));
      for (int m = 0; m < MT; ++m) {
        int64_t digits;
        std::memcpy(&digits, a.xq + (m0 + m) * a.K + k, sizeof(digits));
        const __m256i xb = _mm256_set1_epi64x(digits);
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(codes[j], xb));
      }
    }
    const __m256 s0 = _mm256_loadu_ps(s + g * kRows), s1 = _mm256_loadu_ps(s + g * kRows + 8);
    for (int m = 0; m < MT; ++m) {
      __m256i lo, hi;
      row_sums(acc[m], lo, hi);
      const __m256 sx = _mm256_set1_ps(a.sx[(m0 + m) * a.G + g]);
      out[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, sx), out[m][0]);
      out[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s1, sx), out[m][1]);
    }
  }
  vec2::store_tile<MT>(o, out);
}

inline void block(const Args& a, int64_t b) {
  vec2::rows_in_pairs(a.out, a.N, b, a.M,
                      [&](auto mt, int64_t m0, float* o) { tile<decltype(mt)::value>(a, b, m0, o); });
}

}  // namespace int8f
