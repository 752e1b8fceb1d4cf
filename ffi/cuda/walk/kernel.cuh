// MarkovWalkKernel: the cooperative walk for every launch that the transposed kernel does not take
// (docs/kernel_design.md). One CTA per SM; the vocabulary is cut into 16-row tiles of W2 and CTA c owns a
// contiguous run of them, the first `resident_tiles` held in shared memory from step 0 on, the rest
// streamed from L2 every step. Each step k:
//   1. Choose: step k-1's choices from the exchange; e = W1[prev] turned into MMA operands (operands.cuh).
//   2. Score: the CTA's tiles scored against e on the tensor cores, each lane keeping its best key per
//      request it owns (score.cuh, epilogue.cuh).
//   3. Reduce: the keys over the warp's lanes, then the CTA's warps.
//   4. Publish: one key per request to the grid (exchange.cuh); the wait comes at the top of the next
//      step, after its choice-free loads are issued.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_common.h"
#include "cuda/ptx.cuh"
#include "cuda/values.cuh"
#include "cuda/walk/args.cuh"
#include "cuda/walk/exchange.cuh"
#include "cuda/walk/noise.cuh"
#include "cuda/walk/operands.cuh"
#include "cuda/walk/tiles.cuh"
#include "cuda/walk/traits.cuh"

namespace jax_markov {
namespace walk {

// The values a tile's epilogue combines for the requests this lane owns (slot i), at the tile's rows
// g (a) and g + 8 (b): l = base + (scale x dot) x unscale x logit_scale.
template <int kSlots>
struct TileScores {
  int tile, row0, row_a, row_b;  // the local tile, its first row, this lane's two rows
  float scale_a, scale_b;        // their W2 scales (1 for a float W2)
  const float (&dot_a)[kSlots];  // e . W2 row, e still scaled by its power of two
  const float (&dot_b)[kSlots];
  const uint32_t (&base_a)[kSlots];  // raw bits of the base logits
  const uint32_t (&base_b)[kSlots];
};

// One CTA of MarkovWalkKernel: its shared memory, its place in the grid, and the state it keeps
// across steps. The kernel body (below) is its steps; each phase is a member function.
template <class T>
struct WalkCta {
  static constexpr int NT = T::NT, W2 = T::W2, THREADS = T::THREADS, FORM = T::FORM;
  static constexpr bool SPLIT = T::SPLIT, DIGITS = T::DIGITS, STAGED = T::STAGED, PAIRS = T::PAIRS, EREGS = T::EREGS;
  static constexpr bool CERT = T::CERT;
  static constexpr int kWarps = T::kWarps, kChunks = T::kChunks, kSlots = T::kSlots;
  // Each owned request's power-of-two unscale times logit_scale, held for the step (or read from
  // shared memory as it goes: T::kUnscaleFromSmem).
  static constexpr int kUnscaleSlots = T::kUnscaleFromSmem ? 1 : kSlots;
  using Smem = typename T::Smem;

