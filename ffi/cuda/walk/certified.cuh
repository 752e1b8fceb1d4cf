// The certified walk of a CertifiedMarkovHead in MarkovWalkKernel (the CERT instances: the digit kernel
// at 1-2 requests, the digit pairs at 3-8, EREGS at 9-16 greedy ones): int8 W2 scores every column as
// the plain walk does, and a greedy row chooses what the unquantized head's walk chooses
// (ffi/cpu/certified.h is the CPU form of the same rule). Sampled rows keep their int8 keys, and the
// logits out stay the int8 ones. Each CTA publishes, beside its best int8 key of each request, its
// second-best int8 score and its margin; every CTA reads all of them (the direct exchange) and so
// knows, the same for all, whether the int8 winner is certainly the exact choice. Where it is not, the
// whole grid takes an exact round: each warp re-scores exactly, from the unquantized W2, the columns
// of its own that the int8 scores cannot rule out, and the grid exchanges exact keys once more.
// The margin M of a step and the bounds up() and T' it gives are those of cuda/certificate.cuh.
//
// The certificate, per greedy request and step. The grid's best int8 key is column a's, published by
// CTA c_a with margin M_a: its lower bound is L_a = y_a - KeySlack(y_a) - M_a (a finite y_a and M_a;
// otherwise no certificate). The exact choice v* has R(lr(v*)) >= R(lr(a)) >= R(L_a), so lr(v*) >= T'
// = R(L_a) - (2^-p |R(L_a)| + tiny) (the value just below R(L_a) in the logits dtype, p = 7 bf16, 10
// f16; T' = L_a where l is not rounded), and so up(y_v*) >= T'. Every column but a has y at most its
// CTA's second-best score (c_a) or its CTA's best (any other CTA): where the up() of each of these,
// with its CTA's margin, is below T', v* = a, and the choice is certified. Otherwise the exact round:
// each warp re-scores every column of its own with up(y) >= T' (a lane knows its best key and its
// second-best score, Keep: where the second reaches T', or T' is -inf, the lane re-scores all its
// rows, 2 per tile of the warp, EREGS 4), each re-scored column gets its exact key (lr from the
// unquantized row, padding -inf, rounded to the logits dtype, PackArgmaxKey), and the grid's maximum
// over the CTAs' maxima of exact keys is v*'s key, whatever other columns were re-scored.
//
// The workspace (walk_config.h): the key of CTA c, request b and step k and its bounds word (second-best
// ordered score << 32 | margin bits | 2^31, never 0; 1 for a sampled row) as the pair of words 2 i and
// 2 i + 1, i = (k B + b) grid + c, stored and loaded as one 16-byte access; its exact key of the exact
// round at index i of the exact keys. Each CTA clears its own words of step k - 2 as it publishes step
// k's, and the last CTA out clears the last two steps'.
#pragma once

#include "cuda/certificate.cuh"
#include "cuda/walk/kernel.cuh"

