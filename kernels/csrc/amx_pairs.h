// The walk that the int4 kernels on AMX tiles share (int4_amx.h for bf16 activations, int4_q8_amx.h for int8 ones):
// two blocks of 16 outputs by up to 32 rows of x a step (tiles C 0-3, A 4-5, B 6-7, as amx::configure lays them
// out), every row step of a block pair before the next pair. Each kernel unpacks a block's 4-bit codes into B tiles of
// 1 KiB; past 32 rows the first row step of a pair keeps its unpacked tiles (in L2) and the others load them back.
#pragma once

#include "amx_bf16.h"
#include "tiles_bf16_avx512.h"

#if defined(QUANTKIT_AMX)

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace amx {

constexpr int64_t kTileBytes = kRows * 64;  // a B tile: 16 rows of 64 bytes

// Room for n B tiles on this thread, 64-byte aligned, grown as needed; `slot` 0 and 1 are separate rooms (a block
// pair's kept tiles, and a kernel's own sets of a group's tiles).
inline uint8_t* tile_room(int slot, int64_t n) {
  thread_local std::vector<uint8_t> rooms[2];
  std::vector<uint8_t>& room = rooms[slot];
  const size_t need = static_cast<size_t>(n * kTileBytes + 64);
  if (room.size() < need) room.resize(need);
  const uintptr_t p = reinterpret_cast<uintptr_t>(room.data());
  return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
}

// One row step of a block pair over the G groups of `steps` tile steps each, the part both kernels share; each brings
// its own three parts:
//   unpack(j, g, i, tile)  block j's codes of step i of group g into the B tile at `tile` (1 KiB)
//   product(g, i, bt)      that step's tile products on the B tiles bt[0], bt[1] (amx::step with the kernel's Dot)
//   fold(g, c)             the group's C tiles, stored as c[r * 2 + j][rows][16] (C: fp32 or int32), folded into
//                          the outputs (the kernel's epilogue)
// `kept` and `fill` as over_block_pairs passes them: with kept tiles only the fill step unpacks; without, a group's
// tiles go to one of two sets, alternating by group (a tile load waits for the stores to its buffer, and one buffer
// for every group serialized them). Software-pipelining the groups (the next group's unpacking and tile products
// issued before this group's epilogue, C stored to two buffers in turn) was timed level with this order (the 1B
// shape's 64 linears at 1-128 rows, both kernels, 2026-12-07), so the plain order stays.
template <int MA, int NB, typename C, typename Unpack, typename Product, typename Fold>
inline void over_groups(int64_t G, int64_t steps, uint8_t* kept, bool fill, Unpack unpack, Product product, Fold fold) {
  alignas(64) C c[4][kRows * kRows];
  uint8_t* own = kept != nullptr ? nullptr : tile_room(1, 2 * 2 * steps);  // two sets of steps x 2 blocks
  for (int64_t g = 0; g < G; ++g) {
    // the B tile of step i of the group, block j: base + (i * 2 + j) * kTileBytes
    uint8_t* base = kept != nullptr ? kept + g * steps * 2 * kTileBytes : own + (g % 2) * steps * 2 * kTileBytes;
    if (kept == nullptr || fill)
      for (int64_t i = 0; i < steps; ++i)
        for (int j = 0; j < NB; ++j) unpack(j, g, i, base + (i * 2 + j) * kTileBytes);
    zero_c<MA, NB>();
    for (int64_t i = 0; i < steps; ++i) {
      const void* bt[2] = {base + i * 2 * kTileBytes, base + (i * 2 + 1) * kTileBytes};
      product(g, i, bt);
    }
    store_c<MA, NB>(c);
    fold(g, c);
  }
}

// Blocks b0..b1-1 of an int4 linear with N outputs for the M rows of x, into out (fp32 [M, N]) or out_bf16. The
// kernel's pair_rows(ma, nb, b, m0, r0, r1, kept, fill, o), with ma and nb std::integral_constant (row tiles of r0
// and r1 rows, blocks b..b+nb-1), writes o[r * 2 + j][rows][16]; `kept` is null (unpack every tile) or, past 32
// rows, room for `kept_tiles` tiles, the pair's for all of K, written when `fill` and read back otherwise.
template <typename PairRows>
void over_block_pairs(int64_t M, int64_t N, float* out, uint16_t* out_bf16, int64_t kept_tiles, int64_t b0, int64_t b1,
                      PairRows pair_rows) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  alignas(64) float o[4][kRows * kRows];
  uint8_t* kept = M > kStepRows ? tile_room(0, kept_tiles) : nullptr;
  int configured = -1;
  for (int64_t b = b0; b < b1; b += 2) {
    const int nb = static_cast<int>(std::min<int64_t>(2, b1 - b));
    for (int64_t m0 = 0; m0 < M; m0 += kStepRows) {
      const auto [r0, r1] = row_step(M, m0, configured);
      const bool fill = m0 == 0;
      if (r1 > 0)
        nb == 2 ? pair_rows(Two{}, Two{}, b, m0, r0, r1, kept, fill, o)
                : pair_rows(Two{}, One{}, b, m0, r0, r1, kept, fill, o);
      else
        nb == 2 ? pair_rows(One{}, Two{}, b, m0, r0, r1, kept, fill, o)
                : pair_rows(One{}, One{}, b, m0, r0, r1, kept, fill, o);
      for (int j = 0; j < nb; ++j) {
        const int64_t n0 = (b + j) * kRows;
        const int64_t cols = std::min<int64_t>(kRows, N - n0);
        tiles512::store_rows(out, out_bf16, N, n0, cols, m0, r0, o[j]);
        if (r1 > 0) tiles512::store_rows(out, out_bf16, N, n0, cols, m0 + kRows, r1, o[2 + j]);
      }
    }
  }
  tile_release();
}

}  // namespace amx

#endif
