// MarkovWalkTransposedKernel's launch (see walk_launch.cuh), in a translation unit of its own.
#include "cuda/walk_launch.cuh"
#include "cuda/walk_transposed.cuh"

namespace jax_markov {
namespace walk {

namespace {

// The 64-row tiles of W2 that each of `grid` CTAs scores.
int TilesPerCta(int vocab, int grid) {
  const int total_tiles = (vocab + kTransposedTileRows - 1) / kTransposedTileRows;
  return (total_tiles + grid - 1) / grid;
}

// The shared memory of a layout's CTA that is not resident W2 tiles (rotated: see DigitLayout).
int FixedBytes(bool packed, bool rotated, int tiles_per_cta) {
  const int rows_per_cta = tiles_per_cta * kTransposedTileRows;
  if (packed) return TransposedSmem<true, false>::FixedBytes(rows_per_cta);
  return rotated ? TransposedSmem<false, true>::FixedBytes(rows_per_cta) : TransposedSmem<false, false>::FixedBytes(rows_per_cta);
}

// Whether a layout's CTA fits at all, judged by its larger fixed part (unpacked: the rotated one), so
// that which kernel a launch takes does not depend on whether it samples or on its batch.
bool LayoutFits(bool packed, int tiles_per_cta, const DeviceProperties& props) {
  return FixedBytes(packed, !packed, tiles_per_cta) <= props.smem_per_block;
}

// Whether a launch walks in DigitLayout's rotated order.
bool Rotated(bool packed, const WalkArgs& args) { return !packed && args.sampling && args.batch <= kRotatedMaxBatch; }

template <int BASE, bool PACKED>
auto KernelFor(const WalkArgs& args) {
  if constexpr (!PACKED) {
    if (Rotated(PACKED, args)) return MarkovWalkTransposedKernel<BASE, PACKED, kRotatedSampledWalk>;
  }
  if (args.sampling) return MarkovWalkTransposedKernel<BASE, PACKED, kSampledWalk>;
  return args.logits != nullptr ? MarkovWalkTransposedKernel<BASE, PACKED, kLogitsWalk> : MarkovWalkTransposedKernel<BASE, PACKED, kPlainWalk>;
}

template <bool PACKED>
ffi::Error LaunchLayout(cudaStream_t stream, int device, const DeviceProperties& props, WalkArgs args, bool* launched) {
  *launched = false;
  const int grid = props.sm_count;
  args.tiles_per_cta = TilesPerCta(args.vocab, grid);
  if (!LayoutFits(PACKED, args.tiles_per_cta, props)) return ffi::Error::Success();
  const int fixed = FixedBytes(PACKED, Rotated(PACKED, args), args.tiles_per_cta);
  args.resident_tiles = std::min(args.tiles_per_cta, (props.smem_per_block - fixed) / kTransposedTileBytes);
  const int smem = fixed + args.resident_tiles * kTransposedTileBytes;
  auto kernel = args.base_dtype == kF32    ? KernelFor<kF32, PACKED>(args)
                : args.base_dtype == kBF16 ? KernelFor<kBF16, PACKED>(args)
                                           : KernelFor<kF16, PACKED>(args);
  const cudaError_t prepared = PrepareOnce(reinterpret_cast<const void*>(kernel), device, kTransposedThreads, props);
  if (prepared != cudaSuccess) return CudaError("preparing the transposed kernel", prepared);
  void* params[] = {&args};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(kTransposedThreads), params, smem, stream);
  if (err != cudaSuccess) return CudaError("cudaLaunchCooperativeKernel (transposed)", err);
  *launched = true;
  return ffi::Error::Success();
}

}  // namespace

bool TakesTransposed(const WalkArgs& args, const DeviceProperties& props) {
  return WalksTransposed(args) && LayoutFits(args.batch <= 32, TilesPerCta(args.vocab, props.sm_count), props);
}

// Up to 32 requests take the packed layout (one A operand for both digits).
ffi::Error LaunchTransposed(cudaStream_t stream, int device, const DeviceProperties& props, WalkArgs args, bool* launched) {
  return args.batch <= 32 ? LaunchLayout<true>(stream, device, props, args, launched)
                          : LaunchLayout<false>(stream, device, props, args, launched);
}

}  // namespace walk
}  // namespace jax_markov
