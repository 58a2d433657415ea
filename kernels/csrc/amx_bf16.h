// AMX tiles for bf16 linears (TDPBF16PS): x bf16 [M, K] @ W.T with W in the bf16 kernel's pair layout
// ([NB, K / 2, 16, 2], bf16_dot_avx512.h). Compiled where the compiler targets AMX-TILE and AMX-BF16 (QUANTKIT_AMX);
// used where Linux grants this process the tile state (enabled()).
//
// The pair layout is already what a TDPBF16PS B operand wants: its row p holds, for 16 output rows n, the two weights
// of input columns k + 2p and k + 2p + 1 side by side, so 16 consecutive 64-byte lines of a block (32 input columns)
// load as one B tile, straight from the packed weight. An A tile is up to 16 rows of x by 32 columns (row stride K),
// a C tile the fp32 sums of those rows for the block's 16 outputs, in the [rows][16] order the AVX-512 kernels'
// tiles store (store_rows). One TDPBF16PS does 16 x 16 x 32 multiply-adds where a vdpbf16ps does 16 x 2.
//
// Tiles: C 0-3, A 4-5, B 6-7: two row tiles of x by two blocks a step (every A and B load serves two products).
// Products of bf16 values are exact and the sums fp32, as in the AVX-512 kernels; only the order of the sums differs.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QUANTKIT_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace amx {

constexpr int kRows = 16;   // output rows of a block: the lanes of a C tile's row
constexpr int kTileK = 32;  // input columns a tile step takes (an A row, 16 rows of B)

