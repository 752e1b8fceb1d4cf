// Shared by the CPU and CUDA custom calls: Philox4x32-10, the Gumbel noise of SPEC.md, and the
// packed 64-bit argmax key. Everything here is plain arithmetic that compiles for host and device.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MARKOV_HD __host__ __device__ __forceinline__
#else
#define MARKOV_HD inline
#endif

namespace jax_markov {

// Counter word 2 of the draft noise stream (SPEC.md): keeps it apart from acceptance/resampling.
constexpr uint32_t kDraftStream = 0x40000000u;

MARKOV_HD void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
#endif
}

// First output word of Philox4x32-10 (Random123) at counter (c0, c1, c2, 0) and key (k0, k1).
MARKOV_HD uint32_t Philox4x32Word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t k0, uint32_t k1) {
  uint32_t c3 = 0;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo(0xD2511F53u, c0, &hi0, &lo0);
    MulHiLo(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// g(v) = -log(-log(u)), u = (float(x >> 9) + 0.5) * 2^-23, x = Philox word 0 at (v, position, stream, 0).
MARKOV_HD float GumbelNoise(uint32_t k0, uint32_t k1, uint32_t v, uint32_t position) {
  const uint32_t x = Philox4x32Word0(v, position, kDraftStream, k0, k1);
  const float u = (static_cast<float>(x >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
#if defined(__CUDA_ARCH__)
  // The outer log takes the fast intrinsic (MUFU.LG2, two instructions against about fifteen): its
  // error in g is at most 3 ulp of g (2^-21.4 absolute near w = 1), far inside the near-tie
  // tolerance. The inner one keeps logf (within an ulp): w = -log(u) near u = 1 is tiny, and its
  // relative error becomes g's absolute error.
  return -__logf(-logf(u));
#else
  return -std::log(-std::log(u));
#endif
}

// Orders float scores as unsigned integers: larger float -> larger integer, every NaN largest
// (so the first NaN wins, as jnp.argmax), -0 equal to +0. Adding +0 turns -0 into +0; one xor
// then flips all bits of a negative score and only the sign bit of a positive one.
MARKOV_HD uint32_t OrderedScore(float score) {
  const float s = score + 0.0f;
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(s);
#else
  __builtin_memcpy(&bits, &s, sizeof(bits));
#endif
  bits ^= static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u;
#if defined(__CUDA_ARCH__)
  // The GPU's float arithmetic (the add above) gives every NaN as 0x7FFFFFFF, whose ordered bits
  // are already 0xFFFFFFFF (tests/test_cuda.py feeds NaNs of both signs and other payloads).
  return bits;
#else
  return s != s ? 0xFFFFFFFFu : bits;
#endif
}

// The argmax key: its integer maximum is the SPEC.md choice (largest score, lowest index on ties).
// 0 is below every real key and marks "no candidate yet".
MARKOV_HD uint64_t PackArgmaxKey(float score, uint32_t index) {
  return (static_cast<uint64_t>(OrderedScore(score)) << 32) | (0xFFFFFFFFu - index);
}

MARKOV_HD uint32_t ArgmaxKeyIndex(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

MARKOV_HD int32_t ClampIndex(int64_t id, int64_t size) {
  return static_cast<int32_t>(id < 0 ? 0 : (id >= size ? size - 1 : id));
}

}  // namespace jax_markov
