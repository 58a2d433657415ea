// The int8-weight linear for bf16 activations on CPUs with AVX-512 VNNI and BF16: x bf16 [M, K] @ W.T -> fp32 or
// bf16 [M, N], W held as int8 codes with one fp32 scale per row and group of input columns (symmetric, as
// llama.cpp's Q8_0): W[n, k] = q[n, k] * s[n, g]. Included by int4_cpu.cpp (QUANTKIT_INT8_W). The engine runs a
// float lm_head through it (kernels/int8_cpu.py): half the bytes of bf16, which a decode step reads in full.
//
// Layout (kernels/int8_cpu.py, Int8Blocked):
//   packed  int8  [NB, K / 4, 16, 4]   NB = ceil(N / 16) blocks of 16 output rows; for each 4 input columns the
//                                      16 rows' four codes side by side: one 64-byte vector, lane i = row i
//   scales  fp32  [NB, G, 16]          per group and row (padded rows: 0)
//   wsum    int32 [NB, G, 16]          per group and row: the sum of its codes
// x is written per row and group as 16-bit fixed point, xq = round(x * 32767 / amax) (amax = max |x| over the
// group, scale sx = amax / 32767), and xq + 32768 as two unsigned bytes (hi, lo), stored by column quad with all
// rows side by side ([K / 4, M, 2] 32-bit words: row m's hi quad, then its lo quad), so a tile reaches every row's
// digits from one pointer. (With two arrays, 16 row pointers for an 8-row tile, the compiler reloaded them from the
// stack every step; the head ran 1.10x faster at M = 8 with this layout, docs/BENCHMARKS.md.) One vpdpbusd multiplies a
// byte of 4 columns' activations by the 16 rows' int8 codes, so two of them (hi and lo) give, exactly in int32,
//   sum_k q * xq = 256 * sum_k q * hi + sum_k q * lo - 32768 * wsum,
// with no conversion of the weights (a bf16 kernel would widen each int8 code to bf16 first: two conversions
// and a pack per 32 codes, which was most of its time from 8 rows on). Groups of at most 128 columns keep
// 256 * sum q * hi below 2^31. The rounding of x to 16 bits (at most amax / 65534 an element, 1/128 of the bf16
// rounding of the largest element) is the only difference from multiplying bf16 x; int8_blocked_reference
// rounds x the same way, and the two agree to fp32 summation order.
#pragma once

#include "tiles_bf16_avx512.h"

#if defined(QUANTKIT_BF16_TILES) && defined(__AVX512VNNI__)
#define QUANTKIT_INT8_W 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>


namespace int8w {

constexpr int kRows = 16;
constexpr int64_t kMaxGroup = 128;

struct Args {
  const uint32_t* xd;    // [K / 4, M, 2]: per column quad and row, the high bytes of xq + 32768, then its low bytes
  const float* sx;       // [M, G]
  const int8_t* w;       // [NB, K / 4, 16, 4]
  const float* s;        // [NB, G, 16]
  const int32_t* wsum;   // [NB, G, 16]
  float* out;            // [M, N] fp32, or null when out_bf16 is set
  uint16_t* out_bf16;    // [M, N] bf16 bits, or null
  int64_t M, K, N, G, gs;
};

// xq + 32768 for 16 values of x (bf16 at p) in 32-bit lanes: xq = round(x * inv) (ties to even) in [-32767, 32767].
inline __m512i offset_codes(const uint16_t* p, __m512 vinv) {
  const __m512i lim = _mm512_set1_epi32(32767);
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(tiles512::widen16(p), vinv));  // rounds to nearest even
  return _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(r, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim)),
                          _mm512_set1_epi32(32768));
}

// The same for one value, as an unsigned 16-bit number.
inline uint32_t offset_code(uint16_t x, float inv) {
  const float r = std::min(32767.f, std::max(-32767.f, std::nearbyint(tiles512::widen1(x) * inv)));
  return static_cast<uint32_t>(static_cast<int32_t>(r) + 32768);
}

// 32767 / amax of a group of n values of x (0 for a group of zeros), and amax / 32767 into *sx.
inline float group_inverse(const uint16_t* p, int64_t n, float* sx) {
  const float amax = tiles512::abs_max(p, n);
  *sx = amax / 32767.f;
  return amax > 0.f ? 32767.f / amax : 0.f;
}

