// The many-rows step of paged_attention_cpu.cpp's online softmax on AMX tiles (TDPBF16PS), for a bf16 cache with
// blocks of 16 keys and head dims 32-128 (multiples of 32). Included by paged_attention_cpu.cpp where QUANTKIT_AMX
// (amx_bf16.h). A prefill tile's or the shared-prefix pass's rows (16 rows a row tile, as many tiles as the work item
// has) fold up to 4 blocks (64 keys) a step:
//
//   S = Q K^T   A: 16 query rows x 32 dims (the unscaled bf16 query), B: the block's keys as a B tile (kt: row p holds
//               dims 2p, 2p + 1 of each of the 16 keys, a 16 x 16 transpose of the keys read as 32-bit words);
//               one C tile of 16 rows x 16 keys per block
//   softmax     per row, in fp32 vectors, over the step's 64 scores at once (one max, one rescale of the accumulator
//               and one sum a step, where the AVX-512 step takes one a block); the probabilities rounded to bf16, as
//               the AVX-512 bf16 step and flash attention do, their fp32 sum the denominator
//   O = P V     A: 16 rows x 32 keys of probabilities, B: the values of 32 keys (two blocks) as a B tile per 16 dims
//               (vt: row p holds keys 2p, 2p + 1 side by side for each dim); the step's C tiles are added to the
//               rescaled accumulator
//
// The key and value tiles of a step are made once and serve every row tile of the work item. Keys past the last one
// any row sees (a block's unwritten rows) are zero in both, so stale cache rows never reach a sum.
// Tiles: 0-3 C (a step's scores, then its outputs, four dims tiles at a time), 4-5 A, 6-7 B; all 16 x 64 bytes.
#pragma once

#include "amx_bf16.h"
#include "vec_avx512.h"

#if defined(QUANTKIT_AMX) && defined(QUANTKIT_AVX512)
#define QUANTKIT_ATTENTION_AMX 1

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace amxattn {

constexpr int kBlock = 16;      // keys a cache block holds (the only block size this step takes)
constexpr int kStepBlocks = 4;  // blocks a softmax step folds

// Whether the step takes head dim d and blocks of block_size keys, and this process has AMX tiles.
static inline bool supports(int64_t d, int64_t block_size) {
  return block_size == kBlock && d % 32 == 0 && d >= 32 && d <= 128 && amx::usable(d);
}

// From how many rows of a work item the AMX step runs (below: the AVX-512 steps). A setting, so that tests and the
// attention benchmark can run both paths in one process (set_amx_attention_from_rows in paged_attention_cpu.cpp).
inline int64_t& from_rows() {
  static int64_t rows = 16;
  return rows;
}

// r[n] (16 32-bit words each) -> r[p] with lane n = the old r[n] lane p (a 16 x 16 transpose in 64 shuffles).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // in each 128-bit lane: rows 2i, 2i + 1 interleaved by word
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[4][4];  // u[g][j], 128-bit lane L: column 4L + j of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit lanes across the four groups
    const __m512i v0 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0x44), v1 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0x44), v3 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// A step's shared tiles: kt[j][c] the keys of block j, dims 32c .. 32c + 31; vt[h][c] the values of keys 32h ..
// 32h + 31 (blocks 2h, 2h + 1), dims 16c .. 16c + 15. Each tile 16 rows of 16 32-bit words.
template <int D>
struct StepTiles {
  alignas(64) uint32_t kt[kStepBlocks][D / 32][kBlock * 16];
  alignas(64) uint32_t vt[kStepBlocks / 2][D / 16][kBlock * 16];
};

