// The shared-memory layouts of the two walk kernels, computed the same way by the launch plan (how
// much a CTA needs, how many W2 tiles stay resident) and by the kernels (where each part starts).
#pragma once

#include "common/walk_config.h"

namespace jax_markov {
namespace walk {

// MarkovWalkKernel<NT, ..., PAIRS>: the B fragments and the per-request state (fixed), then the CTA's
// W2 scales, the staged base logits, the noise ahead, the noise tiles, the staged logits out, and the
// resident W2 tiles in what is left.
template <int NT, bool PAIRS>
struct WalkSmem {
  // B for 16 k-steps of [16 x 8 NT] (FragWord), or for PAIRS 8 k32-steps of int8 digits (BuildDigitPairs).
  static constexpr int kFragStepBytes = 256 * NT;
  static constexpr int kFragBytes = (PAIRS ? 8 : 16) * kFragStepBytes;
  // cta_best (8 bytes a request), prev, unscale, inv_t, key0, key1, pos (4 each), the last-CTA flag.
  static constexpr int kStateBytes = kMaxBatch * (8 + 4 * 6) + 16;
  static constexpr int kFixedBytes = kFragBytes + kStateBytes;
  // A warp's noise tile: the [B][16] floats of the tile it scores.
  MARKOV_HOST_DEVICE static constexpr int NoiseTileFloats(int batch) { return batch * kTileRows; }
  // A warp's staged logits: [NT][2][8] pieces of 16 bytes; f32 logits take two such arrays (high and
  // low halves).
  static constexpr int kOutStageBytes = NT * 2 * 8 * 16;
  MARKOV_HOST_DEVICE static constexpr int OutStageBytes(bool f32) { return (f32 ? 2 : 1) * kOutStageBytes; }

