// The transposed walk kernel: walks of 17 to 64 requests over int8 W2 (see walk_kernel.cuh for the
// walk it shares its exchange and helpers with). Greedy walks with no logits out take the plain
// instantiation (kPlainWalk); greedy walks with logits out and sampled walks take the general epilogue
// (kLogitsWalk, kSampledWalk, kRotatedSampledWalk).
//
// Design (measured alone in Session 15 of benchmarks/NOTES.md)
// - The roles of MarkovWalkKernel's wgmma are swapped: A = e, as two int8 digits per request
//   (E = rint(e 2^shift) = d0 + 2^8 d1, max |E| in [2^13, 2^14): fixed point at 2^-14 of the largest
//   element, where the fp16 e of MarkovWalkKernel holds a bf16 W1 exactly; the bias errs by up to
//   about 2e-4 of its rms, tokens differ only at near-ties), one 64-row operand per digit with M row = request (PACKED, up to
//   32 requests: one operand for both digits, M row 16 (b / 8) + b % 8 + 8 d, half the MMAs); B = a tile of
//   64 W2 rows, int8 as stored, in shared memory. wgmma m64n64k32 s8 needs no conversion of W2 and
//   no A registers, and a thread's accumulators cover 2 requests x 16 rows (PACKED: both digits of
//   one request), so it keeps 2 best candidates (16 in MarkovWalkKernel at B = 64).
// - Three warpgroups (four in the plain walk over 16-bit base logits: TransposedWarpgroups) share a
//   CTA's tiles round-robin and issue their wgmmas in turn, so that the tensor cores can finish one
//   warpgroup's tile before the next one's while its epilogue overlaps the others' wgmmas (v123m2:
//   -3.4 % at 64 requests, NOTES Sessions 49-50). Each digit's int32 sums are exact (|sum| < 2^22),
//   and so is high x 256 + low (< 2^31), which one conversion rounds to a float. The first tiles
//   stay resident in shared memory (loaded once by cp.async); the rest stream from L2 into one slot
//   per warpgroup, a streamed tile ahead.
// - Operands in shared memory use the canonical K-major layout without swizzle: element (n, k) of
//   a 64 x 256 operand at byte TransposedOffset(n, k). A W2 tile holds its rows in the order that gives
//   each thread 16 consecutive rows (TileRow): the thread of column pair t holds rows 16 t .. 16 t + 15
//   of the tile, so its base logits are one 32-byte run a request (two 16-byte loads in bf16, whole
//   sectors) instead of eight 4-byte loads that each used half a sector; it still meets its rows in
//   increasing order.
// - The general epilogue: l is rounded to the logits dtype before it is chosen from (one copy of the epilogue per
//   dtype, picked once a tile) and a thread stores its 16 rows of a request 16 bytes at a time; a
//   sampled request scores l / T + g, its Gumbel noise computed in the epilogue, four rows at a time
//   (Philox chains in lockstep). Reading it from a kernel of its own (MarkovWalkNoise, v39) cost that
//   kernel's 311 us and the walk 39 MB of HBM reads a step at V = 151936, B = 64; computed here, the
//   integer multiplies take the issue slots that the walk's latencies leave idle.
// - The sampled walk of 33-48 requests (v41): a thread holds two requests in some warps and one in
//   others, and the noise is most of the work; DigitLayout's ROTATED order gives each warpgroup's
//   heavy warps to other SM sub-partitions than the other warpgroups' (48 KB of A operands, not 32:
//   one resident tile fewer, which costs more than the balance gains from 49 requests on).
// - The exchange is MarkovWalkKernel's direct one (a slot per CTA and request; GatherChoices spins on
//   a warp's first request, then reads the others' slots once), or on more than kDirectMaxCtas SMs
//   its atomic one: one atomicMax per request and an arrival counter that doubles as the grid
//   barrier. (At 16 requests and fewer MarkovWalkKernel's direct exchange and fp16 wgmma were faster:
//   108.5 against 136.6 us at V = 151936, K = 7, B = 16, and 103.9 against 126.3 for the plain walk
//   in Session 35.)
#pragma once

#include "cuda/walk_kernel.cuh"

