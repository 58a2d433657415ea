// The int8-weight linear for bf16 activations on CPUs with AVX-512 BF16 (vdpbf16ps): x bf16 [M, K] @ W.T ->
// fp32 or bf16 [M, N], W held as int8 codes with one fp32 scale per row and group of input columns (symmetric,
// as llama.cpp's Q8_0): W[n, k] = q[n, k] * s[n, g]. Included by int4_cpu.cpp; compiled with the bf16 int4
// kernel (QUANTKIT_INT4_BF16). The engine runs a float lm_head through it (kernels/int8_cpu.py): half the bytes
// of bf16, which a decode step reads in full.
//
// Layout (kernels/int8_cpu.py, Int8Blocked):
//   packed  int8 [NB, K / 2, 16, 2]   NB = ceil(N / 16) blocks of 16 output rows; for each column pair
//                                     (k, k + 1) the 16 rows' two codes side by side: 32 bytes
//   scales  fp32 [NB, G, 16]          per group and row (padded rows: 0)
// One column pair becomes the 32 bf16 lanes of a vdpbf16ps by two sign extensions to int32, two conversions
// to fp32 and one conversion of both to bf16 (lane pair i: row i's codes for k, k + 1). Codes are integers in
// [-127, 127], exact in bf16; products of bf16 values are exact in fp32 and the sums are fp32, so the result
// differs from the fp32 reference only by the order of the sums.
#pragma once

#if defined(QUANTKIT_INT4_BF16)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int4_bf16_avx512.h"

namespace int8bf16 {

constexpr int kRows = 16;

struct Args {
  const uint16_t* x;   // bf16 bits [M, K]
  const int8_t* w;     // [NB, K / 2, 16, 2]
  const float* s;      // [NB, G, 16]
  float* out;          // [M, N] fp32, or null when out_bf16 is set
  uint16_t* out_bf16;  // [M, N] bf16 bits, or null
  int64_t M, K, N, G, gs;
};

// The 32 codes of one column pair (rows 0..15, two columns each) -> bf16 lanes in the same order.
inline __m512bh widen_pair(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from lo (rows 0..7), 16..31 from hi (rows 8..15)
}

// Rows m0..m0+MT-1 of x against block b: o[MT][16] receives the block's outputs (MT <= 8).
template <int MT>
void tile(const Args& a, int64_t b, int64_t m0, float* o) {
  const int8_t* w = a.w + b * a.K * kRows;
  const float* s = a.s + b * a.G * kRows;
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  __m512 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const __m512 scale = _mm512_loadu_ps(s + g * kRows);
    // the next block's lines for the 2U columns from k (32 bytes a column pair, U = 2 or 4 past 4 rows)
    int4bf16::group_dots<MT>(
        x, g * a.gs, (g + 1) * a.gs, [&](int64_t k) { return widen_pair(w + k * kRows); },
        [&](int64_t k) {
          for (int off = 0; off < int4bf16::chains<MT>() * 32; off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + (a.K + k) * kRows + off), _MM_HINT_T0);
        },
        [&](int m, __m512 d) { out[m] = _mm512_fmadd_ps(d, scale, out[m]); });
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(o + m * kRows, out[m]);
}

inline void block(const Args& a, int64_t b) {
  int4bf16::for_tiles(a, b, [&](auto mt, int64_t m0, float* o) { tile<decltype(mt)::value>(a, b, m0, o); });
}

}  // namespace int8bf16

#endif
