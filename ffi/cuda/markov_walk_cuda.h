// What the nanobind module needs from markov_walk.cu.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace jax_markov

XLA_FFI_DECLARE_HANDLER_SYMBOL(MarkovWalkCuda);
