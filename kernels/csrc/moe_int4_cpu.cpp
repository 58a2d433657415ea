// A mixture-of-experts block's experts in one call, on 4-bit weights stacked per expert (the Int4Blocked layout of
// int4_cpu.cpp, one more leading dimension): for bf16 x [T, H], each token's k chosen experts and routing weights,
//   out[t] = sum over its choices j, experts ascending, of w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
// where gate|up is one fused linear per expert [2I, H] and down [H, I].
//
// What the engine's per-expert loop (quantkit/engine/moe.py) does in ~6 torch ops and two kernel calls per expert that
// received tokens (64 expert calls a layer at batch 8 on Qwen3-30B-A3B's shape, each below torch's parallel grain),
// this does in four parallel passes over all of them:
//   1. the T x k choices sorted by expert (a counting sort; tokens ascending within an expert, as a stable argsort
//      gives), x's rows gathered in that order;
//   2. gate|up for every (expert, pair of 16-row blocks): one parallel loop over all experts' blocks, so two threads
//      share 8 experts' work at batch 1 instead of splitting each expert's 96 blocks;
//   3. silu(gate) * up, then down the same way;
//   4. the weighted sum into each token's row, experts in ascending order.
// Every value is rounded where the per-expert loop rounds it (each linear's output to bf16, silu to bf16, the product
// to bf16, each weighted expert output to bf16 before it is added to the bf16 row), and each expert's linears run the
// same kernel on the same rows, so the result equals the loop's bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "act_mul.h"
#include "int4_amx.h"  // int4bf16::any_blocks: the AVX-512 BF16 kernel, or AMX tiles where QUANTKIT_INT4_AMX
#include "int4_avx2.h"  // int4avx2::block: the fp32 kernel
#include "int4_x16_avx2.h"  // int4x16::block: its tiles for a few rows (x in 16-bit fixed point)
#include "moe_int4.h"

namespace {

constexpr int64_t kRows = 16;

// The T x k choices sorted by expert: slot s holds token[s] with routing weight[s]; the experts that received any, in
// ascending order, own the slots start[a] .. start[a] + count[a] - 1.
struct Slots {
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<int64_t> expert, start, count;
};

Slots sort_slots(const int64_t* chosen, const float* w, int64_t t_size, int64_t k, int64_t experts) {
  std::vector<int64_t> next(experts + 1, 0);
  for (int64_t i = 0; i < t_size * k; ++i) {
    TORCH_CHECK(chosen[i] >= 0 && chosen[i] < experts, "chosen expert ", chosen[i], " out of range [0, ", experts, ")");
    ++next[chosen[i] + 1];
  }
  Slots s;
  for (int64_t e = 0; e < experts; ++e) {
    if (next[e + 1] > 0) {
      s.expert.push_back(e);
      s.start.push_back(next[e]);
      s.count.push_back(next[e + 1]);
    }
    next[e + 1] += next[e];  // now: the first slot of expert e + 1
  }
  s.token.resize(t_size * k);
  s.weight.resize(t_size * k);
  for (int64_t i = 0; i < t_size * k; ++i) {  // flat order: tokens ascending within each expert
    const int64_t slot = next[chosen[i]]++;
    s.token[slot] = i / k;
    s.weight[slot] = w[i];
  }
  return s;
}

// One stacked linear: expert e's weight is w + e * per_w, its scales sz + e * per_s (Int4Blocked per expert).
template <typename T>
struct Stacked {
  const uint8_t* w;
  const T* sz;
  int64_t blocks, k, n, gs;
  int64_t per_w() const { return blocks * k * 8; }
  int64_t per_s() const { return blocks * (k / gs) * 2 * kRows; }
};

// fn(a, b0, b1) for every active expert a and its blocks b0..b1-1, the (expert, pair of blocks) units split over
// torch's threads, so that the threads share all experts' blocks (pairs: the bf16 kernel's wide tiles take two).
template <typename Fn>
void over_expert_blocks(const Slots& s, int64_t blocks, Fn fn) {
  const int64_t pairs = (blocks + 1) / 2, units = static_cast<int64_t>(s.expert.size()) * pairs;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1;) {
      const int64_t a = u / pairs, first = u - a * pairs, last = std::min(pairs, first + (u1 - u));
      fn(a, 2 * first, std::min(blocks, 2 * last));
      u += last - first;
    }
  });
}

