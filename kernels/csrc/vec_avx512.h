// AVX-512 building blocks shared by the CPU kernels (paged attention, fused ops): 16 fp32 lanes
// loaded from and stored to fp32, bf16 or fp16 memory, bf16 rounding, and e^x. Included only where
// the compiler targets AVX-512 F/BW/VL (QUANTKIT_AVX512, set below; -march=native on such a CPU).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANTKIT_AVX512 1

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "exp_poly.h"

#include <cstdint>
#include <type_traits>

namespace vec512 {

// Lanes [0, n) of a 16-lane step (all 16 from n = 16 on).
inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p, __mmask16 k = 0xFFFF) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 k = 0xFFFF) {  // bf16 is an fp32's top half
  const __m256i raw = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 k = 0xFFFF) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding for every finite value)
inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline void store16(float* p, __m512 v, __mmask16 k = 0xFFFF) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 k = 0xFFFF) { _mm256_mask_storeu_epi16(p, k, to_bf16(v)); }

// v rounded to T and widened back (the identity for fp32): where a bf16 torch op stores its result
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
}

// e^x lane-wise (exp_poly.h), times 2^n by scalef (0 below x = -104, inf above 88.7).
inline __m512 exp16(__m512 x) {
  using namespace exppoly;
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

}  // namespace vec512

#endif
