// MarkovWalkKernel's score phase: each warp scores its W2 tiles against the step's e on the tensor
// cores (mma.sync warp by warp, or wgmma by warpgroup from 17 columns), each lane keeping its best key
// per request it owns. A tile's words are MMA operands as they stand where its rows are in fragment
// order (resident tiles, arranged once at step 0) or are picked from the prefetch registers (streamed
// tiles); its base logits are fetched a tile ahead; the epilogue (epilogue.cuh) turns dot products into
// keys.
#pragma once

#include "cuda/walk/kernel.cuh"

namespace jax_markov {
namespace walk {

// Starts copying resident tile i of this warp into shared memory: one cp.async group, each lane
// copying the chunks it will read itself (rows past V are zero).
template <class T>
__device__ __forceinline__ void WalkCta<T>::LoadResident(int i) {
  const int j = tiles.Local(false, i), row0 = RowOf(j);
  uint4* slot = reinterpret_cast<uint4*>(resident + size_t(j) * T::kTileBytes) + lane;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const bool inside = row0 + g + (c < kChunks / 2 ? 0 : 8) < vocab;
    CpAsync16(slot + c * 32, TileChunk<W2>(a.w2, vocab, row0, g, t, c), inside);
  }
  CpAsyncCommit();
}

// A fragment-order chunk's words as EREGS's B operands take them: rows g (words x, z) and g + 8
// (y, w) of the k-step, each pair in adjacent words, so that the registers of one 16-byte load are the
// IMMAs' register pairs as they stand (no moves).
__device__ __forceinline__ uint4 PairOrder(uint4 q) { return make_uint4(q.x, q.z, q.y, q.w); }

// Step 0 lands this warp's resident tile i: its load waited for once the tile kLoadAhead ahead is
// issued, then (where the MMA takes tile words as operands) its chunks stored back in fragment order,
// EREGS's in PairOrder (each lane rewrites only the chunks it copied; the int8 -> fp16 conversion
// takes its words from anywhere, so that path keeps its resident tiles in row order).
template <class T>
__device__ __forceinline__ void WalkCta<T>::LandResident(int i) {
  constexpr int kLoadAhead = T::kLoadAhead;
  // Groups committed after tile i's: the tiles up to i + kLoadAhead.
  if (i + kLoadAhead < tiles.n_resident) LoadResident(i + kLoadAhead);
  CpAsyncWaitPending(min(kLoadAhead, tiles.n_resident - 1 - i));
  if constexpr (T::kFragmentOrder) {
    uint4* slot = reinterpret_cast<uint4*>(resident + size_t(tiles.Local(false, i)) * T::kTileBytes) + lane;
    uint4 rows[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) rows[c] = slot[c * 32];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 q = FragmentChunk<W2>(rows, c, true);
      slot[c * 32] = EREGS ? PairOrder(q) : q;
    }
  }
}

// Owned slot i's unscale times logit_scale: the bias (scale x dot) x this, fused into the add of the
// base logit, rounds exactly as logit_scale x (scale x (dot x unscale)) does (scaling by 2^-shift is
// exact), one multiply fewer.
template <class T>
__device__ __forceinline__ float WalkCta<T>::UnscaleOf(const float (&unscale_of)[kUnscaleSlots], int i) const {
  if constexpr (T::kUnscaleFromSmem) return unscale[min(SlotRequest<SPLIT, DIGITS>(i, t), batch - 1)] * a.logit_scale;
  else return unscale_of[i];
}

