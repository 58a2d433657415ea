// The error of rounding a group of weights with each of several candidate (scale, zero) pairs, in one pass over the
// group: the inner loop of the scale search (quantkit.quant.scale_search; quantkit.kernels.group_error holds the
// pure-torch reference, the tests' oracle).
//
//   err[r, c] = sum_j imp[r, j] * (s * (clamp(round(w[r, j] / s) + z, 0, maxq) - z) - w[r, j])^2,
//   s = scale[r, c], z = zero[r, c]
//
// In torch each candidate costs a [rows, candidates, G] temporary and seven element-wise passes over it, bound by
// memory traffic; here a group's G weights are read once into registers (G = 128: eight AVX-512 vectors) and every
// candidate runs over them. Each element is computed as torch computes it (a true division, round half to even, the
// codes less the zero clamped to [-z, maxq - z], an unfused multiply then subtract), so the terms are the
// reference's bit for bit; only the order of the sum differs (vector lanes, then across them), a few ulps.
//
// w: fp32 [R, G] contiguous; imp: fp32 [R, G] contiguous, or empty (every weight 1); scale, zero: fp32 [R, C]
// contiguous, zeros integral. Returns err fp32 [R, C]. Rows are split between the OpenMP threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

float row_error_scalar(const float* w, const float* imp, int64_t g, float s, float z, float maxq) {
  float acc = 0.f;
  for (int64_t j = 0; j < g; ++j) {
    float d = std::nearbyint(w[j] / s);  // the default rounding mode: to nearest, ties to even (torch.round)
    d = std::fmax(d, -z);
    d = std::fmin(d, maxq - z);
    float e = s * d;
    e = e - w[j];
    e = e * e;
    acc += imp ? e * imp[j] : e;
  }
  return acc;
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
float row_error(const float* w, const float* imp, int64_t g, float s, float z, float maxq) {
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-z), hi = _mm512_set1_ps(maxq - z);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= g; j += kLanes) {
    const __m512 x = _mm512_loadu_ps(w + j);
    __m512 d = _mm512_roundscale_ps(_mm512_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    d = _mm512_min_ps(_mm512_max_ps(d, lo), hi);
    __m512 e = _mm512_sub_ps(_mm512_mul_ps(vs, d), x);
    e = _mm512_mul_ps(e, e);
    if (imp) e = _mm512_mul_ps(e, _mm512_loadu_ps(imp + j));
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc) + row_error_scalar(w + j, imp ? imp + j : nullptr, g - j, s, z, maxq);
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
float row_error(const float* w, const float* imp, int64_t g, float s, float z, float maxq) {
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-z), hi = _mm256_set1_ps(maxq - z);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= g; j += kLanes) {
    const __m256 x = _mm256_loadu_ps(w + j);
    __m256 d = _mm256_round_ps(_mm256_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    d = _mm256_min_ps(_mm256_max_ps(d, lo), hi);
    __m256 e = _mm256_sub_ps(_mm256_mul_ps(vs, d), x);
    e = _mm256_mul_ps(e, e);
    if (imp) e = _mm256_mul_ps(e, _mm256_loadu_ps(imp + j));
    acc = _mm256_add_ps(acc, e);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  const float sum = _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
  return sum + row_error_scalar(w + j, imp ? imp + j : nullptr, g - j, s, z, maxq);
}
#else
float row_error(const float* w, const float* imp, int64_t g, float s, float z, float maxq) {
  return row_error_scalar(w, imp, g, s, z, maxq);
}
#endif

void check_f32(const torch::Tensor& t, const char* name, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous(),
              "group_errors: ", name, " must be a contiguous 2-d fp32 CPU tensor");
  TORCH_CHECK(t.size(0) == rows, "group_errors: ", name, " has ", t.size(0), " rows, w has ", rows);
}

torch::Tensor group_errors(torch::Tensor w, torch::Tensor imp, torch::Tensor scale, torch::Tensor zero,
                           int64_t maxq) {
  const int64_t rows = w.size(0);
  check_f32(w, "w", rows);
  check_f32(scale, "scale", rows);
  check_f32(zero, "zero", rows);
  TORCH_CHECK(scale.sizes() == zero.sizes(), "group_errors: scale and zero must have one shape");
  const bool weighted = imp.numel() > 0;
  if (weighted) {
    check_f32(imp, "imp", rows);
    TORCH_CHECK(imp.size(1) == w.size(1), "group_errors: imp and w must have one group length");
  }
  const int64_t g = w.size(1), c = scale.size(1);
  auto err = torch::empty({rows, c}, w.options());
  const float *pw = w.data_ptr<float>(), *pi = weighted ? imp.data_ptr<float>() : nullptr;
  const float *ps = scale.data_ptr<float>(), *pz = zero.data_ptr<float>();
  float* pe = err.data_ptr<float>();
  const float fmaxq = static_cast<float>(maxq);
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = pw + r * g;
    const float* ir = pi ? pi + r * g : nullptr;
    for (int64_t k = 0; k < c; ++k) pe[r * c + k] = row_error(wr, ir, g, ps[r * c + k], pz[r * c + k], fmaxq);
  }
  return err;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("group_errors", &group_errors,
        "w [R, G], imp [R, G] or empty, scale/zero [R, C] fp32 -> err [R, C]: each candidate's rounding error");
}
