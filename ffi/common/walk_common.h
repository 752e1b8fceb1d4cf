// Shared by the CPU and CUDA custom calls: Philox4x32-10, the Gumbel noise of docs/spec.md, and the
// packed 64-bit argmax key. Everything here is plain arithmetic that compiles for host and device.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MARKOV_HD __host__ __device__ __forceinline__
#define MARKOV_UNROLL _Pragma("unroll")
#else
#define MARKOV_HD inline
#define MARKOV_UNROLL
#endif

namespace jax_markov {

// Counter word 2 of the draft noise stream (docs/spec.md): keeps it apart from acceptance/resampling.
constexpr uint32_t kDraftStream = 0x40000000u;

// The hi and lo words of a x b. On the device WIDE makes it one 32 x 32 -> 64-bit multiply, which
// ptxas emits as IMAD.WIDE.U32, and otherwise __umulhi and a low multiply, which it often splits into
// IMAD.HI + IMAD: the transposed kernel's sampled epilogue, bound by these multiplies, issues 10 %
// fewer instructions WIDE, while MarkovWalkKernel's bf16-W2 kernel of 64 columns then spills 104 bytes
// (32 split) and its B = 64 walks took 15 % longer on the H200.
template <bool WIDE>
MARKOV_HD void MulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  if constexpr (!WIDE) {
    *hi = __umulhi(a, b);
    *lo = a * b;
    return;
  }
#endif
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Philox4x32-10 (Random123) for N independent blocks: counter (c0[i], c1[i], c2, 0) and key (k0[i], k1[i]);
// out[i][w] is output word w (0-3, in output order). The rounds run in lockstep over the N blocks, so
// that the compiler sees N independent chains of dependent multiplies side by side (WIDE: see MulHiLo).
// Words a caller never reads are never computed past their last use (dead code).
template <int N, bool WIDE>
MARKOV_HD void Philox4x32(const uint32_t (&c0_in)[N], const uint32_t (&c1_in)[N], uint32_t c2_in, const uint32_t (&k0_in)[N],
                          const uint32_t (&k1_in)[N], uint32_t (&out)[N][4]) {
  uint32_t c0[N], c1[N], c2[N], c3[N], k0[N], k1[N];
  MARKOV_UNROLL
  for (int i = 0; i < N; ++i) {
    c0[i] = c0_in[i];
    c1[i] = c1_in[i];
    c2[i] = c2_in;
    c3[i] = 0;
    k0[i] = k0_in[i];
    k1[i] = k1_in[i];
  }
  MARKOV_UNROLL
  for (int round = 0; round < 10; ++round) {
    MARKOV_UNROLL
    for (int i = 0; i < N; ++i) {
      uint32_t hi0, lo0, hi1, lo1;
      MulHiLo<WIDE>(0xD2511F53u, c0[i], &hi0, &lo0);
      MulHiLo<WIDE>(0xCD9E8D57u, c2[i], &hi1, &lo1);
      const uint32_t n0 = hi1 ^ c1[i] ^ k0[i], n2 = hi0 ^ c3[i] ^ k1[i];
      c0[i] = n0;
      c1[i] = lo1;
      c2[i] = n2;
      c3[i] = lo0;
      k0[i] += 0x9E3779B9u;
      k1[i] += 0xBB67AE85u;
    }
  }
  MARKOV_UNROLL
  for (int i = 0; i < N; ++i) {
    out[i][0] = c0[i];
    out[i][1] = c1[i];
    out[i][2] = c2[i];
    out[i][3] = c3[i];
  }
}

// x's bits as a To of the same size (C++20's std::bit_cast), on the host and the device.
template <typename To, typename From>
MARKOV_HD To BitCast(From x) {
  static_assert(sizeof(To) == sizeof(From), "BitCast keeps the size");
  To y;
  __builtin_memcpy(&y, &x, sizeof(y));
  return y;
}

// logf(u) for a normal float u in (0, 1), as the CUDA math library's logf computes it (the same range
// reduction into [2/3, 4/3), minimax polynomial and roundings, so the same bits) without its branches
// for zero, infinities and subnormals, which GumbelNoise's u never is: about 6 instructions fewer a
// value on the GPU. Host code keeps std::log.
MARKOV_HD float LogOfUnit(float u) {
  const int32_t bits = BitCast<int32_t>(u);
  const int32_t e = (bits - 0x3f2aaaab) & static_cast<int32_t>(0xff800000u);  // u's exponent, less one where m < 2/3
  const float m = BitCast<float>(bits - e);
  const float f = m - 1.0f;  // exact: m in [2/3, 4/3)
  float p = fmaf(f, -0.130188569426536560059f, 0.140846103429794311523f);
  p = fmaf(f, p, -0.121486276388168334961f);
  p = fmaf(f, p, 0.139806106686592102051f);
  p = fmaf(f, p, -0.166842356324195861816f);
  p = fmaf(f, p, 0.200122997164726257324f);
  p = fmaf(f, p, -0.249996691942214965820f);
  p = fmaf(f, p, 0.333331823348999023438f);
  p = fmaf(f, p, -0.5f);
  const float r = fmaf(f, f * p, f);  // log(m) = f + f^2 p(f)
  // + (e 2^-23) ln 2, with 2^-23 moved into the constant: the exact product and so the rounding are the
  // same, one multiply fewer.
  return fmaf(static_cast<float>(e), 0.693147182464599609375f * 1.1920928955078125e-07f, r);
}

// u = (float(x >> 9) + 0.5) * 2^-23 (docs/spec.md) as (1 + (x >> 9) 2^-23) - (1 - 2^-24): the mantissa bits
// set directly, then one subtraction, exact by Sterbenz's lemma, in place of a conversion, an add and
// a multiply.
MARKOV_HD float UnitOfWord(uint32_t x) { return BitCast<float>((x >> 9) | 0x3F800000u) - 0.999999940395355224609375f; }

// The Gumbel noise of one Philox output word x: g = -log(-log(u)), u = (float(x >> 9) + 0.5) 2^-23
// (docs/spec.md). LOGF: on the GPU, the math library's logf and __logf as they stand (the same bits as
// below).
template <bool LOGF = false>
MARKOV_HD float GumbelOfWord(uint32_t x) {
  const float u = UnitOfWord(x);
#if defined(__CUDA_ARCH__)
  // The outer log takes the fast log2 (MUFU.LG2; w in [2^-24, 17) is never subnormal, so the ftz
  // form skips __logf's scaling of subnormals and gives its bits): its error in g is at most 3 ulp of
  // g (2^-21.4 absolute near w = 1), far inside the near-tie tolerance. The inner one is logf's
  // (within an ulp): w = -log(u) near u = 1 is tiny, and its relative error becomes g's absolute error.
  if constexpr (LOGF) {
    return -__logf(-logf(u));
  } else {
    float log2_w;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(log2_w) : "f"(-LogOfUnit(u)));
    return log2_w * -0.693147182464599609375f;
  }
#else
  return -std::log(-std::log(u));
#endif
}

