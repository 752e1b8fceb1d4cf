// The CPU custom call `jax_markov_walk`: the DSpark Markov walk of ../../shared/SPEC.md, exactly as
// jax_markov/reference.py computes it, fused into one pass over W2 per draft step.
//
// Per step k:
//   1. the caller thread gathers e_b = W1[clamp(prev_b)] for every request into an fp32 buffer E
//      (and writes the embeds);
//   2. the vocabulary is cut into chunks of rows that XLA's intra-op thread pool and the caller
//      thread take from a shared counter. A chunk converts its W2 rows to fp32 once, 8 rows at a
//      time (int8 -> fp32, or bf16/f16/f32 -> fp32), and takes the dot of each converted row with
//      every request's e (rows outer, requests inner: W2 is read once per step for the whole
//      batch). Then, per request: l = fp32(base) + logit_scale * (scale[v] * dot) (or
//      logit_scale * dot for a float head), rounded to the logits dtype, stored, and the chunk's
//      best PackArgmaxKey(score, v) is kept in its own slot;
//   3. the caller waits for every chunk (a counter and a condition variable; pool tasks never wait
//      on anything), merges the chunk keys and sets prev = token (+ d2t[token]).
// Sampled rows draw the Gumbel noise 8 columns at a time (two Philox blocks and the logs in AVX2
// registers), only for columns that could still win. Walks with little work per step stay on the
// calling thread.
//
// Overflow: each e is scaled down by a power of two before its dots (Headroom) so that no partial
// sum of a dot with a finite W2 row can overflow, and the dots are scaled back up: exact wherever
// the result is finite, and a bias too large for fp32 is +-inf by its sign, never the NaN of partial
// sums that overflowed in both directions (jax_markov/reference.py's markov_bias does the same).
//
// Determinism: a row's dot is always computed by the same code in the same order (8 fp32 lanes
// over j, then a fixed pairwise tree), whatever the chunk, thread, tile or batch size, and the key
// merge is a max over a total order, so the same inputs give the same bits on one machine. All
// workers run under the caller's MXCSR (XLA flushes denormals; pool threads may not).
//
// SIMD: an AVX2+FMA+F16C path chosen at run time (__builtin_cpu_supports), and a portable scalar
// path written so that compilers vectorise it. No -march flags: the wheel runs on other machines.
// Where FMA is used, it is used where XLA's CPU backend contracts the reference's expressions
// (l = fma(logit_scale, scale * dot, base), score = fma(l, 1/T, g)), so the logits agree bit for
// bit with the reference up to the dot's summation order.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/walk_common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MARKOV_HAVE_AVX2 1
#include <immintrin.h>
#else
#define MARKOV_HAVE_AVX2 0
#endif

namespace ffi = xla::ffi;

