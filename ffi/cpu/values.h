// Values of every dtype the CPU custom call reads and writes: exact scalar conversions between fp32
// and bf16 / f16 (round to nearest even, like XLA's convert and jnp's astype), element sizes, loads
// as fp32 and rounded stores.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace jax_markov {
namespace cpu {

namespace ffi = xla::ffi;

inline uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}
inline float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline float Bf16ToF32(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quietened).
inline uint16_t F32ToBf16(float f) {
  const uint32_t b = FloatBits(f);
  if (f != f) return static_cast<uint16_t>((b >> 16) | 0x0040u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// IEEE half <-> single, exact, subnormals included (after Maratyszcza's FP16 library).
inline float F16ToF32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = BitsFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = BitsFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? FloatBits(denormalized) : FloatBits(normalized));
  return BitsFloat(result);
}

inline uint16_t F32ToF16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = FloatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = BitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = FloatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

template <typename T>
inline float ToF32(T x);
template <>
inline float ToF32<float>(float x) { return x; }

// Storage types: bf16 and f16 are carried as raw uint16 bits, tagged.
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
template <>
inline float ToF32<Bf16>(Bf16 x) { return Bf16ToF32(x.bits); }
template <>
inline float ToF32<F16>(F16 x) { return F16ToF32(x.bits); }
template <>
inline float ToF32<int8_t>(int8_t x) { return static_cast<float>(x); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline size_t ElementBytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S8: return 1;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F32:
    case ffi::DataType::S32:
    case ffi::DataType::U32: return 4;
    default: return 0;
  }
}

// l rounded to dtype t and back (f32: l itself).
inline float RoundTo(float l, ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return Bf16ToF32(F32ToBf16(l));
    case ffi::DataType::F16: return F16ToF32(F32ToF16(l));
    default: return l;
  }
}

// Rounds l to the logits dtype and back, and stores it (scalar; shared by both paths' tails).
inline float RoundStoreScalar(float l, ffi::DataType t, void* out, int64_t i) {
  switch (t) {
    case ffi::DataType::BF16: {
      const uint16_t h = F32ToBf16(l);
      static_cast<uint16_t*>(out)[i] = h;
      return Bf16ToF32(h);
    }
    case ffi::DataType::F16: {
      const uint16_t h = F32ToF16(l);
      static_cast<uint16_t*>(out)[i] = h;
      return F16ToF32(h);
    }
    default:
      static_cast<float*>(out)[i] = l;
      return l;
  }
}

inline float LoadAsF32(const void* p, ffi::DataType t, int64_t i) {
  switch (t) {
    case ffi::DataType::BF16: return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
    case ffi::DataType::F16: return F16ToF32(static_cast<const uint16_t*>(p)[i]);
    case ffi::DataType::S8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

}  // namespace cpu
}  // namespace jax_markov
