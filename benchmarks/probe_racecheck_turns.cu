// Timing-free probe (NOTES Session 49): does compute-sanitizer's racecheck report hazards for the
// turns of v123 (a ring of named barriers: bar.sync by the waiting warpgroup, bar.arrive by the one
// before it) or of v123m (mbarriers), around shared words that __syncthreads orders?
//
//     nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -lineinfo -o /tmp/turns benchmarks/probe_racecheck_turns.cu
//     for mode in 0 1 2; do compute-sanitizer --tool racecheck /tmp/turns $mode; done
//
// Mode 0: no turns (must be clean); 1: named barriers as in v123; 2: mbarriers as in v123m. Each step
// lane 0 of every warp writes its word, a CTA barrier, every thread reads another warp's word, then
// the warpgroups take two rounds of turns and meet at a CTA barrier before the next step's writes:
// no access pair is unordered, so any hazard reported is the tool's.
#include <cstdint>
#include <cstdio>

constexpr int kWarpgroups = 4, kRounds = 2, kSteps = 4;

__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__global__ void __launch_bounds__(128 * kWarpgroups, 1) Turns(float* out, int mode) {
  __shared__ float word[4 * kWarpgroups];
  __shared__ uint64_t turn[kWarpgroups];
  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
  if (tid < kWarpgroups) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" ::"r"(Smem(&turn[tid])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t turns = 0;
  float acc = 0.0f;
  for (int k = 0; k < kSteps; ++k) {
    if (lane == 0) word[warp] = float(k + warp);
    __syncthreads();
    acc += word[(warp + 1) % (4 * kWarpgroups)];
    for (int r = 0; r < kRounds; ++r) {
      const bool wait = wg > 0 || r > 0, pass = wg < kWarpgroups - 1 || r < kRounds - 1;
      if (mode == 1) {
        if (wait) asm volatile("bar.sync %0, 256;" ::"r"(5 + wg) : "memory");
        if (pass) asm volatile("bar.arrive %0, 256;" ::"r"(5 + (wg + 1) % kWarpgroups) : "memory");
      } else if (mode == 2) {
        if (wait) {
          asm volatile(
              "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n" ::"r"(
                  Smem(&turn[wg])),
              "r"(turns++ & 1)
              : "memory");
        }
        if (pass && lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(Smem(&turn[(wg + 1) % kWarpgroups])) : "memory");
      }
      acc += 1.0f;
    }
    __syncthreads();
  }
  out[tid] = acc;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  float* out = nullptr;
  cudaMalloc(&out, 128 * kWarpgroups * sizeof(float));
  Turns<<<2, 128 * kWarpgroups>>>(out, mode);
  const cudaError_t err = cudaDeviceSynchronize();
  float host = 0.0f;
  cudaMemcpy(&host, out, sizeof(float), cudaMemcpyDeviceToHost);
  printf("mode %d: %s, out[0] = %g (expect %g)\n", mode, cudaGetErrorString(err), host,
         float(kSteps * kRounds) + [] { float s = 0; for (int k = 0; k < kSteps; ++k) s += k + 1; return s; }());
  return err == cudaSuccess ? 0 : 1;
}
