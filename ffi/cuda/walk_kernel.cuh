// The cooperative walk kernel (SPEC.md, ffi/README.md), shared by the launch units of each W2 format.
//
// Design
// - One CTA per SM. The vocabulary is cut into tiles of 16 W2 rows (16 x 256 elements: 4 KB in
//   int8, 8 KB in fp16/bf16); CTA c owns a contiguous run of tiles. The first `resident_tiles` of
//   its run are copied into shared memory while step 0 reads them from HBM, and stay there for
//   steps 1..K-1 (where the MMA takes tile words as operands, step 0 stores them back in fragment
//   order: one 16-byte load per MMA operand); the rest stream from L2 every step (in most kernels
//   but for the one each warp scored last, which stays in its prefetch registers for the next step:
//   kKeepsStreamed). Each thread re-reads exactly the bytes it stored, so no barrier guards them.
// - Scoring uses the warpgroup's tensor cores (wgmma m64nNk16): each warp of a warpgroup gives its
//   own tile as 16 rows of A from registers (int8 -> fp16 is exact; fp16 and bf16 rows are used as
//   they are), and B = e = W1[prev], 8 columns per n-tile, is read from shared memory once for the
//   four warps. e is scaled by a power of two per request and written in the MMA's format; where
//   that format holds fewer bits than W1 (fp32 W1, or fp16 W1 against bf16 W2) a request takes two
//   columns (hi + lo parts). Products are exact and accumulate in fp32. Since a dot product is a
//   sum, the r index is permuted freely: each thread loads 16 contiguous bytes per chunk and B is
//   laid out to match. Batches of 1-2 requests with int8 W2 use int8 mma.sync on e's digits
//   instead (BuildDigits), warp by warp, and so do batches of 3-8 (BuildDigitPairs) whose logits are
//   not returned or whose W1 is bf16. Greedy batches of 9-16 with no logits out hold e's digit pairs
//   in registers as the A operand instead, and W2's tile words are B (EREGS, BuildDigitPairOperands).
// - The per-step choice is a 64-bit key (ordered score, inverted index) whose integer maximum is
//   the SPEC.md argmax. Each CTA reduces its candidates in shared memory, then publishes them. Up to
//   kDirectBatch requests here, and in the transposed walk of 17-64 (on up to kDirectMaxCtas SMs),
//   each CTA stores its key in a slot of its own and one warp per request waits for all of them to be
//   non-zero and takes their maximum: the keys are the barrier, one L2 round trip. On more SMs
//   batches above kDirectBatch publish one atomicMax per request, then bump an arrival counter that
//   doubles as the grid barrier. Step k uses its own slots, and the
//   next call starts clean: direct slots are cleared as they go out of use (CTA 0 clears the last
//   two steps'), the atomic keys and counters by the last CTA to leave.
// - Sampled rows add Gumbel noise (Philox4x32-10) to their scores. Small batches compute each step's
//   noise for the CTA's rows into shared memory before scoring, on the warps that do not fetch the
//   grid's choice (FillNoise). Batches of 9 or more requests have all of it computed before the walk
//   by a kernel of their own (MarkovWalkNoise, into scratch, tile-major); each warp stages a tile's
//   share in shared memory a tile ahead (one bulk copy on an mbarrier), so that scoring takes the
//   branch-free epilogue. Otherwise the scoring epilogue computes it.
// - Logits leave a tile through a per-warp shared-memory buffer: stmatrix transposes the
//   accumulator-shaped values so that each lane stores 8 rows of one request (16 or 32 bytes), not one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "common/walk_common.h"
#include "cuda/markov_walk_cuda.h"
#include "cuda/wgmma.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_markov {
namespace walk {

namespace ffi = xla::ffi;

constexpr int kRank = 256;
constexpr int kTileRows = 16;
constexpr int kTileElements = kTileRows * kRank;  // 4096
constexpr int kMaxSteps = 16;
constexpr int kMaxBatch = 64;  // columns per launch (8 n-tiles of 8); larger batches take several launches
constexpr int kMaxStageBytes = 10 * 1024;
constexpr int kMaxNoiseBytes = 24 * 1024;  // at V = 151936 on 132 SMs: up to 5 requests
// The exchange through one slot per CTA (see above): its batch and grid limits, the slots it takes.
constexpr int kDirectBatch = 16;
constexpr int kDirectMaxCtas = 160;
constexpr int kSlotWords = kMaxSteps * kMaxBatch * kDirectMaxCtas;  // the transposed kernel's direct exchange: 64 requests
// The atomic exchange's keys, each on a line of its own (kKeyStride, walk_common.h).
static_assert(kMaxSteps * kMaxBatch * kKeyStride <= kSlotWords, "the atomic exchange's keys fit the slots");
__host__ __device__ constexpr size_t AtomicKey(int k, int b) { return size_t(k * kMaxBatch + b) * kKeyStride; }

enum DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };
// W2's storage: int8 rows with fp32 scales (scored as fp16, or as int8 digits for B <= 2), or the
// unquantized fp16 / bf16 rows of a MarkovHead.
enum W2Format : int { kW2Int8 = 0, kW2F16 = 1, kW2BF16 = 2 };
// The digit kernel's instances (MarkovWalkKernel's FORM): any launch, or one of the common forms with
// bf16 base logits known at compile time, which leaves out the epilogues it does not take: logits out
// in bf16 or in float32 (the noise of any sampled row ahead), or greedy rows and tokens only.
enum LaunchForm : int { kAnyForm = 0, kBF16LogitsForm = 1, kPlainForm = 2, kF32LogitsForm = 3 };
// The logits dtype of a logits-out form.
__host__ __device__ constexpr int FormLogits(int form) { return form == kF32LogitsForm ? kF32 : kBF16; }
__host__ __device__ constexpr bool LogitsForm(int form) { return form == kBF16LogitsForm || form == kF32LogitsForm; }

__host__ __device__ constexpr int W2Bytes(int w2) { return w2 == kW2Int8 ? 1 : 2; }
// 16-byte chunks of a tile that each lane holds: rows g and g + 8, half each.
__host__ __device__ constexpr int TileChunks(int w2) { return 8 * W2Bytes(w2); }

// Timeline builds (cmake -DJAX_MARKOV_TIMELINE=ON, benchmarks/timeline.py): thread 0 of every CTA
// stamps %globaltimer at each phase of each step, lane 0 of every warp when its tiles are scored.
constexpr int kPhases = 6;  // step start, prefetches issued, wait over, e ready, scored, arrived
constexpr int kMaxWarps = 16;

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
  unsigned long long* slots;  // [kSlotWords], zero on entry and exit
  unsigned int* counters;  // [2]: arrivals, departures; zero on entry and exit
  int batch, steps, vocab, v_target, vocab_size;
  int base_dtype, w1_dtype, logits_dtype;
  float logit_scale;
  int tiles_per_cta, resident_tiles;
  int sampling;  // 0: every row greedy, whatever `temperature` holds (the caller gave none)
  int noise_ahead;  // 1: each step's Gumbel noise of a CTA's rows is computed into shared memory first
  // The sampled requests' Gumbel noise (MarkovWalkNoise), tile-major so that a tile's noise for the
  // whole batch is one run: [K][ceil(V / 16)][B][16] floats; or null.
  const float* noise;
  // 1: logits go out through a per-warp shared-memory buffer (stmatrix), 8 rows of a request a store.
  int logits_staged;
  unsigned long long* timeline;  // timeline builds only: [ctas][kMaxSteps + 1][kPhases] stamps, then
                                 // [ctas][kMaxSteps][kMaxWarps] warp scoring ends
};

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

__device__ __forceinline__ int ElementBytes(int dtype) { return dtype == kF32 ? 4 : 2; }

// l rounded to the logits dtype DTYPE, stored at p[i] if `store`; returns the rounded value (the walk
// chooses from it) and the bits a store writes in *bits (16-bit dtypes: the low half), for a staged
// store.
template <int DTYPE>
__device__ __forceinline__ float StoreRoundedAs(void* p, size_t i, float l, bool store, uint32_t* bits = nullptr) {
  if constexpr (DTYPE == kF32) {
    if (store) __stcs(static_cast<float*>(p) + i, l);
    if (bits != nullptr) *bits = __float_as_uint(l);
    return l;
  } else if constexpr (DTYPE == kBF16) {
    const __nv_bfloat16 r = __float2bfloat16_rn(l);
    if (store) __stcs(static_cast<unsigned short*>(p) + i, __bfloat16_as_ushort(r));
    if (bits != nullptr) *bits = __bfloat16_as_ushort(r);
    return __bfloat162float(r);
  } else {
    const __half r = __float2half_rn(l);
    if (store) __stcs(static_cast<unsigned short*>(p) + i, __half_as_ushort(r));
    if (bits != nullptr) *bits = __half_as_ushort(r);
    return __half2float(r);
  }
}

// The same for a dtype known at run time, without branches: both 16-bit roundings are computed and
// the store of the matching width is predicated.
__device__ __forceinline__ float StoreRoundedSelect(void* p, size_t i, int dtype, float l, bool store,
                                                    uint32_t* bits = nullptr) {
  const __nv_bfloat16 rb = __float2bfloat16_rn(l);
  const __half rh = __float2half_rn(l);
  const bool bf16 = dtype == kBF16;
  const unsigned short bits16 = bf16 ? __bfloat16_as_ushort(rb) : __half_as_ushort(rh);
  if (store && dtype == kF32) __stcs(static_cast<float*>(p) + i, l);
  if (store && dtype != kF32) __stcs(static_cast<unsigned short*>(p) + i, bits16);
  if (bits != nullptr) *bits = dtype == kF32 ? __float_as_uint(l) : bits16;
  return dtype == kF32 ? l : (bf16 ? __bfloat162float(rb) : __half2float(rh));
}

// Stores two 8 x 8 matrices of 16-bit values, held as an MMA accumulator fragment (lane (g, t): row
// g, columns 2t and 2t + 1 in r0 for the first, r1 for the second), transposed: lane c (c < 8) gives
// the address of the first matrix's column c (16 bytes), lane 8 + c that of the second's.
__device__ __forceinline__ void StoreMatrixPairTransposed(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1) : "memory");
}

// The same for four matrices (lanes 16 + c and 24 + c give the third's and fourth's column addresses).
__device__ __forceinline__ void StoreMatrixQuadTransposed(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3) : "memory");
}

// Two int8 values (bytes 0,1 or 2,3 of w, sign bits already flipped) -> exact fp16 pair:
// 0x64XX is 1024 + XX in fp16, and XX = x + 128, so subtracting 1152 leaves x.
__device__ __forceinline__ uint32_t Int8PairToHalf2(uint32_t w, uint32_t selector) {
  const uint32_t h = __byte_perm(w, 0x64646464u, selector);
  uint32_t out;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(out) : "r"(h), "r"(0x64806480u));
  return out;
}

// D += A B in fp32 with fp16 (or, BF16, bf16) inputs, one warp.
template <bool BF16>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Where the step's B fragments live in shared memory: the 32-bit word of column n, k = 2 kp + 8 half
// (and k + 1) at k-step s. For wgmma (WG), per k-step a [16 x 8 NT] block in the canonical K-major
// layout without swizzle: core matrices of 8 columns x 8 k (128 contiguous bytes, 16 per column), the
// two k-halves of a k-step 128 bytes apart, groups of 8 columns 256 bytes apart. For mma.sync, the
// fragment of lane (n & 7, kp) of n-tile n / 8 at k-step s, as one 8-byte load: [NT][16][32 lanes].
template <int NT, bool WG>
__device__ __forceinline__ int FragWord(int s, int n, int half, int kp) {
  if constexpr (WG) return s * 64 * NT + (n >> 3) * 64 + half * 32 + (n & 7) * 4 + kp;
  return 2 * (((n >> 3) * 16 + s) * 32 + (n & 7) * 4 + kp) + half;
}
template <int NT>
constexpr int kFragStepBytes = 256 * NT;

