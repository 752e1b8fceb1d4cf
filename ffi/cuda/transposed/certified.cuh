// The certified walk of a CertifiedMarkovHead in the transposed kernel (kCertifiedWalk: 17-64 greedy
// requests, tokens only): int8 W2 scores every column as the plain walk does, and each step's choice is
// the one the unquantized head's walk makes (ffi/cpu/certified.h is the CPU form of the same rule).
// Above 16 requests nearly every step has a decision that the int8 keys cannot certify
// (docs/kernel_design.md section 13), so every step takes the exact round, with no certificate:
// - The atomic exchange gives every CTA request b's int8 winner a, key y_a. Every CTA works out the
//   same margin M (cuda/certificate.cuh, with the head's largest scale and residual norm, which the
//   CTAs gather by atomicMax at launch start) and T' = CertThreshold(y_a, M): the exact choice's exact
//   logit is at least T', and a column whose key y has up(y) = CertUpper(y, M) below T' is not it.
// - A thread keeps, of each of its requests, its best and second-best rows and its third-best score
//   (KeepThree): where the third's up() reaches T' (or a candidate's score is -inf, its row unknown),
//   the thread's every row of that request is re-scored; otherwise the rows of the best and second
//   whose up() reaches T' (the winner's among them). A CTA's rows to re-score go to a list in shared
//   memory, a thread's every row as one entry; where T' is -inf or the list is full, the CTA re-scores
//   its every row of the request.
// - Each CTA's largest exact key of each request goes to the request's exact key by atomicMax, and the
//   CTAs arrive once more: the exact keys are the step's choices.
// The arrivals: step k's int8 keys are arrival 2k + 1 of each CTA, its exact keys 2k + 2.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/smem_layout.h"
#include "common/walk_common.h"
#include "cuda/certificate.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/operands.cuh"

