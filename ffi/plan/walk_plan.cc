// The launch plan (walk_plan.h): which kernel walks each launch and with what resources. Every
// decision about a launch is made here, once; the kernels read the results from WalkArgs.
#include "plan/walk_plan.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/smem_layout.h"
#include "plan/kernel_list.h"

namespace jax_markov {
namespace walk {

bool KernelKey::operator==(const KernelKey& o) const {
  return family == o.family && nt == o.nt && split == o.split && digits == o.digits && w2 == o.w2 && threads == o.threads &&
         staged == o.staged && form == o.form && pairs == o.pairs && eregs == o.eregs && cert == o.cert && base == o.base &&
         packed == o.packed && walk == o.walk;
}

KernelKey WalkKernelKey(int nt, bool split, bool digits, int w2, int threads, bool staged, int form, bool pairs, bool eregs,
                        bool cert) {
  KernelKey k;
  k.family = kWalkFamily;
  k.nt = nt;
  k.split = split;
  k.digits = digits;
  k.w2 = w2;
  k.threads = threads;
  k.staged = staged;
  k.form = form;
  k.pairs = pairs;
  k.eregs = eregs;
  k.cert = cert;
  return k;
}

KernelKey TransposedKernelKey(int base, bool packed, int walk) {
  KernelKey k;
  k.family = kTransposedFamily;
  k.w2 = kW2Int8;
  k.base = base;
  k.packed = packed;
  k.walk = walk;
  k.threads = 128 * TransposedWarpgroups(walk, base);
  return k;
}

namespace {

int RowsPerCta(int64_t vocab, int sm_count) {
  const int64_t total_tiles = (vocab + kTileRows - 1) / kTileRows;
  return int((total_tiles + sm_count - 1) / sm_count * kTileRows);
}

// Whether each step's Gumbel noise of `batch` requests fits in shared memory ahead of scoring (the
// fill): small batches make it there, at the price of about one resident W2 tile a request.
bool NoiseFitsAhead(int batch, int rows_per_cta) { return size_t(batch) * rows_per_cta * sizeof(float) <= size_t(kMaxNoiseBytes); }

// MarkovWalkKernel's shared memory that is not resident tiles, for these variants.
int WalkFixedBytes(int nt, bool pairs, int warps, int rows_per_cta, int staged_bytes, int noise_ahead_bytes, int noise_tile_bytes,
                 int out_stage_bytes, int cert_bytes) {
  const auto f = [&](auto layout) {
    return decltype(layout)::Layout(warps, rows_per_cta, staged_bytes, noise_ahead_bytes, noise_tile_bytes, out_stage_bytes,
                                    cert_bytes)
        .resident;
  };
  if (pairs) return nt == 1 ? f(WalkSmem<1, true>()) : f(WalkSmem<2, true>());
  switch (nt) {
    case 1: return f(WalkSmem<1, false>());
    case 2: return f(WalkSmem<2, false>());
    case 4: return f(WalkSmem<4, false>());
    default: return f(WalkSmem<8, false>());
  }
}

int NoiseTileBytes(int batch) { return WalkSmem<1, false>::NoiseTileFloats(batch) * int(sizeof(float)); }

int OutStageBytes(int nt, bool f32) {
  switch (nt) {
    case 1: return WalkSmem<1, false>::OutStageBytes(f32);
    case 2: return WalkSmem<2, false>::OutStageBytes(f32);
    case 4: return WalkSmem<4, false>::OutStageBytes(f32);
    default: return WalkSmem<8, false>::OutStageBytes(f32);
  }
}

// A MarkovWalkKernel launch of `batch` requests in the variant <nt, split, digits, pairs, eregs, cert>.
LaunchPlan PlanWalkKernel(const WalkCall& call, int batch, const DeviceProperties& props, int nt, bool split, bool digits,
                          bool pairs = false, bool eregs = false, bool cert = false) {
  LaunchPlan p;
  p.batch = batch;
  // 16 warps for int8 W2 up to 16 columns (at most 128 registers: some kernels spill a few dozen
  // bytes), since a tile is a chain of latencies that other warps cover; 16-bit W2 tiles and wider
  // batches hold more registers per lane. EREGS holds e's 64 operand registers a lane beside a
  // streamed tile's 32: 8 warps (at 12 warps ptxas spills in the tile loop and the walk took 9 % longer).
  const int threads = eregs ? 256 : (nt <= 2 && call.w2 == kW2Int8 ? 512 : 256);
  const int warps = threads / 32;
  const int tile_bytes = kTileElements * W2Bytes(call.w2);
  p.grid = props.sm_count;
  const int rows_per_cta = RowsPerCta(call.vocab, p.grid);
  p.tiles_per_cta = rows_per_cta / kTileRows;
  // Kernels of up to 16 columns stage each step's base logits in shared memory (one copy a step,
  // issued before the grid-wide wait), at the price of a few resident W2 tiles. The staging is a
  // template parameter: chosen at run time, the registers that take the staged logits would also take
  // global loads, and every wait on them would wait for the global loads in flight.
  const int esize = ElementBytes(call.base_dtype);
  const int stage_bytes = batch * rows_per_cta * esize;
  const bool stage = nt <= 2 && (call.vocab * esize) % 16 == 0 && stage_bytes <= kMaxStageBytes;
  p.noise_ahead = call.sampling && NoiseFitsAhead(batch, rows_per_cta);
  const bool logits = call.logits_dtype != kNone;
  int form = eregs ? (logits ? kBF16LogitsForm : kPlainForm) : kAnyForm;
  if (cert && !pairs) {  // the certified instances: tokens only, or any other launch (the pairs': any)
    form = call.base_dtype == kBF16 && !logits && !call.sampling ? kPlainForm : kAnyForm;
  } else if (digits) {  // the digit kernel's instances for the known launch forms
    const bool logits_form = call.base_dtype == kBF16 && logits && (!call.sampling || p.noise_ahead);
    if (logits_form && call.logits_dtype == kBF16) {
      form = kBF16LogitsForm;
    } else if (logits_form && call.logits_dtype == kF32) {
      form = kF32LogitsForm;
    } else if (call.base_dtype == kBF16 && !logits && !call.sampling) {
      form = kPlainForm;
    }
  }
  p.noise_tiles = MakesNoiseTiles(nt, split, digits) && call.sampling && !p.noise_ahead && !stage && !eregs;
  // Logits go out 8 rows of a request (16 or 32 bytes) a store where StagesLogits and V % 8 == 0 (so
  // that every store is aligned and a tile's rows past V are whole pieces).
  const bool f32_out = call.logits_dtype == kF32;
  p.logits_staged = StagesLogits(nt, split, digits, f32_out) && logits && call.vocab % 8 == 0 && !eregs;
  const int fixed = WalkFixedBytes(nt, pairs, warps, rows_per_cta, stage ? stage_bytes : 0,
                                 p.noise_ahead ? batch * rows_per_cta * int(sizeof(float)) : 0,
                                 p.noise_tiles ? NoiseTileBytes(batch) : 0,
                                 p.logits_staged ? OutStageBytes(nt, f32_out) : 0, cert ? CertSmem::Bytes(batch) : 0);
  p.resident_tiles = std::min(p.tiles_per_cta, (props.smem_per_block - fixed) / tile_bytes);
  p.smem_bytes = fixed + std::max(p.resident_tiles, 0) * tile_bytes;
  p.threads = threads;
  p.kernel = WalkKernelKey(nt, split, digits, call.w2, threads, stage, form, pairs, eregs, cert);
  return p;
}

// The transposed kernel: int8 W2 (the caller checks), 17-64 requests (above the direct exchange), and
// 9-16 from bf16 base logits where the head gives its tiles (there its tiles' bulk copies make it faster
// than EREGS and the fp16 columns: docs/kernel_design.md section 8); V % 8 == 0 and base
// logits and logits 16-byte aligned (it moves them 16 bytes at a time, 8 rows in bf16 and fp16).
// Logits go out of it only for a bf16 W1: its two int8 digits of e keep 15 bits below e's largest
// element, all the bits of a bf16 element but its smallest ones, while most fp16 and fp32 elements
// lose some (an fp32 W1's logits came out up to 3.3e-5 off the reference, past the tests' 2e-5;
// MarkovWalkKernel's hi + lo columns keep them within it).
bool WalksTransposed(const WalkCall& call, int batch) {
  const bool logits = call.logits_dtype != kNone;
  const bool tiled = call.w2_tiled && call.base_dtype == kBF16;
  const int fewest = tiled ? kTransposedTiledMinBatch : kDirectBatch + 1;
  return batch >= fewest && batch <= kMaxBatch && call.vocab % 8 == 0 && call.base_aligned &&
         (!logits || (call.logits_aligned && call.w1_dtype == kBF16));
}

int TransposedTilesPerCta(int64_t vocab, int grid) {
  const int64_t total_tiles = (vocab + kTransposedTileRows - 1) / kTransposedTileRows;
  return int((total_tiles + grid - 1) / grid);
}

int TransposedFixedBytes(bool packed, int walk, int base, int tiles_per_cta) {
  const int rows = tiles_per_cta * kTransposedTileRows;
  const bool four = TransposedWarpgroups(walk, base) == 4;
  const int cert = walk == kCertifiedWalk ? TransposedCertSmem::kBytes : 0;
  if (packed) return cert + (four ? TransposedSmem<true, false, 4>::FixedBytes(rows) : TransposedSmem<true, false, 3>::FixedBytes(rows));
  if (walk == kRotatedSampledWalk) return TransposedSmem<false, true, 3>::FixedBytes(rows);
  return cert + (four ? TransposedSmem<false, false, 4>::FixedBytes(rows) : TransposedSmem<false, false, 3>::FixedBytes(rows));
}

// Whether a layout's CTA fits at all, judged by the largest fixed part of its walks, so that which
// kernel a launch takes does not depend on whether it samples, on its batch or on its base dtype.
bool TransposedLayoutFits(bool packed, int tiles_per_cta, const DeviceProperties& props) {
  int largest = 0;
  for (int walk : {kPlainWalk, kLogitsWalk, kSampledWalk, kRotatedSampledWalk, kCertifiedWalk}) {
    if (packed && walk == kRotatedSampledWalk) continue;
    for (int base : {kBF16, kF32}) largest = std::max(largest, TransposedFixedBytes(packed, walk, base, tiles_per_cta));
  }
  return largest <= props.smem_per_block;
}

// A launch of the transposed kernel, where it fits (else false).
bool PlanTransposed(const WalkCall& call, int batch, const DeviceProperties& props, LaunchPlan* p) {
  const bool packed = batch <= kPackedMaxBatch;
  p->batch = batch;
  p->grid = props.sm_count;
  p->tiles_per_cta = TransposedTilesPerCta(call.vocab, p->grid);
  if (!TransposedLayoutFits(packed, p->tiles_per_cta, props)) return false;
  const bool rotated = !packed && call.sampling && batch <= kRotatedMaxBatch;
  const int walk = call.certified ? kCertifiedWalk
                   : rotated       ? kRotatedSampledWalk
                   : call.sampling ? kSampledWalk
                   : call.logits_dtype != kNone ? kLogitsWalk
                                                : kPlainWalk;
  const int fixed = TransposedFixedBytes(packed, walk, call.base_dtype, p->tiles_per_cta);
  p->resident_tiles = std::min(p->tiles_per_cta, (props.smem_per_block - fixed) / kTransposedTileBytes);
  p->smem_bytes = fixed + p->resident_tiles * kTransposedTileBytes;
  p->kernel = TransposedKernelKey(call.base_dtype, packed, walk);
  p->threads = p->kernel.threads;
  p->w2_tiled = call.w2_tiled;
  return true;
}

// The launch of `batch` requests: which kernel walks it, by batch range (docs/kernel_design.md).
// Which certified walk takes a CertifiedMarkovHead's call: the digit kernel's 1-2 requests (any
// form); the digit pairs' 3-8 (tokens only, or logits out from a bfloat16 W1, as their plain walk);
// EREGS's 9-16 greedy requests, tokens only, bfloat16 base logits and an even V (its plain walk's own
// conditions); the transposed kernel's 17 to one launch's requests, greedy, tokens only, from bfloat16
// base logits, V a multiple of 8 and the base logits 16-byte aligned (its own conditions).
bool CertifiedDigits(const WalkCall& call) { return call.batch <= kCertDigitBatch; }
bool CertifiedPairs(const WalkCall& call) {
  return call.batch > kCertDigitBatch && call.batch <= 8 && (call.logits_dtype == kNone || call.w1_dtype == kBF16);
}
bool CertifiedEregs(const WalkCall& call) {
  return call.batch > 8 && call.batch <= kCertBatch && !call.sampling && call.logits_dtype == kNone &&
         call.base_dtype == kBF16 && call.vocab % 2 == 0;
}
bool CertifiedTransposed(const WalkCall& call) {
  return call.batch > kCertBatch && call.batch <= LaunchRequests(call.w2, call.w1_dtype) && !call.sampling &&
         call.logits_dtype == kNone && call.base_dtype == kBF16 && call.vocab % 8 == 0 && call.base_aligned;
}

LaunchPlan PlanLaunch(const WalkCall& call, int batch, const DeviceProperties& props) {
  const bool split = ColumnsPerRequest(call.w2, call.w1_dtype) == 2;
  const int columns = split ? 2 * batch : batch;
  const bool logits = call.logits_dtype != kNone;
  // A CertifiedMarkovHead (Unsupported refuses other calls): the digit kernel's, the digit pairs',
  // EREGS's or the transposed kernel's certified walk.
  if (call.certified && CertifiedDigits(call)) return PlanWalkKernel(call, batch, props, 1, false, true, false, false, true);
  if (call.certified && CertifiedPairs(call)) {
    return PlanWalkKernel(call, batch, props, batch <= 4 ? 1 : 2, true, false, true, false, true);
  }
  if (call.certified && CertifiedEregs(call)) return PlanWalkKernel(call, batch, props, 2, false, false, false, true, true);
  if (call.certified) {
    LaunchPlan transposed;
    if (!PlanTransposed(call, batch, props, &transposed)) transposed.resident_tiles = -1;  // Unsupported says so
    return transposed;
  }
  if (call.w2 == kW2Int8) {
    if (batch <= 2) return PlanWalkKernel(call, batch, props, 1, false, true);
    LaunchPlan transposed;
    if (WalksTransposed(call, batch) && PlanTransposed(call, batch, props, &transposed)) return transposed;
    // 3-8 requests on e's digit pairs (int8 tensor cores): tokens only, or logits out from a bf16 W1,
    // whose elements the two digits keep but for the smallest ones. At 9-16, where the pairs' two
    // columns a request take NT = 4, the fp16 path below is faster, but for EREGS's walks.
    if (batch <= 8 && (!logits || call.w1_dtype == kBF16)) return PlanWalkKernel(call, batch, props, batch <= 4 ? 1 : 2, true, false, true);
    // 9-16 requests walked greedily with no logits or bf16 logits out, bf16 base logits and an even V
    // (32-bit loads and stores of row pairs): the digit pairs as e's A operand, in registers (EREGS).
    // Sampled rows take the fp16 columns: EREGS with the noise in its tile loop is slower
    // (docs/kernel_design.md section 12).
    if (batch > 8 && batch <= kDirectBatch && !call.sampling && (!logits || call.logits_dtype == kBF16) &&
        call.base_dtype == kBF16 && call.vocab % 2 == 0) {
      return PlanWalkKernel(call, batch, props, 2, false, false, false, true);
    }
  }
  const int nt = columns <= 8 ? 1 : columns <= 16 ? 2 : columns <= 32 ? 4 : 8;
  return PlanWalkKernel(call, batch, props, nt, split, false);
}

const char* DTypeName(int dtype) { return dtype == kF32 ? "float32" : dtype == kBF16 ? "bfloat16" : "float16"; }

}  // namespace

int ColumnsPerRequest(int w2, int w1_dtype) {
  if (w2 == kW2BF16) return w1_dtype == kBF16 ? 1 : 2;
  return w1_dtype == kF32 ? 2 : 1;
}

int LaunchRequests(int w2, int w1_dtype) { return kMaxBatch / ColumnsPerRequest(w2, w1_dtype); }

std::string Unsupported(const WalkCall& call, const DeviceProperties& props) {
  if (call.w2 != kW2Int8 && call.w2 != kW2F16 && call.w2 != kW2BF16) {
    return "the CUDA kernel walks an int8 (jax_markov.quantize), float16 or bfloat16 W2";
  }
  if (props.major != 9) {
    return "the CUDA kernel needs an sm_90 GPU, this one is sm_" + std::to_string(props.major) + std::to_string(props.minor);
  }
  if (!props.cooperative) return "the GPU does not support cooperative launches";
  if (call.rank != kRank) return "the CUDA kernel needs rank r = " + std::to_string(kRank) + ", got " + std::to_string(call.rank);
  if (call.steps < 1 || call.steps > kMaxSteps) {
    return "the CUDA kernel walks 1 to K = " + std::to_string(kMaxSteps) + " steps, got " + std::to_string(call.steps);
  }
  if (call.batch < 1) return "the CUDA kernel needs B >= 1, got " + std::to_string(call.batch);
  if (call.certified && call.w2 != kW2Int8) return "a CertifiedMarkovHead's w2 must be int8";
  if (call.certified && call.batch <= kCertBatch && props.sm_count > kDirectMaxCtas) {
    return "the certified walk exchanges through one slot per SM, for up to " + std::to_string(kDirectMaxCtas) +
           " SMs; this GPU has " + std::to_string(props.sm_count);
  }
  if (call.certified && !CertifiedDigits(call) && !CertifiedPairs(call) && !CertifiedEregs(call) &&
      !CertifiedTransposed(call)) {
    const bool wide = call.batch > kCertBatch;
    return "the CUDA kernel walks a CertifiedMarkovHead for B <= 8 requests (3-8 with logits out only from a "
           "bfloat16 W1), or 9 to " + std::to_string(LaunchRequests(call.w2, call.w1_dtype)) +
           " greedy ones (no temperatures, no logits out) with bfloat16 base logits and an even V (above " +
           std::to_string(kCertBatch) + ": V a multiple of 8 and the base logits 16-byte aligned), got B = " +
           std::to_string(call.batch) + (call.sampling ? " with temperatures" : "") + (call.logits_dtype != kNone ? " with logits out" : "") +
           (call.w1_dtype != kBF16 ? std::string(" from a ") + DTypeName(call.w1_dtype) + " W1" : "") +
           (call.base_dtype != kBF16 ? std::string(" with ") + DTypeName(call.base_dtype) + " base logits" : "") +
           (call.vocab % 2 != 0 ? " at an odd V" : wide && call.vocab % 8 != 0 ? " at V not a multiple of 8" : "") +
           (wide && !call.base_aligned ? " with base logits not 16-byte aligned" : "");
  }
  const int64_t per_launch = std::min<int64_t>(call.batch, LaunchRequests(call.w2, call.w1_dtype));
  if (per_launch * call.steps * call.vocab >= (int64_t(1) << 32)) {
    return "the CUDA kernel addresses one launch's base logits in 32 bits: " + std::to_string(per_launch) + " requests x K = " +
           std::to_string(call.steps) + " x V = " + std::to_string(call.vocab) + " is not below 2^32";
  }
  for (const LaunchPlan& p : PlanCall(call, props)) {
    if (p.resident_tiles < 0) return "the CUDA kernel's shared memory for this walk does not fit the GPU's " + std::to_string(props.smem_per_block) + " bytes a block";
  }
  return "";
}

std::string SlowerThanReference(const WalkCall& call, const DeviceProperties& props) {
  if (call.w2 != kW2Int8) return "";
  // int8 W2 that the chip does not hold streams from L2 every step, and is fast only while it stays
  // there. (A float W2 streams from L2 and HBM each step, still well ahead of the reference, which
  // reads all of it each step.)
  const int64_t columns = std::min<int64_t>(kMaxBatch, call.batch * ColumnsPerRequest(call.w2, call.w1_dtype));
  int frag_tiles = 1;  // B fragments: 4 KB per 8 columns, in powers of two
  while (frag_tiles * 8 < columns) frag_tiles *= 2;
  const int64_t shared_bytes = int64_t(props.sm_count) * (props.smem_per_block - 4096 * (frag_tiles + 1));
  const int64_t streamed = call.vocab * kRank - shared_bytes;
  if (streamed > 0.75 * props.l2_bytes) {
    return "V = " + std::to_string(call.vocab) + ": " + std::to_string(streamed >> 20) +
           " MiB of int8 W2 would not fit in shared memory and would not stay in this GPU's " +
           std::to_string(props.l2_bytes >> 20) + " MiB L2";
  }
  return "";
}

std::vector<LaunchPlan> PlanCall(const WalkCall& call, const DeviceProperties& props) {
  std::vector<LaunchPlan> plans;
  const int chunk = LaunchRequests(call.w2, call.w1_dtype);
  WalkCall greedy_call = call;
  greedy_call.sampling = false;
  WalkCall plain_call = call;
  plain_call.certified = false;
  for (int64_t first = 0; first < call.batch; first += chunk) {
    const int batch = int(std::min<int64_t>(chunk, call.batch - first));
    LaunchPlan p = PlanLaunch(call, batch, props);
    p.first = int(first);
    p.sampling = call.sampling;
    if (call.sampling) {
      LaunchPlan greedy = PlanLaunch(greedy_call, batch, props);
      const bool guarded = !(greedy.kernel == p.kernel) || greedy.resident_tiles != p.resident_tiles;
      if (guarded) {
        greedy.first = p.first;
        greedy.run_when = kNoRowSamples;
        plans.push_back(greedy);
        p.run_when = kSomeRowSamples;
      }
      if (call.certified) {  // a batch whose rows all sample takes the plain sampled walk
        LaunchPlan plain = PlanLaunch(plain_call, batch, props);
        plain.first = p.first;
        plain.sampling = true;
        plain.run_when = kAllSampled;
        p.run_when = guarded ? int(kMixedRows) : int(kSomeRowGreedy);
        plans.push_back(p);
        plans.push_back(plain);
        continue;
      }
    }
    plans.push_back(p);
  }
  return plans;
}

std::vector<int32_t> W2TileOrder() {
  std::vector<int32_t> order(kTransposedTileBytes, -1);
  for (int n = 0; n < kTransposedTileRows; ++n) {
    for (int k = 0; k < kRank; ++k) order[TransposedOffset(n, k)] = TileRow(n) * kRank + k;
  }
  return order;
}

std::vector<KernelKey> InstantiatedKernels() {
  std::vector<KernelKey> keys;
#define JAX_MARKOV_WALK_KEY(NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT) \
  keys.push_back(WalkKernelKey(NT, SPLIT, DIGITS, W2, THREADS, STAGED, FORM, PAIRS, EREGS, CERT));
#define JAX_MARKOV_TRANSPOSED_KEY(BASE, PACKED, WALK) keys.push_back(TransposedKernelKey(BASE, PACKED, WALK));
  JAX_MARKOV_INT8_WALK_KERNELS(JAX_MARKOV_WALK_KEY)
  JAX_MARKOV_CERTIFIED_WALK_KERNELS(JAX_MARKOV_WALK_KEY)
  JAX_MARKOV_F16_WALK_KERNELS(JAX_MARKOV_WALK_KEY)
  JAX_MARKOV_BF16_WALK_KERNELS(JAX_MARKOV_WALK_KEY)
  JAX_MARKOV_TRANSPOSED_KERNELS(JAX_MARKOV_TRANSPOSED_KEY)
#undef JAX_MARKOV_WALK_KEY
#undef JAX_MARKOV_TRANSPOSED_KEY
  return keys;
}

std::string KernelName(const KernelKey& k) {
  const char* w2 = k.w2 == kW2Int8 ? "int8" : k.w2 == kW2F16 ? "f16" : "bf16";
  if (k.family == kTransposedFamily) {
    static const char* walks[] = {"plain", "logits", "sampled", "rotated_sampled", "certified"};
    return std::string("transposed<base=") + DTypeName(k.base) + (k.packed ? ",packed" : "") + "," + walks[k.walk] + ">";
  }
  static const char* forms[] = {"any", "bf16_logits", "plain", "f32_logits"};
  return "walk<nt=" + std::to_string(k.nt) + (k.split ? ",split" : "") + (k.digits ? ",digits" : "") + (k.pairs ? ",pairs" : "") +
         (k.eregs ? ",eregs" : "") + (k.cert ? ",certified" : "") + ",w2=" + w2 + ",threads=" + std::to_string(k.threads) + (k.staged ? ",staged" : "") +
         ",form=" + forms[k.form] + ">";
}

}  // namespace walk
}  // namespace jax_markov
