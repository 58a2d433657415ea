// The per-block step of paged_attention_cpu.cpp's online softmax in AVX2 + FMA (fp32 arithmetic; the cache fp32,
// bf16 or fp16), for head dims that are multiples of 8 up to kMaxDim. Included by paged_attention_cpu.cpp; compiled
// where the compiler targets AVX2 and FMA, and run where the AVX-512 step (attention_avx512.h) is not built. Same
// contract as the portable fold_block there:
//
//   rows      the work item's query rows: q [n, D] pre-scaled, acc [n, D], running max m [n], sum l [n]
//   kb, vb    the block's first key / value row of this kv head; rows token_stride elements apart
//   visible   row r sees the block's first visible[r] keys (all block_size when null)
//
// The portable loop spends, per row and key, a dot product summed across its lanes and a scalar exp; this step took
// 4.2 s off a 2048-token prefill of a 1B model on an AVX2 EPYC (docs/BENCHMARKS.md). Here the block's keys are
// widened and transposed once (kt [D, 8 * KV], keys in lanes), so a row's scores come out 8 keys a vector by one FMA
// per dim and key vector, exponentiated as vectors (exp8), and its accumulator stays in registers while the values
// pass.
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

namespace avx2att {

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxKeys = 64;  // keys a step (a block is folded in steps of at most this many)

constexpr int64_t kFromRows = 8;  // fewer rows (a decode's query heads) keep the portable loop: the transpose would
                                  // cost as much as the rows' work

inline bool supports(int64_t n, int64_t d) { return n >= kFromRows && d % 8 == 0 && d <= kMaxDim; }

// exp(x) for x <= 0, 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (vec512::exp16's),
// times 2^n built in the exponent bits. x below -87 (past fp32's normal range) gives about 1e-38, not 0: callers
// zero the lanes they mask.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094173e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// 8 elements of a cache row as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Lanes 0..valid-1 all ones (valid 0 to 8).
inline __m256 first(int64_t valid) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), idx));
}

// One step: keys [0, keys) of the block (keys <= kMaxKeys) folded into every row. kt: the keys widened and
// transposed, [d, KV * 8] (lanes past `keys` zero).
template <int KV, typename T>
void fold_step(int64_t n, int64_t d, const float* q, float* acc, float* m, float* l, const float* kt, const T* vb,
               int64_t token_stride, int64_t keys, const int64_t* visible) {
  constexpr int64_t W = KV * 8;
  alignas(32) float p[W];
  for (int64_t r = 0; r < n; ++r) {
    const int64_t valid = std::min(keys, visible ? visible[r] : keys);
    if (valid <= 0) continue;
    const float* qr = q + r * d;
    __m256 s[KV];
    for (int v = 0; v < KV; ++v) s[v] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      const __m256 qi = _mm256_broadcast_ss(qr + i);
      for (int v = 0; v < KV; ++v) s[v] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(kt + i * W + 8 * v), s[v]);
    }
    const __m256 neg = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 mx = neg;
    for (int v = 0; v < KV; ++v) {
      s[v] = _mm256_blendv_ps(neg, s[v], first(valid - 8 * v));
      mx = _mm256_max_ps(mx, s[v]);
    }
    const float m_new = std::max(m[r], hmax(mx));
    const float alpha = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < KV; ++v) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(s[v], mv)), first(valid - 8 * v));
      sum = _mm256_add_ps(sum, e);
      _mm256_store_ps(p + 8 * v, e);
    }
    l[r] = l[r] * alpha + hsum(sum);
    m[r] = m_new;
    float* ar = acc + r * d;
    const __m256 a = _mm256_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 32) {  // 4 accumulator vectors in registers while the values pass
      const int64_t nc = std::min<int64_t>(4, (d - c) / 8);
      __m256 o[4];
      for (int j = 0; j < nc; ++j) o[j] = _mm256_mul_ps(_mm256_loadu_ps(ar + c + 8 * j), a);
      for (int64_t t = 0; t < valid; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const T* vr = vb + t * token_stride + c;
        for (int j = 0; j < nc; ++j) o[j] = _mm256_fmadd_ps(pt, load8(vr + 8 * j), o[j]);
      }
      for (int j = 0; j < nc; ++j) _mm256_storeu_ps(ar + c + 8 * j, o[j]);
    }
  }
}

// The block (block_size keys) folded into n rows, kMaxKeys keys a step.
template <typename T>
void fold_rows(int64_t n, int64_t d, const float* q, float* acc, float* m, float* l, const T* kb, const T* vb,
               int64_t token_stride, int64_t block_size, const int64_t* visible) {
  alignas(32) float kt[kMaxDim * kMaxKeys];
  std::vector<int64_t> shifted;
  for (int64_t k0 = 0; k0 < block_size; k0 += kMaxKeys) {
    const int64_t keys = std::min(kMaxKeys, block_size - k0);
    if (visible) {  // the step's keys each row sees
      shifted.resize(n);
      int64_t any = 0;
      for (int64_t r = 0; r < n; ++r) any = std::max(any, shifted[r] = visible[r] - k0);
      if (any <= 0) break;
    }
    const int kv = static_cast<int>((keys + 7) / 8);
    const int64_t w = kv * 8;
    for (int64_t i = 0; i < d; ++i)
      for (int64_t t = 0; t < w; ++t)
        kt[i * w + t] = t < keys ? static_cast<float>(kb[(k0 + t) * token_stride + i]) : 0.f;
    const T* v0 = vb + k0 * token_stride;
    const int64_t* vis = visible ? shifted.data() : nullptr;
    switch (kv) {
      case 1: fold_step<1>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 2: fold_step<2>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 3: fold_step<3>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 4: fold_step<4>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 5: fold_step<5>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 6: fold_step<6>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      case 7: fold_step<7>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
      default: fold_step<8>(n, d, q, acc, m, l, kt, v0, token_stride, keys, vis); break;
    }
  }
}

}  // namespace avx2att