namespace jax_markov {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar conversions (exact, round-to-nearest-even like XLA's convert / jnp's astype).

inline uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}
inline float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline float Bf16ToF32(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quietened).
inline uint16_t F32ToBf16(float f) {
  const uint32_t b = FloatBits(f);
  if (f != f) return static_cast<uint16_t>((b >> 16) | 0x0040u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// IEEE half <-> single, exact, subnormals included (after Maratyszcza's FP16 library).
inline float F16ToF32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = BitsFloat((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = BitsFloat((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? FloatBits(denormalized) : FloatBits(normalized));
  return BitsFloat(result);
}

inline uint16_t F32ToF16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = FloatBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = BitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = FloatBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

template <typename T>
inline float ToF32(T x);
template <>
inline float ToF32<float>(float x) { return x; }

// Storage types: bf16 and f16 are carried as raw uint16 bits, tagged.
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
template <>
inline float ToF32<Bf16>(Bf16 x) { return Bf16ToF32(x.bits); }
template <>
inline float ToF32<F16>(F16 x) { return F16ToF32(x.bits); }
template <>
inline float ToF32<int8_t>(int8_t x) { return static_cast<float>(x); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The largest Gumbel noise GumbelNoise can return (u = 1 - 2^-24, from the word 0xFFFFFFFF, whichever
// word of a block a column takes), plus a margin for Log8's error: a sampled candidate whose
// fma(l, 1/T, kGumbelBound) is below the best score so far cannot win, and its noise is not
// computed. Rounding is monotone, so skipping is exact.
const float kGumbelBound = [] {
  const float u = (static_cast<float>(0x7FFFFFu) + 0.5f) * 1.1920928955078125e-07f;
  return -std::log(-std::log(u)) + 0.01f;
}();

// 2^k as a float for k in [-126, 127] (the exponent bits set directly).
inline float PowerOfTwo(int k) { return BitsFloat(static_cast<uint32_t>(k + 127) << 23); }

// Scales e[0, rank) down by 2^-s, s = s1 + s2 >= 0 with |e| 2^-s < 1 / (2 rank), so that a dot of e
// with any finite fp32 row never overflows in a partial sum; up = (2^s1, 2^s2) scale its dots back
// (two factors keep each a normal float). s = 0 where e is small, zero or holds an infinity or NaN
// (IEEE arithmetic then decides). Exactly jax_markov/reference.py's headroom_shifts.
void Headroom(float* e, int64_t rank, float* up) {
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

// ---------------------------------------------------------------------------------------------
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
};

thread_local Scratch tls_scratch;

constexpr int kTileRows = 8;
constexpr int64_t kMinParallelWork = int64_t{1} << 21;  // V * (r + 8) * (B + 2) below this: one thread
constexpr int kPrefetchTiles = 4;  // how far ahead W2 is prefetched, in tiles

// ---------------------------------------------------------------------------------------------
// The problem, constant over one call, and the step, constant over one draft step.

struct Problem {
  int64_t batch, steps, vocab, rank, rank8, vocab_size, v_target;
  ffi::DataType base_t, w1_t, w2_t, logits_t;
  bool int8, want_logits, want_embeds, has_d2t;
  float logit_scale;
  const void* base;
  const int32_t* anchor;
  const void* w1;
  const void* w2;
  const float* w2_scale;
  const float* temperature;
  const uint32_t* key;
  const int32_t* position;
  const int32_t* d2t;
  int32_t* tokens;
  void* logits;
  void* embeds;
};

struct Step {
  int64_t k;
  const float* e;          // [B][rank8] scaled by Headroom, zero padded, 64-byte aligned
  const float* up;         // [B][2] the powers of two that scale the dots of e back (Headroom)
  const float* inv_t;      // [B]
  const uint8_t* sampled;  // [B]
  int64_t chunk_rows, num_chunks;
  uint64_t* keys;  // [num_chunks][B]
};

size_t ElementBytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S8: return 1;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F32:
    case ffi::DataType::S32:
    case ffi::DataType::U32: return 4;
    default: return 0;
  }
}

// Rounds l to the logits dtype and back, and stores it (scalar; shared by both paths' tails).
inline float RoundStoreScalar(float l, ffi::DataType t, void* out, int64_t i) {
  switch (t) {
    case ffi::DataType::BF16: {
      const uint16_t h = F32ToBf16(l);
      static_cast<uint16_t*>(out)[i] = h;
      return Bf16ToF32(h);
    }
    case ffi::DataType::F16: {
      const uint16_t h = F32ToF16(l);
      static_cast<uint16_t*>(out)[i] = h;
      return F16ToF32(h);
    }
    default:
      static_cast<float*>(out)[i] = l;
      return l;
  }
}

inline float LoadAsF32(const void* p, ffi::DataType t, int64_t i) {
  switch (t) {
    case ffi::DataType::BF16: return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
    case ffi::DataType::F16: return F16ToF32(static_cast<const uint16_t*>(p)[i]);
    case ffi::DataType::S8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Sampled rows (portable path): the lowest argmax of l * (1/T) + g(v) over l[0..n) (rows v0 + i),
// where a -inf l scores -inf (never -inf * 0 = NaN at 1/T = 0), skipping the noise of a column that
// cannot beat the best score so far. The words of the last Philox block drawn are kept: consecutive
// columns that need noise share a block (SPEC.md: one block per four columns).
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

// ---------------------------------------------------------------------------------------------
// Portable path.

namespace generic {

// One W2 row (any dtype) to fp32, zero padded to rank8.
void ConvertRow(const Problem& p, int64_t v, float* out) {
  const int64_t r = p.rank;
  switch (p.w2_t) {
    case ffi::DataType::S8: {
      const int8_t* src = static_cast<const int8_t*>(p.w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = static_cast<float>(src[j]);
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(p.w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = Bf16ToF32(src[j]);
      break;
    }
    case ffi::DataType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(p.w2) + v * r;
      for (int64_t j = 0; j < r; ++j) out[j] = F16ToF32(src[j]);
      break;
    }
    default: {
      const float* src = static_cast<const float*>(p.w2) + v * r;
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

void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch) {
  const int64_t v0 = chunk * s.chunk_rows;
  const int64_t v1 = std::min(p.vocab, v0 + s.chunk_rows);
  const int64_t vend = std::min(v1, p.vocab_size);  // rows >= vocab_size are padding
  const int64_t n = std::max<int64_t>(0, vend - v0);
  const int64_t B = p.batch;
  float* w = scratch.w.Get(p.rank8);
  float* dots = scratch.dots.Get(B * s.chunk_rows);
  float* lbuf = scratch.l.Get(s.chunk_rows);
  for (int64_t i = 0; i < n; ++i) {
    ConvertRow(p, v0 + i, w);
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
    if (n > 0) {
      if (s.sampled[b]) {
        best = SampledArgmax(lbuf, n, v0, s.inv_t[b], p.key[2 * b], p.key[2 * b + 1],
                                    static_cast<uint32_t>(p.position[b]) + static_cast<uint32_t>(s.k));
      } else {
        for (int64_t i = 0; i < n; ++i) best = std::max(best, PackArgmaxKey(lbuf[i], static_cast<uint32_t>(v0 + i)));
      }
    }
    s.keys[chunk * B + b] = best;
  }
}

}  // namespace generic

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C path.

#if MARKOV_HAVE_AVX2
namespace avx2 {

#define MARKOV_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define MARKOV_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

// Rows [v, v + count) of W2 to fp32 rows of rank8 floats (count <= kTileRows). Missing rows of
// the tile repeat the last one (their dots are computed and discarded).
MARKOV_AVX2_FN void ConvertTile(const Problem& p, int64_t v, int64_t count, float* __restrict out) {
  const int64_t r = p.rank, r8 = p.rank8, full = r & ~int64_t{7};
  // Prefetch the rows kPrefetchTiles tiles ahead (prefetches never fault, even past the end), so
  // that memory streams while the dots of this tile run.
  const size_t row_bytes = static_cast<size_t>(r) * ElementBytes(p.w2_t);
  const char* ahead = static_cast<const char*>(p.w2) + (v + kPrefetchTiles * kTileRows) * row_bytes;
  for (size_t off = 0; off < kTileRows * row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
  for (int64_t t = 0; t < kTileRows; ++t) {
    const int64_t row = v + std::min(t, count - 1);
    float* dst = out + t * r8;
    int64_t j = 0;
    switch (p.w2_t) {
      case ffi::DataType::S8: {
        const int8_t* src = static_cast<const int8_t*>(p.w2) + row * r;
        for (; j + 16 <= full; j += 16) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
          _mm256_store_ps(dst + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
          _mm256_store_ps(dst + j + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
        }
        for (; j < r; ++j) dst[j] = static_cast<float>(src[j]);
        break;
      }
      case ffi::DataType::BF16: {
        const uint16_t* src = static_cast<const uint16_t*>(p.w2) + row * r;
        for (; j < full; j += 8) {
          const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j)));
          _mm256_store_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
        for (; j < r; ++j) dst[j] = Bf16ToF32(src[j]);
        break;
      }
      case ffi::DataType::F16: {
        const uint16_t* src = static_cast<const uint16_t*>(p.w2) + row * r;
        for (; j < full; j += 8) {
          _mm256_store_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
        }
        for (; j < r; ++j) dst[j] = F16ToF32(src[j]);
        break;
      }
      default: {
        const float* src = static_cast<const float*>(p.w2) + row * r;
        for (; j < full; j += 8) _mm256_store_ps(dst + j, _mm256_loadu_ps(src + j));
        for (; j < r; ++j) dst[j] = src[j];
      }
    }
    for (j = r; j < r8; ++j) dst[j] = 0.0f;
  }
}

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

// Dots of one converted tile (kTileRows rows) with every request; writes dots[b * stride + i].
MARKOV_AVX2_FN void TileDots(const float* __restrict w, const float* __restrict e, int64_t B, int64_t r8,
                             float* dots, int64_t stride) {
  if (B == 1) {
    DotTile<8, 1>(w, e, r8, dots, stride);
    return;
  }
  int64_t b = 0;
  for (; b + 3 <= B; b += 3) {
    DotTile<4, 3>(w, e + b * r8, r8, dots + b * stride, stride);
    DotTile<4, 3>(w + 4 * r8, e + b * r8, r8, dots + b * stride + 4, stride);
  }
  if (B - b == 2) {
    DotTile<4, 2>(w, e + b * r8, r8, dots + b * stride, stride);
    DotTile<4, 2>(w + 4 * r8, e + b * r8, r8, dots + b * stride + 4, stride);
  } else if (B - b == 1) {
    DotTile<8, 1>(w, e + b * r8, r8, dots + b * stride, stride);
  }
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

// l[i] = round(fma(logit_scale, scale[v] * dot, base)) for the n valid rows of one request.
template <typename BaseT, bool kInt8, Out kOut>
MARKOV_AVX2_FN void Logits(const BaseT* __restrict base, const float* __restrict dots, const float* __restrict scale,
                           float logit_scale, int64_t n, void* out, float* __restrict l) {
  const __m256 ls = _mm256_set1_ps(logit_scale);
  const size_t out_bytes = kOut == Out::kF32 ? 4 : 2;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 d = _mm256_load_ps(dots + i);
    if constexpr (kInt8) d = _mm256_mul_ps(_mm256_loadu_ps(scale + i), d);
    const __m256 x = _mm256_fmadd_ps(ls, d, LoadBase8<BaseT>(base + i));
    _mm256_store_ps(l + i, RoundStore8<kOut>(x, static_cast<char*>(out) + i * out_bytes));
  }
  for (; i < n; ++i) {
    const float d = kInt8 ? scale[i] * dots[i] : dots[i];
    l[i] = RoundStore1<kOut>(std::fma(logit_scale, d, ToF32(base[i])), out, i);
  }
}

template <typename BaseT, bool kInt8>
MARKOV_AVX2_FN void LogitsFor(ffi::DataType out_t, bool want, const BaseT* base, const float* dots, const float* scale,
                              float ls, int64_t n, void* out, float* l) {
  if (!want) return Logits<BaseT, kInt8, Out::kNone>(base, dots, scale, ls, n, out, l);
  switch (out_t) {
    case ffi::DataType::BF16: return Logits<BaseT, kInt8, Out::kBf16>(base, dots, scale, ls, n, out, l);
    case ffi::DataType::F16: return Logits<BaseT, kInt8, Out::kF16>(base, dots, scale, ls, n, out, l);
    default: return Logits<BaseT, kInt8, Out::kF32>(base, dots, scale, ls, n, out, l);
  }
}

// Philox4x32-10 of the two blocks q and q + 1 at counter (q, position, kDraftStream, 0), one block per
// 128-bit lane, each lane's four words in output order: the noise words of columns 4q .. 4q + 7 in
// order (SPEC.md). A round is one 64-bit multiply per pair of words, c0 * M0 and c2 * M1 (each in its
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

// g(v) = -log(-log(u)) for v .. v + 7 (SPEC.md; v a multiple of 4), from PhiloxTwoBlocks and Log8.
MARKOV_AVX2_INLINE __m256 GumbelNoise8(uint32_t v, uint32_t position, uint32_t key0, uint32_t key1) {
  const __m256i x = PhiloxTwoBlocks(v / 4, position, key0, key1);
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.1920928955078125e-07f));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return _mm256_xor_ps(Log8(_mm256_xor_ps(Log8(u), sign)), sign);
}

// Sampled rows: the lowest argmax of fma(l, 1/T, g(v)) over l[0..n) (rows v0 + i, v0 a multiple of 8),
// where a -inf l scores -inf (never -inf * 0 = NaN at 1/T = 0), 8 columns at a time; the noise of 8
// columns is skipped when none of them can beat the best score so far.
MARKOV_AVX2_FN uint64_t SampledArgmax8(const float* __restrict l, int64_t n, int64_t v0, float inv_t, uint32_t key0,
                                       uint32_t key1, uint32_t position) {
  const __m256 it = _mm256_set1_ps(inv_t), bound = _mm256_set1_ps(kGumbelBound), neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  uint64_t best = 0;
  float best_score = kNegInf;
  alignas(32) float scores[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t valid = std::min<int64_t>(8, n - i);
    const __m256 in_range = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane));
    // lanes past n (inside the buffer, garbage) read -inf and are never candidates
    const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_load_ps(l + i), in_range);
    const __m256 masked = _mm256_cmp_ps(x, neg_inf, _CMP_EQ_OQ);
    const __m256 best_v = _mm256_set1_ps(best_score);
    const __m256 hopeless = _mm256_or_ps(_mm256_cmp_ps(_mm256_fmadd_ps(x, it, bound), best_v, _CMP_LT_OQ), masked);
    if (best != 0 && _mm256_movemask_ps(hopeless) == 0xFF) {
      continue;  // every lane's best possible score is below the best so far
    }
    const __m256 g = GumbelNoise8(static_cast<uint32_t>(v0 + i), position, key0, key1);
    const __m256 score = _mm256_blendv_ps(_mm256_fmadd_ps(x, it, g), neg_inf, masked);
    const __m256 better = _mm256_or_ps(_mm256_cmp_ps(score, best_v, _CMP_GT_OQ), _mm256_cmp_ps(score, score, _CMP_UNORD_Q));
    if (best != 0 && _mm256_movemask_ps(_mm256_and_ps(better, in_range)) == 0) continue;
    _mm256_store_ps(scores, score);
    for (int64_t t = 0; t < valid; ++t) {
      const uint64_t key = PackArgmaxKey(scores[t], static_cast<uint32_t>(v0 + i + t));
      if (key > best) {
        best = key;
        best_score = scores[t];
      }
    }
  }
  return best;
}

// The lowest index of the largest value (NaN largest, the first NaN wins), as a packed key.
MARKOV_AVX2_FN uint64_t GreedyArgmax(const float* __restrict l, int64_t n, int64_t v0) {
  __m256 vmax0 = _mm256_set1_ps(kNegInf), vmax1 = vmax0;
  __m256 vnan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = _mm256_load_ps(l + i), x1 = _mm256_load_ps(l + i + 8);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x0, x1, _CMP_UNORD_Q));
    vmax0 = _mm256_max_ps(vmax0, x0);
    vmax1 = _mm256_max_ps(vmax1, x1);
  }
  vmax0 = _mm256_max_ps(vmax0, vmax1);
  float m = kNegInf;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax0);
  for (int t = 0; t < 8; ++t) m = std::max(m, lanes[t]);
  bool nan = _mm256_movemask_ps(vnan) != 0;
  for (; i < n; ++i) {
    nan |= l[i] != l[i];
    m = std::max(m, l[i]);
  }
  // The first index holding the maximum (or the first NaN), 8 at a time.
  const __m256 target = _mm256_set1_ps(m);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 x = _mm256_load_ps(l + t);
    const int mask = _mm256_movemask_ps(nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, target, _CMP_EQ_OQ));
    if (mask != 0) {
      t += __builtin_ctz(static_cast<unsigned>(mask));
      return PackArgmaxKey(l[t], static_cast<uint32_t>(v0 + t));
    }
  }
  for (; t < n; ++t) {
    if (nan ? l[t] != l[t] : l[t] == m) return PackArgmaxKey(l[t], static_cast<uint32_t>(v0 + t));
  }
  return PackArgmaxKey(l[0], static_cast<uint32_t>(v0));  // unreachable
}

