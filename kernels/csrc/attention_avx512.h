// The per-block step of paged_attention_cpu.cpp's online softmax in AVX-512 (fp32 arithmetic; the
// cache fp32, bf16 or fp16), for head dims 32, 64, 96 and 128. Included by
// paged_attention_cpu.cpp; compiled where vec_avx512.h finds AVX-512 F/BW/VL (-march=native on such a
// CPU), elsewhere the portable fold_block there runs. Same contract as that fold_block:
//
//   rows      the work item's query rows: q [n, D] pre-scaled, acc [n, D], running max m [n], sum l [n]
//   kb, vb    the block's first key / value row of this kv head; rows token_stride elements apart
//   visible   row r sees the block's first visible[r] keys (all block_size when null)
//
// Few rows (a decode: one query per query head of the kv head), up to 16 keys a step (fold_keys): each
// row keeps its query in registers while the keys pass; each key's dot product stays a vector of partial
// sums, and the 16 keys' vectors are summed together in one shuffle tree into a vector of 16 scores (no
// horizontal sum per key); on a bf16 cache with AVX-512 BF16 the dot products take the bf16 query by
// vdpbf16ps. The scores are exponentiated as one vector, and the row's accumulator stays in registers
// while the values pass.
// Many rows (a prefill tile, the shared-prefix pass; from widen_from_rows()): the block is widened once
// and folded into R rows at a time (fold_rows_widened; on a bf16 cache with AVX-512 BF16, in bf16 pairs
// by vdpbf16ps: fold_rows_widened_bf16).
#pragma once

#include "vec_avx512.h"

#if defined(QUANTKIT_AVX512)

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace avx512 {

using vec512::exp16;
using vec512::first;
using vec512::load16;

// One row's online-softmax step over 16 scores s (a widened block's, or fold_keys'), of which the first
// `valid` (1 to 16) count: returns e = exp(s - m_new) (0 past valid) and sets alpha (the old accumulator's
// rescale, 0 on the first block, where m = -inf), then m and l.
inline __m512 softmax_step(__m512 s, int64_t valid, float& m, float& l, float& alpha) {
  const __mmask16 k = first(valid);
  s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), k, s);
  const float m_new = std::max(m, _mm512_reduce_max_ps(s));
  alpha = std::exp(m - m_new);
  const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  l = l * alpha + _mm512_reduce_add_ps(e);
  m = m_new;
  return e;
}

// Few rows: the scores of a row over up to 16 keys come out as one vector. Each key's dot product is a
// vector of 16 partial sums (Dot below); instead of summing each across its lanes (a horizontal sum, 4
// shuffles and 4 adds, per key and row), the 16 keys' vectors are summed together in a tree of 2 shuffles
// and an add per pair (lanes4, lanes16): 45 operations for 16 scores against 128.

// a, b, c, d: key vectors -> 128-bit lane j holds the j-th key's 4 partial sums.
inline __m512 lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));  // lanes A A B B
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));  // lanes C C D D
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

// u[g] = lanes4 of keys 4g .. 4g + 3 -> lane t = key t's score.
inline __m512 lanes16(const __m512 (&u)[4]) {
  const auto pairs = [](__m512 a, __m512 b) {  // per 128-bit lane: a's two sums, then b's
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m512 lo = pairs(u[0], u[1]), hi = pairs(u[2], u[3]);
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4k + j: key k + 4j
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), sums);
}

// A row's dot product with one key as a vector to be summed across its lanes, and the factor that makes
// the sum a scaled score. Dot<NV, T>: the pre-scaled fp32 query (D / 16 vectors) against the key widened
// to fp32, one fused multiply-add per 16 dims.
template <int NV, typename T>
struct Dot {
  __m512 q[NV];
  static constexpr float scale = 1.f;
  explicit Dot(const float* qr) {
    for (int c = 0; c < NV; ++c) q[c] = _mm512_loadu_ps(qr + 16 * c);
  }
  __m512 operator()(const T* k) const {
    __m512 d = _mm512_mul_ps(q[0], load16(k));
    for (int c = 1; c < NV; ++c) d = _mm512_fmadd_ps(q[c], load16(k + 16 * c), d);
    return d;
  }
};

