// MarkovWalkKernel's variants: the template arguments that the launch plan picks (kernel_list.h) and
// every knob that follows from them, in one place.
#pragma once

#include "common/smem_layout.h"
#include "common/walk_config.h"

namespace jax_markov {
namespace walk {

// NT: n-tiles of 8 B columns (up to 8 NT columns a launch). SPLIT: a request takes two columns (hi and
// lo parts of e). DIGITS: 1-2 requests as e's three int8 digits (int8 W2). W2: W2Format. THREADS: the
// CTA's threads. STAGED: each step's base logits staged in shared memory. FORM: LaunchForm. PAIRS: 3-8
// requests as e's two int8 digits in B. EREGS: 9-16 greedy requests, e's two digits as the A operand
// held in registers (tokens only, or bf16 logits out). CERT: a CertifiedMarkovHead's walk
// (certified.cuh): greedy rows re-score their candidates exactly from the unquantized W2; the digit
// kernel's plain and any-form instances, the digit pairs' and EREGS's plain one.
template <int NT_, bool SPLIT_, bool DIGITS_, int W2_, int THREADS_, bool STAGED_, int FORM_, bool PAIRS_, bool EREGS_,
          bool CERT_ = false>
struct WalkTraits {
  static constexpr int NT = NT_;
  static constexpr bool SPLIT = SPLIT_, DIGITS = DIGITS_, STAGED = STAGED_, PAIRS = PAIRS_, EREGS = EREGS_, CERT = CERT_;
  static constexpr int W2 = W2_, THREADS = THREADS_, FORM = FORM_;
  static_assert(!DIGITS || (NT == 1 && !SPLIT && W2 == kW2Int8), "the int8-digit path walks up to 2 requests in one n-tile");
  static_assert(FORM == kAnyForm || DIGITS || EREGS, "only the digit kernel has instances for the known launch forms");
  // A known launch form's base logits are bf16 (the plan: walk_plan.cc).
  static constexpr bool kBF16Base = FORM != kAnyForm;
  static_assert(!EREGS || (NT == 2 && !SPLIT && !DIGITS && !PAIRS && W2 == kW2Int8 &&
                           (FORM == kPlainForm || FORM == kBF16LogitsForm)),
                "e as the A operand: 9-16 requests' digit pairs, int8 W2, greedy with no logits or bf16 logits out");
  static_assert(THREADS / 32 <= kMaxWarps, "the timeline has kMaxWarps warps per CTA");
  static_assert(!STAGED || NT <= 2, "only kernels of up to 16 columns stage their base logits");
  static_assert(!PAIRS || (SPLIT && !DIGITS && W2 == kW2Int8 && NT <= 2), "digit pairs: up to 8 requests' two columns, int8 W2");
  static_assert(!CERT || (DIGITS && (FORM == kPlainForm || FORM == kAnyForm)) || PAIRS || (EREGS && FORM == kPlainForm),
                "the certified walk: the digit kernel (1-2 requests), whose lanes own whole rows (no split-row "
                "form), the digit pairs (3-8) or EREGS (9-16 greedy requests, tokens only)");