// The shared-memory descriptor of k-step 0's B block for wgmma (k-halves 128 bytes apart, groups of 8
// columns 256 bytes apart); k-step s adds s * kFragStepBytes / 16.
__device__ __forceinline__ uint64_t FragDescriptor(const void* frag) { return WgmmaDescriptor(frag, 128, 256); }

// k-steps kBatch h .. kBatch h + kBatch - 1 of a tile's dot products on the warpgroup's tensor cores,
// A from op (k-step kBatch h + i: op[i]); waits for them, so that op's registers are free again and d
// is complete. The empty asm after the wait keeps every read of d after it.
template <int NT, bool BF16, int kBatch>
__device__ __forceinline__ void WgmmaBatch(const uint32_t (&op)[kBatch][4], uint64_t desc, int h, float (&d)[4 * NT]) {
  WgmmaFence();
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int s = kBatch * h + i;
    Wgmma<NT, BF16>(d, op[i][0], op[i][1], op[i][2], op[i][3], desc + uint64_t(s * kFragStepBytes<NT> / 16), s > 0);
  }
  WgmmaCommit();
  WgmmaWait<0>(d);
}

__device__ __forceinline__ void Imma16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d0 + 2^8 d1 + 2^16 d2 from three exact int32 digit sums (each |d| < 2^22, so exact in fp32).
__device__ __forceinline__ float DigitsToFloat(int d0, int d1, int d2) {
  return __fmaf_rn(float(d2), 65536.0f, __fmaf_rn(float(d1), 256.0f, float(d0)));
}

// d0 + 2^8 d1 from two exact int32 digit sums (|d| < 2^22), rounded once.
__device__ __forceinline__ float DigitPairToFloat(int d0, int d1) { return __fmaf_rn(float(d1), 256.0f, float(d0)); }

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

__device__ __forceinline__ unsigned int LoadAcquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The direct exchange's key of request b at step k: the maximum over every CTA's slot, once all of
// them are published (a published key is never 0). The whole warp calls it; every lane gets it.
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
      if (c < gridDim.x) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v[i]) : "l"(slots + c) : "memory");
      ready = ready && v[i] != 0;
    }
  } while (!__all_sync(0xffffffffu, ready));
  unsigned long long best = v[0];
#pragma unroll
  for (int i = 1; i < kPerLane; ++i) best = v[i] > best ? v[i] : best;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, m);
    best = other > best ? other : best;
  }
  return best;
}

// The direct exchange's choices of a warp's N requests at one step (first + u x stride; `step_slots`:
// that step's slots), as draft tokens (0 for those past the batch). The warp spins on its first
// request's slots alone (GatherKey), then reads the others' once, again only while one is empty:
// every CTA publishes all its keys at once, so when one request's slots are in the others' nearly
// always are, and a spin over all of them would read N x grid slots a warp every round trip while
// the slowest CTAs still score (at 64 requests 8.9 MB over the grid a round). The whole warp calls
// it; every lane gets the tokens.
template <int N>
__device__ __forceinline__ void GatherChoices(const unsigned long long* step_slots, int first, int stride, int batch, int lane,
                                              int (&row)[N]) {
  constexpr int kPerLane = (kDirectMaxCtas + 31) / 32;
  row[0] = first < batch ? int(ArgmaxKeyIndex(GatherKey(step_slots + size_t(first) * gridDim.x, lane))) : 0;
  if constexpr (N > 1) {
    unsigned long long v[N - 1][kPerLane];
    bool ready;
    do {
      ready = true;
#pragma unroll
      for (int u = 1; u < N; ++u) {
        const int b = first + u * stride;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int c = lane + 32 * i;
          v[u - 1][i] = 1;
          if (b < batch && c < gridDim.x) {
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v[u - 1][i]) : "l"(step_slots + size_t(b) * gridDim.x + c) : "memory");
          }
          ready = ready && v[u - 1][i] != 0;
        }
      }
    } while (!__all_sync(0xffffffffu, ready));
#pragma unroll
    for (int u = 1; u < N; ++u) {
      unsigned long long best = v[u - 1][0];
#pragma unroll
      for (int i = 1; i < kPerLane; ++i) best = v[u - 1][i] > best ? v[u - 1][i] : best;
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, m);
        best = other > best ? other : best;
      }
      row[u] = first + u * stride < batch ? int(ArgmaxKeyIndex(best)) : 0;
    }
  }
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

// Lane `lane`'s words of the W1 rows of N target tokens (clamped into W1), in one batch of loads:
// e[8 lane .. 8 lane + 7], 16 bytes of a 16-bit row (raw[u][0]) or 32 of an f32 row.
template <int N>
__device__ __forceinline__ void LoadW1Rows(const WalkArgs& a, const int (&row)[N], int lane, uint4 (&raw)[N][2]) {
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int r = ClampIndex(row[u], a.v_target);
    if (a.w1_dtype == kF32) {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const float*>(a.w1) + size_t(r) * kRank) + 2 * lane;
      raw[u][0] = __ldg(src);
      raw[u][1] = __ldg(src + 1);
    } else {
      raw[u][0] = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(a.w1) + size_t(r) * kRank) + lane);
    }
  }
}

// If this CTA's candidate wins, every CTA reads its W1 row next: ask L2 for it now.
__device__ __forceinline__ void PrefetchW1Row(const WalkArgs& a, uint32_t token) {
  const char* row = static_cast<const char*>(a.w1) + size_t(ClampIndex(token, a.v_target)) * kRank * ElementBytes(a.w1_dtype);
  for (int line = 0; line < kRank * ElementBytes(a.w1_dtype); line += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + line));
  }
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
// reloaded in the tile loop; NOTES, Session 42.)
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

// x rounded to fp16 (BF16: bf16), as bits, and that value back as a float.
template <bool BF16>
__device__ __forceinline__ unsigned short NarrowBits(float x) {
  return BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
template <bool BF16>
__device__ __forceinline__ float WidenBits(unsigned short h) {
  return BF16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
}

// Lane L's 8 elements e[8L .. 8L+7] of request b's W1 row as floats (raw words of W1[prev_b]);
// writes the embeds row when this CTA owns request b.
__device__ __forceinline__ void LoadRowAndEmbeds(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                 float (&e)[8]) {
  if (a.w1_dtype == kF32) {
    const float* f = reinterpret_cast<const float*>(&raw[0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = f[i];
  } else {
    const uint32_t words[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned short bits = static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2)));
      e[i] = a.w1_dtype == kBF16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
    }
  }
  if (a.embeds != nullptr && b % gridDim.x == blockIdx.x) {
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(a.embeds) + (size_t(b) * a.steps + k) * kRank * (a.w1_dtype == kF32 ? 4 : 2));
    if (a.w1_dtype == kF32) {
      dst[2 * lane] = raw[0];
      dst[2 * lane + 1] = raw[1];
    } else {
      dst[lane] = raw[0];
    }
  }
}

// 2^n for n in [-126, 127], a normal float: multiplying by it gives ldexpf(x, n), in one instruction.
__device__ __forceinline__ float Pow2(int n) { return __int_as_float((n + 127) << 23); }

// The shift that brings the row's largest |e| into [2^(top - 1), 2^top) (at most max_shift; 0 for
// a zero or non-finite row). Lane 0 records 2^-shift, which undoes it exactly after the dot product.
// amax's biased exponent field is frexpf's exponent + 126 where amax is normal; a subnormal amax
// reads as 2^-126 and gets max_shift either way (top + 126 > max_shift). With top <= 22 and
// max_shift <= 126, shift and -shift are in Pow2's range.
__device__ __forceinline__ int RowShift(const float (&e)[8], int top, int max_shift, int lane, float* unscale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(e[i]));
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  int shift = 0;
  if (amax > 0.0f && amax <= 3.0e38f) shift = min(top - (int(__float_as_uint(amax) >> 23) - 126), max_shift);
  if (lane == 0) *unscale = Pow2(-shift);
  return shift;
}

// e[0..7] x `up` rounded to integers, each in N balanced int8 digits (v = d0 + 2^8 d1 + ..., the top
// digit taking what is left), packed 4 a word: words[d][0..1] hold digit d of the 8 elements.
template <int N>
__device__ __forceinline__ void DigitWords(const float (&e)[8], float up, uint32_t (&words)[N][2]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float scaled = e[i] * up;
    int v = isfinite(scaled) ? __float2int_rn(scaled) : 0;
#pragma unroll
    for (int d = 0; d < N; ++d) {
      const int digit = d < N - 1 ? ((v + 128) & 0xFF) - 128 : v;
      v = (v - digit) >> 8;
      words[d][i / 4] |= uint32_t(digit & 0xFF) << (8 * (i % 4));
    }
  }
}

// Request b's e (lane L: e[8L .. 8L+7]) as E = rint(e 2^shift), max |E| in [2^(top - 1), 2^top), in N
// balanced int8 digits (DigitWords); records the unscale and writes the embeds row (LoadRowAndEmbeds).
template <int N>
__device__ __forceinline__ void RowDigitWords(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2], int top,
                                              float* unscale, uint32_t (&words)[N][2]) {
  float e[8];
  LoadRowAndEmbeds(a, b, k, lane, raw, e);
  const int shift = RowShift(e, top, 126, lane, unscale + b);
  DigitWords(e, Pow2(shift), words);
}

// Small batches (B <= 2) score with int8 tensor cores, with no conversion of W2 at all: e is
// written as a 24-bit integer E = rint(e * 2^shift) (max |E| in [2^21, 2^22)) in three balanced
// int8 digits, E = d0 + 2^8 d1 + 2^16 d2, and each digit is its own B column (column 3b + d). The
// int32 products and sums are exact; only e's bits below 2^-22 of its largest element are lost.
// Lane L writes digit d of e[8L .. 8L+7] to bytes 8L .. 8L+7 of row 3b + d of `digits` ([8][256]).
__device__ __forceinline__ void BuildDigits(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                            int8_t* digits, float* unscale) {
  uint32_t words[3][2] = {};
  RowDigitWords(a, b, k, lane, raw, 22, unscale, words);
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    reinterpret_cast<uint2*>(digits + (3 * b + d) * kRank)[lane] = make_uint2(words[d][0], words[d][1]);
  }
}

// Converts request b's W1 row (raw words of lane L: e[8L .. 8L+7]) into its B columns in the MMA's
// format (fp16, or bf16 against a bf16 W2; layout at FragWord), writes its embeds row when this CTA
// owns request b, and records the power-of-two unscale.
//
// Where each element of e sits follows the A layout of W2's format. A lane's 4 values of row g at
// k-step s are r = 16 (4 (s >> 2) + t) + 4 (s & 3) + j for int8 rows (16-byte chunks of 16 values)
// and r = 8 (4 (s >> 1) + t) + 4 (s & 1) + j for 16-bit rows (chunks of 8 values); values j = 0, 1
// are MMA k = 2t, 2t + 1 and j = 2, 3 are k = 2t + 8, 2t + 9.
template <int NT, bool SPLIT, int W2, bool WG>
__device__ __forceinline__ void BuildFragments(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                               uint32_t* frag, float* unscale) {
  constexpr bool kBF16 = W2 == kW2BF16;
  float e[8];
  LoadRowAndEmbeds(a, b, k, lane, raw, e);
  // max|e| in [2^14, 2^15): fp16 then holds 11 significant bits of every element that matters
  // (bf16's range is fp32's; the same shift does no harm there).
  const int shift = RowShift(e, 15, 100, lane, unscale + b);
  unsigned short hi[8], lo[8];
  const float up = Pow2(shift);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = e[i] * up;
    hi[i] = NarrowBits<kBF16>(x);
    lo[i] = SPLIT ? NarrowBits<kBF16>(x - WidenBits<kBF16>(hi[i])) : 0;
  }
  const int tt = W2 == kW2Int8 ? (lane >> 1) & 3 : lane & 3;
