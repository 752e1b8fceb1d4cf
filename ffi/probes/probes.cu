// Probe kernels that measure the constants of the walk kernel's design floor on the GPU they run on
// (benchmarks/design_floor.py has the formula that uses them). Built only with -DJAX_MARKOV_PROBES=ON,
// into the module `jax_markov._markov_probes` (probes/module.cc).
//
// Timing: a warm-up call, then kRuns runs of back-to-back calls between two CUDA events; the result
// is the median run's time per call. Each run's calls queue behind a sleep kernel, so the events
// time the GPU and not the rate at which the host enqueues launches.
// Bandwidth probes read 16-byte vectors with kUnroll loads in flight per thread; their loads are
// inline PTX (volatile) and fold into a value written out, so the compiler keeps every one of them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/walk_common.h"
#include "cuda/wgmma.cuh"
#include "probes/probes.h"

namespace jax_markov {
namespace {

constexpr int kRuns = 7;
constexpr long long kSleepNs = 5000000;  // longer than the host needs to enqueue one run's calls
constexpr int kUnroll = 4;
constexpr int kReadThreads = 1024;  // bandwidth probes
constexpr int kWalkThreads = 512;   // the walk kernel's CTA size at B <= 16
constexpr int kMaxRequests = 128;   // the walk kernel's largest batch
constexpr int kExchangeRounds = 1000;
constexpr int kMmaChains = 8;
constexpr int kMmaIters = 16384;
constexpr int kNoisePerThread = 1024;
constexpr size_t kCopyBytes = size_t(1) << 30;
constexpr size_t kL2BufferBytes = size_t(24) << 20;
constexpr size_t kReadBytesPerCall = size_t(16) << 30;  // ~2 ms from L2, ~0.5 ms from shared memory

void Check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    throw std::runtime_error("jax_markov design probes: " + what + ": " + cudaGetErrorString(err));
  }
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SleepKernel(long long ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < uint64_t(ns)) __nanosleep(10000);
}

__device__ __forceinline__ uint4 LoadSharedV4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 LoadGlobalCgV4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t Fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// dst = src, `iters` steps of kUnroll grid-wide rows of 16-byte vectors (all loads before the stores).
__global__ void CopyKernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int iters) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int it = 0; it < iters; ++it, i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
}

// Shared memory holds `chunks` rows of blockDim 16-byte vectors; thread t reads vector t of each row
// in turn, `loads` times, so a warp reads 512 contiguous bytes (conflict-free).
__global__ void SmemReadKernel(int chunks, int loads, uint32_t* sink) {
  extern __shared__ uint4 smem[];
  for (int c = 0; c < chunks; ++c) smem[c * blockDim.x + threadIdx.x] = make_uint4(c, threadIdx.x, blockIdx.x, 1);
  __syncthreads();
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem + threadIdx.x));
  const uint32_t row_bytes = blockDim.x * sizeof(uint4);
  uint32_t acc = 0;
  int c = 0;
  for (int i = 0; i < loads; i += kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = LoadSharedV4(base + c * row_bytes);
      c = c + 1 == chunks ? 0 : c + 1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= Fold(v[u]);
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// The same pattern over a global buffer of `chunks` grid-wide rows, read through L2 only (.cg).
__global__ void L2ReadKernel(const uint4* buffer, int chunks, int loads, uint32_t* sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t t = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  int c = 0;
  for (int i = 0; i < loads; i += kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = LoadGlobalCgV4(buffer + c * stride + t);
      c = c + 1 == chunks ? 0 : c + 1;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= Fold(v[u]);
  }
  sink[t] = acc;
}

__device__ __forceinline__ unsigned int LoadAcquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// `rounds` grid-wide exchanges as the walk kernel makes one per step: a block reduce of one 64-bit key
// per thread, one atomicMax per request into the round's slots (a line a request: kKeyStride), the
// arrival counter as grid barrier, then the slots are read back and feed the next round's keys. Runs
// with kWalkThreads threads.
__global__ void ExchangeKernel(unsigned long long* slots, unsigned int* arrivals, int rounds, int requests,
                               unsigned long long* sink) {
  __shared__ unsigned long long warp_best[kWalkThreads / 32];
  __shared__ unsigned long long chosen[kMaxRequests];
  const int tid = threadIdx.x;
  unsigned long long prev = 0;
  for (int r = 0; r < rounds; ++r) {
    unsigned long long key = (prev ^ (uint64_t(blockIdx.x) << 32 | tid)) * 0x9E3779B97F4A7C15ull;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, m));
    if (tid % 32 == 0) warp_best[tid / 32] = key;
    __syncthreads();
    unsigned long long* round_slots = slots + size_t(r) * requests * kKeyStride;
    if (tid < requests) {
      unsigned long long best = 0;
      for (int w = 0; w < kWalkThreads / 32; ++w) best = max(best, warp_best[w] ^ tid);
      atomicMax(&round_slots[tid * kKeyStride], best);
      __threadfence();
    }
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(arrivals, 1u);
      const unsigned int target = gridDim.x * (r + 1);
      while (LoadAcquire(arrivals) < target) {
      }
      __threadfence();
    }
    __syncthreads();
    if (tid < requests) chosen[tid] = __ldcg(&round_slots[tid * kKeyStride]);
    __syncthreads();
    prev = chosen[tid % requests];
  }
  if (blockIdx.x == 0 && tid == 0) *sink = prev;
}

