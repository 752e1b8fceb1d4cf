// The 8-lane building blocks of the AVX2 scorer (chunk_avx2.cc), all inlined into it: the dots of a
// tile of W2 rows with several requests, base logits loaded as fp32, logits rounded to their dtype
// and stored, and the Gumbel noise of 8 columns (two Philox blocks and two logs in registers).
#pragma once

#include <cstdint>

#include "common/walk_common.h"
#include "cpu/isa.h"
#include "cpu/values.h"

#if MARKOV_HAVE_AVX2
namespace jax_markov {
namespace cpu {
namespace avx2 {

// Four 8-lane accumulators -> their four sums, each ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
MARKOV_AVX2_INLINE __m128 Reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// dots of R tile rows with Bt requests: out[b * out_stride + i] for i < R.
template <int R, int Bt>
MARKOV_AVX2_INLINE void DotTile(const float* __restrict w, const float* __restrict e, int64_t r8, float* out,
                                int64_t out_stride) {
  __m256 acc[R][Bt];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int b = 0; b < Bt; ++b) acc[i][b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < r8; j += 8) {
    __m256 ev[Bt];
#pragma GCC unroll 8
    for (int b = 0; b < Bt; ++b) ev[b] = _mm256_load_ps(e + b * r8 + j);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 wv = _mm256_load_ps(w + i * r8 + j);
#pragma GCC unroll 8
      for (int b = 0; b < Bt; ++b) acc[i][b] = _mm256_fmadd_ps(wv, ev[b], acc[i][b]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < Bt; ++b)
#pragma GCC unroll 2
    for (int g = 0; g < R; g += 4)
      _mm_storeu_ps(out + b * out_stride + g, Reduce4(acc[g][b], acc[g + 1][b], acc[g + 2][b], acc[g + 3][b]));
}

// The dot of one row with one request, in DotTile's order (8 lanes over j, then Reduce4's tree): the
// same bits as that row's dot in any tile.
MARKOV_AVX2_INLINE float DotRow(const float* __restrict w, const float* __restrict e, int64_t r8) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < r8; j += 8) acc = _mm256_fmadd_ps(_mm256_load_ps(w + j), _mm256_load_ps(e + j), acc);
  const __m256 pairs = _mm256_hadd_ps(acc, acc);     // (l0+l1), (l2+l3) | (l4+l5), (l6+l7)
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);  // ((l0+l1)+(l2+l3)) | ((l4+l5)+(l6+l7))
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

template <typename BaseT>
MARKOV_AVX2_INLINE __m256 LoadBase8(const BaseT* p);
template <>
MARKOV_AVX2_INLINE __m256 LoadBase8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
MARKOV_AVX2_INLINE __m256 LoadBase8<Bf16>(const Bf16* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
template <>
MARKOV_AVX2_INLINE __m256 LoadBase8<F16>(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Logits dtype tags for the epilogue: 0 = not stored, else the dtype stored.
enum class Out { kNone, kF32, kBf16, kF16 };

// Rounds 8 logits to the output dtype, stores them, returns the rounded values.
template <Out kOut>
MARKOV_AVX2_INLINE __m256 RoundStore8(__m256 l, void* out) {
  if constexpr (kOut == Out::kF32) {
    _mm256_storeu_ps(static_cast<float*>(out), l);
    return l;
  } else if constexpr (kOut == Out::kBf16) {
    const __m256i bits = _mm256_castps_si256(l);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    const __m256i nan_bits = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256 is_nan = _mm256_cmp_ps(l, l, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, nan_bits, _mm256_castps_si256(is_nan));
    rounded = _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256i hi = _mm256_srli_epi32(rounded, 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(static_cast<__m128i*>(out), packed);
    return _mm256_castsi256_ps(rounded);
  } else if constexpr (kOut == Out::kF16) {
    const __m128i h = _mm256_cvtps_ph(l, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(static_cast<__m128i*>(out), h);
    return _mm256_cvtph_ps(h);
  } else {
    (void)out;
    return l;
  }
}

template <Out kOut>
MARKOV_AVX2_INLINE float RoundStore1(float l, void* out, int64_t i) {
  if constexpr (kOut == Out::kF32) {
    static_cast<float*>(out)[i] = l;
    return l;
  } else if constexpr (kOut == Out::kBf16) {
    const uint16_t h = F32ToBf16(l);
    static_cast<uint16_t*>(out)[i] = h;
    return Bf16ToF32(h);
  } else if constexpr (kOut == Out::kF16) {
    const uint16_t h = static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(l), _MM_FROUND_TO_NEAREST_INT), 0));
    static_cast<uint16_t*>(out)[i] = h;
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
  } else {
    (void)out;
    (void)i;
    return l;
  }
}

// Philox4x32-10 of the two blocks q and q + 1 at counter (q, position, kDraftStream, 0), one block per
// 128-bit lane, each lane's four words in output order: the noise words of columns 4q .. 4q + 7 in
// order (docs/spec.md). A round is one 64-bit multiply per pair of words, c0 * M0 and c2 * M1 (each in its
// 64-bit half: lo0, hi0, lo1, hi1), reversed into (hi1, lo1, hi0, lo0) and xored with (c1, 0, c3, 0)
// and the key (k0, 0, k1, 0).
MARKOV_AVX2_INLINE __m256i PhiloxTwoBlocks(uint32_t q, uint32_t position, uint32_t key0, uint32_t key1) {
  const auto i32 = [](uint32_t x) { return static_cast<int>(x); };
  const __m256i m = _mm256_setr_epi32(i32(0xD2511F53u), 0, i32(0xCD9E8D57u), 0, i32(0xD2511F53u), 0, i32(0xCD9E8D57u), 0);
  const __m256i w = _mm256_setr_epi32(i32(0x9E3779B9u), 0, i32(0xBB67AE85u), 0, i32(0x9E3779B9u), 0, i32(0xBB67AE85u), 0);
  const __m256i even = _mm256_setr_epi32(-1, 0, -1, 0, -1, 0, -1, 0);
  __m256i c = _mm256_setr_epi32(i32(q), i32(position), i32(kDraftStream), 0, i32(q + 1), i32(position),
                                i32(kDraftStream), 0);
  __m256i k = _mm256_setr_epi32(i32(key0), 0, i32(key1), 0, i32(key0), 0, i32(key1), 0);
#pragma GCC unroll 10
  for (int round = 0; round < 10; ++round) {
    const __m256i product = _mm256_mul_epu32(c, m);
    const __m256i odd_words = _mm256_and_si256(_mm256_shuffle_epi32(c, _MM_SHUFFLE(3, 3, 1, 1)), even);
    c = _mm256_xor_si256(_mm256_shuffle_epi32(product, _MM_SHUFFLE(0, 1, 2, 3)), _mm256_xor_si256(odd_words, k));
    k = _mm256_add_epi32(k, w);
  }
  return c;
}

// Natural log of 8 positive normal floats (Cephes logf: a degree-8 polynomial on [sqrt(1/2) - 1,
// sqrt(2) - 1], about 1 ulp). Inputs here are never 0, negative, subnormal, inf or NaN.
MARKOV_AVX2_INLINE __m256 Log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                                 _mm256_set1_epi32(0x3F000000)));  // [0.5, 1)
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  const __m256 one = _mm256_set1_ps(1.0f);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(m, small)), one);  // m in [sqrt(1/2) - 1, sqrt(2) - 1)
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

// g(v) = -log(-log(u)) for v .. v + 7 (docs/spec.md; v a multiple of 4), from PhiloxTwoBlocks and Log8.
MARKOV_AVX2_INLINE __m256 GumbelNoise8(uint32_t v, uint32_t position, uint32_t key0, uint32_t key1) {
  const __m256i x = PhiloxTwoBlocks(v / 4, position, key0, key1);
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.1920928955078125e-07f));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return _mm256_xor_ps(Log8(_mm256_xor_ps(Log8(u), sign)), sign);
}

}  // namespace avx2
}  // namespace cpu
}  // namespace jax_markov
#endif  // MARKOV_HAVE_AVX2
