// The per-block step of paged_attention_cpu.cpp's online softmax in AVX-512 (fp32 arithmetic; the
// cache fp32, bf16 or fp16), for head dims 32, 64, 96 and 128. Included by
// paged_attention_cpu.cpp; compiled where vec_avx512.h finds AVX-512 F/BW/VL (-march=native on such a
// CPU), elsewhere the portable fold_block there runs. Same contract as that fold_block:
//
//   rows      the work item's query rows: q [n, D] pre-scaled, acc [n, D], running max m [n], sum l [n]
//   kb, vb    the block's first key / value row of this kv head; rows token_stride elements apart
//   visible   row r sees the block's first visible[r] keys (all block_size when null)
//   s         scratch of block_size floats per row
//
// Each row keeps its query (D / 16 vectors) in registers while the block's keys pass, the 16 (or
// fewer) scores of a block are exponentiated as one vector, and the row's accumulator stays in
// registers while the values pass.
#pragma once

#include "vec_avx512.h"

#if defined(QUANTKIT_AVX512)

#include <algorithm>
#include <cmath>
#include <limits>

namespace avx512 {

using vec512::exp16;
using vec512::first;
using vec512::load16;

// One row over `valid` keys of the block; NV = D / 16.
template <int NV, typename T>
inline void fold_row(float* q, float* acc, float& m, float& l, const T* kb, const T* vb, int64_t token_stride,
                     int64_t valid, float* s) {
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t t = 0; t < valid; ++t) {  // s[t] = q . k_t
    const T* k = kb + t * token_stride;
    __m512 dot = _mm512_mul_ps(qv[0], load16(k));
    for (int c = 1; c < NV; ++c) dot = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), dot);
    s[t] = _mm512_reduce_add_ps(dot);
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < valid; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, first(valid - t), s + t));
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx));
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < valid; t += 16) {
    const __mmask16 k = first(valid - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(m_new)));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  __m512 av[NV];
  const __m512 a = _mm512_set1_ps(alpha);
  for (int c = 0; c < NV; ++c) av[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), a);
  for (int64_t t = 0; t < valid; ++t) {  // acc += p_t v_t
    const T* v = vb + t * token_stride;
    const __m512 p = _mm512_set1_ps(s[t]);
    for (int c = 0; c < NV; ++c) av[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), av[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, av[c]);
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
}

// Whether fold_rows takes head dim d.
inline bool supports(int64_t d) { return d == 32 || d == 64 || d == 96 || d == 128; }

template <typename T>
inline void fold_rows(int64_t n, int64_t d, float* q, float* acc, float* m, float* l, const T* kb, const T* vb,
                      int64_t token_stride, int64_t block_size, const int64_t* visible, float* s) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t valid = visible ? std::min(block_size, visible[r]) : block_size;
    if (valid <= 0) continue;
    float *qr = q + r * d, *ar = acc + r * d;
    switch (d) {
      case 32: fold_row<2>(qr, ar, m[r], l[r], kb, vb, token_stride, valid, s); break;
      case 64: fold_row<4>(qr, ar, m[r], l[r], kb, vb, token_stride, valid, s); break;
      case 96: fold_row<6>(qr, ar, m[r], l[r], kb, vb, token_stride, valid, s); break;
      default: fold_row<8>(qr, ar, m[r], l[r], kb, vb, token_stride, valid, s); break;
    }
  }
}

}  // namespace avx512

#endif
