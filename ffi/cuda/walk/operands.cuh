// The step's e = W1[prev] of each request, turned into the MMA operands that score W2's tiles: fp16 or
// bf16 B fragments (hi + lo columns where the MMA's format holds fewer bits than W1), or e's balanced
// int8 digits (three for up to 2 requests, two above), as B columns or (EREGS) as the A operand held
// in registers. Each request's row is scaled by a power of two first (RowShift), undone exactly after
// the dot product; the embeds row is written on the way.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/smem_layout.h"
#include "common/walk_common.h"
#include "cuda/mma.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/wgmma.cuh"

namespace jax_markov {
namespace walk {

// Where the step's B fragments live in shared memory: the 32-bit word of column n, k = 2 kp + 8 half
// (and k + 1) at k-step s. For wgmma (WG), per k-step a [16 x 8 NT] block in the canonical K-major
// layout without swizzle: core matrices of 8 columns x 8 k (128 contiguous bytes, 16 per column), the
// two k-halves of a k-step 128 bytes apart, groups of 8 columns 256 bytes apart. For mma.sync, the
// fragment of lane (n & 7, kp) of n-tile n / 8 at k-step s, as one 8-byte load: [NT][16][32 lanes].
template <int NT, bool WG>
__device__ __forceinline__ int FragWord(int s, int n, int half, int kp) {
  if constexpr (WG) return s * 64 * NT + (n >> 3) * 64 + half * 32 + (n & 7) * 4 + kp;
  return 2 * (((n >> 3) * 16 + s) * 32 + (n & 7) * 4 + kp) + half;
}

// The shared-memory descriptor of k-step 0's B block for wgmma (k-halves 128 bytes apart, groups of 8
// columns 256 bytes apart); k-step s adds s * WalkSmem<NT, false>::kFragStepBytes / 16.
__device__ __forceinline__ uint64_t FragDescriptor(const void* frag) { return WgmmaDescriptor(frag, 128, 256); }

// k-steps kBatch h .. kBatch h + kBatch - 1 of a tile's dot products on the warpgroup's tensor cores,
// A from op (k-step kBatch h + i: op[i]); waits for them, so that op's registers are free again and d
// is complete. The empty asm after the wait keeps every read of d after it.
template <int NT, bool BF16, int kBatch>
__device__ __forceinline__ void WgmmaBatch(const uint32_t (&op)[kBatch][4], uint64_t desc, int h, float (&d)[4 * NT]) {
  WgmmaFence();
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int s = kBatch * h + i;
    Wgmma<NT, BF16>(d, op[i][0], op[i][1], op[i][2], op[i][3], desc + uint64_t(s * WalkSmem<NT, false>::kFragStepBytes / 16), s > 0);
  }
  WgmmaCommit();
  WgmmaWait<0>(d);
}

// Lane `lane`'s words of the W1 rows of N target tokens (clamped into W1), in one batch of loads:
// e[8 lane .. 8 lane + 7], 16 bytes of a 16-bit row (raw[u][0]) or 32 of an f32 row.
template <int N>
__device__ __forceinline__ void LoadW1Rows(const WalkArgs& a, const int (&row)[N], int lane, uint4 (&raw)[N][2]) {
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int r = ClampIndex(row[u], a.v_target);
    if (a.w1_dtype == kF32) {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const float*>(a.w1) + size_t(r) * kRank) + 2 * lane;
      raw[u][0] = __ldg(src);
      raw[u][1] = __ldg(src + 1);
    } else {
      raw[u][0] = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(a.w1) + size_t(r) * kRank) + lane);
    }
  }
}

// x rounded to fp16 (BF16: bf16), as bits, and that value back as a float.
template <bool BF16>
__device__ __forceinline__ unsigned short NarrowBits(float x) {
  return BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
template <bool BF16>
__device__ __forceinline__ float WidenBits(unsigned short h) {
  return BF16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
}

// 8 consecutive elements of a row of dtype `dtype` as floats, from their raw words (raw[0]: 16 bytes of
// a 16-bit row; raw[0], raw[1]: 32 bytes of an f32 row). Exact.
__device__ __forceinline__ void RowFloats(int dtype, const uint4 (&raw)[2], float (&x)[8]) {
  if (dtype == kF32) {
    const float* f = reinterpret_cast<const float*>(&raw[0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = f[i];
  } else {
    const uint32_t words[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned short bits = static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2)));
      x[i] = dtype == kBF16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
    }
  }
}

// Lane L's 8 elements e[8L .. 8L+7] of request b's W1 row as floats (raw words of W1[prev_b]);
// writes the embeds row when this CTA owns request b.
__device__ __forceinline__ void LoadRowAndEmbeds(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                 float (&e)[8]) {
  RowFloats(a.w1_dtype, raw, e);
  if (a.embeds != nullptr && b % gridDim.x == blockIdx.x) {
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(a.embeds) + (size_t(b) * a.steps + k) * kRank * (a.w1_dtype == kF32 ? 4 : 2));
    if (a.w1_dtype == kF32) {
      dst[2 * lane] = raw[0];
      dst[2 * lane + 1] = raw[1];
    } else {
      dst[lane] = raw[0];
    }
  }
}