  const WalkArgs& a;
  // Shared memory (WalkSmem): the B fragments (DIGITS: [8 columns][256] int8 digits instead), the
  // per-request state, the W2 scales, staged base logits, the noise ahead, this warp's noise tile, its
  // staged logits, the resident tiles.
  uint32_t* frag;
  int8_t* digits;
  unsigned long long* cta_best;
  int* prev;
  float *unscale, *inv_t;
  uint32_t *key0, *key1, *pos;
  int* last_out;
  float* scales;
  unsigned char* staged;
  float *noise, *noise_tile;
  unsigned char *out_buffer, *resident;
  // A certified walk's state (CertSmem; certified.cuh).
  unsigned long long* cert_exact;
  float *cert_margin, *cert_threshold, *cert_e;
  unsigned int *cert_second, *cert_counts, *cert_rounds, *cert_maxima;
  uint32_t out_column;     // this lane's stmatrix column address in out_buffer
  uint32_t resident_lane;  // this lane's 16 bytes of resident tile 0, as a shared address
  int stage_rows;       // the CTA's rows (tiles_per_cta x 16)
  bool noise_tiles, staged_out, f32_out;
  // Where this CTA and thread are.
  int tid, lane, warp, g, t;
  int batch, steps, vocab;
  int first_tile, first_row, total_tiles, my_tiles, my_rows;
  WarpTiles<kWarps> tiles;
  int loop_tiles;  // tile iterations of this warp's loop (wgmma: its warpgroup's busiest warp's)
  uint64_t frag_desc;
  bool direct;  // the exchange through one slot per CTA and request
  // What the launch's rows need, known after Start.
  bool any_sampled, plain, noise_free;
  // The streamed tile in flight into registers: the next one this warp scores.
  uint4 pre[kChunks];
  // A certified walk: each owned slot's best key of the step and its second-best ordered score (Keep),
  // kept until the next step's choice for the exact round, where one is taken.
  unsigned long long lane_best[CERT ? kSlots : 1];
  mutable uint32_t lane_second[CERT ? kSlots : 1];
  // A certified walk: this warp makes the margins of requests margin_rank, margin_rank + margin_warps, ...
  // (MakeMargins; none where margin_rank < 0).
  int margin_rank, margin_warps;

  __device__ __forceinline__ WalkCta(const WalkArgs& args, unsigned char* smem);
  __device__ __forceinline__ int RowOf(int local_tile) const { return (first_tile + local_tile) * kTileRows; }

  // The phases (this file unless noted).
  __device__ __forceinline__ void Start();
  __device__ __forceinline__ void IssueAndWait(int k);
  __device__ __forceinline__ void Choose(int k);
  __device__ __forceinline__ void BuildOperands(int b, int k, const uint4 (&raw)[2]);
  __device__ __forceinline__ void FillNoiseOfStep(int k);
  __device__ __forceinline__ void Score(int k, unsigned long long (&best)[kSlots]);  // score.cuh
  __device__ __forceinline__ void Reduce(int k, unsigned long long (&best)[kSlots]);
  __device__ __forceinline__ void Finish();

  // Tile residency and operands (score.cuh).
  __device__ __forceinline__ void LoadResident(int i);
  __device__ __forceinline__ void LandResident(int i);
  __device__ __forceinline__ float UnscaleOf(const float (&unscale_of)[kUnscaleSlots], int i) const;

  // A certified walk (certified.cuh): the CTA's largest scale and residual norm, a request's margin
  // with its e, the CTA's keys and bounds published, the choices certified from the grid's, and the
  // exact round of the choices they do not single out.
  __device__ __forceinline__ void StartCertificate(uint32_t s_bits, uint32_t r_bits);
  __device__ __forceinline__ void CertifyE(int b, const uint4 (&raw)[2]);
  __device__ __forceinline__ void MakeMargins(int k);
  __device__ __forceinline__ void PublishCertified(int k);
  __device__ __forceinline__ void ChooseCertified(int k);
  __device__ __forceinline__ void ChooseCertifiedPass(int k, unsigned redo, unsigned& failed);
  __device__ __forceinline__ void ExactRound(int k, unsigned redo);
  __device__ __forceinline__ void RescoreCandidates(int k, int i, unsigned redo);
  template <bool SKIP_MASKED>
  __device__ __forceinline__ unsigned long long RescoreColumns(int r, int k, const float (&e)[8],
                                                               const int (&cols)[T::kRescoreBatch],
                                                               int& rows_read) const;