template <class T>
__device__ __forceinline__ void WalkCta<T>::Score(int k, unsigned long long (&best)[kSlots]) {
  constexpr bool kWgmma = T::kWgmma, kBaseAhead = T::kBaseAhead, kFragmentOrder = T::kFragmentOrder;
  if (T::kFillWhileGathering) FillNoiseOfStep(k);
  // The staged base logits' group; at step 0 the first resident tiles' groups may still be pending.
  if (STAGED) CpAsyncWaitPending(k == 0 ? min(T::kLoadAhead, tiles.n_resident) : 0);
  // The B fragments written by Choose are read by the tensor cores through the async proxy.
  if constexpr (kWgmma) FenceSharedForAsyncProxy();
  __syncthreads();
  Stamp(a, k, 3);

  uint4 digit_frag[4];  // DIGITS: lane (g, t)'s B fragments, column g at k = 64q + 16t .. +15
  if constexpr (DIGITS) {
#pragma unroll
    for (int q = 0; q < 4; ++q) digit_frag[q] = reinterpret_cast<const uint4*>(digits + g * kRank + 64 * q)[t];
  }
  uint4 e_operands[EREGS ? 2 : 1][EREGS ? 8 : 1];  // EREGS: lane (g, t)'s A fragments (BuildDigitPairOperands)
  if constexpr (EREGS) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int s = 0; s < 8; ++s) e_operands[m][s] = reinterpret_cast<const uint4*>(frag)[(m * 8 + s) * 32 + lane];
    }
  }
  float unscale_of[kUnscaleSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    best[i] = 0;
    if constexpr (CERT) lane_second[i] = 0;
    if constexpr (!T::kUnscaleFromSmem) unscale_of[i] = unscale[min(SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g), batch - 1)] * a.logit_scale;
  }
  // Step 0 lands the resident tiles before the tile loop, not in it: the loop's step-0 branches cost
  // every later step 7 % of its score phase at one request.
  if (!T::kStep0InLoop && k == 0) {
    for (int i = 0; i < tiles.n_resident; ++i) LandResident(i);
  }
  int im = 0, is = 0;
  StreamedSlots slots(tiles.total(), tiles.n_streamed);
  int streamed_slot = T::kSteppedSlots ? slots.slot : tiles.StreamedSlot(0);
  bool next_streamed = streamed_slot == 0;
  // A step's first streamed tile is in `pre` already (kKeepsStreamed: the one the step before scored last).
  const int order = T::kKeepsStreamed ? k : 0;  // WarpTiles::Streamed's step
  int next_tile = next_streamed ? tiles.Streamed(order, 0) : tiles.Local(false, 0);
  uint32_t line[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) line[i] = BaseLine<SPLIT, DIGITS, STAGED, EREGS>(a, stage_rows, first_row, k, i, t, g);
  uint32_t base_a[kSlots], base_b[kSlots];
  const auto LoadBase = [&](int row0, uint32_t (&ba)[kSlots], uint32_t (&bb)[kSlots]) {
    if constexpr (EREGS) {
      LoadBasePairs<kSlots, STAGED>(a, staged, line, row0, t, ba, bb);
    } else {
      LoadBaseBits<kSlots, STAGED, T::kBF16Base>(a, staged, line, row0, g, ba, bb);
    }
  };
  if (kBaseAhead && tiles.total() > 0) LoadBase(RowOf(next_tile), base_a, base_b);
  // EREGS scores tile n's MMAs before tile n - 1's epilogue, so that the epilogue's instructions issue
  // while the tensor cores work: the held tile is the one whose MMAs are done (its local index, base
  // logits and accumulators).
  int held_tile = 0;
  uint32_t held_a[kSlots], held_b[kSlots];
  int held_acc[2][2][4];
  // Only the wgmma kernels run past a warp's own tiles (loop_tiles); saying so at compile time leaves
  // the operand zeroing of a warp past its tiles out of the mma.sync kernels' tile loop.
  const int n_tiles = kWgmma ? loop_tiles : tiles.total();
  // EREGS's loop two tiles an iteration: the held tile's accumulators and base logits alternate
  // between two register sets instead of being copied (20 moves a tile).
