// MarkovWalkTransposedKernel: walks of 17 to 64 requests over int8 W2, and of 9-16 from bf16 base logits and
// a head with tiles (docs/kernel_design.md sections 5 and 8). Greedy walks with no logits out take
// the plain instance (kPlainWalk); greedy walks with logits out and sampled walks take the general epilogue
// (kLogitsWalk, kSampledWalk, kRotatedSampledWalk). A CertifiedMarkovHead's greedy walks of 17-64
// requests take the plain epilogue and an exact round each step (kCertifiedWalk, certified.cuh).
// - The roles of MarkovWalkKernel's wgmma are swapped: A = e, as two int8 digits per request
//   (E = rint(e 2^shift) = d0 + 2^8 d1, max |E| in [2^13, 2^14): fixed point at 2^-14 of the largest
//   element, where the fp16 e of MarkovWalkKernel holds a bf16 W1 exactly; the bias errs by up to
//   about 2e-4 of its rms, tokens differ only at near-ties), one 64-row operand per digit with M row =
//   request (PACKED, up to 32 requests: one operand for both digits, M row 16 (b / 8) + b % 8 + 8 d,
//   half the MMAs); B = a tile of 64 W2 rows, int8 as stored, in shared memory. wgmma m64n64k32 s8
//   needs no conversion of W2 and no A registers, and a thread's accumulators cover 2 requests x 16
//   rows (PACKED: both digits of one request), so it keeps 2 best candidates.
// - Three warpgroups (four in the plain walk over 16-bit base logits: TransposedWarpgroups) share a
//   CTA's tiles round-robin and issue their wgmmas in turn, so that the tensor cores can finish one
//   warpgroup's tile before the next one's while its epilogue overlaps the others' wgmmas. Each
//   digit's int32 sums are exact (|sum| < 2^22), and so is high x 256 + low (< 2^31), which one
//   conversion rounds to a float. The first tiles stay resident in shared memory (loaded once); the
//   rest stream from L2 into one slot per warpgroup, a streamed tile ahead. Where the head carries W2
//   stored tile by tile (w2_tiles, in the slot's byte order), a tile lands by one bulk copy that one
//   thread issues and the warpgroup waits for on an mbarrier, and step 0 scores each resident tile as
//   it lands; otherwise the warpgroup copies it 16 bytes a cp.async.
// - A W2 tile holds its rows in the order that gives each thread 16 consecutive rows (TileRow): the
//   thread of column pair t holds rows 16 t .. 16 t + 15 of the tile, so its base logits are one
//   32-byte run a request (two 16-byte loads in bf16, whole sectors), it meets its rows in increasing
//   order, and a sampled request's noise takes one Philox block every four rows.
// - The general epilogue: l is rounded to the logits dtype before it is chosen from (one copy of the
//   epilogue per dtype, picked once a tile) and a thread stores its 16 rows of a request 16 bytes at a
//   time; a sampled request scores l / T + g, its Gumbel noise made in the epilogue, where the
//   integer multiplies take the issue slots that the walk's latencies leave idle.
// - The exchange is MarkovWalkKernel's above kDirectBatch requests: one atomicMax per request and an
//   arrival counter that doubles as the grid barrier.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/smem_layout.h"
#include "common/walk_common.h"
#include "cuda/ptx.cuh"
#include "cuda/transposed/certified.cuh"
#include "cuda/transposed/tiles.cuh"
#include "cuda/values.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/exchange.cuh"
#include "cuda/wgmma.cuh"