namespace jax_markov {
namespace walk {

// A thread's best, second-best and third-best scores of each of its R requests, with the rows of the
// first two, kept from one step's scoring to its exact round.
template <int R>
struct CertTop {
  float best[R], second[R], third[R];
  int best_row[R], second_row[R];
};

// The epilogue's choice of a request's best (a strictly larger value, or the first NaN, replaces it:
// the lowest row wins ties, the rows coming in increasing order), keeping the second and third by the
// same rule: every other row's score is at most the third's, or is NaN where the third is.
__device__ __forceinline__ void KeepThree(float l, int row, float& best, int& best_row, float& second, int& second_row,
                                          float& third) {
  if (!(l <= best) && best == best) {
    third = second;
    second = best;
    second_row = best_row;
    best = l;
    best_row = row;
  } else if (!(l <= second) && second == second) {
    third = second;
    second = l;
    second_row = row;
  } else if (!(l <= third) && third == third) {
    third = l;
  }
}

// The state (TransposedCertSmem) at `cert`.
struct CertState {
  unsigned long long* exact;
  float2* norms;
  float* margin;
  float* threshold;
  int* w1_row;
  unsigned* rescored;
  unsigned long long* all;
  int* count;
  unsigned* maxima;
  int2* list;
  __device__ explicit CertState(unsigned char* cert)
      : exact(reinterpret_cast<unsigned long long*>(cert + TransposedCertSmem::kExact)),
        norms(reinterpret_cast<float2*>(cert + TransposedCertSmem::kNorms)),
        margin(reinterpret_cast<float*>(cert + TransposedCertSmem::kMargin)),
        threshold(reinterpret_cast<float*>(cert + TransposedCertSmem::kThreshold)),
        w1_row(reinterpret_cast<int*>(cert + TransposedCertSmem::kW1Row)),
        rescored(reinterpret_cast<unsigned*>(cert + TransposedCertSmem::kRescored)),
        all(reinterpret_cast<unsigned long long*>(cert + TransposedCertSmem::kAll)),
        count(reinterpret_cast<int*>(cert + TransposedCertSmem::kCount)),
        maxima(reinterpret_cast<unsigned*>(cert + TransposedCertSmem::kMaxima)),
        list(reinterpret_cast<int2*>(cert + TransposedCertSmem::kList)) {}
};

// Launch start, before the CTA's barrier: the state zeroed, and each warp's largest W2 scale and
// residual norm over the CTA's rows (as bits: both are never negative, and a NaN or negative one
// reads as unusable) in maxima.
__device__ __forceinline__ void CertStart(const WalkArgs& a, const CertState& c, int first_row, int my_rows, int tid,
                                          int threads) {
  for (int b = tid; b < kMaxBatch; b += threads) {
    c.exact[b] = 0;
    c.rescored[b] = 0;
  }
  if (tid == 0) {
    *c.all = 0;
    *c.count = 0;
  }
  uint32_t s_bits = 0, r_bits = 0;
  for (int i = tid; i < my_rows; i += threads) {
    s_bits = max(s_bits, __float_as_uint(__ldg(a.scale + first_row + i)));
    r_bits = max(r_bits, __float_as_uint(__ldg(a.residual_norm + first_row + i)));
  }
  s_bits = __reduce_max_sync(0xffffffffu, s_bits);
  r_bits = __reduce_max_sync(0xffffffffu, r_bits);
  if ((tid & 31) == 0) {
    c.maxima[2 * (tid >> 5)] = s_bits;
    c.maxima[2 * (tid >> 5) + 1] = r_bits;
  }
}

// After the CTA's barrier: the CTA's maxima into the head's by atomicMax (each lands before the CTA
// arrives at step 0's exchange, so that every CTA reads the head's after it).
__device__ __forceinline__ void CertPublishMaxima(const WalkArgs& a, const CertState& c, int tid, int warps) {
  if (tid != 0) return;
  uint32_t s_bits = 0, r_bits = 0;
  for (int w = 0; w < warps; ++w) {
    s_bits = max(s_bits, c.maxima[2 * w]);
    r_bits = max(r_bits, c.maxima[2 * w + 1]);
  }
  atomicMax(&a.slots[kCertMaxima], static_cast<unsigned long long>(s_bits));
  atomicMax(&a.slots[kCertMaxima + kKeyStride], static_cast<unsigned long long>(r_bits));
}

// Request b's W1 row of the step being built and e's norms, by the warp that builds its digits: the
// step's exact round reads them.
__device__ __forceinline__ void CertRecordE(const WalkArgs& a, const CertState& c, int b, int row, const uint4 (&raw)[2],
                                            int lane) {
  float e[8];
  RowFloats(a.w1_dtype, raw, e);
  const float2 norms = CertNorms(e);
  if (lane == 0) {
    c.norms[b] = norms;
    c.w1_row[b] = ClampIndex(row, a.v_target);
  }
}

// Lane L's e[8L .. 8L+7] of request r's step, from its W1 row.
__device__ __forceinline__ void CertE(const WalkArgs& a, const CertState& c, int r, int lane, float (&e)[8]) {
  const int row[1] = {c.w1_row[r]};
  uint4 raw[1][2];
  raw[0][1] = make_uint4(0, 0, 0, 0);
  LoadW1Rows(a, row, lane, raw);
  RowFloats(a.w1_dtype, raw[0], e);
}

// 1. Threads b < batch, once step k's int8 keys are in: request b's margin and T'. unscale: the step's
// 2^-sigma of each request. CTA 0 counts the decisions (each takes the exact round).
__device__ __forceinline__ void CertThresholds(const WalkArgs& a, const CertState& c, const float* unscale, int k, int tid) {
  if (tid >= a.batch) return;
  const unsigned long long key = __ldcg(&a.slots[AtomicKey(k, tid)]);
  const uint32_t s_bits = uint32_t(__ldcg(&a.slots[kCertMaxima])), r_bits = uint32_t(__ldcg(&a.slots[kCertMaxima + kKeyStride]));
  const float margin = CertMarginOf(c.norms[tid], unscale[tid], a.logit_scale, __uint_as_float(s_bits), __uint_as_float(r_bits),
                                    s_bits <= 0x7f7fffffu && r_bits <= 0x7f7fffffu);
  const float y = KeyScore(key);
  c.margin[tid] = margin;
  const float threshold = fabsf(y) < INFINITY && margin < INFINITY ? CertThreshold(y, margin, kF32) : -INFINITY;
  c.threshold[tid] = threshold;
  if (!(threshold > -INFINITY)) atomicOr(c.all, 1ull << tid);
  if (a.cert_stats != nullptr && blockIdx.x == 0) {
    atomicAdd(&a.cert_stats[kCertDecisions], 1ull);
    atomicAdd(&a.cert_stats[kCertExactRounds], 1ull);
    if (!(margin < INFINITY)) atomicAdd(&a.cert_stats[kCertUncertified], 1ull);
  }
}

// 2. Each thread with rows, after the thresholds' barrier: its rows of request request[r] that the
// bounds cannot rule out, listed as (request, row), or as (request, -1 - tid) for its every row; or the
// request marked for every row of the CTA.
template <int R>
__device__ __forceinline__ void CertListCandidates(const WalkArgs& a, const CertState& c, const CertTop<R>& top,
                                                   const int (&request)[R], int tid) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int rq = request[r];
    if (rq >= a.batch) continue;
    const float m = c.margin[rq], threshold = c.threshold[rq];
    if (!(threshold > -INFINITY)) continue;  // the CTA's every row (CertThresholds marked it)
    bool first = !(CertUpper(top.best[r], m, kF32) < threshold);
    bool second = !(CertUpper(top.second[r], m, kF32) < threshold);
    const bool every = !(CertUpper(top.third[r], m, kF32) < threshold) || (first && top.best[r] == -INFINITY) ||
                       (second && top.second[r] == -INFINITY);
    if (every) {
      first = true;
      second = false;
      if (a.cert_stats != nullptr) atomicAdd(&a.cert_stats[kCertLaneFallbacks], 1ull);
    }
    if (!first && !second) continue;
    const int n = int(first) + int(second);
    const int at = atomicAdd(c.count, n);
    if (at + n <= TransposedCertSmem::kListCapacity) {
      if (first) c.list[at] = make_int2(rq, every ? -1 - tid : top.best_row[r]);
      if (second) c.list[at + int(first)] = make_int2(rq, top.second_row[r]);
    } else {
      atomicOr(c.all, 1ull << rq);
    }
  }
}