#pragma unroll
  for (int part = 0; part < (SPLIT ? 2 : 1); ++part) {
    const int column = SPLIT ? 2 * b + part : b;
    const unsigned short* h = part ? lo : hi;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int s = W2 == kW2Int8 ? 4 * (lane >> 3) + 2 * (lane & 1) + u : 2 * (lane >> 2) + u;
      frag[FragWord<NT, WG>(s, column, 0, tt)] = uint32_t(h[4 * u]) | (uint32_t(h[4 * u + 1]) << 16);
      frag[FragWord<NT, WG>(s, column, 1, tt)] = uint32_t(h[4 * u + 2]) | (uint32_t(h[4 * u + 3]) << 16);
    }
  }
}

// Batches of 3-8 requests whose logits are not returned or whose W1 is bf16 (PAIRS) score with int8
// tensor cores too: e as E = rint(e * 2^shift) (max |E| in [2^13, 2^14)) in two balanced int8 digits,
// E = d0 + 2^8 d1, in SPLIT's column layout (n-tile b / 4, columns 2 (b % 4) + d), so that lane t
// holds both digit sums of request 4 i + t. E keeps 15 bits below e's largest element, as the
// transposed kernel's digits do: all the bits of a bf16 element but its smallest ones; other W1
// dtypes walk tokens only, which may differ only at near-ties. The B fragment of lane (n, t) at
// m16n8k32 step j is 8 bytes at [NT][8][32 lanes]: E's digits at k = 64 (j / 2) + 16 t + 8 (j % 2) +
// 0..7, the k order of FragmentChunk's A words, so lane L's 8 elements (k = 8 L ..) are step
// 2 (L / 8) + L % 2 of t = (L / 2) % 4.
template <int NT>
__device__ __forceinline__ void BuildDigitPairs(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                uint32_t* frag, float* unscale) {
  uint32_t words[2][2] = {};
  RowDigitWords(a, b, k, lane, raw, 14, unscale, words);  // the high digit within [-64, 64]
  const int j = 2 * (lane >> 3) + (lane & 1), t = (lane >> 1) & 3;
#pragma unroll
  for (int d = 0; d < 2; ++d) {
    const int n = 2 * (b % 4) + d;
    reinterpret_cast<uint2*>(frag)[((b / 4) * 8 + j) * 32 + n * 4 + t] = make_uint2(words[d][0], words[d][1]);
  }
}

// Batches of 9-16 requests walked greedily with no logits out (EREGS) take the same two digits the
// other way round: as the A operand of m16n8k32, with W2's tile words as B (n-tile 0: rows 0-7 of the
// tile, n-tile 1: rows 8-15), so that no k-step reads e from shared memory and W2 is not converted.
// M-tile m, row r is digit r / 8 of request 8 m + r % 8; each warp holds both M-tiles' A fragments of
// all 8 k-steps (16 x 16 bytes a lane) for the whole step. Lane (g, t)'s fragment of k-step j is 16
// bytes at [2 m][8 j][32 lanes], {digit 0, digit 1} of request 8 m + g at k = 64 (j / 2) + 16 t +
// 8 (j % 2) + 0..3, then the same at + 4..7: FragmentChunk's k order, as in BuildDigitPairs.
__device__ __forceinline__ void BuildDigitPairOperands(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                       uint32_t* frag, float* unscale) {
  uint32_t words[2][2] = {};
  RowDigitWords(a, b, k, lane, raw, 14, unscale, words);
  const int j = 2 * (lane >> 3) + (lane & 1), t = (lane >> 1) & 3;
  reinterpret_cast<uint4*>(frag)[((b / 8) * 8 + j) * 32 + 4 * (b % 8) + t] =
      make_uint4(words[0][0], words[1][0], words[0][1], words[1][1]);
}

// Request finished by slot i of thread-in-group t: with SPLIT, n-tile i holds (hi, lo) columns of
// request 4i + t; otherwise n-tile i / 2 holds requests 8(i / 2) + 2t and 8(i / 2) + 2t + 1.
// With DIGITS (B <= 2), lane t = 0 finishes request 0 and t = 2 request 1; t = 1, 3 own none.
// With EREGS (e as the A operand, BuildDigitPairOperands), slot i of group g holds request 8i + g.
template <bool SPLIT, bool DIGITS = false, bool EREGS = false>
__device__ __forceinline__ int SlotRequest(int i, int t, int g = 0) {
  if (EREGS) return 8 * i + g;
  if (DIGITS) return t == 0 ? 0 : (t == 2 ? 1 : kMaxBatch);
  return SPLIT ? i * 4 + t : (i / 2) * 8 + 2 * t + (i % 2);
}

// The shared-memory address of a generic pointer into shared memory, as PTX's shared instructions take it.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SharedAddress(smem_dst)), "l"(src), "r"(fill ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most n of this thread's cp.async groups are still in flight (n > 7 waits for 7).
__device__ __forceinline__ void CpAsyncWaitPending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// Whether kernel <NT, SPLIT, DIGITS> reads a.noise (MarkovWalkNoise) when given it: those that walk
// kNoisePassRequests or more requests. At 16 warps (128 registers a thread) the stage's code spills
// registers in those of up to 8, whose batches' noise mostly fits ahead anyway (up to 5 requests at
// V = 151936).
constexpr int kNoisePassRequests = 9;
__host__ __device__ constexpr bool ReadsNoisePass(int nt, bool split, bool digits) {
  return !digits && (split ? 4 * nt : 8 * nt) >= kNoisePassRequests;
}

// Whether kernel <NT, SPLIT, DIGITS> stages logits (of 4 bytes if F32, else 2) for 8-row stores (see
// out_stage): where a lane's MMA columns are whole requests; f32 ones in the wgmma kernels, whose
// 16 slots a thread make each value's own store cost most.
__host__ __device__ constexpr bool StagesLogits(int nt, bool split, bool digits, bool f32) {
  return !split && !digits && (!f32 || nt >= 4);
}

// Bulk copies (the TMA unit) into shared memory that complete on an mbarrier: a phase of `bar`
// completes once its one arrival (the expect_tx) is made and all the bytes it expects have landed.
// (A phase of an mbarrier made with more arrivals completes at the last of them.)

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t arrivals = 1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(bar)) : "memory");
}

__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)), "r"(bytes) : "memory");
}

// bytes: a multiple of 16, as are both addresses.
__device__ __forceinline__ void BulkCopyToShared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(SharedAddress(dst)), "l"(src), "r"(bytes), "r"(SharedAddress(bar)) : "memory");
}

// Waits for the phase of `bar` with this parity to complete.
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(bar)), "r"(parity) : "memory");
}

// Raw bits of a base logit of dtype BASE as a float: one instruction at most.
template <int BASE>
__device__ __forceinline__ float BaseToFloat(uint32_t bits) {
  if constexpr (BASE == kF16) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  if constexpr (BASE == kBF16) return __uint_as_float(bits << 16);
  return __uint_as_float(bits);
}

// The same for a dtype known at run time, with selects rather than a jump.
__device__ __forceinline__ float BitsToFloat(uint32_t bits, int dtype) {
  const float half = BaseToFloat<kF16>(bits);
  const float wide = dtype == kBF16 ? BaseToFloat<kBF16>(bits) : BaseToFloat<kF32>(bits);
  return dtype == kF16 ? half : wide;
}

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
// ([B][stage_rows]) with cp.async, as one commit group; every 16-byte chunk is whole (see Launch).
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

// MarkovWalkKernel's own noise (FillNoise, the general epilogue) takes the math library's logf for its
// inner log, not LogOfUnit (the same bits): with LogOfUnit the kernel's register allocation shifted and
// its greedy walks, which compute no noise, ran 1 % slower (benchmarks/NOTES.md, Session 23).
constexpr bool kWalkLogf = true;

// Step k's Gumbel noise of rows [first_row, first_row + rows) for every sampled request, into
// noise[b][stage_rows], on `threads` threads from `thread`. It depends on neither the walk nor the
// weights, so a CTA computes it outside the scoring epilogue (where few lanes own a request when the
// batch is small): with the warps that wait for the others to fetch the grid's choice, or before the
// grid-wide wait. A thread's rows share a request, so the Philox round keys stay in registers; two
// rows at a time give the scheduler two independent chains.
__device__ __forceinline__ void FillNoise(const WalkArgs& a, float* noise, int stage_rows, int first_row, int rows, int k,
                                          const float* inv_t, const uint32_t* key0, const uint32_t* key1,
                                          const uint32_t* pos, int thread, int threads) {
  for (int b = 0; b < a.batch; ++b) {
    if (!(inv_t[b] > 0.0f)) continue;
    const uint32_t k0 = key0[b], k1 = key1[b], position = pos[b] + uint32_t(k);
#pragma unroll 2
    for (int r = thread; r < rows; r += threads) {
      noise[b * stage_rows + r] = GumbelNoise<kWalkLogf>(k0, k1, uint32_t(first_row + r), position);
    }
  }
}

// Every sampled request's Gumbel noise for all K steps (a.noise's layout), before the walk starts
// (batches whose noise does not fit in shared memory), kNoiseChains independent Philox chains a
// thread, which share its key schedule and store address (8: 89 instructions a value against 104 at
// 4, Session 22 of benchmarks/NOTES.md). With the noise at hand the walk scores with the branch-free
// epilogue, whose branches cost the general one more than the noise itself (benchmarks/NOTES.md,
// Session 13). Grid: (ceil(V / kNoiseValuesPerBlock), K, B); greedy requests' lines are left
// unwritten. (A template, so that every launch unit that includes this may instantiate it.)
constexpr int kNoiseThreads = 256;
constexpr int kNoiseChains = 8;
constexpr int kNoiseValuesPerBlock = kNoiseThreads * kNoiseChains;

template <int CHAINS>
__global__ void __launch_bounds__(kNoiseThreads) MarkovWalkNoise(const WalkArgs a, float* noise) {
  static_assert(kNoiseThreads % kTileRows == 0, "a thread's chains share their place in a tile");
  const int b = blockIdx.z, k = blockIdx.y;
  if (!(a.temperature[b] > 0.0f)) return;
  const uint32_t key0 = a.key[2 * b], key1 = a.key[2 * b + 1], position = static_cast<uint32_t>(a.position[b]) + uint32_t(k);
  // Chain i takes value first + i * kNoiseThreads: a warp's stores of a chain cover 32 consecutive values.
  const uint32_t first = blockIdx.x * kNoiseThreads * CHAINS + threadIdx.x;
  uint32_t k0[CHAINS], k1[CHAINS], v[CHAINS], pos[CHAINS];
  float g[CHAINS];
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) {
    k0[i] = key0;
    k1[i] = key1;
    v[i] = first + i * kNoiseThreads;
    pos[i] = position;
  }
  GumbelNoise<CHAINS>(k0, k1, v, pos, g);
  // Chain i's value lies kNoiseThreads / 16 tiles after chain 0's, at the same place in its tile.
  const size_t tiles = (a.vocab + kTileRows - 1) / kTileRows;
  float* out = noise + ((k * tiles + first / kTileRows) * a.batch + b) * kTileRows + first % kTileRows;
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) {
    if (v[i] < uint32_t(a.vocab)) __stcs(out + size_t(i) * kNoiseThreads * a.batch, g[i]);
  }
}

// Where the base logits of lane (g, t)'s slot i start at step k, as an element index: into a.base
// ([B, K, V]: Launch keeps B K V below 2^32), or STAGED into `staged` ([B][stage_rows], less
// first_row, so that adding a row of this CTA gives its index). Requests past the batch read the last
// one's. Computed once a step, so that a tile's loads add only their rows.
template <bool SPLIT, bool DIGITS, bool STAGED, bool EREGS>
__device__ __forceinline__ uint32_t BaseLine(const WalkArgs& a, int stage_rows, int first_row, int k, int i, int t, int g) {
  const int rq = min(SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g), a.batch - 1);
  return STAGED ? uint32_t(rq * stage_rows - first_row) : uint32_t(rq * a.steps + k) * uint32_t(a.vocab);
}