  // The epilogues (epilogue.cuh): a tile's l, score and key for each owned request.
  __device__ __forceinline__ void Keep(unsigned long long& best, int i, unsigned long long key) const;
  __device__ __forceinline__ void FoldPlain(unsigned long long& best, int i, int row, float base, float bias) const;
  template <int BASE>
  __device__ __forceinline__ void PlainEpilogue(const TileScores<kSlots>& s, const float (&unscale_of)[kUnscaleSlots],
                                                unsigned long long (&best)[kSlots]) const;
  template <int OUT, bool KNOWN>
  __device__ __forceinline__ void NoiseFreeEpilogue(const TileScores<kSlots>& s, int k, const float (&unscale_of)[kUnscaleSlots],
                                                    unsigned long long (&best)[kSlots]) const;
  __device__ __forceinline__ void GeneralEpilogue(const TileScores<kSlots>& s, int k, const float (&unscale_of)[kUnscaleSlots],
                                                  unsigned long long (&best)[kSlots]) const;
  __device__ __forceinline__ void Epilogue(const TileScores<kSlots>& s, int k, const float (&unscale_of)[kUnscaleSlots],
                                           unsigned long long (&best)[kSlots]) const;
  __device__ __forceinline__ void PairOperandEpilogue(int tile, int k, const uint32_t (&base_a)[kSlots], const uint32_t (&base_b)[kSlots],
                                                      const int (&acc)[2][2][4], const float (&unscale_of)[kUnscaleSlots],
                                                      unsigned long long (&best)[kSlots]) const;
  __device__ __forceinline__ void StageLogits(int nt, const uint32_t (&stored)[2][2]) const;
  __device__ __forceinline__ void FlushLogits(int k, int row0) const;
};

template <class T>
__device__ __forceinline__ WalkCta<T>::WalkCta(const WalkArgs& args, unsigned char* smem) : a(args) {
  tid = threadIdx.x;
  lane = tid & 31;
  warp = tid >> 5;
  g = lane >> 2;
  t = lane & 3;
  batch = a.batch;
  steps = a.steps;
  vocab = a.vocab;
  stage_rows = a.tiles_per_cta * kTileRows;
  noise_tiles = T::kNoiseTiles && a.noise_tiles;
  staged_out = T::kStagedOut && a.logits_staged;
  f32_out = StagesLogits(NT, SPLIT, DIGITS, true) && a.logits_dtype == kF32;
  const int out_stage_bytes = Smem::OutStageBytes(f32_out);  // a warp's
  const typename Smem::Parts parts =
      Smem::Layout(kWarps, stage_rows, STAGED ? a.batch * stage_rows * ElementBytes(a.base_dtype) : 0,
                   a.noise_ahead ? a.batch * stage_rows * int(sizeof(float)) : 0,
                   noise_tiles ? Smem::NoiseTileFloats(a.batch) * int(sizeof(float)) : 0, staged_out ? out_stage_bytes : 0,
                   CERT ? CertSmem::Bytes(a.batch) : 0);
  frag = reinterpret_cast<uint32_t*>(smem);
  digits = reinterpret_cast<int8_t*>(smem);
  cta_best = reinterpret_cast<unsigned long long*>(smem + Smem::kFragBytes);
  prev = reinterpret_cast<int*>(cta_best + kMaxBatch);
  unscale = reinterpret_cast<float*>(prev + kMaxBatch);
  inv_t = unscale + kMaxBatch;
  key0 = reinterpret_cast<uint32_t*>(inv_t + kMaxBatch);
  key1 = key0 + kMaxBatch;
  pos = key1 + kMaxBatch;
  last_out = reinterpret_cast<int*>(pos + kMaxBatch);
  scales = reinterpret_cast<float*>(smem + parts.scales);
  staged = smem + parts.staged;
  noise = reinterpret_cast<float*>(smem + parts.noise);
  noise_tile = reinterpret_cast<float*>(smem + parts.noise_tiles) + warp * Smem::NoiseTileFloats(a.batch);
  out_buffer = smem + parts.out_stage + warp * out_stage_bytes;
  resident = smem + parts.resident;
  // Opaque to the compiler, so that it keeps the address in a register: derived from `resident`, it
  // was recomputed from the shared window's base (S2UR SR_CgaCtaId and 9 more instructions) every tile.
  if constexpr (!T::kWgmma) {
    resident_lane = SharedAddress(resident) + lane * 16;
    asm volatile("" : "+r"(resident_lane));
  }
  if constexpr (CERT) {
    cert_exact = reinterpret_cast<unsigned long long*>(smem + parts.cert + CertSmem::kExact);
    cert_second = reinterpret_cast<unsigned int*>(smem + parts.cert + CertSmem::kSecond);
    cert_margin = reinterpret_cast<float*>(smem + parts.cert + CertSmem::kMargin);
    cert_threshold = reinterpret_cast<float*>(smem + parts.cert + CertSmem::kThreshold);
    cert_counts = reinterpret_cast<unsigned int*>(smem + parts.cert + CertSmem::kCounts);
    cert_rounds = reinterpret_cast<unsigned int*>(smem + parts.cert + CertSmem::kRounds);
    cert_maxima = reinterpret_cast<unsigned int*>(smem + parts.cert + CertSmem::kMaxima);
    cert_e = reinterpret_cast<float*>(smem + parts.cert + CertSmem::kE);
  }
  // Lane L's column address for matrix L / 8 of n-tile 0: h = (L / 8) % 2, c = L % 8; matrices 2 and 3
  // (f32's low halves) in the second array.
  out_column = SharedAddress(out_buffer) + ((lane >> 3) & 1) * 128 + (lane & 7) * 16 + (lane >= 16 ? Smem::kOutStageBytes : 0);
  first_tile = blockIdx.x * a.tiles_per_cta;
  first_row = first_tile * kTileRows;
  total_tiles = (vocab + kTileRows - 1) / kTileRows;
  my_tiles = max(0, min(a.tiles_per_cta, total_tiles - first_tile));
  my_rows = max(0, min(my_tiles * kTileRows, vocab - first_row));
  tiles = WarpTiles<kWarps>(warp, a.resident_tiles, my_tiles);
  // wgmma is warpgroup-wide: the four warps of a warpgroup run as many tile iterations as the busiest
  // of them, a warp past its own tiles with zero operands and no epilogue.
  loop_tiles = tiles.total();
  if constexpr (T::kWgmma) {
    for (int w = warp & ~3; w <= (warp | 3); ++w) loop_tiles = max(loop_tiles, WarpTiles<kWarps>(w, a.resident_tiles, my_tiles).total());
  }
  frag_desc = FragDescriptor(frag);
  // Small batches exchange keys through one slot per CTA (slots[(k * batch + b) * grid + cta]).
  direct = batch <= kDirectBatch && gridDim.x <= kDirectMaxCtas;
  if constexpr (CERT) {
    // The margins go to the warps with fewer tiles than the busiest (each warp's rank among them), or
    // to every warp where all have as many.
    int most = 0;
    for (int w = 0; w < kWarps; ++w) most = max(most, WarpTiles<kWarps>(w, a.resident_tiles, my_tiles).total());
    int light = 0, rank = -1;
    for (int w = 0; w < kWarps; ++w) {
      if (WarpTiles<kWarps>(w, a.resident_tiles, my_tiles).total() >= most) continue;
      if (w == warp) rank = light;
      ++light;
    }
    margin_warps = light > 0 ? light : kWarps;
    margin_rank = light > 0 ? rank : warp;
  }
}

// The state of every request, then everything that does not depend on the walk starts moving: step 0's
// base logits, the first kLoadAhead of this warp's resident tiles (one cp.async group per tile, in
// scoring order, each lane copying the chunks it will read itself; step 0 issues the rest kLoadAhead
// tiles ahead of its scoring, so that scoring overlaps the load), its first streamed tile into
// registers, and the W2 scales.
template <class T>
__device__ __forceinline__ void WalkCta<T>::Start() {
  for (int i = tid; i < Smem::kFragBytes / 4; i += THREADS) frag[i] = 0;
  for (int b = tid; b < kMaxBatch; b += THREADS) {
    cta_best[b] = 0;
    if (b < batch) {
      prev[b] = a.anchor[b];
      inv_t[b] = InverseTemperature(a, b);
      key0[b] = a.key[2 * b];
      key1[b] = a.key[2 * b + 1];
      pos[b] = static_cast<uint32_t>(a.position[b]);
    }
  }
  if (STAGED && my_tiles > 0) StageBaseLogits<THREADS>(a, staged, stage_rows, first_row, my_rows, 0);
  if (!STAGED && my_tiles > 0) PrefetchBaseLogits<THREADS>(a, first_row, my_rows, 0);
  for (int i = 0; i < min(T::kLoadAhead, tiles.n_resident); ++i) LoadResident(i);
  if (tiles.n_streamed > 0) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(0, 0)), g, t, pre);
  // The W2 scales, once the tiles' loads are on their way (a thread waits for its scales before it
  // stores them). A float W2 has no scales: 1 leaves its dot products as they are. A certified walk
  // loads the rows' residual norms beside them, for the largest of each (as bits: a NaN or negative
  // value reads above +inf, and makes the bound unusable).
  uint32_t s_bits = 0, r_bits = 0;
  for (int i = tid; i < stage_rows; i += THREADS) {
    const float s = a.scale == nullptr ? 1.0f : (i < my_rows ? __ldg(a.scale + first_row + i) : 0.0f);
    if (CERT && i < my_rows) {
      s_bits = max(s_bits, __float_as_uint(s));
      r_bits = max(r_bits, __float_as_uint(__ldg(a.residual_norm + first_row + i)));
    }
    scales[i] = s;
  }
  if constexpr (CERT) StartCertificate(s_bits, r_bits);
  // Greedy rows with no logits out take a scoring epilogue without branches; scoring draws no noise
  // where the fill or the noise tiles make it (or no row samples).
  any_sampled = __syncthreads_or(tid < batch && a.sampling && a.temperature[tid] > 0.0f);
  plain = !any_sampled && a.logits == nullptr;
  noise_free = !any_sampled || a.noise_ahead || noise_tiles;
  if (!T::kFillWhileGathering) FillNoiseOfStep(0);
}

