// The int4 linear for bf16 activations on CPUs with AVX-512 BF16 (vdpbf16ps): x bf16 [M, K] @ W.T ->
// fp32 [M, N], on the same packed layout as int4_cpu.cpp's AVX2 kernel (Int4Blocked). Included by
// int4_cpu.cpp; compiled where the compiler targets AVX-512 BF16/BW/VL (QUANTKIT_INT4_BF16). The tile loop, the
// widening and the stores it shares with the other AVX-512 BF16 kernels are in tiles_bf16_avx512.h.
//
// One vdpbf16ps multiplies 16 output rows by two input columns: lane i accumulates
//   x[k] * w[i, k] + x[k + 1] * w[i, k + 1]
// from 32 bf16 values, so the codes of a block for columns k, k + 1 (16 packed bytes) become 32 bf16
// lanes by one byte shuffle, a widening, a mask and a shift (unpack_pair; from 3 rows, 8 columns at once: a mask and
// a shift, then one byte permute an operand, nibbles and pair_of). A code c (0..15) is taken as the bf16
// 128 + c (bits 0x4300 | c, exact), so no conversion is needed: the extra 128 * x sums to
// 128 * xsum over a group and is removed with the zero point (z + 128). Products of bf16 values are
// exact in fp32 and the sums are fp32, so the result differs from the fp32 kernel's only by the
// order of the sums and the cancellation of 128 * xsum (about 2^-24 * 128 * group size relative to
// |x|, far below the bf16 output's rounding).
#pragma once

#include "tiles_bf16_avx512.h"

#if defined(QUANTKIT_BF16_TILES)
#define QUANTKIT_INT4_BF16 1

#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace int4bf16 {

// The tiles, the bf16 widening and the stores are shared with the other AVX-512 BF16 kernels.
using namespace tiles512;

template <typename T>
struct Args {
  const uint16_t* x;   // bf16 bits [M, K]
  const float* xsum;   // [M, G]
  const uint8_t* w;    // [NB, K, 8]
  const T* sz;         // [NB, G, 2, 16]
  float* out;          // [M, N] fp32, or null when out_bf16 is set
  uint16_t* out_bf16;  // [M, N] bf16 bits (rounded to nearest even, as torch rounds fp32 to bf16), or null
  int64_t M, K, N, G, gs;
};

// The sums of x over each group, in fp32: xsum [M, G] from x bf16 [M, K] (gs even).
inline void group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t gs, float* xsum) {
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + m * K + g * gs;
      __m512 acc = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= gs; c += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c)));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      }
      float sum = _mm512_reduce_add_ps(acc);
      for (; c < gs; ++c) {
        const uint32_t bits = uint32_t(p[c]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof v);
        sum += v;
      }
      xsum[m * G + g] = sum;
    }
}

// Columns k, k + 1 of one block (its bytes at p = block + k * 8: byte kk * 8 + j holds row j in the low
// nibble and row j + 8 in the high one, for column k + kk) -> lane pair i: (128 + code(i, k), 128 + code(i, k + 1)).
inline __m512bh unpack_pair(const uint8_t* p) {
  // byte t <- byte (t % 2) * 8 + t / 2: then the low nibble of byte t is 16-bit lane t (row t / 2,
  // column k + t % 2) and its high nibble lane 16 + t (row 8 + t / 2)
  const __m128i order = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m128i bytes = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), order);
  const __m256i w = _mm256_cvtepu8_epi16(bytes);
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(15));
  const __m256i hi = _mm256_srli_epi16(w, 4);
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return (__m512bh)_mm512_or_si512(v, _mm512_set1_epi16(0x4300));
}

// Whether the tiles of 3 rows and more unpack 8 columns a step where the group size allows (the default) or a pair:
// a switch so that a benchmark can time both in one process (set_eight_columns).
inline bool& eight_columns() {
  static bool on = true;
  return on;
}

// A block's codes for 8 columns (64 bytes at p = block + k * 8, k a multiple of 8) split into their nibbles, a byte
// each: lo holds byte i's low nibble (row i % 8, column k + i / 8), hi its high one (row 8 + i % 8). pair_of then
// makes each column pair's vdpbf16ps operand, as unpack_pair does, in one byte permute of the two: 3 vector ops for
// 8 columns and one for each pair, where unpack_pair takes 6 for each pair.
struct Nibbles {
  __m512i lo, hi;
};
inline Nibbles nibbles(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(15);
  return {_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask)};
}

