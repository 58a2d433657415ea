// quantkit's bf16-weight linears. Where the CPU computes bf16 natively (AVX-512 BF16), bf16_dot_linear takes bf16
// activations too (bf16_dot_avx512.h). Below, the one for CPUs without native bf16: y = x @ W.T with x fp32 [M, K],
// W bf16 [N, K], y fp32 [M, N]. Each bf16 weight is widened to fp32 exactly (its 16 bits become the top half of an fp32) and
// multiplied in fp32, so the result is fp32 F.linear on the widened weight up to summation order, reading half
// the bytes of an fp32 weight.
//
// The weight is held in panels (`pack`): panel p holds rows 16p .. 16p + 15 of W (zero rows past N) as
// [K][16], so the 16 weights of one k for 16 outputs are contiguous and widen into one 512-bit vector (two
// 256-bit ones on AVX2). The kernel is an outer-product GEMM: a tile of MR rows of x by NP panels keeps
// MR x NP vector accumulators in registers; for each k it widens NP weight vectors and adds x[m, k] (broadcast)
// times each into every accumulator. No horizontal sums, each widened vector serves MR rows of x, and each
// thread's panels (NP x 16 x K bf16, 96 KiB at K = 1024) stay in L2 while every tile of x passes over them,
// so W is read from memory once per call at any M. Groups of NP panels are split over torch's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "amx_bf16.h"  // AMX tiles for the same layout, where QUANTKIT_AMX
#include "bf16_dot_avx512.h"  // bf16 activations and weights, where QUANTKIT_BF16_DOT

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int64_t kRowsPerPass = 131072;  // x elements (rows x K) per pass over W

#if defined(__AVX512F__)
constexpr int VPP = 1;  // vectors per panel row
using Vec = __m512;
inline Vec widen(const uint16_t* p, int) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec bcast(float v) { return _mm512_set1_ps(v); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
constexpr int MR = 8, NP = 3;  // 24 accumulators + 3 weight vectors + 1 broadcast of 32 registers
#else
constexpr int VPP = 2;
using Vec = __m256;
inline Vec widen(const uint16_t* p, int half) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * half));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec bcast(float v) { return _mm256_set1_ps(v); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
constexpr int MR = 6, NP = 1;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
#endif
constexpr int kLanes = static_cast<int>(kPanel) / VPP;

// y[m, n0 + c] for m < mr, c < 16 * np (only the first `cols` columns are written): x rows K apart, the
// panels at w (K x 16 each, consecutive), y rows ldy apart.
template <int mr, int np>
void tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t ldy, int64_t cols) {
  Vec acc[mr][np * VPP];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < np * VPP; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[np * VPP];
    for (int j = 0; j < np; ++j)
      for (int v = 0; v < VPP; ++v) wv[j * VPP + v] = widen(w + (j * K + k) * kPanel, v);
    for (int i = 0; i < mr; ++i) {
      const Vec b = bcast(x[i * K + k]);
      for (int j = 0; j < np * VPP; ++j) acc[i][j] = fma(b, wv[j], acc[i][j]);
    }
  }
  if (cols == np * kPanel) {
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < np * VPP; ++j) store(y + i * ldy + j * kLanes, acc[i][j]);
    return;
  }
  alignas(64) float row[np * kPanel];  // the last group of panels: write only the columns that exist
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < np * VPP; ++j) store(row + j * kLanes, acc[i][j]);
    std::copy(row, row + cols, y + i * ldy);
  }
}

using TileFn = void (*)(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t);

template <int mr, int... P>
constexpr std::array<TileFn, sizeof...(P)> panel_row(std::integer_sequence<int, P...>) {
  return {tile<mr, P + 1>...};
}

template <int... M>
constexpr std::array<std::array<TileFn, NP>, sizeof...(M)> tile_table(std::integer_sequence<int, M...>) {
  return {panel_row<M + 1>(std::make_integer_sequence<int, NP>{})...};
}

constexpr auto kTiles = tile_table(std::make_integer_sequence<int, MR>{});  // kTiles[mr - 1][np - 1]

}  // namespace

// W bf16 [N, K] -> panels bf16 [ceil(N / 16), K, 16] (rows past N zero).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2, "w must be bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x fp32 [M, K] @ W.T -> fp32 [M, N], W given as pack(W) and its row count N.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be fp32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kBFloat16 && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.size(1) == x.size(1) && packed.is_contiguous() && N > (packed.size(0) - 1) * kPanel &&
                  N <= packed.size(0) * kPanel,
              "packed must be pack(W) of a bf16 W [N, K] with K = x.size(1)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t groups = (panels + NP - 1) / NP;
  const int64_t rows_per_pass = std::max<int64_t>(MR, kRowsPerPass / K / MR * MR);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {  // rows of x that stay in L2 while W passes by
    const int64_t m1 = std::min(M, m0 + rows_per_pass);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p = g * NP, np = std::min<int64_t>(NP, panels - p);
        const int64_t n = p * kPanel, cols = std::min<int64_t>(np * kPanel, N - n);
        for (int64_t m = m0; m < m1; m += MR) {
          const int64_t mr = std::min<int64_t>(MR, m1 - m);
          kTiles[mr - 1][np - 1](xp + m * K, wp + p * K * kPanel, yp + m * N + n, K, N, cols);
        }
      }
    });
  }
  return y;
}