#if defined(QUANTKIT_INT4_BF16)
// Every active expert's linear on its slots' rows, bf16: in [S, K] (rows in slot order) -> out [S, N] bf16.
template <typename T>
void experts_linear(const Slots& s, const Stacked<T>& lin, const torch::Tensor& in_t, torch::Tensor& out_t,
                    c10::BFloat16) {
  const int64_t groups = lin.k / lin.gs, rows = in_t.size(0);
  const auto* in = reinterpret_cast<const uint16_t*>(in_t.data_ptr<at::BFloat16>());
  auto* out = reinterpret_cast<uint16_t*>(out_t.data_ptr<at::BFloat16>());
  std::vector<float> xsum(rows * groups);
  int4bf16::group_sums(in, rows, lin.k, lin.gs, xsum.data());
  over_expert_blocks(s, lin.blocks, [&](int64_t a, int64_t b0, int64_t b1) {
    const int64_t r = s.start[a];
    const int4bf16::Args<T> args{in + r * lin.k, xsum.data() + r * groups, lin.w + s.expert[a] * lin.per_w(),
                                 lin.sz + s.expert[a] * lin.per_s(), nullptr, out + r * lin.n, s.count[a], lin.k,
                                 lin.n, groups, lin.gs};
    int4bf16::any_blocks(args, b0, b1);
  });
}
#endif

// The same in fp32 on the AVX2 kernel, each expert's rows as int4_linear runs them (below 4 rows the 16-bit fixed-point
// tiles, else the FMA tiles on x's group sums): in fp32 [S, K] -> out fp32 [S, N].
template <typename T>
void experts_linear(const Slots& s, const Stacked<T>& lin, const torch::Tensor& in, torch::Tensor& out_t, float) {
  const int64_t groups = lin.k / lin.gs, rows = in.size(0);
  float* out = out_t.data_ptr<float>();
  const torch::Tensor xsum = in.view({rows, groups, lin.gs}).sum(-1).contiguous();  // [S, G]
  const float *x = in.data_ptr<float>(), *xs = xsum.data_ptr<float>();
  const bool x16 = lin.gs % 4 == 0 && lin.gs <= int4x16::kMaxGroup;
  const auto on_x16 = [&](int64_t a) { return x16 && s.count[a] <= int4x16::kMaxRows; };
  // The digits of the rows of experts with few rows, each row's own (spread as int4_linear's: 4K a row), those
  // experts' rows one after another from at[a]; the rest go unrounded.
  const int64_t experts = static_cast<int64_t>(s.expert.size());
  std::vector<int64_t> at(experts, 0);
  int64_t few = 0;
  for (int64_t a = 0; a < experts; ++a)
    if (on_x16(a)) at[a] = std::exchange(few, few + s.count[a]);
  std::vector<int16_t> xq(few * 4 * lin.k);
  std::vector<float> sx(few * groups), xqsum(sx.size());
  for (int64_t a = 0; a < experts; ++a)
    if (on_x16(a))
      int4x16::quantize(x + s.start[a] * lin.k, s.count[a], lin.k, lin.gs, xq.data() + at[a] * 4 * lin.k,
                        sx.data() + at[a] * groups, xqsum.data() + at[a] * groups);
  over_expert_blocks(s, lin.blocks, [&](int64_t a, int64_t b0, int64_t b1) {
    const int64_t r = s.start[a];
    const uint8_t* w = lin.w + s.expert[a] * lin.per_w();
    const T* sz = lin.sz + s.expert[a] * lin.per_s();
    if (on_x16(a)) {
      const int64_t i = at[a];
      const int4x16::Args<T> args{xq.data() + i * 4 * lin.k, sx.data() + i * groups, xqsum.data() + i * groups, w, sz,
                                  out + r * lin.n, s.count[a], lin.k, lin.n, groups, lin.gs};
      for (int64_t b = b0; b < b1; ++b) int4x16::block(args, b);
      return;
    }
    const int4avx2::Args<T> args{x + r * lin.k, xs + r * groups, w, sz, out + r * lin.n, s.count[a], lin.k, lin.n,
                                 groups, lin.gs};
    for (int64_t b = b0; b < b1; ++b) int4avx2::block(args, b);
  });
}