// The largest exact key of request r's rows RowAt(m) for m below count, kRescoreRows at a time: groups
// first, first + stride, ... of kRescoreRows (rows of -inf base read no W2 row where the margin is
// finite).
template <class RowAt>
__device__ __forceinline__ unsigned long long ExactKeysOfRows(const WalkArgs& a, const CertState& c, int r, int k, const float (&e)[8],
                                                              int count, int first, int stride, RowAt row_at, int lane,
                                                              int& read) {
  constexpr int kRescoreRows = 4;
  const bool skip_masked = c.margin[r] < INFINITY;
  unsigned long long best = 0;
  for (int m0 = first * kRescoreRows; m0 < count; m0 += stride * kRescoreRows) {
    int cols[kRescoreRows];
#pragma unroll
    for (int j = 0; j < kRescoreRows; ++j) cols[j] = m0 + j < count ? row_at(m0 + j) : -1;
    const unsigned long long key = skip_masked ? ExactKeys<kRescoreRows, true>(a, a.vocab, a.steps, r, k, e, cols, lane, false, read)
                                               : ExactKeys<kRescoreRows, false>(a, a.vocab, a.steps, r, k, e, cols, lane, false, read);
    best = key > best ? key : best;
  }
  return best;
}

// 3. Every warp, after the list's barrier: the exact keys of the listed rows (a warp an entry: one row,
// or a thread's every row, 16 of each of its warpgroup's tiles) and of every row of the CTA for the
// marked requests, each request's largest into exact, the rows read into rescored. The CTA's tiles
// are local tiles 0 .. my_tiles - 1 from first_row, warpgroup j's those from j on, `warpgroups` apart.
__device__ __forceinline__ void CertRescore(const WalkArgs& a, const CertState& c, int k, int first_row, int my_rows, int my_tiles,
                                            int warpgroups, int warp, int warps, int lane) {
  const unsigned long long all = *c.all;
  const auto Fold = [&](int r, unsigned long long best, int read) {
    if (lane == 0) {
      atomicMax(&c.exact[r], best);
      atomicAdd(&c.rescored[r], unsigned(read));
    }
  };
  const int n = min(*c.count, TransposedCertSmem::kListCapacity);
  for (int i = warp; i < n; i += warps) {
    const int2 entry = c.list[i];
    const int r = entry.x;
    if ((all >> r) & 1ull) continue;  // re-scored below with the request's every row
    float e[8];
    CertE(a, c, r, lane, e);
    unsigned long long best;
    int read = 0;
    if (entry.y >= 0) {
      const int cols[1] = {entry.y};
      best = ExactKeys<1, false>(a, a.vocab, a.steps, r, k, e, cols, lane, false, read);
    } else {
      const int thread = -1 - entry.y, wg = thread >> 7, t = thread & 3;
      const int rows = 16 * ((my_tiles - wg + warpgroups - 1) / warpgroups);  // 16 a tile of the warpgroup's
      const auto RowAt = [&](int m) { return first_row + (wg + (m >> 4) * warpgroups) * kTransposedTileRows + 16 * t + (m & 15); };
      best = ExactKeysOfRows(a, c, r, k, e, rows, 0, 1, RowAt, lane, read);
    }
    Fold(r, best, read);
  }
  for (unsigned long long left = all; left != 0; left &= left - 1) {
    const int r = __ffsll(static_cast<long long>(left)) - 1;
    float e[8];
    CertE(a, c, r, lane, e);
    int read = 0;
    const auto RowAt = [&](int m) { return first_row + m; };
    const unsigned long long best = ExactKeysOfRows(a, c, r, k, e, my_rows, warp, warps, RowAt, lane, read);
    Fold(r, best, read);
  }
}