namespace jax_markov {
namespace walk {

// The transposed kernel's variants: BASE, the base logits' DType; PACKED, both digits in one A operand
// (up to kPackedMaxBatch requests); WALK, a TransposedWalk. Every knob that follows from them.
template <int BASE_, bool PACKED_, int WALK_>
struct TransposedTraits {
  static constexpr int BASE = BASE_, WALK = WALK_;
  static constexpr bool PACKED = PACKED_;
  static constexpr bool GENERAL = WALK != kPlainWalk && WALK != kCertifiedWalk;  // the general epilogue
  static constexpr bool CERT = WALK == kCertifiedWalk;
  static constexpr bool SAMPLED = WALK == kSampledWalk || WALK == kRotatedSampledWalk;
  static constexpr bool ROTATED = WALK == kRotatedSampledWalk;  // see DigitLayout
  static_assert(!(ROTATED && PACKED), "the rotated order is the unpacked layout's");
  static constexpr int kWarpgroups = TransposedWarpgroups(WALK, BASE);
  static_assert(!ROTATED || kWarpgroups == kTransposedWarpgroups, "the rotated order is laid out for three warpgroups");
  static constexpr int kThreads = 128 * kWarpgroups;
  using Digits = DigitLayout<PACKED, ROTATED>;
  using Layout = TransposedSmem<PACKED, ROTATED, kWarpgroups>;
  static constexpr int kCertBytes = CERT ? TransposedCertSmem::kBytes : 0;  // after the scales
  static constexpr int kBlocks = PACKED ? 1 : 2;  // A operands
  static constexpr int kRequests = PACKED ? 1 : 2;  // requests a thread scores
  // Philox blocks a sampled thread makes at once, their chains in lockstep: two where it scores one
  // request (PACKED); beside the unpacked layout's two requests a second block spilled.
  static constexpr int kNoiseBlocks = PACKED ? 2 : 1;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kPerWarp = (kMaxBatch + kWarps - 1) / kWarps;  // requests whose choice a warp fetches
  // Requests whose base logits a thread loads before the MMAs: a sampled walk without PACKED loads
  // request 1's once the accumulators are turned into floats (registers for the noise's chains).
  static constexpr int kEarly = SAMPLED && !PACKED ? 1 : kRequests;
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) MarkovWalkTransposedKernel(const WalkArgs a) {
  constexpr int BASE = T::BASE;
  constexpr bool PACKED = T::PACKED, GENERAL = T::GENERAL, SAMPLED = T::SAMPLED, ROTATED = T::ROTATED, CERT = T::CERT;
  constexpr int kWarpgroups = T::kWarpgroups, kThreads = T::kThreads, kBlocks = T::kBlocks, kRequests = T::kRequests;
  constexpr int kWarps = T::kWarps, kPerWarp = T::kPerWarp, kEarly = T::kEarly, kNoiseBlocks = T::kNoiseBlocks;
  using Digits = typename T::Digits;
  using Layout = typename T::Layout;
  if (SkipsLaunch(a)) return;
  extern __shared__ __align__(1024) unsigned char smem[];
  int8_t* digits = reinterpret_cast<int8_t*>(smem);
  unsigned long long* cta_best = reinterpret_cast<unsigned long long*>(smem + Layout::kDigitsBytes);
  float* unscale = reinterpret_cast<float*>(cta_best + kMaxBatch);
  int* last_out = reinterpret_cast<int*>(unscale + kMaxBatch);
  uint64_t* turn = reinterpret_cast<uint64_t*>(last_out + 4);  // warpgroup wg's turn: turn[wg]
  uint64_t* landed = turn + 4;  // warpgroup wg's slot holds its bulk copy: landed[wg]
  uint64_t* resident_landed = landed + 4;  // resident tile i has landed by its bulk copy
  const int rows_per_cta = a.tiles_per_cta * kTransposedTileRows;
  float* scales = reinterpret_cast<float*>(smem + Layout::kDigitsBytes + 1024);
  const CertState cert(smem + Layout::kDigitsBytes + 1024 + Layout::ScalesBytes(rows_per_cta));
  int8_t* ring = reinterpret_cast<int8_t*>(smem + Layout::kDigitsBytes + 1024 + Layout::ScalesBytes(rows_per_cta) + T::kCertBytes);
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
  const bool bulk_copies = a.w2_tiles != nullptr;
  // With bulk copies the resident tiles land by one each too, and step 0 scores each as it lands.
  const bool bulk_resident = bulk_copies && n_resident <= Layout::kResidentBarriers;
  // Streamed tile c into the slot; a cp.async group either way, so that step 0's wait for the resident
  // tiles counts the same groups.
  const auto CopyStreamed = [&](int c) {
    if (c < n_streamed * steps) {
      const int tile = first_tile + first_streamed + (c % n_streamed) * kWarpgroups;
      if (!bulk_copies) {
        CopyTransposedTile(w2, vocab, tile * kTransposedTileRows, slot, u);
      } else if (u == 0) {
        MbarrierArriveExpectTx(&landed[wg], kTransposedTileBytes);
        BulkCopyTile(a.w2_tiles, tile, slot, &landed[wg]);
      }
    }
    CpAsyncCommit();
  };

  Stamp(a, 0, 0);
  if (tid < kWarpgroups) {  // a turn is given by lane 0 of each of the predecessor's warps
    MbarrierInit(&turn[tid], 4);
    MbarrierInit(&landed[tid], 1);
  }
  if (tid < Layout::kResidentBarriers) MbarrierInit(&resident_landed[tid], 1);
  if (tid < Layout::kResidentBarriers || tid < kWarpgroups) FenceMbarrierInit();
  __syncthreads();  // the turns made before any other shared-memory write (racecheck pairs them otherwise)
  // Requests past the batch keep zero digits (their sums are zero and never published).
  for (int i = tid; i < Layout::kDigitsBytes / 16; i += kThreads) reinterpret_cast<uint4*>(digits)[i] = make_uint4(0, 0, 0, 0);
  for (int b = tid; b < kMaxBatch; b += kThreads) cta_best[b] = 0;
  // Everything that does not depend on the walk starts moving now: step 0's base logits (to L2), the
  // resident tiles (warpgroup w copies tiles w, w + kWarpgroups, ...), then each warpgroup's first
  // streamed tile.
  if (my_tiles > 0) PrefetchBaseLogits<kThreads>(a, first_row, my_rows, 0);
  for (int i = wg; i < n_resident; i += kWarpgroups) {
    if (!bulk_resident) {
      CopyTransposedTile(w2, vocab, RowOf(i), resident + size_t(i) * kTransposedTileBytes, u);
    } else if (u == 0) {
      MbarrierArriveExpectTx(&resident_landed[i], kTransposedTileBytes);
      BulkCopyTile(a.w2_tiles, first_tile + i, resident + size_t(i) * kTransposedTileBytes, &resident_landed[i]);
    }
  }
  CpAsyncCommit();
  CopyStreamed(0);
  for (int i = tid; i < rows_per_cta; i += kThreads) scales[i] = i < my_rows ? __ldg(a.scale + first_row + i) : 0.0f;
  if constexpr (CERT) CertStart(a, cert, first_row, my_rows, tid, kThreads);
  __syncthreads();  // the zeroed digits before any warp writes its requests' digits
  if constexpr (CERT) CertPublishMaxima(a, cert, tid, kWarps);

  Stamp(a, 0, 1);
  Stamp(a, 0, 2);
  CertTop<kRequests> top;  // CERT: a step's best three scores of each request, for its exact round
  int consumed = 0;  // streamed tiles this warpgroup has scored
  uint32_t turns = 0;  // turns this warpgroup has waited for (the parity of the next phase of turn[wg])
  for (int k = 0; k <= steps; ++k) {
    if (k > 0) {
      Stamp(a, k, 0);
      if (k < steps && my_tiles > 0) PrefetchBaseLogits<kThreads>(a, first_row, my_rows, k);
      Stamp(a, k, 1);
      // Every CTA's step k-1 keys are in once all have arrived.
      WaitForArrivals(a, CERT ? 2 * k - 1 : k, tid);
      __syncthreads();
      Stamp(a, k, 2);
      if constexpr (CERT) {  // step k-1's exact round: its choices are the exact keys
        CertThresholds(a, cert, unscale, k - 1, tid);
        __syncthreads();
        int request[kRequests];
#pragma unroll
        for (int r = 0; r < kRequests; ++r) request[r] = my_tiles > 0 ? Digits::Request(w, wg, g, r) : batch;
        CertListCandidates(a, cert, top, request, tid);
        __syncthreads();
        CertRescore(a, cert, k - 1, first_row, my_rows, my_tiles, kWarpgroups, warp, kWarps, lane);
        __syncthreads();
        CertPublish(a, cert, k - 1, tid);
        __syncthreads();
        Arrive(a, tid);
        WaitForArrivals(a, 2 * k, tid);
        __syncthreads();
      }
    }

    // 1. Step k-1's choices (warp w: requests w, w + kWarps, ...): their keys, then their W1 rows, each
    //    in one batch of loads, then e's digits.
    {
      int row[kPerWarp];
      if (k == 0) {
#pragma unroll
        for (int p = 0; p < kPerWarp; ++p) row[p] = a.anchor[min(warp + p * kWarps, batch - 1)];
      } else {
        FetchChoices(CERT ? a.slots + kCertExactKeys : a.slots, k - 1, warp, kWarps, batch, row);
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
          if (CERT && b < batch) CertRecordE(a, cert, b, row[p], w1_raw[p], lane);
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
      top.second[r] = top.third[r] = -INFINITY;
      top.second_row[r] = 0;
      const int rq = min(RequestOf(r), batch - 1);
      unscale_of[r] = unscale[rq] * a.logit_scale;
      base_offset[r] = (size_t(rq) * steps + k) * vocab;
      if constexpr (SAMPLED) {
        inv_t[r] = RequestOf(r) < batch ? InverseTemperature(a, rq) : -1.0f;
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
      if (streamed && bulk_copies) {
        MbarrierWait(&landed[wg], consumed & 1);
      } else if (!streamed && k == 0 && bulk_resident) {
        MbarrierWait(&resident_landed[i], 0);
      } else if (streamed) {
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
      // lowest index wins ties, as docs/spec.md's argmax.
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
            if constexpr (CERT) {
              KeepThree(l, row, best_value[r], best_row[r], top.second[r], top.second_row[r], top.third[r]);
            } else if (!(l <= best_value[r]) && best_value[r] == best_value[r]) {
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
          const bool sampled = SAMPLED && inv_t[r] >= 0.0f;
          uint32_t bits[kOut == kF32 ? 16 : 8];
          float gumbel[4 * kNoiseBlocks];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (sampled && j % (2 * kNoiseBlocks) == 0) {  // rows 2 j .. 2 j + 4 kNoiseBlocks - 1: a block each 4
              uint32_t k0[kNoiseBlocks], k1[kNoiseBlocks], block[kNoiseBlocks], p[kNoiseBlocks];
#pragma unroll
              for (int n = 0; n < kNoiseBlocks; ++n) {
                k0[n] = key0[r];
                k1[n] = key1[r];
                block[n] = uint32_t(thread_row0 + 2 * j) / 4 + n;
                p[n] = position[r];
              }
              float g4[kNoiseBlocks][4];
              GumbelNoiseBlock<kNoiseBlocks, true>(k0, k1, block, p, g4);
#pragma unroll
              for (int c = 0; c < 4 * kNoiseBlocks; ++c) gumbel[c] = g4[c / 4][c % 4];
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
              const float score = sampled ? SampledScore(l, inv_t[r], gumbel[2 * (j % (2 * kNoiseBlocks)) + h]) : l;
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
        // kLogitsWalk always has logits out (the plan), but without its kNone copy it ran 1.3-1.5 %
        // slower at B = 64.
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
      top.best[r] = best_value[r];
      top.best_row[r] = best_row[r];
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

    // 4. Publish one key per request and arrive, as MarkovWalkKernel does.
    PublishKeys(a, k, false, batch, steps, cta_best, tid);
    Stamp(a, k, 5);
  }

  // The last CTA out leaves the workspace zeroed for the next call on this stream, as MarkovWalkKernel's
  // atomic exchange does (written out there: as a shared function it changed MarkovWalkKernel's
  // register allocation).
  CpAsyncWaitPending(0);  // no copy in flight when the CTA exits
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *last_out = atomicAdd(&a.counters[1], 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (*last_out) {
    for (int i = tid; i < steps * batch; i += kThreads) a.slots[AtomicKey(i / batch, i % batch)] = 0;
    if constexpr (CERT) CertClearWorkspace(a, tid, kThreads);
    if (tid == 0) {
      a.counters[0] = 0;
      a.counters[1] = 0;
    }
  }
}

}  // namespace walk
}  // namespace jax_markov