// Raw bits of the base logits that lane (g, t) combines with a tile's dot products: rows row0 + g
// (ba) and row0 + g + 8 (bb) of every request it owns (`line`: BaseLine), at clamped (always valid)
// indices. All loads of one call issue before any is used.
template <int kSlots, bool STAGED>
__device__ __forceinline__ void LoadBaseBits(const WalkArgs& a, const unsigned char* staged, const uint32_t (&line)[kSlots],
                                             int row0, int g, uint32_t (&ba)[kSlots], uint32_t (&bb)[kSlots]) {
  const uint32_t ra = min(row0 + g, a.vocab - 1), rb = min(row0 + g + 8, a.vocab - 1);
  const void* base = STAGED ? static_cast<const void*>(staged) : a.base;
  if (a.base_dtype == kF32) {
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

// The EREGS form of LoadBaseBits, for bf16 base logits and an even V (LaunchForColumns): lane (g, t) combines
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

// Shared-memory layout: B fragments, per-request state, the CTA's W2 scales, the staged base
// logits and the Gumbel noise (small batches), then the resident W2 tiles.
template <int NT, bool PAIRS = false>
struct Smem {
  // B for 16 k-steps (FragWord), or for PAIRS 8 k32-steps of int8 digits (BuildDigitPairs).
  static constexpr int kFragBytes = (PAIRS ? 8 : 16) * kFragStepBytes<NT>;
  // + the last-CTA flag, then two mbarriers a warp (the noise stage).
  static constexpr int kStateBytes = kMaxBatch * (8 + 4 * 6) + 16 + 2 * kMaxWarps * 8;
  static constexpr int kFixedBytes = kFragBytes + kStateBytes;
  // A warp's noise stage (two tiles' [B][16] floats) and staged logits ([NT][2][8] pieces of 16 bytes;
  // f32 logits take two such arrays, their high and low halves).
  __host__ __device__ static constexpr int NoiseStageFloats(int batch) { return 2 * batch * kTileRows; }
  static constexpr int kOutStageBytes = NT * 2 * 8 * 16;
  __host__ __device__ static constexpr int OutStageBytes(bool f32) { return (f32 ? 2 : 1) * kOutStageBytes; }
};

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

template <int NT, bool SPLIT, bool DIGITS, int W2, int THREADS, bool STAGED, int FORM, bool PAIRS = false, bool EREGS = false>
__global__ void __launch_bounds__(THREADS, 1) MarkovWalkKernel(const WalkArgs a) {
  static_assert(!DIGITS || (NT == 1 && !SPLIT && W2 == kW2Int8), "the int8-digit path walks up to 2 requests in one n-tile");
  static_assert(FORM == kAnyForm || DIGITS || EREGS, "only the digit kernel has instances for the known launch forms");
  static_assert(!EREGS || (NT == 2 && !SPLIT && !DIGITS && !PAIRS && W2 == kW2Int8 && FORM == kPlainForm),
                "e as the A operand: 9-16 requests' digit pairs, int8 W2, greedy with no logits out");
  static_assert(THREADS / 32 <= kMaxWarps, "the timeline has kMaxWarps warps per CTA");
  static_assert(!STAGED || NT <= 2, "only kernels of up to 16 columns stage their base logits");
  static_assert(!PAIRS || (SPLIT && !DIGITS && W2 == kW2Int8 && NT <= 2), "digit pairs: up to 8 requests' two columns, int8 W2");
  constexpr int kWarps = THREADS / 32;
  constexpr int kChunks = TileChunks(W2);
  constexpr int kTileBytes = kTileElements * W2Bytes(W2);
  constexpr int kSlots = EREGS ? 2 : (DIGITS ? 1 : (SPLIT ? NT : 2 * NT));  // requests a thread owns per row
  constexpr int kRowsPerPass = kMaxBatch / kWarps < 8 ? kMaxBatch / kWarps : 8;  // W1 rows a warp fetches at once
  constexpr int kDirectPerWarp = (kDirectBatch + kWarps - 1) / kWarps;
  // Base logits are fetched one tile ahead where registers allow; at NT = 8 a tile's 128 MMAs
  // cover the latency of fetching them at the start of the tile. EREGS folds a tile in the next
  // tile's iteration, so its base logits fetched at the tile's own start are a tile ahead of use.
  constexpr bool kBaseAhead = NT <= 4 && !EREGS;
  // The branch-free epilogue for rows with no noise to compute spills registers at 16 slots a thread.
  constexpr bool kNoiseFreeEpilogue = kSlots <= 8;
  // At 16 slots, one copy of it for every logits dtype (chosen with selects, kAnyDType), for batches
  // whose noise is staged.
  constexpr int kAnyDType = -2;
  // Logits staged for 16-byte stores (a.logits_staged): see out_stage.
  constexpr bool kStagedOut = StagesLogits(NT, SPLIT, DIGITS, false);
  // Whether this kernel reads MarkovWalkNoise's pass (a tile's noise staged at a time) where a launch
  // gives one; where it does not, sampled rows read the fill's noise ahead or compute their own.
  constexpr bool kNoisePass = ReadsNoisePass(NT, SPLIT, DIGITS) && !STAGED && !EREGS;
  // Batches that may take the direct exchange fill step k's noise while its choice is fetched (see
  // FillNoise's call); larger ones before the grid-wide wait, where the fill spills fewer registers.
  constexpr bool kFillWhileGathering = NT <= 2;
  // Resident tiles in flight per warp during step 0: 12 or more warps x 2 x 4 KB per SM cover HBM's
  // latency. EREGS's 8 warps keep 4 each (the same 32 KB an SM; measured no slower than 2, NOTES Session 45).
  constexpr int kLoadAhead = EREGS ? 4 : 2;
  // Resident tiles in fragment order where MMA operands are tile words as they stand.
  constexpr bool kFragmentOrder = DIGITS || PAIRS || EREGS || W2 != kW2Int8;
  // Whether a warp keeps its last streamed tile of a step in its prefetch registers for the next
  // (WarpTiles::Streamed). The digit kernel's instance for any launch spills registers with it, and
  // the int8 -> fp16 kernels, whose scoring is bound by the conversion, gain nothing (NOTES, Session 30).
  constexpr bool kKeepsStreamed = kFragmentOrder && (FORM != kAnyForm || !DIGITS);
  // Batches of 17 and more requests score on the warpgroup's tensor cores (wgmma), in batches of
  // kBatch k-steps whose A operands stay in registers until their MMAs are done; smaller ones (where
  // wgmma's waits cost more than its shared B reads save) score warp by warp with mma.sync, in
  // kChains independent accumulator chains per n-tile.
  constexpr bool kWgmma = !DIGITS && !PAIRS && NT >= 4;
  // Whether step 0 loads and arranges the resident tiles in the tile loop, as it scores them, rather
  // than before it: only in the wgmma kernels of 16-bit W2, where the arranging pass's 16 chunks a
  // lane made ptxas spill in the tile loop (48 -> 116 bytes).
  constexpr bool kStep0InLoop = kWgmma && W2 != kW2Int8;
  // The wgmma kernels' general epilogue computes the noise of kNoiseGroup slots (2 x kNoiseGroup
  // Philox chains) before their branches; the others compute it row by row in the branches (where
  // their 128 registers a thread allow no more).
  constexpr bool kGroupNoise = kWgmma;
  constexpr int kNoiseGroup = kGroupNoise ? 2 : 1;
  constexpr int kBatch = W2 == kW2Int8 ? 8 : 4;
  constexpr int kChains = NT == 1 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* frag = reinterpret_cast<uint32_t*>(smem);
  int8_t* digits = reinterpret_cast<int8_t*>(smem);  // DIGITS: [8 columns][256] int8 instead
  unsigned long long* cta_best = reinterpret_cast<unsigned long long*>(smem + Smem<NT, PAIRS>::kFragBytes);
  int* prev = reinterpret_cast<int*>(cta_best + kMaxBatch);
  float* unscale = reinterpret_cast<float*>(prev + kMaxBatch);
  float* inv_t = unscale + kMaxBatch;
  uint32_t* key0 = reinterpret_cast<uint32_t*>(inv_t + kMaxBatch);
  uint32_t* key1 = key0 + kMaxBatch;
  uint32_t* pos = key1 + kMaxBatch;
  int* last_out = reinterpret_cast<int*>(pos + kMaxBatch);
  uint64_t* noise_bar = reinterpret_cast<uint64_t*>(last_out + 4);  // [kWarps][2]
  float* scales = reinterpret_cast<float*>(smem + Smem<NT, PAIRS>::kFixedBytes);
  const int stage_rows = a.tiles_per_cta * kTileRows;
  unsigned char* staged = reinterpret_cast<unsigned char*>(scales + stage_rows);
  float* noise = reinterpret_cast<float*>(staged + (STAGED ? size_t(a.batch) * stage_rows * ElementBytes(a.base_dtype) : 0));
  // Step k's noise from MarkovWalkNoise (a.noise), staged a tile ahead per warp: [kWarps][2][B][16]
  // floats. Launch gives a.noise to the kernels that read it and do not stage base logits (the
  // staging kernels' batches' noise always fits ahead).
  const bool noise_pass = kNoisePass && a.noise != nullptr;
  float* noise_stage = noise + (a.noise_ahead ? a.batch * stage_rows : 0);
  // Logits out, staged per warp where lanes hold whole requests' columns (not SPLIT, not DIGITS):
  // [NT][2][8] pieces of 16 bytes (request 8 nt + c's rows 8 h .. 8 h + 7 of the tile) of 16-bit
  // values; f32 values as two such arrays, their high halves and their low halves.
  const bool staged_out = kStagedOut && a.logits_staged;
  const bool f32_out = StagesLogits(NT, SPLIT, DIGITS, true) && a.logits_dtype == kF32;
  const int out_stage_bytes = Smem<NT, PAIRS>::OutStageBytes(f32_out);  // a warp's
  unsigned char* out_stage = reinterpret_cast<unsigned char*>(noise_stage + (noise_pass ? kWarps * Smem<NT, PAIRS>::NoiseStageFloats(a.batch) : 0));
  unsigned char* resident = out_stage + (staged_out ? kWarps * out_stage_bytes : 0);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int batch = a.batch, steps = a.steps, vocab = a.vocab;
  const int first_tile = blockIdx.x * a.tiles_per_cta;
  const int first_row = first_tile * kTileRows;
  const int total_tiles = (vocab + kTileRows - 1) / kTileRows;
  const int my_tiles = max(0, min(a.tiles_per_cta, total_tiles - first_tile));
  const int my_rows = max(0, min(my_tiles * kTileRows, vocab - first_row));
  const WarpTiles<kWarps> tiles(warp, a.resident_tiles, my_tiles);
  // wgmma is warpgroup-wide: the four warps of a warpgroup run as many tile iterations as the busiest
  // of them, a warp past its own tiles with zero operands and no epilogue.
  int loop_tiles = tiles.total();
  if constexpr (kWgmma) {
    for (int w = warp & ~3; w <= (warp | 3); ++w) loop_tiles = max(loop_tiles, WarpTiles<kWarps>(w, a.resident_tiles, my_tiles).total());
  }
  const uint64_t frag_desc = FragDescriptor(frag);
  // Small batches exchange keys through one slot per CTA (slots[(k * batch + b) * grid + cta]).
  const bool direct = batch <= kDirectBatch && gridDim.x <= kDirectMaxCtas;
  const auto RowOf = [&](int local_tile) { return (first_tile + local_tile) * kTileRows; };

  Stamp(a, 0, 0);
  for (int i = tid; i < Smem<NT, PAIRS>::kFragBytes / 4; i += THREADS) frag[i] = 0;
  if (noise_pass && lane < 2) {
    MbarrierInit(&noise_bar[2 * warp + lane]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int b = tid; b < kMaxBatch; b += THREADS) {
    cta_best[b] = 0;
    if (b < batch) {
      prev[b] = a.anchor[b];
      const float temp = a.temperature[b];
      inv_t[b] = a.sampling && temp > 0.0f ? 1.0f / temp : 0.0f;
      key0[b] = a.key[2 * b];
      key1[b] = a.key[2 * b + 1];
      pos[b] = static_cast<uint32_t>(a.position[b]);
    }
  }
  // Everything that does not depend on the walk starts moving now: step 0's base logits, then the
  // first kLoadAhead of this warp's resident tiles (one cp.async group per tile, in scoring order,
  // each lane copying the chunks it will read itself; step 0 issues the rest kLoadAhead tiles ahead
  // of its scoring, so that scoring overlaps the load), then its first streamed tile into registers.
  const auto LoadResident = [&](int i) {
    const int j = tiles.Local(false, i), row0 = RowOf(j);
    uint4* slot = reinterpret_cast<uint4*>(resident + size_t(j) * kTileBytes) + lane;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const bool inside = row0 + g + (c < kChunks / 2 ? 0 : 8) < vocab;
      CpAsync16(slot + c * 32, TileChunk<W2>(a.w2, vocab, row0, g, t, c), inside);
    }
    CpAsyncCommit();
  };
  if (STAGED && my_tiles > 0) StageBaseLogits<THREADS>(a, staged, stage_rows, first_row, my_rows, 0);
  if (!STAGED && my_tiles > 0) PrefetchBaseLogits<THREADS>(a, first_row, my_rows, 0);
  for (int i = 0; i < min(kLoadAhead, tiles.n_resident); ++i) LoadResident(i);
  uint4 pre[kChunks];
  if (tiles.n_streamed > 0) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(0, 0)), g, t, pre);
  // The W2 scales, once the tiles' loads are on their way (a thread waits for its scales before it
  // stores them). A float W2 has no scales: 1 leaves its dot products as they are.
  for (int i = tid; i < stage_rows; i += THREADS) {
    scales[i] = a.scale == nullptr ? 1.0f : (i < my_rows ? __ldg(a.scale + first_row + i) : 0.0f);
  }
  // Greedy rows with no logits out take a scoring epilogue without branches.
  const bool any_sampled = __syncthreads_or(a.sampling && tid < batch && a.temperature[tid] > 0.0f);
  const bool plain = !any_sampled && a.logits == nullptr;
  // Scoring computes no noise when the fill or MarkovWalkNoise has (or no row samples).
  const bool noise_free = !any_sampled || a.noise_ahead || noise_pass;
  // The noise stage: this warp's buffer u % 2 takes the noise of the u-th tile it scores (counted
  // over all steps), so that buffer's mbarrier completes its phase u / 2 for it.
  uint32_t noise_tiles = 0;
  // Issues the bulk copy of step k's noise of the tile at row0 ([B][16] floats, one run of a.noise;
  // greedy requests' lines are never read) into buffer s. Its previous tile was read by this warp's
  // ordinary loads, which the fence orders before the copy's writes.
  const auto StageNoise = [&](int k, int row0, uint32_t s) {
    float* buffer = noise_stage + (size_t(warp) * 2 + s) * batch * kTileRows;
    FenceSharedForAsyncProxy();
    __syncwarp();
    if (lane == 0) {
      const uint32_t bytes = batch * kTileRows * sizeof(float);
      MbarrierArriveExpectTx(&noise_bar[2 * warp + s], bytes);
      BulkCopyToShared(buffer, a.noise + (size_t(k) * total_tiles + row0 / kTileRows) * batch * kTileRows, bytes,
                       &noise_bar[2 * warp + s]);
    }
  };
  // staged_out: step k's rounded logits of a tile leave through this warp's out_stage buffer.
  // StageLogits puts n-tile nt's there (stored[h][c]: the stored bits of row 8 h + g, request
  // 8 nt + 2t + c), transposed by stmatrix so that 16 bytes hold 8 rows of one request; FlushLogits
  // then stores whole pieces, 16 bytes a lane (32 for f32: both halves put back together), both halves
  // of a request's rows in one warp store. Rows past V (V % 8 == 0: whole pieces) and requests past
  // the batch are not written.
  unsigned char* out_buffer = out_stage + warp * out_stage_bytes;
  // Lane L's column address for matrix L / 8 of n-tile 0: h = (L / 8) % 2, c = L % 8; matrices 2 and 3
  // (f32's low halves) in the second array.
  const uint32_t out_column = SharedAddress(out_buffer) + ((lane >> 3) & 1) * 128 + (lane & 7) * 16 + (lane >= 16 ? Smem<NT, PAIRS>::kOutStageBytes : 0);
  const auto StageLogits = [&](int nt, const uint32_t (&stored)[2][2]) {
    const uint32_t low0 = __byte_perm(stored[0][0], stored[0][1], 0x5410), low1 = __byte_perm(stored[1][0], stored[1][1], 0x5410);
    if (f32_out) {
      StoreMatrixQuadTransposed(out_column + nt * 256, __byte_perm(stored[0][0], stored[0][1], 0x7632),
                                __byte_perm(stored[1][0], stored[1][1], 0x7632), low0, low1);
    } else {
      StoreMatrixPairTransposed(out_column + nt * 256, low0, low1);
    }
  };
  const auto FlushLogits = [&](int k, int row0) {
    __syncwarp();
#pragma unroll
    for (int p = lane; p < NT * 16; p += 32) {
      const int rq = 8 * (p >> 4) + (p & 7), row = row0 + 8 * ((p >> 3) & 1);
      if (rq < batch && row < vocab) {
        const size_t at = (size_t(rq) * steps + k) * vocab + row;
        const uint4 piece = *reinterpret_cast<const uint4*>(out_buffer + p * 16);
        if (f32_out) {
          const uint4 low = *reinterpret_cast<const uint4*>(out_buffer + Smem<NT, PAIRS>::kOutStageBytes + p * 16);
          uint4* dst = reinterpret_cast<uint4*>(static_cast<float*>(a.logits) + at);
          __stcs(dst, make_uint4(__byte_perm(low.x, piece.x, 0x5410), __byte_perm(low.x, piece.x, 0x7632),
                                 __byte_perm(low.y, piece.y, 0x5410), __byte_perm(low.y, piece.y, 0x7632)));
          __stcs(dst + 1, make_uint4(__byte_perm(low.z, piece.z, 0x5410), __byte_perm(low.z, piece.z, 0x7632),
                                     __byte_perm(low.w, piece.w, 0x5410), __byte_perm(low.w, piece.w, 0x7632)));
        } else {
          __stcs(reinterpret_cast<uint4*>(static_cast<unsigned short*>(a.logits) + at), piece);
        }
      }
    }
    __syncwarp();  // the buffer is read before the next tile's matrices overwrite it
  };
  if (!kFillWhileGathering && a.noise_ahead) FillNoise(a, noise, stage_rows, first_row, my_rows, 0, inv_t, key0, key1, pos, tid, THREADS);

  Stamp(a, 0, 1);
  Stamp(a, 0, 2);
  // With the direct exchange only CTA 0 reads the last step's keys: it writes the tokens and clears
  // the slots. (A loop bound: an exit from the loop at that step spilled in the tile loop.)
  const int last = direct && blockIdx.x != 0 ? steps - 1 : steps;
  for (int k = 0; k <= last; ++k) {
    if (k > 0) {
      Stamp(a, k, 0);
      // Step k's inputs that do not depend on the choice start moving before the wait.
      if (k < steps && my_tiles > 0) {
        if constexpr (STAGED) {
          StageBaseLogits<THREADS>(a, staged, stage_rows, first_row, my_rows, k);
        } else {
          PrefetchBaseLogits<THREADS>(a, first_row, my_rows, k);
        }
        if (!kKeepsStreamed && tiles.n_streamed > 0) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(0, 0)), g, t, pre);
        if (!kFillWhileGathering && a.noise_ahead) FillNoise(a, noise, stage_rows, first_row, my_rows, k, inv_t, key0, key1, pos, tid, THREADS);
      }
      // Wait for every CTA's step k-1 key (they arrived at the end of step k-1); the direct
      // exchange waits for the keys themselves below.
      Stamp(a, k, 1);
      if (!direct) {
        WaitForArrivals(a, k, tid);
        __syncthreads();
      }
      Stamp(a, k, 2);
    }

    // 1. Step k-1's choices; e_b = W1[prev_b] -> fp16 B fragments. Lane L holds e[8L .. 8L+7]. A
    //    warp reads the keys of kRowsPerPass requests, then their W1 rows, before converting any
    //    (each in one batch of loads: one L2 round trip each, not one per request).
    for (int first = warp; first < batch; first += kWarps * kRowsPerPass) {
      int row[kRowsPerPass];
      if (k == 0) {
#pragma unroll
        for (int u = 0; u < kRowsPerPass; ++u) row[u] = prev[min(first + u * kWarps, batch - 1)];
      } else if (direct) {
        // A warp walks at most kDirectPerWarp requests here.
#pragma unroll
        for (int u = 0; u < kRowsPerPass; ++u) {
          const int b = first + u * kWarps;
          row[u] = u < kDirectPerWarp && b < batch ? ArgmaxKeyIndex(GatherKey(a.slots + size_t((k - 1) * batch + b) * gridDim.x, lane)) : 0;
        }
      } else {
        FetchChoices(a.slots, k - 1, first, kWarps, batch, row);
      }
      if (k > 0 && a.d2t != nullptr) DraftToTarget(a.d2t, row);
      if (k > 0 && blockIdx.x == 0 && lane == 0) WriteTokens(a.tokens, batch, steps, k, first, kWarps, row);
      if (k == steps) continue;
      uint4 w1_raw[kRowsPerPass][2];
      LoadW1Rows(a, row, lane, w1_raw);
#pragma unroll
      for (int u = 0; u < kRowsPerPass; ++u) {
        const int b = first + u * kWarps;
        if (b >= batch) break;
        if constexpr (DIGITS) {
          BuildDigits(a, b, k, lane, w1_raw[u], digits, unscale);
        } else {
          if constexpr (EREGS) {
            BuildDigitPairOperands(a, b, k, lane, w1_raw[u], frag, unscale);
          } else if constexpr (PAIRS) {
            BuildDigitPairs<NT>(a, b, k, lane, w1_raw[u], frag, unscale);
          } else {
            BuildFragments<NT, SPLIT, W2, kWgmma>(a, b, k, lane, w1_raw[u], frag, unscale);
          }
        }
      }
    }
    if (k == steps) {
      Stamp(a, k, 3);
      break;
    }
    // Step k's noise. The direct exchange's gathering warps (warp b fetches request b's choice)
    // start a chain of L2 round trips (the keys, then the W1 row); the warps past them fill the
    // noise meanwhile, where they are most of the CTA. Otherwise (step 0, larger batches) every warp
    // fills it here.
    if (kFillWhileGathering && a.noise_ahead) {
      const int busy = k > 0 && direct && batch < kWarps / 2 ? batch * 32 : 0;
      if (tid >= busy) {
        FillNoise(a, noise, stage_rows, first_row, my_rows, k, inv_t, key0, key1, pos, tid - busy, THREADS - busy);
      }
    }
    // The staged base logits' group; at step 0 the first resident tiles' groups may still be pending.
    if (STAGED) CpAsyncWaitPending(k == 0 ? min(kLoadAhead, tiles.n_resident) : 0);
    // The B fragments written above are read by the tensor cores through the async proxy.
    if constexpr (kWgmma) FenceSharedForAsyncProxy();
    __syncthreads();
    Stamp(a, k, 3);

    // 2. Score this warp's tiles; keep the best key per owned request in registers.
    uint4 digit_frag[4];  // DIGITS: lane (g, t)'s B fragments, column g at k = 64q + 16t .. +15
    if constexpr (DIGITS) {
#pragma unroll
      for (int q = 0; q < 4; ++q) digit_frag[q] = reinterpret_cast<const uint4*>(digits + g * kRank + 64 * q)[t];
    }
    uint4 e_operands[EREGS ? 2 : 1][EREGS ? 8 : 1];  // EREGS: lane (g, t)'s A fragments (BuildDigitPairOperands)
    if constexpr (EREGS) {
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int s = 0; s < 8; ++s) e_operands[m][s] = reinterpret_cast<const uint4*>(frag)[(m * 8 + s) * 32 + lane];
      }
    }
    unsigned long long best[kSlots];
    // Each owned request's power-of-two unscale times logit_scale, for the whole step: the bias
    // (scale * dot) * this, fused into the add of the base logit, rounds exactly as
    // logit_scale * (scale * (dot * unscale)) does (scaling by 2^-shift is exact), one multiply fewer.
    // The mma.sync kernels past two requests (128 registers a thread at 16 warps) read it from shared
    // memory as they go: held in registers, it pushed the next tile's base logits to local memory, and
    // that spill store waited for their global load (8 % of the B = 16 greedy samples).
    constexpr bool kUnscaleFromSmem = !kWgmma && !DIGITS && !EREGS;
    float unscale_of[kUnscaleFromSmem ? 1 : kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      best[i] = 0;
      if constexpr (!kUnscaleFromSmem) unscale_of[i] = unscale[min(SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g), batch - 1)] * a.logit_scale;
    }
    const auto UnscaleOf = [&](int i) {
      if constexpr (kUnscaleFromSmem) return unscale[min(SlotRequest<SPLIT, DIGITS>(i, t), batch - 1)] * a.logit_scale;
      else return unscale_of[i];
    };
    // Step 0 lands this warp's resident tiles: tile i's load waited for once the tile kLoadAhead
    // ahead is issued, then (where the MMA takes tile words as operands) its chunks stored back in
    // fragment order (each lane rewrites only the chunks it copied; the int8 -> fp16 conversion takes
    // its words from anywhere, so that path keeps its resident tiles in row order). Before the tile
    // loop, not in it: the loop's step-0 branches cost every later step 7 % of its score phase at one
    // request (v78's timeline, benchmarks/NOTES.md Session 32).
    const auto LandResident = [&](int i) {
      // Groups committed after tile i's: the tiles up to i + kLoadAhead.
      if (i + kLoadAhead < tiles.n_resident) LoadResident(i + kLoadAhead);
      CpAsyncWaitPending(min(kLoadAhead, tiles.n_resident - 1 - i));
      if constexpr (kFragmentOrder) {
        uint4* slot = reinterpret_cast<uint4*>(resident + size_t(tiles.Local(false, i)) * kTileBytes) + lane;
        uint4 rows[kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) rows[c] = slot[c * 32];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) slot[c * 32] = FragmentChunk<W2>(rows, c, true);
      }
    };
    if (!kStep0InLoop && k == 0) {
      for (int i = 0; i < tiles.n_resident; ++i) LandResident(i);
    }
    int im = 0, is = 0;
    int streamed_slot = tiles.StreamedSlot(0);
    bool next_streamed = streamed_slot == 0;
    // A step's first streamed tile is in `pre` already (kKeepsStreamed: the one the step before
    // scored last).
    const int order = kKeepsStreamed ? k : 0;  // WarpTiles::Streamed's step
    int next_tile = next_streamed ? tiles.Streamed(order, 0) : tiles.Local(false, 0);
    uint32_t line[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) line[i] = BaseLine<SPLIT, DIGITS, STAGED, EREGS>(a, stage_rows, first_row, k, i, t, g);
    uint32_t base_a[kSlots], base_b[kSlots];
    const auto LoadBase = [&](int row0, uint32_t (&ba)[kSlots], uint32_t (&bb)[kSlots]) {
      if constexpr (EREGS) {
        LoadBasePairs<kSlots, STAGED>(a, staged, line, row0, t, ba, bb);
      } else {
        LoadBaseBits<kSlots, STAGED>(a, staged, line, row0, g, ba, bb);
      }
    };
    if (kBaseAhead && tiles.total() > 0) LoadBase(RowOf(next_tile), base_a, base_b);
    if (noise_pass && tiles.total() > 0) StageNoise(k, RowOf(next_tile), noise_tiles & 1);
    // Greedy rows and no logits out: l_k and its key, with no branches and no masks. Rows past
    // vocab_size (rows past V among them) are -inf, so their keys lose to any row below V; the slots
    // of requests past the batch are never published.
    const auto FoldPlain = [&](int i, int row, float base, float bias) {
      const float l = row < a.vocab_size ? base + bias : -INFINITY;
      const unsigned long long key = PackArgmaxKey(l, uint32_t(row));
      best[i] = key > best[i] ? key : best[i];
    };
    // EREGS scores tile n's MMAs before tile n - 1's epilogue, so that the epilogue's instructions
    // issue while the tensor cores work: the held tile is the one whose MMAs are done (its local
    // index, bf16 base logits and accumulators).
    int held_tile = 0;
    uint32_t held_a[EREGS ? kSlots : 1], held_b[EREGS ? kSlots : 1];
    int held_acc[EREGS ? 2 : 1][2][4];
    // Lane (g, t) folds rows 8h + 2t + c of the held tile for requests 8m + g (slot m).
    const auto PairOperandEpilogue = [&]() {
      const int row0 = RowOf(held_tile);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 scale = *reinterpret_cast<const float2*>(scales + held_tile * kTileRows + 8 * h + 2 * t);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          const uint32_t bits = h ? held_b[i] : held_a[i];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float dot = DigitPairToFloat(held_acc[EREGS ? i : 0][h][c], held_acc[EREGS ? i : 0][h][2 + c]);
            const float bias = ((c ? scale.y : scale.x) * dot) * UnscaleOf(i);
            FoldPlain(i, row0 + 8 * h + 2 * t + c, BaseToFloat<kBF16>(c ? bits >> 16 : bits), bias);
          }
        }
      }
    };
    for (int n = 0; n < loop_tiles; ++n) {
      const bool active = n < tiles.total();
      const int j = next_tile;
      const int row0 = RowOf(j), row_a = row0 + g, row_b = row0 + g + 8;
      const bool streamed = active && next_streamed;
      uint32_t next_a[kSlots], next_b[kSlots];
      if (active) {
        if (streamed) {
          ++is;
          streamed_slot = tiles.StreamedSlot(is);
        } else {
          if (kStep0InLoop && k == 0) LandResident(im);
          ++im;
        }
        if (!kBaseAhead) LoadBase(row0, base_a, base_b);
        if (n + 1 < tiles.total()) {
          next_streamed = streamed_slot == n + 1;
          next_tile = next_streamed ? tiles.Streamed(order, is) : tiles.Local(false, im);
          if (kBaseAhead) {
            LoadBase(RowOf(next_tile), next_a, next_b);
          }
          if (noise_pass) StageNoise(k, RowOf(next_tile), (noise_tiles + 1) & 1);
        }
      }
      // Dot products of the tile's rows g and g + 8 with each owned request's e (still scaled). A
      // streamed tile is taken straight from the prefetch registers (row order), a resident one as
      // step 0 left it (see above). Two copies of the operand code (no register copies of the
      // prefetch registers), one of the MMAs and one of the epilogue.
      float dot_a[kSlots], dot_b[kSlots];
      uint4* slot = reinterpret_cast<uint4*>(resident + size_t(j) * kTileBytes) + lane;
      // Calls use(rows_order, chunks) on the tile's chunks: the prefetch registers of a streamed
      // tile, or those of a resident one from shared memory (zeros for a warp past its tiles; only
      // the chunks that `use` reads are loaded).
      const auto WithChunks = [&](const auto& use) {
        if (streamed) {
          use(true, pre);
        } else {
          uint4 q[kChunks];
          if (active) {
#pragma unroll
            for (int i = 0; i < kChunks; ++i) q[i] = slot[i * 32];
          } else {
#pragma unroll
            for (int i = 0; i < kChunks; ++i) q[i] = make_uint4(0, 0, 0, 0);
          }
          use(!kFragmentOrder, q);
        }
      };
      // The A words of k-step s: rows g and g + 8 at k = 2t, 2t + 1 (x, y) and 2t + 8, 2t + 9 (z, w).
      const auto StepOperands = [&](bool rows_order, const uint4 (&chunks)[kChunks], int s) {
        if constexpr (W2 == kW2Int8) {
          // Row words s & 3 of chunk s >> 2: fragment-order chunk 2 (s >> 2) + ((s >> 1) & 1).
          const uint4 q = FragmentChunk<W2>(chunks, 2 * (s >> 2) + ((s >> 1) & 1), rows_order);
          const uint32_t wa = ((s & 1) ? q.z : q.x) ^ 0x80808080u;
          const uint32_t wb = ((s & 1) ? q.w : q.y) ^ 0x80808080u;
          return make_uint4(Int8PairToHalf2(wa, 0x4140), Int8PairToHalf2(wb, 0x4140), Int8PairToHalf2(wa, 0x4342),
                            Int8PairToHalf2(wb, 0x4342));
        } else {
          return FragmentChunk<W2>(chunks, s, rows_order);
        }
      };
      // EREGS: the digit dot products of requests 8m + g with rows 8h + 2t + c of the tile (acc[m][h]:
      // digits 0 at c, 1 at 2 + c). Each k-step's fragment words, from the prefetch registers of a
      // streamed tile or one 16-byte load of a resident one (fragment order), are the B operand of
      // both n-tiles.
      int acc[EREGS ? 2 : 1][2][4] = {};
      const auto PairOperandDots = [&](const auto& step_words) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const uint4 q = step_words(s);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const uint4 e = e_operands[m][s];
            Imma16832(acc[m][0], e.x, e.y, e.z, e.w, q.x, q.z);
            Imma16832(acc[m][1], e.x, e.y, e.z, e.w, q.y, q.w);
          }
        }
      };
      if constexpr (EREGS) {
        if (streamed) {
          PairOperandDots([&](int s) { return FragmentChunk<W2>(pre, s, true); });
        } else {
          PairOperandDots([&](int s) { return active ? slot[s * 32] : make_uint4(0, 0, 0, 0); });
        }
      } else if constexpr (!kWgmma) {
        const auto TileDots = [&](bool rows_order, const uint4 (&chunks)[kChunks]) {
          if constexpr (DIGITS) {
            int acc[2][4] = {};
#pragma unroll
            for (int s = 0; s < 8; ++s) {
              const int w = 2 * (s & 1);
              const uint4 q = FragmentChunk<W2>(chunks, s, rows_order);
              Imma16832(acc[s & 1], q.x, q.y, q.z, q.w, Word(digit_frag[s >> 1], w), Word(digit_frag[s >> 1], w + 1));
            }
            int c[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) c[e] = acc[0][e] + acc[1][e];
            // Columns 0-2 are request 0's digits (lanes t = 0, 1), columns 3-5 request 1's (t = 1, 2):
            // t = 0 takes digit 2 from t = 1, t = 2 takes digit 0 from t = 1.
            const int down0 = __shfl_down_sync(0xffffffffu, c[0], 1), down2 = __shfl_down_sync(0xffffffffu, c[2], 1);
            const int up1 = __shfl_up_sync(0xffffffffu, c[1], 1), up3 = __shfl_up_sync(0xffffffffu, c[3], 1);
            const bool first = t == 0;
            dot_a[0] = DigitsToFloat(first ? c[0] : up1, first ? c[1] : c[0], first ? down0 : c[1]);
            dot_b[0] = DigitsToFloat(first ? c[2] : up3, first ? c[3] : c[2], first ? down2 : c[3]);
          } else if constexpr (PAIRS) {
            // n-tile i: columns 2t, 2t + 1 are request 4i + t's digits 0 and 1, rows g and g + 8.
            int acc[kChains * NT][4] = {};
#pragma unroll
            for (int s = 0; s < 8; ++s) {
              const uint4 q = FragmentChunk<W2>(chunks, s, rows_order);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const uint2 bf = reinterpret_cast<const uint2*>(frag)[(nt * 8 + s) * 32 + lane];
                Imma16832(acc[(s % kChains) * NT + nt], q.x, q.y, q.z, q.w, bf.x, bf.y);
              }
            }
#pragma unroll
            for (int i = 0; i < kSlots; ++i) {
              int c[4] = {acc[i][0], acc[i][1], acc[i][2], acc[i][3]};
              if constexpr (kChains == 2) {
#pragma unroll
                for (int e = 0; e < 4; ++e) c[e] += acc[NT + i][e];
              }
              dot_a[i] = DigitPairToFloat(c[0], c[1]);
              dot_b[i] = DigitPairToFloat(c[2], c[3]);
            }
          } else {
            float acc[kChains * NT][4] = {};
#pragma unroll
            for (int s = 0; s < 16; ++s) {
              const uint4 op = StepOperands(rows_order, chunks, s);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const uint2 bf = reinterpret_cast<const uint2*>(frag)[(nt * 16 + s) * 32 + lane];
                Mma16816<W2 == kW2BF16>(acc[(s % kChains) * NT + nt], op.x, op.y, op.z, op.w, bf.x, bf.y);
              }
            }
#pragma unroll
            for (int i = 0; i < kSlots; ++i) {
              const int nt = SPLIT ? i : i / 2, c = SPLIT ? 0 : i % 2;
              float va[2] = {acc[nt][0], acc[nt][1]}, vb[2] = {acc[nt][2], acc[nt][3]};
              if constexpr (kChains == 2) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  va[e] += acc[NT + nt][e];
                  vb[e] += acc[NT + nt][2 + e];
                }
              }
              dot_a[i] = SPLIT ? va[0] + va[1] : va[c];
              dot_b[i] = SPLIT ? vb[0] + vb[1] : vb[c];
            }
          }
        };
        WithChunks(TileDots);
      } else {
        float d[4 * NT];
#pragma unroll
        for (int h = 0; h < 16 / kBatch; ++h) {
          uint32_t op[kBatch][4];
          const auto BatchOperands = [&](bool rows_order, const uint4 (&chunks)[kChunks]) {
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
              const uint4 v = StepOperands(rows_order, chunks, kBatch * h + i);
              op[i][0] = v.x;
              op[i][1] = v.y;
              op[i][2] = v.z;
              op[i][3] = v.w;
            }
          };
          WithChunks(BatchOperands);
          WgmmaBatch<NT, W2 == kW2BF16, kBatch>(op, frag_desc, h, d);
        }
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          const int nt = SPLIT ? i : i / 2, c = SPLIT ? 0 : i % 2;
          dot_a[i] = SPLIT ? d[4 * nt] + d[4 * nt + 1] : d[4 * nt + c];
          dot_b[i] = SPLIT ? d[4 * nt + 2] + d[4 * nt + 3] : d[4 * nt + 2 + c];
        }
      }
      if (streamed && is < tiles.n_streamed) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(order, is)), g, t, pre);
      if (!active) continue;

      const float scale_a = scales[j * kTileRows + g], scale_b = scales[j * kTileRows + g + 8];
      // This tile's staged noise: [B][16] floats.
      const float* tile_noise = noise_stage + (size_t(warp) * 2 + (noise_tiles & 1)) * batch * kTileRows;
      if (noise_pass) {
        MbarrierWait(&noise_bar[2 * warp + (noise_tiles & 1)], (noise_tiles >> 1) & 1);
        ++noise_tiles;
      }
      // The noise of request rq's row in shared memory, for the branch-free epilogue: the stage's or
      // the fill's, noise_src[rq * noise_stride + noise_offset + row]. The wgmma kernels take it so (one
      // load a value, not two and a select); in the 16-warp kernels the three registers spill.
      const float* noise_src = noise_pass ? tile_noise : noise;
      const int noise_stride = noise_pass ? kTileRows : stage_rows, noise_offset = noise_pass ? -row0 : -first_row;
      // Greedy rows and no logits out (FoldPlain), for base logits of dtype decltype(base_dtype)::value.
      const auto PlainEpilogue = [&](auto base_dtype) {
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          const float unscale_i = UnscaleOf(i);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float bias = ((h ? scale_b : scale_a) * (h ? dot_b[i] : dot_a[i])) * unscale_i;
            FoldPlain(i, h ? row_b : row_a, BaseToFloat<decltype(base_dtype)::value>(h ? base_b[i] : base_a[i]), bias);
          }
        }
      };
      // Sampled rows whose noise is in shared memory (the fill or the stage), and greedy rows with
      // logits out: l_k, rounded to the logits dtype decltype(logits_dtype)::value (kNone: no logits
      // out; kAnyDType: a.logits_dtype, by selects, and the logits staged if any), and its Gumbel
      // score, with selects and predicated stores rather than branches. The noise is read only for
      // sampled requests (only they have it); rows past vocab_size score -inf, whatever noise they read.
      // known_form (std::true_type): the launch's common form, known here so that the rows' loads, stores
      // and noise take no selects (Session 23: 68 instructions a value at B = 16): bf16 base logits,
      // logits out in bf16 (the digit kernel: or float32, by its FORM), staged where this kernel stages
      // them (kStagedOut: no store addresses), and the noise of sampled rows where this kernel reads it
      // (kNoisePass: the tile's stage, else the fill's).
      // There the digit kernel splits the rows between lanes (kSplitRows): lane t = 0, 2 computes l of
      // rows g and g + 8 of request t / 2 and passes row g + 8's to lane t + 1, and each finishes one
      // (its rounding, store, noise and key) where both did two; step 3 merges lane t + 1's keys.
      const auto NoiseFreeEpilogue = [&](auto logits_dtype, auto known_form) {
        constexpr int kOut = decltype(logits_dtype)::value;
        constexpr bool kKnown = decltype(known_form)::value;
        constexpr bool kStage = kOut != kNone && StagesLogits(NT, SPLIT, DIGITS, kOut == kF32);
        constexpr bool kSplitRows = kKnown && DIGITS;
        const bool stage_out = kKnown ? kStagedOut : staged_out;
        uint32_t stored[2][2];  // kStage: an n-tile's stored bits, [h][i % 2]
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          const int owner = kSplitRows ? t / 2 : SlotRequest<SPLIT, DIGITS>(i, t), rq = min(owner, batch - 1);
          const float it = inv_t[rq];
          const int out_line = rq * steps + k;  // of logits [B, K, V]
          const int noise_line = rq * noise_stride + noise_offset;
          const float unscale_i = UnscaleOf(i);
          const auto Logit = [&](int h) {  // l of row g + 8 h, right in the lanes that own a request
            const int row = h ? row_b : row_a;
            const float bias = ((h ? scale_b : scale_a) * (h ? dot_b[i] : dot_a[i])) * unscale_i;
            const uint32_t base_bits = h ? base_b[i] : base_a[i];
            return row < a.vocab_size ? (kKnown ? BaseToFloat<kBF16>(base_bits) : BitsToFloat(base_bits, a.base_dtype)) + bias : -INFINITY;
          };
          float split_l = 0.0f;
          if constexpr (kSplitRows) {
            const float high = __shfl_up_sync(0xffffffffu, Logit(1), 1);
            split_l = t & 1 ? high : Logit(0);
          }
#pragma unroll
          for (int h = 0; h < (kSplitRows ? 1 : 2); ++h) {
            const int row = kSplitRows ? (t & 1 ? row_b : row_a) : (h ? row_b : row_a);
            float l = kSplitRows ? split_l : Logit(h);
            if constexpr (kOut == kAnyDType) {
              l = StoreRoundedSelect(nullptr, 0, a.logits_dtype, l, false, &stored[h][i % 2]);
            } else if constexpr (kOut != kNone) {
              const bool direct_store = kKnown ? !kStagedOut : !staged_out;
              l = StoreRoundedAs<kOut>(a.logits, direct_store ? size_t(out_line) * vocab + row : 0, l,
                                       direct_store && owner < batch && row < vocab, &stored[h][i % 2]);
            }
            float score = l;
            if (it > 0.0f) {
              score = __fadd_rn(__fmul_rn(l, it), kKnown ? (kNoisePass ? tile_noise[rq * kTileRows + h * 8 + g]
                                                                             : noise[rq * stage_rows + row - first_row])
                                                   : kWgmma ? noise_src[noise_line + row]
                                                   : noise_pass ? tile_noise[rq * kTileRows + row - row0]
                                                                : noise[rq * stage_rows + row - first_row]);
            }
            const unsigned long long key = PackArgmaxKey(row < a.vocab_size ? score : -INFINITY, uint32_t(row));
            best[i] = key > best[i] ? key : best[i];
          }
          if constexpr (kStage) {
            if (stage_out && i % 2 == 1) StageLogits(i / 2, stored);
          }
        }
        if constexpr (kStage) {
          if (stage_out) FlushLogits(k, row0);
        }
      };
      // Every other case. Sampled batches with neither the fill nor the stage compute their noise here;
      // the wgmma kernels that of kNoiseGroup slots' two rows at a time, for greedy requests too
      // (unused), in lockstep (GumbelNoise<N>): one chain of dependent multiplies at a time leaves the
      // warp waiting on each. One copy of this code, the logits dtype chosen with selects: a copy per
      // dtype spills registers at 16 slots a thread.
      const auto GeneralEpilogue = [&]() {
        const bool compute_noise = any_sampled && !a.noise_ahead && !noise_pass;
#pragma unroll
        for (int i0 = 0; i0 < kSlots; i0 += kNoiseGroup) {
          float gumbel[2 * kNoiseGroup];
          if (kGroupNoise && compute_noise) {
            uint32_t k0[2 * kNoiseGroup], k1[2 * kNoiseGroup], v[2 * kNoiseGroup], position[2 * kNoiseGroup];
#pragma unroll
            for (int c = 0; c < 2 * kNoiseGroup; ++c) {
              const int rq = min(SlotRequest<SPLIT, DIGITS>(i0 + c / 2, t), batch - 1);
              k0[c] = key0[rq];
              k1[c] = key1[rq];
              v[c] = uint32_t(c % 2 ? row_b : row_a);
              position[c] = pos[rq] + uint32_t(k);
            }
            GumbelNoise<2 * kNoiseGroup, false, kWalkLogf>(k0, k1, v, position, gumbel);
          }
#pragma unroll
          for (int j = 0; j < kNoiseGroup; ++j) {
            const int i = i0 + j, rq = SlotRequest<SPLIT, DIGITS>(i, t);
            if (rq >= batch) continue;
            const float unscale_i = UnscaleOf(i);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = h ? row_b : row_a;
              if (row >= vocab) continue;
              const size_t index = (size_t(rq) * steps + k) * vocab + row;
              const float bias = ((h ? scale_b : scale_a) * (h ? dot_b[i] : dot_a[i])) * unscale_i;
              float l = row < a.vocab_size ? BitsToFloat(h ? base_b[i] : base_a[i], a.base_dtype) + bias : -INFINITY;
              l = StoreRoundedSelect(a.logits, index, a.logits_dtype, l, a.logits != nullptr);
              float score = l;
              if (inv_t[rq] > 0.0f) {
                const float noise_of = a.noise_ahead ? noise[rq * stage_rows + row - first_row]
                                       : noise_pass  ? tile_noise[rq * kTileRows + row - row0]
                                       : kGroupNoise ? gumbel[2 * j + h]
                                                     : GumbelNoise<kWalkLogf>(key0[rq], key1[rq], uint32_t(row), pos[rq] + uint32_t(k));
                score = __fadd_rn(__fmul_rn(l, inv_t[rq]), noise_of);
              }
              const unsigned long long packed = PackArgmaxKey(score, uint32_t(row));
              best[i] = packed > best[i] ? packed : best[i];
            }
          }
        }
      };
      if constexpr (EREGS) {
        if (n > 0) PairOperandEpilogue();
        held_tile = j;
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          held_a[i] = base_a[i];
          held_b[i] = base_b[i];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 4; ++e) held_acc[i][h][e] = acc[i][h][e];
          }
        }
      } else if constexpr (FORM == kPlainForm) {
        PlainEpilogue(std::integral_constant<int, kBF16>());
      } else if (LogitsForm(FORM)) {
        NoiseFreeEpilogue(std::integral_constant<int, FormLogits(FORM)>(), std::true_type());
      } else if (plain && a.base_dtype == kBF16) {
        PlainEpilogue(std::integral_constant<int, kBF16>());
      } else if (plain && a.base_dtype == kF16) {
        PlainEpilogue(std::integral_constant<int, kF16>());
      } else if (plain) {
        PlainEpilogue(std::integral_constant<int, kF32>());
      } else if (!DIGITS && kNoiseFreeEpilogue && !SPLIT && a.logits != nullptr && a.logits_dtype == kBF16 &&
                 a.base_dtype == kBF16 && (!kStagedOut || staged_out) &&
                 (!any_sampled || (kNoisePass ? noise_pass : a.noise_ahead))) {
        // The launch's common form. The digit kernel has an instance of its own for it (kBF16LogitsForm, above,
        // picked by Launch): its split-row epilogue, compiled beside the others, spilled registers in
        // the tile loop of every launch.
        NoiseFreeEpilogue(std::integral_constant<int, kBF16>(), std::true_type());
      } else if (kNoiseFreeEpilogue && noise_free && a.logits == nullptr) {
        NoiseFreeEpilogue(std::integral_constant<int, kNone>(), std::false_type());
      } else if (kNoiseFreeEpilogue && noise_free && a.logits_dtype == kF32) {
        NoiseFreeEpilogue(std::integral_constant<int, kF32>(), std::false_type());
      } else if (kNoiseFreeEpilogue && noise_free && a.logits_dtype == kBF16) {
        NoiseFreeEpilogue(std::integral_constant<int, kBF16>(), std::false_type());
      } else if (kNoiseFreeEpilogue && noise_free) {
        NoiseFreeEpilogue(std::integral_constant<int, kF16>(), std::false_type());
      } else if (!kNoiseFreeEpilogue && noise_free && (staged_out || a.logits == nullptr)) {
        NoiseFreeEpilogue(std::integral_constant<int, kAnyDType>(), std::false_type());
      } else {
        // At 16 slots a thread, where the epilogue above would spill in four copies, sampled batches
        // that compute their noise come here, and those with logits out that cannot be staged.
        GeneralEpilogue();
      }
      // The int8 kernels but the digit one copy only where the next tile's bits were loaded: after
      // the last tile the copy reads registers left from the step before and keeps them live. That
      // measured 8 % faster at 8 requests but up to 7 % slower in the bf16 head and 1 % in the digit
      // kernel, where ptxas schedules the rest worse (NOTES, Session 39).
      constexpr bool kGuardedCopy = W2 == kW2Int8 && !DIGITS;
      if (kBaseAhead && (!kGuardedCopy || n + 1 < tiles.total())) {
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          base_a[i] = next_a[i];
          base_b[i] = next_b[i];
        }
      }
    }
    if constexpr (EREGS) {
      if (tiles.total() > 0) PairOperandEpilogue();
    }

    StampWarp(a, k, warp);

    // 3. Reduce over the 8 lanes that share t, then across warps in shared memory.
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
#pragma unroll
      for (int m = EREGS ? 1 : 4; m < (EREGS ? 4 : 32); m <<= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best[i], m);
        best[i] = other > best[i] ? other : best[i];
      }
      if (LogitsForm(FORM)) {  // the split-row epilogue: lane t + 1 holds the keys of rows g + 8
        const unsigned long long other = __shfl_down_sync(0xffffffffu, best[i], 1);
        best[i] = other > best[i] ? other : best[i];
      }
      const int rq = SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g);
      if ((EREGS ? t : g) == 0 && rq < batch && best[i] != 0) atomicMax(&cta_best[rq], best[i]);
    }
    __syncthreads();
    Stamp(a, k, 4);

    // 4. Publish one key per request and arrive; the wait comes at the top of the next step, after
    //    its prefetches are issued. A direct slot always gets a key (1: no candidate here).
    PublishKeys(a, k, direct, batch, steps, cta_best, tid);
    Stamp(a, k, 5);
  }

  // The workspace is left zeroed for the next call on this stream, with no grid-wide arrival for the
  // direct exchange: each CTA cleared its slots of steps 0 .. steps - 3 as it went (PublishKeys), and
  // CTA 0, which alone read the last step's keys, clears steps - 2 and steps - 1 (every CTA read
  // step steps - 2's slots before it published the step steps - 1 keys that CTA 0 gathered). With
  // the atomic exchange the last CTA out clears the keys and the counters.
  if (direct) {
    if (blockIdx.x == 0) {
      __syncthreads();
      const int first = max(0, steps - 2) * batch * gridDim.x;
      ClearWords(a.slots + first, steps * batch * gridDim.x - first, tid, THREADS);
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
    if constexpr (DIGITS) {
      // The whole range of the atomic keys: the written words' index below left this kernel two
      // registers spilled and reloaded every step (NOTES, Session 37).
      for (int i = tid; i < int(AtomicKey(steps, 0)); i += THREADS) a.slots[i] = 0;
    } else {
      // Only the words written: the atomic keys, one a line.
      for (int i = tid; i < steps * batch; i += THREADS) a.slots[AtomicKey(i / batch, i % batch)] = 0;
    }
    if (tid == 0) {
      a.counters[0] = 0;
      a.counters[1] = 0;
    }
  }
}
// ---------------------------------------------------------------------------------------------
// Host side: one launch of up to kMaxBatch columns.