#if defined(__AVX512BF16__)
// On a bf16 cache: the unscaled bf16 query against the key as it is stored, by vdpbf16ps (32 dims an
// instruction, the products exact in fp32), the score scaled after the sum (as the widened bf16 step does).
template <int NV>
struct Bf16Dot {
  __m512bh q[NV / 2];
  float scale;
  Bf16Dot(const c10::BFloat16* qr, float sc) : scale(sc) {
    for (int c = 0; c < NV / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
  }
  __m512 operator()(const c10::BFloat16* k) const {
    __m512 d = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c) d = _mm512_dpbf16_ps(d, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return d;
  }
};
#endif

// One online-softmax step of R rows (R = 1, or 2 rows that see the same keys: a decode's query heads of
// one kv head, each key and value loaded once for both) over the block's first `valid` keys (1 to 16):
// dot[r] the row's query, acc at stride D, m and l. The same arithmetic per row whatever R, so the
// same bits.
template <int NV, int R, typename DotT, typename T>
inline void fold_keys(const DotT (&dot)[R], float* acc, float* m, float* l, const T* kb, const T* vb,
                      int64_t token_stride, int64_t valid) {
  constexpr int D = 16 * NV;
  __m512 u[R][4];
  for (int g = 0; g < 4; ++g) {  // keys 4g .. 4g + 3; keys past valid count 0 (softmax_step masks them)
    __m512 kd[R][4];
    for (int j = 0; j < 4; ++j) {
      const int64_t t = 4 * g + j;
      for (int r = 0; r < R; ++r) kd[r][j] = t < valid ? dot[r](kb + t * token_stride) : _mm512_setzero_ps();
    }
    for (int r = 0; r < R; ++r) u[r][g] = lanes4(kd[r][0], kd[r][1], kd[r][2], kd[r][3]);
  }
  alignas(64) float p[R][16];
  __m512 a[R];
  for (int r = 0; r < R; ++r) {
    float alpha;
    const __m512 s = _mm512_mul_ps(lanes16(u[r]), _mm512_set1_ps(dot[r].scale));
    _mm512_store_ps(p[r], softmax_step(s, valid, m[r], l[r], alpha));
    a[r] = _mm512_set1_ps(alpha);
  }
  __m512 av[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) av[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), a[r]);
  for (int64_t t = 0; t < valid; ++t) {  // acc += p_t v_t
    const T* v = vb + t * token_stride;
    for (int c = 0; c < NV; ++c) {
      const __m512 vc = load16(v + 16 * c);
      for (int r = 0; r < R; ++r) av[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][t]), vc, av[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, av[r][c]);
}

// Whether the per-row step folds two rows that see the same keys together (fold_keys with R = 2). A setting, like
// widen_from_rows, so that a test can check both give the same bits and the benchmarks can time both.
inline bool& pair_rows() {
  static bool on = true;
  return on;
}

// Whether fold_rows takes head dim d.
inline bool supports(int64_t d) { return d == 32 || d == 64 || d == 96 || d == 128; }

// Many rows over one block of 16 keys (a prefill tile, the shared-prefix pass): the block is widened
// once, its keys transposed to kt [D][16] and its values to vf [16][D], fp32, zero past `keys`. A row's
// 16 scores are then D broadcast FMAs into one vector (no horizontal sum per key), and R rows share each
// load of kt and vf.
constexpr int64_t WIDE_BLOCK = 16;

// From how many rows of a work item fold_rows widens the block (below: the per-row step above, for which
// widening would cost more than it saves). A setting, so that tests and the attention benchmark can run
// both paths in one process (set_widen_from_rows in paged_attention_cpu.cpp).
inline int64_t& widen_from_rows() {
  static int64_t rows = 8;
  return rows;
}

template <int NV, typename T>
inline void widen_block(const T* kb, const T* vb, int64_t token_stride, int64_t keys, float* kt, float* vf) {
  constexpr int D = 16 * NV;
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(WIDE_BLOCK));
  for (int64_t t = 0; t < WIDE_BLOCK; ++t)
    for (int c = 0; c < NV; ++c) {
      const bool live = t < keys;
      const __m512 k = live ? load16(kb + t * token_stride + 16 * c) : _mm512_setzero_ps();
      _mm512_storeu_ps(vf + t * D + 16 * c, live ? load16(vb + t * token_stride + 16 * c) : _mm512_setzero_ps());
      _mm512_i32scatter_ps(kt + 16 * c * WIDE_BLOCK + t, column, k, 4);  // kt[16c + i][t] = k[i]
    }
}

