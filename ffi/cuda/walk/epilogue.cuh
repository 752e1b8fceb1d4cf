// MarkovWalkKernel's epilogues: a tile's dot products become l = base + bias, rounded to the logits
// dtype (and stored) where logits go out, scored (l for greedy rows, l / T + g for sampled ones) and
// folded into the lane's best key per owned request. Which epilogue a tile takes (Epilogue) is decided
// once a launch, by what its rows need: none of them branches per row.
#pragma once

#include "cuda/walk/kernel.cuh"

namespace jax_markov {
namespace walk {

// A row's key folded into the best of owned slot i. A certified walk also keeps the slot's
// second-best ordered score (certified.cuh: the CTA's second best, and a lane with two candidates
// re-scores all its rows), with no branches.
template <class T>
__device__ __forceinline__ void WalkCta<T>::Keep(unsigned long long& best, int i, unsigned long long key) const {
  if constexpr (CERT) lane_second[i] = max(lane_second[i], uint32_t(min(key, best) >> 32));  // what best does not keep
  best = key > best ? key : best;
}

// Greedy rows and no logits out: l and its key, with no branches and no masks. Rows past vocab_size
// (rows past V among them) are -inf, so their keys lose to any row below V; the slots of requests
// past the batch are never published.
template <class T>
__device__ __forceinline__ void WalkCta<T>::FoldPlain(unsigned long long& best, int i, int row, float base, float bias) const {
  const float l = row < a.vocab_size ? base + bias : -INFINITY;
  Keep(best, i, PackArgmaxKey(l, uint32_t(row)));
}

// The plain epilogue for base logits of dtype BASE.
template <class T>
template <int BASE>
__device__ __forceinline__ void WalkCta<T>::PlainEpilogue(const TileScores<kSlots>& s, const float (&unscale_of)[kUnscaleSlots],
                                                          unsigned long long (&best)[kSlots]) const {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const float unscale_i = UnscaleOf(unscale_of, i);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float bias = ((h ? s.scale_b : s.scale_a) * (h ? s.dot_b[i] : s.dot_a[i])) * unscale_i;
      FoldPlain(best[i], i, h ? s.row_b : s.row_a, BaseToFloat<BASE>(h ? s.base_b[i] : s.base_a[i]), bias);
    }
  }
}

// EREGS's epilogue of the held tile at step k: lane (g, t) folds rows 8h + 2t + c for requests 8m + g
// (slot m), from bf16 base logits loaded in pairs. The bf16-logits form (greedy rows only) folds the
// rounded logits and stores both rows' in one 4-byte store (V is even, so the two rows are both below
// V or both past it).
template <class T>
__device__ __forceinline__ void WalkCta<T>::PairOperandEpilogue(int tile, int k, const uint32_t (&base_a)[kSlots],
                                                                const uint32_t (&base_b)[kSlots], const int (&acc)[2][2][4],
                                                                const float (&unscale_of)[kUnscaleSlots],
                                                                unsigned long long (&best)[kSlots]) const {
  const int row0 = RowOf(tile);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float2 scale = *reinterpret_cast<const float2*>(scales + tile * kTileRows + 8 * h + 2 * t);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const uint32_t bits = h ? base_b[i] : base_a[i];
      if constexpr (FORM == kPlainForm) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float dot = DigitPairToFloat(acc[i][h][c], acc[i][h][2 + c]);
          const float bias = ((c ? scale.y : scale.x) * dot) * UnscaleOf(unscale_of, i);
          FoldPlain(best[i], i, row0 + 8 * h + 2 * t + c, BaseToFloat<kBF16>(c ? bits >> 16 : bits), bias);
        }
      } else {
        const int row = row0 + 8 * h + 2 * t;  // of c = 0
        const int owner = SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g);
        uint32_t pair = 0;  // both rows' bf16 logits, row + 1 high
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float dot = DigitPairToFloat(acc[i][h][c], acc[i][h][2 + c]);
          const float bias = ((c ? scale.y : scale.x) * dot) * UnscaleOf(unscale_of, i);
          const float logit = row + c < a.vocab_size ? BaseToFloat<kBF16>(c ? bits >> 16 : bits) + bias : -INFINITY;
          const __nv_bfloat16 r = __float2bfloat16_rn(logit);
          pair |= uint32_t(__bfloat16_as_ushort(r)) << (16 * c);
          Keep(best[i], i, PackArgmaxKey(__bfloat162float(r), uint32_t(row + c)));
        }
        if (owner < batch && row < vocab) {
          __stcs(reinterpret_cast<uint32_t*>(static_cast<unsigned short*>(a.logits) + (size_t(owner) * steps + k) * vocab + row),
                 pair);
        }
      }
    }
  }
}