inline ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_markov CUDA walk: ") + what + ": " + cudaGetErrorString(err));
}

inline ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_markov CUDA walk: " + msg);
}

// Raises a kernel's shared-memory limit to the device maximum and checks that one CTA of `threads`
// fits per SM, once per kernel and device: these calls cost host time on every launch otherwise.
inline cudaError_t PrepareOnce(const void* kernel, int device, int threads, const DeviceProperties& props) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, cudaError_t> prepared;
  std::lock_guard<std::mutex> lock(mu);
  auto it = prepared.find({kernel, device});
  if (it == prepared.end()) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, props.smem_per_block);
    int per_sm = 0;
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, props.smem_per_block);
    if (err == cudaSuccess && per_sm < 1) err = cudaErrorCooperativeLaunchTooLarge;
    it = prepared.emplace(std::make_pair(kernel, device), err).first;
  }
  return it->second;
}

// Rows of W2 per CTA on `sm_count` SMs.
inline int RowsPerCta(int vocab, int sm_count) {
  const int total_tiles = (vocab + kTileRows - 1) / kTileRows;
  return (total_tiles + sm_count - 1) / sm_count * kTileRows;
}

// Whether each step's Gumbel noise of `batch` requests fits in shared memory (FillNoise): small
// batches compute it there, at the price of about one resident W2 tile per request.
inline bool NoiseFitsAhead(int batch, int rows_per_cta) {
  return size_t(batch) * rows_per_cta * sizeof(float) <= size_t(kMaxNoiseBytes);
}