MARKOV_AVX2_FN void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch) {
  const int64_t v0 = chunk * s.chunk_rows;
  const int64_t v1 = std::min(p.vocab, v0 + s.chunk_rows);
  const int64_t vend = std::min(v1, p.vocab_size);
  const int64_t n = std::max<int64_t>(0, vend - v0);
  const int64_t B = p.batch, cr = s.chunk_rows;
  float* w = scratch.w.Get(kTileRows * p.rank8);
  float* dots = scratch.dots.Get(B * cr + kTileRows);
  float* lbuf = scratch.l.Get(cr);
  for (int64_t t = 0; t < n; t += kTileRows) {
    ConvertTile(p, v0 + t, std::min<int64_t>(kTileRows, n - t), w);
    TileDots(w, s.e, B, p.rank8, dots + t, cr);
  }
  const float* scale = p.int8 ? p.w2_scale + v0 : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * p.steps + s.k;
    const char* base = static_cast<const char*>(p.base) + (row * p.vocab + v0) * ElementBytes(p.base_t);
    void* out = p.want_logits ? static_cast<char*>(p.logits) + (row * p.vocab + v0) * ElementBytes(p.logits_t)
                              : nullptr;
    float* d = dots + b * cr;
    ScaleBack(d, n, s.up + 2 * b);
    switch (p.base_t) {
      case ffi::DataType::BF16:
        if (p.int8) LogitsFor<Bf16, true>(p.logits_t, p.want_logits, reinterpret_cast<const Bf16*>(base), d, scale, p.logit_scale, n, out, lbuf);
        else LogitsFor<Bf16, false>(p.logits_t, p.want_logits, reinterpret_cast<const Bf16*>(base), d, scale, p.logit_scale, n, out, lbuf);
        break;
      case ffi::DataType::F16:
        if (p.int8) LogitsFor<F16, true>(p.logits_t, p.want_logits, reinterpret_cast<const F16*>(base), d, scale, p.logit_scale, n, out, lbuf);
        else LogitsFor<F16, false>(p.logits_t, p.want_logits, reinterpret_cast<const F16*>(base), d, scale, p.logit_scale, n, out, lbuf);
        break;
      default:
        if (p.int8) LogitsFor<float, true>(p.logits_t, p.want_logits, reinterpret_cast<const float*>(base), d, scale, p.logit_scale, n, out, lbuf);
        else LogitsFor<float, false>(p.logits_t, p.want_logits, reinterpret_cast<const float*>(base), d, scale, p.logit_scale, n, out, lbuf);
    }
    if (p.want_logits) {
      for (int64_t i = n; i < v1 - v0; ++i) RoundStoreScalar(kNegInf, p.logits_t, out, i);
    }
    uint64_t best = 0;
    if (n > 0) {
      if (s.sampled[b]) {
        best = SampledArgmax8(lbuf, n, v0, s.inv_t[b], p.key[2 * b], p.key[2 * b + 1],
                              static_cast<uint32_t>(p.position[b]) + static_cast<uint32_t>(s.k));
      } else {
        best = GreedyArgmax(lbuf, n, v0);
      }
    }
    s.keys[chunk * B + b] = best;
  }
}

}  // namespace avx2
#endif  // MARKOV_HAVE_AVX2