// R rows (q, acc at stride D; m, l) over a widened block; row r sees its first valid[r] keys (0 to 16).
template <int NV, int R>
inline void fold_widened(const float* q, float* acc, float* m, float* l, const int64_t* valid, const float* kt,
                         const float* vf) {
  constexpr int D = 16 * NV;
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  for (int i = 0; i < D; i += 2) {  // two chains per row: s0 over even dims, s1 over odd ones
    const __m512 k0 = _mm512_loadu_ps(kt + i * WIDE_BLOCK), k1 = _mm512_loadu_ps(kt + (i + 1) * WIDE_BLOCK);
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + i]), k0, s0[r]);
      s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + i + 1]), k1, s1[r]);
    }
  }
  alignas(64) float p[R][WIDE_BLOCK];
  float alpha[R];
  int64_t keys = 0;
  for (int r = 0; r < R; ++r) {
    alpha[r] = 1.f;
    _mm512_store_ps(p[r], _mm512_setzero_ps());
    if (valid[r] <= 0) continue;  // the row sees none of this block: its state stays as it is
    keys = std::max(keys, valid[r]);
    _mm512_store_ps(p[r], softmax_step(_mm512_add_ps(s0[r], s1[r]), valid[r], m[r], l[r], alpha[r]));
  }
  __m512 av[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) av[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int64_t t = 0; t < keys; ++t) {  // acc += p_t v_t
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vf + t * D + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][t]);
      for (int c = 0; c < NV; ++c) av[r][c] = _mm512_fmadd_ps(pr, vv[c], av[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, av[r][c]);
}

// Rows at a time over a widened block: R rows' accumulators and the block's values fit in 32 registers.
template <int NV>
constexpr int ROWS_AT_A_TIME = NV <= 4 ? 4 : 2;

// The keys of the block any of the n rows sees (0: none), and the widened path's walk over the rows:
// fold(r, count, valid) for rows r .. r + count - 1, count ROWS_AT_A_TIME<NV> and then 1 for the rest,
// valid[j] the keys row r + j sees (0 to 16).
struct WidenedRows {
  int64_t n;
  const int64_t* visible;

  int64_t seen(int64_t r) const { return visible ? std::clamp<int64_t>(visible[r], 0, WIDE_BLOCK) : WIDE_BLOCK; }

  int64_t keys() const {
    int64_t k = 0;
    for (int64_t r = 0; r < n; ++r) k = std::max(k, seen(r));
    return k;
  }

  template <int R, typename Group, typename One>
  void walk(Group group, One one) const {
    int64_t valid[R];
    int64_t r = 0;
    for (; r + R <= n; r += R) {
      for (int j = 0; j < R; ++j) valid[j] = seen(r + j);
      group(r, valid);
    }
    for (; r < n; ++r) {
      valid[0] = seen(r);
      one(r, valid);
    }
  }
};

template <int NV, typename T>
inline void fold_rows_widened(int64_t n, float* q, float* acc, float* m, float* l, const T* kb, const T* vb,
                              int64_t token_stride, const int64_t* visible) {
  constexpr int D = 16 * NV, R = ROWS_AT_A_TIME<NV>;
  const WidenedRows rows{n, visible};
  const int64_t keys = rows.keys();
  if (keys == 0) return;
  alignas(64) float kt[D * WIDE_BLOCK], vf[WIDE_BLOCK * D];
  widen_block<NV>(kb, vb, token_stride, keys, kt, vf);
  rows.walk<R>([&](int64_t r, const int64_t* valid) { fold_widened<NV, R>(q + r * D, acc + r * D, m + r, l + r, valid, kt, vf); },
               [&](int64_t r, const int64_t* valid) { fold_widened<NV, 1>(q + r * D, acc + r * D, m + r, l + r, valid, kt, vf); });
}

