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

// Whether a launch walks in DigitLayout's rotated order.
bool Rotated(bool packed, const WalkArgs& args) { return !packed && args.sampling && args.batch <= kRotatedMaxBatch; }

// The walk (TransposedWalk) that a launch takes.
int WalkOf(bool packed, const WalkArgs& args) {
  if (Rotated(packed, args)) return kRotatedSampledWalk;
  if (args.sampling) return kSampledWalk;
  return args.logits != nullptr ? kLogitsWalk : kPlainWalk;
}

template <bool PACKED, bool ROTATED, int WARPGROUPS>
int SmemFixedBytes(int tiles_per_cta) {
  return TransposedSmem<PACKED, ROTATED, WARPGROUPS>::FixedBytes(tiles_per_cta * kTransposedTileRows);
}

// The shared memory of a walk's CTA that is not resident W2 tiles.
int FixedBytes(bool packed, int walk, int base, int tiles_per_cta) {
  const bool four = TransposedWarpgroups(walk, base) == 4;
  if (packed) return four ? SmemFixedBytes<true, false, 4>(tiles_per_cta) : SmemFixedBytes<true, false, 3>(tiles_per_cta);
  if (walk == kRotatedSampledWalk) return SmemFixedBytes<false, true, 3>(tiles_per_cta);
  return four ? SmemFixedBytes<false, false, 4>(tiles_per_cta) : SmemFixedBytes<false, false, 3>(tiles_per_cta);
}

// Whether a layout's CTA fits at all, judged by the largest fixed part of its walks, so that which
// kernel a launch takes does not depend on whether it samples, on its batch or on its base dtype (and
// by the rounds of its fewest warpgroups).
bool LayoutFits(bool packed, int tiles_per_cta, const DeviceProperties& props) {
  if (tiles_per_cta > kMaxTransposedRounds * kTransposedWarpgroups) return false;
  int largest = 0;
  for (int walk : {kPlainWalk, kLogitsWalk, kSampledWalk, kRotatedSampledWalk}) {
    if (packed && walk == kRotatedSampledWalk) continue;
    for (int base : {kBF16, kF32}) largest = std::max(largest, FixedBytes(packed, walk, base, tiles_per_cta));
  }
  return largest <= props.smem_per_block;
}

template <int BASE, bool PACKED>
auto KernelFor(int walk) {
  if constexpr (!PACKED) {
    if (walk == kRotatedSampledWalk) return MarkovWalkTransposedKernel<BASE, PACKED, kRotatedSampledWalk>;
  }
  if (walk == kSampledWalk) return MarkovWalkTransposedKernel<BASE, PACKED, kSampledWalk>;
  return walk == kLogitsWalk ? MarkovWalkTransposedKernel<BASE, PACKED, kLogitsWalk> : MarkovWalkTransposedKernel<BASE, PACKED, kPlainWalk>;
}

template <bool PACKED>
ffi::Error LaunchLayout(cudaStream_t stream, int device, const DeviceProperties& props, WalkArgs args, bool* launched) {
  *launched = false;
  const int grid = props.sm_count;
  args.tiles_per_cta = TilesPerCta(args.vocab, grid);
  if (!LayoutFits(PACKED, args.tiles_per_cta, props)) return ffi::Error::Success();
  const int walk = WalkOf(PACKED, args);
  const int fixed = FixedBytes(PACKED, walk, args.base_dtype, args.tiles_per_cta);
  args.resident_tiles = std::min(args.tiles_per_cta, (props.smem_per_block - fixed) / kTransposedTileBytes);
  const int smem = fixed + args.resident_tiles * kTransposedTileBytes;
  const int threads = 128 * TransposedWarpgroups(walk, args.base_dtype);
  auto kernel = args.base_dtype == kF32    ? KernelFor<kF32, PACKED>(walk)
                : args.base_dtype == kBF16 ? KernelFor<kBF16, PACKED>(walk)
                                           : KernelFor<kF16, PACKED>(walk);
  const cudaError_t prepared = PrepareOnce(reinterpret_cast<const void*>(kernel), device, threads, props);
  if (prepared != cudaSuccess) return CudaError("preparing the transposed kernel", prepared);
  void* params[] = {&args};
  const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(threads), params, smem, stream);
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
