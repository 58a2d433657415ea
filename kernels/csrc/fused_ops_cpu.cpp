// Fused elementwise ops of the decoder on CPU, fp32 or bf16 (one pass over the data, no temporaries).
// Bindings: paged_attention_cpu.cpp (one extension, quantkit_attn). References: kernels/fused_ops_reference.py.
//
//   rms_norm(x [T, H], w [H], eps)              -> w * x / sqrt(mean(x^2) + eps)
//   add_rms_norm_(x [T, H], residual [T, H], w, eps)   residual += x; x = rms_norm(residual) (both in place)
//   silu_and_mul(gate [T, I], up [T, I])        -> silu(gate) * up (rows may be strided)
//   rotary_(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D])   rotate-half RoPE, in place
//   rope_and_cache(qkv [T, (Hq + 2 Hk) D], positions [T], table [n, 2D], key_cache, value_cache, slots [T], Hq, Hk)
//       -> q [T, Hq, D] rotated; k rotated and v copied into the caches' slots (one call for what the
//       attention block did in eight ops: split, copies, rotary, two index_copy_)
//
// Every tensor of one call shares x's dtype. Arithmetic is fp32; in bf16, each value is rounded to
// bf16 where the torch reference's op would round it (`rnd<T>`: the identity for fp32), so the
// results equal the reference's up to the order of the mean-of-squares sum and libm's exp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "act_mul.h"  // silu_mul_range and rnd, shared with the 4-bit experts
#include "vec_avx512.h"  // the vector bodies, where QUANTKIT_AVX512

namespace {

void check_rows(const torch::Tensor& x, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == like.scalar_type(), name, " must have x's dtype");
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
}

// dst = w * rnd(src / rms(src)), src already holding the residual stream
template <typename T>
inline void norm_row(const T* src, const T* w, T* dst, int64_t h, float eps) {
#if defined(QUANTKIT_AVX512)
  using namespace vec512;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 v = load16(src + i, first(h - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps));
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 k = first(h - i);
    store16(dst + i, _mm512_mul_ps(load16(w + i, k), round16<T>(_mm512_mul_ps(load16(src + i, k), inv))), k);
  }
#else
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < h; ++i) {
    const float v = static_cast<float>(src[i]);
    sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i)
    dst[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(src[i]) * inv));
#endif
}

// residual += x (rounded to T), then x = norm(residual)
template <typename T>
inline void add_norm_row(T* x, T* residual, const T* w, int64_t h, float eps) {
#if defined(QUANTKIT_AVX512)
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 k = vec512::first(h - i);
    vec512::store16(residual + i, _mm512_add_ps(vec512::load16(residual + i, k), vec512::load16(x + i, k)), k);
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) residual[i] = static_cast<T>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
#endif
  norm_row(residual, w, x, h, eps);
}


// The ops' dtypes; the bodies' loops live in the helpers above (a pragma cannot sit inside a macro argument).
#define QK_DISPATCH(x, NAME, ...) \
  AT_DISPATCH_SWITCH((x).scalar_type(), NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, x, "x");
  check_rows(weight, x, "weight");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h, "weight must have the last dimension of x");
  auto out = torch::empty_like(x);
  QK_DISPATCH(x, "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, x, "x");
  check_rows(residual, x, "residual");
  check_rows(weight, x, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(weight.numel() == h, "weight must have the last dimension of x");
  QK_DISPATCH(x, "add_rms_norm_", [&] {
    scalar_t *xp = x.data_ptr<scalar_t>(), *rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) add_norm_row(xp + r * h, rp + r * h, wp, h, static_cast<float>(eps));
    });
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  // Rows may be strided (the two halves of a fused gate|up output): only each row must be contiguous.
  TORCH_CHECK(gate.scalar_type() == torch::kFloat32 || gate.scalar_type() == torch::kBFloat16,
              "gate must be float32 or bfloat16");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type(), "up must have gate's dtype");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  const int64_t i_size = gate.size(-1);
  auto g2 = gate.reshape({-1, i_size}), u2 = up.reshape({-1, i_size});  // views where the rows allow
  TORCH_CHECK(g2.stride(1) == 1 && u2.stride(1) == 1, "gate and up rows must be contiguous");
  const int64_t rows = g2.size(0), gs = g2.stride(0), us = u2.stride(0);
  auto out = torch::empty(gate.sizes(), gate.options());
  QK_DISPATCH(gate, "silu_and_mul", [&] {
    const scalar_t *gp = g2.data_ptr<scalar_t>(), *up_ = u2.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * i_size, 4096, [&](int64_t b, int64_t e) {
      while (b < e) {  // [b, e) in row-major order of out, cut at row ends
        const int64_t r = b / i_size, c = b - r * i_size, n = std::min(e - b, i_size - c);
        silu_mul_range(gp + r * gs, up_ + r * us, op + r * i_size, c, c + n);
        b += n;
      }
    });
  });
  return out;
}

