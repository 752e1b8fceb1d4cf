// The instantiated walk kernels by key (ffi/plan/kernel_list.h), each W2 format's and the transposed
// kernel's in a translation unit of their own (kernels_*.cu: they compile in parallel).
#pragma once

#include "plan/walk_plan.h"

namespace jax_markov {
namespace walk {

const void* Int8WalkKernel(const KernelKey& key);
const void* CertifiedWalkKernel(const KernelKey& key);
const void* F16WalkKernel(const KernelKey& key);
const void* BF16WalkKernel(const KernelKey& key);
const void* TransposedKernel(const KernelKey& key);

// Defines FUNCTION(key): the instance of LIST (kernel_list.h) that `key` names, or null. Each kernels_*.cu
// that includes the kernel defines its own.
#define JAX_MARKOV_DEFINE_KERNEL_LOOKUP(FUNCTION, LIST, INSTANCE)  \
  const void* FUNCTION(const KernelKey& key) {                    \
    LIST(INSTANCE)                                                \
    return nullptr;                                               \
  }

// LIST's entry for MarkovWalkKernel (kernel_list.h's X arguments).
#define JAX_MARKOV_WALK_INSTANCE(NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT)                    \
  if (key == WalkKernelKey(NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT)) {                      \
    return reinterpret_cast<const void*>(                                                                            \
        &MarkovWalkKernel<WalkTraits<NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT>>);            \
  }

// The kernel a plan names, or null where the build does not instantiate it.
inline const void* KernelFunction(const KernelKey& key) {
  if (key.family == kTransposedFamily) return TransposedKernel(key);
  if (key.cert) return CertifiedWalkKernel(key);
  return key.w2 == kW2Int8 ? Int8WalkKernel(key) : key.w2 == kW2F16 ? F16WalkKernel(key) : BF16WalkKernel(key);
}

}  // namespace walk
}  // namespace jax_markov