// ---------------------------------------------------------------------------------------------
// Dispatch and threading.

enum class Isa : int { kGeneric = 0, kAvx2 = 1 };

Isa DetectIsa() {
#if MARKOV_HAVE_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kGeneric;
}

std::atomic<int> g_isa{-1};

Isa CurrentIsa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    const char* force = std::getenv("JAX_MARKOV_CPU_ISA");
    isa = static_cast<int>(force && std::string(force) == "generic" ? Isa::kGeneric : DetectIsa());
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<Isa>(isa);
}

// The work of one step, shared with pool tasks. Tasks that start after every chunk is taken touch
// nothing but this object (they own a reference to it), so the caller never waits for them.
struct StepWork {
  const Problem* problem = nullptr;  // only read after taking a chunk (the caller is still waiting then)
  const Step* step = nullptr;        // same
  int64_t num_chunks = 0;
  Isa isa = Isa::kGeneric;
  unsigned mxcsr = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Work() {
    int64_t chunk = next.fetch_add(1, std::memory_order_relaxed);
    if (chunk >= num_chunks) return;
#if MARKOV_HAVE_AVX2
    const unsigned saved_mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr);
#endif
    Scratch& scratch = tls_scratch;
    int64_t finished = 0;
    for (; chunk < num_chunks; chunk = next.fetch_add(1, std::memory_order_relaxed)) {
#if MARKOV_HAVE_AVX2
      if (isa == Isa::kAvx2) {
        avx2::ProcessChunk(*problem, *step, chunk, scratch);
      } else {
        generic::ProcessChunk(*problem, *step, chunk, scratch);
      }
#else
      generic::ProcessChunk(*problem, *step, chunk, scratch);
#endif
      ++finished;
    }
#if MARKOV_HAVE_AVX2
    _mm_setcsr(saved_mxcsr);
#endif
    if (done.fetch_add(finished, std::memory_order_acq_rel) + finished == num_chunks) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Shape checks.

std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
}

