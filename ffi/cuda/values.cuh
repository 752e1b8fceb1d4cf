// The walk's values in and out, shared by both kernels: raw base-logit bits as floats, and l rounded to
// the logits dtype (docs/spec.md: the walk chooses from the rounded value) with its store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_config.h"

namespace jax_markov {
namespace walk {

// Raw bits of a base logit of dtype BASE as a float: one instruction at most.
template <int BASE>
__device__ __forceinline__ float BaseToFloat(uint32_t bits) {
  if constexpr (BASE == kF16) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  if constexpr (BASE == kBF16) return __uint_as_float(bits << 16);
  return __uint_as_float(bits);
}

// The same for a dtype known at run time, with selects rather than a jump.
__device__ __forceinline__ float BitsToFloat(uint32_t bits, int dtype) {
  const float half = BaseToFloat<kF16>(bits);
  const float wide = dtype == kBF16 ? BaseToFloat<kBF16>(bits) : BaseToFloat<kF32>(bits);
  return dtype == kF16 ? half : wide;
}

// l rounded to the logits dtype DTYPE, stored at p[i] if `store`; returns the rounded value (the walk
// chooses from it) and the bits a store writes in *bits (16-bit dtypes: the low half), for a staged
// store.
template <int DTYPE>
__device__ __forceinline__ float StoreRoundedAs(void* p, size_t i, float l, bool store, uint32_t* bits = nullptr) {
  if constexpr (DTYPE == kF32) {
    if (store) __stcs(static_cast<float*>(p) + i, l);
    if (bits != nullptr) *bits = __float_as_uint(l);
    return l;
  } else if constexpr (DTYPE == kBF16) {
    const __nv_bfloat16 r = __float2bfloat16_rn(l);
    if (store) __stcs(static_cast<unsigned short*>(p) + i, __bfloat16_as_ushort(r));
    if (bits != nullptr) *bits = __bfloat16_as_ushort(r);
    return __bfloat162float(r);
  } else {
    const __half r = __float2half_rn(l);
    if (store) __stcs(static_cast<unsigned short*>(p) + i, __half_as_ushort(r));
    if (bits != nullptr) *bits = __half_as_ushort(r);
    return __half2float(r);
  }
}

// The same for a dtype known at run time, without branches: both 16-bit roundings are computed and
// the store of the matching width is predicated.
__device__ __forceinline__ float StoreRoundedSelect(void* p, size_t i, int dtype, float l, bool store,
                                                    uint32_t* bits = nullptr) {
  const __nv_bfloat16 rb = __float2bfloat16_rn(l);
  const __half rh = __float2half_rn(l);
  const bool bf16 = dtype == kBF16;
  const unsigned short bits16 = bf16 ? __bfloat16_as_ushort(rb) : __half_as_ushort(rh);
  if (store && dtype == kF32) __stcs(static_cast<float*>(p) + i, l);
  if (store && dtype != kF32) __stcs(static_cast<unsigned short*>(p) + i, bits16);
  if (bits != nullptr) *bits = dtype == kF32 ? __float_as_uint(l) : bits16;
  return dtype == kF32 ? l : (bf16 ? __bfloat162float(rb) : __half2float(rh));
}

}  // namespace walk
}  // namespace jax_markov
