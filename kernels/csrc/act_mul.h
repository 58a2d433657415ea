// silu(gate) * up over a row range, shared by the fused ops (fused_ops_cpu.cpp) and the 4-bit experts
// (moe_int4_cpu.cpp), so that both round where the torch reference does: silu(gate) to T, then the product to T.
#pragma once

#include <cmath>
#include <cstdint>

#include <type_traits>

#include "vec_avx512.h"  // the vector bodies, where QUANTKIT_AVX512
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_avx2.h"  // fp32's, where AVX2 without AVX-512
#endif

// v rounded to T and widened back: where the reference's bf16 op stores its result (the identity for fp32)
template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out[i] = silu(gate[i]) * up[i] for i in [begin, end)
template <typename T>
inline void silu_mul_range(const T* gate, const T* up, T* out, int64_t begin, int64_t end) {
#if defined(QUANTKIT_AVX512)
  using namespace vec512;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 k = first(end - i);
    const __m512 g = load16(gate + i, k);
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store16(out + i, _mm512_mul_ps(silu, load16(up + i, k)), k);
  }
#else
  int64_t i = begin;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {  // fp32 (the engine's arithmetic without AVX-512): e^-g on vectors
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= end; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, vec2::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < end; ++j) {
    const float g = static_cast<float>(gate[j]);
    out[j] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[j]));
  }
#endif
}
