// Thin wrappers of the PTX instructions the walk kernels use beyond CUDA C++: asynchronous copies
// into shared memory, mbarriers, acquire loads, transposing matrix stores and proxy fences.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_markov {

// The shared-memory address of a generic pointer into shared memory, as PTX's shared instructions take it.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes from a shared address. Volatile: kept in order with the cp.async waits and barriers that
// make the bytes ready.
__device__ __forceinline__ uint4 LoadShared16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}

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

// An mbarrier in shared memory: a phase completes once `arrivals` arrivals are made.
__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(arrivals) : "memory");
}

// Makes the mbarriers this thread initialized visible to other threads' arrivals and waits.
__device__ __forceinline__ void FenceMbarrierInit() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(bar)) : "memory");
}

// Arrives on `bar` and adds `bytes` to the transaction count that its current phase waits for (the bytes
// of the async copies that complete on it).
__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)), "r"(bytes) : "memory");
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

__device__ __forceinline__ unsigned int LoadAcquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// Shared memory written by ordinary stores, made visible to the tensor cores' reads (async proxy).
__device__ __forceinline__ void FenceSharedForAsyncProxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace jax_markov