// 4. Threads b < batch, after the re-scoring's barrier: request b's exact key of the CTA into the
// step's by atomicMax (a CTA with none publishes nothing; the winner's CTA always has one), the
// counts into the stats, the state cleared for the next step. The caller then arrives.
__device__ __forceinline__ void CertPublish(const WalkArgs& a, const CertState& c, int k, int tid) {
  if (tid == 0) {
    *c.all = 0;
    *c.count = 0;
  }
  if (tid >= a.batch) return;
  const unsigned long long exact = c.exact[tid];
  if (exact != 0) atomicMax(&a.slots[kCertExactKeys + AtomicKey(k, tid)], exact);
  c.exact[tid] = 0;
  const unsigned rescored = c.rescored[tid];
  c.rescored[tid] = 0;
  if (a.cert_stats != nullptr && rescored != 0) {
    atomicAdd(&a.cert_stats[kCertRescored], (unsigned long long)rescored);
    atomicMax(&a.cert_stats[kCertMaxCtaRescored], (unsigned long long)rescored);
    atomicAdd(&a.cert_stats[kCertCtaSets], 1ull);
  }
}

// The last CTA out: the exact keys and the head's maxima left zeroed for the next call.
__device__ __forceinline__ void CertClearWorkspace(const WalkArgs& a, int tid, int threads) {
  for (int i = tid; i < a.steps * a.batch; i += threads) a.slots[kCertExactKeys + AtomicKey(i / a.batch, i % a.batch)] = 0;
  if (tid == 0) {
    a.slots[kCertMaxima] = 0;
    a.slots[kCertMaxima + kKeyStride] = 0;
  }
}

}  // namespace walk
}  // namespace jax_markov