namespace jax_markov {
namespace walk {

// Launch start: each warp's largest W2 scale and residual norm over the CTA's rows (the thread's
// largest of each, as bits, from Start) in cert_maxima; the exact keys, second-best scores, counts and
// exact-round requests zeroed. Before Start's barrier.
template <class T>
__device__ __forceinline__ void WalkCta<T>::StartCertificate(uint32_t s_bits, uint32_t r_bits) {
  s_bits = __reduce_max_sync(0xffffffffu, s_bits);
  r_bits = __reduce_max_sync(0xffffffffu, r_bits);
  if (lane == 0) {
    cert_maxima[2 * warp] = s_bits;
    cert_maxima[2 * warp + 1] = r_bits;
  }
  if (tid < kCertBatch) {
    cert_exact[tid] = 0;
    cert_second[tid] = 0;
    cert_counts[2 * tid] = 0;
    cert_counts[2 * tid + 1] = 0;
  }
  if (tid < 2) cert_rounds[tid] = 0;
}

// Request b's e of step k (lane L: e[8L .. 8L+7], from W1's raw words) in cert_e, by the warp that built
// its operands: the step's margin (MakeMargins) and the exact round read it.
template <class T>
__device__ __forceinline__ void WalkCta<T>::CertifyE(int b, const uint4 (&raw)[2]) {
  float e[8];
  RowFloats(a.w1_dtype, raw, e);
  float4* to = reinterpret_cast<float4*>(cert_e + b * kRank + 8 * lane);
  to[0] = make_float4(e[0], e[1], e[2], e[3]);
  to[1] = make_float4(e[4], e[5], e[6], e[7]);
}

// After scoring step k: the margins of the step's requests (cert_margin, by the step's parity; step
// k's is read by its publish and, at step k + 1, by its exact round), from cert_e and the unscales
// that the operands' build left before the step's barrier. The warps that score fewer tiles than the
// CTA's busiest make them (margin_rank of margin_warps; every warp where all score as many), so that
// the margin costs the step no time. CTA 0 counts each step's decision of a greedy request here, and
// whether its bound is usable.
template <class T>
__device__ __forceinline__ void WalkCta<T>::MakeMargins(int k) {
  if (margin_rank < 0) return;
  const uint32_t s_bits = __reduce_max_sync(0xffffffffu, lane < kWarps ? cert_maxima[2 * lane] : 0u);
  const uint32_t r_bits = __reduce_max_sync(0xffffffffu, lane < kWarps ? cert_maxima[2 * lane + 1] : 0u);
  for (int b = margin_rank; b < batch; b += margin_warps) {
    const float4* from = reinterpret_cast<const float4*>(cert_e + b * kRank + 8 * lane);
    const float4 lo = from[0], hi = from[1];
    const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const float margin = CertMargin(e, unscale[b], a.logit_scale, __uint_as_float(s_bits), __uint_as_float(r_bits),
                                    s_bits <= 0x7f7fffffu && r_bits <= 0x7f7fffffu);
    if (lane == 0) {
      cert_margin[(k & 1) * kCertBatch + b] = margin;
      if (a.cert_stats != nullptr && blockIdx.x == 0 && inv_t[b] < 0.0f) {
        atomicAdd(&a.cert_stats[kCertDecisions], 1ull);
        if (!(margin < INFINITY)) atomicAdd(&a.cert_stats[kCertUncertified], 1ull);
      }
    }
  }
}

// After the CTA's barrier: step k's int8 key of every request (cta_best, left zeroed; 1 where the CTA
// has none) into its direct slot, and a greedy request's bounds word beside it (cert_second left
// zeroed); this CTA's words of step k - 2 cleared (every CTA read them, exact round included, before
// it published step k - 1's, which this CTA gathered). A CTA whose key may win asks L2 for its W1 row.
template <class T>
__device__ __forceinline__ void WalkCta<T>::PublishCertified(int k) {
  if (tid >= batch) return;
  const unsigned long long mine = cta_best[tid];
  unsigned long long bounds = 1;
  if (inv_t[tid] < 0.0f) {
    const uint32_t margin_bits = __float_as_uint(cert_margin[(k & 1) * kCertBatch + tid]) | 0x80000000u;
    bounds = (static_cast<unsigned long long>(cert_second[tid]) << 32) | margin_bits;
  }
  const size_t at = size_t(k * batch + tid) * gridDim.x + blockIdx.x;
  unsigned long long* pair = a.slots + 2 * at;
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(pair), "l"(mine != 0 ? mine : 1ull), "l"(bounds) : "memory");
  if (k >= 2) {
    const size_t old = at - size_t(2 * batch) * gridDim.x;
    asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %1};" ::"l"(a.slots + 2 * old), "l"(0ull) : "memory");
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a.slots + kExactWords + old), "l"(0ull) : "memory");
  }
  if (mine != 0 && a.d2t == nullptr && k + 1 < steps) PrefetchW1Row(a, ArgmaxKeyIndex(mine));
  cta_best[tid] = 0;
  cert_second[tid] = 0;
}

