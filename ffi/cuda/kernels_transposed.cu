// MarkovWalkTransposedKernel's instances (ffi/plan/kernel_list.h).
#include "cuda/kernels.h"
#include "cuda/transposed/kernel.cuh"
#include "plan/kernel_list.h"

namespace jax_markov {
namespace walk {

#define JAX_MARKOV_TRANSPOSED_INSTANCE(BASE, PACKED, WALK) \
  if (key == TransposedKernelKey(BASE, PACKED, WALK)) return reinterpret_cast<const void*>(&MarkovWalkTransposedKernel<TransposedTraits<BASE, PACKED, WALK>>);
JAX_MARKOV_DEFINE_KERNEL_LOOKUP(TransposedKernel, JAX_MARKOV_TRANSPOSED_KERNELS, JAX_MARKOV_TRANSPOSED_INSTANCE)

}  // namespace walk
}  // namespace jax_markov
