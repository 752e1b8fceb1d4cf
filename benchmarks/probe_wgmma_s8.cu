// Timing probe (Session 48): the transposed kernel's wgmma loop alone at 64 requests, e's two int8
// digits as A from shared memory (descriptors, as the kernel does) or from registers, B = a 64-row
// W2 tile in shared memory; per tile 2 digits x 8 k-steps of m64n64k32, then a wait and a token
// epilogue, W warpgroups a CTA sharing 18 tiles a step round-robin (V = 151936 on 132 SMs).
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -I ffi benchmarks/probe_wgmma_s8.cu -o probe && ./probe
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "cuda/wgmma.cuh"

using namespace jax_markov;

__device__ __forceinline__ void WgmmaS8Rs(int (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]),
        "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
        "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

constexpr int kTilesPerStep = 18, kResident = 8, kTileBytes = 64 * 256, kDigitBytes = 64 * 256;

template <bool RS, int W>
__global__ void __launch_bounds__(128 * W, 1) Probe(int steps, int* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* digits = smem;                       // 2 x [64 x 256] s8
  unsigned char* tiles = smem + 2 * kDigitBytes;      // kResident x [64 x 256] s8
  for (int i = threadIdx.x; i < (2 * kDigitBytes + kResident * kTileBytes) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x01010101u * (1 + (i % 3));
  FenceSharedForAsyncProxy();
  __syncthreads();
  const int wg = threadIdx.x / 128;
  uint32_t a[2][8][4];  // RS: e's digits for this thread, all 8 k-steps
#pragma unroll
  for (int dg = 0; dg < 2; ++dg)
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int j = 0; j < 4; ++j) a[dg][s][j] = 0x01010101u * (1 + ((dg + s + j + threadIdx.x) & 1));
  int total = 0;
  for (int k = 0; k < steps; ++k) {
    for (int i = wg; i < kTilesPerStep; i += W) {
      const unsigned char* tile = tiles + (i % kResident) * kTileBytes;
      int d[2][32];
      WgmmaFence();
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int dg = 0; dg < 2; ++dg) {
          const uint64_t db = WgmmaDescriptor(tile + s * 2048, 128, 256);
          if constexpr (RS) {
            WgmmaS8Rs(d[dg], a[dg][s], db, s > 0);
          } else {
            WgmmaS8(d[dg], WgmmaDescriptor(digits + dg * kDigitBytes + s * 2048, 128, 256), db, s > 0);
          }
        }
      }
      WgmmaCommit();
      WgmmaWaitGroup<0>();
#pragma unroll
      for (int dg = 0; dg < 2; ++dg)
#pragma unroll
        for (int r = 0; r < 32; ++r) asm volatile("" : "+r"(d[dg][r])::"memory");
      int m = 0;
#pragma unroll
      for (int r = 0; r < 32; ++r) m = max(m, d[0][r] + 256 * d[1][r]);
      total += m;
    }
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

template <bool RS, int W>
void Run(int sms, int* sink) {
  const int smem = 2 * kDigitBytes + kResident * kTileBytes;
  cudaFuncSetAttribute(Probe<RS, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int steps = 200;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(e0);
    Probe<RS, W><<<sms, 128 * W, smem>>>(steps, sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (rep > 0 && ms < best) best = ms;
  }
  const cudaError_t err = cudaGetLastError();
  printf("| %s | %d | %.2f | %s |\n", RS ? "registers" : "shared memory", W, best * 1e3f / steps, cudaGetErrorString(err));
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int* sink;
  cudaMalloc(&sink, sms * 512 * sizeof(int));
  printf("# wgmma m64n64k32 s8, 2 digits x 8 k-steps a 64-row tile, %d tiles a CTA a step, %d CTAs: us a step (best of 6 launches of 200 steps)\n\n", kTilesPerStep, sms);
  printf("| A operand | warpgroups | us a step | error |\n|---|---|---|---|\n");
  Run<false, 2>(sms, sink); Run<false, 3>(sms, sink); Run<false, 4>(sms, sink);
  Run<true, 2>(sms, sink); Run<true, 3>(sms, sink); Run<true, 4>(sms, sink);
  return 0;
}
