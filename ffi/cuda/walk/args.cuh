// What a launch of either walk kernel receives (one struct, passed by value): the call's buffers, the
// launch plan's decisions (ffi/plan/walk_plan.h) and the workspace; and the timeline stamps of
// diagnostic builds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_config.h"

namespace jax_markov {
namespace walk {

struct WalkArgs {
  const void* base;  // [B, K, V]
  const int32_t* anchor;
  const void* w1;  // [vt, 256]
  const void* w2;  // [V, 256] int8, fp16 or bf16
  const float* scale;  // [V] for int8 W2, null for a float W2
  const float* temperature;
  const uint32_t* key;  // [B, 2]
  const int32_t* position;
  const int32_t* d2t;  // [V] or null
  int32_t* tokens;  // [B, K]
  void* logits;  // [B, K, V] or null
  void* embeds;  // [B, K, 256] or null
  unsigned long long* slots;  // [kWorkspaceWords], zero on entry and exit
  unsigned int* counters;  // [2]: arrivals, departures; zero on entry and exit
  int batch, steps, vocab, v_target, vocab_size;
  int base_dtype, w1_dtype, logits_dtype;
  float logit_scale;
  // The plan (LaunchPlan): the CTA's tiles, those of them resident in shared memory, and how
  // MarkovWalkKernel makes sampled rows' noise: each step's for the CTA's rows ahead of scoring
  // (noise_ahead), or each tile's into a warp's buffer as it scores it (noise_tiles), or else in the
  // scoring epilogue; logits_staged: logits out through shared memory, 8 rows of a request a store.
  int tiles_per_cta, resident_tiles;
  int sampling;  // 0: every row greedy, whatever `temperature` holds (the caller gave none)
  int noise_ahead, noise_tiles, logits_staged;
  int run_when;  // RunWhen: the batch classes in which the launch walks (it returns at once in others)
  const int8_t* w2_tiles;  // the transposed kernel: W2 stored tile by tile (W2TileOrder), or null
  // A CertifiedMarkovHead's certificate (the CERT instances; null otherwise): the unquantized W2 [V, 256]
  // of dtype w2_exact_dtype and its rows' residual norms [V]; cert_stats: the counters of
  // certified_stats() (kCertStats words), or null where they are not kept.
  const void* w2_exact;
  int w2_exact_dtype;
  const float* residual_norm;
  unsigned long long* cert_stats;
  unsigned long long* timeline;  // timeline builds only: [ctas][kMaxSteps + 1][kPhases] stamps, then
                                 // [ctas][kMaxSteps][kMaxWarps] warp scoring ends
};

// Whether this guarded launch returns at once (RunWhen): every CTA reads the launch's temperatures
// and reaches the same answer, before it touches the workspace or any output.
__device__ __forceinline__ bool SkipsLaunch(const WalkArgs& a) {
  if (a.run_when == kAlways) return false;
  int samples = 0, greedy = 0;
  for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
    const bool sampled = a.temperature[b] > 0.0f;  // InverseTemperature's rule
    samples |= sampled;
    greedy |= !sampled;
  }
  const bool any_sampled = __syncthreads_or(samples), any_greedy = __syncthreads_or(greedy);
  const int batch_class = !any_sampled ? kAllGreedy : any_greedy ? kMixedRows : kAllSampled;
  return (a.run_when & batch_class) == 0;
}

// A request's 1 / T where it samples, -1 where it is greedy (T = 0, NaN or negative, or no temperatures
// given). T = +inf samples with 1 / T = 0: uniformly among the columns that are not -inf.
__device__ __forceinline__ float InverseTemperature(const WalkArgs& a, int b) {
  const float temp = a.temperature[b];
  return a.sampling && temp > 0.0f ? 1.0f / temp : -1.0f;
}

// A sampled row's score (docs/spec.md): l / T + g, and -inf where l is -inf (masked or padding), also
// when 1 / T is 0 (where -inf x 0 would be NaN, which wins).
__device__ __forceinline__ float SampledScore(float l, float inv_t, float g) {
  return l == -INFINITY ? -INFINITY : __fadd_rn(__fmul_rn(l, inv_t), g);
}

#ifdef JAX_MARKOV_TIMELINE
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
__device__ __forceinline__ void Stamp(const WalkArgs& a, int k, int phase) {
  if (threadIdx.x == 0) a.timeline[(size_t(blockIdx.x) * (kMaxSteps + 1) + k) * kPhases + phase] = GlobalTimer();
}
__device__ __forceinline__ void StampWarp(const WalkArgs& a, int k, int warp) {
  if ((threadIdx.x & 31) == 0) {
    a.timeline[size_t(gridDim.x) * (kMaxSteps + 1) * kPhases + (size_t(blockIdx.x) * kMaxSteps + k) * kMaxWarps + warp] =
        GlobalTimer();
  }
}
#else
__device__ __forceinline__ void Stamp(const WalkArgs&, int, int) {}
__device__ __forceinline__ void StampWarp(const WalkArgs&, int, int) {}
#endif

}  // namespace walk
}  // namespace jax_markov
