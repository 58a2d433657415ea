// Small AVX2 helpers the fp32 kernels share (int4_avx2.h, int4_q8_avx2.h, int8_f32_avx2.h), as vec_avx512.h does for
// the AVX-512 ones.
#pragma once

#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace vec2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// max |p[i]| over n floats.
inline float abs_max(const float* p, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

// The sum of the 8 int32 lanes of v.
inline int32_t sum8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// o[mt][16] (a tile's rows m0.. against the 16-row block b) into out [M, N] at rows m0.., columns 16b.., dropping
// columns past N.
inline void store_rows(float* out, int64_t N, int64_t b, int64_t m0, int64_t mt, const float* o) {
  const int64_t n0 = b * 16, cols = std::min<int64_t>(16, N - n0);
  for (int64_t m = 0; m < mt; ++m) std::memcpy(out + (m0 + m) * N + n0, o + m * 16, cols * sizeof(float));
}

}  // namespace vec2
