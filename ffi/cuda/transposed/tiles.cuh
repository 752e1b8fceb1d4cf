// The transposed kernel's tiles and values: a 64-row W2 tile copied into shared memory as a wgmma B
// operand, e's two int8 digits written into the A operands, and a thread's 16 consecutive rows of base
// logits in and rounded logits out, 16 bytes a load or store.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/smem_layout.h"
#include "cuda/ptx.cuh"
#include "cuda/values.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/operands.cuh"
#include "cuda/walk/tiles.cuh"

namespace jax_markov {
namespace walk {

// Warpgroup-local copy of tile `row0`'s 64 W2 rows into `dst` (TransposedOffset layout, column n
// holding row TileRow(n)), 16 bytes a cp.async, 8 a thread (u = thread in the warpgroup). Within a
// warp, lanes L % 8 take 8 columns of one 16-byte k-column (one 128-byte core matrix in shared
// memory) and L / 8 four adjacent k-columns (64 contiguous bytes of a row in global memory). Rows past
// V are zero.
__device__ __forceinline__ void CopyTransposedTile(const int8_t* w2, int vocab, int row0, int8_t* dst, int u) {
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int q = u + 128 * m, lane = q % 32, group = q / 32;
    const int n = 8 * (group % 8) + lane % 8, column = 4 * (group / 8) + lane / 8;
    const int row = row0 + TileRow(n);
    const bool inside = row < vocab;
    CpAsync16(dst + TransposedOffset(n, 16 * column), w2 + size_t(inside ? row : 0) * kRank + 16 * column, inside);
  }
}

// Tile `tile` of W2 stored tile by tile (W2TileOrder's layout, which is the slot's) into `dst` by one bulk copy of
// kTransposedTileBytes contiguous bytes, completing on `bar`; one thread issues it, after
// MbarrierArriveExpectTx(bar, kTransposedTileBytes).
__device__ __forceinline__ void BulkCopyTile(const int8_t* w2_tiles, int tile, int8_t* dst, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(SharedAddress(dst)),
               "l"(w2_tiles + size_t(tile) * kTransposedTileBytes), "r"(kTransposedTileBytes), "r"(SharedAddress(bar))
               : "memory");
}

// Request b's e (lane L: e[8L .. 8L+7]) as two int8 digits in the A operands (`digits`, laid out as
// Digits, a DigitLayout); records the unscale and writes the embeds row as MarkovWalkKernel does.
template <typename Digits>
__device__ __forceinline__ void BuildTwoDigits(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                               int8_t* digits, float* unscale) {
  uint32_t words[2][2] = {};
  RowDigitWords(a, b, k, lane, raw, 14, unscale, words);  // the high digit within [-64, 64]
#pragma unroll
  for (int d = 0; d < 2; ++d) {
    const uint2 bytes = make_uint2(words[d][0], words[d][1]);
    *reinterpret_cast<uint2*>(digits + Digits::Offset(b, d, 8 * lane)) = bytes;
    if (Digits::kRows > 64 && Digits::Row(b, d) < Digits::kRows - 64) {  // its copy 64 rows (8 x 256 bytes) on
      *reinterpret_cast<uint2*>(digits + Digits::Offset(b, d, 8 * lane) + 8 * 256) = bytes;
    }
  }
}

// The raw bits of two adjacent base logits (rows 2 j, 2 j + 1 of a thread's 16).
template <int BASE>
using BasePairBits = std::conditional_t<BASE == kF32, uint2, uint32_t>;

// A thread's 16 base logits (rows row .. row + 15 of one request and step, at element `offset` of the
// base logits' rows), 16 bytes a load, as 8 pairs. `whole`: all 16 lie before V; otherwise a 16-byte
// vector at or past V (V % 8 == 0: wholly past it) is not loaded, its bits never used. Rows in
// [vocab_size, V) are loaded and later replaced by -inf.
template <int BASE>
__device__ __forceinline__ void LoadThreadBase(const WalkArgs& a, size_t offset, int row, bool whole, BasePairBits<BASE> (&pairs)[8]) {
  constexpr int kVectors = BASE == kF32 ? 4 : 2, kRowsPerVector = 16 / kVectors;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.base) + (offset + row) * (BASE == kF32 ? 4 : 2));
  uint4 v[kVectors];
  if (whole) {
#pragma unroll
    for (int q = 0; q < kVectors; ++q) v[q] = __ldcs(src + q);
  } else {
#pragma unroll
    for (int q = 0; q < kVectors; ++q) v[q] = row + q * kRowsPerVector < a.vocab ? __ldcs(src + q) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int q = 0; q < kVectors; ++q) {
    if constexpr (BASE == kF32) {
      pairs[2 * q] = make_uint2(v[q].x, v[q].y);
      pairs[2 * q + 1] = make_uint2(v[q].z, v[q].w);
    } else {
      pairs[4 * q] = v[q].x;
      pairs[4 * q + 1] = v[q].y;
      pairs[4 * q + 2] = v[q].z;
      pairs[4 * q + 3] = v[q].w;
    }
  }
}

// Value h (0: row, 1: row + 1) of a pair as a float.
template <int BASE>
__device__ __forceinline__ float BasePairValue(const BasePairBits<BASE>& bits, int h) {
  if constexpr (BASE == kF32) {
    return __uint_as_float(h ? bits.y : bits.x);
  } else {
    return BaseToFloat<BASE>(h ? bits >> 16 : bits & 0xFFFFu);
  }
}

// A thread's 16 rounded logits of one request (rows row .. row + 15; `bits`: 32-bit words, two 16-bit
// values each or one f32) at element `offset` of the logits' rows, 16 bytes a store; a vector at or past
// V (V % 8 == 0: wholly past it) is not stored.
template <int OUT>
__device__ __forceinline__ void StoreThreadLogits(const WalkArgs& a, size_t offset, int row, const uint32_t (&bits)[OUT == kF32 ? 16 : 8]) {
  constexpr int kVectors = OUT == kF32 ? 4 : 2, kRowsPerVector = 16 / kVectors;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(a.logits) + (offset + row) * (OUT == kF32 ? 4 : 2));
#pragma unroll
  for (int q = 0; q < kVectors; ++q) {
    if (row + q * kRowsPerVector < a.vocab) __stcs(dst + q, make_uint4(bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]));
  }
}

}  // namespace walk
}  // namespace jax_markov