bool HasShape(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

ffi::Error Bad(const std::string& what) { return ffi::Error::InvalidArgument("jax_markov_walk (cpu): " + what); }

}  // namespace

ffi::Error MarkovWalkCpu(ffi::ThreadPool pool, ffi::AnyBuffer base, ffi::AnyBuffer anchor, ffi::AnyBuffer w1,
                         ffi::AnyBuffer w2, ffi::AnyBuffer w2_scale, ffi::AnyBuffer temperature, ffi::AnyBuffer key,
                         ffi::AnyBuffer position, ffi::AnyBuffer d2t, ffi::Result<ffi::AnyBuffer> tokens,
                         ffi::Result<ffi::AnyBuffer> logits, ffi::Result<ffi::AnyBuffer> embeds, int64_t vocab_size,
                         float logit_scale, bool sampling) {
  // ---- operands
  const auto bd = base.dimensions();
  if (bd.size() != 3 || !IsFloat(base.element_type())) {
    return Bad("base_logits must be a bf16/f16/f32 [B, K, V] array, got rank " + std::to_string(bd.size()) + " " +
               Dims(bd));
  }
  const int64_t B = bd[0], K = bd[1], V = bd[2];
  if (B < 1 || K < 1 || V < 1) return Bad("base_logits must have B, K, V >= 1, got " + Dims(bd));
  const auto w1d = w1.dimensions();
  if (w1d.size() != 2 || !IsFloat(w1.element_type()) || w1d[0] < 1 || w1d[1] < 1) {
    return Bad("w1 must be a non-empty bf16/f16/f32 [V_target, r] array, got " + Dims(w1d));
  }
  const int64_t v_target = w1d[0], rank = w1d[1];
  const bool int8 = w2.element_type() == ffi::DataType::S8;
  if (!int8 && !IsFloat(w2.element_type())) return Bad("w2 must be s8, bf16, f16 or f32");
  if (!HasShape(w2.dimensions(), {V, rank})) {
    return Bad("w2 must be [V, r] = [" + std::to_string(V) + ", " + std::to_string(rank) + "], got " +
               Dims(w2.dimensions()));
  }
  if (w2_scale.element_type() != ffi::DataType::F32 || !HasShape(w2_scale.dimensions(), {int8 ? V : 0})) {
    return Bad(std::string("w2_scale must be f32 ") + (int8 ? "[V] for an s8 w2" : "[0] for a float w2") + ", got " +
               Dims(w2_scale.dimensions()));
  }
  if (anchor.element_type() != ffi::DataType::S32 || !HasShape(anchor.dimensions(), {B})) {
    return Bad("anchor must be s32 [B] = [" + std::to_string(B) + "], got " + Dims(anchor.dimensions()));
  }
  if (temperature.element_type() != ffi::DataType::F32 || !HasShape(temperature.dimensions(), {B})) {
    return Bad("temperature must be f32 [B], got " + Dims(temperature.dimensions()));
  }
  if (key.element_type() != ffi::DataType::U32 || !HasShape(key.dimensions(), {B, 2})) {
    return Bad("key must be u32 [B, 2], got " + Dims(key.dimensions()));
  }
  if (position.element_type() != ffi::DataType::S32 || !HasShape(position.dimensions(), {B})) {
    return Bad("position must be s32 [B], got " + Dims(position.dimensions()));
  }
  const bool has_d2t = HasShape(d2t.dimensions(), {V});
  if (d2t.element_type() != ffi::DataType::S32 || !(has_d2t || HasShape(d2t.dimensions(), {0}))) {
    return Bad("d2t must be s32 [V] or [0], got " + Dims(d2t.dimensions()));
  }
  if (vocab_size < 1 || vocab_size > V) {
    return Bad("vocab_size must be in [1, V = " + std::to_string(V) + "], got " + std::to_string(vocab_size));
  }
  // ---- results
  if (tokens->element_type() != ffi::DataType::S32 || !HasShape(tokens->dimensions(), {B, K})) {
    return Bad("tokens must be s32 [B, K], got " + Dims(tokens->dimensions()));
  }
  const bool want_logits = HasShape(logits->dimensions(), {B, K, V});
  if (!IsFloat(logits->element_type()) || !(want_logits || HasShape(logits->dimensions(), {0}))) {
    return Bad("logits must be f32/bf16/f16 [B, K, V] or [0], got " + Dims(logits->dimensions()));
  }
  const bool want_embeds = HasShape(embeds->dimensions(), {B, K, rank});
  if (embeds->element_type() != w1.element_type() || !(want_embeds || HasShape(embeds->dimensions(), {0}))) {
    return Bad("embeds must be [B, K, r] or [0] in w1's dtype, got " + Dims(embeds->dimensions()));
  }

  Problem p;
  p.batch = B;
  p.steps = K;
  p.vocab = V;
  p.rank = rank;
  p.rank8 = (rank + 7) & ~int64_t{7};
  p.vocab_size = vocab_size;
  p.v_target = v_target;
  p.base_t = base.element_type();
  p.w1_t = w1.element_type();
  p.w2_t = w2.element_type();
  p.logits_t = logits->element_type();
  p.int8 = int8;
  p.want_logits = want_logits;
  p.want_embeds = want_embeds;
  p.has_d2t = has_d2t;
  p.logit_scale = logit_scale;
  p.base = base.untyped_data();
  p.anchor = static_cast<const int32_t*>(anchor.untyped_data());
  p.w1 = w1.untyped_data();
  p.w2 = w2.untyped_data();
  p.w2_scale = static_cast<const float*>(w2_scale.untyped_data());
  p.temperature = static_cast<const float*>(temperature.untyped_data());
  p.key = static_cast<const uint32_t*>(key.untyped_data());
  p.position = static_cast<const int32_t*>(position.untyped_data());
  p.d2t = static_cast<const int32_t*>(d2t.untyped_data());
  p.tokens = static_cast<int32_t*>(tokens->untyped_data());
  p.logits = logits->untyped_data();
  p.embeds = embeds->untyped_data();

  // ---- per-request constants (a walk given no temperatures, `sampling` false, is all greedy)
  std::vector<float> inv_t(B);
  std::vector<uint8_t> sampled(B);
  for (int64_t b = 0; b < B; ++b) {
    const float t = p.temperature[b];
    sampled[b] = sampling && t > 0.0f;
    inv_t[b] = sampled[b] ? 1.0f / t : 0.0f;
  }
  std::vector<int32_t> prev(p.anchor, p.anchor + B);

  // ---- chunking: enough chunks to balance the pool, each a multiple of the tile
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk_rows = (V + 8 * threads - 1) / (8 * threads);
  chunk_rows = std::clamp<int64_t>((chunk_rows + kTileRows - 1) / kTileRows * kTileRows, 64, 512);
  const int64_t num_chunks = (V + chunk_rows - 1) / chunk_rows;
  // The calling thread works too, so num_threads - 1 pool tasks keep one worker per pool thread
  // (the pool has one thread per core). Small steps (about a tenth of a millisecond of work) stay on
  // the calling thread: waking pool threads would cost more than it saves.
  const bool small = V * (rank + 8) * (B + 2) < kMinParallelWork;
  const int64_t tasks = small ? 0 : std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, num_chunks - 1));

  const Isa isa = CurrentIsa();
