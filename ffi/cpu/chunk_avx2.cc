// The AVX2+FMA+F16C scorer of a chunk (chunk.h): W2 rows converted a tile at a time, their dots with
// every request, the logits epilogue, and the greedy and sampled argmaxes, 8 columns at a time.
#include "cpu/isa.h"

#if MARKOV_HAVE_AVX2
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/walk_common.h"
#include "cpu/avx2_primitives.h"
#include "cpu/certified.h"
#include "cpu/chunk.h"
#include "cpu/headroom.h"
#include "cpu/values.h"

namespace jax_markov {
namespace cpu {
namespace avx2 {
namespace {

// Row `row` of a [V, r] W2 of type t (int8 or a float type) to fp32, zero padded to rank8.
MARKOV_AVX2_INLINE void ConvertRow(const Problem& p, const void* w2, ffi::DataType t, int64_t row, float* __restrict dst) {
  const int64_t r = p.rank, r8 = p.rank8, full = r & ~int64_t{7};
  int64_t j = 0;
  switch (t) {
    case ffi::DataType::S8: {
      const int8_t* src = static_cast<const int8_t*>(w2) + row * r;
      for (; j + 16 <= full; j += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
        _mm256_store_ps(dst + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        _mm256_store_ps(dst + j + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
      }
      for (; j < r; ++j) dst[j] = static_cast<float>(src[j]);
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w2) + row * r;
      for (; j < full; j += 8) {
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j)));
        _mm256_store_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
      }
      for (; j < r; ++j) dst[j] = Bf16ToF32(src[j]);
      break;
    }
    case ffi::DataType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(w2) + row * r;
      for (; j < full; j += 8) {
        _mm256_store_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
      }
      for (; j < r; ++j) dst[j] = F16ToF32(src[j]);
      break;
    }
    default: {
      const float* src = static_cast<const float*>(w2) + row * r;
      for (; j < full; j += 8) _mm256_store_ps(dst + j, _mm256_loadu_ps(src + j));
      for (; j < r; ++j) dst[j] = src[j];
    }
  }
  for (j = r; j < r8; ++j) dst[j] = 0.0f;
}

// Rows [v, v + count) of W2 to fp32 rows of rank8 floats (count <= kTileRows). Missing rows of
// the tile repeat the last one (their dots are computed and discarded).
MARKOV_AVX2_FN void ConvertTile(const Problem& p, int64_t v, int64_t count, float* __restrict out) {
  // Prefetch the rows kPrefetchTiles tiles ahead (prefetches never fault, even past the end), so
  // that memory streams while the dots of this tile run.
  const size_t row_bytes = static_cast<size_t>(p.rank) * ElementBytes(p.w2_t);
  const char* ahead = static_cast<const char*>(p.w2) + (v + kPrefetchTiles * kTileRows) * row_bytes;
  for (size_t off = 0; off < kTileRows * row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
  for (int64_t t = 0; t < kTileRows; ++t) ConvertRow(p, p.w2, p.w2_t, v + std::min(t, count - 1), out + t * p.rank8);
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

// A certified greedy request's key over its candidates (chunk-local rows cand[0, count) of the chunk
// from v0): each re-scored from the unquantized W2 exactly as a float head's walk scores it (the same
// conversion, dot (DotRow: DotTile's bits), scale back, fma and rounding), PackArgmaxKey(-inf, v0)
// where there is none. w: a row of scratch.
MARKOV_AVX2_FN uint64_t ExactKey(const Problem& p, const Step& s, int64_t b, int64_t v0, const int32_t* cand,
                                 int64_t count, const char* base, float* w) {
  uint64_t best = PackArgmaxKey(kNegInf, static_cast<uint32_t>(v0));
  const float* up = s.up + 2 * b;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t i = cand[c];
    ConvertRow(p, p.w2_exact, p.w2_exact_t, v0 + i, w);
    const float d = DotRow(w, s.e + b * p.rank8, p.rank8) * up[0] * up[1];
    const float l = std::fma(p.logit_scale, d, LoadAsF32(base, p.base_t, i));
    best = std::max(best, PackArgmaxKey(p.want_logits ? RoundTo(l, p.logits_t) : l, static_cast<uint32_t>(v0 + i)));
  }
  return best;
}

}  // namespace

MARKOV_AVX2_FN void ProcessChunk(const Problem& p, const Step& s, int64_t chunk, Scratch& scratch) {
  const int64_t v0 = chunk * s.chunk_rows;
  const int64_t v1 = std::min(p.vocab, v0 + s.chunk_rows);
  const int64_t vend = std::min(v1, p.vocab_size);
  const int64_t n = std::max<int64_t>(0, vend - v0);
  const int64_t B = p.batch, cr = s.chunk_rows;
  float* w = scratch.w.Get(kTileRows * p.rank8);
  float* dots = scratch.dots.Get(B * cr + kTileRows);
  float* lbuf = scratch.l.Get(cr);
  if (p.certified) {
    scratch.keep.resize(cr);
    scratch.cand.resize(cr);
  }
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
    int32_t rescored = 0;
    if (n > 0) {
      if (s.sampled[b]) {
        best = SampledArgmax8(lbuf, n, v0, s.inv_t[b], p.key[2 * b], p.key[2 * b + 1],
                              static_cast<uint32_t>(p.position[b]) + static_cast<uint32_t>(s.k));
      } else {
        best = GreedyArgmax(lbuf, n, v0);
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

}  // namespace avx2
}  // namespace cpu
}  // namespace jax_markov
#endif  // MARKOV_HAVE_AVX2