// Logits staged for 16-byte stores (staged_out): step k's rounded logits of a tile leave through this
// warp's out_buffer. StageLogits puts n-tile nt's there (stored[h][c]: the stored bits of row 8 h + g,
// request 8 nt + 2t + c), transposed by stmatrix so that 16 bytes hold 8 rows of one request;
// FlushLogits then stores whole pieces, 16 bytes a lane (32 for f32: both halves put back together),
// both halves of a request's rows in one warp store. Rows past V (V % 8 == 0: whole pieces) and
// requests past the batch are not written.
template <class T>
__device__ __forceinline__ void WalkCta<T>::StageLogits(int nt, const uint32_t (&stored)[2][2]) const {
  const uint32_t low0 = __byte_perm(stored[0][0], stored[0][1], 0x5410), low1 = __byte_perm(stored[1][0], stored[1][1], 0x5410);
  if (f32_out) {
    StoreMatrixQuadTransposed(out_column + nt * 256, __byte_perm(stored[0][0], stored[0][1], 0x7632),
                              __byte_perm(stored[1][0], stored[1][1], 0x7632), low0, low1);
  } else {
    StoreMatrixPairTransposed(out_column + nt * 256, low0, low1);
  }
}

template <class T>
__device__ __forceinline__ void WalkCta<T>::FlushLogits(int k, int row0) const {
  __syncwarp();
#pragma unroll
  for (int p = lane; p < NT * 16; p += 32) {
    const int rq = 8 * (p >> 4) + (p & 7), row = row0 + 8 * ((p >> 3) & 1);
    if (rq < batch && row < vocab) {
      const size_t at = (size_t(rq) * steps + k) * vocab + row;
      const uint4 piece = *reinterpret_cast<const uint4*>(out_buffer + p * 16);
      if (f32_out) {
        const uint4 low = *reinterpret_cast<const uint4*>(out_buffer + Smem::kOutStageBytes + p * 16);
        uint4* dst = reinterpret_cast<uint4*>(static_cast<float*>(a.logits) + at);
        __stcs(dst, make_uint4(__byte_perm(low.x, piece.x, 0x5410), __byte_perm(low.x, piece.x, 0x7632),
                               __byte_perm(low.y, piece.y, 0x5410), __byte_perm(low.y, piece.y, 0x7632)));
        __stcs(dst + 1, make_uint4(__byte_perm(low.z, piece.z, 0x5410), __byte_perm(low.z, piece.z, 0x7632),
                                   __byte_perm(low.w, piece.w, 0x5410), __byte_perm(low.w, piece.w, 0x7632)));
      } else {
        __stcs(reinterpret_cast<uint4*>(static_cast<unsigned short*>(a.logits) + at), piece);
      }
    }
  }
  __syncwarp();  // the buffer is read before the next tile's matrices overwrite it
}