// Block j of a step (keys at kb, values at vb, rows token_stride elements apart; its first `keys` rows live, the rest
// taken as zero) into its tiles.
template <int D>
inline void stage_block(const uint16_t* kb, const uint16_t* vb, int64_t token_stride, int keys, int j,
                        StepTiles<D>& t) {
  for (int c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int n = 0; n < kBlock; ++n)
      r[n] = n < keys ? _mm512_loadu_si512(kb + n * token_stride + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(t.kt[j][c] + p * 16, r[p]);
  }
  // word 2n <- a[n], 2n + 1 <- b[n]: dims 16c .. 16c + 15 of two keys, interleaved (lo: n = 0..15, hi: 16..31)
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int h = j / 2, row0 = (j % 2) * 8;
  for (int i = 0; i < kBlock / 2; ++i)
    for (int c2 = 0; c2 < D / 32; ++c2) {
      const __m512i a = 2 * i < keys ? _mm512_loadu_si512(vb + 2 * i * token_stride + 32 * c2) : _mm512_setzero_si512();
      const __m512i b = 2 * i + 1 < keys ? _mm512_loadu_si512(vb + (2 * i + 1) * token_stride + 32 * c2)
                                         : _mm512_setzero_si512();
      _mm512_store_si512(t.vt[h][2 * c2] + (row0 + i) * 16, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(t.vt[h][2 * c2 + 1] + (row0 + i) * 16, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// A block past the step's last one: its half of the value tiles zero (the step's probabilities there are zero too).
template <int D>
inline void clear_block(int j, StepTiles<D>& t) {
  for (int c = 0; c < D / 16; ++c)
    std::memset(t.vt[j / 2][c] + (j % 2) * 8 * 16, 0, 8 * 16 * sizeof(uint32_t));
}

// The tile intrinsics take their tile numbers as literals (they are spelled into the instruction), so each C tile's
// steps are written out once per tile by these macros.
//
// QUANTKIT_SCORES(J): C tile J = the 16 rows of q (row stride D) against block J's keys (scores, unscaled).
#define QUANTKIT_SCORES(J)                                  \
  do {                                                      \
    _tile_zero(J);                                          \
    for (int c = 0; c < D / 32; c += 2) {                   \
      _tile_loadd(4, q + 32 * c, D * 2);                    \
      _tile_loadd(6, t.kt[J][c], 64);                       \
      _tile_dpbf16ps(J, 4, 6);                              \
      if (c + 1 < D / 32) {                                 \
        _tile_loadd(5, q + 32 * (c + 1), D * 2);            \
        _tile_loadd(7, t.kt[J][c + 1], 64);                 \
        _tile_dpbf16ps(J, 5, 7);                            \
      }                                                     \
    }                                                       \
  } while (0)

// QUANTKIT_OUTPUTS(I): C tile I = probabilities p ([2][16][32] bf16: each row's keys 0-31, then 32-63) against the
// values of dims 16c .. 16c + 15, over `halves` key halves.
#define QUANTKIT_OUTPUTS(I)                                 \
  do {                                                      \
    _tile_zero(I);                                          \
    _tile_loadd(4, p, 64);                                  \
    _tile_loadd(6, t.vt[0][c], 64);                         \
    _tile_dpbf16ps(I, 4, 6);                                \
    if (halves > 1) {                                       \
      _tile_loadd(5, p + kBlock * 32, 64);                  \
      _tile_loadd(7, t.vt[1][c], 64);                       \
      _tile_dpbf16ps(I, 5, 7);                              \
    }                                                       \
  } while (0)

template <int D>
inline void scores_of(int j, const uint16_t* q, const StepTiles<D>& t) {
  switch (j) {
    case 0: QUANTKIT_SCORES(0); break;
    case 1: QUANTKIT_SCORES(1); break;
    case 2: QUANTKIT_SCORES(2); break;
    default: QUANTKIT_SCORES(3); break;
  }
}

// C tile i: the outputs of dims tile c.
template <int D>
inline void outputs_of(int i, const uint16_t* p, int halves, int c, const StepTiles<D>& t) {
  switch (i) {
    case 0: QUANTKIT_OUTPUTS(0); break;
    case 1: QUANTKIT_OUTPUTS(1); break;
    case 2: QUANTKIT_OUTPUTS(2); break;
    default: QUANTKIT_OUTPUTS(3); break;
  }
}

#undef QUANTKIT_SCORES
#undef QUANTKIT_OUTPUTS

// Folds blocks b0 .. b1 - 1 into n rows: qb [n][D] the unscaled bf16 query rows, acc [n][D], m, l fp32 (the online
// softmax's state, continued); base(b) the element offset of block b's first key row in both caches (kc, vc); row r
// sees the keys of block b up to key index last[r] (last: null, every key of every block). The scores are scaled by
// `scale` after their sums, as the AVX-512 bf16 step does.
template <int D, typename Base>
void fold_blocks(int64_t n, const c10::BFloat16* qb, float scale, float* acc, float* m, float* l, const c10::BFloat16* kc,
                 const c10::BFloat16* vc, int64_t token_stride, int64_t b0, int64_t b1, Base base, const int64_t* last) {
  thread_local std::vector<uint8_t> room;
  const int64_t tiles = (n + 15) / 16;
  const size_t need = sizeof(StepTiles<D>) + tiles * 16 * D * 2 + 2 * kBlock * 32 * 2 + 16 * D * 4 + 4 * 256 * 4 + 64;
  if (room.size() < need) room.resize(need);
  uint8_t* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(room.data()) + 63) & ~uintptr_t(63));
  auto& st = *reinterpret_cast<StepTiles<D>*>(at);
  uint16_t* q = reinterpret_cast<uint16_t*>(at + sizeof(StepTiles<D>));  // [tiles * 16][D], rows past n zero
  uint16_t* p = q + tiles * 16 * D;                                      // [2][16][32] probabilities
  float* o = reinterpret_cast<float*>(p + 2 * kBlock * 32);               // [16][D] a step's outputs
  float* s = o + 16 * D;                                                  // [4][16][16] a step's scores
  std::memcpy(q, qb, n * D * 2);
  std::memset(q + n * D, 0, (tiles * 16 - n) * D * 2);
  const auto seen = [&](int64_t r, int64_t b) -> int {  // keys of block b row r sees
    return last == nullptr ? kBlock : static_cast<int>(std::clamp<int64_t>(last[r] - b * kBlock + 1, 0, kBlock));
  };
  const float neg_inf = -std::numeric_limits<float>::infinity();
  amx::configure(16, 16);
  for (int64_t b = b0; b < b1; b += kStepBlocks) {
    const int nb = static_cast<int>(std::min<int64_t>(kStepBlocks, b1 - b));
    for (int j = 0; j < nb; ++j) {
      int keys = 0;
      for (int64_t r = 0; r < n && keys < kBlock; ++r) keys = std::max(keys, seen(r, b + j));
      const int64_t off = base(b + j);
      stage_block<D>(reinterpret_cast<const uint16_t*>(kc + off), reinterpret_cast<const uint16_t*>(vc + off),
                     token_stride, keys, j, st);
    }
    if (nb % 2) clear_block<D>(nb, st);
    const int halves = (nb + 1) / 2;
    for (int64_t rt = 0; rt < tiles; ++rt) {
      const int64_t r0 = rt * 16, rows = std::min<int64_t>(16, n - r0);
      for (int j = 0; j < nb; ++j) {
        scores_of<D>(j, q + r0 * D, st);
      }
      for (int j = 0; j < nb; ++j) {
        switch (j) {
          case 0: _tile_stored(0, s, 64); break;
          case 1: _tile_stored(1, s + 256, 64); break;
          case 2: _tile_stored(2, s + 512, 64); break;
          default: _tile_stored(3, s + 768, 64); break;
        }
      }
      float alpha[16];
      for (int64_t i = 0; i < 16; ++i) {
        uint16_t* pr = p + i * 32;  // half 0; half 1 at + 16 * 32
        alpha[i] = 1.f;
        if (i >= rows) continue;  // padding rows: their outputs are never read
        const int64_t r = r0 + i;
        __m512 sc[kStepBlocks], mx = _mm512_set1_ps(neg_inf);
        for (int j = 0; j < nb; ++j) {
          sc[j] = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), vec512::first(seen(r, b + j)),
                                     _mm512_mul_ps(_mm512_load_ps(s + j * 256 + i * 16), _mm512_set1_ps(scale)));
          mx = _mm512_max_ps(mx, sc[j]);
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
        __m512 e[kStepBlocks] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        if (m_new != neg_inf) {  // else the row has seen no key yet: its state and probabilities stay zero
          alpha[i] = std::exp(m[r] - m_new);
          __m512 sum = _mm512_setzero_ps();
          for (int j = 0; j < nb; ++j) {
            e[j] = _mm512_maskz_mov_ps(vec512::first(seen(r, b + j)),
                                       vec512::exp16(_mm512_sub_ps(sc[j], _mm512_set1_ps(m_new))));
            sum = _mm512_add_ps(sum, e[j]);
          }
          l[r] = l[r] * alpha[i] + _mm512_reduce_add_ps(sum);
          m[r] = m_new;
        }
        _mm512_store_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        _mm512_store_si512(pr + 16 * 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
      }
      for (int c0 = 0; c0 < D / 16; c0 += 4) {  // four dims tiles at a time
        const int cn = std::min(4, D / 16 - c0);
        for (int i = 0; i < cn; ++i) outputs_of<D>(i, p, halves, c0 + i, st);
        for (int i = 0; i < cn; ++i) {
          switch (i) {
            case 0: _tile_stored(0, o + 16 * c0, D * 4); break;
            case 1: _tile_stored(1, o + 16 * (c0 + 1), D * 4); break;
            case 2: _tile_stored(2, o + 16 * (c0 + 2), D * 4); break;
            default: _tile_stored(3, o + 16 * (c0 + 3), D * 4); break;
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {  // acc = acc * alpha + the step's outputs
        float* ar = acc + (r0 + i) * D;
        const __m512 a = _mm512_set1_ps(alpha[i]);
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(ar + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(ar + 16 * c), a, _mm512_load_ps(o + i * D + 16 * c)));
      }
    }
  }
  amx::tile_release();
}

// fold_blocks for head dim d (a multiple of 32, 32 to 128; supports(d, 16) checked by the caller).
template <typename Base>
void fold_blocks_any(int64_t d, int64_t n, const c10::BFloat16* qb, float scale, float* acc, float* m, float* l,
                     const c10::BFloat16* kc, const c10::BFloat16* vc, int64_t token_stride, int64_t b0, int64_t b1,
                     Base base, const int64_t* last) {
  switch (d) {
    case 32: return fold_blocks<32>(n, qb, scale, acc, m, l, kc, vc, token_stride, b0, b1, base, last);
    case 64: return fold_blocks<64>(n, qb, scale, acc, m, l, kc, vc, token_stride, b0, b1, base, last);
    case 96: return fold_blocks<96>(n, qb, scale, acc, m, l, kc, vc, token_stride, b0, b1, base, last);
    default: return fold_blocks<128>(n, qb, scale, acc, m, l, kc, vc, token_stride, b0, b1, base, last);
  }
}

}  // namespace amxattn

#endif