// Version 2 of the draft noise (docs/spec.md): one Philox block gives the noise of four consecutive
// columns, g(4 q + w) from word w of the block at counter (q, position, kDraftStream, 0).
// g[i][w] = g(4 block[i] + w) for N independent (key, block, position) at once (WIDE: see MulHiLo).
template <int N, bool WIDE = false, bool LOGF = false>
MARKOV_HD void GumbelNoiseBlock(const uint32_t (&k0)[N], const uint32_t (&k1)[N], const uint32_t (&block)[N],
                                const uint32_t (&position)[N], float (&g)[N][4]) {
  uint32_t x[N][4];
  Philox4x32<N, WIDE>(block, position, kDraftStream, k0, k1, x);
  MARKOV_UNROLL
  for (int i = 0; i < N; ++i) {
    MARKOV_UNROLL
    for (int w = 0; w < 4; ++w) g[i][w] = GumbelOfWord<LOGF>(x[i][w]);
  }
}

// Word w (0-3, known at run time) of a block, by selects (no indexed register array).
MARKOV_HD uint32_t BlockWord(const uint32_t (&x)[4], uint32_t w) {
  return w == 0 ? x[0] : (w == 1 ? x[1] : (w == 2 ? x[2] : x[3]));
}

// g(v[i]) for N independent (key, column, position) at once, each from its own block floor(v / 4)
// (word v mod 4): for columns that share no block. Columns that do should take GumbelNoiseBlock,
// a quarter of the Philox work.
template <int N, bool WIDE = false, bool LOGF = false>
MARKOV_HD void GumbelNoise(const uint32_t (&k0)[N], const uint32_t (&k1)[N], const uint32_t (&v)[N],
                           const uint32_t (&position)[N], float (&g)[N]) {
  uint32_t block[N], x[N][4];
  MARKOV_UNROLL
  for (int i = 0; i < N; ++i) block[i] = v[i] >> 2;
  Philox4x32<N, WIDE>(block, position, kDraftStream, k0, k1, x);
  MARKOV_UNROLL
  for (int i = 0; i < N; ++i) g[i] = GumbelOfWord<LOGF>(BlockWord(x[i], v[i] & 3u));
}

template <bool LOGF = false>
MARKOV_HD float GumbelNoise(uint32_t k0, uint32_t k1, uint32_t v, uint32_t position) {
  const uint32_t k0s[1] = {k0}, k1s[1] = {k1}, vs[1] = {v}, ps[1] = {position};
  float g[1];
  GumbelNoise<1, false, LOGF>(k0s, k1s, vs, ps, g);
  return g[0];
}

// Orders float scores as unsigned integers: larger float -> larger integer, every NaN largest
// (so the first NaN wins, as jnp.argmax), -0 equal to +0. Adding +0 turns -0 into +0; one xor
// then flips all bits of a negative score and only the sign bit of a positive one.
MARKOV_HD uint32_t OrderedScore(float score) {
  const float s = score + 0.0f;
  uint32_t bits = BitCast<uint32_t>(s);
  bits ^= static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u;
#if defined(__CUDA_ARCH__)
  // The GPU's float arithmetic (the add above) gives every NaN as 0x7FFFFFFF, whose ordered bits
  // are already 0xFFFFFFFF (tests/test_cuda.py feeds NaNs of both signs and other payloads).
  return bits;
#else
  return s != s ? 0xFFFFFFFFu : bits;
#endif
}

// The argmax key: its integer maximum is the docs/spec.md choice (largest score, lowest index on ties).
// 0 is below every real key and marks "no candidate yet".
MARKOV_HD uint64_t PackArgmaxKey(float score, uint32_t index) {
  return (static_cast<uint64_t>(OrderedScore(score)) << 32) | (0xFFFFFFFFu - index);
}

MARKOV_HD uint32_t ArgmaxKeyIndex(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// Where the CUDA walk's grid-wide exchange takes one atomicMax per request, each request's key lies on
// a 128-byte line of its own (keys kKeyStride words apart), so that the atomics of different requests
// meet in different L2 slices rather than queueing on a few lines.
constexpr int kKeyStride = 16;

MARKOV_HD int32_t ClampIndex(int64_t id, int64_t size) {
  return static_cast<int32_t>(id < 0 ? 0 : (id >= size ? size - 1 : id));
}

}  // namespace jax_markov