#if MARKOV_HAVE_AVX2
  const unsigned mxcsr = _mm_getcsr();
#else
  const unsigned mxcsr = 0;
#endif

  AlignedFloats e_buf;
  float* e = e_buf.Get(B * p.rank8);
  if (e == nullptr) return ffi::Error::Internal("jax_markov_walk (cpu): out of memory");
  std::vector<uint64_t> keys(num_chunks * B);
  std::vector<float> up(2 * B);
  const size_t w1_bytes = ElementBytes(p.w1_t);

  for (int64_t k = 0; k < K; ++k) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t id = ClampIndex(prev[b], v_target);
      const char* src = static_cast<const char*>(p.w1) + id * rank * w1_bytes;
      float* dst = e + b * p.rank8;
      for (int64_t j = 0; j < rank; ++j) dst[j] = LoadAsF32(src, p.w1_t, j);
      for (int64_t j = rank; j < p.rank8; ++j) dst[j] = 0.0f;
      Headroom(dst, rank, up.data() + 2 * b);
      if (want_embeds) std::memcpy(static_cast<char*>(p.embeds) + ((b * K + k) * rank) * w1_bytes, src, rank * w1_bytes);
    }
    Step step{k, e, up.data(), inv_t.data(), sampled.data(), chunk_rows, num_chunks, keys.data()};
    auto work = std::make_shared<StepWork>();
    work->problem = &p;
    work->step = &step;
    work->num_chunks = num_chunks;
    work->isa = isa;
    work->mxcsr = mxcsr;
    for (int64_t t = 0; t < tasks; ++t) pool.Schedule([work] { work->Work(); });
    work->Work();
    {
      std::unique_lock<std::mutex> lock(work->mu);
      work->cv.wait(lock, [&] { return work->done.load(std::memory_order_acquire) == num_chunks; });
    }
    for (int64_t b = 0; b < B; ++b) {
      uint64_t best = 0;
      for (int64_t c = 0; c < num_chunks; ++c) best = std::max(best, keys[c * B + b]);
      const int32_t token = static_cast<int32_t>(ArgmaxKeyIndex(best));
      const int32_t target =
          has_d2t ? static_cast<int32_t>(static_cast<uint32_t>(token) + static_cast<uint32_t>(p.d2t[token])) : token;
      p.tokens[b * K + k] = target;
      prev[b] = target;
    }
  }
  return ffi::Error::Success();
}