// Whether this build has the bf16-activation kernel (AVX-512 BF16).
bool has_bf16_dot() {
#if defined(QUANTKIT_BF16_DOT)
  return true;
#else
  return false;
#endif
}

#if defined(QUANTKIT_BF16_DOT)
// W bf16 [N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2] (bf16_dot_avx512.h; rows past N zero).
torch::Tensor pack_pairs(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0, "w must be bf16 [N, K], K even");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + bf16dot::kRows - 1) / bf16dot::kRows;
  auto padded = torch::zeros({blocks * bf16dot::kRows, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, bf16dot::kRows, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(QUANTKIT_AMX)
// From this many rows of x, bf16_dot_linear runs on AMX tiles (where amx::usable): from one row, since over a decode
// step's linears (weights from memory) the tiles read them at 30 GB/s against 24 for the AVX-512 one-row tile (python -m
// quantkit.bench.bf16_dot, docs/BENCHMARKS.md). A switch so that a benchmark can move it (set_amx_from_m).
inline int64_t& amx_from_m() {
  static int64_t m = 1;
  return m;
}

// Blocks b0..b1-1 of the result for every row of x, on AMX tiles: each C tile plus the bias, rounded to bf16.
inline void amx_blocks(const bf16dot::Args& a, int64_t b0, int64_t b1) {
  amx::for_blocks(a.x, a.M, a.K, a.w, b0, b1, [&](int64_t b, int64_t m0, int rows, float* c) {
    const int64_t n0 = b * bf16dot::kRows;
    if (a.bias != nullptr) {
      const __m512 bias = _mm512_loadu_ps(a.bias + n0);
      for (int r = 0; r < rows; ++r) _mm512_storeu_ps(c + r * 16, _mm512_add_ps(_mm512_loadu_ps(c + r * 16), bias));
    }
    tiles512::store_rows(nullptr, a.out_bf16, a.N, n0, std::min<int64_t>(bf16dot::kRows, a.N - n0), m0, rows, c);
  });
}
#endif

// x bf16 [M, K] @ W.T + bias -> bf16 [M, N], W given as pack_pairs(W) and its row count N; bias fp32 [NB * 16]
// (zero past N) or None.
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kBFloat16 && packed.dim() == 4 && packed.size(2) == bf16dot::kRows &&
                  packed.size(3) == 2 && packed.size(1) * 2 == x.size(1) && packed.is_contiguous() &&
                  N > (packed.size(0) - 1) * bf16dot::kRows && N <= packed.size(0) * bf16dot::kRows,
              "packed must be pack_pairs(W) of a bf16 W [N, K] with K = x.size(1)");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dtype() == torch::kFloat32 && bias->is_contiguous() &&
                            bias->numel() == packed.size(0) * bf16dot::kRows),
              "bias must be fp32 [ceil(N / 16) * 16]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const bf16dot::Args args{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                           reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                           has_bias ? bias->data_ptr<float>() : nullptr, nullptr,
                           reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N};
#if defined(QUANTKIT_AMX)
  if (M >= amx_from_m() && amx::usable(K)) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { amx_blocks(args, b0, b1); });
    return y;
  }
#endif
  const int64_t rows_per_pass = std::max<int64_t>(8, bf16dot::kRowsPerPass / std::max<int64_t>(K, 1) / 8 * 8);
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {
    const int64_t m1 = std::min(M, m0 + rows_per_pass);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { bf16dot::blocks(args, b0, b1, m0, m1); });
  }
  return y;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto dev = m.def_submodule("dev", "development-only tuning switches, for benchmarks and tests; production code "
                             "never calls them");
  m.def("has_bf16_dot", &has_bf16_dot, "whether bf16_dot_linear was built (AVX-512 BF16)");
#if defined(QUANTKIT_BF16_DOT)
  m.def("pack_pairs", &pack_pairs, "bf16 W [N, K] -> the bf16 kernel's blocks [ceil(N / 16), K / 2, 16, 2]");
  m.def("bf16_dot_linear", &bf16_dot_linear, "x bf16 [M, K] @ W.T (+ bias) from pack_pairs(W) -> bf16 [M, N]",
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias") = py::none());
#endif
  amx::bind_switches(m, dev);
#if defined(QUANTKIT_AMX)
  dev.def("set_amx_from_m", [](int64_t m) { return std::exchange(amx_from_m(), m); },
        "the rows of x from which bf16_dot_linear runs on AMX tiles; returns the previous value");
#endif
  m.def("pack", &pack, "bf16 W [N, K] -> the kernel's panels [ceil(N / 16), K, 16]");
  m.def("bf16_linear", &bf16_linear, "x fp32 [M, K] @ W.T from pack(W), widened to fp32 -> fp32 [M, N]");
}
