// MarkovWalkKernel's W2 tiles (16 rows) and base logits: which tiles a warp scores and which of them
// stay resident in shared memory, the loads of a tile's chunks from L2 (streamed) or their copies into
// shared memory (resident), the A-operand order of a tile's words, and the base logits a lane combines
// with a tile's dot products (from L2, or staged in shared memory a step at a time).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_config.h"
#include "cuda/mma.cuh"
#include "cuda/ptx.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/operands.cuh"

namespace jax_markov {
namespace walk {

// Which of a CTA's tiles warp w scores. The first `resident` local tiles live in shared memory and
// are dealt round-robin (tile w + i * W); the rest stream from L2, dealt from the last warp down so
// that warps with one tile fewer in shared memory take the streamed ones. A warp scores its
// streamed tiles spread evenly among its resident ones, starting with one, so each streamed
// tile's load is issued a few tiles before it is needed. Kernels that keep their streamed tiles
// (kKeepsStreamed) take them in reverse at odd steps (Streamed), so that each step starts with the
// tile the step before ended with, still in the prefetch registers: a warp with one streamed tile
// loads it once a walk, not once a step.
template <int kWarps>
struct WarpTiles {
  int warp, resident, n_resident, n_streamed;
  WarpTiles() = default;
  __device__ WarpTiles(int w, int resident_tiles, int my_tiles) : warp(w), resident(resident_tiles) {
    const int r = min(resident_tiles, my_tiles);
    n_resident = w < r ? (r - 1 - w) / kWarps + 1 : 0;
    const int first_streamed = r + (kWarps - 1 - w);
    n_streamed = first_streamed < my_tiles ? (my_tiles - 1 - first_streamed) / kWarps + 1 : 0;
  }
  __device__ int total() const { return n_resident + n_streamed; }
  __device__ int Local(bool streamed, int i) const {
    return streamed ? resident + (kWarps - 1 - warp) + i * kWarps : warp + i * kWarps;
  }
  // The local tile of the i-th streamed tile that the warp scores at step k.
  __device__ int Streamed(int k, int i) const { return Local(true, k & 1 ? n_streamed - 1 - i : i); }
  // The position in the warp's order of streamed tile `is` (past the end once all are scored).
  __device__ int StreamedSlot(int is) const { return is < n_streamed ? (is * total()) / n_streamed : total(); }
};

// WarpTiles::StreamedSlot(0), StreamedSlot(1), ..., StreamedSlot(n_streamed) stepped without a division
// a tile: floor(is total / n_streamed) = is q + floor(is r / n_streamed), with q and r the quotient and
// remainder of total / n_streamed (r < n_streamed: a step carries at most one). `slot` is tile 0's;
// Next() moves to the next tile's.
struct StreamedSlots {
  int slot, carry, q, r, n;
  __device__ StreamedSlots(int total, int n_streamed)
      : slot(n_streamed > 0 ? 0 : total), carry(0), q(n_streamed > 0 ? total / n_streamed : 0),
        r(n_streamed > 0 ? total % n_streamed : 0), n(n_streamed) {}
  __device__ int Next() {
    slot += q;
    carry += r;
    if (carry >= n) {
      carry -= n;
      ++slot;
    }
    return slot;
  }
};

// Chunk i of lane (g, t)'s share of the tile starting at row0: row row0 + g for the first half of
// the chunks, row0 + g + 8 for the second, chunk 4 (i mod half) + t of that row. Rows past V read
// row V - 1 instead (their scores are never used).
template <int W2>
__device__ __forceinline__ const uint4* TileChunk(const void* w2, int vocab, int row0, int g, int t, int i) {
  constexpr int kHalf = TileChunks(W2) / 2;
  const int row = min(row0 + g + (i < kHalf ? 0 : 8), vocab - 1);
  return reinterpret_cast<const uint4*>(static_cast<const char*>(w2) + size_t(row) * kRank * W2Bytes(W2)) +
         4 * (i % kHalf) + t;
}

// Lane (g, t)'s chunks of a tile, from L2: nothing waits for these loads until the tile is scored.
template <int W2>
__device__ __forceinline__ void LoadTileGlobal(const void* w2, int vocab, int row0, int g, int t,
                                               uint4 (&raw)[TileChunks(W2)]) {
#pragma unroll
  for (int i = 0; i < TileChunks(W2); ++i) raw[i] = __ldcg(TileChunk<W2>(w2, vocab, row0, g, t, i));
}

// Chunk j of lane (g, t)'s share of a tile in fragment order: the A-operand words of k-step j,
// {row g, row g + 8, row g, row g + 8} at words 2 (j & 1) and 2 (j & 1) + 1 of row chunk j / 2, so
// that one 16-byte register quad is an MMA operand as it stands (no register moves per MMA). From
// chunks held in row order (ROWS, as loaded from W2) or already in fragment order.
template <int W2>
__device__ __forceinline__ uint4 FragmentChunk(const uint4 (&c)[TileChunks(W2)], int j, bool rows) {
  if (!rows) return c[j];
  const uint4 ra = c[j >> 1], rb = c[TileChunks(W2) / 2 + (j >> 1)];
  const int w = 2 * (j & 1);
  return make_uint4(Word(ra, w), Word(rb, w), Word(ra, w + 1), Word(rb, w + 1));
}

// Starts copying request rows [first_row, first_row + rows) of step k's base logits into `staged`
// ([B][stage_rows]) with cp.async, as one commit group; every 16-byte chunk is whole (the plan stages
// only where a row of V base logits is a multiple of 16 bytes).
template <int THREADS>
__device__ __forceinline__ void StageBaseLogits(const WalkArgs& a, unsigned char* staged, int stage_rows, int first_row,
                                                int rows, int k) {
  const int esize = ElementBytes(a.base_dtype);
  const int chunks = rows * esize / 16;
  for (int c = threadIdx.x; c < a.batch * chunks; c += THREADS) {
    const int rq = c / chunks, j = c % chunks;
    const char* src = static_cast<const char*>(a.base) + ((size_t(rq) * a.steps + k) * a.vocab + first_row) * esize + 16 * j;
    CpAsync16(staged + size_t(rq) * stage_rows * esize + 16 * j, src, true);
  }
  CpAsyncCommit();
}

// Asks L2 for step k's base logits of rows [first_row, first_row + rows), all requests: the loads
// in the scoring loop then wait for L2, not HBM.
template <int THREADS>
__device__ __forceinline__ void PrefetchBaseLogits(const WalkArgs& a, int first_row, int rows, int k) {
  const int esize = ElementBytes(a.base_dtype);
  const int lines = (rows * esize + 127) / 128 + 1;
  for (int c = threadIdx.x; c < a.batch * lines; c += THREADS) {
    const int rq = c / lines, line = c % lines;
    const char* start = static_cast<const char*>(a.base) + ((size_t(rq) * a.steps + k) * a.vocab + first_row) * esize;
    const char* p = start + min(128 * line, rows * esize - 1);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
}

// Where the base logits of lane (g, t)'s slot i start at step k, as an element index: into a.base
// ([B, K, V]: the plan keeps B K V below 2^32), or STAGED into `staged` ([B][stage_rows], less
// first_row, so that adding a row of this CTA gives its index). Requests past the batch read the last
// one's. Computed once a step, so that a tile's loads add only their rows.
template <bool SPLIT, bool DIGITS, bool STAGED, bool EREGS>
__device__ __forceinline__ uint32_t BaseLine(const WalkArgs& a, int stage_rows, int first_row, int k, int i, int t, int g) {
  const int rq = min(SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g), a.batch - 1);
  return STAGED ? uint32_t(rq * stage_rows - first_row) : uint32_t(rq * a.steps + k) * uint32_t(a.vocab);
}

// Raw bits of the base logits that lane (g, t) combines with a tile's dot products: rows row0 + g
// (ba) and row0 + g + 8 (bb) of every request it owns (`line`: BaseLine), at clamped (always valid)
// indices. All loads of one call issue before any is used. BF16_BASE: the launch's base logits are
// bf16 (a known launch form), and no other dtype's loads are compiled.
template <int kSlots, bool STAGED, bool BF16_BASE>
__device__ __forceinline__ void LoadBaseBits(const WalkArgs& a, const unsigned char* staged, const uint32_t (&line)[kSlots],
                                             int row0, int g, uint32_t (&ba)[kSlots], uint32_t (&bb)[kSlots]) {
  const uint32_t ra = min(row0 + g, a.vocab - 1), rb = min(row0 + g + 8, a.vocab - 1);
  const void* base = STAGED ? static_cast<const void*>(staged) : a.base;
  if (!BF16_BASE && a.base_dtype == kF32) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const unsigned int* p = static_cast<const unsigned int*>(base);
      ba[i] = STAGED ? p[line[i] + ra] : __ldcs(p + (line[i] + ra));
      bb[i] = STAGED ? p[line[i] + rb] : __ldcs(p + (line[i] + rb));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const unsigned short* p = static_cast<const unsigned short*>(base);
      ba[i] = STAGED ? p[line[i] + ra] : __ldcs(p + (line[i] + ra));
      bb[i] = STAGED ? p[line[i] + rb] : __ldcs(p + (line[i] + rb));
    }
  }
}

// The EREGS form of LoadBaseBits, for bf16 base logits and an even V (the plan): lane (g, t) combines
// rows row0 + 2t, 2t + 1 (ba) and row0 + 8 + 2t, 8 + 2t + 1 (bb) of each request it owns, one 32-bit
// load a pair.
template <int kSlots, bool STAGED>
__device__ __forceinline__ void LoadBasePairs(const WalkArgs& a, const unsigned char* staged, const uint32_t (&line)[kSlots],
                                              int row0, int t, uint32_t (&ba)[kSlots], uint32_t (&bb)[kSlots]) {
  const uint32_t ra = min(row0 + 2 * t, a.vocab - 2), rb = min(row0 + 8 + 2 * t, a.vocab - 2);
  const unsigned short* p = static_cast<const unsigned short*>(STAGED ? static_cast<const void*>(staged) : a.base);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const unsigned int* pa = reinterpret_cast<const unsigned int*>(p + (line[i] + ra));
    const unsigned int* pb = reinterpret_cast<const unsigned int*>(p + (line[i] + rb));
    ba[i] = STAGED ? *pa : __ldcs(pa);
    bb[i] = STAGED ? *pb : __ldcs(pb);
  }
}

}  // namespace walk
}  // namespace jax_markov