// A greedy request's choice of a step from every CTA's key and bounds word (pairs: CTA c's at words
// 2c and 2c + 1), once all are published: the grid's best key (returned) and whether the bounds
// certify it (the comment at the top); threshold gets T' for the exact round (-inf where no bound can
// be used). A lane loads a CTA's pair at once; each word is written once a step, never 0, so that the
// pair is the step's where both are nonzero. The whole warp calls it; every lane gets the same. The
// best key's W1 row (prefetch_w1: no d2t, below the last step) is asked into L1 before the
// certificate's arithmetic, which its latency then covers (nearly every certificate holds).
__device__ __forceinline__ unsigned long long GatherCertified(const WalkArgs& a, const unsigned long long* pairs, int lane,
                                                              int dtype, bool prefetch_w1, bool& certified,
                                                              float& threshold) {
  constexpr int kPerLane = (kDirectMaxCtas + 31) / 32;
  unsigned long long key[kPerLane], word[kPerLane];
  bool ready;
  do {
    ready = true;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      key[i] = word[i] = 1;
      if (c < gridDim.x) {
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(key[i]), "=l"(word[i]) : "l"(pairs + 2 * c) : "memory");
      }
      ready = ready && key[i] != 0 && word[i] != 0;
    }
  } while (!__all_sync(0xffffffffu, ready));
  unsigned long long best = key[0];
#pragma unroll
  for (int i = 1; i < kPerLane; ++i) best = key[i] > best ? key[i] : best;
  best = WarpMaxKey(best);
  if (prefetch_w1) PrefetchW1RowL1(a, ArgmaxKeyIndex(best), lane);
  // The winner's margin, and the highest up() of every other column: its CTA's best, or (the winner's
  // CTA) its second-best; an unordered or unbounded one leaves the choice uncertified. Without
  // branches, so that the CTAs' bounds are worked out side by side.
  float winner_margin = INFINITY, up = -INFINITY;
  bool bounded = true;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const bool used = key[i] != 1;  // no CTA, or a CTA with no column of this request
    const bool winner = key[i] == best;
    const float margin = __uint_as_float(uint32_t(word[i]) & 0x7fffffffu);
    const uint32_t other = winner ? uint32_t(word[i] >> 32) : uint32_t(key[i] >> 32);
    const bool counts = used && other != 0;  // 0: the winner's CTA has no second column
    const float u = CertUpper(OrderedToFloat(other), margin, dtype);
    winner_margin = used && winner ? margin : winner_margin;
    bounded = bounded && (!counts || u < INFINITY);
    up = counts && u > up ? u : up;
  }
  // As ordered bits, one reduction each: a margin is never negative, and up is never NaN.
  winner_margin = __uint_as_float(__reduce_min_sync(0xffffffffu, __float_as_uint(winner_margin)));
  up = OrderedToFloat(__reduce_max_sync(0xffffffffu, OrderedScore(up)));
  bounded = __all_sync(0xffffffffu, bounded);
  const float y_a = KeyScore(best);
  threshold = fabsf(y_a) < INFINITY && winner_margin < INFINITY ? CertThreshold(y_a, winner_margin, dtype) : -INFINITY;
  certified = bounded && threshold > -INFINITY && up < threshold;
  return best;
}

// Exact keys of up to kRescoreBatch columns of request r at step k (ExactKeys), rounded where logits go out.
template <class T>
template <bool SKIP_MASKED>
__device__ __forceinline__ unsigned long long WalkCta<T>::RescoreColumns(int r, int k, const float (&e)[8],
                                                                         const int (&cols)[T::kRescoreBatch],
                                                                         int& rows_read) const {
  return ExactKeys<T::kRescoreBatch, SKIP_MASKED>(a, vocab, steps, r, k, e, cols, lane, FORM != kPlainForm && a.logits != nullptr,
                                                   rows_read);
}

// Step k-1's choices of a certified walk (k > 0) and step k's operands: every request's winner from the
// exchange, certified for greedy ones where the bounds allow (ChooseCertifiedPass); where some greedy
// choice is not, in any CTA, every CTA sees the same keys and bounds and so takes the exact round
// together (ExactRound), then those choices from the exact keys.
template <class T>
__device__ __forceinline__ void WalkCta<T>::ChooseCertified(int k) {
  unsigned failed = 0;
  ChooseCertifiedPass(k, 0u, failed);
  if (lane == 0 && failed != 0) atomicOr(&cert_rounds[k & 1], failed);
  __syncthreads();
  const unsigned redo = cert_rounds[k & 1];
  // The other parity's word was last read at step k - 1, before this step's first barrier.
  if (tid == 0) cert_rounds[(k + 1) & 1] = 0;
  if (redo == 0) return;
  ExactRound(k - 1, redo);
  ChooseCertifiedPass(k, redo, failed);
}

