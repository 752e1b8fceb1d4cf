// What the nanobind module needs from markov_walk.cu.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_markov {

struct DeviceProperties {
  int sm_count = 0;
  int smem_per_block = 0;  // opt-in maximum of dynamic shared memory per block, bytes
  int l2_bytes = 0;
  int major = 0;
  int minor = 0;
  bool cooperative = false;
};

// Cached per device ordinal.
cudaError_t QueryDeviceProperties(int device, DeviceProperties* out);

// Whether one launch of `batch` requests (at most one launch's worth) over int8 W2 of `vocab` rows
// and W1 of `w1_dtype` ("float32", "bfloat16" or "float16"), with 16-byte aligned base logits and
// logits, runs MarkovWalkTransposedKernel on a GPU with these properties (rather than
// MarkovWalkKernel). Needs no GPU: tests use it to know which kernel a case exercises. Throws
// std::invalid_argument for another w1_dtype.
bool LaunchTakesTransposed(int batch, int vocab, const std::string& w1_dtype, bool logits_out, const DeviceProperties& props);

#ifdef JAX_MARKOV_TIMELINE
// Timeline builds: the latest launch's stamps (walk_kernel.cuh: kPhases per CTA and step, then the
// scoring end of every warp), in nanoseconds of %globaltimer; `ctas` is the grid size.
cudaError_t ReadTimeline(std::vector<unsigned long long>* out, int* ctas);
#endif

}  // namespace jax_markov

XLA_FFI_DECLARE_HANDLER_SYMBOL(MarkovWalkCuda);