// The byte permutes of pair_of: for column pair c (columns k + 2c, k + 2c + 1), 16-bit lane 2i + t (row i, column
// k + 2c + t) takes its low byte from lo (rows 0-7) or hi (rows 8-15, index + 64) and keeps the high byte 0x43.
struct PairIndex {
  __m512i of[4];
  PairIndex() {
    alignas(64) uint8_t bytes[64];
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < kRows; ++i)
        for (int t = 0; t < 2; ++t) {
          const int lane = 2 * i + t, column = 2 * c + t;
          bytes[2 * lane] = static_cast<uint8_t>(i < 8 ? column * 8 + i : 64 + column * 8 + i - 8);
          bytes[2 * lane + 1] = 0x43;
        }
      of[c] = _mm512_load_si512(bytes);
    }
  }
};

inline const PairIndex& pair_index() {  // one table for every tile
  static const PairIndex index;
  return index;
}

// Column pair c of the 8 columns in n -> lane pair i: (128 + code(i, k + 2c), 128 + code(i, k + 2c + 1)), the
// operand unpack_pair(p + 16 * c) gives.
inline __m512bh pair_of(const Nibbles& n, const __m512i& index) {
  // bytes from lo and hi where the mask is set (the low bytes), the index's own 0x43 where it is not
  return (__m512bh)_mm512_mask2_permutex2var_epi8(n.lo, index, static_cast<__mmask64>(0x5555555555555555ULL), n.hi);
}

// Rows m0..m0+MT-1 of x against block b: o[MT][16] receives the block's outputs (MT <= 8). Where the group size is a
// multiple of 8 and a step of group_dots takes 8 columns or more (3-7 rows), the codes are unpacked 8 columns at once.
template <int MT, typename T>
void tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  const PairIndex& pairs = pair_index();
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  __m512 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
  const bool eights = a.gs % 8 == 0 && eight_columns();
  for (int64_t g = 0; g < a.G; ++g) {
    const T* s = sz + g * 2 * kRows;
    const __m512 scale = load16(s), zero = _mm512_add_ps(load16(s + kRows), _mm512_set1_ps(128.f));
    auto prefetch = [&](int64_t k) { prefetch_next_block(w, a.K, k); };
    auto finish = [&](int m, __m512 d) {
      const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + m) * a.G + g]);
      out[m] = _mm512_fmadd_ps(_mm512_fnmadd_ps(xs, zero, d), scale, out[m]);
    };
    const int64_t k0 = g * a.gs, k1 = (g + 1) * a.gs;
    if constexpr (2 * chains<MT>() % 8 == 0) {
      if (eights) {
        group_dots<MT, 8>(x, k0, k1, [&](int64_t k, __m512bh (&c)[4]) {
          const Nibbles n = nibbles(w + k * 8);
          for (int i = 0; i < 4; ++i) c[i] = pair_of(n, pairs.of[i]);
        }, prefetch, finish);
        continue;
      }
    }
    group_dots<MT, 2>(x, k0, k1, [&](int64_t k, __m512bh (&c)[1]) { c[0] = unpack_pair(w + k * 8); }, prefetch, finish);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(o + m * kRows, out[m]);
}

// 8 columns' codes at once (64 bytes at p = block + k * 8, k a multiple of 8) -> four vdpbf16ps operands: operand c,
// 32-bit lane 4L + q, holds rows 4c + q of columns k + 2L, k + 2L + 1 as bf16 (128 + code). One in-lane byte shuffle
// puts each 128-bit lane's column pair side by side, a mask and a shift split the nibbles, and interleaving the codes
// with the byte 0x43 makes the bf16 values: 9 vector ops for 4 operands, where unpack_pair takes 6 for one. The cost is
// that a lane adds up one column pair of each group of 8 only (lanes_to_rows sums them at the end of a tile).
inline void unpack_eight(const uint8_t* p, __m512bh (&w)[4]) {
  const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
  const __m512i v = _mm512_shuffle_epi8(_mm512_loadu_si512(p), order);
  const __m512i nibble = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8(0x43);
  const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  w[0] = (__m512bh)_mm512_unpacklo_epi8(lo, exponent);
  w[1] = (__m512bh)_mm512_unpackhi_epi8(lo, exponent);
  w[2] = (__m512bh)_mm512_unpacklo_epi8(hi, exponent);
  w[3] = (__m512bh)_mm512_unpackhi_epi8(hi, exponent);
}