// Step k's noise of the CTA's rows ahead of scoring, on `threads` threads from `thread`, where it fits
// (a.noise_ahead); the plain form's instances, whose rows never sample, have none.
template <class T>
__device__ __forceinline__ void WalkCta<T>::FillNoiseOfStep(int k) {
  if (FORM == kPlainForm || !a.noise_ahead) return;
  // The direct exchange's gathering warps (warp b fetches request b's choice) start a chain of L2
  // round trips (the keys, then the W1 row); with kFillWhileGathering the warps past them fill the
  // noise meanwhile, where they are most of the CTA. Otherwise every warp fills it.
  const int busy = T::kFillWhileGathering && k > 0 && direct && batch < kWarps / 2 ? batch * 32 : 0;
  if (tid >= busy) FillNoise(a, noise, stage_rows, first_row, my_rows, k, inv_t, key0, key1, pos, tid - busy, THREADS - busy);
}

// Step k's inputs that do not depend on the choice start moving before the wait; then the wait for
// every CTA's step k-1 key (the direct exchange waits for the keys themselves in Choose).
template <class T>
__device__ __forceinline__ void WalkCta<T>::IssueAndWait(int k) {
  Stamp(a, k, 0);
  if (k < steps && my_tiles > 0) {
    if constexpr (STAGED) {
      StageBaseLogits<THREADS>(a, staged, stage_rows, first_row, my_rows, k);
    } else {
      PrefetchBaseLogits<THREADS>(a, first_row, my_rows, k);
    }
    if (!T::kKeepsStreamed && tiles.n_streamed > 0) LoadTileGlobal<W2>(a.w2, vocab, RowOf(tiles.Streamed(0, 0)), g, t, pre);
    if (!T::kFillWhileGathering) FillNoiseOfStep(k);
  }
  Stamp(a, k, 1);
  if (!direct) {
    WaitForArrivals(a, k, tid);
    __syncthreads();
  }
  Stamp(a, k, 2);
}