#pragma unroll(EREGS ? 2 : 1)
  for (int n = 0; n < n_tiles; ++n) {
    const bool active = !kWgmma || n < tiles.total();
    const int j = next_tile;
    const int row0 = RowOf(j);
    const bool streamed = active && next_streamed;
    uint32_t next_a[kSlots], next_b[kSlots];
    if (active) {
      if (streamed) {
        ++is;
        streamed_slot = T::kSteppedSlots ? slots.Next() : tiles.StreamedSlot(is);
      } else {
        if (T::kStep0InLoop && k == 0) LandResident(im);
        ++im;
      }
      if (!kBaseAhead) LoadBase(row0, base_a, base_b);
      if (n + 1 < tiles.total()) {
        next_streamed = streamed_slot == n + 1;
        next_tile = next_streamed ? tiles.Streamed(order, is) : tiles.Local(false, im);
        if (kBaseAhead) LoadBase(RowOf(next_tile), next_a, next_b);
      }
      if (noise_tiles) MakeNoiseTile(noise_tile, batch, row0, k, inv_t, key0, key1, pos, lane);
    }
    // Dot products of the tile's rows g and g + 8 with each owned request's e (still scaled). A
    // streamed tile is taken straight from the prefetch registers (row order), a resident one as
    // step 0 left it. Two copies of the operand code (no register copies of the prefetch registers),
    // one of the MMAs and one of the epilogue.
    float dot_a[kSlots], dot_b[kSlots];
    const uint32_t slot = kWgmma ? 0 : resident_lane + uint32_t(j) * T::kTileBytes;  // 16 bytes a lane, chunks 512 apart
    const uint4* slot_pointer = reinterpret_cast<const uint4*>(resident + size_t(j) * T::kTileBytes) + lane;
    // Calls use(rows_order, chunks) on the tile's chunks: the prefetch registers of a streamed tile, or
    // those of a resident one from shared memory (zeros for a warp past its tiles).
    const auto WithChunks = [&](const auto& use) {
      if (streamed) {
        use(true, pre);
      } else {
        uint4 q[kChunks];
        if (active) {
#pragma unroll
          for (int i = 0; i < kChunks; ++i) q[i] = kWgmma ? slot_pointer[i * 32] : LoadShared16(slot + i * 512);
        } else {
#pragma unroll
          for (int i = 0; i < kChunks; ++i) q[i] = make_uint4(0, 0, 0, 0);
        }
        use(!kFragmentOrder, q);
      }
    };
    // The A words of k-step s: rows g and g + 8 at k = 2t, 2t + 1 (x, y) and 2t + 8, 2t + 9 (z, w).
    const auto StepOperands = [&](bool rows_order, const uint4 (&chunks)[kChunks], int s) {
      if constexpr (W2 == kW2Int8) {
        // Row words s & 3 of chunk s >> 2: fragment-order chunk 2 (s >> 2) + ((s >> 1) & 1).
        const uint4 q = FragmentChunk<W2>(chunks, 2 * (s >> 2) + ((s >> 1) & 1), rows_order);
        const uint32_t wa = ((s & 1) ? q.z : q.x) ^ 0x80808080u;
        const uint32_t wb = ((s & 1) ? q.w : q.y) ^ 0x80808080u;
        return make_uint4(Int8PairToHalf2(wa, 0x4140), Int8PairToHalf2(wb, 0x4140), Int8PairToHalf2(wa, 0x4342),
                          Int8PairToHalf2(wb, 0x4342));
      } else {
        return FragmentChunk<W2>(chunks, s, rows_order);
      }
    };
    // EREGS: the digit dot products of requests 8m + g with rows 8h + 2t + c of the tile (acc[m][h]:
    // digits 0 at c, 1 at 2 + c). Each k-step's fragment words in PairOrder, from the prefetch
    // registers of a streamed tile or one 16-byte load of a resident one, are the B operands of both
    // n-tiles.
    int acc[EREGS ? 2 : 1][2][4] = {};
    const auto PairOperandDots = [&](const auto& step_words) {
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const uint4 q = step_words(s);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const uint4 e = e_operands[m][s];
          Imma16832(acc[m][0], e.x, e.y, e.z, e.w, q.x, q.y);
          Imma16832(acc[m][1], e.x, e.y, e.z, e.w, q.z, q.w);
        }
      }
    };
    if constexpr (EREGS) {
      if (streamed) {
        PairOperandDots([&](int s) { return PairOrder(FragmentChunk<W2>(pre, s, true)); });
      } else {
        PairOperandDots([&](int s) { return active ? LoadShared16(slot + s * 512) : make_uint4(0, 0, 0, 0); });
      }
    } else if constexpr (!kWgmma) {
      constexpr int kChains = T::kChains;
      const auto TileDots = [&](bool rows_order, const uint4 (&chunks)[kChunks]) {
        if constexpr (DIGITS) {
          int acc[2][4] = {};
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const int w = 2 * (s & 1);
            const uint4 q = FragmentChunk<W2>(chunks, s, rows_order);
            Imma16832(acc[s & 1], q.x, q.y, q.z, q.w, Word(digit_frag[s >> 1], w), Word(digit_frag[s >> 1], w + 1));
          }
          int c[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) c[e] = acc[0][e] + acc[1][e];
          // Columns 0-2 are request 0's digits (lanes t = 0, 1), columns 3-5 request 1's (t = 1, 2):
          // t = 0 takes digit 2 from t = 1, t = 2 takes digit 0 from t = 1.
          const int down0 = __shfl_down_sync(0xffffffffu, c[0], 1), down2 = __shfl_down_sync(0xffffffffu, c[2], 1);
          const int up1 = __shfl_up_sync(0xffffffffu, c[1], 1), up3 = __shfl_up_sync(0xffffffffu, c[3], 1);
          const bool first = t == 0;
          dot_a[0] = DigitsToFloat(first ? c[0] : up1, first ? c[1] : c[0], first ? down0 : c[1]);
          dot_b[0] = DigitsToFloat(first ? c[2] : up3, first ? c[3] : c[2], first ? down2 : c[3]);
        } else if constexpr (PAIRS) {
          // n-tile i: columns 2t, 2t + 1 are request 4i + t's digits 0 and 1, rows g and g + 8.
          int acc[kChains * NT][4] = {};
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const uint4 q = FragmentChunk<W2>(chunks, s, rows_order);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint2 bf = reinterpret_cast<const uint2*>(frag)[(nt * 8 + s) * 32 + lane];
              Imma16832(acc[(s % kChains) * NT + nt], q.x, q.y, q.z, q.w, bf.x, bf.y);
            }
          }
