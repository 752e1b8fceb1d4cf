// The walk kernel's instantiations for bf16 W2 (see walk_kernel.cuh).
#include "cuda/walk_kernel.cuh"

namespace jax_markov {
namespace walk {

template ffi::Error LaunchForColumns<kW2BF16>(bool, int, cudaStream_t, int, const DeviceProperties&, const WalkArgs&, float*);

}  // namespace walk
}  // namespace jax_markov