#if defined(__AVX512BF16__)
// A bf16 cache's widened block stays bf16, in the pairs vdpbf16ps multiplies (one instruction: 16 lanes,
// each the fp32 sum of two products of bf16 values): kp [D / 2][16] words, word (i, t) = key t's dims
// 2i and 2i + 1 (a key row read as 32-bit words), and vp [8][D] words, word (j, c) = dim c of keys 2j and
// 2j + 1. Scores are q . k of the unscaled bf16 query, exact products summed in fp32, then scaled; the
// probabilities are rounded to bf16 for the values' products (as flash attention does), their fp32 sum
// is the softmax's denominator.
template <int NV>
inline void widen_block_bf16(const c10::BFloat16* kb, const c10::BFloat16* vb, int64_t token_stride, int64_t keys,
                             uint32_t* kp, uint32_t* vp) {
  constexpr int D = 16 * NV, W = D / 2;
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(WIDE_BLOCK));
  for (int64_t t = 0; t < WIDE_BLOCK; ++t)
    for (int w = 0; w < W; w += 16) {  // 16 words (32 dims) a load
      const __m512i k = t < keys ? _mm512_loadu_si512(kb + t * token_stride + 2 * w) : _mm512_setzero_si512();
      _mm512_i32scatter_epi32(kp + w * WIDE_BLOCK + t, column, k, 4);
    }
  const auto row16 = [&](int64_t t, int c) {  // dims 16c .. 16c + 15 of value t, each in a 32-bit lane
    return t < keys ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + t * token_stride + 16 * c)))
                    : _mm512_setzero_si512();
  };
  for (int64_t j = 0; j < WIDE_BLOCK / 2; ++j)
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_si512(vp + j * D + 16 * c, _mm512_or_si512(row16(2 * j, c), _mm512_slli_epi32(row16(2 * j + 1, c), 16)));
}

// R rows (qw [R][D / 2] words of the unscaled bf16 query; acc at stride D; m, l) over a bf16-widened block.
template <int NV, int R>
inline void fold_widened_bf16(const uint32_t* qw, float scale, float* acc, float* m, float* l, const int64_t* valid,
                              const uint32_t* kp, const uint32_t* vp) {
  constexpr int D = 16 * NV, W = D / 2;
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  for (int i = 0; i < W; i += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + i * WIDE_BLOCK);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (i + 1) * WIDE_BLOCK);
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_dpbf16_ps(s0[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * W + i])), k0);
      s1[r] = _mm512_dpbf16_ps(s1[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * W + i + 1])), k1);
    }
  }
  alignas(64) uint16_t p[R][WIDE_BLOCK];
  float alpha[R];
  int64_t keys = 0;
  for (int r = 0; r < R; ++r) {
    alpha[r] = 1.f;
    _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), _mm256_setzero_si256());
    if (valid[r] <= 0) continue;
    keys = std::max(keys, valid[r]);
    const __m512 e = softmax_step(_mm512_mul_ps(_mm512_add_ps(s0[r], s1[r]), _mm512_set1_ps(scale)), valid[r], m[r],
                                  l[r], alpha[r]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), (__m256i)_mm512_cvtneps_pbh(e));
  }
  __m512 av[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) av[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int64_t j = 0; 2 * j < keys; ++j) {  // acc += p_2j v_2j + p_2j+1 v_2j+1
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + j * D + 16 * c);
    for (int r = 0; r < R; ++r) {
      uint32_t two;
      std::memcpy(&two, p[r] + 2 * j, sizeof two);
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(two));
      for (int c = 0; c < NV; ++c) av[r][c] = _mm512_dpbf16_ps(av[r][c], pr, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, av[r][c]);
}

template <int NV>
inline void fold_rows_widened_bf16(int64_t n, const c10::BFloat16* qb, float scale, float* acc, float* m, float* l,
                                   const c10::BFloat16* kb, const c10::BFloat16* vb, int64_t token_stride,
                                   const int64_t* visible) {
  constexpr int D = 16 * NV, W = D / 2, R = ROWS_AT_A_TIME<NV>;
  const WidenedRows rows{n, visible};
  const int64_t keys = rows.keys();
  if (keys == 0) return;
  alignas(64) uint32_t kp[W * WIDE_BLOCK], vp[WIDE_BLOCK / 2 * D];
  widen_block_bf16<NV>(kb, vb, token_stride, keys, kp, vp);
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(qb);
  rows.walk<R>(
      [&](int64_t r, const int64_t* valid) { fold_widened_bf16<NV, R>(qw + r * W, scale, acc + r * D, m + r, l + r, valid, kp, vp); },
      [&](int64_t r, const int64_t* valid) { fold_widened_bf16<NV, 1>(qw + r * W, scale, acc + r * D, m + r, l + r, valid, kp, vp); });
}
#endif

