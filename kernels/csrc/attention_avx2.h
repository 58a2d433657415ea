// The many-rows step of paged_attention_cpu.cpp's online softmax in AVX2 + FMA (fp32 arithmetic; the cache fp32,
// bf16 or fp16), for head dims that are multiples of 8 up to kMaxDim: a prefill tile's rows (a work item's queries x
// the query heads of one kv head) against blocks [b0, b1) of the cache. Included by paged_attention_cpu.cpp; compiled
// where the compiler targets AVX2 and FMA, and run where the AVX-512 step (attention_avx512.h) is not built.
//
// The keys go kMaxKeys at a time whatever the block size. A step gathers its keys (widened and transposed once, kt
// [D, 8 * KV], keys in lanes) and its values (widened into one contiguous buffer: a kv head's rows lie token_stride
// apart in the cache, 2 KiB for 8 kv heads of 64, so that 64 of them fall in a few L1 sets and evicted one another
// when read in place), then makes three passes over the rows: scores 8 keys a vector (one FMA per dim and key vector),
// weights (exp8 on vectors), values into the accumulators, each pass keeping its shared operand in L1 and taking rows
// two at a time, so that each key or value vector loaded serves two rows. On the AVX2 EPYC a 1B model's 2048-token
// prefill attention (one layer, 32 heads of 64, 8 kv heads) took 420 ms a layer folding one block a step (one row at a
// time, values read in place) and takes 142 ms (docs/BENCHMARKS.md).
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_avx2.h"

namespace avx2att {

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxKeys = 64;  // keys a step

constexpr int64_t kFromRows = 8;  // fewer rows (a decode's query heads) keep the portable loop: the transpose would
                                  // cost as much as the rows' work

inline bool supports(int64_t n, int64_t d) { return n >= kFromRows && d % 8 == 0 && d <= kMaxDim; }

using vec2::exp8;  // lanes below -87 give about 1e-38, not 0: callers zero the lanes they mask
using vec2::max8;
using vec2::sum8;

using vec2::load8;  // 8 elements of a cache row as fp32

// Lanes 0..valid-1 all ones (valid 0 to 8).
inline __m256 first(int64_t valid) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), idx));
}

// v, held in a register: GCC otherwise folds a load that R multiply-adds share into each of them, R loads where one
// does (the loads, not the multiply-adds, then bound the step).
inline __m256 in_register(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

// o[r][v] += sum over i < count of a[r * a_stride + i] * b[i * b_stride + 8v .. + 7], for R rows and N vectors: the
// step's two products (scores: a the queries, b the transposed keys; values: a the weights, b the values). Each
// vector of b loaded serves R rows, each element of a broadcast serves N vectors; o stays in registers.
template <int R, int N>
inline void outer_products(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t count,
                           __m256 (&o)[R][N]) {
  for (int64_t i = 0; i < count; ++i) {
    __m256 ai[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) ai[r] = _mm256_broadcast_ss(a + r * a_stride + i);
#pragma GCC unroll 8
    for (int v = 0; v < N; ++v) {
      const __m256 bv = in_register(_mm256_load_ps(b + i * b_stride + 8 * v));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) o[r][v] = _mm256_fmadd_ps(ai[r], bv, o[r][v]);
    }
  }
}

// Scores of rows r0..r0+R-1 (R 1 or 2) against key vectors [v0, v0 + NV) of a step: sc[r][8v..8v+7] = q_r . keys.
template <int R, int NV>
inline void scores(int64_t d, const float* q, const float* kt, int64_t w, int v0, float* sc) {
  __m256 s[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) s[r][v] = _mm256_setzero_ps();
  outer_products<R, NV>(q, d, kt + 8 * v0, w, d, s);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_store_ps(sc + r * kMaxKeys + 8 * (v0 + v), s[r][v]);
}