// Sampled rows whose noise is in shared memory (the fill or the noise tile), and greedy rows with
// logits out: l, rounded to the logits dtype OUT (kNone: no logits out; kAnyDType: a.logits_dtype, by
// selects, and the logits staged if any), and its score, with selects and predicated stores rather
// than branches. The noise is read only for sampled requests (only they have it); rows past
// vocab_size score -inf, whatever noise they read.
// KNOWN: the launch's common form, known here so that the rows' loads, stores and noise take no
// selects: bf16 base logits, logits out in bf16 (the digit kernel: or float32, by its FORM), staged
// where this kernel stages them (kStagedOut: no store addresses), and the noise of sampled rows where
// this kernel has it (the noise tile, else the fill's). There the digit kernel splits the rows between
// lanes (kSplitRows): lane t = 0, 2 computes l of rows g and g + 8 of request t / 2 and passes row
// g + 8's to lane t + 1, and each finishes one (its rounding, store, noise and key) where both did
// two; Reduce merges lane t + 1's keys.
template <class T>
template <int OUT, bool KNOWN>
__device__ __forceinline__ void WalkCta<T>::NoiseFreeEpilogue(const TileScores<kSlots>& s, int k,
                                                              const float (&unscale_of)[kUnscaleSlots],
                                                              unsigned long long (&best)[kSlots]) const {
  constexpr bool kStage = OUT != kNone && StagesLogits(NT, SPLIT, DIGITS, OUT == kF32);
  constexpr bool kSplitRows = KNOWN && DIGITS;
  const bool stage_out = KNOWN ? T::kStagedOut : staged_out;
  // The noise of request rq's row: noise_src[rq * noise_stride + noise_offset + row] (the wgmma kernels
  // take it so: one load a value, not two and a select; in the 16-warp kernels the three registers spill).
  const float* noise_src = noise_tiles ? noise_tile : noise;
  const int noise_stride = noise_tiles ? kTileRows : stage_rows, noise_offset = noise_tiles ? -s.row0 : -first_row;
  uint32_t stored[2][2];  // kStage: an n-tile's stored bits, [h][i % 2]
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int owner = kSplitRows ? t / 2 : SlotRequest<SPLIT, DIGITS>(i, t), rq = min(owner, batch - 1);
    const float it = inv_t[rq];
    const int out_line = rq * steps + k;  // of logits [B, K, V]
    const int noise_line = rq * noise_stride + noise_offset;
    const float unscale_i = UnscaleOf(unscale_of, i);
    const auto Logit = [&](int h) {  // l of row g + 8 h, right in the lanes that own a request
      const int row = h ? s.row_b : s.row_a;
      const float bias = ((h ? s.scale_b : s.scale_a) * (h ? s.dot_b[i] : s.dot_a[i])) * unscale_i;
      const uint32_t base_bits = h ? s.base_b[i] : s.base_a[i];
      return row < a.vocab_size ? (KNOWN ? BaseToFloat<kBF16>(base_bits) : BitsToFloat(base_bits, a.base_dtype)) + bias : -INFINITY;
    };
    float split_l = 0.0f;
    if constexpr (kSplitRows) {
      const float high = __shfl_up_sync(0xffffffffu, Logit(1), 1);
      split_l = t & 1 ? high : Logit(0);
    }
#pragma unroll
    for (int h = 0; h < (kSplitRows ? 1 : 2); ++h) {
      const int row = kSplitRows ? (t & 1 ? s.row_b : s.row_a) : (h ? s.row_b : s.row_a);
      float l = kSplitRows ? split_l : Logit(h);
      if constexpr (OUT == T::kAnyDType) {
        l = StoreRoundedSelect(nullptr, 0, a.logits_dtype, l, false, &stored[h][i % 2]);
      } else if constexpr (OUT != kNone) {
        const bool direct_store = KNOWN ? !T::kStagedOut : !staged_out;
        l = StoreRoundedAs<OUT>(a.logits, direct_store ? size_t(out_line) * vocab + row : 0, l,
                                direct_store && owner < batch && row < vocab, &stored[h][i % 2]);
      }
      float score = l;
      if (it >= 0.0f) {
        const float g_noise = KNOWN ? (T::kNoiseTiles ? noise_tile[rq * kTileRows + h * 8 + g] : noise[rq * stage_rows + row - first_row])
                              : T::kWgmma ? noise_src[noise_line + row]
                              : noise_tiles ? noise_tile[rq * kTileRows + row - s.row0]
                                            : noise[rq * stage_rows + row - first_row];
        score = SampledScore(l, it, g_noise);
      }
      Keep(best[i], i, PackArgmaxKey(row < a.vocab_size ? score : -INFINITY, uint32_t(row)));
    }
    if constexpr (kStage) {
      if (stage_out && i % 2 == 1) StageLogits(i / 2, stored);
    }
  }
  if constexpr (kStage) {
    if (stage_out) FlushLogits(k, s.row0);
  }
}

