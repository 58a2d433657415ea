// A streaming read of a buffer at memory speed: the bound of a memory-bound decode step (quantkit.kernels.stream_read).
//
// What STREAM's and likwid-bench's read kernels do, for reads alone: each thread reads its own contiguous share of
// the buffer (split at 64-byte lines, the OpenMP threads pinned by the caller's count), with full-width vector
// loads, eight lines an iteration into independent accumulators (no dependence chain longer than the loop), and a
// software prefetch of every line a given distance ahead (0: the hardware's prefetchers alone), so that enough lines
// are in flight to cover the memory latency. No one distance reads fastest on every host (the hardware's stream
// prefetcher stops at each 4 KiB page: the int4 decode tiles read 1.1x faster fetching 4 KiB ahead), so the bound is
// the best of several (quantkit.kernels.stream_read.PREFETCH_DISTANCES). What it computes keeps the loads alive:
// the sum of the buffer's 32-bit words, wrapping modulo 2^32 (integer adds are exact in any order, so the reference
// reproduces it bit for bit).
//
// buf: uint8 [bytes], contiguous (any length: the tail past the last whole 64-byte line is summed word by word;
// a length not a multiple of 4 is refused); ahead: the prefetch distance in bytes (>= 0). Returns the wrapped sum as
// a non-negative int64.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kUnroll = 8;  // lines an iteration

uint32_t sum_words(const uint8_t* p, int64_t bytes) {
  uint32_t s = 0;
  for (int64_t i = 0; i + 4 <= bytes; i += 4) {
    uint32_t w;
    std::memcpy(&w, p + i, 4);
    s += w;
  }
  return s;
}

// The 32-bit words of lines [0, lines) from p, summed with wrapping; each line fetched `ahead` bytes early.
uint32_t sum_lines(const uint8_t* p, int64_t lines, int64_t ahead) {
#if defined(__AVX512F__)
  __m512i acc[kUnroll];
  for (auto& a : acc) a = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + kUnroll <= lines; i += kUnroll) {
    const uint8_t* q = p + i * kLine;
    if (ahead > 0)
      for (int u = 0; u < kUnroll; ++u) _mm_prefetch(reinterpret_cast<const char*>(q + ahead + u * kLine), _MM_HINT_T0);
    for (int u = 0; u < kUnroll; ++u)
      acc[u] = _mm512_add_epi32(acc[u], _mm512_loadu_si512(reinterpret_cast<const void*>(q + u * kLine)));
  }
  for (; i < lines; ++i)
    acc[0] = _mm512_add_epi32(acc[0], _mm512_loadu_si512(reinterpret_cast<const void*>(p + i * kLine)));
  for (int u = 1; u < kUnroll; ++u) acc[0] = _mm512_add_epi32(acc[0], acc[u]);
  return static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[0]));
#else
  (void)ahead;
  return sum_words(p, lines * kLine);  // the compiler vectorizes it at the level's width
#endif
}

int64_t read_sum(torch::Tensor buf, int64_t threads, int64_t ahead) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == torch::kUInt8 && buf.dim() == 1 && buf.is_contiguous(),
              "read_sum: buf must be a contiguous 1-d uint8 CPU tensor");
  TORCH_CHECK(buf.numel() % 4 == 0, "read_sum: the buffer's length must be a multiple of 4 bytes");
  TORCH_CHECK(threads >= 1, "read_sum: threads must be at least 1");
  TORCH_CHECK(ahead >= 0, "read_sum: the prefetch distance must be at least 0");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t bytes = buf.numel(), lines = bytes / kLine;
  uint32_t total = sum_words(p + lines * kLine, bytes - lines * kLine);
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t first = lines * t / n, last = lines * (t + 1) / n;
    total += sum_lines(p + first * kLine, last - first, ahead);
  }
  return static_cast<int64_t>(total);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_sum", &read_sum, "uint8 buf [bytes] -> the sum of its 32-bit words mod 2^32, read by `threads` threads, "
        "each line prefetched `ahead` bytes early", py::arg("buf"), py::arg("threads"), py::arg("ahead") = 1024);
}
