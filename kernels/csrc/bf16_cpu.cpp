// quantkit's bf16-weight linear for CPUs without native bf16: y = x @ W.T with x fp32 [M, K], W bf16 [N, K]
// (the checkpoint's rows, as stored), y fp32 [M, N]. Each bf16 weight is widened to fp32 exactly (its 16 bits
// become the top half of an fp32) and multiplied in fp32 (AVX2 + FMA), so the result is fp32 F.linear on the
// widened weight up to summation order, reading half the bytes of an fp32 weight. For small M (decode):
// each row of W is read once and used for every row of x (M <= 8 accumulators). Rows of W are split over
// torch's thread pool (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxM = 8;

inline __m256 widen8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline float widen1(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [n0, n1) of y for M rows of x (M <= kMaxM).
template <int M>
void rows(const float* x, const uint16_t* w, float* y, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 wv = widen8(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * widen1(wr[k]);
      y[m * N + n] = s;
    }
  }
}

using RowsFn = void (*)(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr RowsFn kRows[kMaxM] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be fp32 [M, K]");
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2 && w.size(1) == x.size(1), "w must be bf16 [N, K]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {  // chunks of up to 8 rows of x
    const int mc = static_cast<int>(std::min<int64_t>(kMaxM, M - m0));
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      kRows[mc - 1](xp + m0 * K, wp, yp + m0 * N, n0, n1, K, N);
    });
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &bf16_linear, "x fp32 [M, K] @ W.T, W bf16 [N, K] widened to fp32 -> fp32 [M, N] (AVX2/FMA)");
}
