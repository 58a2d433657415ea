// silu(gate) * up over a row range, shared by the fused ops (fused_ops_cpu.cpp) and the 4-bit experts
// (moe_int4_cpu.cpp), so that both round where the torch reference does: silu(gate) to T, then the product to T.
#pragma once

#include <cmath>
#include <cstdint>

#include "vec_avx512.h"  // the vector bodies, where QUANTKIT_AVX512

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
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
#endif
}