namespace jax_markov {
namespace walk {

constexpr int kTransposedTileRows = 64;
constexpr int kTransposedTileBytes = kTransposedTileRows * kRank;  // int8
// The warpgroups of the walks other than TransposedWarpgroups' four (DigitLayout's ROTATED order is
// laid out for them).
constexpr int kTransposedWarpgroups = 3;

// What a launch of the transposed kernel does besides choosing: nothing (greedy, no logits out),
// logits out (greedy), or sampling (and logits out if asked), the last in DigitLayout's ROTATED order
// for unpacked launches of up to kRotatedMaxBatch requests. Each is its own instantiation: the noise's
// code costs a greedy walk with logits out 7 % (v40's first form) even where it never runs.
enum TransposedWalk : int { kPlainWalk = 0, kLogitsWalk = 1, kSampledWalk = 2, kRotatedSampledWalk = 3 };
constexpr int kRotatedMaxBatch = 48;  // rotated: 40 requests -8.0 %, 48 -4.2 %, but 64 +1.3 % (NOTES, Session 20)

// A walk's warpgroups a CTA: the plain walk over 16-bit base logits on four (its epilogue fits 128
// registers a thread, and its score phase is bound by latency that more warps cover: two warpgroups
// lost 4.4 % against three, NOTES Session 34); the general epilogues (up to 168 registers) and f32
// base logits (whose tile loop spills at 128) on three.
__host__ __device__ constexpr int TransposedWarpgroups(int walk, int base) {
  return walk == kPlainWalk && base != kF32 ? 4 : kTransposedWarpgroups;
}

// Byte offset of element (row, k) of a `rows` x 256 int8 wgmma operand: [k / 32][row / 8][k half][row % 8][16].
__host__ __device__ constexpr int OperandOffset(int rows, int row, int k) {
  return (k / 32) * (rows * 32) + (row / 8) * 256 + ((k % 32) / 16) * 128 + (row % 8) * 16 + k % 16;
}
__host__ __device__ constexpr int TransposedOffset(int row, int k) { return OperandOffset(64, row, k); }

// The tile row (0-63) at wgmma column n: the accumulator columns 8 j + 2 t + h (j < 8, h < 2) of the
// threads of column pair t hold rows 16 t + 2 j + h.
__host__ __device__ constexpr int TileRow(int n) { return 16 * ((n % 8) / 2) + 2 * (n / 8) + n % 2; }

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

// The A operands' layout. Unpacked, operand d holds digit d of request b in row b. PACKED (up to 32
// requests), the one operand holds digit d of request b in row 16 (b / 8) + b % 8 + 8 d. ROTATED
// (unpacked sampled launches of up to kRotatedMaxBatch requests): row 16 (b / 8) + b % 8 of operand d
// for b < 32 and row 16 ((b - 32) / 8) + 8 + b % 8 for the rest, and rows 0-31 again as rows 64-95, so
// that warpgroup j reads the 64 rows from row 16 j on: its warp w then scores the requests that warp
// (w + j) % 4 holds in operand rows 0-63.
// Below 64 requests some warps hold two requests a thread and the others one, and a sampled request's
// noise is most of a thread's work; the three warpgroups put warp w on the same SM sub-partition, so
// that without the rotation the sub-partitions of the first warps made all the second requests' noise.
template <bool PACKED, bool ROTATED>
struct DigitLayout {
  static constexpr int kRows = ROTATED ? 64 + 16 * (kTransposedWarpgroups - 1) : 64;  // rows of an operand
  static constexpr int kSlabBytes = kRows * 32;  // the k-slab of one wgmma (32 k)
  static constexpr int kOperandBytes = kRows * kRank;
  static constexpr int kBytes = (PACKED ? 1 : 2) * kOperandBytes;
  // The operand row of digit d of request b (ROTATED: its first copy).
  __host__ __device__ static constexpr int Row(int b, int d) {
    return PACKED ? 16 * (b / 8) + b % 8 + 8 * d : ROTATED ? (b < 32 ? 16 * (b / 8) + b % 8 : 16 * ((b - 32) / 8) + 8 + b % 8) : b;
  }
  __host__ __device__ static constexpr int Offset(int b, int d, int k) {
    return (PACKED ? 0 : d * kOperandBytes) + OperandOffset(kRows, Row(b, d), k);
  }
  // The request that warp w of warpgroup wg scores in accumulator rows g + 8 r of its 16 (PACKED: r = 0).
  __host__ __device__ static constexpr int Request(int w, int wg, int g, int r) {
    return PACKED ? 8 * w + g : ROTATED ? 8 * ((w + wg) % 4) + g + 32 * r : 16 * w + g + 8 * r;
  }
  // Whether Request names the request whose digits lie in the rows each warpgroup reads: for each
  // warpgroup, every request once, in the row of its digit 0 (PACKED: digit 1 eight rows on).
  static constexpr bool Consistent() {
    for (int wg = 0; wg < kTransposedWarpgroups; ++wg) {
      bool seen[kMaxBatch] = {};
      for (int w = 0; w < 4; ++w) {
        for (int g = 0; g < 8; ++g) {
          for (int r = 0; r < (PACKED ? 1 : 2); ++r) {
            const int b = Request(w, wg, g, r);
            const int read = (ROTATED ? 16 * wg : 0) + 16 * w + g + 8 * r;  // the operand row read
            if (b < 0 || b >= kMaxBatch || seen[b] || read >= kRows) return false;
            seen[b] = true;
            const int row = Row(b, 0);
            if (read != row && !(read == row + 64 && row < kRows - 64)) return false;
            if (PACKED && Row(b, 1) != row + 8) return false;
          }
        }
      }
    }
    return true;
  }
};
static_assert(DigitLayout<true, false>::Consistent() && DigitLayout<false, false>::Consistent() &&
                  DigitLayout<false, true>::Consistent(),
              "each warpgroup reads every request's digits where Request says");

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

// Shared memory: the A operands (DigitLayout), per-request state, then the W2 scales, one
// streamed-tile slot per warpgroup (WARPGROUPS) and the resident tiles (each tile 1024-byte aligned,
// as are the operands).
template <bool PACKED, bool ROTATED, int WARPGROUPS>
struct TransposedSmem {
  static constexpr int kDigitsBytes = DigitLayout<PACKED, ROTATED>::kBytes;
  static constexpr int kStateBytes = kMaxBatch * (8 + 4) + 16 + 8 * 4;  // cta_best, unscale, last-CTA flag, turns
  static constexpr int kRingBytes = WARPGROUPS * kTransposedTileBytes;
  __host__ __device__ static constexpr int ScalesBytes(int rows_per_cta) { return (rows_per_cta * 4 + 1023) / 1024 * 1024; }
  __host__ __device__ static constexpr int FixedBytes(int rows_per_cta) {
    return kDigitsBytes + 1024 + ScalesBytes(rows_per_cta) + kRingBytes;  // state padded to 1024
  }
};
static_assert(TransposedSmem<false, false, 4>::kStateBytes <= 1024, "the state fits its 1024 bytes");
static_assert(TransposedSmem<false, true, kTransposedWarpgroups>::kDigitsBytes % 1024 == 0, "the state stays 1024-byte aligned");

template <int BASE, bool PACKED, int WALK>
__global__ void __launch_bounds__(128 * TransposedWarpgroups(WALK, BASE), 1) MarkovWalkTransposedKernel(const WalkArgs a) {
  constexpr bool GENERAL = WALK != kPlainWalk;  // the general epilogue
  constexpr bool SAMPLED = WALK == kSampledWalk || WALK == kRotatedSampledWalk;
  constexpr bool ROTATED = WALK == kRotatedSampledWalk;  // see DigitLayout
  static_assert(!(ROTATED && PACKED), "the rotated order is the unpacked layout's");
  constexpr int kWarpgroups = TransposedWarpgroups(WALK, BASE);
  static_assert(!ROTATED || kWarpgroups == kTransposedWarpgroups, "the rotated order is laid out for three warpgroups");
  constexpr int kThreads = 128 * kWarpgroups;
  using Digits = DigitLayout<PACKED, ROTATED>;
  using Layout = TransposedSmem<PACKED, ROTATED, kWarpgroups>;
  constexpr int kBlocks = PACKED ? 1 : 2;  // A operands
  constexpr int kRequests = PACKED ? 1 : 2;  // requests a thread scores
  constexpr int kWarps = kThreads / 32;
  constexpr int kPerWarp = (kMaxBatch + kWarps - 1) / kWarps;  // requests whose choice a warp fetches
  // Requests whose base logits a thread loads before the MMAs: a sampled walk without PACKED loads
  // request 1's once the accumulators are turned into floats (registers for the noise's chains).
  constexpr int kEarly = SAMPLED && !PACKED ? 1 : kRequests;
  extern __shared__ __align__(1024) unsigned char smem[];
  int8_t* digits = reinterpret_cast<int8_t*>(smem);
  unsigned long long* cta_best = reinterpret_cast<unsigned long long*>(smem + Layout::kDigitsBytes);
  float* unscale = reinterpret_cast<float*>(cta_best + kMaxBatch);
  int* last_out = reinterpret_cast<int*>(unscale + kMaxBatch);
  uint64_t* turn = reinterpret_cast<uint64_t*>(last_out + 4);  // warpgroup wg's turn: turn[wg]
  const int rows_per_cta = a.tiles_per_cta * kTransposedTileRows;
  float* scales = reinterpret_cast<float*>(smem + Layout::kDigitsBytes + 1024);
  int8_t* ring = reinterpret_cast<int8_t*>(smem + Layout::kDigitsBytes + 1024 + Layout::ScalesBytes(rows_per_cta));
  int8_t* resident = ring + Layout::kRingBytes;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = tid >> 7, u = tid & 127;
  const int w = warp & 3, g = lane >> 2, t = lane & 3;
  const int batch = a.batch, steps = a.steps, vocab = a.vocab;
  const int first_tile = blockIdx.x * a.tiles_per_cta;
  const int first_row = first_tile * kTransposedTileRows;
  const int total_tiles = (vocab + kTransposedTileRows - 1) / kTransposedTileRows;
  const int my_tiles = max(0, min(a.tiles_per_cta, total_tiles - first_tile));
  const int my_rows = max(0, min(my_tiles * kTransposedTileRows, vocab - first_row));
  const int n_resident = min(a.resident_tiles, my_tiles);
  const auto RowOf = [&](int local_tile) { return (first_tile + local_tile) * kTransposedTileRows; };
  // This warpgroup's streamed tiles, one periodic sequence over all steps: streamed tile c (counted
  // from 0 at step 0) is local tile first_streamed + (c % n_streamed) x kWarpgroups.
  const int first_streamed = n_resident + ((wg - n_resident) % kWarpgroups + kWarpgroups) % kWarpgroups;
  const int n_streamed = first_streamed < my_tiles ? (my_tiles - 1 - first_streamed) / kWarpgroups + 1 : 0;
  const int8_t* w2 = static_cast<const int8_t*>(a.w2);
  int8_t* slot = ring + wg * kTransposedTileBytes;
  const auto CopyStreamed = [&](int c) {
    if (c < n_streamed * steps) CopyTransposedTile(w2, vocab, RowOf(first_streamed + (c % n_streamed) * kWarpgroups), slot, u);
    CpAsyncCommit();
  };

  Stamp(a, 0, 0);
  if (tid < kWarpgroups) {  // a turn is given by lane 0 of each of the predecessor's warps
    MbarrierInit(&turn[tid], 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the turns made before any other shared-memory write (racecheck pairs them otherwise)
  // Requests past the batch keep zero digits (their sums are zero and never published).
  for (int i = tid; i < Layout::kDigitsBytes / 16; i += kThreads) reinterpret_cast<uint4*>(digits)[i] = make_uint4(0, 0, 0, 0);
  for (int b = tid; b < kMaxBatch; b += kThreads) cta_best[b] = 0;
  // Everything that does not depend on the walk starts moving now: step 0's base logits (to L2), the
  // resident tiles (warpgroup w copies tiles w, w + kWarpgroups, ...), then each warpgroup's first
  // streamed tile.
  if (my_tiles > 0) PrefetchBaseLogits<kThreads>(a, first_row, my_rows, 0);
  for (int i = wg; i < n_resident; i += kWarpgroups) {
    CopyTransposedTile(w2, vocab, RowOf(i), resident + size_t(i) * kTransposedTileBytes, u);
  }
  CpAsyncCommit();
  CopyStreamed(0);
  for (int i = tid; i < rows_per_cta; i += kThreads) scales[i] = i < my_rows ? __ldg(a.scale + first_row + i) : 0.0f;
  __syncthreads();  // the zeroed digits before any warp writes its requests' digits

  Stamp(a, 0, 1);
  Stamp(a, 0, 2);
  int consumed = 0;  // streamed tiles this warpgroup has scored
  uint32_t turns = 0;  // turns this warpgroup has waited for (the parity of the next phase of turn[wg])
  // The direct exchange (slots[(k * batch + b) * grid + cta]): only CTA 0 gathers the last step's keys
  // (it writes the tokens); the other CTAs stop once they have published it.
  const bool direct = gridDim.x <= kDirectMaxCtas;
  const int last = direct && blockIdx.x != 0 ? steps - 1 : steps;
  for (int k = 0; k <= last; ++k) {
    if (k > 0) {
      Stamp(a, k, 0);
      if (k < steps && my_tiles > 0) PrefetchBaseLogits<kThreads>(a, first_row, my_rows, k);
      Stamp(a, k, 1);
      // Atomic exchange: every CTA's step k-1 keys are in once all have arrived (the direct one waits
      // for the keys themselves below).
      if (!direct) {
        WaitForArrivals(a, k, tid);
        __syncthreads();
      }
      Stamp(a, k, 2);
    }

    // 1. Step k-1's choices (warp w: requests w, w + kWarps, ...): their keys, then their W1 rows, each
    //    in one batch of loads, then e's digits.
    {
      int row[kPerWarp];
      if (k == 0) {
#pragma unroll
        for (int p = 0; p < kPerWarp; ++p) row[p] = a.anchor[min(warp + p * kWarps, batch - 1)];
      } else {
        if (direct) {
          GatherChoices(a.slots + size_t(k - 1) * batch * gridDim.x, warp, kWarps, batch, lane, row);
        } else {
          FetchChoices(a.slots, k - 1, warp, kWarps, batch, row);
        }
        if (a.d2t != nullptr) DraftToTarget(a.d2t, row);
        if (blockIdx.x == 0 && lane == 0) WriteTokens(a.tokens, batch, steps, k, warp, kWarps, row);
      }
      if (k < steps) {
        uint4 w1_raw[kPerWarp][2];
        LoadW1Rows(a, row, lane, w1_raw);
#pragma unroll
        for (int p = 0; p < kPerWarp; ++p) {
          const int b = warp + p * kWarps;
          if (b < batch) BuildTwoDigits<Digits>(a, b, k, lane, w1_raw[p], digits, unscale);
        }
      }
    }
    if (k == steps) {
      Stamp(a, k, 3);
      break;
    }
    // Step 0: the resident tiles have landed (this thread's copies, then everyone's).
    if (k == 0) CpAsyncWaitPending(1);
    FenceSharedForAsyncProxy();  // the digits (and resident tiles) are read by the tensor cores
    __syncthreads();
    Stamp(a, k, 3);

    // 2. Score this warpgroup's tiles: a thread's best (value, row) for requests 16 w + g + 8 r
    //    (PACKED: request 8 w + g; ROTATED: 8 ((w + wg) % 4) + g + 32 r) over its rows 16 t .. 16 t + 15
    //    of each tile.
    const auto RequestOf = [&](int r) { return Digits::Request(w, wg, g, r); };
    // A warp whose requests all lie past the batch (its first, request RequestOf(0) - g, does) joins its
    // warpgroup's wgmmas only.
    const bool warp_idle = RequestOf(0) - g >= batch;
    float best_value[kRequests];
    int best_row[kRequests];
    float unscale_of[kRequests];
    size_t base_offset[kRequests];  // also the logits' (both [B, K, V])
    float inv_t[kRequests];  // SAMPLED: 1 / T of a sampled request, 0 for a greedy one or one past the batch
    uint32_t key0[kRequests], key1[kRequests], position[kRequests];  // SAMPLED: its Philox key and counter
#pragma unroll
    for (int r = 0; r < kRequests; ++r) {
      best_value[r] = -INFINITY;
      best_row[r] = 0;
      const int rq = min(RequestOf(r), batch - 1);
      unscale_of[r] = unscale[rq] * a.logit_scale;
      base_offset[r] = (size_t(rq) * steps + k) * vocab;
      if constexpr (SAMPLED) {
        const float temp = a.temperature[rq];
        inv_t[r] = temp > 0.0f && RequestOf(r) < batch ? 1.0f / temp : 0.0f;
        key0[r] = a.key[2 * rq];
        key1[r] = a.key[2 * rq + 1];
        position[r] = uint32_t(a.position[rq]) + uint32_t(k);
      }
    }
    // The warpgroups issue their tiles' wgmmas in turn (warpgroup 0, 1, ..., then 0 again for its next
    // tile), each once its predecessor's are issued, so that the tensor cores finish one warpgroup's
    // tile before the next one's and its epilogue overlaps the others' wgmmas; a warpgroup whose
    // tiles run out one round early passes the turn on once more. Round r of warpgroup wg waits for
    // the next phase of turn[wg] (not at round 0 of warpgroup 0), and each of its warps then arrives at
    // its successor's (not at the last round of the last warpgroup), so every turn's phases match its
    // waits each step.
    const int rounds = (my_tiles + kWarpgroups - 1) / kWarpgroups;
    const auto WaitTurn = [&](int round) {
      if (wg > 0 || round > 0) MbarrierWait(&turn[wg], turns++ & 1);
    };
    const auto PassTurn = [&](int round) {
      if ((wg < kWarpgroups - 1 || round < rounds - 1) && lane == 0) MbarrierArrive(&turn[(wg + 1) % kWarpgroups]);
    };
    for (int i = wg; i < my_tiles; i += kWarpgroups) {
      const int row0 = RowOf(i);
      const int round = i / kWarpgroups;
      // The tile's base logits of this thread's rows, loaded while the MMAs run.
      const int thread_row0 = row0 + 16 * t;
      const bool whole = row0 + kTransposedTileRows <= vocab;
      BasePairBits<BASE> base[kEarly][8];
      if (!warp_idle) {
#pragma unroll
        for (int r = 0; r < kEarly; ++r) LoadThreadBase<BASE>(a, base_offset[r], thread_row0, whole, base[r]);
      }
      const bool streamed = i >= n_resident;
      const int8_t* tile = streamed ? slot : resident + size_t(i) * kTransposedTileBytes;
      if (streamed) {
        CpAsyncWaitPending(0);
        FenceSharedForAsyncProxy();
        asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
      }
      int acc[kBlocks][32];
      // The A operands of k-slab s, from row 0 (ROTATED: row 16 wg). A rotated descriptor is one made
      // here plus a constant: the asm hides where its shift comes from, so that the compiler neither
      // holds all sixteen in ordinary registers through the epilogue (it cannot tell that wg is uniform,
      // and the noise's chains spilled) nor needs a copy of the wgmmas per warpgroup (which it
      // serializes: each wgmma waited for the one before).
      uint32_t a_shift = 32 * 16 * wg;  // bytes
      if constexpr (ROTATED) asm volatile("" : "+r"(a_shift));
      const uint64_t rotated_desc = WgmmaDescriptor(digits + a_shift, 128, 256);
      const auto ADesc = [&](int d, int s) {
        const int offset = d * Digits::kOperandBytes + s * Digits::kSlabBytes;
        return ROTATED ? rotated_desc + uint64_t(offset >> 4) : WgmmaDescriptor(digits + offset, 128, 256);
      };
      WaitTurn(round);
      WgmmaFence();
#pragma unroll
      for (int d = 0; d < kBlocks; ++d) {
#pragma unroll
        for (int s = 0; s < kRank / 32; ++s) WgmmaS8(acc[d], ADesc(d, s), WgmmaDescriptor(tile + s * 2048, 128, 256), s > 0);
      }
      WgmmaCommit();
      PassTurn(round);
      WgmmaWaitGroup<0>();
#pragma unroll
      for (int d = 0; d < kBlocks; ++d) {
#pragma unroll
        for (int e = 0; e < 32; ++e) asm volatile("" : "+r"(acc[d][e])::"memory");
      }
      if (streamed) {
        // Every warp's wgmmas have read the slot: the warpgroup's next streamed tile goes in.
        asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
        CopyStreamed(++consumed);
      }
      // l = base + (scale x dot) x unscale x logit_scale, rounded as MarkovWalkKernel rounds it; -inf
      // at and past vocab_size (only a tile that reaches vocab_size checks). The rows of a thread come
      // in increasing order, so a strictly larger value (or the first NaN) replaces its best: the
      // lowest index wins ties, as SPEC.md's argmax.
      // scale x dot of accumulator pair j's value e (request e / 2, row 2 j + e % 2 of the thread's 16):
      // the digits' sums are (operand 1, 0) at accumulator e, or (PACKED) accumulators e + 2, e.
      const auto ScaledDot = [&](int j, int e) {
        const float2 sc = *reinterpret_cast<const float2*>(&scales[i * kTransposedTileRows + 16 * t + 2 * j]);
        const int high = PACKED ? acc[0][4 * j + e + 2] : acc[kBlocks - 1][4 * j + e];
        // The digits' sums as one exact int32 (|high| < 2^21, |low| < 2^22), rounded to a float once.
        const float dot = __int2float_rn(high * 256 + acc[0][4 * j + e]);
        return (e % 2 ? sc.y : sc.x) * dot;
      };
      const auto Epilogue = [&](auto partial) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2 * kRequests; ++e) {
            const int r = e / 2, row = thread_row0 + 2 * j + e % 2;
            float l = __fmaf_rn(ScaledDot(j, e), unscale_of[r], BasePairValue<BASE>(base[r][j], e % 2));
            if (decltype(partial)::value && row >= a.vocab_size) l = -INFINITY;
            if (!(l <= best_value[r]) && best_value[r] == best_value[r]) {
              best_value[r] = l;
              best_row[r] = row;
            }
          }
        }
      };
      // GENERAL: request r's l rounded to the logits dtype OUT (kNone: no logits out) and stored, and
      // its score (sampled: l / T + g, g made here for rows 4 q .. 4 q + 3 at once), from base[r], or for
      // r >= kEarly from `late` (loaded once the accumulators are floats, before request 0's noise).
      const auto GeneralEpilogue = [&](auto partial, auto out) {
        constexpr int kOut = decltype(out)::value;
        // scale x dot of every value first: the digits' accumulators (64 registers unpacked) are free
        // before the noise's chains need registers.
        float scaled_dot[kRequests][16];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2 * kRequests; ++e) scaled_dot[e / 2][2 * j + e % 2] = ScaledDot(j, e);
        }
        BasePairBits<BASE> late[8];
        if constexpr (kEarly < kRequests) LoadThreadBase<BASE>(a, base_offset[kEarly], thread_row0, whole, late);
#pragma unroll
        for (int r = 0; r < kRequests; ++r) {
          const BasePairBits<BASE>(&base_r)[8] = r < kEarly ? base[r < kEarly ? r : 0] : late;
          const bool sampled = SAMPLED && inv_t[r] > 0.0f;
          uint32_t bits[kOut == kF32 ? 16 : 8];
          float gumbel[4];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (sampled && j % 2 == 0) {
              uint32_t k0[4], k1[4], v[4], p[4];
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                k0[c] = key0[r];
                k1[c] = key1[r];
                v[c] = uint32_t(thread_row0 + 2 * j + c);
                p[c] = position[r];
              }
              GumbelNoise<4, true>(k0, k1, v, p, gumbel);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = thread_row0 + 2 * j + h;
              float l = __fmaf_rn(scaled_dot[r][2 * j + h], unscale_of[r], BasePairValue<BASE>(base_r[j], h));
              if (decltype(partial)::value && row >= a.vocab_size) l = -INFINITY;
              if constexpr (kOut != kNone) {
                uint32_t b;
                l = StoreRoundedAs<kOut>(nullptr, 0, l, false, &b);
                if constexpr (kOut == kF32) {
                  bits[2 * j + h] = b;
                } else {
                  bits[j] = h ? bits[j] | (b << 16) : b;
                }
              }
              const float score = sampled ? __fadd_rn(__fmul_rn(l, inv_t[r]), gumbel[2 * (j % 2) + h]) : l;
              if (!(score <= best_value[r]) && best_value[r] == best_value[r]) {
                best_value[r] = score;
                best_row[r] = row;
              }
            }
          }
          if constexpr (kOut != kNone) {
            if (RequestOf(r) < batch) StoreThreadLogits<kOut>(a, base_offset[r], thread_row0, bits);
          }
        }
      };
      const auto GeneralFor = [&](auto partial) {
        // kLogitsWalk always has logits out (KernelFor), but without its kNone copy it ran 1.3-1.5 %
        // slower (Session 20's A/B at B = 64).
        if (a.logits == nullptr) {
          GeneralEpilogue(partial, std::integral_constant<int, kNone>());
        } else if (a.logits_dtype == kBF16) {
          GeneralEpilogue(partial, std::integral_constant<int, kBF16>());
        } else if (a.logits_dtype == kF16) {
          GeneralEpilogue(partial, std::integral_constant<int, kF16>());
        } else {
          GeneralEpilogue(partial, std::integral_constant<int, kF32>());
        }
      };
      if constexpr (GENERAL) {
        if (!warp_idle && row0 + kTransposedTileRows > a.vocab_size) {
          GeneralFor(std::true_type());
        } else if (!warp_idle) {
          GeneralFor(std::false_type());
        }
      } else {
        if (!warp_idle && row0 + kTransposedTileRows > a.vocab_size) {
          Epilogue(std::true_type());
        } else if (!warp_idle) {
          Epilogue(std::false_type());
        }
      }
    }
    if (wg + (rounds - 1) * kWarpgroups >= my_tiles && rounds > 0) {  // no tile in the last round
      WaitTurn(rounds - 1);
      PassTurn(rounds - 1);
    }
    StampWarp(a, k, warp);

    // 3. Reduce over the 4 lanes that share g, then across warpgroups in shared memory.