// kMmaChains independent accumulator chains per warp, so that the tensor cores, not the latency of
// one chain, set the rate. Operands are 1.0: the sums stay exact and finite.
__global__ void MmaKernel(int iters, float* sink) {
  const uint32_t a = 0x3c003c00u, b = 0x3c003c00u;  // two fp16 1.0 per register
  float c[kMmaChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kMmaChains; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b));
    }
  }
  float sum = 0;
#pragma unroll
  for (int k = 0; k < kMmaChains; ++k) sum += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// Every warpgroup issues m64n64k16 wgmmas (A from registers, B from shared memory, all operands 1.0)
// in groups of kMmaChains, keeping two groups in flight, so that the tensor cores, not the waits, set
// the rate. The sums stay exact: 16 per wgmma, at most 2^21 wgmmas.
__global__ void __launch_bounds__(kWalkThreads, 1) WgmmaKernel(int iters, float* sink) {
  __shared__ __align__(128) uint32_t b[16 * 64 / 2];  // [16 x 64] fp16 ones: every layout reads 1.0
  for (int i = threadIdx.x; i < 16 * 64 / 2; i += blockDim.x) b[i] = 0x3c003c00u;
  FenceSharedForAsyncProxy();
  __syncthreads();
  uint32_t a;  // two fp16 1.0, set once: a constant rematerialized before every wgmma would need a fence
  asm volatile("mov.b32 %0, 0x3c003c00;" : "=r"(a));
  const uint64_t desc = WgmmaDescriptor(b, 128, 256);
  float d[32];
  WgmmaFence();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < kMmaChains; ++k) Wgmma<8, false>(d, a, a, a, a, desc, it > 0 || k > 0);
    WgmmaCommit();
    WgmmaWaitGroup<1>();
  }
  WgmmaWait<0>(d);
  float sum = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) sum += d[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// The walk's Gumbel noise (walk_common.h) of `per_thread` consecutive columns per thread (a multiple
// of 4: one Philox block gives four), as a sampled row needs one per (request, vocabulary row) and
// step, with the key and position as run-time values, as in the walk; the xor of their bits is written
// out, so that the compiler keeps every one.
__global__ void NoiseKernel(int per_thread, uint32_t key0, uint32_t key1, uint32_t position, uint32_t* sink) {
  const uint32_t first_block = (blockIdx.x * blockDim.x + threadIdx.x) * uint32_t(per_thread / 4);
  const uint32_t k0[1] = {key0}, k1[1] = {key1}, p[1] = {position};
  uint32_t bits = 0;
  for (int q = 0; q < per_thread / 4; ++q) {
    const uint32_t block[1] = {first_block + q};
    float g[1][4];
    GumbelNoiseBlock<1>(k0, k1, block, p, g);
    bits ^= __float_as_uint(g[0][0]) ^ __float_as_uint(g[0][1]) ^ __float_as_uint(g[0][2]) ^ __float_as_uint(g[0][3]);
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = bits;
}

__global__ void EmptyKernel() {}

// What the probes allocate, freed (and the caller's device restored) also when a probe throws.
struct Scope {
  int previous_device = -1;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<void*> buffers;

  ~Scope() {
    // Errors here are not reported: a failing probe's own error is the one worth raising.
    for (void* p : buffers) cudaFree(p);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (previous_device >= 0) cudaSetDevice(previous_device);
  }

  template <class T>
  T* Alloc(size_t count) {
    buffers.reserve(buffers.size() + 1);  // so that push_back cannot throw and leak the allocation
    void* p = nullptr;
    Check(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc(" + std::to_string(count * sizeof(T)) + " bytes)");
    buffers.push_back(p);
    return static_cast<T*>(p);
  }
};

template <class Launch>
double SecondsPerCall(const Scope& s, int calls, Launch launch) {
  launch();
  Check(cudaStreamSynchronize(s.stream), "warm-up call");
  double seconds[kRuns];
  for (double& run : seconds) {
    SleepKernel<<<1, 1, 0, s.stream>>>(kSleepNs);
    Check(cudaGetLastError(), "sleep kernel launch");
    Check(cudaEventRecord(s.start, s.stream), "cudaEventRecord");
    for (int i = 0; i < calls; ++i) launch();
    Check(cudaEventRecord(s.stop, s.stream), "cudaEventRecord");
    Check(cudaEventSynchronize(s.stop), "probe run");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, s.start, s.stop), "cudaEventElapsedTime");
    run = ms * 1e-3 / calls;
  }
  std::sort(seconds, seconds + kRuns);
  return seconds[kRuns / 2];
}

// CTAs of `threads` threads of `kernel` that fit on one SM without dynamic shared memory.
template <class Kernel>
int BlocksPerSm(Kernel kernel, int threads) {
  int per_sm = 0;
  Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return per_sm;
}

// The dynamic shared memory that fills the opt-in maximum, so that exactly one CTA of `kernel` runs
// per SM, as the walk kernel does.
template <class Kernel>
int OnePerSmDynamicSmem(Kernel kernel, int threads, int smem_per_block) {
  cudaFuncAttributes attr;
  Check(cudaFuncGetAttributes(&attr, kernel), "cudaFuncGetAttributes");
  const int dynamic = smem_per_block - int(attr.sharedSizeBytes);
  Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic), "cudaFuncSetAttribute");
  int per_sm = 0;
  Check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (per_sm != 1) {
    throw std::runtime_error("jax_markov design probes: a probe CTA with all shared memory fits " +
                             std::to_string(per_sm) + " times per SM, expected once");
  }
  return dynamic;
}