// Choose for a certified walk (k > 0: the direct exchange): redo 0 takes each request's winner, a
// greedy one only where it is certified (else its bit in failed, its T' in cert_threshold); redo != 0
// takes the requests of its bits from the exact keys. Each choice taken writes its token (CTA 0) and,
// below the last step, builds step k's operands.
template <class T>
__device__ __forceinline__ void WalkCta<T>::ChooseCertifiedPass(int k, unsigned redo, unsigned& failed) {
  constexpr int kRowsPerPass = T::kRowsPerPass;
  const int dtype = FORM == kPlainForm ? kF32 : a.logits_dtype;  // kF32 where no logits go out
  for (int first = warp; first < batch; first += kWarps * kRowsPerPass) {
    int row[kRowsPerPass];
    bool take[kRowsPerPass];
#pragma unroll
    for (int u = 0; u < kRowsPerPass; ++u) {
      const int b = first + u * kWarps;
      row[u] = 0;
      take[u] = false;
      if (u >= T::kDirectPerWarp || b >= batch) continue;
      const size_t at = size_t((k - 1) * batch + b) * gridDim.x;
      if (redo != 0) {
        take[u] = (redo >> b) & 1u;
        if (take[u]) row[u] = ArgmaxKeyIndex(GatherKey(a.slots + kExactWords + at, lane));
      } else if (inv_t[b] < 0.0f) {
        bool certified;
        float threshold;
        const unsigned long long key =
            GatherCertified(a, a.slots + 2 * at, lane, dtype, a.d2t == nullptr && k < steps, certified, threshold);
        take[u] = certified;
        row[u] = ArgmaxKeyIndex(key);
        if (!certified) {
          failed |= 1u << b;
          if (lane == 0) {
            cert_threshold[b] = threshold;
            if (a.cert_stats != nullptr && blockIdx.x == 0) atomicAdd(&a.cert_stats[kCertExactRounds], 1ull);
          }
        }
      } else {
        take[u] = true;
        row[u] = ArgmaxKeyIndex(GatherKey<2>(a.slots + 2 * at, lane));  // a sampled row: its key alone
      }
    }
    if (a.d2t != nullptr) DraftToTarget(a.d2t, row);
    if (blockIdx.x == 0 && lane == 0) {
#pragma unroll
      for (int u = 0; u < kRowsPerPass; ++u) {
        if (take[u]) a.tokens[(first + u * kWarps) * steps + k - 1] = row[u];
      }
    }
    if (k == steps) continue;
    uint4 w1_raw[kRowsPerPass][2];
    LoadW1Rows(a, row, lane, w1_raw);
#pragma unroll
    for (int u = 0; u < kRowsPerPass; ++u) {
      if (take[u]) BuildOperands(first + u * kWarps, k, w1_raw[u]);
    }
  }
}

// The exact round of step k's greedy requests in redo (bit b): each warp re-scores its candidates
// (RescoreCandidates), then each request's exact key of the CTA goes to its exact-key slot (1 where
// the CTA has none), with the CTA's counts for the stats.
template <class T>
__device__ __forceinline__ void WalkCta<T>::ExactRound(int k, unsigned redo) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) RescoreCandidates(k, i, redo);
  __syncthreads();
  if (tid >= batch || !((redo >> tid) & 1u)) return;
  const unsigned long long exact = cert_exact[tid];
  cert_exact[tid] = 0;
  unsigned long long* slot = a.slots + kExactWords + size_t(k * batch + tid) * gridDim.x + blockIdx.x;
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(slot), "l"(exact != 0 ? exact : 1ull) : "memory");
  if (a.cert_stats == nullptr) return;
  const unsigned int rescored = cert_counts[2 * tid], lanes = cert_counts[2 * tid + 1];
  cert_counts[2 * tid] = 0;
  cert_counts[2 * tid + 1] = 0;
  unsigned long long* stats = a.cert_stats;
  if (rescored != 0) {
    atomicAdd(&stats[kCertRescored], (unsigned long long)rescored);
    atomicMax(&stats[kCertMaxCtaRescored], (unsigned long long)rescored);
    atomicAdd(&stats[kCertCtaSets], 1ull);
  }
  if (lanes != 0) atomicAdd(&stats[kCertLaneFallbacks], (unsigned long long)lanes);
}

