// The int4 linear with int8 activations (W4A8) for fp32 activations on every CPU the extension builds for (AVX2 +
// FMA): x fp32 [M, K] is quantized per row and group (the weight's groups) to int8 with the scale max|x| / 127, then
// multiplied with the 4-bit codes by vpmaddubsw, on the same packed layout as int4_cpu.cpp (Int4Blocked). Included by
// int4_cpu.cpp. The arithmetic of int4_q8_avx512.h (and of llama.cpp's AVX2 Q4 x Q8 dot products): the int32 sums
// are exact, and each group is scaled in the same order, so the two kernels give the same bits on x exact in bf16;
// int4_q8_reference is the oracle.
//
// A step takes one column quad of a block (32 packed bytes: byte c * 8 + j holds row j in its low nibble and row
// j + 8 in its high one, for column k + c). A mask (and a shift) give each half's codes as bytes, and one byte
// interleave puts (column k, k + 1) of every row side by side in the low 128-bit lane and (k + 2, k + 3) in the high
// one; one vpmaddubsw (u8 codes x s8 activations, each lane's pair of x broadcast) gives 16 int16 sums of two
// products, at most 2 * 15 * 127 = 3810 in magnitude, so eight quads add up in int16 (30480) before they are widened
// to int32, the two lanes (column pairs) of a row added.
#pragma once

#include <immintrin.h>

#include <c10/util/Half.h>

#include "vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace int4q8avx2 {

constexpr int kRows = 16;
constexpr int kQuadsInt16 = 8;  // quads whose vpmaddubsw sums an int16 lane holds (8 * 3810 < 32767)

template <typename T>
struct Args {
  const int8_t* xq;    // [M, K]
  const float* sx;     // [M, G]: the activation scale of each row and group
  const float* xqsum;  // [M, G]: the sum of xq over the group
  const uint8_t* w;    // [NB, K, 8]
  const T* sz;         // [NB, G, 2, 16]
  float* out;          // [M, N]
  int64_t M, K, N, G, gs;
};

using vec2::load8;

// x fp32 [M, K] -> xq [M, K] = round(x * 127 / amax) (ties to even), sx = amax / 127 and xqsum per (row, group);
// amax = max |x| over the group (a group of zeros: scale 0, codes 0). quantize_activations_reference.
inline void quantize(const float* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* sx, float* xqsum) {
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + m * K + g * gs;
      int8_t* q = xq + m * K + g * gs;
      const float amax = vec2::abs_max(p, gs);
      int64_t c = 0;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i sum = _mm256_setzero_si256();
      for (c = 0; c + 8 <= gs; c += 8) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + c), vinv));  // rounds to nearest even
        sum = _mm256_add_epi32(sum, r);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + c), _mm_packs_epi16(w16, w16));
      }
      int32_t total = vec2::sum8(sum);
      for (; c < gs; ++c) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(p[c] * inv));
        q[c] = static_cast<int8_t>(r);
        total += r;
      }
      sx[m * G + g] = amax / 127.f;
      xqsum[m * G + g] = static_cast<float>(total);
    }
}

// (x[k], x[k + 1]) in every 16-bit lane of the low half, (x[k + 2], x[k + 3]) in the high one.
inline __m256i pairs(const int8_t* x, __m256i spread) {
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread);
}

// Columns k..k+3 of one block (32 bytes at p) -> the codes of rows 0-7 (lo) and 8-15 (hi): in each, row i's codes
// of columns k, k + 1 at bytes 2i, 2i + 1 of the low lane, of columns k + 2, k + 3 in the high lane.
inline void unpack_quad(const uint8_t* p, __m256i low4, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i a = _mm256_and_si256(v, low4), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  lo = _mm256_unpacklo_epi8(a, _mm256_bsrli_epi128(a, 8));
  hi = _mm256_unpacklo_epi8(b, _mm256_bsrli_epi128(b, 8));
}

// Rows 0-7 of the int32 sums: the two lanes' int16 sums (columns k, k + 1 and k + 2, k + 3) of each row added.
inline __m256i widen(__m256i s) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
}

// Rows m0..m0+MT-1 of xq against block b: o[MT][16] receives the block's outputs.
template <int MT, typename T>
void tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const int8_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.xq + (m0 + m) * a.K;
  __m256 out[MT][2];
  for (int m = 0; m < MT; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    const int64_t k1 = (g + 1) * a.gs;
    for (int64_t k = g * a.gs; k < k1;) {
      __m256i s16[MT][2];
      for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
      for (const int64_t end = std::min(k1, k + 4 * kQuadsInt16); k < end; k += 4) {
        __m256i lo, hi;
        unpack_quad(w + k * 8, low4, lo, hi);
        for (int m = 0; m < MT; ++m) {
          const __m256i xb = pairs(x[m] + k, spread);
          s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(lo, xb));
          s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(hi, xb));
        }
      }
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = _mm256_add_epi32(acc[m][0], widen(s16[m][0]));
        acc[m][1] = _mm256_add_epi32(acc[m][1], widen(s16[m][1]));
      }
    }
    const T* s = sz + g * 2 * kRows;
    const __m256 s0 = load8(s), s1 = load8(s + 8), z0 = load8(s + kRows), z1 = load8(s + kRows + 8);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * a.G + g;
      const __m256 xs = _mm256_set1_ps(a.xqsum[i]), sx = _mm256_set1_ps(a.sx[i]);
      const __m256 d0 = _mm256_fnmadd_ps(xs, z0, _mm256_cvtepi32_ps(acc[m][0]));
      const __m256 d1 = _mm256_fnmadd_ps(xs, z1, _mm256_cvtepi32_ps(acc[m][1]));
      out[m][0] = _mm256_fmadd_ps(d0, _mm256_mul_ps(s0, sx), out[m][0]);
      out[m][1] = _mm256_fmadd_ps(d1, _mm256_mul_ps(s1, sx), out[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(o + m * kRows, out[m][0]);
    _mm256_storeu_ps(o + m * kRows + 8, out[m][1]);
  }
}

template <typename T>
void block(const Args<T>& a, int64_t b) {
  float o[4 * kRows];
  auto store = [&](int64_t m0, int64_t mt) { vec2::store_rows(a.out, a.N, b, m0, mt, o); };
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4) { tile<4>(a, b, m0, o); store(m0, 4); }
  if (m0 + 2 <= a.M) { tile<2>(a, b, m0, o); store(m0, 2); m0 += 2; }
  if (m0 < a.M) { tile<1>(a, b, m0, o); store(m0, 1); }
}

}  // namespace int4q8avx2
