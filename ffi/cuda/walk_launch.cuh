// Which kernel walks a launch: MarkovWalkTransposedKernel where it applies (int8 W2), else
// MarkovWalkKernel in the variant that the batch's columns take.
#pragma once

#include "cuda/walk_kernel.cuh"

namespace jax_markov {
namespace walk {

// Whether a launch walks in MarkovWalkTransposedKernel (walk_transposed.cuh): int8 W2 (checked by the
// caller), 17-64 requests (above MarkovWalkKernel's direct exchange), V % 8 == 0 and base logits and
// logits 16-byte aligned (it moves them 16 bytes at a time, 8 rows in bf16 and fp16). Logits go out
// of it only for a bf16 W1: its two int8 digits of e keep 15 bits below e's largest element, all the
// bits of a bf16 element but its smallest ones, while most fp16 and fp32 elements lose some (an fp32
// W1's logits came out up to 3.3e-5 off the reference on the H200, past the tests' 2e-5; the hi + lo
// columns of MarkovWalkKernel keep them within it).
inline bool WalksTransposed(const WalkArgs& a) {
  return a.batch > kDirectBatch && a.batch <= kMaxBatch && a.vocab % 8 == 0 && reinterpret_cast<uintptr_t>(a.base) % 16 == 0 && reinterpret_cast<uintptr_t>(a.scale) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 && (a.logits == nullptr || a.w1_dtype == kBF16);
}

// Whether MarkovWalkTransposedKernel walks this launch on this GPU: WalksTransposed and its fixed
// shared memory fits (else LaunchTransposed declines and MarkovWalkKernel walks).
bool TakesTransposed(const WalkArgs& args, const DeviceProperties& props);

// One launch of MarkovWalkTransposedKernel where WalksTransposed holds (walk_launch_transposed.cu).
// *launched is false where the CTA's fixed shared memory does not fit: the caller takes
// MarkovWalkKernel then.
ffi::Error LaunchTransposed(cudaStream_t stream, int device, const DeviceProperties& props, WalkArgs args, bool* launched);

// One launch for `columns` B columns (a request each; two with SPLIT) of W2 format W2. Each
// format's instantiation lives in its own translation unit (walk_launch_*.cu), compiled in parallel.
template <int W2>
ffi::Error LaunchForColumns(bool split, int columns, cudaStream_t stream, int device, const DeviceProperties& props,
                            const WalkArgs& args, float* noise_buffer) {
  if constexpr (W2 == kW2Int8) {
    if (args.batch <= 2) return Launch<1, false, true, kW2Int8>(stream, device, props, args, noise_buffer);
    if (WalksTransposed(args)) {
      bool launched = false;
      const ffi::Error err = LaunchTransposed(stream, device, props, args, &launched);
      if (err.failure() || launched) return err;
    }
    // Walks of 3-8 requests on e's digit pairs (int8 tensor cores, BuildDigitPairs): tokens only, or
    // logits out from a bf16 W1, whose elements the two digits keep but for the smallest ones (as in
    // WalksTransposed). At 9-16, where the pairs' two columns a request take NT = 4, the fp16 path
    // below is faster (NOTES, Sessions 28 and 29), but for EREGS's walks.
    if (args.batch <= 8 && (args.logits == nullptr || args.w1_dtype == kBF16)) {
      if (args.batch <= 4) return Launch<1, true, false, kW2Int8, true>(stream, device, props, args, noise_buffer);
      return Launch<2, true, false, kW2Int8, true>(stream, device, props, args, noise_buffer);
    }
    // 9-16 requests walked greedily with no logits out, bf16 base logits and an even V (32-bit loads of
    // row pairs): the same digit pairs as e's A operand, in registers (EREGS, BuildDigitPairOperands).
    if (args.batch > 8 && args.batch <= kDirectBatch && !args.sampling && args.logits == nullptr && args.base_dtype == kBF16 &&
        args.vocab % 2 == 0) {
      return Launch<2, false, false, kW2Int8, false, true>(stream, device, props, args, noise_buffer);
    }
  }
  if (split) {
    if (columns <= 8) return Launch<1, true, false, W2>(stream, device, props, args, noise_buffer);
    if (columns <= 16) return Launch<2, true, false, W2>(stream, device, props, args, noise_buffer);
    if (columns <= 32) return Launch<4, true, false, W2>(stream, device, props, args, noise_buffer);
    return Launch<8, true, false, W2>(stream, device, props, args, noise_buffer);
  }
  if (columns <= 8) return Launch<1, false, false, W2>(stream, device, props, args, noise_buffer);
  if (columns <= 16) return Launch<2, false, false, W2>(stream, device, props, args, noise_buffer);
  if (columns <= 32) return Launch<4, false, false, W2>(stream, device, props, args, noise_buffer);
  return Launch<8, false, false, W2>(stream, device, props, args, noise_buffer);
}

extern template ffi::Error LaunchForColumns<kW2Int8>(bool, int, cudaStream_t, int, const DeviceProperties&,
                                                     const WalkArgs&, float*);
extern template ffi::Error LaunchForColumns<kW2F16>(bool, int, cudaStream_t, int, const DeviceProperties&,
                                                    const WalkArgs&, float*);
extern template ffi::Error LaunchForColumns<kW2BF16>(bool, int, cudaStream_t, int, const DeviceProperties&,
                                                     const WalkArgs&, float*);

}  // namespace walk
}  // namespace jax_markov
