// The int4 linear with int8 activations (W4A8) for fp32 activations on every CPU the extension builds for (AVX2 +
// FMA): x fp32 [M, K] is quantized per row and group (the weight's groups) to int8 with the scale max|x| / 127, then
// multiplied with the 4-bit codes by vpmaddubsw, on the same packed layout as int4_cpu.cpp (Int4Blocked). Included by
// int4_cpu.cpp. The arithmetic of int4_q8_avx512.h (and of llama.cpp's AVX2 Q4 x Q8 dot products): the int32 sums
// are exact, and each group is scaled in the same order, so the two kernels give the same bits on x exact in bf16;
// int4_q8_reference is the oracle.
//
// From kUnpackFromRows rows a block's codes are unpacked once into a per-thread buffer, then read by every tile of
// rows: on Zen 3 the unpack (a cross-lane dword permute alone costs more than a vpmaddubsw) took 40% of a tile's
// vector issue slots when each tile redid it (2048 rows, 2 threads: 1.22-1.28x on the 1B model's shapes,
// docs/BENCHMARKS.md).
// Unpacking a column quad of a block (32 packed bytes: byte c * 8 + j holds row j in its low nibble and row j + 8 in
// its high one, for column k + c): one dword permute and one in-lane byte shuffle transpose it so that dword j holds
// row j's (and j + 8's) four columns; a mask (and a shift) then give each half's codes as bytes, 64 bytes a quad.
// x's four columns are one broadcast dword (a load, no shuffle), so one vpmaddubsw (u8 codes x s8 activations) gives
// 16 int16 sums of two products per half, at most 2 * 15 * 127 = 3810 in magnitude: eight quads add up in int16
// (30480) before one vpmaddwd by ones widens each row's two lanes into its int32 sum.
#pragma once

#include <immintrin.h>

#include <c10/util/Half.h>

#include "stream_ahead.h"
#include "vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace int4q8avx2 {

constexpr int kRows = 16;
constexpr int kQuadsInt16 = 8;  // quads whose vpmaddubsw sums an int16 lane holds (8 * 3810 < 32767)

template <typename T>
using Args = vec2::IntArgs<int8_t, T>;

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

// Columns k..k+3 of one block (32 bytes at p) -> the codes of rows 0-7 (lo) and 8-15 (hi): in each, dword i holds
// row i's codes of columns k..k+3 as bytes.
inline void unpack_quad(const uint8_t* p, __m256i low4, __m256i& lo, __m256i& hi) {
  // dword 2c + h of the quad: column c, rows 4h..4h+3 -> lane h: columns 0-3 of rows 4h..4h+3 (a 4x4 byte block)
  const __m256i by_rows = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i t = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v, by_rows), transpose);
  lo = _mm256_and_si256(t, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low4);
}

// x[k..k+3] (int8) in every dword.
inline __m256i quad_of(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm256_set1_epi32(four);
}

// Where a tile reads the column quads' unpacked codes (lo: rows 0-7, hi: rows 8-15) from, quad after quad from a
// cursor (`at`, then `next`): Packed unpacks them from the weight at each tile, Unpacked loads them from a block
// unpacked once (unpack_block).
struct Packed {
  const uint8_t* w;  // the block's packed bytes
  int64_t ahead;  // prefetch the codes this many bytes ahead of the loads (stream_ahead.h; 0: none)
  __m256i low4 = _mm256_set1_epi8(15);
  const uint8_t* at(int64_t k) const { return w + k * 8; }
  void next(const uint8_t*& p, __m256i& lo, __m256i& hi) const {
    stream::prefetch(p, ahead);
    unpack_quad(p, low4, lo, hi);
    p += 32;
  }
};

struct Unpacked {
  const __m256i* codes;  // [K / 4][2]
  const __m256i* at(int64_t k) const { return codes + k / 4 * 2; }
  static void next(const __m256i*& p, __m256i& lo, __m256i& hi) {
    lo = _mm256_load_si256(p);
    hi = _mm256_load_si256(p + 1);
    p += 2;
  }
};

// Block b's codes -> codes[2q] (rows 0-7) and codes[2q + 1] (rows 8-15) for each column quad q.
template <typename T>
void unpack_block(const Args<T>& a, int64_t b, __m256i* codes) {
  const Packed packed{a.w + b * a.K * 8, 0};
  const uint8_t* p = packed.at(0);
  for (int64_t q = 0; q < a.K / 4; ++q) packed.next(p, codes[2 * q], codes[2 * q + 1]);
}

