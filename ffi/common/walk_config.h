// The walk's fixed sizes, its storage formats and the predicates that pick a kernel's variants: one
// source of truth for the launch plan (host, ffi/plan/) and the kernels (device, ffi/cuda/).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/walk_common.h"

#if defined(__CUDACC__)
#define MARKOV_HOST_DEVICE __host__ __device__
#else
#define MARKOV_HOST_DEVICE
#endif

namespace jax_markov {
namespace walk {

constexpr int kRank = 256;
constexpr int kTileRows = 16;
constexpr int kTileElements = kTileRows * kRank;  // 4096
constexpr int kMaxSteps = 16;
constexpr int kMaxBatch = 64;  // columns per launch (8 n-tiles of 8); larger batches take several launches
constexpr int kMaxStageBytes = 10 * 1024;
constexpr int kMaxNoiseBytes = 24 * 1024;  // at V = 151936 on 132 SMs: up to 5 requests
// The exchange through one slot per CTA: its batch and grid limits, the slots it takes.
constexpr int kDirectBatch = 16;
constexpr int kDirectMaxCtas = 160;
constexpr int kSlotWords = kMaxSteps * kDirectBatch * kDirectMaxCtas;
// The workspace's words: the keys (kSlotWords); a certified walk's direct slots instead hold each key
// with its bounds word (2 kSlotWords), then the exact keys of its exact rounds (certified.cuh).
constexpr int kExactWords = 2 * kSlotWords, kWorkspaceWords = 3 * kSlotWords;
// The requests a launch of a certified walk (a CertifiedMarkovHead) takes: 1-2 in the digit kernel,
// 9-16 in EREGS (kCertBatch), more in the transposed kernel.
constexpr int kCertDigitBatch = 2;
constexpr int kCertBatch = 16;
// The atomic exchange's keys, each on a line of its own (kKeyStride, walk_common.h).
static_assert(kMaxSteps * kMaxBatch * kKeyStride <= kSlotWords, "the atomic exchange's keys fit the slots");
MARKOV_HOST_DEVICE constexpr size_t AtomicKey(int k, int b) { return size_t(k * kMaxBatch + b) * kKeyStride; }
// The certified transposed walk's words (cuda/transposed/certified.cuh): its exact keys at
// kCertExactKeys + AtomicKey(k, b), and the head's largest scale and residual norm (as bits) at
// kCertMaxima and kCertMaxima + kKeyStride.
constexpr int kCertExactKeys = kSlotWords, kCertMaxima = 2 * kSlotWords;
static_assert(kCertMaxima + 2 * kKeyStride <= kWorkspaceWords, "the certified transposed walk's words fit the workspace");

enum DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };
// The counters of a certified walk (WalkArgs::cert_stats, the CUDA module's certified_stats()): greedy
// (request, step) decisions, those whose bound could not be used, those that took an exact round (the
// exchange's int8 keys did not certify the choice), columns re-scored exactly in all and at most by
// one CTA for one decision, (decision, CTA) pairs that re-scored a column, and lanes that re-scored
// all their rows (two or more candidates, or no usable bound).
enum CertStat : int { kCertDecisions, kCertUncertified, kCertExactRounds, kCertRescored, kCertMaxCtaRescored, kCertCtaSets,
                      kCertLaneFallbacks, kCertStats };
// W2's storage: int8 rows with fp32 scales, or the unquantized fp16 / bf16 rows of a MarkovHead.
enum W2Format : int { kW2Int8 = 0, kW2F16 = 1, kW2BF16 = 2 };
// MarkovWalkKernel's instances for launches whose form is known when the kernel is chosen: any launch,
// or (the digit kernel) bf16 base logits with logits out in bf16 or float32 (the noise of any sampled
// row ahead), or greedy rows and tokens only. A known form leaves out the epilogues it does not take.
enum LaunchForm : int { kAnyForm = 0, kBF16LogitsForm = 1, kPlainForm = 2, kF32LogitsForm = 3 };
MARKOV_HOST_DEVICE constexpr int FormLogits(int form) { return form == kF32LogitsForm ? kF32 : kBF16; }
MARKOV_HOST_DEVICE constexpr bool LogitsForm(int form) { return form == kBF16LogitsForm || form == kF32LogitsForm; }

// Which launches of a sampled call run. A serving loop passes temperatures for every batch, also for
// one whose rows are all greedy (temperature 0), and only the device sees their values. Where the
// call's greedy launch would be another kernel (or the same one with more resident tiles), the plan
// (PlanCall) launches both: the greedy one first, returning at once where a row samples, then the
// sampled one, returning at once where none does. A CertifiedMarkovHead's call adds the plain sampled
// walk, which alone walks a batch whose rows all sample (the certified walk certifies greedy rows
// only). Each launch reads the launch's temperatures first and walks in the classes of RunWhen.
enum BatchClass : int { kAllGreedy = 1, kMixedRows = 2, kAllSampled = 4 };
enum RunWhen : int {
  kAlways = kAllGreedy | kMixedRows | kAllSampled,
  kNoRowSamples = kAllGreedy,
  kSomeRowSamples = kMixedRows | kAllSampled,
  kSomeRowGreedy = kAllGreedy | kMixedRows,
};

MARKOV_HOST_DEVICE constexpr int ElementBytes(int dtype) { return dtype == kF32 ? 4 : 2; }
MARKOV_HOST_DEVICE constexpr int W2Bytes(int w2) { return w2 == kW2Int8 ? 1 : 2; }
// 16-byte chunks of a tile that each lane holds: rows g and g + 8, half each.
MARKOV_HOST_DEVICE constexpr int TileChunks(int w2) { return 8 * W2Bytes(w2); }

// Timeline builds (cmake -DJAX_MARKOV_TIMELINE=ON, benchmarks/timeline.py): thread 0 of every CTA
// stamps %globaltimer at each phase of each step, lane 0 of every warp when its tiles are scored.
constexpr int kPhases = 6;  // step start, prefetches issued, wait over, e ready, scored, arrived
constexpr int kMaxWarps = 16;

// Batches from kNoiseTileRequests requests up, in the kernels of that many columns, make each tile's
// Gumbel noise for the whole batch into a warp's shared-memory buffer just before they score it (the
// noise tiles), so that scoring takes the branch-free epilogue. At 16 warps (128 registers a thread)
// that code spills registers in the kernels of up to 8 columns, whose batches' noise mostly fits
// ahead anyway (up to 5 requests at V = 151936).
constexpr int kNoiseTileRequests = 9;
MARKOV_HOST_DEVICE constexpr bool MakesNoiseTiles(int nt, bool split, bool digits) {
  return !digits && (split ? 4 * nt : 8 * nt) >= kNoiseTileRequests;
}

// Whether kernel <NT, SPLIT, DIGITS> stages logits (of 4 bytes if F32, else 2) for 8-row stores:
// where a lane's MMA columns are whole requests; f32 ones in the wgmma kernels, whose 16 slots a
// thread make each value's own store cost most.
MARKOV_HOST_DEVICE constexpr bool StagesLogits(int nt, bool split, bool digits, bool f32) {
  return !split && !digits && (!f32 || nt >= 4);
}

// The transposed kernel (17-64 requests over int8 W2, and 9-16 of a head with tiles):
// 64-row tiles of W2.
constexpr int kTransposedTileRows = 64;
constexpr int kTransposedTileBytes = kTransposedTileRows * kRank;  // int8
// The warpgroups of the walks other than TransposedWarpgroups' four (DigitLayout's ROTATED order is
// laid out for them).
constexpr int kTransposedWarpgroups = 3;
// What a launch of the transposed kernel does besides choosing: nothing (greedy, no logits out),
// logits out (greedy), or sampling (and logits out if asked), the last in DigitLayout's ROTATED order
// for unpacked launches of up to kRotatedMaxBatch requests. Each is its own instance: the noise's
// code costs a greedy walk with logits out 7 % even where it never runs. A CertifiedMarkovHead's greedy
// walk with no logits out takes kCertifiedWalk: the plain walk and an exact round each step.
enum TransposedWalk : int { kPlainWalk = 0, kLogitsWalk = 1, kSampledWalk = 2, kRotatedSampledWalk = 3, kCertifiedWalk = 4 };
constexpr int kRotatedMaxBatch = 48;  // rotated: 40 requests -8.0 %, 48 -4.2 %, but 64 +1.3 %
// Up to this many requests the transposed kernel takes the packed layout (one A operand for both digits).
constexpr int kPackedMaxBatch = 32;
// From this many requests a head with tiles walks launches from bf16 base logits on the transposed
// kernel (WalksTransposed in ffi/plan/walk_plan.cc), not on EREGS or the fp16 columns; fewer take the
// digit kernel or the digit pairs.
constexpr int kTransposedTiledMinBatch = 9;

// A transposed walk's warpgroups a CTA: the plain walk over 16-bit base logits on four (its epilogue
// fits 128 registers a thread, and its score phase is bound by latency that more warps cover: two
// warpgroups lost 4.4 % against three); the general epilogues (up to 168 registers) and f32 base
// logits (whose tile loop spills at 128) and the certified walk on three.
MARKOV_HOST_DEVICE constexpr int TransposedWarpgroups(int walk, int base) {
  return walk == kPlainWalk && base != kF32 ? 4 : kTransposedWarpgroups;
}

}  // namespace walk
}  // namespace jax_markov