// For tests and benchmarks: which SIMD path runs ("avx2" or "generic"), and forcing one.
const char* CpuIsaName() { return CurrentIsa() == Isa::kAvx2 ? "avx2" : "generic"; }

bool SetCpuIsa(const std::string& name) {
  if (name == "generic") {
    g_isa.store(static_cast<int>(Isa::kGeneric));
    return true;
  }
  if (name == "avx2" || name == "auto") {
    const Isa detected = DetectIsa();
    if (name == "avx2" && detected != Isa::kAvx2) return false;
    g_isa.store(static_cast<int>(detected));
    return true;
  }
  return false;
}

}  // namespace jax_markov

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarkovWalkCpu, jax_markov::MarkovWalkCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // base_logits
                                  .Arg<ffi::AnyBuffer>()  // anchor
                                  .Arg<ffi::AnyBuffer>()  // w1
                                  .Arg<ffi::AnyBuffer>()  // w2
                                  .Arg<ffi::AnyBuffer>()  // w2_scale
                                  .Arg<ffi::AnyBuffer>()  // temperature
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // position
                                  .Arg<ffi::AnyBuffer>()  // d2t
                                  .Ret<ffi::AnyBuffer>()  // tokens
                                  .Ret<ffi::AnyBuffer>()  // logits
                                  .Ret<ffi::AnyBuffer>()  // embeds
                                  .Attr<int64_t>("vocab_size")
                                  .Attr<float>("logit_scale")
                                  .Attr<bool>("sampling"));