double HbmCopyBytesPerSecond(Scope& s, int sm_count, int l2_bytes) {
  const int grid = sm_count * BlocksPerSm(CopyKernel, kReadThreads);
  const size_t step_bytes = size_t(grid) * kReadThreads * kUnroll * sizeof(uint4);
  size_t free_bytes = 0, total_bytes = 0;
  Check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  // Leave room for the caller (JAX keeps a share of the memory free, not all of it).
  const int iters = int(std::min(kCopyBytes, free_bytes / 4) / step_bytes);
  const size_t bytes = iters * step_bytes;
  if (bytes < 4 * size_t(l2_bytes)) {  // a smaller copy would partly run from L2
    throw std::runtime_error("jax_markov design probes: the copy probe needs 2 x " +
                             std::to_string(4 * size_t(l2_bytes) >> 20) + " MiB of device memory, " +
                             std::to_string(free_bytes >> 20) + " MiB are free");
  }
  uint4* src = s.Alloc<uint4>(bytes / sizeof(uint4));
  uint4* dst = s.Alloc<uint4>(bytes / sizeof(uint4));
  Check(cudaMemsetAsync(src, 1, bytes, s.stream), "cudaMemsetAsync");
  const double t = SecondsPerCall(s, 10, [&] {
    CopyKernel<<<grid, kReadThreads, 0, s.stream>>>(src, dst, iters);
    Check(cudaGetLastError(), "copy kernel launch");
  });
  return 2.0 * double(bytes) / t;
}