#pragma unroll
    for (int r = 0; r < kRequests; ++r) {
      unsigned long long key = PackArgmaxKey(best_value[r], uint32_t(best_row[r]));
#pragma unroll
      for (int m = 1; m < 4; m <<= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, m);
        key = other > key ? other : key;
      }
      const int rq = RequestOf(r);
      if (t == 0 && rq < batch && my_tiles > 0) atomicMax(&cta_best[rq], key);
    }
    __syncthreads();
    Stamp(a, k, 4);

    // 4. Publish one key per request (and arrive, atomic exchange), as MarkovWalkKernel does.
    PublishKeys(a, k, direct, batch, steps, cta_best, tid);
    Stamp(a, k, 5);
  }

  // The workspace is left zeroed for the next call on this stream, as MarkovWalkKernel leaves it
  // (written out here: as a shared function it changed MarkovWalkKernel's register allocation). Direct:
  // each CTA cleared its slots of step k - 2 when it published step k, and CTA 0, having gathered the
  // last step's keys (so every CTA is done reading the last two steps'), clears those. Atomic: the
  // last CTA out clears the keys and the counters.
  CpAsyncWaitPending(0);  // no copy in flight when the CTA exits
  if (direct) {
    if (blockIdx.x == 0) {
      __syncthreads();
      unsigned long long* first = a.slots + size_t(max(0, steps - 2)) * batch * gridDim.x;
      for (int i = tid; i < (steps - max(0, steps - 2)) * batch * int(gridDim.x); i += kThreads) first[i] = 0;
    }
    return;
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *last_out = atomicAdd(&a.counters[1], 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (*last_out) {
    for (int i = tid; i < steps * batch; i += kThreads) a.slots[AtomicKey(i / batch, i % batch)] = 0;
    if (tid == 0) {
      a.counters[0] = 0;
      a.counters[1] = 0;
    }
  }
}

}  // namespace walk
}  // namespace jax_markov