// Row r's scores sc [KV * 8] (keys past `valid` ignored) -> its weights p = exp(s - m_new) (0 past valid), the
// running max and sum updated; returns alpha = exp(m_old - m_new), by which its accumulator is to be scaled.
template <int KV>
inline float weights(float* sc, int64_t valid, float& m, float& l) {
  const __m256 neg = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 s[KV];
  __m256 mx = neg;
#pragma GCC unroll 8
  for (int v = 0; v < KV; ++v) {
    s[v] = _mm256_blendv_ps(neg, _mm256_load_ps(sc + 8 * v), first(valid - 8 * v));
    mx = _mm256_max_ps(mx, s[v]);
  }
  const float m_new = std::max(m, max8(mx));
  const float alpha = std::exp(m - m_new);  // 0 on the first step (m = -inf)
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int v = 0; v < KV; ++v) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(s[v], mv)), first(valid - 8 * v));
    sum = _mm256_add_ps(sum, e);
    _mm256_store_ps(sc + 8 * v, e);
  }
  l = l * alpha + sum8(sum);
  m = m_new;
  return alpha;
}

// Columns [c, c + 8 NC) of acc rows r0..r0+R-1 = acc * alpha + sum over keys t < keys of p[r][t] * value t (vals
// [keys, d]: the values).
template <int R, int NC>
inline void accumulate_columns(int64_t d, int64_t c, float* acc, const float* p, const float* alpha,
                               const float* vals, int64_t keys) {
  __m256 o[R][NC];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) o[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + c + 8 * j), a);
  }
  outer_products<R, NC>(p, kMaxKeys, vals + c, d, keys, o);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc + r * d + c + 8 * j, o[r][j]);
}

// Every column of acc rows r0..r0+R-1 (accumulate_columns), 32 at a time.
template <int R>
inline void accumulate(int64_t d, float* acc, const float* p, const float* alpha, const float* vals, int64_t keys) {
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) accumulate_columns<R, 4>(d, c, acc, p, alpha, vals, keys);
  switch ((d - c) / 8) {
    case 3: return accumulate_columns<R, 3>(d, c, acc, p, alpha, vals, keys);
    case 2: return accumulate_columns<R, 2>(d, c, acc, p, alpha, vals, keys);
    case 1: return accumulate_columns<R, 1>(d, c, acc, p, alpha, vals, keys);
    default: return;
  }
}

// Rows r0..r0+R-1's scores against a step's KV key vectors (kt [d, KV * 8]) into sc (rows kMaxKeys apart).
template <int KV, int R>
inline void step_scores(int64_t d, const float* q, const float* kt, float* sc) {
  constexpr int64_t W = KV * 8;
  if constexpr (KV >= 4) scores<R, 4>(d, q, kt, W, 0, sc);
  if constexpr (KV >= 8) scores<R, 4>(d, q, kt, W, 4, sc);
  if constexpr (KV % 4 != 0) scores<R, KV % 4>(d, q, kt, W, KV / 4 * 4, sc);
}

// One step: the step's keys (at most kMaxKeys; kt their keys widened and transposed, [d, KV * 8], lanes past the
// step's keys zero; vals their values widened, [keys, d]) folded into n rows, row r seeing the first valid[r] of them.
// In three passes over the rows, so that each pass's shared operand stays in L1 (the keys, then the values): every
// row's scores into sc [n, kMaxKeys], then their weights, then the values into the accumulators. Rows go two at a time
// through the multiply-adds, each key and value vector loaded serving both.
template <int KV>
void fold_step(int64_t n, int64_t d, const float* q, float* acc, float* m, float* l, const float* kt,
               const float* vals, const int64_t* valid, float* sc, float* alpha) {
  for (int64_t r = 0; r < n; r += 2) {
    if (r + 1 < n && valid[r + 1] > 0) step_scores<KV, 2>(d, q + r * d, kt, sc + r * kMaxKeys);
    else if (valid[r] > 0) step_scores<KV, 1>(d, q + r * d, kt, sc + r * kMaxKeys);
  }
  for (int64_t r = 0; r < n; ++r)
    if (valid[r] > 0) alpha[r] = weights<KV>(sc + r * kMaxKeys, valid[r], m[r], l[r]);
  for (int64_t r = 0; r < n; r += 2) {
    const bool first = valid[r] > 0, second = r + 1 < n && valid[r + 1] > 0;
    if (first && second)
      accumulate<2>(d, acc + r * d, sc + r * kMaxKeys, alpha + r, vals, std::max(valid[r], valid[r + 1]));
    else if (first || second) {
      const int64_t one = first ? r : r + 1;
      accumulate<1>(d, acc + one * d, sc + one * kMaxKeys, alpha + one, vals, valid[one]);
    }
  }
}