// Step k-1's choices (k > 0; the anchors at k = 0): the tokens out, and e_b = W1[prev_b] as the MMA
// operands of step k. Lane L holds e[8L .. 8L+7]. A warp reads the keys of kRowsPerPass requests, then
// their W1 rows, before converting any (each in one batch of loads: one L2 round trip each, not one
// per request).
template <class T>
__device__ __forceinline__ void WalkCta<T>::Choose(int k) {
  constexpr int kRowsPerPass = T::kRowsPerPass;
  for (int first = warp; first < batch; first += kWarps * kRowsPerPass) {
    int row[kRowsPerPass];
    if (k == 0) {
#pragma unroll
      for (int u = 0; u < kRowsPerPass; ++u) row[u] = prev[min(first + u * kWarps, batch - 1)];
    } else if (direct) {
      // A warp walks at most kDirectPerWarp requests here.
#pragma unroll
      for (int u = 0; u < kRowsPerPass; ++u) {
        const int b = first + u * kWarps;
        row[u] = u < T::kDirectPerWarp && b < batch ? ArgmaxKeyIndex(GatherKey(a.slots + size_t((k - 1) * batch + b) * gridDim.x, lane)) : 0;
      }
    } else {
      FetchChoices(a.slots, k - 1, first, kWarps, batch, row);
    }
    if (k > 0 && a.d2t != nullptr) DraftToTarget(a.d2t, row);
    if (k > 0 && blockIdx.x == 0 && lane == 0) WriteTokens(a.tokens, batch, steps, k, first, kWarps, row);
    if (k == steps) continue;
    uint4 w1_raw[kRowsPerPass][2];
    LoadW1Rows(a, row, lane, w1_raw);
#pragma unroll
    for (int u = 0; u < kRowsPerPass; ++u) {
      const int b = first + u * kWarps;
      if (b >= batch) break;
      BuildOperands(b, k, w1_raw[u]);
    }
  }
}

