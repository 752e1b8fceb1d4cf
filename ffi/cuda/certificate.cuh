// The certified walks' bound (ffi/cpu/certified.h is its CPU form): by how much a column's int8 logit can
// differ from its exact one, the bounds of a column's exact logit that its key gives, and the exact
// re-scoring of a column from the unquantized W2.
//
// The bound. For column v (scale s, int8 row q, unquantized row w, residual norm rho >= ||w - s q||_2),
// the step's exact e (the W1 row as floats), its shift 2^sigma (E = rint(e 2^sigma), the digits' integer
// vector, max |E| in [2^21, 2^22) or, two digits, in [2^13, 2^14), unless sigma is capped) and
// L = |logit_scale|, the biases
//   b8 = the digit kernel's: fl(fl(fl(D) s) U) with D = q.E exact (int32 digit sums), U = 2^-sigma
//        logit_scale (exact: required normal or 0), fl(D) = DigitsToFloat's two roundings (two digits:
//        one; the transposed kernel's l8 = RN(base + fl(s fl(D)) U) rounds once fewer again);
//   br = the re-scoring's: fl(logit_scale fl(w.e)), w.e summed by 8 fused multiply-adds a lane and 5
//        shuffle adds (each term rounded at most 13 times)
// differ by at most X:
//   |w.e - s q.e| <= min(rho ||e||_2, (1/2 + 2^-16) s ||e||_1)   (certified.h: Cauchy-Schwarz or elementwise);
//   |s q.(E 2^-sigma - e)| <= s 2^-sigma (1/2) sum |q_j| <= s 2^-sigma 2^14   (E's rounding, |q_j| <= 128);
//   fl(D): u |d0 + 2^8 d1| + u |fl(D)| <= 2^6 + u |D| (1 + u), u = 2^-24: |d0 + 2^8 d1| < 2^30.01;
//   the roundings of both dots and products, each relative to sum |w_j e_j| or s sum |q_j e_j|, both
//   at most 127 s ||e||_1 (1 + 2^-22) (|w_j| <= max |w| = 127 s rounded): (gamma_13 + 5u) in all, taken
//   as 2^-18 L 127 s ||e||_1;
//   underflows (IEEE gradual, the build does not flush): at most 2^-150 an operation, 2^-140 (L U' + L + 1)
//   with U' = 2^-sigma in all.
// So X = L min(rho_max ||e||_2, (1/2 + 2^-16) s_max ||e||_1) + 2^-18 L 127 s_max ||e||_1 +
// (2^14 + 2^7) L s_max 2^-sigma + 2^-140 (L 2^-sigma + L + 1), with the largest scale and residual norm
// of the columns it bounds (the CTA's, or the head's; taken once a launch: they do not change across
// steps), every operation rounded upward (the cuda __f*_ru intrinsics), then inflated by 2^-20: the
// margin M of the step, per request. The logits l8 = RN(base + b8) and lr = RN(base + br) then differ by at most
// M + 2^-22 |l8| (RN is monotone; the last add rounds each by u |l|).
// This holds where nothing overflows and E is e's: e finite with ||e||_1 <= kMaxShiftedAbs (a larger
// max |e| takes sigma = 0 and its E saturates), 127 s_max ||e||_1 and L times it below 2^124, s_max below
// 2^86 (|fl(D) s| finite) and U normal or 0 (`safe`); otherwise M = +inf and every row is re-scored.
//
// Keys hold y = l8, or l8 rounded to the logits dtype where logits go out (bf16/f16: the walk chooses
// from R(l)), so l8 lies within KeySlack(y) of y, and l8 = -inf says only l8 <= -MaxFinite: a column's
// upper bound is up(y) = y' + KeySlack(y') + M with y' = y, or -MaxFinite for -inf.
#pragma once

#include <cfloat>
#include <cstdint>

#include "common/walk_common.h"
#include "cuda/values.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/operands.cuh"