// fold_keys for row r alone, or with row r + 1 (pair; D <= 64, where both rows' queries and accumulators
// fit the registers): make_dot(std::integral_constant<int, NV>, row) -> that row's Dot.
template <int NV, typename MakeDot, typename T>
inline void fold_dims(MakeDot make_dot, bool pair, int64_t r, float* acc, float* m, float* l, const T* kb, const T* vb,
                      int64_t token_stride, int64_t valid) {
  const std::integral_constant<int, NV> nv;
  using DotT = decltype(make_dot(nv, r));
  float* ar = acc + r * 16 * NV;
  if constexpr (NV <= 4) {
    if (pair) {
      const DotT dots[2] = {make_dot(nv, r), make_dot(nv, r + 1)};
      return fold_keys<NV, 2>(dots, ar, m + r, l + r, kb, vb, token_stride, valid);
    }
  }
  const DotT dots[1] = {make_dot(nv, r)};
  fold_keys<NV, 1>(dots, ar, m + r, l + r, kb, vb, token_stride, valid);
}

// Folds one block into n rows: q [n, D] pre-scaled fp32 (qb: the same rows unscaled in the cache's dtype
// when that is bf16, else null; scale: the factor between them), acc, m, l; the block's keys kb and
// values vb, rows token_stride elements apart; row r sees the first visible[r] keys (all when null).
template <typename T>
inline void fold_rows(int64_t n, int64_t d, float* q, const T* qb, float scale, float* acc, float* m, float* l,
                      const T* kb, const T* vb, int64_t token_stride, int64_t block_size, const int64_t* visible) {
  if (block_size == WIDE_BLOCK && n >= widen_from_rows()) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (qb != nullptr) switch (d) {
          case 32: return fold_rows_widened_bf16<2>(n, qb, scale, acc, m, l, kb, vb, token_stride, visible);
          case 64: return fold_rows_widened_bf16<4>(n, qb, scale, acc, m, l, kb, vb, token_stride, visible);
          case 96: return fold_rows_widened_bf16<6>(n, qb, scale, acc, m, l, kb, vb, token_stride, visible);
          default: return fold_rows_widened_bf16<8>(n, qb, scale, acc, m, l, kb, vb, token_stride, visible);
        }
    }
#endif
    switch (d) {
      case 32: return fold_rows_widened<2>(n, q, acc, m, l, kb, vb, token_stride, visible);
      case 64: return fold_rows_widened<4>(n, q, acc, m, l, kb, vb, token_stride, visible);
      case 96: return fold_rows_widened<6>(n, q, acc, m, l, kb, vb, token_stride, visible);
      default: return fold_rows_widened<8>(n, q, acc, m, l, kb, vb, token_stride, visible);
    }
  }
  for (int64_t t0 = 0; t0 < block_size; t0 += WIDE_BLOCK) {  // up to 16 keys a step
    const auto seen = [&](int64_t r) {
      return std::clamp<int64_t>((visible ? std::min(block_size, visible[r]) : block_size) - t0, 0, WIDE_BLOCK);
    };
    for (int64_t r = 0; r < n; ++r) {
      const int64_t valid = seen(r);
      if (valid <= 0) continue;
      const bool pair = pair_rows() && r + 1 < n && d <= 64 && seen(r + 1) == valid;
      const int64_t at = t0 * token_stride;
      const auto fold = [&](auto make_dot) {  // make_dot(row) -> the row's Dot
        switch (d) {
          case 32: return fold_dims<2>(make_dot, pair, r, acc, m, l, kb + at, vb + at, token_stride, valid);
          case 64: return fold_dims<4>(make_dot, pair, r, acc, m, l, kb + at, vb + at, token_stride, valid);
          case 96: return fold_dims<6>(make_dot, pair, r, acc, m, l, kb + at, vb + at, token_stride, valid);
          default: return fold_dims<8>(make_dot, pair, r, acc, m, l, kb + at, vb + at, token_stride, valid);
        }
      };
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (qb != nullptr) {
          fold([&](auto nv, int64_t row) { return Bf16Dot<decltype(nv)::value>(qb + row * d, scale); });
          r += pair;
          continue;
        }
      }
#endif
      fold([&](auto nv, int64_t row) { return Dot<decltype(nv)::value, T>(q + row * d); });
      r += pair;
    }
  }
}

}  // namespace avx512

#endif
