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
#include <vector>

#include "act_mul.h"
#include "int4_amx.h"  // int4bf16::any_blocks: the AVX-512 BF16 kernel, or AMX tiles where QUANTKIT_INT4_AMX

#if defined(QUANTKIT_INT4_BF16)
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

// Every active expert's linear on its slots' rows: in [S, K] bf16 (rows in slot order) -> out [S, N] bf16, work
// split over (expert, pair of blocks) so that the threads share all experts' blocks.
template <typename T>
void experts_linear(const Slots& s, const Stacked<T>& lin, const uint16_t* in, uint16_t* out) {
  const int64_t groups = lin.k / lin.gs, rows = static_cast<int64_t>(s.token.size());
  std::vector<float> xsum(rows * groups);
  int4bf16::group_sums(in, rows, lin.k, lin.gs, xsum.data());
  const int64_t pairs = (lin.blocks + 1) / 2, units = static_cast<int64_t>(s.expert.size()) * pairs;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1;) {
      const int64_t a = u / pairs, first = u - a * pairs, last = std::min(pairs, first + (u1 - u));
      const int64_t r = s.start[a], e = s.expert[a];
      const int4bf16::Args<T> args{in + r * lin.k, xsum.data() + r * groups, lin.w + e * lin.per_w(),
                                   lin.sz + e * lin.per_s(), nullptr, out + r * lin.n, s.count[a], lin.k, lin.n,
                                   groups, lin.gs};
      int4bf16::any_blocks(args, 2 * first, std::min(lin.blocks, 2 * last));
      u += last - first;
    }
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

}  // namespace

torch::Tensor int4_moe_bf16(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, torch::Tensor w1,
                            torch::Tensor s1, int64_t gs1, torch::Tensor w2, torch::Tensor s2, int64_t gs2) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [T, H]");
  TORCH_CHECK(chosen.dtype() == torch::kLong && chosen.dim() == 2 && chosen.size(0) == x.size(0),
              "chosen must be int64 [T, k]");
  TORCH_CHECK(weights.dtype() == torch::kFloat && weights.sizes() == chosen.sizes(), "weights must be fp32 [T, k]");
  x = x.contiguous();
  chosen = chosen.contiguous();
  weights = weights.contiguous();
  const int64_t t_size = x.size(0), h = x.size(1), k = chosen.size(1), experts = w1.size(0), inter = w2.size(2);
  auto out = torch::zeros({t_size, h}, x.options());
  if (t_size == 0) return out;
  const Slots s = sort_slots(chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), t_size, k, experts);
  const int64_t rows = t_size * k;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xs(rows * h), gu(rows * 2 * inter), hid(rows * inter), y(rows * h);  // bf16 bits
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&xs[r * h], xp + s.token[r] * h, h * sizeof(uint16_t));
  with_scale_type(s1, [&](auto tag1) {
    using T1 = decltype(tag1);
    experts_linear(s, stacked<T1>(w1, s1, experts, h, 2 * inter, gs1, "w1 (gate|up)"), xs.data(), gu.data());
  });
  const auto* g = reinterpret_cast<const c10::BFloat16*>(gu.data());
  auto* hp = reinterpret_cast<c10::BFloat16*>(hid.data());
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_range(g + r * 2 * inter, g + r * 2 * inter + inter, hp + r * inter, 0, inter);
  });
  with_scale_type(s2, [&](auto tag2) {
    using T2 = decltype(tag2);
    experts_linear(s, stacked<T2>(w2, s2, experts, inter, h, gs2, "w2 (down)"), hid.data(), y.data());
  });
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* yp = reinterpret_cast<const c10::BFloat16*>(y.data());
  at::parallel_for(0, h, 256, [&](int64_t c0, int64_t c1) {  // columns apart; within a column, slots in order
    using namespace vec512;
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* o = op + s.token[r] * h;
      const __m512 w = _mm512_set1_ps(s.weight[r]);
      for (int64_t c = c0; c < c1; c += 16) {
        const __mmask16 m = first(c1 - c);
        const __m512 v = round16<c10::BFloat16>(_mm512_mul_ps(load16(yp + r * h + c, m), w));
        store16(o + c, _mm512_add_ps(load16(o + c, m), v), m);  // the bf16 row's sum, rounded as torch's bf16 add
      }
    }
  });
  return out;
}

#endif