namespace {

// dst = src rotated (dst == src: in place)
template <typename T>
inline void rotate_row(const T* src, T* x, const T* c, const T* s, int64_t half) {
  // rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin repeat over the halves.
  // Each product is rounded before the sum, as the reference's x * cos + rotate_half(x) * sin.
#if defined(QUANTKIT_AVX512)
  using namespace vec512;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 k = first(half - i);
    const __m512 a = load16(src + i, k), b = load16(src + i + half, k);
    const __m512 lo = _mm512_sub_ps(round16<T>(_mm512_mul_ps(a, load16(c + i, k))),
                                    round16<T>(_mm512_mul_ps(b, load16(s + i, k))));
    const __m512 hi = _mm512_add_ps(round16<T>(_mm512_mul_ps(b, load16(c + i + half, k))),
                                    round16<T>(_mm512_mul_ps(a, load16(s + i + half, k))));
    store16(x + i, lo, k);
    store16(x + i + half, hi, k);
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + half]);
    const float c1 = static_cast<float>(c[i]), s1 = static_cast<float>(s[i]);
    const float c2 = static_cast<float>(c[i + half]), s2 = static_cast<float>(s[i + half]);
    x[i] = static_cast<T>(rnd<T>(a * c1) + rnd<T>(-b * s1));
    x[i + half] = static_cast<T>(rnd<T>(b * c2) + rnd<T>(a * s2));
  }
#endif
}

// The index of the first maximum of x[0 .. n), as torch.argmax: a NaN counts as the maximum (the first NaN
// wins). Two passes: the maximum (NaNs noticed on the way), then its first index.
inline int64_t argmax_row(const float* x, int64_t n) {
#if defined(QUANTKIT_AVX512)
  using namespace vec512;
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
    nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, k, mx, v);
  }
  if (nan == 0) {
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(first(n - i), _mm512_maskz_loadu_ps(first(n - i), x + i), mv, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  int64_t best = 0;  // the portable loop, and the rows with a NaN
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

}  // namespace

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (auto* t : {&q, &k, &cos, &sin}) check_rows(*t, q, "q, k, cos and sin");
  const int64_t tokens = q.size(0), d = q.size(2), hq = q.size(1), hk = k.size(1);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == d && d % 2 == 0, "q and k must be [T, heads, D] with even D");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == d, "cos/sin must be [T, D]");
  QK_DISPATCH(q, "rotary_", [&] {
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (int64_t h = 0; h < hq; ++h) {
          scalar_t* x = qp + (t * hq + h) * d;
          rotate_row(x, x, cp + t * d, sp + t * d, d / 2);
        }
        for (int64_t h = 0; h < hk; ++h) {
          scalar_t* x = kp + (t * hk + h) * d;
          rotate_row(x, x, cp + t * d, sp + t * d, d / 2);
        }
      }
    });
  });
}

torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor table, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor slots, int64_t hq, int64_t hk) {
  for (auto* t : {&qkv, &table, &key_cache, &value_cache}) check_rows(*t, qkv, "qkv, table and the caches");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && slots.is_contiguous(),
              "positions and slots must be contiguous int64");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == hk,
              "the caches must be [blocks, block_size, kv_heads, D] alike");
  const int64_t tokens = qkv.size(0), d = key_cache.size(3), n_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hk) * d && d % 2 == 0,
              "qkv must be [T, (heads + 2 kv_heads) * D] with even D");
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 2 * d, "table must be [positions, 2 * D] (cos | sin)");
  TORCH_CHECK(positions.numel() == tokens && slots.numel() == tokens, "one position and one slot per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table.size(0), "position ", pos[t], " is outside the table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < n_slots, "slot ", slot[t], " is outside the cache");
  }
  auto q = torch::empty({tokens, hq, d}, qkv.options());
  QK_DISPATCH(qkv, "rope_and_cache", [&] {
    const scalar_t *src = qkv.data_ptr<scalar_t>(), *tp = table.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kc = key_cache.data_ptr<scalar_t>(), *vc = value_cache.data_ptr<scalar_t>();
    const int64_t width = (hq + 2 * hk) * d;
    at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* row = src + t * width;
        const scalar_t *c = tp + pos[t] * 2 * d, *s = c + d;
        for (int64_t h = 0; h < hq; ++h) rotate_row(row + h * d, qp + (t * hq + h) * d, c, s, d / 2);
        for (int64_t h = 0; h < hk; ++h) rotate_row(row + (hq + h) * d, kc + (slot[t] * hk + h) * d, c, s, d / 2);
        std::copy(row + (hq + hk) * d, row + width, vc + slot[t] * hk * d);
      }
    });
  });
  return q;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous non-empty fp32 [rows, n]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}
