// The certified greedy choice of a CertifiedMarkovHead (jax_markov/head.py): int8 W2 scores every
// column, and only the columns that the int8 scores cannot rule out are re-scored exactly from the
// unquantized W2, so that a greedy row chooses what the unquantized head's walk chooses.
//
// The bound. For column v and the step's e (as the dots see it: Headroom-scaled, then scaled back),
// the unquantized dot w.e and the int8 one scale (q.e) differ by the residual's dot,
//   |(w - scale q) . e| <= min(rho ||e||_2, (1/2 + 2^-16) scale ||e||_1)
// (Cauchy-Schwarz with rho = residual_norm[v] >= ||w - scale q||_2; elementwise, each residual is at
// most half a quantization step plus the rounding of W2 / scale). The computed values differ from
// those real dots by their fp32 roundings, each bounded through sum |w_j e_j| <= 127 (1 + 2^-24) scale
// ||e||_1 (|w_j| <= max|row| and scale = max|row| / 127 rounded):
// - each dot: gamma_n sum |w_j e_j| with n = rank8 / 4 + 4 roundings on any term's way (8 lanes of
//   rank8 / 8 multiply-adds, two roundings each where no FMA, a tree of 3, one spare) and
//   gamma_n = n u / (1 - n u), u = 2^-24;
// - the products scale * dot and logit_scale * dot and the sum with the base logit: u |value| each,
//   the last one as 2u |l8| (the term is 4u |l8|: room for the margin's own roundings);
// - underflows flushed to zero (XLA runs with denormals flushed): at most 2^-126 an operation in the
//   scaled dots, (2 rank8 + 8) 2^-126 2^s a dot, and an absolute 2^-120 for the last operations.
// With every coefficient inflated by (1 + 2^-16) for the fp32 arithmetic of the margin itself, the
// margin of column v is
//   m = min(rho k_norm2, scale k_norm1) + scale k_scale + k_const + 2^-22 |l8|,
// and the unquantized logit l as the float walk computes it lies in [l8 - m, l8 + m] after rounding,
// because rounding to nearest is monotone: l = RN(base + bias) with |bias - bias8| inside the margin.
// This holds where nothing overflows: the bound is used only when e is finite and no bias of the
// step can reach 2^126 (`safe`); otherwise every column of the step is re-scored.
//
// The filter (per chunk, per greedy request, as a CTA would with its own columns): T = the lower
// bound l8 - m of the chunk's best int8 column (the column the int8 walk's chunk would keep; NaN: T =
// -inf). T is at most the exact logit of that column, so at most the chunk's best exact logit and at
// most the step's: the exact argmax lies among the columns whose upper bound l8 + m reaches T, and a
// chunk keeps a superset of the step's candidates it holds. Where logits are returned in bf16/f16
// the walk chooses from l rounded to them, so ties appear within one of their units: a column is
// dropped only when its upper bound is below T' = R(T) - (2^-p |R(T)| + tiny) (p = 7 bf16, 10 f16),
// which is at most the value just below R(T) in that dtype. A masked column (base -inf, bias finite)
// is -inf exactly and never a candidate; NaN bounds (a NaN base, scale or residual norm) are never
// dropped. The candidates are re-scored with the unquantized rows by the float walk's own code (same
// bits), the chunk keeps the largest PackArgmaxKey of them (PackArgmaxKey(-inf, v0) where it has
// none), and the step's merge is the usual max over the chunks' keys.
#pragma once

#include <cstdint>

#include "cpu/chunk.h"
#include "cpu/isa.h"

namespace jax_markov {
namespace cpu {

// One certified greedy request's bound at one step (the coefficients of the margin above).
struct CertifiedBound {
  bool safe = false;     // e finite and no bias of the step can overflow: the filter applies
  float k_norm2 = 0.0f;  // |logit_scale| ||e||_2, times residual_norm[v]
  float k_norm1 = 0.0f;  // |logit_scale| (1/2 + 2^-16) ||e||_1, times scale[v]
  float k_scale = 0.0f;  // |logit_scale| (c ||e||_1 + a), times scale[v]: the roundings of both dots
  float k_const = 0.0f;  // |logit_scale| (a + 2^-126) + 2^-120: underflows
};

// The bound of request e (rank values, Headroom-scaled; up its two powers of two) for a head whose
// largest row scale is scale_max (NaN scales left out).
CertifiedBound MakeCertifiedBound(const float* e, int64_t rank, int64_t rank8, const float* up, float logit_scale,
                                  float scale_max);

// The candidates of one chunk of n valid rows for one greedy request: their chunk-local indices in
// cand (all n where !bound.safe), their count returned. base: the request's base logits from the
// chunk's first row; d: the chunk's int8 dots, scaled back; anchor: the chunk's best int8 column
// (chunk-local); keep: RoundUp8(n) ints of scratch. The same filter compiled for each SIMD path (the
// candidates may differ where it fuses a multiply-add; both are sound).
namespace generic {
int64_t CertifiedCandidates(const Problem& p, const CertifiedBound& bound, const void* base, const float* d,
                            int64_t v0, int64_t n, int64_t anchor, int32_t* keep, int32_t* cand);
}  // namespace generic
#if MARKOV_HAVE_AVX2
namespace avx2 {
MARKOV_AVX2_FN int64_t CertifiedCandidates(const Problem& p, const CertifiedBound& bound, const void* base,
                                           const float* d, int64_t v0, int64_t n, int64_t anchor, int32_t* keep,
                                           int32_t* cand);
}  // namespace avx2
#endif

// What the certified walks of this process have re-scored, for tests (module.cc exposes it): greedy
// (request, step) decisions, rows re-scored in all and at most for one decision, (decision, chunk)
// pairs that re-scored a row and the most rows one chunk re-scored for one decision, and decisions
// whose bound could not be used (every row re-scored).
struct CertifiedStats {
  int64_t decisions = 0, rescored = 0, max_rescored = 0, chunk_sets = 0, max_chunk_set = 0, uncertified = 0;
};
void RecordCertifiedStats(const CertifiedStats& call);
CertifiedStats CertifiedStatsSoFar();
void ResetCertifiedStats();

}  // namespace cpu
}  // namespace jax_markov