double SmemReadBytesPerSecond(Scope& s, int sm_count, int smem_per_block) {
  const int smem = OnePerSmDynamicSmem(SmemReadKernel, kReadThreads, smem_per_block);
  const int row_bytes = kReadThreads * sizeof(uint4);
  const int chunks = smem / row_bytes;
  const size_t threads = size_t(sm_count) * kReadThreads;
  const int loads = int(kReadBytesPerCall / (threads * sizeof(uint4)) / kUnroll * kUnroll);
  uint32_t* sink = s.Alloc<uint32_t>(threads);
  const double t = SecondsPerCall(s, 5, [&] {
    SmemReadKernel<<<sm_count, kReadThreads, smem, s.stream>>>(chunks, loads, sink);
    Check(cudaGetLastError(), "shared-memory read kernel launch");
  });
  return double(threads) * loads * sizeof(uint4) / t;
}

double L2ReadBytesPerSecond(Scope& s, int sm_count, int l2_bytes) {
  const int grid = sm_count * BlocksPerSm(L2ReadKernel, kReadThreads);
  const size_t threads = size_t(grid) * kReadThreads;
  const size_t row_bytes = threads * sizeof(uint4);
  // Well inside the L2, so that after the warm-up call every read hits it.
  const int chunks = int(std::max<size_t>(1, std::min(kL2BufferBytes, size_t(l2_bytes) / 2) / row_bytes));
  const int loads = int(kReadBytesPerCall / row_bytes / kUnroll * kUnroll);
  uint4* buffer = s.Alloc<uint4>(chunks * threads);
  uint32_t* sink = s.Alloc<uint32_t>(threads);
  Check(cudaMemsetAsync(buffer, 1, chunks * row_bytes, s.stream), "cudaMemsetAsync");
  const double t = SecondsPerCall(s, 5, [&] {
    L2ReadKernel<<<grid, kReadThreads, 0, s.stream>>>(buffer, chunks, loads, sink);
    Check(cudaGetLastError(), "L2 read kernel launch");
  });
  return double(threads) * loads * sizeof(uint4) / t;
}

// Seconds per exchange round with `requests` requests: (time of kExchangeRounds rounds - time of one
// round) / (kExchangeRounds - 1), which cancels the launch and the slot clearing.
double ExchangeSeconds(Scope& s, int sm_count, int smem_per_block, int requests) {
  const int smem = OnePerSmDynamicSmem(ExchangeKernel, kWalkThreads, smem_per_block);
  const size_t slot_bytes = size_t(kExchangeRounds) * kMaxRequests * kKeyStride * sizeof(unsigned long long);
  unsigned long long* slots = s.Alloc<unsigned long long>(slot_bytes / sizeof(unsigned long long));
  unsigned int* arrivals = s.Alloc<unsigned int>(1);
  unsigned long long* sink = s.Alloc<unsigned long long>(1);
  auto seconds = [&](int rounds, int calls) {
    return SecondsPerCall(s, calls, [&] {
      Check(cudaMemsetAsync(slots, 0, slot_bytes, s.stream), "cudaMemsetAsync");
      Check(cudaMemsetAsync(arrivals, 0, sizeof(unsigned int), s.stream), "cudaMemsetAsync");
      void* params[] = {&slots, &arrivals, &rounds, &requests, &sink};
      Check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(ExchangeKernel), dim3(sm_count), dim3(kWalkThreads),
                                        params, smem, s.stream),
            "cudaLaunchCooperativeKernel (exchange probe)");
    });
  };
  return (seconds(kExchangeRounds, 3) - seconds(1, 20)) / (kExchangeRounds - 1);
}