// Linux gives a process the AMX tile data only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// the answer holds for every thread. False where the CPU or the kernel has no AMX, or where the environment sets
// QUANTKIT_CPU_AMX=0 (read once per process): then the AVX-512 kernels run.
inline bool enabled() {
  static const bool granted = [] {
    const char* env = std::getenv("QUANTKIT_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether the linears take the AMX path where it applies (the default) or the AVX-512 one: a switch so that a
// benchmark can time both in one process (set_amx). One per extension: `static` gives each translation unit its own
// (an inline function's static would be one GNU unique symbol for every extension in the process).
static inline bool& switched_on() {
  static bool on = true;
  return on;
}

static inline bool usable(int64_t K) { return switched_on() && K % kTileK == 0 && enabled(); }

// The palette (ldtilecfg's 64 bytes): tiles 0-1 and 4 have r0 rows (the first row tile of x), 2-3 and 5 have r1 rows
// (the second; 0: unused), 6-7 are B (16 rows). Every row is 64 bytes.
struct alignas(64) Palette {
  uint8_t id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the palette for row tiles of r0 and r1 rows on this thread. Other code on the thread (oneDNN) loads its own,
// so every call configures again; tile_release() ends the thread's use.
inline void configure(int r0, int r1) {
  Palette p;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, kRows, kRows};
  for (int t = 0; t < 8; ++t) {
    p.rows[t] = static_cast<uint8_t>(rows[t]);
    p.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&p);
}

inline void tile_release() { _tile_release(); }

// The 2 x 2 step's C tiles: tile r * 2 + j holds row tile r (MA of them) against block j (NB of them).
template <int MA, int NB>
inline void zero_c() {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MA == 2) _tile_zero(2);
  if constexpr (MA == 2 && NB == 2) _tile_zero(3);
}

// The C tiles into c[r * 2 + j] ([rows][16]: fp32 sums of TDPBF16PS, int32 ones of the int8 tile products).
template <int MA, int NB, typename C>
inline void store_c(C (*c)[kRows * kRows]) {
  _tile_stored(0, c[0], 64);
  if constexpr (NB == 2) _tile_stored(1, c[1], 64);
  if constexpr (MA == 2) _tile_stored(2, c[2], 64);
  if constexpr (MA == 2 && NB == 2) _tile_stored(3, c[3], 64);
}

// A step's four tile products (C tile r * 2 + j += A tile 4 + r . B tile 6 + j) as one type, for step's Dot. GCC's
// tile intrinsics are asm templates that paste their tile numbers in as text: they take literals only, not template
// parameters, so each product is written out.
#define QUANTKIT_AMX_STEP_DOTS(Name, product) \
  struct Name {                               \
    static void a0b0() { product(0, 4, 6); }  \
    static void a0b1() { product(1, 4, 7); }  \
    static void a1b0() { product(2, 5, 6); }  \
    static void a1b1() { product(3, 5, 7); }  \
  };
QUANTKIT_AMX_STEP_DOTS(Bf16Dot, _tile_dpbf16ps)  // bf16 pairs, fp32 sums

// One tile step: C += A . B, A the MA row tiles at x (row stride `stride` bytes; the second 16 rows below the first),
// B of block j the 16 64-byte rows at b[j], each product Dot's.
template <int MA, int NB, typename Dot = Bf16Dot>
inline void step(const void* x, int64_t stride, const void* const* b) {
  _tile_loadd(4, x, stride);
  _tile_loadd(6, b[0], 64);
  Dot::a0b0();
  if constexpr (NB == 2) {
    _tile_loadd(7, b[1], 64);
    Dot::a0b1();
  }
  if constexpr (MA == 2) {
    _tile_loadd(5, static_cast<const uint8_t*>(x) + kRows * stride, stride);
    Dot::a1b0();
    if constexpr (NB == 2) Dot::a1b1();
  }
}

// c[r * 2 + j] ([rows][16] fp32) = rows 16r.. of x (MA row tiles) against blocks w[j] (NB of them), over columns 0..K-1
// (K a multiple of 32). x: bf16 bits, row stride ldx elements; w[j]: a block of the pair layout, [K / 2, 16, 2], whose
// 16 lines from column k are the B tile of columns k..k+31. The loop body is step<MA, NB>'s written out: calling step
// with the pair of block pointers each step compiled to the same inner loop but ran a decode step's linears 2-4% slower
// in an A/B against the build with this loop (quantkit.bench.kernel_revision, 21 rounds, M = 1, 8, 16).
template <int MA, int NB>
inline void dots(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K, float (*c)[kRows * kRows]) {
  zero_c<MA, NB>();
  const int64_t stride = ldx * 2;
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(4, x + k, stride);
    _tile_loadd(6, w[0] + k * kRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, w[1] + k * kRows, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MA == 2) {
      _tile_loadd(5, x + kRows * ldx + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_c<MA, NB>(c);
}

// dots<MA, NB> for MA = 1 or 2 row tiles and NB = 1 or 2 blocks, chosen at run time
inline void dots_any(int ma, int nb, const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                     float (*c)[kRows * kRows]) {
  if (ma == 2)
    nb == 2 ? dots<2, 2>(x, ldx, w, K, c) : dots<2, 1>(x, ldx, w, K, c);
  else
    nb == 2 ? dots<1, 2>(x, ldx, w, K, c) : dots<1, 1>(x, ldx, w, K, c);
}

// Rows of x per step (two row tiles) and the weights a thread keeps in L2 while those rows pass by: its blocks are
// taken this many bytes at a time (1 MiB of a 2 MiB L2), so a large-M call reads each block once per chunk of x rows.
constexpr int64_t kStepRows = 2 * kRows;
constexpr int64_t kChunkBytes = 1 << 20;

// The row tiles of the step at row m0 of M (r1 0: one tile), with their palette loaded where `configured` (r0 * 32 + r1
// of the palette this thread has loaded; -1: none) differs.
struct RowStep {
  int r0, r1;
};
inline RowStep row_step(int64_t M, int64_t m0, int& configured) {
  const int r0 = static_cast<int>(std::min<int64_t>(kRows, M - m0));
  const int r1 = static_cast<int>(std::clamp<int64_t>(M - m0 - kRows, 0, kRows));
  if (r0 * 32 + r1 != configured) {
    configure(r0, r1);
    configured = r0 * 32 + r1;
  }
  return {r0, r1};
}

// For blocks b0..b1-1 of a pair-layout weight (K columns) and every row of x [M, K]: emit(b, m0, rows, c) receives
// the fp32 sums c[rows][16] of rows m0..m0+rows-1 against block b. Configures and releases the tiles itself.
template <typename Emit>
void for_blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t b0, int64_t b1, Emit emit) {
  alignas(64) float c[4][kRows * kRows];
  const int64_t block_elems = K * kRows, per_chunk = std::max<int64_t>(2, kChunkBytes / (block_elems * 2));
  int configured = -1;
  for (int64_t cb = b0; cb < b1; cb += per_chunk) {
    const int64_t ce = std::min(b1, cb + per_chunk);
    for (int64_t m0 = 0; m0 < M; m0 += kStepRows) {
      const auto [r0, r1] = row_step(M, m0, configured);
      for (int64_t b = cb; b < ce; b += 2) {
        const int nb = static_cast<int>(std::min<int64_t>(2, ce - b));
        const uint16_t* w2[2] = {w + b * block_elems, w + (b + nb - 1) * block_elems};
        dots_any(r1 > 0 ? 2 : 1, nb, x + m0 * K, K, w2, K, c);
        for (int j = 0; j < nb; ++j) {
          emit(b + j, m0, r0, c[j]);
          if (r1 > 0) emit(b + j, m0 + kRows, r1, c[2 + j]);
        }
      }
    }
  }
  tile_release();
}

}  // namespace amx

#endif

#include <utility>

namespace amx {

// The two functions every extension built with this header exposes, whether or not it has the AMX paths: has_amx()
// (built for AMX and granted the tiles) and, among the development-only switches (`dev`), set_amx(on) (the paths on
// or off for this extension; returns the old setting, false where they are not built).
template <typename Module>
void bind_switches(Module& m, Module& dev) {
  m.def("has_amx", [] {
#if defined(QUANTKIT_AMX)
    return enabled();
#else
    return false;
#endif
  }, "whether this extension has its AMX paths and Linux granted this process the tiles");
  dev.def("set_amx", [](bool on) {
#if defined(QUANTKIT_AMX)
    return std::exchange(switched_on(), on);
#else
    (void)on;
    return false;
#endif
  }, "AMX tiles on (default) or off where they apply; returns the previous setting");
}

}  // namespace amx
