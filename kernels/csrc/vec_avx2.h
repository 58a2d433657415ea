// Small AVX2 helpers the fp32 kernels share (int4_avx2.h, int4_x16_avx2.h, int4_q8_avx2.h, int8_f32_avx2.h,
// attention_avx2.h), as vec_avx512.h does for the AVX-512 ones.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "exp_poly.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace vec2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // the top 16 bits of an fp32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// The largest of the 8 fp32 lanes of v.
inline float max8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// The sum of the 8 fp32 lanes of v.
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// max |p[i]| over n floats.
inline float abs_max(const float* p, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
  float m = max8(v);
  for (; i < n; ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

// The first 32-byte aligned address of v resized to hold n elements past it (a scratch buffer the kernels load and
// store whole vectors from; std::vector<__m256> would align it too, with a warning that its attributes are dropped).
template <typename T>
inline T* aligned32(std::vector<T>& v, size_t n) {
  v.resize(n + 32 / sizeof(T));
  const auto p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 31) & ~static_cast<uintptr_t>(31));
}

// e^x lane-wise (exp_poly.h), times 2^n built in the exponent bits of two factors (2^(n/2) 2^(n - n/2), so that e^x
// overflows to inf where fp32 does). x is clamped to [-87, 89]: below, about 1e-38 where e^x is subnormal or 0; above,
// inf as for every x past 88.73.
inline __m256 exp8(__m256 x) {
  using namespace exppoly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kTaylor[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}

// The sum of the 8 int32 lanes of v.
inline int32_t sum8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// x fp32 [M, K] -> xq int16 [M, K] and sx [M, G], per row and group of gs columns: xq = round(x * 32767 / amax),
// ties to even, in [-32767, 32767]; a group of zeros: sx 0, xq 0 (quantize_activations16_reference). With xqsum, also
// each group's sum of xq ([M, G]).
inline void quantize16(const float* x, int64_t M, int64_t K, int64_t gs, int16_t* xq, float* sx,
                       float* xqsum = nullptr) {
  const int64_t G = K / gs;
  const __m256i lim = _mm256_set1_epi32(32767), neg = _mm256_set1_epi32(-32767);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + m * K + g * gs;
      int16_t* q = xq + m * K + g * gs;
      const float amax = abs_max(p, gs);
      sx[m * G + g] = amax / 32767.f;
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i sum = _mm256_setzero_si256();
      int64_t c = 0;
      for (; c + 8 <= gs; c += 8) {  // cvtps rounds to nearest even
        const __m256i r = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + c),
                                                                                             vinv)), lim), neg);
        sum = _mm256_add_epi32(sum, r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c),
                         _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
      }
      int64_t total = sum8(sum);
      for (; c < gs; ++c) {
        q[c] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, std::nearbyint(p[c] * inv))));
        total += q[c];
      }
      if (xqsum != nullptr) xqsum[m * G + g] = static_cast<float>(total);
    }
}

// o[mt][16] (a tile's rows m0.. against the 16-row block b) into out [M, N] at rows m0.., columns 16b.., dropping
// columns past N.
inline void store_rows(float* out, int64_t N, int64_t b, int64_t m0, int64_t mt, const float* o) {
  const int64_t n0 = b * 16, cols = std::min<int64_t>(16, N - n0);
  for (int64_t m = 0; m < mt; ++m) std::memcpy(out + (m0 + m) * N + n0, o + m * 16, cols * sizeof(float));
}

// What the integer-activation int4 kernels (int4_q8_avx2.h: D int8; int4_x16_avx2.h: D int16) read: x's digits and
// per-(row, group) scale and digit sum, the Int4Blocked weight with its scales and zeros (T fp16 or fp32), the output.
template <typename D, typename T>
struct IntArgs {
  const D* xq;         // [M, K] (int4_x16_avx2.h: [M, 4K], each quad of columns spread by its quantize)
  const float* sx;     // [M, G]: the scale of each row and group
  const float* xqsum;  // [M, G]: the sum of xq over the group
  const uint8_t* w;    // [NB, K, 8]
  const T* sz;         // [NB, G, 2, 16]
  float* out;          // [M, N]
  int64_t M, K, N, G, gs;
};

// A row's 16 outputs (out[0]: rows 0-7, out[1]: rows 8-15) += (sums - z * xqsum) * s * sx: one group of the integer-
// activation kernels (int4_q8_avx2.h, int4_x16_avx2.h), each group's exact int32 sums scaled in the same order.
inline void add_group(__m256i lo, __m256i hi, float xqsum, float sx, __m256 s0, __m256 s1, __m256 z0, __m256 z1,
                      __m256 (&out)[2]) {
  const __m256 xs = _mm256_set1_ps(xqsum), vsx = _mm256_set1_ps(sx);
  out[0] = _mm256_fmadd_ps(_mm256_fnmadd_ps(xs, z0, _mm256_cvtepi32_ps(lo)), _mm256_mul_ps(s0, vsx), out[0]);
  out[1] = _mm256_fmadd_ps(_mm256_fnmadd_ps(xs, z1, _mm256_cvtepi32_ps(hi)), _mm256_mul_ps(s1, vsx), out[1]);
}

// A tile's MT rows of 16 outputs into o[MT][16].
template <int MT>
inline void store_tile(float* o, const __m256 (&out)[MT][2]) {
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(o + m * 16, out[m][0]);
    _mm256_storeu_ps(o + m * 16 + 8, out[m][1]);
  }
}

// Rows [0, M) of x against the 16-row block b in tiles of 2 rows, then 1 (the 16-bit kernels: four int32 accumulators
// a row fill the registers at 2): tile(std::integral_constant<int, MT>, m0, o) computes o[MT][16], stored into out.
template <typename Tile>
inline void rows_in_pairs(float* out, int64_t N, int64_t b, int64_t M, Tile tile) {
  float o[2 * 16];
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) {
    tile(std::integral_constant<int, 2>{}, m0, o);
    store_rows(out, N, b, m0, 2, o);
  }
  if (m0 < M) {
    tile(std::integral_constant<int, 1>{}, m0, o);
    store_rows(out, N, b, m0, 1, o);
  }
}

}  // namespace vec2