// Columns [k0, k1) of MT rows (at most kQuadsInt16 quads): acc[m] = (first) or += row m's int32 sums. Only the int16
// sums and one quad's codes are live here: with the int32 sums and the outputs also in registers, GCC 12 spilled a sum
// in the hot loop (a store-to-load chain that held the tile to two thirds of this speed). The first run of a group
// stores rather than zeroing acc beforehand: GCC made that memset a `rep stos`, 11% of the tile's time on Zen 3.
template <int MT, typename Codes>
inline void run(const Codes& codes, const int8_t* const (&x)[MT], int64_t k0, int64_t k1, bool first,
                int32_t (&acc)[MT][16]) {
  __m256i s16[MT][2];
  for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
  auto p = codes.at(k0);
  for (int64_t k = k0; k < k1; k += 4) {
    __m256i lo, hi;
    codes.next(p, lo, hi);
    for (int m = 0; m < MT; ++m) {
      const __m256i xb = quad_of(x[m] + k);
      s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(lo, xb));
      s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(hi, xb));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) {
      __m256i* p = reinterpret_cast<__m256i*>(acc[m] + 8 * h);
      const __m256i sum = _mm256_madd_epi16(s16[m][h], ones);
      _mm256_store_si256(p, first ? sum : _mm256_add_epi32(_mm256_load_si256(p), sum));
    }
}

// Rows m0..m0+MT-1 of xq against block b, its codes read through `codes`: o[MT][16] receives the block's outputs.
// The int32 sums and the outputs stay in memory (run).
template <int MT, typename T, typename Codes>
void tile(const Args<T>& a, int64_t b, int64_t m0, const Codes& codes, float* o) {
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const int8_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.xq + (m0 + m) * a.K;
  alignas(32) int32_t acc[MT][16];
  if (a.G == 0) std::fill(o, o + MT * kRows, 0.f);  // K = 0
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t k0 = g * a.gs, k1 = k0 + a.gs;
    for (int64_t k = k0; k < k1; k += 4 * kQuadsInt16)
      run<MT>(codes, x, k, std::min(k1, k + 4 * kQuadsInt16), k == k0, acc);
    const T* s = sz + g * 2 * kRows;
    const __m256 s0 = load8(s), s1 = load8(s + 8), z0 = load8(s + kRows), z1 = load8(s + kRows + 8);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * a.G + g;
      __m256 out[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // o is written by group 0 (no fill)
      if (g > 0) out[0] = _mm256_loadu_ps(o + m * kRows), out[1] = _mm256_loadu_ps(o + m * kRows + 8);
      vec2::add_group(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc[m])),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(acc[m] + 8)), a.xqsum[i], a.sx[i], s0, s1,
                      z0, z1, out);
      _mm256_storeu_ps(o + m * kRows, out[0]);
      _mm256_storeu_ps(o + m * kRows + 8, out[1]);
    }
  }
}

// Rows [m_begin, m_end) of xq against block b, in tiles of 4, 2, 1 rows through `codes`.
template <typename T, typename Codes>
void tiles(const Args<T>& a, int64_t b, int64_t m_begin, int64_t m_end, const Codes& codes) {
  float o[4 * kRows];
  auto store = [&](int64_t m0, int64_t mt) { vec2::store_rows(a.out, a.N, b, m0, mt, o); };
  int64_t m0 = m_begin;
  for (; m0 + 4 <= m_end; m0 += 4) { tile<4>(a, b, m0, codes, o); store(m0, 4); }
  if (m0 + 2 <= m_end) { tile<2>(a, b, m0, codes, o); store(m0, 2); m0 += 2; }
  if (m0 < m_end) { tile<1>(a, b, m0, codes, o); store(m0, 1); }
}

// Rows [m_begin, m_end) of xq against block b. From kUnpackFromRows rows the block's codes are unpacked once into this
// thread's buffer (below, unpacking them at each tile costs less than storing and reloading them).
constexpr int64_t kUnpackFromRows = 8;

template <typename T>
void block(const Args<T>& a, int64_t b, int64_t m_begin, int64_t m_end) {
  const int64_t rows = m_end - m_begin;
  if (rows < kUnpackFromRows)  // 1-3 rows stream the codes (stream_ahead.h), 4-7 are bound by their arithmetic
    return tiles(a, b, m_begin, m_end, Packed{a.w + b * a.K * 8, rows < 4 ? stream::ahead() : 0});
  thread_local std::vector<uint8_t> buffer;
  auto* codes = reinterpret_cast<__m256i*>(vec2::aligned32(buffer, a.K * 16));  // [K / 4][2] vectors
  unpack_block(a, b, codes);
  tiles(a, b, m_begin, m_end, Unpacked{codes});
}

}  // namespace int4q8avx2
