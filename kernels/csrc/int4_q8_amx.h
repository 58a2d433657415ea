// The int4 linear with int8 activations (W4A8) on AMX-INT8 tiles (TDPBSUD): the same arithmetic as the AVX-512 VNNI
// kernel (int4_q8_avx512.h) on the same Int4Blocked layout and the same xq. Included by int4_cpu.cpp where
// QUANTKIT_AMX, QUANTKIT_INT4_Q8 and the compiler targets AMX-INT8.
//
// The VNNI kernel's vpdpbusd operand for four columns (16 outputs x 4 codes, 64 bytes) is one row of a TDPBUSD B
// tile, so the B tile of 64 columns of a block is 16 such rows (1 KiB, from 512 bytes of codes): each 64 bytes of codes
// (8 columns) give two rows by a mask, a shift and two two-source byte permutations. An A tile is up to 16 rows of xq
// by 64 columns (signed bytes: TDPBSUD, A signed x B unsigned). One tile product is 16 x 16 x 64 multiply-adds,
// against the bf16 AMX kernel's 16 x 16 x 32 on two bytes of unpacked weight a code: half the tile products a code.
// A C tile holds, exactly in int32, a group's sum of code * xq for up to 16 rows and the block's 16 outputs, and at
// the end of each group each row gets
//   out += s * sx * (C - z * xqsum),
// in the VNNI kernel's operations on the same int32 sums: the same bits.
//
// Two blocks and up to 32 rows a step, walked as amx_pairs.h walks them (past 32 rows a block pair's unpacked tiles,
// K * 32 bytes, are kept for its other row steps).
#pragma once

#include "amx_pairs.h"
#include "int4_q8_avx512.h"
#include "stream_ahead.h"

#if defined(QUANTKIT_AMX) && defined(QUANTKIT_INT4_Q8) && defined(__AMX_INT8__)
#define QUANTKIT_INT4_Q8_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace int4q8amx {

constexpr int kRows = 16;
constexpr int kStepK = 64;  // columns a tile step takes: 16 B rows of four

// Whether the AMX path takes groups of gs columns: whole tile steps, and AMX granted.
static inline bool usable(int64_t gs) { return gs % kStepK == 0 && amx::usable(gs); }

// The two byte permutations of unpack_tile: from the masked low nibbles (rows 0-7, bytes c * 8 + j for column c of
// eight) and high nibbles (rows 8-15, the second source: + 64), lane byte 4i + c of B row `half` gets code (row i,
// column 4 * half + c).
struct RowIndex {
  __m512i half[2];
};
inline RowIndex row_index() {
  alignas(64) uint8_t v[2][64];
  for (int half = 0; half < 2; ++half)
    for (int b = 0; b < 64; ++b) {
      const int i = b / 4, c = 4 * half + b % 4;
      v[half][b] = static_cast<uint8_t>(i < 8 ? c * 8 + i : 64 + c * 8 + (i - 8));
    }
  return {{_mm512_load_si512(v[0]), _mm512_load_si512(v[1])}};
}

// Columns k..k+63 of a block (codes at blk: [K, 8]) -> B tile t[16][64]: row r holds lane i's codes (row i, columns
// k + 4r .. k + 4r + 3). Each line of codes it reads is fetched `ahead` bytes beforehand (stream_ahead.h; 0: none).
inline void unpack_tile(const uint8_t* blk, int64_t k, uint8_t* t, const RowIndex& index, int64_t ahead) {
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int l = 0; l < 8; ++l) {
    const uint8_t* p = blk + (k + 8 * l) * 8;
    stream::prefetch(p, ahead);
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    _mm512_store_si512(t + (2 * l) * 64, _mm512_permutex2var_epi8(lo, index.half[0], hi));
    _mm512_store_si512(t + (2 * l + 1) * 64, _mm512_permutex2var_epi8(lo, index.half[1], hi));
  }
}

// The tile products of a step (amx::step's Dot): TDPBSUD, A signed (xq) by B unsigned (codes), int32 sums.
QUANTKIT_AMX_STEP_DOTS(SignedByUnsigned, _tile_dpbsud)

// Rows m0..m0+r0+r1-1 of xq (row tiles of r0 and r1 rows) against the NB blocks from b: o[r * 2 + j][rows][16]
// receives the outputs. kept: null (unpack every tile), or the pair's tiles for all of K, [K / 64][2] B tiles, written
// when `fill` and read back otherwise (amx::over_groups).
template <int MA, int NB, typename T>
void pair_rows(const int4q8::Args<T>& a, int64_t b, int64_t m0, int r0, int r1, uint8_t* kept, bool fill,
               float (*o)[kRows * kRows]) {
  const int8_t* x = a.xq + m0 * a.K;
  const int rows[2] = {r0, r1};
  const int64_t ahead = stream::ahead();
  const RowIndex index = row_index();
  for (int t = 0; t < 4; ++t) std::fill(o[t], o[t] + kRows * kRows, 0.f);
  const auto unpack = [&](int j, int64_t g, int64_t i, uint8_t* tile) {
    unpack_tile(a.w + (b + j) * a.K * 8, g * a.gs + i * kStepK, tile, index, ahead);
  };
  const auto product = [&](int64_t g, int64_t i, const void* const* bt) {
    amx::step<MA, NB, SignedByUnsigned>(x + g * a.gs + i * kStepK, a.K, bt);
  };
  const auto fold = [&](int64_t g, const int32_t (*c)[kRows * kRows]) {
    for (int j = 0; j < NB; ++j) {
      const T* s = a.sz + ((b + j) * a.G + g) * 2 * kRows;
      const __m512 scale = tiles512::load16(s), zero = tiles512::load16(s + kRows);
      for (int r = 0; r < MA; ++r)
        for (int i = 0; i < rows[r]; ++i) {
          float* p = o[r * 2 + j] + i * kRows;
          const int64_t at = (m0 + r * kRows + i) * a.G + g;
          const __m512i d = _mm512_load_si512(c[r * 2 + j] + i * kRows);
          const __m512 dot = _mm512_fnmadd_ps(_mm512_set1_ps(a.xqsum[at]), zero, _mm512_cvtepi32_ps(d));
          _mm512_store_ps(p, _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(a.sx[at])), _mm512_load_ps(p)));
        }
    }
  };
  amx::over_groups<MA, NB, int32_t>(a.G, a.gs / kStepK, kept, fill, unpack, product, fold);
}

// Blocks b0..b1-1 for every row of xq (a.gs a multiple of 64, usable): two blocks by up to 32 rows a step.
template <typename T>
void blocks(const int4q8::Args<T>& a, int64_t b0, int64_t b1) {
  amx::over_block_pairs(a.M, a.N, a.out, a.out_bf16, a.K / kStepK * 2, b0, b1,
                        [&](auto ma, auto nb, int64_t b, int64_t m0, int r0, int r1, uint8_t* kept, bool fill,
                            float (*o)[kRows * kRows]) {
                          pair_rows<decltype(ma)::value, decltype(nb)::value>(a, b, m0, r0, r1, kept, fill, o);
                        });
}

}  // namespace int4q8amx

#endif