namespace jax_markov {
namespace walk {

// The float whose OrderedScore is `ordered` (the high word of a key).
__device__ __forceinline__ float OrderedToFloat(uint32_t ordered) {
  return __uint_as_float(ordered & 0x80000000u ? ordered ^ 0x80000000u : ~ordered);
}
__device__ __forceinline__ float KeyScore(unsigned long long key) { return OrderedToFloat(uint32_t(key >> 32)); }

// The largest finite value of the logits dtype (kF32: logits not rounded).
__device__ __forceinline__ float MaxFinite(int dtype) {
  return dtype == kBF16 ? 0x1.fep127f : dtype == kF16 ? 65504.0f : FLT_MAX;
}

// An upper bound of |l8 - y| + 2^-22 |l8| for an int8 logit l8 whose key holds y (l8 rounded to the
// logits dtype, or l8 itself for kF32), y finite.
__device__ __forceinline__ float KeySlack(float y, int dtype) {
  const float relative = dtype == kBF16 ? 0x1p-7f + 0x1p-21f : dtype == kF16 ? 0x1p-10f + 0x1p-21f : 0x1p-21f;
  return __fmaf_ru(fabsf(y), relative, dtype == kF16 ? 0x1p-24f : 0x1p-120f);
}

// up(y): no exact logit of a column whose key holds y is above this.
__device__ __forceinline__ float CertUpper(float y, float margin, int dtype) {
  const float y1 = y == -INFINITY ? -MaxFinite(dtype) : y;
  return __fadd_ru(__fadd_ru(y1, KeySlack(y1, dtype)), margin);
}

// T': the exact choice's exact logit is at least this, given a column whose key holds y_a (finite).
__device__ __forceinline__ float CertThreshold(float y_a, float margin, int dtype) {
  const float lower = __fsub_rd(__fsub_rd(y_a, KeySlack(y_a, dtype)), margin);
  if (dtype == kF32) return lower;
  const float r = dtype == kBF16 ? __bfloat162float(__float2bfloat16_rn(lower)) : __half2float(__float2half_rn(lower));
  const float below = dtype == kBF16 ? __fmaf_ru(fabsf(r), 0x1p-7f, 0x1p-120f) : __fmaf_ru(fabsf(r), 0x1p-10f, 0x1p-24f);
  return __fsub_rd(r, below);
}

// ||e||_1 and ||e||_2^2 of one request's e, rounded upward, from lane L's e[8L .. 8L+7]. The whole
// warp calls it; every lane gets them.
__device__ __forceinline__ float2 CertNorms(const float (&e)[8]) {
  float n1 = 0.0f, n2 = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    n1 = __fadd_ru(n1, fabsf(e[i]));
    n2 = __fmaf_ru(e[i], e[i], n2);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    n1 = __fadd_ru(n1, __shfl_xor_sync(0xffffffffu, n1, m));
    n2 = __fadd_ru(n2, __shfl_xor_sync(0xffffffffu, n2, m));
  }
  return make_float2(n1, n2);
}

// The margin M of one request's step (the comment above), from e's norms (CertNorms), the unscale
// 2^-sigma and the largest scale and residual norm of the columns it bounds (coefficients_ok: both
// finite and >= 0); +inf where the bound cannot be used.
__device__ __forceinline__ float CertMarginOf(float2 norms, float unscale, float logit_scale, float s_max, float r_max,
                                              bool coefficients_ok) {
  const float n1 = norms.x, n2 = norms.y;
  const float ls = fabsf(logit_scale);
  const float p = __fmul_ru(__fmul_ru(127.0f, s_max), n1);  // NaN or inf where e is not finite
  const float u = unscale * logit_scale;                    // exact where normal
  const bool safe = coefficients_ok && n1 <= kMaxShiftedAbs && p < 0x1p124f && __fmul_ru(ls, p) < 0x1p124f &&
                    s_max < 0x1p86f && (logit_scale == 0.0f || (fabsf(u) >= 0x1p-126f && fabsf(u) < INFINITY));
  if (!safe) return INFINITY;
  const float by_norm2 = __fmul_ru(r_max, __fsqrt_ru(n2));
  const float by_norm1 = __fmul_ru(0x1.0002p-1f, __fmul_ru(s_max, n1));  // (1/2 + 2^-16) s ||e||_1
  const float residual = __fmul_ru(ls, by_norm2 < by_norm1 ? by_norm2 : by_norm1);
  const float roundings = __fmul_ru(0x1p-18f, __fmul_ru(ls, p));
  const float digits = __fmul_ru(__fmul_ru(0x1.02p14f, ls), __fmul_ru(s_max, unscale));
  const float tiny = __fmul_ru(0x1p-140f, __fadd_ru(__fmul_ru(ls, unscale), __fadd_ru(ls, 1.0f)));
  return __fmul_ru(__fadd_ru(__fadd_ru(residual, roundings), __fadd_ru(digits, tiny)), 1.0f + 0x1p-20f);
}

// The same from lane L's e[8L .. 8L+7]. The whole warp calls it; every lane gets it.
__device__ __forceinline__ float CertMargin(const float (&e)[8], float unscale, float logit_scale, float s_max, float r_max,
                                            bool coefficients_ok) {
  return CertMarginOf(CertNorms(e), unscale, logit_scale, s_max, r_max, coefficients_ok);
}

// Exact keys of up to N columns of request r at step k (cols: warp-uniform rows, -1 or rows past V for
// none; vocab and steps: a's), from lane L's e[8L .. 8L+7]; the largest, or 0. Each key holds lr, rounded to the logits dtype
// where `rounded`. rows_read counts the unquantized W2 rows read: columns at or past vocab_size are -inf
// without theirs, and so, with SKIP_MASKED (only where the step's margin is finite, so that
// logit_scale (w . e) is finite), are columns of -inf base (their base loaded first: a masked row costs
// that load alone); otherwise every load is issued at once. The whole warp calls it.
template <int N, bool SKIP_MASKED>
__device__ __forceinline__ unsigned long long ExactKeys(const WalkArgs& a, int vocab, int steps, int r, int k, const float (&e)[8],
                                                       const int (&cols)[N], int lane, bool rounded, int& rows_read) {
  const int esize = ElementBytes(a.w2_exact_dtype), bsize = ElementBytes(a.base_dtype);
  uint4 raw[N][2];
  uint32_t base_bits[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    base_bits[j] = 0;
    if (cols[j] >= 0 && cols[j] < vocab) {
      const size_t at = (size_t(r) * steps + k) * vocab + cols[j];
      base_bits[j] = bsize == 4 ? __ldg(static_cast<const uint32_t*>(a.base) + at)
                                : __ldg(static_cast<const unsigned short*>(a.base) + at);
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    raw[j][0] = raw[j][1] = make_uint4(0, 0, 0, 0);
    const bool masked = SKIP_MASKED && BitsToFloat(base_bits[j], a.base_dtype) == -INFINITY;
    if (cols[j] >= 0 && cols[j] < a.vocab_size && !masked) {
      ++rows_read;
      const uint4* w =
          reinterpret_cast<const uint4*>(static_cast<const char*>(a.w2_exact) + size_t(cols[j]) * kRank * esize);
      raw[j][0] = __ldg(w + (esize == 4 ? 2 * lane : lane));
      if (esize == 4) raw[j][1] = __ldg(w + 2 * lane + 1);
    }
  }
  unsigned long long best = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float w[8];
    RowFloats(a.w2_exact_dtype, raw[j], w);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) dot = __fmaf_rn(w[i], e[i], dot);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, m));
    if (cols[j] < 0 || cols[j] >= vocab) continue;
    const float base = BitsToFloat(base_bits[j], a.base_dtype);
    float l = cols[j] < a.vocab_size ? __fadd_rn(base, __fmul_rn(a.logit_scale, dot)) : -INFINITY;
    if (rounded) l = StoreRoundedSelect(nullptr, 0, a.logits_dtype, l, false);
    const unsigned long long key = PackArgmaxKey(l, uint32_t(cols[j]));
    best = key > best ? key : best;
  }
  return best;
}

}  // namespace walk
}  // namespace jax_markov
