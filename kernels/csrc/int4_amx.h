// The int4 linear for bf16 activations on AMX tiles: x bf16 [M, K] @ W.T -> fp32 or bf16 [M, N] on the Int4Blocked
// layout, with the same arithmetic as the AVX-512 BF16 kernel (int4_bf16_avx512.h). Included by int4_cpu.cpp where
// QUANTKIT_AMX (amx_bf16.h) and QUANTKIT_INT4_BF16.
//
// A block's codes for 32 input columns (256 packed bytes) unpack into one B tile (16 rows of 64 bytes) with the AVX-512
// kernel's operands (nibbles, pair_of: a code c as the bf16 128 + c, exact), stored to a 1 KiB buffer that
// TDPBF16PS reads through a tile load. A C tile then holds, for up to 16 rows of x and the block's 16 outputs, the sum
// over a group's columns of x . (128 + c); at the end of each group it is stored, and each row gets
//   out += s * (C - (z + 128) * xsum)
// as in the AVX-512 kernel, so the products are exact and the sums fp32 in both; only their order differs.
//
// Two blocks and up to 32 rows of x a step (tiles C 0-3, A 4-5, B 6-7, as amx_bf16.h configures them). With more than
// 32 rows the first step on a block pair keeps its unpacked tiles (K * 64 bytes for the pair, in L2) and the others
// load them back.
#pragma once

#include "amx_pairs.h"
#include "int4_bf16_avx512.h"
#include "stream_ahead.h"

#if defined(QUANTKIT_AMX) && defined(QUANTKIT_INT4_BF16)
#define QUANTKIT_INT4_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace int4amx {

constexpr int kRows = 16;
constexpr int kTileK = amx::kTileK;
constexpr int kTileElems = kTileK / 2 * 32;  // bf16 values in a B tile: 16 rows of 16 outputs x 2 columns
static_assert(kTileElems * 2 == amx::kTileBytes, "a B tile is amx_pairs.h's room of 1 KiB");

// Whether w can run here: AMX granted, and groups of whole tile steps (32 columns).
static inline bool usable(int64_t gs) { return gs % kTileK == 0 && amx::usable(gs); }

// Columns k..k+31 of a block (codes at blk: [K, 8]) -> B tile t[16][32]: row p holds the 16 outputs' (128 + code)
// pairs for columns k + 2p, k + 2p + 1 (pair_of's operand for that pair). Each of the 4 lines of codes it reads is
// fetched `ahead` bytes beforehand (stream_ahead.h; 0: none): all 64 int4 linears of the 1B shape at M = 8, 1.13x.
inline void unpack_tile(const uint8_t* blk, int64_t k, uint16_t* t, int64_t ahead) {
  const int4bf16::PairIndex& pairs = int4bf16::pair_index();
  for (int l = 0; l < 4; ++l) {
    stream::prefetch(blk + (k + 8 * l) * 8, ahead);
    const int4bf16::Nibbles n = int4bf16::nibbles(blk + (k + 8 * l) * 8);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(t + (4 * l + c) * 32, (__m512i)int4bf16::pair_of(n, pairs.of[c]));
  }
}

// A block pair's unpacked tiles for all of K ([K / 32][2] tiles, K * 64 bytes: in L2).
inline int64_t kept_tiles(int64_t K) { return K / kTileK * 2; }

// Rows m0..m0+r0+r1-1 of x (row tiles of r0 and r1 rows) against the NB blocks from b: o[r * 2 + j][rows][16] receives
// the outputs. kept: null (unpack every tile), or the pair's tiles for all of K, [K / 32][2] B tiles, written when
// `fill` and read back otherwise (amx::over_groups).
template <int MA, int NB, typename T>
void pair_rows(const int4bf16::Args<T>& a, int64_t b, int64_t m0, int r0, int r1, uint8_t* kept, bool fill,
               float (*o)[kRows * kRows]) {
  const uint16_t* x = a.x + m0 * a.K;
  const int rows[2] = {r0, r1};
  const int64_t ahead = stream::ahead();
  for (int t = 0; t < 4; ++t) std::fill(o[t], o[t] + kRows * kRows, 0.f);
  const auto unpack = [&](int j, int64_t g, int64_t i, uint8_t* tile) {
    unpack_tile(a.w + (b + j) * a.K * 8, g * a.gs + i * kTileK, reinterpret_cast<uint16_t*>(tile), ahead);
  };
  const auto product = [&](int64_t g, int64_t i, const void* const* bt) {
    amx::step<MA, NB>(x + g * a.gs + i * kTileK, a.K * 2, bt);
  };
  const auto fold = [&](int64_t g, const float (*c)[kRows * kRows]) {
    for (int j = 0; j < NB; ++j) {
      const T* s = a.sz + ((b + j) * a.G + g) * 2 * kRows;
      const __m512 scale = tiles512::load16(s), zero = _mm512_add_ps(tiles512::load16(s + kRows), _mm512_set1_ps(128.f));
      for (int r = 0; r < MA; ++r)
        for (int i = 0; i < rows[r]; ++i) {
          float* p = o[r * 2 + j] + i * kRows;
          const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + r * kRows + i) * a.G + g]);
          const __m512 d = _mm512_fnmadd_ps(xs, zero, _mm512_load_ps(c[r * 2 + j] + i * kRows));
          _mm512_store_ps(p, _mm512_fmadd_ps(d, scale, _mm512_load_ps(p)));
        }
    }
  };
  amx::over_groups<MA, NB, float>(a.G, a.gs / kTileK, kept, fill, unpack, product, fold);
}

// Blocks b0..b1-1 for every row of x (a.gs a multiple of 32, amx::usable): two blocks by up to 32 rows a step.
template <typename T>
void blocks(const int4bf16::Args<T>& a, int64_t b0, int64_t b1) {
  amx::over_block_pairs(a.M, a.N, a.out, a.out_bf16, kept_tiles(a.K), b0, b1,
                        [&](auto ma, auto nb, int64_t b, int64_t m0, int r0, int r1, uint8_t* kept, bool fill,
                            float (*o)[kRows * kRows]) {
                          pair_rows<decltype(ma)::value, decltype(nb)::value>(a, b, m0, r0, r1, kept, fill, o);
                        });
}

}  // namespace int4amx

#endif

#if defined(QUANTKIT_INT4_BF16)
namespace int4bf16 {

#if defined(QUANTKIT_INT4_AMX)
// From this many rows of x, the bf16-activation kernel runs on AMX tiles where they apply (int4amx::usable): python -m
// quantkit.bench.int4_tiles --switch amx on this project's CPU (docs/BENCHMARKS.md); a switch so that a benchmark can move it.
inline int64_t& amx_from_m() {
  static int64_t m = 2;
  return m;
}
#endif

// Blocks b0..b1-1 of `a` for every row of x: on AMX tiles from amx_from_m() rows where they apply, else by vdpbf16ps.
template <typename T>
inline void any_blocks(const Args<T>& a, int64_t b0, int64_t b1) {
#if defined(QUANTKIT_INT4_AMX)
  if (a.M >= amx_from_m() && int4amx::usable(a.gs)) {
    int4amx::blocks(a, b0, b1);
    return;
  }
#endif
  blocks(a, b0, b1);
}

}  // namespace int4bf16
#endif