  using Smem = WalkSmem<NT, PAIRS>;
  // Rows of W2 whose loads a warp has in flight at once when it re-scores a certified walk's candidates.
  static constexpr int kRescoreBatch = 4;
  static constexpr int kWarps = THREADS / 32;
  static constexpr int kChunks = TileChunks(W2);
  static constexpr int kTileBytes = kTileElements * W2Bytes(W2);
  static constexpr int kSlots = EREGS ? 2 : (DIGITS ? 1 : (SPLIT ? NT : 2 * NT));  // requests a thread owns per row
  static constexpr int kRowsPerPass = kMaxBatch / kWarps < 8 ? kMaxBatch / kWarps : 8;  // W1 rows a warp fetches at once
  static constexpr int kDirectPerWarp = (kDirectBatch + kWarps - 1) / kWarps;
  // Base logits are fetched one tile ahead where registers allow; at NT = 8 a tile's 128 MMAs
  // cover the latency of fetching them at the start of the tile. EREGS folds a tile in the next
  // tile's iteration, so its base logits fetched at the tile's own start are a tile ahead of use.
  static constexpr bool kBaseAhead = NT <= 4 && !EREGS;
  // The branch-free epilogue for rows with no noise to draw spills registers at 16 slots a thread.
  static constexpr bool kNoiseFreeEpilogue = kSlots <= 8;
  // At 16 slots, one copy of it for every logits dtype (chosen with selects, kAnyDType), for batches
  // whose noise is made ahead or in tiles.
  static constexpr int kAnyDType = -2;
  // Logits staged for 16-byte stores (a.logits_staged). EREGS stores a lane's two adjacent rows of a
  // request (4 bytes) directly.
  static constexpr bool kStagedOut = StagesLogits(NT, SPLIT, DIGITS, false) && !EREGS;
  // Whether sampled launches of this kernel make their noise in tiles (noise.cuh) where it does not
  // fit ahead; the staging kernels' batches' noise always fits ahead.
  static constexpr bool kNoiseTiles = MakesNoiseTiles(NT, SPLIT, DIGITS) && !STAGED && !EREGS;
  // Batches that may take the direct exchange fill step k's noise while its choice is fetched;
  // larger ones before the grid-wide wait, where the fill spills fewer registers.
  static constexpr bool kFillWhileGathering = NT <= 2;
  // Resident tiles in flight per warp during step 0: 12 or more warps x 2 x 4 KB per SM cover HBM's
  // latency. EREGS's 8 warps keep 4 each (the same 32 KB an SM; measured no slower than 2).
  static constexpr int kLoadAhead = EREGS ? 4 : 2;
  // Resident tiles in fragment order where MMA operands are tile words as they stand.
  static constexpr bool kFragmentOrder = DIGITS || PAIRS || EREGS || W2 != kW2Int8;
  // Whether a warp keeps its last streamed tile of a step in its prefetch registers for the next
  // (WarpTiles::Streamed). The digit kernel's instance for any launch spills registers with it, and
  // the int8 -> fp16 kernels, whose scoring is bound by the conversion, gain nothing.
  static constexpr bool kKeepsStreamed = kFragmentOrder && (FORM != kAnyForm || !DIGITS);
  // Batches of 17 and more columns score on the warpgroup's tensor cores (wgmma), in batches of
  // kBatch k-steps whose A operands stay in registers until their MMAs are done; smaller ones (where
  // wgmma's waits cost more than its shared B reads save) score warp by warp with mma.sync, in
  // kChains independent accumulator chains per n-tile.
  static constexpr bool kWgmma = !DIGITS && !PAIRS && NT >= 4;
  // Whether step 0 loads and arranges the resident tiles in the tile loop, as it scores them, rather
  // than before it: only in the wgmma kernels of 16-bit W2, where the arranging pass's 16 chunks a
  // lane made ptxas spill in the tile loop (48 -> 116 bytes).
  static constexpr bool kStep0InLoop = kWgmma && W2 != kW2Int8;
  // The wgmma kernels' general epilogue draws the noise of kNoiseGroup slots (2 x kNoiseGroup Philox
  // chains) before their branches; the others draw it row by row in the branches (where their 128
  // registers a thread allow no more).
  static constexpr bool kGroupNoise = kWgmma;
  static constexpr int kNoiseGroup = kGroupNoise ? 2 : 1;
  static constexpr int kBatch = W2 == kW2Int8 ? 8 : 4;
  static constexpr int kChains = NT == 1 ? 2 : 1;
  // The mma.sync kernels past two requests (128 registers a thread at 16 warps) read each owned
  // request's unscale from shared memory as they go: held in registers, it pushed the next tile's base
  // logits to local memory, and that spill store waited for their global load.
  static constexpr bool kUnscaleFromSmem = !kWgmma && !DIGITS && !EREGS;
  // The int8 kernels but the digit one copy the next tile's base logits only where they were loaded:
  // after the last tile the copy reads registers left from the step before and keeps them live. That
  // measured 8 % faster at 8 requests but up to 7 % slower in the bf16 head and 1 % in the digit
  // kernel, where ptxas schedules the rest worse.
  static constexpr bool kGuardedCopy = W2 == kW2Int8 && !DIGITS;
  // The mma.sync kernels step their streamed tiles' positions (StreamedSlots) rather than divide for
  // each: 20-30 instructions fewer in their tile loops and fewer spills there (nvcc 13.0); in the
  // wgmma kernels the stepping state spilled registers (bf16 W2, 17-32 columns: none -> 40 bytes).
  static constexpr bool kSteppedSlots = !kWgmma;
};

}  // namespace walk
}  // namespace jax_markov
