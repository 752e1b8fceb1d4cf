// The constants of the walk kernel's design floor, measured by small probe kernels on the GPU they
// run on (ffi/probes/probes.cu). benchmarks/design_floor.py turns them into floors.
#pragma once

namespace jax_markov {

struct DesignConstants {
  double hbm_copy_bytes_per_s = 0;    // bytes read + written per second by a 1 GiB device-to-device copy
  double smem_read_bytes_per_s = 0;   // shared-memory bytes read per second, all SMs together
  double l2_read_bytes_per_s = 0;     // bytes of an L2-resident buffer read per second, all SMs together
  double exchange_s = 0;              // one grid-wide exchange of one request (reduce, atomicMax, barrier)
  double exchange_per_request_s = 0;  // what each further request adds to it (fitted at 128 requests)
  double mma_per_s = 0;               // mma.m16n8k16 (fp16 in, fp32 accumulate) per second, all SMs together
  double wgmma_per_s = 0;             // wgmma m64n64k16 (fp16 in, fp32 accumulate) per second, all SMs together
  double noise_per_s = 0;             // Gumbel noise values (a quarter of a Philox4x32-10 block and two logs each) per second, all SMs together
  double coop_launch_gap_s = 0;       // per back-to-back cooperative launch of an empty kernel
  int sm_count = 0;
  int smem_per_block = 0;  // opt-in maximum of shared memory per block, bytes
};

// Runs every probe on CUDA device `device` (about a second); the caller's current device is kept.
// Throws std::runtime_error naming the CUDA call that failed.
DesignConstants MeasureDesignConstants(int device);

}  // namespace jax_markov
