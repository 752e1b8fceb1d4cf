// The FFI handler of the CUDA walk: checks the buffers, keeps a zeroed workspace per stream, takes
// scratch for the Gumbel noise of large sampled batches, and walks the batch in launches of up to
// kMaxBatch columns (the kernel: walk_kernel.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/markov_walk_cuda.h"
#include "cuda/walk_launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_markov {
namespace walk {
namespace {

struct Workspace {
  unsigned long long* slots = nullptr;
  unsigned int* counters = nullptr;
};

// One zeroed workspace per (device, stream): kernels on one stream run in order, and each call
// leaves it zeroed. Allocated once and kept for the life of the process.
cudaError_t GetWorkspace(int device, cudaStream_t stream, Workspace* out) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Workspace> workspaces;
  std::lock_guard<std::mutex> lock(mu);
  auto it = workspaces.find({device, stream});
  if (it != workspaces.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  const size_t slot_bytes = sizeof(unsigned long long) * kSlotWords;
  void* mem = nullptr;
  cudaError_t err = cudaMalloc(&mem, slot_bytes + 2 * sizeof(unsigned int));
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(mem, 0, slot_bytes + 2 * sizeof(unsigned int), stream);
  if (err != cudaSuccess) return err;
  Workspace ws{static_cast<unsigned long long*>(mem), reinterpret_cast<unsigned int*>(static_cast<char*>(mem) + slot_bytes)};
  workspaces[{device, stream}] = ws;
  *out = ws;
  return cudaSuccess;
}

#ifdef JAX_MARKOV_TIMELINE
// Timeline builds: the stamps of the latest launch (ReadTimeline copies them out).
std::mutex timeline_mu;
unsigned long long* timeline_buffer = nullptr;
int timeline_ctas = 0;

size_t TimelineWords(int ctas) { return size_t(ctas) * ((kMaxSteps + 1) * kPhases + kMaxSteps * kMaxWarps); }

cudaError_t TimelineBuffer(int ctas, unsigned long long** out) {
  std::lock_guard<std::mutex> lock(timeline_mu);
  if (timeline_buffer == nullptr) {
    const cudaError_t err = cudaMalloc(&timeline_buffer, TimelineWords(ctas) * sizeof(unsigned long long));
    if (err != cudaSuccess) return err;
    timeline_ctas = ctas;
  }
  *out = timeline_buffer;
  return cudaSuccess;
}
#endif

// Whether a sampled call whose widest launch walks `widest` requests gets scratch for MarkovWalkNoise:
// where that launch's noise does not fit in shared memory (FillNoise), from kNoisePassRequests on.
bool WantsNoiseBuffer(bool sampling, int widest, int vocab, int sm_count) {
  return sampling && widest >= kNoisePassRequests && !NoiseFitsAhead(widest, RowsPerCta(vocab, sm_count));
}

int DTypeCode(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kF32;
    case ffi::DataType::BF16: return kBF16;
    case ffi::DataType::F16: return kF16;
    default: return kNone;
  }
}

ffi::Error MarkovWalkCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer base, ffi::Buffer<ffi::S32> anchor, ffi::AnyBuffer w1,
                              ffi::AnyBuffer w2, ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> temperature,
                              ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> d2t,
                              ffi::Result<ffi::Buffer<ffi::S32>> tokens, ffi::Result<ffi::AnyBuffer> logits,
                              ffi::Result<ffi::AnyBuffer> embeds, int64_t vocab_size, float logit_scale, bool sampling) {
  const auto bd = base.dimensions();
  const auto w1d = w1.dimensions();
  const auto w2d = w2.dimensions();
  if (bd.size() != 3) return Invalid("base_logits must be [B, K, V]");
  const int64_t batch = bd[0], steps = bd[1], vocab = bd[2];
  if (w1d.size() != 2 || w2d.size() != 2) return Invalid("w1 and w2 must be rank 2");
  if (w1d[1] != kRank || w2d[1] != kRank) return Invalid("the CUDA kernel needs rank r = 256");
  if (w2d[0] != vocab) return Invalid("w2 rows must equal V");
  const ffi::DataType w2_type = w2.element_type();
  if (w2_type != ffi::DataType::S8 && w2_type != ffi::DataType::F16 && w2_type != ffi::DataType::BF16) {
    return Invalid("the CUDA kernel walks an int8 (jax_markov.quantize), fp16 or bf16 W2");
  }
  const bool int8 = w2_type == ffi::DataType::S8;
  if (w2_scale.element_count() != (int8 ? vocab : 0)) return Invalid("w2_scale must be [V] for an int8 W2, [0] otherwise");
  if (steps < 1 || steps > kMaxSteps) return Invalid("K must be in [1, 16]");
  const int base_dtype = DTypeCode(base.element_type()), w1_dtype = DTypeCode(w1.element_type());
  if (base_dtype == kNone || w1_dtype == kNone) return Invalid("base_logits and w1 must be f32, bf16 or f16");
  // A request takes two B columns (hi + lo) where the MMA's format holds fewer bits than W1: fp16
  // MMAs (int8 and fp16 W2) split fp32 W1, bf16 MMAs split fp32 and fp16 W1.
  const bool split = w2_type == ffi::DataType::BF16 ? w1_dtype != kBF16 : w1_dtype == kF32;
  if (batch < 1) return Invalid("B must be at least 1");
  if (anchor.element_count() != batch || temperature.element_count() != batch || position.element_count() != batch ||
      key.element_count() != 2 * batch) {
    return Invalid("anchor, temperature, key and position must have B requests");
  }
  if (d2t.element_count() != 0 && d2t.element_count() != vocab) return Invalid("d2t must be [V] or empty");
  if (vocab_size < 1 || vocab_size > vocab) return Invalid("vocab_size must be in [1, V]");
  if (tokens->element_count() != batch * steps) return Invalid("tokens must be [B, K]");
  const bool want_logits = logits->element_count() != 0;
  if (want_logits && logits->element_count() != batch * steps * vocab) return Invalid("logits must be [B, K, V] or empty");
  const int logits_dtype = DTypeCode(logits->element_type());
  if (logits_dtype == kNone) return Invalid("logits must be f32, bf16 or f16");
  const bool want_embeds = embeds->element_count() != 0;
  if (want_embeds && (embeds->element_count() != batch * steps * kRank || embeds->element_type() != w1.element_type())) {
    return Invalid("embeds must be [B, K, 256] in w1's dtype or empty");
  }

  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaError("cudaGetDevice", err);
  DeviceProperties props;
  err = QueryDeviceProperties(device, &props);
  if (err != cudaSuccess) return CudaError("device properties", err);
  if (props.major != 9) return Invalid("the CUDA kernel needs an sm_90 GPU");
  if (!props.cooperative) return Invalid("the GPU does not support cooperative launches");
  Workspace ws;
  err = GetWorkspace(device, stream, &ws);
  if (err != cudaSuccess) return CudaError("workspace", err);

  WalkArgs args{};
  args.base = base.untyped_data();
  args.anchor = anchor.typed_data();
  args.w1 = w1.untyped_data();
  args.w2 = w2.untyped_data();
  args.scale = int8 ? w2_scale.typed_data() : nullptr;
  args.temperature = temperature.typed_data();
  args.key = key.typed_data();
  args.position = position.typed_data();
  args.d2t = d2t.element_count() ? d2t.typed_data() : nullptr;
  args.tokens = tokens->typed_data();
  args.logits = want_logits ? logits->untyped_data() : nullptr;
  args.embeds = want_embeds ? embeds->untyped_data() : nullptr;
  args.slots = ws.slots;
  args.counters = ws.counters;
  args.steps = int(steps);
  args.vocab = int(vocab);
  args.v_target = int(w1d[0]);
  args.vocab_size = int(vocab_size);
  args.base_dtype = base_dtype;
  args.w1_dtype = w1_dtype;
  // Logits not asked for are never rounded: the walk chooses from the fp32 l_k.
  args.logits_dtype = want_logits ? logits_dtype : kF32;
  args.logit_scale = logit_scale;
  args.sampling = sampling;
#ifdef JAX_MARKOV_TIMELINE
  err = TimelineBuffer(props.sm_count, &args.timeline);
  if (err != cudaSuccess) return CudaError("timeline", err);
#endif
  // Requests are independent walks: a batch wider than one launch's kMaxBatch columns walks in
  // chunks, one launch each, in order on the stream (each leaves the workspace zeroed).
  const int64_t chunk = split ? kMaxBatch / 2 : kMaxBatch;
  const int base_esize = base_dtype == kF32 ? 4 : 2, w1_esize = w1_dtype == kF32 ? 4 : 2;
  const int logits_esize = logits_dtype == kF32 ? 4 : 2;
  const auto Part = [&](int64_t b0) {
    WalkArgs part = args;
    part.batch = int(std::min(chunk, batch - b0));
    part.base = static_cast<const char*>(args.base) + b0 * steps * vocab * base_esize;
    part.anchor = args.anchor + b0;
    part.temperature = args.temperature + b0;
    part.key = args.key + 2 * b0;
    part.position = args.position + b0;
    part.tokens = args.tokens + b0 * steps;
    if (want_logits) part.logits = static_cast<char*>(args.logits) + b0 * steps * vocab * logits_esize;
    if (want_embeds) part.embeds = static_cast<char*>(args.embeds) + b0 * steps * kRank * w1_esize;
    return part;
  };
  // Sampled launches of MarkovWalkKernel get their noise from MarkovWalkNoise where WantsNoiseBuffer,
  // in scratch that XLA lends for this call ([K, ceil(V / 16), widest such launch, 16] floats, reused
  // by every launch in stream order); the transposed kernel makes its own. Without it (the allocation
  // failed) MarkovWalkKernel computes the noise itself, slower.
  int64_t widest = 0;
  for (int64_t b0 = 0; b0 < batch; b0 += chunk) {
    const WalkArgs part = Part(b0);
    if (!(int8 && TakesTransposed(part, props))) widest = std::max<int64_t>(widest, part.batch);
  }
  float* noise_buffer = nullptr;
  if (WantsNoiseBuffer(sampling, int(widest), int(vocab), props.sm_count)) {
    const size_t tiles = (vocab + kTileRows - 1) / kTileRows;
    const std::optional<void*> mem = scratch.Allocate(size_t(widest) * steps * tiles * kTileRows * sizeof(float), 16);
    if (mem.has_value()) noise_buffer = static_cast<float*>(*mem);
  }
  for (int64_t b0 = 0; b0 < batch; b0 += chunk) {
    const WalkArgs part = Part(b0);
    const int columns = split ? 2 * part.batch : part.batch;
    const ffi::Error err =
        int8 ? LaunchForColumns<kW2Int8>(split, columns, stream, device, props, part, noise_buffer)
             : (w2_type == ffi::DataType::F16
                    ? LaunchForColumns<kW2F16>(split, columns, stream, device, props, part, noise_buffer)
                    : LaunchForColumns<kW2BF16>(split, columns, stream, device, props, part, noise_buffer));
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace walk

bool LaunchTakesTransposed(int batch, int vocab, const std::string& w1_dtype, bool logits_out, const DeviceProperties& props) {
  walk::WalkArgs args{};
  args.batch = batch;
  args.vocab = vocab;
  if (w1_dtype == "float32") {
    args.w1_dtype = walk::kF32;
  } else if (w1_dtype == "bfloat16") {
    args.w1_dtype = walk::kBF16;
  } else if (w1_dtype == "float16") {
    args.w1_dtype = walk::kF16;
  } else {
    throw std::invalid_argument("w1_dtype must be float32, bfloat16 or float16, got " + w1_dtype);
  }
  // Only whether logits go out matters (any pointer); base logits and logits are taken as aligned, as
  // XLA allocates them (nullptr is; so is this 16-byte aligned stand-in).
  alignas(16) static char logits_sentinel = 0;
  args.logits = logits_out ? &logits_sentinel : nullptr;
  return walk::TakesTransposed(args, props);
}

#ifdef JAX_MARKOV_TIMELINE
cudaError_t ReadTimeline(std::vector<unsigned long long>* out, int* ctas) {
  std::lock_guard<std::mutex> lock(walk::timeline_mu);
  *ctas = walk::timeline_ctas;
  out->assign(walk::TimelineWords(walk::timeline_ctas), 0);
  if (walk::timeline_buffer == nullptr) return cudaSuccess;
  return cudaMemcpy(out->data(), walk::timeline_buffer, out->size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
}
#endif

cudaError_t QueryDeviceProperties(int device, DeviceProperties* out) {
  static std::mutex mu;
  static std::map<int, DeviceProperties> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  DeviceProperties p;
  int cooperative = 0;
  cudaError_t err;
  if ((err = cudaDeviceGetAttribute(&p.sm_count, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&p.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&p.l2_bytes, cudaDevAttrL2CacheSize, device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&p.major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&p.minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device)) != cudaSuccess) return err;
  p.cooperative = cooperative != 0;
  cache[device] = p;
  *out = p;
  return cudaSuccess;
}

}  // namespace jax_markov

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarkovWalkCuda, jax_markov::walk::MarkovWalkCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()           // base_logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // anchor
                                  .Arg<ffi::AnyBuffer>()           // w1
                                  .Arg<ffi::AnyBuffer>()           // w2
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w2_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()    // temperature
                                  .Arg<ffi::Buffer<ffi::U32>>()    // key
                                  .Arg<ffi::Buffer<ffi::S32>>()    // position
                                  .Arg<ffi::Buffer<ffi::S32>>()    // d2t
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens
                                  .Ret<ffi::AnyBuffer>()           // logits
                                  .Ret<ffi::AnyBuffer>()           // embeds
                                  .Attr<int64_t>("vocab_size")
                                  .Attr<float>("logit_scale")
                                  .Attr<bool>("sampling"));
