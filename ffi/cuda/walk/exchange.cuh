// The grid-wide exchange of each step's choice (docs/kernel_design.md, "The exchange"): every CTA
// publishes its best key per request, and every CTA learns the grid's maximum before the next step.
// Up to kDirectBatch requests (on up to kDirectMaxCtas SMs) each CTA stores its key in a slot of its
// own and one warp per request waits for all of them to be non-zero and takes their maximum: the
// keys are the barrier, one L2 round trip. Larger batches publish one atomicMax per request, then
// bump an arrival counter that doubles as the grid barrier. Step k uses its own slots, and the next
// call starts clean: direct slots are cleared as they go out of use, the atomic keys and counters by
// the last CTA to leave.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_common.h"
#include "cuda/ptx.cuh"
#include "cuda/walk/args.cuh"

namespace jax_markov {
namespace walk {

// The largest of the warp's keys; every lane gets it.
__device__ __forceinline__ unsigned long long WarpMaxKey(unsigned long long key) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, m);
    key = other > key ? other : key;
  }
  return key;
}

// The direct exchange's key of request b at step k: the maximum over every CTA's slot, once all of
// them are published (a published key is never 0). CTA c's key is at slots[kStride c] (2 where each
// key has a bounds word beside it: the certified walk's pairs). The whole warp calls it; every lane
// gets it.
template <int kStride = 1>
__device__ __forceinline__ unsigned long long GatherKey(const unsigned long long* slots, int lane) {
  constexpr int kPerLane = (kDirectMaxCtas + 31) / 32;
  unsigned long long v[kPerLane];
  bool ready;
  do {
    ready = true;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      v[i] = 1;
      if (c < gridDim.x) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v[i]) : "l"(slots + kStride * c) : "memory");
      ready = ready && v[i] != 0;
    }
  } while (!__all_sync(0xffffffffu, ready));
  unsigned long long best = v[0];
#pragma unroll
  for (int i = 1; i < kPerLane; ++i) best = v[i] > best ? v[i] : best;
  return WarpMaxKey(best);
}

// The exchange above kDirectBatch: N requests' choices of step `step` (requests first + u x stride, the
// last one standing in past the batch), as draft tokens.
template <int N>
__device__ __forceinline__ void FetchChoices(const unsigned long long* slots, int step, int first, int stride, int batch, int (&row)[N]) {
  unsigned long long key[N];
#pragma unroll
  for (int u = 0; u < N; ++u) key[u] = __ldcg(&slots[AtomicKey(step, min(first + u * stride, batch - 1))]);
#pragma unroll
  for (int u = 0; u < N; ++u) row[u] = ArgmaxKeyIndex(key[u]);
}

// Draft tokens to target tokens (d2t), in one batch of loads.
template <int N>
__device__ __forceinline__ void DraftToTarget(const int32_t* d2t, int (&row)[N]) {
  int offset[N];
#pragma unroll
  for (int u = 0; u < N; ++u) offset[u] = __ldg(d2t + row[u]);
#pragma unroll
  for (int u = 0; u < N; ++u) row[u] += offset[u];
}

// Step k-1's tokens of requests first + u x stride (those in the batch).
template <int N>
__device__ __forceinline__ void WriteTokens(int32_t* tokens, int batch, int steps, int k, int first, int stride, const int (&row)[N]) {
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int b = first + u * stride;
    if (b < batch) tokens[b * steps + k - 1] = row[u];
  }
}

// If this CTA's candidate wins, every CTA reads its W1 row next: ask L2 for it now.
__device__ __forceinline__ void PrefetchW1Row(const WalkArgs& a, uint32_t token) {
  const char* row = static_cast<const char*>(a.w1) + size_t(ClampIndex(token, a.v_target)) * kRank * ElementBytes(a.w1_dtype);
  for (int line = 0; line < kRank * ElementBytes(a.w1_dtype); line += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + line));
  }
}

// The chosen W1 row asked into L1 by the warp that reads it next, each lane its own words of it.
__device__ __forceinline__ void PrefetchW1RowL1(const WalkArgs& a, uint32_t token, int lane) {
  const int row_bytes = kRank * ElementBytes(a.w1_dtype);
  const char* at = static_cast<const char*>(a.w1) + size_t(ClampIndex(token, a.v_target)) * row_bytes + lane * (row_bytes / 32);
  asm volatile("prefetch.global.L1 [%0];" ::"l"(at));
}

// The exchange above kDirectBatch, after a CTA barrier that orders its keys first: this CTA arrives
// (release: its keys are visible to whoever acquires the count), and thread 0 waits until all CTAs
// have arrived k times.
__device__ __forceinline__ void Arrive(const WalkArgs& a, int tid) {
  if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&a.counters[0]) : "memory");
}
__device__ __forceinline__ void WaitForArrivals(const WalkArgs& a, int k, int tid) {
  if (tid == 0) {
    const unsigned int target = gridDim.x * k;
    while (LoadAcquire(&a.counters[0]) < target) {
    }
  }
}

// Words [0, n) set to 0 by the CTA's `threads` threads. (Written as an index from `first` in the
// kernel's tail, the loop changed ptxas's allocation of the one-request kernel: 52 bytes of spills,
// reloaded in the tile loop.)
__device__ __forceinline__ void ClearWords(unsigned long long* words, int n, int tid, int threads) {
  for (int i = tid; i < n; i += threads) words[i] = 0;
}

// Step k's key of every request from this CTA (cta_best, left zeroed): its own slot per request with
// the direct exchange (always a key: 1 is no candidate here), else one atomicMax per request and an
// arrival after a CTA barrier. A CTA whose candidate may win asks L2 for its W1 row: with the direct
// exchange every CTA with a candidate; with the atomic one only a CTA whose key led the slot when its
// atomicMax landed (the winner's always did; in random order about 5.5 of 132 CTAs a request), once
// it has arrived, so that waiting for the atomic's answer delays no arrival.
__device__ __forceinline__ void PublishKeys(const WalkArgs& a, int k, bool direct, int batch, int steps,
                                            unsigned long long* cta_best, int tid) {
  const bool prefetch = a.d2t == nullptr && k + 1 < steps;
  unsigned long long mine = 0, before = ~0ull;
  if (tid < batch) {
    mine = cta_best[tid];
    if (direct) {
      unsigned long long* slot = a.slots + size_t(k * batch + tid) * gridDim.x + blockIdx.x;
      asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(slot), "l"(mine != 0 ? mine : 1ull) : "memory");
      // This CTA gathered step k - 1's keys from every CTA, each published after that CTA read the
      // slots of step k - 2: this CTA's slot there is read by no one any more.
      if (k >= 2) asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(slot - size_t(2 * batch) * gridDim.x), "l"(0ull) : "memory");
      if (mine != 0 && prefetch) PrefetchW1Row(a, ArgmaxKeyIndex(mine));
    } else if (mine != 0) {
      before = atomicMax(&a.slots[AtomicKey(k, tid)], mine);
    }
    cta_best[tid] = 0;
  }
  if (!direct) {
    __syncthreads();
    Arrive(a, tid);
    if (mine > before && prefetch) PrefetchW1Row(a, ArgmaxKeyIndex(mine));
  }
}

}  // namespace walk
}  // namespace jax_markov