#pragma unroll
          for (int i = 0; i < kSlots; ++i) {
            int c[4] = {acc[i][0], acc[i][1], acc[i][2], acc[i][3]};
            if constexpr (kChains == 2) {
#pragma unroll
              for (int e = 0; e < 4; ++e) c[e] += acc[NT + i][e];
            }
            dot_a[i] = DigitPairToFloat(c[0], c[1]);
            dot_b[i] = DigitPairToFloat(c[2], c[3]);
          }
        } else {
          float acc[kChains * NT][4] = {};
#pragma unroll
          for (int s = 0; s < 16; ++s) {
            const uint4 op = StepOperands(rows_order, chunks, s);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint2 bf = reinterpret_cast<const uint2*>(frag)[(nt * 16 + s) * 32 + lane];
              Mma16816<W2 == kW2BF16>(acc[(s % kChains) * NT + nt], op.x, op.y, op.z, op.w, bf.x, bf.y);
            }
          }
#pragma unroll
          for (int i = 0; i < kSlots; ++i) {
            const int nt = SPLIT ? i : i / 2, c = SPLIT ? 0 : i % 2;
            float va[2] = {acc[nt][0], acc[nt][1]}, vb[2] = {acc[nt][2], acc[nt][3]};
            if constexpr (kChains == 2) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                va[e] += acc[NT + nt][e];
                vb[e] += acc[NT + nt][2 + e];
              }
            }
            dot_a[i] = SPLIT ? va[0] + va[1] : va[c];
            dot_b[i] = SPLIT ? vb[0] + vb[1] : vb[c];
          }
        }
      };
      WithChunks(TileDots);
    } else {
      constexpr int kBatch = T::kBatch;
      float d[4 * NT];
#pragma unroll
      for (int h = 0; h < 16 / kBatch; ++h) {
        uint32_t op[kBatch][4];
        const auto BatchOperands = [&](bool rows_order, const uint4 (&chunks)[kChunks]) {
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            const uint4 v = StepOperands(rows_order, chunks, kBatch * h + i);
            op[i][0] = v.x;
            op[i][1] = v.y;
            op[i][2] = v.z;
            op[i][3] = v.w;
          }
        };
        WithChunks(BatchOperands);
        WgmmaBatch<NT, W2 == kW2BF16, kBatch>(op, frag_desc, h, d);
      }
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int nt = SPLIT ? i : i / 2, c = SPLIT ? 0 : i % 2;
        dot_a[i] = SPLIT ? d[4 * nt] + d[4 * nt + 1] : d[4 * nt + c];
        dot_b[i] = SPLIT ? d[4 * nt + 2] + d[4 * nt + 3] : d[4 * nt + 2 + c];
      }
    }
    if (streamed && is < tiles.n_streamed) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(order, is)), g, t, pre);
    if (!active) continue;

    if constexpr (EREGS) {
      if (n > 0) PairOperandEpilogue(held_tile, k, held_a, held_b, held_acc, unscale_of, best);
      held_tile = j;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        held_a[i] = base_a[i];
        held_b[i] = base_b[i];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 4; ++e) held_acc[i][h][e] = acc[i][h][e];
        }
      }
    } else {
      const TileScores<kSlots> scores{j, row0, row0 + g, row0 + g + 8, scales[j * kTileRows + g], scales[j * kTileRows + g + 8],
                                      dot_a, dot_b, base_a, base_b};
      Epilogue(scores, k, unscale_of, best);
    }
    if (kBaseAhead && (!T::kGuardedCopy || n + 1 < tiles.total())) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        base_a[i] = next_a[i];
        base_b[i] = next_b[i];
      }
    }
  }
  if constexpr (EREGS) {
    if (tiles.total() > 0) PairOperandEpilogue(held_tile, k, held_a, held_b, held_acc, unscale_of, best);
  }
}

}  // namespace walk
}  // namespace jax_markov