// x[k + 2L], x[k + 2L + 1] in every 32-bit lane of 128-bit lane L (the operand unpack_eight's lanes meet)
inline __m512bh quad(const uint16_t* x) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return (__m512bh)_mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(pairs));
}

// v[c], lane 4L + q, a part of row 4c + q -> lane r the sum of row r's four parts
inline __m512 lanes_to_rows(const __m512 (&v)[4]) {
  __m512 rows = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    __m512 t = _mm512_add_ps(v[c], _mm512_shuffle_f32x4(v[c], v[c], _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));  // every 128-bit lane: the sum
    rows = _mm512_mask_mov_ps(rows, static_cast<__mmask16>(0xF << (4 * c)), t);
  }
  return rows;
}

// Rows m0..m0+MT-1 of x against block b, 8 columns a step (unpack_eight; the group size a multiple of 8). For 1 or 2
// rows, where the one-pair tile spends most of its time unpacking: over a batch-1 decode step's int4 linears it read
// the codes at 27 GB/s, this tile at 35 (1.30x; 2 rows 1.11-1.25x). From 4 rows the unpacking is shared enough: two
// 2-row passes of this tile ran 4 rows 0.90x of the one-pair tile (docs/BENCHMARKS.md). The scales and zero points
// are applied in the operands' lane order, the zero point's xsum a quarter in each of a row's four lanes.
template <int MT, typename T>
void lane_tile(const Args<T>& a, int64_t b, int64_t m0, float* o) {
  constexpr int U = MT == 1 ? 2 : 1;  // 8 chains at one row
  const uint8_t* w = a.w + b * a.K * 8;
  const T* sz = a.sz + b * a.G * 2 * kRows;
  const int64_t ahead = stream::ahead();
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  __m512i rows_of[4];  // lane 4L + q -> row 4c + q
  const __m512i within = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  for (int c = 0; c < 4; ++c) rows_of[c] = _mm512_add_epi32(_mm512_set1_epi32(4 * c), within);
  __m512 out[4][MT];
  for (int c = 0; c < 4; ++c)
    for (int m = 0; m < MT; ++m) out[c][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 acc[U][4][MT];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < 4; ++c)
        for (int m = 0; m < MT; ++m) acc[u][c][m] = _mm512_setzero_ps();
    auto step = [&](int u, int64_t k) {
      __m512bh wv[4];
      stream::prefetch(w + k * 8, ahead);  // one 64-byte line a step
      unpack_eight(w + k * 8, wv);
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = quad(x[m] + k);
        for (int c = 0; c < 4; ++c) acc[u][c][m] = _mm512_dpbf16_ps(acc[u][c][m], xv, wv[c]);
      }
    };
    const int64_t k1 = (g + 1) * a.gs;
    int64_t k = g * a.gs;
    for (; k + 8 * U <= k1; k += 8 * U)
      for (int u = 0; u < U; ++u) step(u, k + 8 * u);
    for (; k < k1; k += 8) step(0, k);
    const T* s = sz + g * 2 * kRows;
    const __m512 scale = load16(s), zero = _mm512_add_ps(load16(s + kRows), _mm512_set1_ps(128.f));
    for (int c = 0; c < 4; ++c) {
      const __m512 sc = _mm512_permutexvar_ps(rows_of[c], scale), zc = _mm512_permutexvar_ps(rows_of[c], zero);
      for (int m = 0; m < MT; ++m) {
        __m512 d = acc[0][c][m];
        for (int u = 1; u < U; ++u) d = _mm512_add_ps(d, acc[u][c][m]);
        const __m512 xs = _mm512_set1_ps(0.25f * a.xsum[(m0 + m) * a.G + g]);
        out[c][m] = _mm512_fmadd_ps(_mm512_fnmadd_ps(xs, zc, d), sc, out[c][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    const __m512 parts[4] = {out[0][m], out[1][m], out[2][m], out[3][m]};
    _mm512_storeu_ps(o + m * kRows, lanes_to_rows(parts));
  }
}

// Whether 1-2 rows run lane_tile (the default) or the one-pair tile: a switch so that a benchmark can time both in
// one process (set_lane_tiles).
inline bool& lane_tiles() {
  static bool on = true;
  return on;
}

template <typename T>
void block(const Args<T>& a, int64_t b) {
  for_tiles(a, b, [&](auto mt, int64_t m0, float* o) {
    constexpr int MT = decltype(mt)::value;
    if constexpr (MT <= 2) {
      if (a.gs % 8 == 0 && lane_tiles()) return lane_tile<MT>(a, b, m0, o);
    }
    tile<MT>(a, b, m0, o);
  });
}

// What a wide tile does with the two blocks' vdpbf16ps operands: unpack them (the only tile of 8 rows on the pair),
// unpack them and keep them (the first of several), or read back the kept ones (the others). Kept, a pair's operands
// take K / 2 * 2 vectors (K * 64 bytes: 176 KiB at K = 2816), read at one load each where unpacking takes 10 vector
// ops per 8 columns of the two blocks; the operands and the order of the sums are the same, so are the results.
enum class Operands { unpack, keep, reuse };

// Rows m0..m0+7 of x against blocks b and b + 1 at once: each broadcast pair of x serves both blocks, so the 8-row
// tile issues half the broadcasts per vdpbf16ps of the one-block tile (the bf16 kernel's wide tile does the same,
// bf16_dot_avx512.h): 1.07-1.15x the one-block tile at 8-64 rows (docs/BENCHMARKS.md). 16 accumulators; each
// group's sums are scaled into o[2][8][16] in memory, since a second set of 16 registers for them would spill.
// Groups of a multiple of 8 columns unpack 8 columns a step (nibbles, pair_of), others a pair (unpack_pair).
// kept[(k / 2) * 2 + j]: block j's operand for columns k, k + 1 (Op keep writes it, reuse reads it).
template <Operands Op, typename T>
void wide_tile(const Args<T>& a, int64_t b, int64_t m0, float* o, __m512i* kept) {
  constexpr int MT = 8, NB = 2;
  const PairIndex& pairs = pair_index();
  const uint8_t* w[NB];
  const T* sz[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.w + (b + j) * a.K * 8;
    sz[j] = a.sz + (b + j) * a.G * 2 * kRows;
  }
  const uint16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = a.x + (m0 + m) * a.K;
  for (int i = 0; i < NB * MT; ++i) _mm512_storeu_ps(o + i * kRows, _mm512_setzero_ps());
  __m512 acc[NB][MT];
  auto dots = [&](int64_t k, const __m512bh (&wv)[NB]) {  // columns k, k + 1 of both blocks, all 8 rows
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = pair(x[m] + k);
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  };
  const bool eights = a.gs % 8 == 0 && eight_columns();
  for (int64_t g = 0; g < a.G; ++g) {
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < MT; ++m) acc[j][m] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * a.gs;
    if constexpr (Op == Operands::reuse) {
      for (int64_t k = g * a.gs; k < k1; k += 2) {
        __m512bh wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(kept + k + j);
        dots(k, wv);
      }
    } else if (eights) {
      for (int64_t k = g * a.gs; k < k1; k += 8) {
        Nibbles n[NB];
        for (int j = 0; j < NB; ++j) {  // and the next two blocks' line for these columns
          prefetch_next_block(w[j] + a.K * 8, a.K, k);
          n[j] = nibbles(w[j] + k * 8);
        }
        for (int c = 0; c < 4; ++c) {
          __m512bh wv[NB];
          for (int j = 0; j < NB; ++j) {
            wv[j] = pair_of(n[j], pairs.of[c]);
            if constexpr (Op == Operands::keep) _mm512_storeu_si512(kept + k + 2 * c + j, (__m512i)wv[j]);
          }
          dots(k + 2 * c, wv);
        }
      }
    } else {
      for (int64_t k = g * a.gs; k < k1; k += 2) {
        if ((k & 7) == 0)  // the next two blocks' line for these columns (one 64-byte line holds 8 columns)
          for (int j = 0; j < NB; ++j) prefetch_next_block(w[j] + a.K * 8, a.K, k);
        __m512bh wv[NB];
        for (int j = 0; j < NB; ++j) {
          wv[j] = unpack_pair(w[j] + k * 8);
          if constexpr (Op == Operands::keep) _mm512_storeu_si512(kept + k + j, (__m512i)wv[j]);
        }
        dots(k, wv);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const T* s = sz[j] + g * 2 * kRows;
      const __m512 scale = load16(s), zero = _mm512_add_ps(load16(s + kRows), _mm512_set1_ps(128.f));
      for (int m = 0; m < MT; ++m) {
        float* p = o + (j * MT + m) * kRows;
        const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + m) * a.G + g]);
        _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_fnmadd_ps(xs, zero, acc[j][m]), scale, _mm512_loadu_ps(p)));
      }
    }
  }
}