double MmaPerSecond(Scope& s, int sm_count, int smem_per_block) {
  const int smem = OnePerSmDynamicSmem(MmaKernel, kWalkThreads, smem_per_block);
  float* sink = s.Alloc<float>(size_t(sm_count) * kWalkThreads);
  const double t = SecondsPerCall(s, 5, [&] {
    MmaKernel<<<sm_count, kWalkThreads, smem, s.stream>>>(kMmaIters, sink);
    Check(cudaGetLastError(), "mma kernel launch");
  });
  return double(sm_count) * (kWalkThreads / 32) * kMmaChains * kMmaIters / t;
}

double WgmmaPerSecond(Scope& s, int sm_count, int smem_per_block) {
  const int smem = OnePerSmDynamicSmem(WgmmaKernel, kWalkThreads, smem_per_block);
  float* sink = s.Alloc<float>(size_t(sm_count) * kWalkThreads);
  const int iters = kMmaIters / 8;
  const double t = SecondsPerCall(s, 5, [&] {
    WgmmaKernel<<<sm_count, kWalkThreads, smem, s.stream>>>(iters, sink);
    Check(cudaGetLastError(), "wgmma kernel launch");
  });
  return double(sm_count) * (kWalkThreads / 128) * kMmaChains * iters / t;
}

double NoisePerSecond(Scope& s, int sm_count, int smem_per_block) {
  const int smem = OnePerSmDynamicSmem(NoiseKernel, kWalkThreads, smem_per_block);
  uint32_t* sink = s.Alloc<uint32_t>(size_t(sm_count) * kWalkThreads);
  const double t = SecondsPerCall(s, 5, [&] {
    NoiseKernel<<<sm_count, kWalkThreads, smem, s.stream>>>(kNoisePerThread, 0x8badf00du, 0x5eedu, 7u, sink);
    Check(cudaGetLastError(), "noise kernel launch");
  });
  return double(sm_count) * kWalkThreads * kNoisePerThread / t;
}

double CoopLaunchGapSeconds(Scope& s, int sm_count, int smem_per_block) {
  const int smem = OnePerSmDynamicSmem(EmptyKernel, kWalkThreads, smem_per_block);
  return SecondsPerCall(s, 200, [&] {
    Check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(EmptyKernel), dim3(sm_count), dim3(kWalkThreads),
                                      nullptr, smem, s.stream),
          "cudaLaunchCooperativeKernel (empty kernel)");
  });
}

}  // namespace

DesignConstants MeasureDesignConstants(int device) {
  Scope s;
  Check(cudaGetDevice(&s.previous_device), "cudaGetDevice");
  Check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  int l2_bytes = 0, cooperative = 0;
  DesignConstants c;
  Check(cudaDeviceGetAttribute(&c.sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  Check(cudaDeviceGetAttribute(&c.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute");
  Check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
  Check(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device), "cudaDeviceGetAttribute");
  if (!cooperative) throw std::runtime_error("jax_markov design probes: the GPU does not support cooperative launches");
  // A stream of its own that does not synchronize with the legacy default stream.
  Check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  Check(cudaEventCreate(&s.start), "cudaEventCreate");
  Check(cudaEventCreate(&s.stop), "cudaEventCreate");

  c.hbm_copy_bytes_per_s = HbmCopyBytesPerSecond(s, c.sm_count, l2_bytes);
  c.smem_read_bytes_per_s = SmemReadBytesPerSecond(s, c.sm_count, c.smem_per_block);
  c.l2_read_bytes_per_s = L2ReadBytesPerSecond(s, c.sm_count, l2_bytes);
  c.exchange_s = ExchangeSeconds(s, c.sm_count, c.smem_per_block, 1);
  const double exchange_max = ExchangeSeconds(s, c.sm_count, c.smem_per_block, kMaxRequests);
  c.exchange_per_request_s = std::max(0.0, (exchange_max - c.exchange_s) / (kMaxRequests - 1));
  c.mma_per_s = MmaPerSecond(s, c.sm_count, c.smem_per_block);
  c.wgmma_per_s = WgmmaPerSecond(s, c.sm_count, c.smem_per_block);
  c.noise_per_s = NoisePerSecond(s, c.sm_count, c.smem_per_block);
  c.coop_launch_gap_s = CoopLaunchGapSeconds(s, c.sm_count, c.smem_per_block);
  return c;
}

}  // namespace jax_markov
