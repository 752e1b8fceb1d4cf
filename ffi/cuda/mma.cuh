// Warp-level tensor-core MMAs (mma.sync) and the integer and half-precision conversions around them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_markov {

// Two int8 values (bytes 0,1 or 2,3 of w, sign bits already flipped) -> exact fp16 pair:
// 0x64XX is 1024 + XX in fp16, and XX = x + 128, so subtracting 1152 leaves x.
__device__ __forceinline__ uint32_t Int8PairToHalf2(uint32_t w, uint32_t selector) {
  const uint32_t h = __byte_perm(w, 0x64646464u, selector);
  uint32_t out;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(out) : "r"(h), "r"(0x64806480u));
  return out;
}

// D += A B in fp32 with fp16 (or, BF16, bf16) inputs, one warp.
template <bool BF16>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void Imma16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d0 + 2^8 d1 + 2^16 d2 from three exact int32 digit sums (each |d| < 2^22, so exact in fp32).
__device__ __forceinline__ float DigitsToFloat(int d0, int d1, int d2) {
  return __fmaf_rn(float(d2), 65536.0f, __fmaf_rn(float(d1), 256.0f, float(d0)));
}

// d0 + 2^8 d1 from two exact int32 digit sums (|d| < 2^22), rounded once.
__device__ __forceinline__ float DigitPairToFloat(int d0, int d1) { return __fmaf_rn(float(d1), 256.0f, float(d0)); }

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// 2^n for n in [-126, 127], a normal float: multiplying by it gives ldexpf(x, n), in one instruction.
__device__ __forceinline__ float Pow2(int n) { return __int_as_float((n + 127) << 23); }

}  // namespace jax_markov
