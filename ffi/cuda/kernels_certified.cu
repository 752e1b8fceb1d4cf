// MarkovWalkKernel's instances for a CertifiedMarkovHead (ffi/plan/kernel_list.h, cuda/walk/certified.cuh).
#include "cuda/kernels.h"
#include "cuda/walk/kernel.cuh"
#include "plan/kernel_list.h"

namespace jax_markov {
namespace walk {

JAX_MARKOV_DEFINE_KERNEL_LOOKUP(CertifiedWalkKernel, JAX_MARKOV_CERTIFIED_WALK_KERNELS, JAX_MARKOV_WALK_INSTANCE)

}  // namespace walk
}  // namespace jax_markov