template <typename T>
Stacked<T> stacked(const torch::Tensor& w, const torch::Tensor& sz, int64_t experts, int64_t k, int64_t n, int64_t gs,
                   const char* name) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 4 && w.size(0) == experts && w.size(2) == k && w.size(3) == 8,
              name, " must be uint8 [E, ceil(N/16), K, 8] with K = ", k);
  TORCH_CHECK(w.size(1) * kRows >= n && w.size(1) * kRows < n + kRows, name, " has the wrong row blocks for N = ", n);
  TORCH_CHECK(gs > 0 && gs % 2 == 0 && k % gs == 0, name, ": the group size must be even and divide K");
  TORCH_CHECK(sz.dim() == 5 && sz.size(0) == experts && sz.size(1) == w.size(1) && sz.size(2) == k / gs &&
                  sz.size(3) == 2 && sz.size(4) == kRows,
              name, " scales must be [E, ceil(N/16), K/group, 2, 16]");
  TORCH_CHECK(w.is_contiguous() && sz.is_contiguous(), name, " and its scales must be contiguous");
  return Stacked<T>{w.data_ptr<uint8_t>(), sz.data_ptr<T>(), w.size(1), k, n, gs};
}

// fn(scales pointer type tag) for fp16 or fp32 scales
template <typename Fn>
void with_scale_type(const torch::Tensor& sz, Fn fn) {
  TORCH_CHECK(sz.dtype() == torch::kHalf || sz.dtype() == torch::kFloat, "scales must be fp16 or fp32");
  if (sz.dtype() == torch::kHalf)
    fn(at::Half{});
  else
    fn(float{});
}

// The checks and the sorted choices every grouped call starts from; x made contiguous.
struct Call {
  Slots slots;
  int64_t t_size, h, experts, inter, rows;
};

Call start_call(torch::Tensor& x, torch::Tensor chosen, torch::Tensor weights, const torch::Tensor& w1,
                const torch::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  TORCH_CHECK(chosen.dtype() == torch::kLong && chosen.dim() == 2 && chosen.size(0) == x.size(0),
              "chosen must be int64 [T, k]");
  TORCH_CHECK(weights.dtype() == torch::kFloat && weights.sizes() == chosen.sizes(), "weights must be fp32 [T, k]");
  TORCH_CHECK(w1.dim() == 4 && w2.dim() == 4, "w1 and w2 must be stacked [E, blocks, K, 8]");
  x = x.contiguous();
  chosen = chosen.contiguous();
  weights = weights.contiguous();
  Call c{{}, x.size(0), x.size(1), w1.size(0), w2.size(2), chosen.numel()};
  c.slots = sort_slots(chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), c.t_size, chosen.size(1), c.experts);
  return c;
}

// hidden[r] = silu(gate_up[r, :I]) * gate_up[r, I:] for every slot row r
template <typename T>
void silu_rows(const T* gate_up, T* hidden, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      silu_mul_range(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, hidden + r * inter, 0, inter);
  });
}

