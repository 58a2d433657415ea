// The AVX2 + FMA int4 linear's tiles (int4_cpu.cpp's header comment explains the layout and the sums): x fp32 [M, K]
// @ W.T -> fp32 [M, N] on the Int4Blocked layout, one 16-row block at a time. Shared by int4_cpu.cpp (int4_linear) and
// moe_int4_cpu.cpp (the grouped experts in fp32).
#pragma once

#include <immintrin.h>

#include <c10/util/Half.h>

#include "vec_avx2.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace int4avx2 {

constexpr int kRows = 16;

template <typename T>
struct Args {
  const float* x;      // [M, K]
  const float* xsum;   // [M, G]
  const uint8_t* w;    // [NB, K, 8]
  const T* sz;         // [NB, G, 2, 16]
  float* out;          // [M, N]
  int64_t M, K, N, G, gs;
};

using vec2::load8;

inline void unpack16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

// Rows m0..m0+MT-1 of x against block b: o[MT][16] accumulates the block's outputs.
template <int MT, typename T>
void tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  constexpr int U = MT >= 4 ? 1 : (MT >= 2 ? 2 : 4);
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const float* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  __m256 out[MT][2];
  for (int m = 0; m < MT; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 acc[U][MT][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MT; ++m) acc[u][m][0] = acc[u][m][1] = _mm256_setzero_ps();
    const int64_t k0 = g * a.gs, k1 = k0 + a.gs;
    int64_t k = k0;
    for (; k + U <= k1; k += U) {
      for (int u = 0; u < U; ++u) {
        __m256 lo, hi;
        unpack16(w + (k + u) * 8, lo, hi);
        for (int m = 0; m < MT; ++m) {
          const __m256 xb = _mm256_broadcast_ss(x[m] + k + u);
          acc[u][m][0] = _mm256_fmadd_ps(xb, lo, acc[u][m][0]);
          acc[u][m][1] = _mm256_fmadd_ps(xb, hi, acc[u][m][1]);
        }
      }
    }
    for (; k < k1; ++k) {
      __m256 lo, hi;
      unpack16(w + k * 8, lo, hi);
      for (int m = 0; m < MT; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x[m] + k);
        acc[0][m][0] = _mm256_fmadd_ps(xb, lo, acc[0][m][0]);
        acc[0][m][1] = _mm256_fmadd_ps(xb, hi, acc[0][m][1]);
      }
    }
    const T* s = sz + g * 2 * kRows;
    const __m256 s0 = load8(s), s1 = load8(s + 8), z0 = load8(s + 16), z1 = load8(s + 24);
    for (int m = 0; m < MT; ++m) {
      __m256 d0 = acc[0][m][0], d1 = acc[0][m][1];
      for (int u = 1; u < U; ++u) {
        d0 = _mm256_add_ps(d0, acc[u][m][0]);
        d1 = _mm256_add_ps(d1, acc[u][m][1]);
      }
      const __m256 xs = _mm256_broadcast_ss(a.xsum + (m0 + m) * a.G + g);
      out[m][0] = _mm256_fmadd_ps(_mm256_fnmadd_ps(xs, z0, d0), s0, out[m][0]);
      out[m][1] = _mm256_fmadd_ps(_mm256_fnmadd_ps(xs, z1, d1), s1, out[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(o + m * kRows, out[m][0]);
    _mm256_storeu_ps(o + m * kRows + 8, out[m][1]);
  }
}

// Write o[mt][16] into out[m0.., 16b..], dropping rows past N.
template <typename T>
void store(const Args<T>& a, int64_t b, int64_t m0, int64_t mt, const float* o) {
  vec2::store_rows(a.out, a.N, b, m0, mt, o);
}

template <typename T>
void block(const Args<T>& a, int64_t b) {
  float o[4 * kRows];
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4) { tile<4>(a, b, m0, o); store(a, b, m0, 4, o); }
  switch (a.M - m0) {
    case 3: tile<3>(a, b, m0, o); store(a, b, m0, 3, o); break;
    case 2: tile<2>(a, b, m0, o); store(a, b, m0, 2, o); break;
    case 1: tile<1>(a, b, m0, o); store(a, b, m0, 1, o); break;
    default: break;
  }
}

}  // namespace int4avx2