// The largest |e| of a row that RowShift scales: a larger finite one takes shift 0 as a non-finite row
// does, and its integers saturate (the walk's scores of such a row are not e's; the certified walk
// re-scores every column of its step).
constexpr float kMaxShiftedAbs = 3.0e38f;

// The shift that brings the row's largest |e| into [2^(top - 1), 2^top) (at most max_shift; 0 for
// a zero or non-finite row, or one above kMaxShiftedAbs). Lane 0 records 2^-shift, which undoes it
// exactly after the dot product.
// amax's biased exponent field is frexpf's exponent + 126 where amax is normal; a subnormal amax
// reads as 2^-126 and gets max_shift either way (top + 126 > max_shift). With top <= 22 and
// max_shift <= 126, shift and -shift are in Pow2's range.
__device__ __forceinline__ int RowShift(const float (&e)[8], int top, int max_shift, int lane, float* unscale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(e[i]));
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  int shift = 0;
  if (amax > 0.0f && amax <= kMaxShiftedAbs) shift = min(top - (int(__float_as_uint(amax) >> 23) - 126), max_shift);
  if (lane == 0) *unscale = Pow2(-shift);
  return shift;
}

// e[0..7] x `up` rounded to integers, each in N balanced int8 digits (v = d0 + 2^8 d1 + ..., the top
// digit taking what is left), packed 4 a word: words[d][0..1] hold digit d of the 8 elements.
template <int N>
__device__ __forceinline__ void DigitWords(const float (&e)[8], float up, uint32_t (&words)[N][2]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float scaled = e[i] * up;
    int v = isfinite(scaled) ? __float2int_rn(scaled) : 0;
#pragma unroll
    for (int d = 0; d < N; ++d) {
      const int digit = d < N - 1 ? ((v + 128) & 0xFF) - 128 : v;
      v = (v - digit) >> 8;
      words[d][i / 4] |= uint32_t(digit & 0xFF) << (8 * (i % 4));
    }
  }
}

// Request b's e (lane L: e[8L .. 8L+7]) as E = rint(e 2^shift), max |E| in [2^(top - 1), 2^top), in N
// balanced int8 digits (DigitWords); records the unscale and writes the embeds row (LoadRowAndEmbeds).
template <int N>
__device__ __forceinline__ void RowDigitWords(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2], int top,
                                              float* unscale, uint32_t (&words)[N][2]) {
  float e[8];
  LoadRowAndEmbeds(a, b, k, lane, raw, e);
  const int shift = RowShift(e, top, 126, lane, unscale + b);
  DigitWords(e, Pow2(shift), words);
}

// Small batches (B <= 2) score with int8 tensor cores, with no conversion of W2 at all: e is
// written as a 24-bit integer E = rint(e * 2^shift) (max |E| in [2^21, 2^22)) in three balanced
// int8 digits, E = d0 + 2^8 d1 + 2^16 d2, and each digit is its own B column (column 3b + d). The
// int32 products and sums are exact; only e's bits below 2^-22 of its largest element are lost.
// Lane L writes digit d of e[8L .. 8L+7] to bytes 8L .. 8L+7 of row 3b + d of `digits` ([8][256]).
__device__ __forceinline__ void BuildDigits(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                            int8_t* digits, float* unscale) {
  uint32_t words[3][2] = {};
  RowDigitWords(a, b, k, lane, raw, 22, unscale, words);
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    reinterpret_cast<uint2*>(digits + (3 * b + d) * kRank)[lane] = make_uint2(words[d][0], words[d][1]);
  }
}

// Converts request b's W1 row (raw words of lane L: e[8L .. 8L+7]) into its B columns in the MMA's
// format (fp16, or bf16 against a bf16 W2; layout at FragWord), writes its embeds row when this CTA
// owns request b, and records the power-of-two unscale.
//
// Where each element of e sits follows the A layout of W2's format. A lane's 4 values of row g at
// k-step s are r = 16 (4 (s >> 2) + t) + 4 (s & 3) + j for int8 rows (16-byte chunks of 16 values)
// and r = 8 (4 (s >> 1) + t) + 4 (s & 1) + j for 16-bit rows (chunks of 8 values); values j = 0, 1
// are MMA k = 2t, 2t + 1 and j = 2, 3 are k = 2t + 8, 2t + 9.
template <int NT, bool SPLIT, int W2, bool WG>
__device__ __forceinline__ void BuildFragments(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                               uint32_t* frag, float* unscale) {
  constexpr bool kBF16 = W2 == kW2BF16;
  float e[8];
  LoadRowAndEmbeds(a, b, k, lane, raw, e);
  // max|e| in [2^14, 2^15): fp16 then holds 11 significant bits of every element that matters
  // (bf16's range is fp32's; the same shift does no harm there).
  const int shift = RowShift(e, 15, 100, lane, unscale + b);
  unsigned short hi[8], lo[8];
  const float up = Pow2(shift);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = e[i] * up;
    hi[i] = NarrowBits<kBF16>(x);
    lo[i] = SPLIT ? NarrowBits<kBF16>(x - WidenBits<kBF16>(hi[i])) : 0;
  }
  const int tt = W2 == kW2Int8 ? (lane >> 1) & 3 : lane & 3;
