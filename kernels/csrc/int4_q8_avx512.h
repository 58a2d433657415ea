// The int4 linear with int8 activations (W4A8) on CPUs with AVX-512 VNNI and VBMI: x bf16 [M, K] is
// quantized per row and group (the weight's groups) to int8 with the scale max|x| / 127, then multiplied with
// the 4-bit codes by vpdpbusd, on the same packed layout as int4_cpu.cpp (Int4Blocked). Included by
// int4_cpu.cpp; compiled where the compiler targets AVX-512 VNNI, VBMI, BW, VL and BF16 (QUANTKIT_INT4_Q8).
//
// One vpdpbusd multiplies 16 output rows by four input columns: lane i accumulates in int32
//   sum_c code(i, k + c) * xq[k + c],  c = 0..3,
// u8 codes against s8 activations, 64 multiply-adds an instruction (vdpbf16ps: 32). The codes of a block for
// columns k..k+3 (32 packed bytes) become the 64 lane bytes by a mask, a shift and one byte permutation. For a
// group g of a row m, with the activation scale sx and the integer sum xqsum of its quantized x:
//   out[m, n] += s[n, g] * sx[m, g] * (sum_k code * xq - z[n, g] * xqsum[m, g]),
// the same identity as the bf16 and fp32 kernels with x replaced by xq * sx. The int32 sums are exact; the error
// against W4A16 is x's rounding to 8 bits (at most sx / 2 an element), which int4_q8_reference reproduces.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define QUANTKIT_INT4_Q8 1

#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tiles_bf16_avx512.h"

namespace int4q8 {

constexpr int kRows = 16;

template <typename T>
struct Args {
  const int8_t* xq;    // [M, K]
  const float* sx;     // [M, G]: the activation scale of each row and group
  const float* xqsum;  // [M, G]: the sum of xq over the group
  const uint8_t* w;    // [NB, K, 8]
  const T* sz;         // [NB, G, 2, 16]
  float* out;          // [M, N] fp32, or null when out_bf16 is set
  uint16_t* out_bf16;  // [M, N] bf16 bits, or null
  int64_t M, K, N, G, gs;
};

// x bf16 [M, K] -> xq [M, K] = round(x * 127 / amax) (ties to even), sx = amax / 127 and xqsum per (row, group);
// amax = max |x| over the group (a group of zeros: scale 0, codes 0).
inline void quantize(const uint16_t* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* sx, float* xqsum) {
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + m * K + g * gs;
      int8_t* q = xq + m * K + g * gs;
      const float amax = tiles512::abs_max(p, gs);
      int64_t c = 0;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
      for (c = 0; c + 16 <= gs; c += 16) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(tiles512::widen16(p + c), vinv));  // rounds to nearest even
        sum = _mm512_add_epi32(sum, r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtsepi32_epi8(r));
      }
      int32_t total = _mm512_reduce_add_epi32(sum);
      for (; c < gs; ++c) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(tiles512::widen1(p[c]) * inv));
        q[c] = static_cast<int8_t>(r);
        total += r;
      }
      sx[m * G + g] = amax / 127.f;
      xqsum[m * G + g] = static_cast<float>(total);
    }
}

// The byte permutation of unpack_quad: lane byte 4i + c <- code (row i, column k + c) of the masked halves.
struct QuadIndex {
  alignas(64) uint8_t v[64];
  QuadIndex() {
    for (int b = 0; b < 64; ++b) {
      const int i = b / 4, c = b % 4;
      v[b] = static_cast<uint8_t>(i < 8 ? c * 8 + i : 32 + c * 8 + (i - 8));
    }
  }
};

inline __m512i quad_index() {
  static const QuadIndex index;
  return _mm512_load_si512(index.v);
}

// Columns k..k+3 of one block (32 bytes at p = block + k * 8: byte c * 8 + j holds row j in the low nibble and
// row j + 8 in the high one, for column k + c) -> lane i: the 4 codes (row i, columns k..k+3) as bytes.
inline __m512i unpack_quad(const uint8_t* p, __m512i index) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                            _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
  return _mm512_permutexvar_epi8(index, halves);
}

inline __m512i quad(const int8_t* x) {  // (xq[k], .., xq[k + 3]) in every lane
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm512_set1_epi32(four);
}

// Rows m0..m0+MT-1 of xq against block b: o[MT][16] receives the block's outputs (MT <= 8).
template <int MT, typename T>
void tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  constexpr int U = MT >= 8 ? 2 : (MT >= 4 ? 4 : 8);  // independent vpdpbusd chains: U * MT >= 16
  const __m512i index = quad_index();
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  [[maybe_unused]] const int64_t ahead = MT >= 4 ? 0 : stream::ahead();
  const int8_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.xq + (m0 + m) * a.K;
  __m512 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i acc[U][MT];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_setzero_si512();
    const int64_t k0 = g * a.gs, k1 = k0 + a.gs;
    int64_t k = k0;
    for (; k + 4 * U <= k1; k += 4 * U) {
      if constexpr (MT >= 4) {
        tiles512::prefetch_next_block(w, a.K, k);
      } else {  // 1-3 rows stream: a 64-byte line every two quads (stream::prefetch)
        for (int u = 0; u < U; u += 2) stream::prefetch(w + (k + 4 * u) * 8, ahead);
      }
      for (int u = 0; u < U; ++u) {
        const __m512i codes = unpack_quad(w + (k + 4 * u) * 8, index);
        for (int m = 0; m < MT; ++m) acc[u][m] = _mm512_dpbusd_epi32(acc[u][m], codes, quad(x[m] + k + 4 * u));
      }
    }
    for (; k < k1; k += 4) {
      const __m512i codes = unpack_quad(w + k * 8, index);
      for (int m = 0; m < MT; ++m) acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], codes, quad(x[m] + k));
    }
    const T* s = sz + g * 2 * kRows;
    const __m512 scale = tiles512::load16(s), zero = tiles512::load16(s + kRows);
    for (int m = 0; m < MT; ++m) {
      __m512i d = acc[0][m];
      for (int u = 1; u < U; ++u) d = _mm512_add_epi32(d, acc[u][m]);
      const int64_t i = (m0 + m) * a.G + g;
      const __m512 dot = _mm512_fnmadd_ps(_mm512_set1_ps(a.xqsum[i]), zero, _mm512_cvtepi32_ps(d));
      out[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(a.sx[i])), out[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(o + m * kRows, out[m]);
}

template <typename T>
void block(const Args<T>& a, int64_t b) {
  tiles512::for_tiles(a, b, [&](auto mt, int64_t m0, float* o) { tile<decltype(mt)::value>(a, b, m0, o); });
}

}  // namespace int4q8

#endif