// One launch of up to kMaxBatch columns. A sampled batch whose noise does not fit ahead, given
// `noise_buffer` (room for [K, ceil(V / 16), batch, 16] floats), has its noise computed there first by
// MarkovWalkNoise, on the same stream.
template <int NT, bool SPLIT, bool DIGITS, int W2, bool PAIRS = false, bool EREGS = false>
ffi::Error Launch(cudaStream_t stream, int device, const DeviceProperties& props, WalkArgs args, float* noise_buffer) {
  // 16 warps for int8 W2 up to 16 columns (at most 128 registers: some kernels spill a few dozen
  // bytes), since a tile is a chain of latencies that other warps cover; 16-bit W2 tiles and wider
  // batches hold more registers per lane.
  // EREGS holds e's 64 operand registers a lane beside a streamed tile's 32: 8 warps (218 registers;
  // at 12 warps, 168 registers, ptxas spills in the tile loop and the walk took 9 % longer: NOTES, Session 45).
  constexpr int kThreads = EREGS ? 256 : (NT <= 2 && W2 == kW2Int8 ? 512 : 256);
  constexpr int kTileBytes = kTileElements * W2Bytes(W2);
  if (size_t(args.batch) * args.steps * args.vocab > 0xffffffffu) {
    return Invalid("B x K x V of one launch must stay below 2^32 (base logits are addressed in 32 bits)");
  }
  const int grid = props.sm_count;
  const int rows_per_cta = RowsPerCta(args.vocab, grid);
  args.tiles_per_cta = rows_per_cta / kTileRows;
  // Small batches (kernels of up to 16 columns) stage each step's base logits in shared memory (one
  // bulk copy per step, issued before the grid-wide wait), at the price of a few resident W2 tiles.
  // The staging is a template parameter: were it chosen at run time, the registers that take the
  // staged logits would also take global loads, and every wait on them would wait for the global
  // loads in flight (the streamed tiles' prefetch among them).
  const int esize = args.base_dtype == kF32 ? 4 : 2;
  const int stage_bytes = args.batch * rows_per_cta * esize;
  const bool stage = NT <= 2 && (size_t(args.vocab) * esize) % 16 == 0 && stage_bytes <= kMaxStageBytes;
  const int noise_bytes = args.batch * rows_per_cta * int(sizeof(float));
  args.noise_ahead = args.sampling && NoiseFitsAhead(args.batch, rows_per_cta);
  // EREGS has only the plain form (LaunchForColumns picks it for such launches alone).
  constexpr int kForm = EREGS ? kPlainForm : kAnyForm;
  auto kernel = MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, false, kForm, PAIRS, EREGS>;
  if constexpr (NT <= 2) {
    if (stage) kernel = MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, true, kForm, PAIRS, EREGS>;
  }
  // The digit kernel's instances for the known launch forms (LaunchForm).
  if constexpr (DIGITS) {
    const bool logits_form = args.base_dtype == kBF16 && args.logits != nullptr && (!args.sampling || args.noise_ahead);
    if (logits_form && args.logits_dtype == kBF16) {
      kernel = stage ? MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, true, kBF16LogitsForm>
                     : MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, false, kBF16LogitsForm>;
    } else if (logits_form && args.logits_dtype == kF32) {
      kernel = stage ? MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, true, kF32LogitsForm>
                     : MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, false, kF32LogitsForm>;
    } else if (args.base_dtype == kBF16 && args.logits == nullptr && !args.sampling) {
      kernel = stage ? MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, true, kPlainForm>
                     : MarkovWalkKernel<NT, SPLIT, DIGITS, W2, kThreads, false, kPlainForm>;
    }
  }
  args.noise = nullptr;
  if (ReadsNoisePass(NT, SPLIT, DIGITS) && args.sampling && !args.noise_ahead && !stage && noise_buffer != nullptr) {
    const dim3 noise_grid((args.vocab + kNoiseValuesPerBlock - 1) / kNoiseValuesPerBlock, args.steps, args.batch);
    MarkovWalkNoise<kNoiseChains><<<noise_grid, kNoiseThreads, 0, stream>>>(args, noise_buffer);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError("launching MarkovWalkNoise", err);
    args.noise = noise_buffer;
  }
  const int noise_stage_bytes = args.noise != nullptr ? kThreads / 32 * Smem<NT, PAIRS>::NoiseStageFloats(args.batch) * int(sizeof(float)) : 0;
  // Logits go out 8 rows of a request (16 or 32 bytes) a store where StagesLogits and V % 8 == 0 (so
  // that every store is aligned and a tile's rows past V are whole pieces).
  args.logits_staged = StagesLogits(NT, SPLIT, DIGITS, args.logits_dtype == kF32) && args.logits != nullptr &&
                       args.vocab % 8 == 0;
  const int out_stage_bytes = args.logits_staged ? kThreads / 32 * Smem<NT, PAIRS>::OutStageBytes(args.logits_dtype == kF32) : 0;
  const int fixed = Smem<NT, PAIRS>::kFixedBytes + rows_per_cta * int(sizeof(float)) + (stage ? stage_bytes : 0) +
                    (args.noise_ahead ? noise_bytes : 0) + noise_stage_bytes + out_stage_bytes;
  args.resident_tiles = std::min(args.tiles_per_cta, (props.smem_per_block - fixed) / kTileBytes);
  if (args.resident_tiles < 0) return Invalid("not enough shared memory per block");
  const int smem = fixed + args.resident_tiles * kTileBytes;
  const cudaError_t prepared = PrepareOnce(reinterpret_cast<const void*>(kernel), device, kThreads, props);
  if (prepared != cudaSuccess) return CudaError("preparing the kernel", prepared);
  void* params[] = {&args};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(kThreads), params, smem, stream);
  if (err != cudaSuccess) return CudaError("cudaLaunchCooperativeKernel", err);
  return ffi::Error::Success();
}

}  // namespace walk
}  // namespace jax_markov