#pragma unroll
  for (int part = 0; part < (SPLIT ? 2 : 1); ++part) {
    const int column = SPLIT ? 2 * b + part : b;
    const unsigned short* h = part ? lo : hi;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int s = W2 == kW2Int8 ? 4 * (lane >> 3) + 2 * (lane & 1) + u : 2 * (lane >> 2) + u;
      frag[FragWord<NT, WG>(s, column, 0, tt)] = uint32_t(h[4 * u]) | (uint32_t(h[4 * u + 1]) << 16);
      frag[FragWord<NT, WG>(s, column, 1, tt)] = uint32_t(h[4 * u + 2]) | (uint32_t(h[4 * u + 3]) << 16);
    }
  }
}

// Batches of 3-8 requests whose logits are not returned or whose W1 is bf16 (PAIRS) score with int8
// tensor cores too: e as E = rint(e * 2^shift) (max |E| in [2^13, 2^14)) in two balanced int8 digits,
// E = d0 + 2^8 d1, in SPLIT's column layout (n-tile b / 4, columns 2 (b % 4) + d), so that lane t
// holds both digit sums of request 4 i + t. E keeps 15 bits below e's largest element, as the
// transposed kernel's digits do: all the bits of a bf16 element but its smallest ones; other W1
// dtypes walk tokens only, which may differ only at near-ties. The B fragment of lane (n, t) at
// m16n8k32 step j is 8 bytes at [NT][8][32 lanes]: E's digits at k = 64 (j / 2) + 16 t + 8 (j % 2) +
// 0..7, the k order of FragmentChunk's A words, so lane L's 8 elements (k = 8 L ..) are step
// 2 (L / 8) + L % 2 of t = (L / 2) % 4.
template <int NT>
__device__ __forceinline__ void BuildDigitPairs(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                uint32_t* frag, float* unscale) {
  uint32_t words[2][2] = {};
  RowDigitWords(a, b, k, lane, raw, 14, unscale, words);  // the high digit within [-64, 64]
  const int j = 2 * (lane >> 3) + (lane & 1), t = (lane >> 1) & 3;
#pragma unroll
  for (int d = 0; d < 2; ++d) {
    const int n = 2 * (b % 4) + d;
    reinterpret_cast<uint2*>(frag)[((b / 4) * 8 + j) * 32 + n * 4 + t] = make_uint2(words[d][0], words[d][1]);
  }
}

// Batches of 9-16 requests walked greedily with no logits out (EREGS) take the same two digits the
// other way round: as the A operand of m16n8k32, with W2's tile words as B (n-tile 0: rows 0-7 of the
// tile, n-tile 1: rows 8-15), so that no k-step reads e from shared memory and W2 is not converted.
// M-tile m, row r is digit r / 8 of request 8 m + r % 8; each warp holds both M-tiles' A fragments of
// all 8 k-steps (16 x 16 bytes a lane) for the whole step. Lane (g, t)'s fragment of k-step j is 16
// bytes at [2 m][8 j][32 lanes], {digit 0, digit 1} of request 8 m + g at k = 64 (j / 2) + 16 t +
// 8 (j % 2) + 0..3, then the same at + 4..7: FragmentChunk's k order, as in BuildDigitPairs.
__device__ __forceinline__ void BuildDigitPairOperands(const WalkArgs& a, int b, int k, int lane, const uint4 (&raw)[2],
                                                       uint32_t* frag, float* unscale) {
  uint32_t words[2][2] = {};
  RowDigitWords(a, b, k, lane, raw, 14, unscale, words);
  const int j = 2 * (lane >> 3) + (lane & 1), t = (lane >> 1) & 3;
  reinterpret_cast<uint4*>(frag)[((b / 8) * 8 + j) * 32 + 4 * (b % 8) + t] =
      make_uint4(words[0][0], words[1][0], words[0][1], words[1][1]);
}

// Request finished by slot i of thread-in-group t: with SPLIT, n-tile i holds (hi, lo) columns of
// request 4i + t; otherwise n-tile i / 2 holds requests 8(i / 2) + 2t and 8(i / 2) + 2t + 1.
// With DIGITS (B <= 2), lane t = 0 finishes request 0 and t = 2 request 1; t = 1, 3 own none.
// With EREGS (e as the A operand, BuildDigitPairOperands), slot i of group g holds request 8i + g.
template <bool SPLIT, bool DIGITS = false, bool EREGS = false>
__device__ __forceinline__ int SlotRequest(int i, int t, int g = 0) {
  if (EREGS) return 8 * i + g;
  if (DIGITS) return t == 0 ? 0 : (t == 2 ? 1 : kMaxBatch);
  return SPLIT ? i * 4 + t : (i / 2) * 8 + 2 * t + (i % 2);
}

}  // namespace walk
}  // namespace jax_markov