// Every other case. Sampled batches with neither the fill nor the noise tiles draw their noise here;
// the wgmma kernels that of kNoiseGroup slots' two rows at a time, for greedy requests too (unused),
// in lockstep (GumbelNoise<N>): one chain of dependent multiplies at a time leaves the warp waiting
// on each. One copy of this code, the logits dtype chosen with selects: a copy per dtype spills
// registers at 16 slots a thread.
template <class T>
__device__ __forceinline__ void WalkCta<T>::GeneralEpilogue(const TileScores<kSlots>& s, int k,
                                                            const float (&unscale_of)[kUnscaleSlots],
                                                            unsigned long long (&best)[kSlots]) const {
  constexpr int kNoiseGroup = T::kNoiseGroup;
  const bool draw_noise = any_sampled && !a.noise_ahead && !noise_tiles;
#pragma unroll
  for (int i0 = 0; i0 < kSlots; i0 += kNoiseGroup) {
    float gumbel[2 * kNoiseGroup];
    if (T::kGroupNoise && draw_noise) {
      uint32_t k0[2 * kNoiseGroup], k1[2 * kNoiseGroup], v[2 * kNoiseGroup], position[2 * kNoiseGroup];
#pragma unroll
      for (int c = 0; c < 2 * kNoiseGroup; ++c) {
        const int rq = min(SlotRequest<SPLIT, DIGITS>(i0 + c / 2, t), batch - 1);
        k0[c] = key0[rq];
        k1[c] = key1[rq];
        v[c] = uint32_t(c % 2 ? s.row_b : s.row_a);
        position[c] = pos[rq] + uint32_t(k);
      }
      GumbelNoise<2 * kNoiseGroup, false, kWalkLogf>(k0, k1, v, position, gumbel);
    }
#pragma unroll
    for (int j = 0; j < kNoiseGroup; ++j) {
      const int i = i0 + j, rq = SlotRequest<SPLIT, DIGITS>(i, t);
      if (rq >= batch) continue;
      const float unscale_i = UnscaleOf(unscale_of, i);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = h ? s.row_b : s.row_a;
        if (row >= vocab) continue;
        const size_t index = (size_t(rq) * steps + k) * vocab + row;
        const float bias = ((h ? s.scale_b : s.scale_a) * (h ? s.dot_b[i] : s.dot_a[i])) * unscale_i;
        float l = row < a.vocab_size ? BitsToFloat(h ? s.base_b[i] : s.base_a[i], a.base_dtype) + bias : -INFINITY;
        l = StoreRoundedSelect(a.logits, index, a.logits_dtype, l, a.logits != nullptr);
        float score = l;
        if (inv_t[rq] >= 0.0f) {
          const float noise_of = a.noise_ahead ? noise[rq * stage_rows + row - first_row]
                                 : noise_tiles ? noise_tile[rq * kTileRows + row - s.row0]
                                 : T::kGroupNoise ? gumbel[2 * j + h]
                                                  : GumbelNoise<kWalkLogf>(key0[rq], key1[rq], uint32_t(row), pos[rq] + uint32_t(k));
          score = SampledScore(l, inv_t[rq], noise_of);
        }
        Keep(best[i], i, PackArgmaxKey(score, uint32_t(row)));
      }
    }
  }
}

// The epilogue a tile takes: the plain one where no row samples and no logits go out, the noise-free
// one where the noise is made (or none is needed) and it does not spill, else the general one.
template <class T>
__device__ __forceinline__ void WalkCta<T>::Epilogue(const TileScores<kSlots>& s, int k, const float (&unscale_of)[kUnscaleSlots],
                                                     unsigned long long (&best)[kSlots]) const {
  constexpr bool kNoiseFreeEpilogue = T::kNoiseFreeEpilogue;
  if constexpr (FORM == kPlainForm) {
    PlainEpilogue<kBF16>(s, unscale_of, best);
  } else if constexpr (LogitsForm(FORM)) {
    NoiseFreeEpilogue<FormLogits(FORM), true>(s, k, unscale_of, best);
  } else if (plain && a.base_dtype == kBF16) {
    PlainEpilogue<kBF16>(s, unscale_of, best);
  } else if (plain && a.base_dtype == kF16) {
    PlainEpilogue<kF16>(s, unscale_of, best);
  } else if (plain) {
    PlainEpilogue<kF32>(s, unscale_of, best);
  } else if (!DIGITS && kNoiseFreeEpilogue && !SPLIT && a.logits != nullptr && a.logits_dtype == kBF16 && a.base_dtype == kBF16 &&
             (!T::kStagedOut || staged_out) && (!any_sampled || (T::kNoiseTiles ? noise_tiles : a.noise_ahead))) {
    // The launch's common form. The digit kernel has an instance of its own for it (kBF16LogitsForm,
    // above, picked by the plan): its split-row epilogue, compiled beside the others, spilled registers
    // in the tile loop of every launch.
    NoiseFreeEpilogue<kBF16, true>(s, k, unscale_of, best);
  } else if (kNoiseFreeEpilogue && noise_free && a.logits == nullptr) {
    NoiseFreeEpilogue<kNone, false>(s, k, unscale_of, best);
  } else if (kNoiseFreeEpilogue && noise_free && a.logits_dtype == kF32) {
    NoiseFreeEpilogue<kF32, false>(s, k, unscale_of, best);
  } else if (kNoiseFreeEpilogue && noise_free && a.logits_dtype == kBF16) {
    NoiseFreeEpilogue<kBF16, false>(s, k, unscale_of, best);
  } else if (kNoiseFreeEpilogue && noise_free) {
    NoiseFreeEpilogue<kF16, false>(s, k, unscale_of, best);
  } else if (!kNoiseFreeEpilogue && noise_free && (staged_out || a.logits == nullptr)) {
    NoiseFreeEpilogue<T::kAnyDType, false>(s, k, unscale_of, best);
  } else {
    // At 16 slots a thread, where the epilogue above would spill in four copies, sampled batches
    // that draw their noise come here, and those with logits out that cannot be staged.
    GeneralEpilogue(s, k, unscale_of, best);
  }
}

}  // namespace walk
}  // namespace jax_markov