// Request b's e = W1[prev_b] (lane L: its words 8L .. 8L+7, raw) as step k's MMA operands (a certified
// walk also records its margin and e).
template <class T>
__device__ __forceinline__ void WalkCta<T>::BuildOperands(int b, int k, const uint4 (&raw)[2]) {
  if constexpr (DIGITS) {
    BuildDigits(a, b, k, lane, raw, digits, unscale);
  } else if constexpr (EREGS) {
    BuildDigitPairOperands(a, b, k, lane, raw, frag, unscale);
  } else if constexpr (PAIRS) {
    BuildDigitPairs<NT>(a, b, k, lane, raw, frag, unscale);
  } else {
    BuildFragments<NT, SPLIT, W2, T::kWgmma>(a, b, k, lane, raw, frag, unscale);
  }
  if constexpr (CERT) CertifyE(b, raw);
}

// The best key of each owned request over the 8 lanes that share t (EREGS: the 4 that share g), then
// across the CTA's warps in shared memory. A certified walk also keeps each lane's best key and takes
// the CTA's second-best score: pairs of (best key, second score) merge as the keys do, and a warp's
// atomicMax on the CTA's best tells it which of its best and the best it displaced is second.
template <class T>
__device__ __forceinline__ void WalkCta<T>::Reduce(int k, unsigned long long (&best)[kSlots]) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    uint32_t second = 0;
    if constexpr (CERT) {
      lane_best[i] = best[i];
      second = lane_second[i];
    }
#pragma unroll
    for (int m = EREGS ? 1 : 4; m < (EREGS ? 4 : 32); m <<= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best[i], m);
      if constexpr (CERT) second = max(max(second, __shfl_xor_sync(0xffffffffu, second, m)), uint32_t(min(other, best[i]) >> 32));
      best[i] = other > best[i] ? other : best[i];
    }
    if (DIGITS && LogitsForm(FORM)) {  // the split-row epilogue: lane t + 1 holds the keys of rows g + 8
      const unsigned long long other = __shfl_down_sync(0xffffffffu, best[i], 1);
      if constexpr (CERT) second = max(max(second, __shfl_down_sync(0xffffffffu, second, 1)), uint32_t(min(other, best[i]) >> 32));
      best[i] = other > best[i] ? other : best[i];
    }
    const int rq = SlotRequest<SPLIT, DIGITS, EREGS>(i, t, g);
    if ((EREGS ? t : g) == 0 && rq < batch && best[i] != 0) {
      const unsigned long long before = atomicMax(&cta_best[rq], best[i]);
      if constexpr (CERT) atomicMax(&cert_second[rq], max(second, uint32_t(min(before, best[i]) >> 32)));
    }
  }
  __syncthreads();
}

