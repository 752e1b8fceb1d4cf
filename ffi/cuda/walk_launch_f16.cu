// The walk kernels' instantiations for f16 W2 (see walk_launch.cuh).
#include "cuda/walk_launch.cuh"

namespace jax_markov {
namespace walk {

template ffi::Error LaunchForColumns<kW2F16>(bool, int, cudaStream_t, int, const DeviceProperties&, const WalkArgs&, float*);

}  // namespace walk
}  // namespace jax_markov
