// What the nanobind module `_markov_cuda` needs from the CUDA handler (handler.cu).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "plan/walk_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_markov {

// Cached per device ordinal.
cudaError_t QueryDeviceProperties(int device, walk::DeviceProperties* out);

// The certified walks' counters on device `device` (walk_config.h's CertStat, kCertStats words): kept
// from the first EnableCertifiedStats on (launches before it keep none); CertifiedStats waits for the
// device, copies them out (all zero where not enabled) and zeroes them if `reset`.
cudaError_t EnableCertifiedStats(int device);
cudaError_t CertifiedStats(int device, bool reset, std::vector<unsigned long long>* out);

#ifdef JAX_MARKOV_TIMELINE
// Timeline builds: the latest launch's stamps (walk/args.cuh: kPhases per CTA and step, then the
// scoring end of every warp), in nanoseconds of %globaltimer; `ctas` is the grid size.
cudaError_t ReadTimeline(std::vector<unsigned long long>* out, int* ctas);
#endif

}  // namespace jax_markov

XLA_FFI_DECLARE_HANDLER_SYMBOL(MarkovWalkCuda);
