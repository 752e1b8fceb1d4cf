// The portable scorer of a chunk (chunk.h): plain C++ that compilers vectorise, in the AVX2 path's
// order of operations, so that both paths give the same bits.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/walk_common.h"
#include "cpu/certified.h"
#include "cpu/chunk.h"
#include "cpu/headroom.h"
#include "cpu/values.h"

namespace jax_markov {
namespace cpu {
namespace generic {
namespace {

// Sampled rows (portable path): the lowest argmax of l * (1/T) + g(v) over l[0..n) (rows v0 + i),
// where a -inf l scores -inf (never -inf * 0 = NaN at 1/T = 0), skipping the noise of a column that
// cannot beat the best score so far. The words of the last Philox block drawn are kept: consecutive
// columns that need noise share a block (docs/spec.md: one block per four columns).
inline uint64_t SampledArgmax(const float* l, int64_t n, int64_t v0, float inv_t, uint32_t k0, uint32_t k1,
                              uint32_t position) {
  const uint32_t k0s[1] = {k0}, k1s[1] = {k1}, positions[1] = {position};
  uint32_t block[1] = {0}, words[1][4];
  bool have_block = false;
  uint64_t best = 0;
  float best_score = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    const float x = l[i];
    if (best != 0 && (x == kNegInf || x * inv_t + kGumbelBound < best_score)) continue;
    const uint32_t v = static_cast<uint32_t>(v0 + i);
    float score = kNegInf;
    if (x != kNegInf) {
      if (!have_block || block[0] != v / 4) {
        block[0] = v / 4;
        have_block = true;
        Philox4x32<1, false>(block, positions, kDraftStream, k0s, k1s, words);
      }
      score = x * inv_t + GumbelOfWord(words[0][v % 4]);
    }
    const uint64_t key = PackArgmaxKey(score, v);
    if (key > best) {
      best = key;
      best_score = score;
    }
  }
  return best;
}

// Row v of a [V, r] W2 of type t (int8 or a float type) to fp32, zero padded to rank8.
void ConvertRow(const Problem& p, const void* w2, ffi::DataType t, int64_t v, float* out) {
  const int64_t r = p.rank;
  switch (t) {
    case ffi::DataType::S8: {
      const int8_t* src = static_cast<const int8_t*>(w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = static_cast<float>(src[j]);
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = Bf16ToF32(src[j]);
      break;
    }
    case ffi::DataType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = F16ToF32(src[j]);
      break;
    }
    default: {
      const float* src = static_cast<const float*>(w2) + v * r;
      std::memcpy(out, src, r * sizeof(float));
    }
  }
  for (int64_t j = r; j < p.rank8; ++j) out[j] = 0.0f;
}

// 8 fp32 lanes over j, then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): the AVX2 path's order.
inline float Dot(const float* __restrict w, const float* __restrict e, int64_t rank8) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < rank8; j += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += w[j + l] * e[j + l];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A certified greedy request's key over its candidates (chunk-local rows cand[0, count) of the chunk
// from v0): each re-scored from the unquantized W2 exactly as a float head's walk scores it (the same
// conversion, dot, scale back, logit and rounding), PackArgmaxKey(-inf, v0) where there is none.
uint64_t ExactKey(const Problem& p, const Step& s, int64_t b, int64_t v0, const int32_t* cand, int64_t count,
                  const void* base, float* w) {
  uint64_t best = PackArgmaxKey(kNegInf, static_cast<uint32_t>(v0));
  const float* up = s.up + 2 * b;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t i = cand[c];
    ConvertRow(p, p.w2_exact, p.w2_exact_t, v0 + i, w);
    const float d = Dot(w, s.e + b * p.rank8, p.rank8) * up[0] * up[1];
    const float bias = p.logit_scale * d;
    const float l = LoadAsF32(base, p.base_t, i) + bias;
    best = std::max(best, PackArgmaxKey(p.want_logits ? RoundTo(l, p.logits_t) : l, static_cast<uint32_t>(v0 + i)));
  }
  return best;
}

}  // namespace

void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch) {
  const int64_t v0 = chunk * s.chunk_rows;
  const int64_t v1 = std::min(p.vocab, v0 + s.chunk_rows);
  const int64_t vend = std::min(v1, p.vocab_size);  // rows >= vocab_size are padding
  const int64_t n = std::max<int64_t>(0, vend - v0);
  const int64_t B = p.batch;
  float* w = scratch.w.Get(p.rank8);
  float* dots = scratch.dots.Get(B * s.chunk_rows);
  float* lbuf = scratch.l.Get(s.chunk_rows);
  if (p.certified) {
    scratch.keep.resize(s.chunk_rows);
    scratch.cand.resize(s.chunk_rows);
  }
  for (int64_t i = 0; i < n; ++i) {
    ConvertRow(p, p.w2, p.w2_t, v0 + i, w);
    for (int64_t b = 0; b < B; ++b) dots[b * s.chunk_rows + i] = Dot(w, s.e + b * p.rank8, p.rank8);
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * p.steps + s.k;
    const void* base = static_cast<const char*>(p.base) + (row * p.vocab + v0) * ElementBytes(p.base_t);
    float* d = dots + b * s.chunk_rows;
    ScaleBack(d, n, s.up + 2 * b);
    for (int64_t i = 0; i < n; ++i) {
      const float bias = p.int8 ? p.logit_scale * (p.w2_scale[v0 + i] * d[i]) : p.logit_scale * d[i];
      lbuf[i] = LoadAsF32(base, p.base_t, i) + bias;
    }
    if (p.want_logits) {
      void* out = static_cast<char*>(p.logits) + (row * p.vocab + v0) * ElementBytes(p.logits_t);
      for (int64_t i = 0; i < n; ++i) lbuf[i] = RoundStoreScalar(lbuf[i], p.logits_t, out, i);
      for (int64_t i = n; i < v1 - v0; ++i) RoundStoreScalar(kNegInf, p.logits_t, out, i);
    }
    uint64_t best = 0;
    int32_t rescored = 0;
    if (n > 0) {
      if (s.sampled[b]) {
        best = SampledArgmax(lbuf, n, v0, s.inv_t[b], p.key[2 * b], p.key[2 * b + 1],
                                    static_cast<uint32_t>(p.position[b]) + static_cast<uint32_t>(s.k));
      } else {
        for (int64_t i = 0; i < n; ++i) best = std::max(best, PackArgmaxKey(lbuf[i], static_cast<uint32_t>(v0 + i)));
        if (p.certified) {  // the int8 best anchors the filter; the exact best of the candidates is kept
          const int64_t anchor = static_cast<int64_t>(ArgmaxKeyIndex(best)) - v0;
          rescored = static_cast<int32_t>(
              CertifiedCandidates(p, s.bounds[b], base, d, v0, n, anchor, scratch.keep.data(), scratch.cand.data()));
          best = ExactKey(p, s, b, v0, scratch.cand.data(), rescored, base, w);
        }
      }
    }
    s.keys[chunk * B + b] = best;
    if (p.certified) s.rescored[chunk * B + b] = rescored;
  }
}

}  // namespace generic
}  // namespace cpu
}  // namespace jax_markov