// x bf16 [M, K] -> the digits of xq + 32768 (xd [K / 4, M, 2], as Args::xd) and sx [M, G], per row and group of gs
// columns (gs a multiple of 4; a multiple of 16 or not: the tail runs scalar). xq = round(x * 32767 / amax), ties
// to even, in [-32767, 32767]; a group of zeros: sx 0, xq 0.
inline void digits(const uint16_t* x, int64_t M, int64_t K, int64_t gs, uint32_t* xd, float* sx) {
  const int64_t G = K / gs;
  const __m512i byte = _mm512_set1_epi32(255);
  auto quad = [&](int64_t m, int64_t c) { return xd + (c / 4 * M + m) * 2; };  // row m's words for columns c..c+3
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = g * gs;
      const uint16_t* p = x + m * K + at;
      const float inv = group_inverse(p, gs, sx + m * G + g);
      const __m512 vinv = _mm512_set1_ps(inv);
      int64_t c = 0;
      for (; c + 16 <= gs; c += 16) {
        const __m512i r = offset_codes(p + c, vinv);
        const __m128i hi = _mm512_cvtepi32_epi8(_mm512_srli_epi32(r, 8));
        const __m128i lo = _mm512_cvtepi32_epi8(_mm512_and_si512(r, byte));
        // (hi, lo) of quads 0 and 1, then of quads 2 and 3
        const __m128i q01 = _mm_unpacklo_epi32(hi, lo), q23 = _mm_unpackhi_epi32(hi, lo);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(quad(m, at + c)), q01);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(quad(m, at + c + 4)), _mm_unpackhi_epi64(q01, q01));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(quad(m, at + c + 8)), q23);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(quad(m, at + c + 12)), _mm_unpackhi_epi64(q23, q23));
      }
      for (; c < gs; ++c) {
        const uint32_t u = offset_code(p[c], inv), shift = 8 * ((at + c) % 4);
        uint32_t* w = quad(m, at + c);
        w[0] = (w[0] & ~(255u << shift)) | (u >> 8) << shift;
        w[1] = (w[1] & ~(255u << shift)) | (u & 255) << shift;
      }
    }
}

// Rows m0..m0+MT-1 of x against block b: o[MT][16] receives the block's outputs (MT <= 8).
template <int MT>
void tile(const Args& a, int64_t b, int64_t m0, float* o) {
  // column quads in flight: 2 * U * MT >= 16 independent vpdpbusd chains (a hi and a lo one per row)
  constexpr int U = MT >= 8 ? 1 : (MT >= 4 ? 2 : 4);
  const int8_t* w = a.w + b * a.K * kRows;
  const float* s = a.s + b * a.G * kRows;
  const int32_t* ws = a.wsum + b * a.G * kRows;
  const int64_t stride = 2 * a.M;  // words from one column quad's digits to the next
  __m512 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i ah[U][MT], al[U][MT];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MT; ++m) ah[u][m] = al[u][m] = _mm512_setzero_si512();
    const int64_t k1 = (g + 1) * a.gs;
    int64_t k = g * a.gs;
    auto step = [&](int u, int64_t kk) {
      const __m512i codes = _mm512_loadu_si512(w + kk * kRows);
      const uint32_t* d = a.xd + kk / 4 * stride + 2 * m0;
      for (int m = 0; m < MT; ++m) {
        ah[u][m] = _mm512_dpbusd_epi32(ah[u][m], _mm512_set1_epi32(d[2 * m]), codes);
        al[u][m] = _mm512_dpbusd_epi32(al[u][m], _mm512_set1_epi32(d[2 * m + 1]), codes);
      }
    };
    for (; k + 4 * U <= k1; k += 4 * U) {
      if constexpr (MT >= 4) {  // the next block's lines for these columns (64 bytes a quad), as the int4 tiles do
        for (int u = 0; u < U; ++u)
          _mm_prefetch(reinterpret_cast<const char*>(w + (a.K + k + 4 * u) * kRows), _MM_HINT_T0);
      }
      for (int u = 0; u < U; ++u) step(u, k + 4 * u);
    }
    for (; k < k1; k += 4) step(0, k);
    const __m512 scale = _mm512_loadu_ps(s + g * kRows);
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(ws + g * kRows), 15);  // 32768 * wsum
    for (int m = 0; m < MT; ++m) {
      __m512i h = ah[0][m], l = al[0][m];
      for (int u = 1; u < U; ++u) {
        h = _mm512_add_epi32(h, ah[u][m]);
        l = _mm512_add_epi32(l, al[u][m]);
      }
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l), offset);  // sum q * xq
      const __m512 sx = _mm512_set1_ps(a.sx[(m0 + m) * a.G + g]);
      out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, sx), out[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(o + m * kRows, out[m]);
}

inline void block(const Args& a, int64_t b) {
  tiles512::for_tiles(a, b, [&](auto mt, int64_t m0, float* o) { tile<decltype(mt)::value>(a, b, m0, o); });
}

}  // namespace int8w

#endif
