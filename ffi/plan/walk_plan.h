// The launch plan of the CUDA walk, on the host alone: from a call's shapes and dtypes and the GPU's
// properties, whether the kernel can walk it (the envelope), and for each launch (a batch walks in
// chunks of kMaxBatch columns) which instantiated kernel runs it, on how many threads, with how much
// shared memory and how many resident W2 tiles. The FFI handler executes plans (ffi/cuda/handler.cu);
// Python asks the same functions through the `_markov_plan` module (jax_markov/native.py).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/walk_config.h"

namespace jax_markov {
namespace walk {

struct DeviceProperties {
  int sm_count = 0;
  int smem_per_block = 0;  // opt-in maximum of dynamic shared memory per block, bytes
  int l2_bytes = 0;
  int major = 0;
  int minor = 0;
  bool cooperative = false;
};

// A walk as the custom call sees it (docs/spec.md; ffi/README.md's operands).
struct WalkCall {
  int64_t batch = 0, steps = 0, vocab = 0, rank = 0;
  int w2 = kW2Int8;            // W2Format, or -1: a W2 dtype the kernel does not walk
  int w1_dtype = kBF16;        // DType
  int base_dtype = kBF16;      // DType
  int logits_dtype = kNone;    // DType of the logits out, kNone: no logits out
  bool sampling = false;       // the caller gave temperatures (rows may sample)
  bool base_aligned = true;    // base logits 16-byte aligned (XLA's buffers are)
  bool logits_aligned = true;  // logits out 16-byte aligned
  bool certified = false;      // a CertifiedMarkovHead: greedy rows re-score their candidates exactly
  bool w2_tiled = false;       // the int8 W2 also comes stored tile by tile (QuantizedMarkovHead.tiles, W2TileOrder)
};

enum KernelFamily : int { kWalkFamily = 0, kTransposedFamily = 1 };

// A kernel instance: MarkovWalkKernel's template arguments (kWalkFamily) or
// MarkovWalkTransposedKernel's (kTransposedFamily); the other family's fields are 0.
struct KernelKey {
  int family = kWalkFamily;
  int nt = 0, split = 0, digits = 0, w2 = 0, threads = 0, staged = 0, form = 0, pairs = 0, eregs = 0, cert = 0;
  int base = 0, packed = 0, walk = 0;
  bool operator==(const KernelKey& o) const;
};

// One launch of up to kMaxBatch columns.
struct LaunchPlan {
  KernelKey kernel;
  int first = 0, batch = 0;  // the requests it walks: [first, first + batch)
  int grid = 0, threads = 0, smem_bytes = 0;
  int tiles_per_cta = 0, resident_tiles = 0;
  bool noise_ahead = false;    // MarkovWalkKernel: each step's noise of the CTA's rows made into shared memory first
  bool noise_tiles = false;    // MarkovWalkKernel: each tile's noise made into a warp's buffer just before it is scored
  bool logits_staged = false;  // MarkovWalkKernel: logits out 8 rows of a request a store, through shared memory
  bool sampling = false;       // whether its rows may sample (false: every row greedy, whatever T holds)
  bool w2_tiled = false;       // transposed kernel: W2 tiles land by one bulk copy each from W2 stored tile by tile
  int run_when = kAlways;      // RunWhen (walk_config.h)
};

// B columns a request takes: the MMA's format holds e in one column, or two (hi + lo parts) where it
// holds fewer bits than W1 (fp16 MMAs for int8 and fp16 W2 split an fp32 W1; bf16 MMAs split fp32 and
// fp16 W1).
int ColumnsPerRequest(int w2, int w1_dtype);
// Requests per launch.
int LaunchRequests(int w2, int w1_dtype);

// Why the kernel cannot walk `call` on this GPU, naming the limit, or "" if it can.
std::string Unsupported(const WalkCall& call, const DeviceProperties& props);

// Why the kernel, although it can walk `call`, would likely be slower than the reference there, or "":
// int8 W2 that would neither fit in shared memory nor stay in L2. impl="auto" then takes the reference.
std::string SlowerThanReference(const WalkCall& call, const DeviceProperties& props);

// The launches of a call that Unsupported accepts, in order: per run of requests one launch, or for a
// sampled call whose greedy launch differs the guarded pair, and for a certified head's sampled call
// the plain sampled walk after them (RunWhen).
std::vector<LaunchPlan> PlanCall(const WalkCall& call, const DeviceProperties& props);

// The keys of MarkovWalkKernel<WalkTraits<...>> and MarkovWalkTransposedKernel<...> instances.
KernelKey WalkKernelKey(int nt, bool split, bool digits, int w2, int threads, bool staged, int form, bool pairs, bool eregs,
                        bool cert = false);
KernelKey TransposedKernelKey(int base, bool packed, int walk);

// Every kernel the build instantiates (kernel_list.h).
std::vector<KernelKey> InstantiatedKernels();

std::string KernelName(const KernelKey& key);

// W2 stored tile by tile (QuantizedMarkovHead.tiles): int8 [ceil(V / kTransposedTileRows)][kTransposedTileBytes],
// each tile's bytes as the transposed kernel holds a tile in shared memory, so that one bulk copy moves
// it; rows past V are zero. Byte i of a stored tile is byte W2TileOrder()[i] of the tile's rows of W2
// taken row-major ([kTransposedTileRows][kRank]).
std::vector<int32_t> W2TileOrder();

}  // namespace walk
}  // namespace jax_markov
