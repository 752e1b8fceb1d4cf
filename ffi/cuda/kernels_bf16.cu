// MarkovWalkKernel's instances for bf16 W2 (ffi/plan/kernel_list.h).
#include "cuda/kernels.h"
#include "cuda/walk/kernel.cuh"
#include "plan/kernel_list.h"

namespace jax_markov {
namespace walk {

JAX_MARKOV_DEFINE_KERNEL_LOOKUP(BF16WalkKernel, JAX_MARKOV_BF16_WALK_KERNELS, JAX_MARKOV_WALK_INSTANCE)

}  // namespace walk
}  // namespace jax_markov