// Column k of a block's codes (8 bytes at p) -> 16 fp32 lanes, row order
inline __m512 column_codes(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
}

// One block of W4 (codes at w, scales and zeros at sz) dequantized into the bf16 kernel's pair layout (out: [K / 2,
// 16, 2] bf16 bits, bf16_dot_avx512.h): each value (q - z) * s in fp32, as int4_dequantize computes it, rounded to
// nearest even as .to(torch.bfloat16) rounds. The large-M path multiplies such tiles with the bf16 kernel.
template <typename T>
void dequantize_pairs(const uint8_t* w, const T* sz, int64_t K, int64_t gs, uint16_t* out) {
  // word 2i <- word i, word 2i + 1 <- word 16 + i (_mm512_set_epi16 lists words 31 down to 0)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                              21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t g = 0; g < K / gs; ++g) {
    const T* s = sz + g * 2 * kRows;
    const __m512 scale = load16(s), zero = load16(s + kRows);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
      const __m512 a = _mm512_mul_ps(_mm512_sub_ps(column_codes(w + k * 8), zero), scale);
      const __m512 b = _mm512_mul_ps(_mm512_sub_ps(column_codes(w + (k + 1) * 8), zero), scale);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0-15: column k, 16-31: column k + 1
      _mm512_storeu_si512(out + k * kRows, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Whether 8 rows and more run wide_tile over pairs of blocks (the default) or the one-block tile: a switch so that a
// benchmark can time both in one process (set_wide_tiles).
inline bool& wide_tiles() {
  static bool on = true;
  return on;
}

// This thread's room for a block pair's kept operands (wide_tile, Operands::keep): K vectors, grown as needed.
inline __m512i* kept_operands(int64_t K) {
  thread_local std::vector<__m512i> room;
  if (static_cast<int64_t>(room.size()) < K) room.resize(K);
  return room.data();
}

// Blocks b0..b1-1 for every row of x: pairs of blocks in wide tiles of 8 rows (from 16 rows the first tile on a pair
// keeps its unpacked operands for the others), the rows past the last 8 and a last unpaired block by block().
template <typename T>
void blocks(const Args<T>& a, int64_t b0, int64_t b1) {
  int64_t b = b0;
  if (a.M >= 8 && wide_tiles()) {
    const int64_t m8 = a.M / 8 * 8;
    Args<T> rest = a;  // rows m8.. of x
    rest.x = a.x + m8 * a.K;
    rest.xsum = a.xsum + m8 * a.G;
    rest.out = a.out != nullptr ? a.out + m8 * a.N : nullptr;
    rest.out_bf16 = a.out_bf16 != nullptr ? a.out_bf16 + m8 * a.N : nullptr;
    rest.M = a.M - m8;
    float o[2 * 8 * kRows];
    __m512i* kept = m8 > 8 ? kept_operands(a.K) : nullptr;  // several 8-row tiles on each pair: unpack once
    for (; b + 2 <= b1; b += 2) {
      for (int64_t m0 = 0; m0 < m8; m0 += 8) {
        if (kept == nullptr)
          wide_tile<Operands::unpack>(a, b, m0, o, nullptr);
        else if (m0 == 0)
          wide_tile<Operands::keep>(a, b, m0, o, kept);
        else
          wide_tile<Operands::reuse>(a, b, m0, o, kept);
        for (int j = 0; j < 2; ++j) {
          const int64_t n0 = (b + j) * kRows;
          if (n0 < a.N) store_rows(a.out, a.out_bf16, a.N, n0, std::min<int64_t>(kRows, a.N - n0), m0, 8, o + j * 8 * kRows);
        }
      }
      if (rest.M > 0) {
        block(rest, b);
        block(rest, b + 1);
      }
    }
  }
  for (; b < b1; ++b) block(a, b);
}

}  // namespace int4bf16

#endif
