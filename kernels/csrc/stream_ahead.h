// The software prefetch of the tiles that stream their codes from memory: at one to three rows of x (batch-1 decode)
// the AVX-512 tiles of int4_bf16_avx512.h and int4_q8_avx512.h and the AVX2 tiles of int4_x16_avx2.h and
// int4_q8_avx2.h; on AMX, int4_amx.h's unpacking (every M) and int8_amx.h's head at one row tile (M <= 16).
// Each thread walks its blocks front to back, a 64-byte line a step or two, with enough unpacking work a line that the
// core keeps too few lines in flight for the memory's bandwidth: the tiles fetch the line this many bytes ahead of
// their loads (a 4 KiB page: the hardware's stream prefetcher stops at each). Measured on an 8B layer's int4 linears
// at M = 1, 2 threads, against none: the AVX-512 BF16 W4A16 tile read 1.12x the codes a second and W4A8 1.09x (EPYC
// BF16); the AVX2 16-bit tile 1.32x and W4A8 1.26x (EPYC AVX2). The int8 lm_head's VNNI and AVX2 tiles, one load
// and two multiply-adds a line, read faster without it on EPYC BF16 (0.95x with it) and no faster with it on EPYC
// AVX2, so they have none (benchmarks/int4_prefetch.py, docs/BENCHMARKS.md); its AMX tiles at 8-16 rows, 1.2x.
// A switch so that a benchmark can time distances in one process (the extension's dev.set_stream_ahead; 0: none).
#pragma once

#include <xmmintrin.h>

#include <cstdint>

namespace stream {

inline int64_t& ahead() {
  static int64_t bytes = 4096;
  return bytes;
}

// The line `bytes` past p (nothing where it is 0): a tile reads ahead() once, into a local, so that its hot loop
// holds the distance in a register.
inline void prefetch(const void* p, int64_t bytes) {
  if (bytes > 0) _mm_prefetch(static_cast<const char*>(p) + bytes, _MM_HINT_T0);
}

}  // namespace stream