// The workspace is left zeroed for the next call on this stream, with no grid-wide arrival for the
// direct exchange: each CTA cleared its slots of steps 0 .. steps - 3 as it went (PublishKeys), and
// CTA 0, which alone read the last step's keys, clears steps - 2 and steps - 1 (every CTA read step
// steps - 2's slots before it published the step steps - 1 keys that CTA 0 gathered). With the atomic
// exchange the last CTA out clears the keys and the counters.
template <class T>
__device__ __forceinline__ void WalkCta<T>::Finish() {
  if (direct && !CERT) {
    if (blockIdx.x == 0) {
      __syncthreads();
      const int first = max(0, steps - 2) * batch * gridDim.x;
      ClearWords(a.slots + first, steps * batch * gridDim.x - first, tid, THREADS);
    }
    return;
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *last_out = atomicAdd(&a.counters[1], 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (CERT && direct && *last_out) {
    // A certified walk's every CTA gathered the last step's keys (where the exact round needs them all):
    // the last one out clears the last two steps' key-and-bounds pairs and exact keys (certified.cuh).
    const size_t first = size_t(max(0, steps - 2)) * batch * gridDim.x, end = size_t(steps) * batch * gridDim.x;
    for (size_t i = first + tid; i < end; i += THREADS) {
      reinterpret_cast<ulonglong2*>(a.slots)[i] = make_ulonglong2(0ull, 0ull);
      a.slots[kExactWords + i] = 0;
    }
    if (tid == 0) a.counters[1] = 0;
  } else if (*last_out) {
    if constexpr (DIGITS) {
      // The whole range of the atomic keys: the written words' index below left this kernel two
      // registers spilled and reloaded every step.
      for (int i = tid; i < int(AtomicKey(steps, 0)); i += THREADS) a.slots[i] = 0;
    } else {
      // Only the words written: the atomic keys, one a line.
      for (int i = tid; i < steps * batch; i += THREADS) a.slots[AtomicKey(i / batch, i % batch)] = 0;
    }
    if (tid == 0) {
      a.counters[0] = 0;
      a.counters[1] = 0;
    }
  }
}

}  // namespace walk
}  // namespace jax_markov

#include "cuda/walk/certified.cuh"
#include "cuda/walk/epilogue.cuh"
#include "cuda/walk/score.cuh"

namespace jax_markov {
namespace walk {

template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) MarkovWalkKernel(const WalkArgs a) {
  if (SkipsLaunch(a)) return;
  extern __shared__ __align__(16) unsigned char smem[];
  WalkCta<T> cta(a, smem);
  Stamp(a, 0, 0);
  cta.Start();
  Stamp(a, 0, 1);
  Stamp(a, 0, 2);
  // With the direct exchange only CTA 0 reads the last step's keys: it writes the tokens and clears
  // the slots. (A loop bound: an exit from the loop at that step spilled in the tile loop.)
  // A certified walk's every CTA takes the last step's choices, for the exact round they may need.
  const int last = cta.direct && blockIdx.x != 0 && !T::CERT ? a.steps - 1 : a.steps;
  for (int k = 0; k <= last; ++k) {
    if (k > 0) cta.IssueAndWait(k);
    if constexpr (T::CERT) {
      if (k > 0) cta.ChooseCertified(k);
      else cta.Choose(k);
    } else {
      cta.Choose(k);
    }
    if (k == a.steps) {
      Stamp(a, k, 3);
      break;
    }
    unsigned long long best[WalkCta<T>::kSlots];
    cta.Score(k, best);
    if constexpr (T::CERT) cta.MakeMargins(k);
    StampWarp(a, k, cta.warp);
    cta.Reduce(k, best);
    Stamp(a, k, 4);
    // The wait comes at the top of the next step, after its prefetches are issued.
    if constexpr (T::CERT) cta.PublishCertified(k);
    else PublishKeys(a, k, cta.direct, a.batch, a.steps, cta.cta_best, cta.tid);
    Stamp(a, k, 5);
  }
  cta.Finish();
}

}  // namespace walk
}  // namespace jax_markov
