// The certified greedy filter (certified.h has its bound and its rule): each request's margin
// coefficients, the candidates of a chunk, and the counters the tests read.
#include "cpu/certified.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/isa.h"
#include "cpu/values.h"

namespace jax_markov {
namespace cpu {
namespace {

constexpr double kUnit = 0x1p-24;             // u, fp32's unit roundoff
constexpr double kInflate = 1.0 + 0x1p-16;    // the margin's own fp32 roundings (a few per column)
constexpr double kHalfStep = 0.5 + 0x1p-16;   // |residual_j| / scale: half a step, plus W2 / scale's rounding
constexpr double kSafeBias = 0x1p126;         // biases below this (and their sums of two) stay finite

int64_t RoundUp8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// x >= 0 as a float no smaller than x, and a normal one (denormals may be flushed where it is used).
float UpFloat(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return std::max(f, FLT_MIN);
}

// T' of certified.h: the lower bound, lowered to at most the value just below its rounding to
// the logits dtype (T itself where the logits are not rounded).
float Threshold(float lower, bool rounded, ffi::DataType logits_t) {
  if (!rounded) return lower;
  switch (logits_t) {
    case ffi::DataType::BF16: {
      const float r = Bf16ToF32(F32ToBf16(lower));
      return r - (std::fabs(r) * 0x1p-7f + 0x1p-120f);
    }
    case ffi::DataType::F16: {
      const float r = F16ToF32(F32ToF16(lower));
      return r - (std::fabs(r) * 0x1p-10f + 0x1p-24f);
    }
    default:
      return lower;
  }
}

// Column i's int8 logit l8 and margin m (certified.h). l8 unfused or fused (the AVX2 unit's compiler
// may contract it): the bound covers both. A NaN residual norm keeps m NaN (never dropped); a NaN scale
// makes l8 NaN.
__attribute__((always_inline)) inline void ColumnBound(float x, float scale, float rho, float d, float logit_scale,
                                                       const CertifiedBound& bound, float& l8, float& m) {
  l8 = x + logit_scale * (scale * d);
  const float by_norm2 = rho * bound.k_norm2, by_norm1 = scale * bound.k_norm1;
  m = (by_norm1 < by_norm2 ? by_norm1 : by_norm2) + scale * bound.k_scale + bound.k_const + 0x1p-22f * std::fabs(l8);
}

// The filter of certified.h over one chunk, its threshold from the lower bound of the chunk's best
// int8 column (`anchor`, which the chunk finds anyway): no larger than the chunk's largest lower
// bound, so no smaller a set, and one column's bound instead of a max over all of them. Written for
// the compiler to vectorise (the generic and AVX2 entry points below compile it for their ISA).
template <typename BaseT>
__attribute__((always_inline)) inline int64_t Candidates(const Problem& p, const CertifiedBound& bound,
                                                         const BaseT* __restrict base, const float* __restrict d,
                                                         int64_t v0, int64_t n, int64_t anchor,
                                                         int32_t* __restrict keep, int32_t* __restrict cand) {
  const float* __restrict scale = p.w2_scale + v0;
  const float* __restrict rho = p.residual_norm + v0;
  const float ls = p.logit_scale;
  float l8, m;
  ColumnBound(ToF32(base[anchor]), scale[anchor], rho[anchor], d[anchor], ls, bound, l8, m);
  const float lower = l8 - m;
  const float threshold = Threshold(lower == lower ? lower : kNegInf, p.want_logits, p.logits_t);
  for (int64_t i = 0; i < n; ++i) {
    const float x = ToF32(base[i]);
    ColumnBound(x, scale[i], rho[i], d[i], ls, bound, l8, m);
    // A masked column (x = -inf) is -inf exactly; any other is kept unless its upper bound is below
    // the threshold (a NaN one is kept). Integer flags: the loop has no branch and vectorises.
    keep[i] = static_cast<int32_t>(!(l8 + m < threshold)) & static_cast<int32_t>(x != kNegInf);
  }
  for (int64_t i = n; i < RoundUp8(n); ++i) keep[i] = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += 8) {
    int32_t any = 0;
    for (int l = 0; l < 8; ++l) any |= keep[i + l];
    if (any == 0) continue;  // almost every group
    for (int l = 0; l < 8; ++l) {
      if (keep[i + l] != 0) cand[count++] = static_cast<int32_t>(i + l);
    }
  }
  return count;
}

// Every row where the bound cannot be used, else the filter for the base logits' type.
__attribute__((always_inline)) inline int64_t Filter(const Problem& p, const CertifiedBound& bound, const void* base,
                                                     const float* d, int64_t v0, int64_t n, int64_t anchor,
                                                     int32_t* keep, int32_t* cand) {
  if (!bound.safe) {
    for (int64_t i = 0; i < n; ++i) cand[i] = static_cast<int32_t>(i);
    return n;
  }
  switch (p.base_t) {
    case ffi::DataType::BF16:
      return Candidates(p, bound, static_cast<const Bf16*>(base), d, v0, n, anchor, keep, cand);
    case ffi::DataType::F16:
      return Candidates(p, bound, static_cast<const F16*>(base), d, v0, n, anchor, keep, cand);
    default:
      return Candidates(p, bound, static_cast<const float*>(base), d, v0, n, anchor, keep, cand);
  }
}

std::atomic<int64_t> g_decisions{0}, g_rescored{0}, g_max_rescored{0}, g_chunk_sets{0}, g_max_chunk_set{0},
    g_uncertified{0};

void AtomicMax(std::atomic<int64_t>& a, int64_t x) {
  int64_t seen = a.load(std::memory_order_relaxed);
  while (seen < x && !a.compare_exchange_weak(seen, x, std::memory_order_relaxed)) {
  }
}

}  // namespace

CertifiedBound MakeCertifiedBound(const float* e, int64_t rank, int64_t rank8, const float* up, float logit_scale,
                                  float scale_max) {
  const double unscale = static_cast<double>(up[0]) * up[1];  // 2^s: the dots' scale back
  double n1 = 0.0, n2 = 0.0;
  for (int64_t j = 0; j < rank; ++j) {
    const double x = e[j];
    n1 += std::fabs(x);
    n2 += x * x;
  }
  n1 *= unscale;
  n2 = std::sqrt(n2) * unscale;
  const double ls = std::fabs(static_cast<double>(logit_scale));
  CertifiedBound b;
  // The largest bias of the step, int8 or unquantized, is below max(|ls|, 1) 127 scale_max ||e||_1
  // (1 + small); the max with 1 keeps the unscaled dots finite too. NaN or inf: not safe.
  b.safe = std::max(ls, 1.0) * n1 * 127.0 * static_cast<double>(scale_max) * (1.0 + 0x1p-10) < kSafeBias;
  if (!b.safe) return b;
  const double n = static_cast<double>(rank8) / 4.0 + 4.0;
  const double gamma = n * kUnit / (1.0 - n * kUnit);
  const double c = 127.0 * (2.0 * gamma + 3.0 * kUnit) * (1.0 + 0x1p-10);
  const double a = (2.0 * static_cast<double>(rank8) + 8.0) * 0x1p-126 * unscale;
  b.k_norm2 = UpFloat(ls * n2 * kInflate);
  b.k_norm1 = UpFloat(ls * kHalfStep * n1 * kInflate);
  b.k_scale = UpFloat(ls * (c * n1 + a) * kInflate);
  b.k_const = UpFloat(ls * (a + 0x1p-126) * kInflate + 0x1p-120);
  return b;
}

namespace generic {
int64_t CertifiedCandidates(const Problem& p, const CertifiedBound& bound, const void* base, const float* d,
                            int64_t v0, int64_t n, int64_t anchor, int32_t* keep, int32_t* cand) {
  return Filter(p, bound, base, d, v0, n, anchor, keep, cand);
}
}  // namespace generic

#if MARKOV_HAVE_AVX2
namespace avx2 {
MARKOV_AVX2_FN int64_t CertifiedCandidates(const Problem& p, const CertifiedBound& bound, const void* base,
                                           const float* d, int64_t v0, int64_t n, int64_t anchor, int32_t* keep,
                                           int32_t* cand) {
  return Filter(p, bound, base, d, v0, n, anchor, keep, cand);
}
}  // namespace avx2
#endif

void RecordCertifiedStats(const CertifiedStats& call) {
  g_decisions.fetch_add(call.decisions, std::memory_order_relaxed);
  g_rescored.fetch_add(call.rescored, std::memory_order_relaxed);
  g_chunk_sets.fetch_add(call.chunk_sets, std::memory_order_relaxed);
  g_uncertified.fetch_add(call.uncertified, std::memory_order_relaxed);
  AtomicMax(g_max_rescored, call.max_rescored);
  AtomicMax(g_max_chunk_set, call.max_chunk_set);
}

CertifiedStats CertifiedStatsSoFar() {
  CertifiedStats s;
  s.decisions = g_decisions.load();
  s.rescored = g_rescored.load();
  s.max_rescored = g_max_rescored.load();
  s.chunk_sets = g_chunk_sets.load();
  s.max_chunk_set = g_max_chunk_set.load();
  s.uncertified = g_uncertified.load();
  return s;
}

void ResetCertifiedStats() {
  for (auto* a : {&g_decisions, &g_rescored, &g_max_rescored, &g_chunk_sets, &g_max_chunk_set, &g_uncertified}) {
    a->store(0);
  }
}

}  // namespace cpu
}  // namespace jax_markov
