// The int4 linear's decode-sized tiles for fp32 activations (AVX2): x fp32 [M, K] is written per row and group (the
// weight's groups) as 16-bit fixed point, xq = round(x * 32767 / amax) with the scale amax / 32767 (the int8 lm_head's
// digits, vec2::quantize16: at most amax / 65534 from x, finer than bf16 for every value above amax / 128), and
// multiplied with the 4-bit codes by vpmaddwd, on the Int4Blocked layout of int4_cpu.cpp. Included by int4_cpu.cpp,
// whose int4_linear runs these tiles for a few rows (batch-1 decode) and int4_avx2.h's fp32 FMA tiles from there on.
//
// Why: the FMA tiles spend a widening, a mask or shift and a conversion to fp32 on every 8 codes before the one FMA
// that uses them; at one row of x nothing amortizes that, so they read the codes at a third of the memory bandwidth
// (docs/BENCHMARKS.md, "On the EPYC AVX2"). Here one column quad of a block (32 packed bytes: byte c * 8 + j holds
// row j in its low nibble and row j + 8 in its high one, for column k + c) is spread by two in-lane byte shuffles
// into 16-bit words (a row's two columns of each lane side by side); a shift gives the high nibbles, and four vpmaddwd
// against x's four digits (spread once a call by quantize, one load a quad) give 64 products as int32 sums of two,
// each lane one column pair, added at the group's end. (A cross-lane dword permute of the codes, which put a row's
// four columns in one lane, cost more than the rest of the quad's unpacking on Zen 3.) A quad is then 12 vector
// operations, two loads and a prefetch (stream_ahead.h): about 3 cycles on Zen 3 from L1, where its
// four ALU pipes are the limit. A group's sums are exact in int32 (at most 15 * 32767 a column: groups up to kMaxGroup
// columns), then scaled as int4_q8_avx2.h scales its own: out += (sum - z * sum(xq)) * s * sx.
#pragma once

#include <immintrin.h>

#include <c10/util/Half.h>

#include "stream_ahead.h"
#include "vec_avx2.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace int4x16 {

constexpr int kRows = 16;
constexpr int64_t kMaxGroup = 4096;  // a row's sum over a group: 4096 * 15 * 32767 < 2^31
constexpr int64_t kMaxRows = 3;  // int4_linear runs these tiles below 4 rows of x, the FMA tiles from there

template <typename T>
using Args = vec2::IntArgs<int16_t, T>;

using vec2::load8;

// Columns k..k+3 of one block (32 bytes at p) as 16-bit words, in-lane: lane 0 holds columns k, k+1 and lane 1 columns
// k+2, k+3 (as the block stores them), and each dword a row's two columns side by side. c[0] holds rows 0-3 and 8-11
// as whole bytes (word = q[j] + 16 q[j + 8], dword i of a lane: rows i and i + 8), c[1] rows 4-7 and 12-15 the same
// way, c[2] and c[3] the high nibbles alone (rows 8-11, 12-15). Nothing masks the low nibbles out: the sums of c[0]
// and c[1] are fixed at the group's end (tile: minus 16 times the high nibbles' sums, exact in int32's wrap-around
// as the result fits). No cross-lane permute: x's digits are spread to match instead (spread_x), and a group's two
// lanes added at its end (eight_rows).
inline void unpack_quad(const uint8_t* p, __m256i (&c)[4]) {
  // byte 8 * (c % 2) + j of a lane: column c, rows j (low nibble) and j + 8 (high) -> word 2i + h: column h, row i
  const __m256i rows03 = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,
                                          0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1);
  const __m256i rows47 = _mm256_setr_epi8(4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1,
                                          4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  c[0] = _mm256_shuffle_epi8(t, rows03);
  c[1] = _mm256_shuffle_epi8(t, rows47);
  c[2] = _mm256_srli_epi16(c[0], 4);  // the word's high byte is zero
  c[3] = _mm256_srli_epi16(c[1], 4);
}

// x's four digits of columns k..k+3 (at q) spread as unpack_quad's codes want them: lane 0's dwords (x[k], x[k+1]),
// lane 1's (x[k+2], x[k+3]).
inline __m256i spread_x(const int16_t* q) {
  int64_t digits;
  std::memcpy(&digits, q, sizeof digits);
  const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // in-lane dword picks
  return _mm256_castps_si256(_mm256_permutevar_ps(_mm256_castsi256_ps(_mm256_set1_epi64x(digits)), pick));
}

// x fp32 [M, K] -> its 16-bit digits as the tiles read them (vec2::quantize16's, each quad of columns spread by
// spread_x once here rather than once a block): xs [M, 4K] int16, 32 bytes a quad; sx and xqsum [M, G] as
// quantize16's.
inline void quantize(const float* x, int64_t M, int64_t K, int64_t gs, int16_t* xs, float* sx, float* xqsum) {
  std::vector<int16_t> row(K);
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m) {
    vec2::quantize16(x + m * K, 1, K, gs, row.data(), sx + m * G, xqsum + m * G);
    for (int64_t k = 0; k < K; k += 4)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + m * 4 * K + 4 * k), spread_x(row.data() + k));
  }
}

// Two groups of four rows' sums, each lane one column pair -> the eight rows in order (a's four, then b's).
inline __m256i eight_rows(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Rows m0..m0+MT-1 of xq (MT <= 2: four int32 accumulators a row, with the codes, fill the 16 registers) against block
// b: o[MT][16] receives the block's outputs.
template <int MT, typename T>
void tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const int64_t ahead = stream::ahead();
  __m256 out[MT][2];
  for (int m = 0; m < MT; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_si256();
#pragma GCC unroll 2  // two quads a turn: GCC moves the accumulators between registers once a turn (1.04x from L3)
    for (int64_t k = g * a.gs, k1 = k + a.gs; k < k1; k += 4) {
      stream::prefetch(w + k * 8, ahead);  // each quad (one every other, once a line, measured no faster)
      __m256i c[4];
      unpack_quad(w + k * 8, c);
      for (int m = 0; m < MT; ++m) {
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (m0 + m) * 4 * a.K + 4 * k));
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(c[j], xb));
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 2; ++j) acc[m][j] = _mm256_sub_epi32(acc[m][j], _mm256_slli_epi32(acc[m][j + 2], 4));
    const T* s = sz + g * 2 * kRows;
    const __m256 s0 = load8(s), s1 = load8(s + 8), z0 = load8(s + kRows), z1 = load8(s + kRows + 8);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * a.G + g;
      vec2::add_group(eight_rows(acc[m][0], acc[m][1]), eight_rows(acc[m][2], acc[m][3]), a.xqsum[i], a.sx[i], s0, s1,
                      z0, z1, out[m]);
    }
  }
  vec2::store_tile<MT>(o, out);
}

template <typename T>
void block(const Args<T>& a, int64_t b) {
  vec2::rows_in_pairs(a.out, a.N, b, a.M,
                      [&](auto mt, int64_t m0, float* o) { tile<decltype(mt)::value>(a, b, m0, o); });
}

}  // namespace int4x16