// Owned slot i's candidates of step k for the greedy requests in redo (the comment at the top): the
// lane's best column where its up() reaches the request's T', all the lane's rows where its second-best
// score's does (or T' is -inf); their exact keys folded into cert_exact. The whole warp calls it.
template <class T>
__device__ __forceinline__ void WalkCta<T>::RescoreCandidates(int k, int i, unsigned redo) {
  constexpr int N = T::kRescoreBatch;
  const int rq = SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g);
  const unsigned long long own = lane_best[i];
  const int dtype = FORM == kPlainForm ? kF32 : a.logits_dtype;
  bool first = false, all = false;
  if (rq < batch && ((redo >> rq) & 1u) && own != 0) {
    const float threshold = cert_threshold[rq], margin = cert_margin[(k & 1) * kCertBatch + rq];
    all = !(threshold > -INFINITY) ||
          (lane_second[i] != 0 && !(CertUpper(OrderedToFloat(lane_second[i]), margin, dtype) < threshold));
    first = !all && !(CertUpper(KeyScore(own), margin, dtype) < threshold);
  }
  const int own_row = int(ArgmaxKeyIndex(own));
  // The requests of slot i in this warp: the digit kernel's 1-2, the digit pairs' 4i .. 4i + 3, EREGS's
  // 8i .. 8i + 7.
  const int r_first = EREGS ? 8 * i : PAIRS ? 4 * i : 0;
  const int r_end = min(batch, EREGS ? 8 * i + 8 : PAIRS ? 4 * i + 4 : kCertDigitBatch);
  for (int r = r_first; r < r_end; ++r) {
    if (!((redo >> r) & 1u)) continue;
    const bool mine = rq == r;
    const unsigned all_lanes = __ballot_sync(0xffffffffu, mine && all);
    unsigned firsts = __ballot_sync(0xffffffffu, mine && first);
    if ((all_lanes | firsts) == 0) continue;
    // Lane L's e[8L .. 8L+7] of step k, as CertifyE left it.
    const float4* from = reinterpret_cast<const float4*>(cert_e + r * kRank + 8 * lane);
    const float4 lo = from[0], hi = from[1];
    const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    unsigned long long best = 0;
    int count = 0;
    // The best rows of lanes with one candidate, kRescoreBatch at a time.
    while (firsts) {
      int cols[N];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        cols[j] = -1;
        if (firsts) {
          cols[j] = __shfl_sync(0xffffffffu, own_row, __ffs(firsts) - 1);
          firsts &= firsts - 1;
        }
      }
      const unsigned long long key = RescoreColumns<false>(r, k, e, cols, count);
      best = key > best ? key : best;
    }
    // Every row of the lanes that cannot tell: rows g and g + 8 of each of the warp's tiles (EREGS:
    // rows 8h + 2t + c), those of -inf base without their W2 rows where the margin is finite (a CTA of
    // masked rows stays cheap).
    const bool masked_skip = cert_margin[(k & 1) * kCertBatch + r] < INFINITY;
    constexpr int kLaneRows = EREGS ? 4 : 2;  // a lane's rows of a tile
    for (unsigned left = all_lanes; left != 0; left &= left - 1) {
      const int from_lane = __ffs(left) - 1, lane_g = from_lane >> 2, lane_t = from_lane & 3;
      const int rows = kLaneRows * tiles.total();
      for (int m0 = 0; m0 < rows; m0 += N) {
        int cols[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int m = m0 + j, n = m / kLaneRows;
          const int tile = n < tiles.n_resident ? tiles.Local(false, n) : tiles.Local(true, n - tiles.n_resident);
          const int in_tile = EREGS ? 8 * ((m >> 1) & 1) + 2 * lane_t + (m & 1) : lane_g + 8 * (m & 1);
          cols[j] = m < rows ? RowOf(tile) + in_tile : -1;
        }
        const unsigned long long key = masked_skip ? RescoreColumns<true>(r, k, e, cols, count)
                                                   : RescoreColumns<false>(r, k, e, cols, count);
        best = key > best ? key : best;
      }
    }
    if (lane == 0) {
      atomicMax(&cert_exact[r], best);
      if (a.cert_stats != nullptr) {
        atomicAdd(&cert_counts[2 * r], unsigned(count));
        atomicAdd(&cert_counts[2 * r + 1], unsigned(__popc(all_lanes)));
      }
    }
  }
}

}  // namespace walk
}  // namespace jax_markov
