// Fused elementwise ops of the decoder on CPU, fp32 (one pass over the data, no temporaries).
// Bindings: paged_attention_cpu.cpp (one extension, quantkit_attn). References: kernels/fused_ops_reference.py.
//
//   rms_norm(x [T, H], w [H], eps)              -> w * x / sqrt(mean(x^2) + eps)
//   add_rms_norm_(x [T, H], residual [T, H], w, eps)   residual += x; x = rms_norm(residual) (both in place)
//   silu_and_mul(gate [T, I], up [T, I])        -> silu(gate) * up
//   rotary_(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D])   rotate-half RoPE, in place
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
}

inline void norm_row(const float* src, const float* w, float* dst, int64_t h, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < h; ++i) sq += src[i] * src[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) dst[i] = w[i] * (src[i] * inv);
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h, "weight must have the last dimension of x");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
  });
  return out;
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h, "weight must have the last dimension of x");
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float *xr = xp + r * h, *rr = rp + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, h, static_cast<float>(eps));
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  auto out = torch::empty_like(gate);
  const float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 4096, [&](int64_t b, int64_t e) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) op[i] = gp[i] / (1.f + std::exp(-gp[i])) * up_[i];
  });
  return out;
}

namespace {

inline void rotate_row(float* x, const float* c, const float* s, int64_t half) {
  // rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin repeat over the halves
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

}  // namespace

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (auto* t : {&q, &k, &cos, &sin}) check_rows(*t, "q, k, cos and sin");
  const int64_t tokens = q.size(0), d = q.size(2), hq = q.size(1), hk = k.size(1);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == d && d % 2 == 0, "q and k must be [T, heads, D] with even D");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == d, "cos/sin must be [T, D]");
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t h = 0; h < hq; ++h) rotate_row(qp + (t * hq + h) * d, cp + t * d, sp + t * d, d / 2);
      for (int64_t h = 0; h < hk; ++h) rotate_row(kp + (t * hk + h) * d, cp + t * d, sp + t * d, d / 2);
    }
  });
}