  // Byte offsets of the variable parts (each present where its size is not 0).
  struct Parts {
    int scales, staged, noise, noise_tiles, out_stage, cert, resident;
  };
  // stage_rows: the CTA's rows; staged_bytes: its staged base logits (STAGED); noise_ahead_bytes: a
  // step's noise of its rows (the fill); noise_tile_bytes, out_stage_bytes: a warp's; cert_bytes: a
  // certified walk's state (CertSmem), 0 in every other walk.
  MARKOV_HOST_DEVICE static constexpr Parts Layout(int warps, int stage_rows, int staged_bytes, int noise_ahead_bytes,
                                                   int noise_tile_bytes, int out_stage_bytes, int cert_bytes = 0) {
    Parts p{};
    p.scales = kFixedBytes;
    p.staged = p.scales + stage_rows * int(sizeof(float));
    p.noise = p.staged + staged_bytes;
    p.noise_tiles = p.noise + noise_ahead_bytes;
    p.out_stage = p.noise_tiles + warps * noise_tile_bytes;
    p.cert = p.out_stage + warps * out_stage_bytes;
    p.resident = p.cert + cert_bytes;
    return p;
  }
};

// A certified walk's state (the CERT instances, up to kCertBatch requests): per request the CTA's
// second-best int8 score of the step (ordered), its margin at steps of each parity (made after the
// step's scoring, read by its publish and the next step's exact round), the grid's threshold where
// the step's choice takes an exact round, the CTA's exact key of that round and its counts for the
// stats (columns re-scored, lanes that re-scored all their rows); the requests of each step parity
// that take an exact round; per warp the largest W2 scale and residual norm of its rows (as bits),
// which give the CTA's once a launch; then each request's e of the step as floats, for the margins and
// the warps that re-score (one shared-memory read, not an L2 round trip ahead of the W2 rows' loads).
struct CertSmem {
  static constexpr int kExact = 0;                                  // unsigned long long [kCertBatch]
  static constexpr int kSecond = kExact + 8 * kCertBatch;           // unsigned int [kCertBatch]
  static constexpr int kMargin = kSecond + 4 * kCertBatch;          // float [2][kCertBatch]
  static constexpr int kThreshold = kMargin + 8 * kCertBatch;       // float [kCertBatch]
  static constexpr int kCounts = kThreshold + 4 * kCertBatch;       // unsigned int [kCertBatch][2]
  static constexpr int kRounds = kCounts + 8 * kCertBatch;          // unsigned int [2]
  static constexpr int kMaxima = kRounds + 8;                       // unsigned int [kMaxWarps][2]
  static constexpr int kE = (kMaxima + 8 * kMaxWarps + 15) / 16 * 16;  // float [batch][256]
  MARKOV_HOST_DEVICE static constexpr int Bytes(int batch) { return kE + batch * kRank * int(sizeof(float)); }
};

// The transposed kernel's wgmma operands in shared memory: canonical K-major layout without swizzle.
// Byte offset of element (row, k) of a `rows` x 256 int8 operand: [k / 32][row / 8][k half][row % 8][16].
MARKOV_HOST_DEVICE constexpr int OperandOffset(int rows, int row, int k) {
  return (k / 32) * (rows * 32) + (row / 8) * 256 + ((k % 32) / 16) * 128 + (row % 8) * 16 + k % 16;
}
MARKOV_HOST_DEVICE constexpr int TransposedOffset(int row, int k) { return OperandOffset(64, row, k); }
// The row of a 64-row W2 tile (0-63) at the transposed kernel's wgmma column n: the accumulator
// columns 8 j + 2 t + h (j < 8, h < 2) of the threads of column pair t hold rows 16 t + 2 j + h. A tile
// in shared memory holds element k of row TileRow(n) at TransposedOffset(n, k), and so does a tile of
// W2 stored tile by tile (QuantizedMarkovHead.tiles, W2TileOrder in plan/walk_plan.h).
MARKOV_HOST_DEVICE constexpr int TileRow(int n) { return 16 * ((n % 8) / 2) + 2 * (n / 8) + n % 2; }

// The transposed kernel's A operands (e's two int8 digits a request). Unpacked, operand d holds digit d
// of request b in row b. PACKED (up to kPackedMaxBatch requests), the one operand holds digit d of
// request b in row 16 (b / 8) + b % 8 + 8 d. ROTATED (unpacked sampled launches of up to
// kRotatedMaxBatch requests): row 16 (b / 8) + b % 8 of operand d for b < 32 and row
// 16 ((b - 32) / 8) + 8 + b % 8 for the rest, and rows 0-31 again as rows 64-95, so that warpgroup j
// reads the 64 rows from row 16 j on: its warp w then scores the requests that warp (w + j) % 4 holds
// in operand rows 0-63.
// Below 64 requests some warps hold two requests a thread and the others one, and a sampled request's
// noise is most of a thread's work; the three warpgroups put warp w on the same SM sub-partition, so
// that without the rotation the sub-partitions of the first warps made all the second requests' noise.
template <bool PACKED, bool ROTATED>
struct DigitLayout {
  static constexpr int kRows = ROTATED ? 64 + 16 * (kTransposedWarpgroups - 1) : 64;  // rows of an operand
  static constexpr int kSlabBytes = kRows * 32;  // the k-slab of one wgmma (32 k)
  static constexpr int kOperandBytes = kRows * kRank;
  static constexpr int kBytes = (PACKED ? 1 : 2) * kOperandBytes;
  // The operand row of digit d of request b (ROTATED: its first copy).
  MARKOV_HOST_DEVICE static constexpr int Row(int b, int d) {
    return PACKED ? 16 * (b / 8) + b % 8 + 8 * d : ROTATED ? (b < 32 ? 16 * (b / 8) + b % 8 : 16 * ((b - 32) / 8) + 8 + b % 8) : b;
  }
  MARKOV_HOST_DEVICE static constexpr int Offset(int b, int d, int k) {
    return (PACKED ? 0 : d * kOperandBytes) + OperandOffset(kRows, Row(b, d), k);
  }
  // The request that warp w of warpgroup wg scores in accumulator rows g + 8 r of its 16 (PACKED: r = 0).
  MARKOV_HOST_DEVICE static constexpr int Request(int w, int wg, int g, int r) {
    return PACKED ? 8 * w + g : ROTATED ? 8 * ((w + wg) % 4) + g + 32 * r : 16 * w + g + 8 * r;
  }
  // Whether Request names the request whose digits lie in the rows each warpgroup reads: for each
  // warpgroup, every request once, in the row of its digit 0 (PACKED: digit 1 eight rows on).
  static constexpr bool Consistent() {
    for (int wg = 0; wg < kTransposedWarpgroups; ++wg) {
      bool seen[kMaxBatch] = {};
      for (int w = 0; w < 4; ++w) {
        for (int g = 0; g < 8; ++g) {
          for (int r = 0; r < (PACKED ? 1 : 2); ++r) {
            const int b = Request(w, wg, g, r);
            const int read = (ROTATED ? 16 * wg : 0) + 16 * w + g + 8 * r;  // the operand row read
            if (b < 0 || b >= kMaxBatch || seen[b] || read >= kRows) return false;
            seen[b] = true;
            const int row = Row(b, 0);
            if (read != row && !(read == row + 64 && row < kRows - 64)) return false;
            if (PACKED && Row(b, 1) != row + 8) return false;
          }
        }
      }
    }
    return true;
  }
};
static_assert(DigitLayout<true, false>::Consistent() && DigitLayout<false, false>::Consistent() &&
                  DigitLayout<false, true>::Consistent(),
              "each warpgroup reads every request's digits where Request says");

// MarkovWalkTransposedKernel's shared memory: the A operands (DigitLayout), the per-request state
// (padded to 1024 bytes), the W2 scales, one streamed-tile slot per warpgroup, then the resident tiles
// (each tile 1024-byte aligned, as are the operands). The state ends with two mbarriers a warpgroup:
// its turn to issue wgmmas, and its slot's bulk copy landed; then one a resident tile that lands by a
// bulk copy.
template <bool PACKED, bool ROTATED, int WARPGROUPS>
struct TransposedSmem {
  static constexpr int kDigitsBytes = DigitLayout<PACKED, ROTATED>::kBytes;
  static constexpr int kResidentBarriers = 16;  // resident tiles that land by bulk copies, at most
  // cta_best, unscale, last-CTA flag, mbarriers (turns, streamed slots, resident tiles)
  static constexpr int kStateBytes = kMaxBatch * (8 + 4) + 16 + 2 * 8 * 4 + 8 * kResidentBarriers;
  static constexpr int kRingBytes = WARPGROUPS * kTransposedTileBytes;
  MARKOV_HOST_DEVICE static constexpr int ScalesBytes(int rows_per_cta) { return (rows_per_cta * 4 + 1023) / 1024 * 1024; }
  MARKOV_HOST_DEVICE static constexpr int FixedBytes(int rows_per_cta) {
    return kDigitsBytes + 1024 + ScalesBytes(rows_per_cta) + kRingBytes;  // state padded to 1024
  }
};
static_assert(TransposedSmem<false, false, 4>::kStateBytes <= 1024, "the state fits its 1024 bytes");
static_assert(TransposedSmem<false, true, kTransposedWarpgroups>::kDigitsBytes % 1024 == 0, "the state stays 1024-byte aligned");

// The certified transposed walk's state (cuda/transposed/certified.cuh), after the scales: per request
// its exact key, e's norms, the step's margin and T', its W1 row and the rows re-scored; the requests
// whose every row the CTA re-scores; how many rows are listed; each warp's largest W2 scale and
// residual norm; the rows listed for re-scoring.
struct TransposedCertSmem {
  static constexpr int kListCapacity = 96;
  static constexpr int kExact = 0;                         // unsigned long long [kMaxBatch]
  static constexpr int kNorms = kExact + 8 * kMaxBatch;    // float2 [kMaxBatch]
  static constexpr int kMargin = kNorms + 8 * kMaxBatch;   // float [kMaxBatch]
  static constexpr int kThreshold = kMargin + 4 * kMaxBatch;
  static constexpr int kW1Row = kThreshold + 4 * kMaxBatch;  // int [kMaxBatch]
  static constexpr int kRescored = kW1Row + 4 * kMaxBatch;   // unsigned [kMaxBatch]
  static constexpr int kAll = kRescored + 4 * kMaxBatch;     // unsigned long long: bit b, request b
  static constexpr int kCount = kAll + 8;                    // int, padded to 8 bytes
  static constexpr int kMaxima = kCount + 8;                 // unsigned [kMaxWarps][2]
  static constexpr int kList = kMaxima + 8 * kMaxWarps;      // int2 [kListCapacity]: (request, row)
  static constexpr int kBytes = (kList + 8 * kListCapacity + 1023) / 1024 * 1024;
};

}  // namespace walk
}  // namespace jax_markov