// out[token[r]] += weight[r] * y[r] for the slot rows in order (ascending experts), fp32: the product rounded to fp32,
// then the sum, as the per-expert loop's two torch ops (never contracted into one fused multiply-add).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void add_weighted(const Slots& s, const float* y, float* out, int64_t h) {
  at::parallel_for(0, h, 256, [&](int64_t c0, int64_t c1) {  // columns apart; within a column, slots in order
    for (size_t r = 0; r < s.token.size(); ++r) {
      float* o = out + s.token[r] * h;
      const float* yr = y + r * h;
      const float w = s.weight[r];
      for (int64_t c = c0; c < c1; ++c) {
        const float v = yr[c] * w;
        o[c] = o[c] + v;
      }
    }
  });
}
#pragma GCC pop_options

#if defined(QUANTKIT_INT4_BF16)
// The same in bf16: each weighted output rounded to bf16, then added into the bf16 row (rounded as torch's bf16 add).
void add_weighted(const Slots& s, const c10::BFloat16* y, c10::BFloat16* out, int64_t h) {
  at::parallel_for(0, h, 256, [&](int64_t c0, int64_t c1) {
    using namespace vec512;
    for (size_t r = 0; r < s.token.size(); ++r) {
      c10::BFloat16* o = out + s.token[r] * h;
      const __m512 w = _mm512_set1_ps(s.weight[r]);
      for (int64_t c = c0; c < c1; c += 16) {
        const __mmask16 m = first(c1 - c);
        const __m512 v = round16<c10::BFloat16>(_mm512_mul_ps(load16(y + r * h + c, m), w));
        store16(o + c, _mm512_add_ps(load16(o + c, m), v), m);
      }
    }
  });
}
#endif

// The grouped call in the activation type A (c10::BFloat16 or float): gather, gate|up, SiLU, down, weighted sum.
template <typename A>
torch::Tensor grouped(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, const torch::Tensor& w1,
                      const torch::Tensor& s1, int64_t gs1, const torch::Tensor& w2, const torch::Tensor& s2,
                      int64_t gs2) {
  const Call c = start_call(x, chosen, weights, w1, w2);
  const Slots& s = c.slots;
  const int64_t h = c.h, inter = c.inter, rows = c.rows;
  auto out = torch::zeros({c.t_size, h}, x.options());
  if (c.t_size == 0) return out;
  const auto index = torch::from_blob(const_cast<int64_t*>(s.token.data()), {rows}, torch::kLong);
  const auto xs = x.index_select(0, index);  // [S, H] in slot order
  auto gu = torch::empty({rows, 2 * inter}, x.options()), hid = torch::empty({rows, inter}, x.options());
  auto y = torch::empty({rows, h}, x.options());
  with_scale_type(s1, [&](auto tag1) {
    using T1 = decltype(tag1);
    experts_linear(s, stacked<T1>(w1, s1, c.experts, h, 2 * inter, gs1, "w1 (gate|up)"), xs, gu, A{});
  });
  silu_rows(gu.data_ptr<A>(), hid.data_ptr<A>(), rows, inter);
  with_scale_type(s2, [&](auto tag2) {
    using T2 = decltype(tag2);
    experts_linear(s, stacked<T2>(w2, s2, c.experts, inter, h, gs2, "w2 (down)"), hid, y, A{});
  });
  add_weighted(s, y.data_ptr<A>(), out.data_ptr<A>(), h);
  return out;
}

}  // namespace

#if defined(QUANTKIT_INT4_BF16)
torch::Tensor int4_moe_bf16(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, torch::Tensor w1,
                            torch::Tensor s1, int64_t gs1, torch::Tensor w2, torch::Tensor s2, int64_t gs2) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16, "x must be bf16 [T, H]");
  return grouped<c10::BFloat16>(x, chosen, weights, w1, s1, gs1, w2, s2, gs2);
}
#endif

torch::Tensor int4_moe_f32(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, torch::Tensor w1,
                           torch::Tensor s1, int64_t gs1, torch::Tensor w2, torch::Tensor s2, int64_t gs2) {
  TORCH_CHECK(x.dtype() == torch::kFloat, "x must be fp32 [T, H]");
  return grouped<float>(x, chosen, weights, w1, s1, gs1, w2, s2, gs2);
}
