// The int8-weight linear for bf16 activations on AMX tiles (AMX-INT8, TDPBUSD): the same arithmetic as the AVX-512
// VNNI kernel (int8_bf16_avx512.h), on the same layout. Included by int4_cpu.cpp where QUANTKIT_AMX and
// QUANTKIT_INT8_W.
//
// The layout's [NB, K / 4, 16, 4] int8 codes are what a TDPBUSD B operand wants as stored: row r of a 64-column step
// holds the 16 outputs' codes of columns 4r..4r+3 side by side, so a block's 16 lines load as one B tile, no code is
// converted. x is rounded as in the VNNI kernel (xq per row and group, 16 bits), but written as two planes of bytes
// [2][M'][K] (M' = M rounded up to 16, the extra rows zero), so an A tile is 16 rows of one plane: the high bytes
// xq >> 8, signed, then the low bytes xq & 255, unsigned (xq = 256 * hi + lo). A TDPBSSD and a TDPBUSD a step give,
// exactly in int32, sum q * hi and sum q * lo, and at the end of a group each row gets
//   out += s * sx * (256 * sum q * hi + sum q * lo),
// the VNNI kernel's sum q * xq in another order (int32, so the same values; no 32768 * wsum term: hi is signed).
// With one row tile (M <= 16) each line of codes stream::ahead() bytes after the one it loads is fetched
// beforehand, as the AVX-512 tiles do.
//
// Tiles: C 0-3 (high and low sums of two blocks), A 4-5 (the two planes), B 6-7 (two blocks): amx::configure(16, 16).
#pragma once

#include "amx_bf16.h"
#include "int8_bf16_avx512.h"
#include "stream_ahead.h"

#if defined(QUANTKIT_AMX) && defined(QUANTKIT_INT8_W) && defined(__AMX_INT8__)
#define QUANTKIT_INT8_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace int8amx {

constexpr int kRows = 16;
constexpr int kStepK = 64;  // columns a tile step takes (16 rows of column quads)

// Whether the AMX path takes groups of gs columns: whole tile steps, and AMX granted.
static inline bool usable(int64_t gs) { return gs % kStepK == 0 && amx::usable(gs); }

inline int64_t padded_rows(int64_t M) { return (M + kRows - 1) / kRows * kRows; }

// x bf16 [M, K] -> planes [2][padded_rows(M)][K] (the signed high bytes of xq, then its unsigned low bytes; rows past
// M zero) and sx [M, G], xq rounded as int8w::digits rounds it (gs a multiple of 16).
inline void digit_planes(const uint16_t* x, int64_t M, int64_t K, int64_t gs, uint8_t* planes, float* sx) {
  const int64_t G = K / gs, Mp = padded_rows(M);
  uint8_t* hi = planes;
  uint8_t* lo = planes + Mp * K;
  std::memset(hi + M * K, 0, (Mp - M) * K);
  std::memset(lo + M * K, 0, (Mp - M) * K);
  const __m512i byte = _mm512_set1_epi32(255), sign = _mm512_set1_epi32(128);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = m * K + g * gs;
      const __m512 vinv = _mm512_set1_ps(int8w::group_inverse(x + at, gs, sx + m * G + g));
      for (int64_t c = 0; c < gs; c += 16) {
        const __m512i r = int8w::offset_codes(x + at + c, vinv);  // xq + 32768: its high byte is (xq >> 8) + 128
        const __m512i h = _mm512_xor_si512(_mm512_srli_epi32(r, 8), sign);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + at + c), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + at + c), _mm512_cvtepi32_epi8(_mm512_and_si512(r, byte)));
      }
    }
}

struct Args {
  const uint8_t* planes;  // [2][Mp][K]
  const float* sx;        // [M, G]
  const int8_t* w;        // [NB, K / 4, 16, 4]
  const float* s;         // [NB, G, 16]
  float* out;             // [M, N] fp32, or null when out_bf16 is set
  uint16_t* out_bf16;     // [M, N] bf16 bits, or null
  int64_t M, Mp, K, N, G, gs;
};

// Rows m0..m0+15 (of the padded planes) against blocks b and b + NB - 1: o[j][16][16] receives the outputs.
template <int NB>
void pair_rows(const Args& a, int64_t b, int64_t m0, float (*o)[kRows * kRows]) {
  alignas(64) int32_t c[4][kRows * kRows];
  const uint8_t* hi = a.planes + m0 * a.K;
  const uint8_t* lo = a.planes + (a.Mp + m0) * a.K;
  const int8_t* w0 = a.w + b * a.K * kRows;
  const int8_t* w1 = a.w + (b + NB - 1) * a.K * kRows;
  const int rows = static_cast<int>(std::min<int64_t>(kRows, a.M - m0));
  // One row tile (M <= 16): its codes stream from memory, fetched ahead (1.15-1.2x at M = 8 and 16, Xeon AMX). Past
  // one tile the pair's codes serve each tile, and fetching ahead for the first slowed M = 32 (0.93x): none.
  const int64_t ahead = a.M <= kRows ? stream::ahead() : 0;
  for (int j = 0; j < NB; ++j) std::fill(o[j], o[j] + kRows * kRows, 0.f);
  for (int64_t g = 0; g < a.G; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NB == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = g * a.gs; k < (g + 1) * a.gs; k += kStepK) {
      for (int64_t l = 0; ahead > 0 && l < kStepK * kRows; l += 64) {
        stream::prefetch(w0 + k * kRows + l, ahead);
        if constexpr (NB == 2) stream::prefetch(w1 + k * kRows + l, ahead);
      }
      _tile_loadd(4, hi + k, a.K);
      _tile_loadd(5, lo + k, a.K);
      _tile_loadd(6, w0 + k * kRows, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      if constexpr (NB == 2) {
        _tile_loadd(7, w1 + k * kRows, 64);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if constexpr (NB == 2) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    for (int j = 0; j < NB; ++j) {
      const int64_t at = ((b + j) * a.G + g) * kRows;
      const __m512 scale = _mm512_loadu_ps(a.s + at);
      for (int i = 0; i < rows; ++i) {
        const __m512i h = _mm512_load_si512(c[2 * j] + i * kRows), l = _mm512_load_si512(c[2 * j + 1] + i * kRows);
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);  // sum q * xq
        const __m512 sx = _mm512_set1_ps(a.sx[(m0 + i) * a.G + g]);
        float* p = o[j] + i * kRows;
        _mm512_store_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, sx), _mm512_load_ps(p)));
      }
    }
  }
}

// Blocks b0..b1-1 for every row of x: two blocks by 16 rows a step, every row tile of a block pair before the next
// pair (the pair's codes, 2 * K * 16 bytes, stay in L1/L2 across the row tiles).
inline void blocks(const Args& a, int64_t b0, int64_t b1) {
  alignas(64) float o[2][kRows * kRows];
  amx::configure(kRows, kRows);
  for (int64_t b = b0; b < b1; b += 2) {
    const int nb = static_cast<int>(std::min<int64_t>(2, b1 - b));
    for (int64_t m0 = 0; m0 < a.M; m0 += kRows) {
      nb == 2 ? pair_rows<2>(a, b, m0, o) : pair_rows<1>(a, b, m0, o);
      const int64_t rows = std::min<int64_t>(kRows, a.M - m0);
      for (int j = 0; j < nb; ++j) {
        const int64_t n0 = (b + j) * kRows;
        tiles512::store_rows(a.out, a.out_bf16, a.N, n0, std::min<int64_t>(kRows, a.N - n0), m0, rows, o[j]);
      }
    }
  }
  amx::tile_release();
}

}  // namespace int8amx

#endif
