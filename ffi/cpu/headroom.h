// The overflow guard of the dots (the design comment in handler.cc): e is scaled down by a power of
// two before its dots with W2 and the dots are scaled back up.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/values.h"

namespace jax_markov {
namespace cpu {

// 2^k as a float for k in [-126, 127] (the exponent bits set directly).
inline float PowerOfTwo(int k) { return BitsFloat(static_cast<uint32_t>(k + 127) << 23); }

// Scales e[0, rank) down by 2^-s, s = s1 + s2 >= 0 with |e| 2^-s < 1 / (2 rank), so that a dot of e
// with any finite fp32 row never overflows in a partial sum; up = (2^s1, 2^s2) scale its dots back
// (two factors keep each a normal float). s = 0 where e is small, zero or holds an infinity or NaN
// (IEEE arithmetic then decides). Exactly jax_markov/reference.py's headroom_shifts.
inline void Headroom(float* e, int64_t rank, float* up) {
  float m = 0.0f;  // max |e|, NaN if any is NaN
  for (int64_t j = 0; j < rank; ++j) {
    const float a = std::fabs(e[j]);
    m = (m < a || a != a) ? a : m;
  }
  const int biased = static_cast<int>((FloatBits(m) >> 23) & 0xFFu);  // |e| < 2^(biased - 126)
  int h = 0;  // 2^h >= 2 rank
  while ((int64_t{1} << h) < 2 * rank) ++h;
  const int shift = biased == 0xFF ? 0 : std::max(biased - 126 + h, 0);
  const int s1 = shift / 2, s2 = shift - s1;
  const float down1 = PowerOfTwo(-s1), down2 = PowerOfTwo(-s2);
  for (int64_t j = 0; j < rank; ++j) e[j] = e[j] * down1 * down2;
  up[0] = PowerOfTwo(s1);
  up[1] = PowerOfTwo(s2);
}

// The dots d[0, n) of a Headroom-scaled e scaled back to those of e.
inline void ScaleBack(float* d, int64_t n, const float* up) {
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] * up[0] * up[1];
}

}  // namespace cpu
}  // namespace jax_markov