// Keys krow[0..n) (n <= 8; rows past n zero) widened and transposed into kt: kt[i * w + j] = key j's element i.
template <typename T>
inline void transpose_keys(const T* const* krow, int64_t n, int64_t d, float* kt, int64_t w) {
  for (int64_t i = 0; i < d; i += 8) {
    __m256 r[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) r[j] = j < n ? load8(krow[j] + i) : _mm256_setzero_ps();
    __m256 t[8], u[8];
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < 8; j += 4) {
      u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
      u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
      u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
      u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      _mm256_store_ps(kt + (i + j) * w, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
      _mm256_store_ps(kt + (i + j + 4) * w, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
    }
  }
}

// Cache blocks [b0, b1) folded into n rows, kMaxKeys keys a step whatever the block size (a step's keys may span
// blocks: each step widens and transposes its keys once, then every row folds them in, two rows at a time so that
// each key and value vector loaded serves both). base(b): block b's offset in both caches (this kv head); last: the
// last key position each row sees (null: every key).
template <typename T, typename Base>
void fold_blocks(int64_t n, int64_t d, const float* q, float* acc, float* m, float* l, const T* kc, const T* vc,
                 int64_t token_stride, int64_t block_size, int64_t b0, int64_t b1, Base base, const int64_t* last) {
  alignas(32) float kt[kMaxDim * kMaxKeys];
  alignas(32) float vals[kMaxKeys * kMaxDim];
  std::vector<int64_t> valid(n);
  std::vector<float> scratch, alpha(n);
  float* sc = vec2::aligned32(scratch, n * kMaxKeys);  // the step's scores, then weights, of every row
  const int64_t end = b1 * block_size;
  for (int64_t k0 = b0 * block_size; k0 < end; k0 += kMaxKeys) {
    const int64_t keys = std::min(kMaxKeys, end - k0);
    int64_t any = 0;
    for (int64_t r = 0; r < n; ++r)
      any = std::max(any, valid[r] = last ? std::clamp<int64_t>(last[r] - k0 + 1, 0, keys) : keys);
    if (any <= 0) break;
    const int kv = static_cast<int>((keys + 7) / 8);
    const int64_t w = kv * 8;
    const T* krow[kMaxKeys];
    for (int64_t t = 0; t < keys; ++t) {
      const int64_t pos = k0 + t, off = base(pos / block_size) + (pos % block_size) * token_stride;
      krow[t] = kc + off;
      for (int64_t i = 0; i < d; i += 8) _mm256_store_ps(vals + t * d + i, load8(vc + off + i));
    }
    for (int64_t t = 0; t < w; t += 8) transpose_keys(krow + t, std::min<int64_t>(8, keys - t), d, kt + t, w);
    switch (kv) {
      case 1: fold_step<1>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 2: fold_step<2>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 3: fold_step<3>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 4: fold_step<4>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 5: fold_step<5>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 6: fold_step<6>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      case 7: fold_step<7>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
      default: fold_step<8>(n, d, q, acc, m, l, kt, vals, valid.data(), sc, alpha.data()); break;
    }
  }
}

}  // namespace avx2att
