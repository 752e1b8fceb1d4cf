// What scoring one chunk of vocabulary rows for one draft step takes (handler.cc cuts a step into
// chunks and runs them on XLA's thread pool): the problem, constant over one call; the step,
// constant over one draft step; each thread's scratch; and the two scorers, portable
// (chunk_generic.cc) and AVX2 (chunk_avx2.cc), which write the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu/isa.h"
#include "xla/ffi/api/ffi.h"

namespace jax_markov {
namespace cpu {

namespace ffi = xla::ffi;

constexpr int kTileRows = 8;       // W2 rows converted and dotted together
constexpr int kPrefetchTiles = 4;  // how far ahead W2 is prefetched, in tiles

struct Problem {
  int64_t batch, steps, vocab, rank, rank8, vocab_size, v_target;
  ffi::DataType base_t, w1_t, w2_t, logits_t, w2_exact_t;
  bool int8, want_logits, want_embeds, has_d2t;
  bool certified;  // a CertifiedMarkovHead: greedy rows re-score their candidates (certified.h)
  float logit_scale;
  const void* base;
  const int32_t* anchor;
  const void* w1;
  const void* w2;
  const float* w2_scale;
  const void* w2_exact;        // [V, r] the unquantized W2 (certified only)
  const float* residual_norm;  // [V] (certified only)
  const float* temperature;
  const uint32_t* key;
  const int32_t* position;
  const int32_t* d2t;
  int32_t* tokens;
  void* logits;
  void* embeds;
};

struct CertifiedBound;  // certified.h

struct Step {
  int64_t k;
  const float* e;          // [B][rank8] scaled by Headroom, zero padded, 64-byte aligned
  const float* up;         // [B][2] the powers of two that scale the dots of e back (Headroom)
  const float* inv_t;      // [B]
  const uint8_t* sampled;  // [B]
  int64_t chunk_rows, num_chunks;
  uint64_t* keys;  // [num_chunks][B]
  const CertifiedBound* bounds;  // [B] each greedy request's bound (certified only)
  int32_t* rescored;             // [num_chunks][B] rows each chunk re-scored (certified only)
};

// Aligned scratch memory.
struct AlignedFloats {
  float* data = nullptr;
  size_t size = 0;
  ~AlignedFloats() { std::free(data); }
  float* Get(size_t n) {
    if (n > size) {
      std::free(data);
      size = std::max<size_t>(n, 2 * size);
      data = static_cast<float*>(std::aligned_alloc(64, ((size * sizeof(float) + 63) / 64) * 64));
      if (data == nullptr) size = 0;
    }
    return data;
  }
};

struct Scratch {
  AlignedFloats w;     // [kTileRows][r8] one tile of W2 rows in fp32
  AlignedFloats dots;  // [B][chunk_rows] dots of the chunk
  AlignedFloats l;     // [chunk_rows] logits of one request
  std::vector<int32_t> keep;  // [chunk_rows] which rows a certified greedy request keeps (certified.h)
  std::vector<int32_t> cand;  // [chunk_rows] their indices
};

// The largest Gumbel noise GumbelNoise can return (u = 1 - 2^-24, from the word 0xFFFFFFFF, whichever
// word of a block a column takes), plus a margin for Log8's error: a sampled candidate whose
// fma(l, 1/T, kGumbelBound) is below the best score so far cannot win, and its noise is not
// computed. Rounding is monotone, so skipping is exact.
inline const float kGumbelBound = [] {
  const float u = (static_cast<float>(0x7FFFFFu) + 0.5f) * 1.1920928955078125e-07f;
  return -std::log(-std::log(u)) + 0.01f;
}();

namespace generic {
// Scores chunk `chunk` of step s: its logits (stored when requested) and each request's best key
// in s.keys[chunk * B + b].
void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch);
}  // namespace generic

#if MARKOV_HAVE_AVX2
namespace avx2 {
// The same, on the AVX2 path.
MARKOV_AVX2_FN void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch);
}  // namespace avx2
#endif

}  // namespace cpu
}  // namespace jax_markov
