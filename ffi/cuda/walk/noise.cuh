// MarkovWalkKernel's Gumbel noise for sampled rows (docs/spec.md, version 2: one Philox4x32-10 block
// gives the noise of four consecutive columns), made where it is used: each step's noise of the CTA's
// rows into shared memory ahead of scoring where it fits (the fill: small batches), or each tile's
// noise for the whole batch into a warp's buffer just before the warp scores it (the noise tiles:
// batches from kNoiseTileRequests requests up), so that scoring takes the branch-free epilogue;
// otherwise the scoring epilogue draws it value by value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/walk_common.h"
#include "common/walk_config.h"
#include "cuda/walk/args.cuh"

namespace jax_markov {
namespace walk {

// MarkovWalkKernel's noise takes the math library's logf for its inner log, not LogOfUnit (the same
// bits): with LogOfUnit the kernel's register allocation shifted and its greedy walks, which make no
// noise, ran 1 % slower.
constexpr bool kWalkLogf = true;

// Step k's noise of rows [first_row, first_row + rows) (first_row a multiple of 4) for every sampled
// request, into noise[b][stage_rows] (stage_rows a multiple of 16, so that a block's four values are
// one aligned 16-byte store, within the row even past `rows`), on `threads` threads from `thread`. It
// depends on neither the walk nor the weights, so a CTA makes it outside the scoring epilogue: with
// the warps that wait for the others to fetch the grid's choice, or before the grid-wide wait. A
// thread's blocks share a request, so the Philox round keys stay in registers.
__device__ __forceinline__ void FillNoise(const WalkArgs& a, float* noise, int stage_rows, int first_row, int rows, int k,
                                          const float* inv_t, const uint32_t* key0, const uint32_t* key1,
                                          const uint32_t* pos, int thread, int threads) {
  const int blocks = (rows + 3) / 4;
  for (int b = 0; b < a.batch; ++b) {
    if (!(inv_t[b] >= 0.0f)) continue;
    const uint32_t k0[1] = {key0[b]}, k1[1] = {key1[b]}, p[1] = {pos[b] + uint32_t(k)};
    float4* out = reinterpret_cast<float4*>(noise + b * stage_rows);
    for (int q = thread; q < blocks; q += threads) {
      const uint32_t block[1] = {uint32_t(first_row) / 4 + q};
      float g[1][4];
      GumbelNoiseBlock<1, false, kWalkLogf>(k0, k1, block, p, g);
      out[q] = make_float4(g[0][0], g[0][1], g[0][2], g[0][3]);
    }
  }
}

// Step k's noise of the 16-row tile at row0 for every sampled request, into a warp's buffer
// ([B][16] floats, 16-byte aligned): four blocks a request, one a lane at a time (one Philox chain: the
// kernels that make noise tiles hold a streamed tile and two tiles' base logits in registers here, and
// two chains spilled). The whole warp calls it; the buffer is the warp's own, read by the tile's
// epilogue.
__device__ __forceinline__ void MakeNoiseTile(float* buffer, int batch, int row0, int k, const float* inv_t,
                                              const uint32_t* key0, const uint32_t* key1, const uint32_t* pos, int lane) {
  __syncwarp();  // every lane has read the previous tile's noise
  for (int i = lane; i < 4 * batch; i += 32) {
    const int b = i / 4;
    if (inv_t[b] >= 0.0f) {
      const uint32_t k0[1] = {key0[b]}, k1[1] = {key1[b]}, block[1] = {uint32_t(row0) / 4 + i % 4};
      const uint32_t p[1] = {pos[b] + uint32_t(k)};
      float g[1][4];
      GumbelNoiseBlock<1, false, kWalkLogf>(k0, k1, block, p, g);
      reinterpret_cast<float4*>(buffer)[i] = make_float4(g[0][0], g[0][1], g[0][2], g[0][3]);
    }
  }
  __syncwarp();  // the tile's noise is in before any lane reads it
}

}  // namespace walk
}  // namespace jax_markov
