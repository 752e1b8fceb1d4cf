// The FFI handler of the CUDA walk: checks the buffers against the operand contract (ffi/README.md),
// asks the launch plan (ffi/plan/) whether and how the kernels walk the call, keeps a zeroed workspace
// per stream for the grid-wide exchange, and executes the plan's launches in order on the stream.
// Compatible with XLA's command buffers: a call enqueues only its kernels, and the first call on a
// stream, which allocates the workspace, does so outside any graph capture.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/handler.h"
#include "cuda/kernels.h"
#include "cuda/walk/args.cuh"
#include "plan/walk_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_markov {
namespace walk {
namespace {

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_markov CUDA walk: ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error Invalid(const std::string& msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_markov CUDA walk: " + msg); }

// Runs `f` with this thread's stream capture mode relaxed, so that the one-time allocations and kernel
// attributes below are allowed while XLA captures a command buffer on this thread (they are not
// captured: they happen once, when the call is recorded).
template <typename F>
cudaError_t OutsideCapture(F f) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) return err;
  const cudaError_t result = f();
  err = cudaThreadExchangeStreamCaptureMode(&mode);
  return result != cudaSuccess ? result : err;
}

struct Workspace {
  unsigned long long* slots = nullptr;
  unsigned int* counters = nullptr;
};

// One zeroed workspace per (device, stream): kernels on one stream run in order, and each call leaves
// it zeroed. Allocated and zeroed once (on a stream of its own, waited for) and kept for the life of
// the process.
cudaError_t GetWorkspace(int device, cudaStream_t stream, Workspace* out) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Workspace> workspaces;
  std::lock_guard<std::mutex> lock(mu);
  auto it = workspaces.find({device, stream});
  if (it != workspaces.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  const size_t slot_bytes = sizeof(unsigned long long) * kWorkspaceWords, bytes = slot_bytes + 2 * sizeof(unsigned int);
  void* mem = nullptr;
  const cudaError_t err = OutsideCapture([&] {
    cudaStream_t zeroing;
    cudaError_t e = cudaMalloc(&mem, bytes);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
    if (e != cudaSuccess) return e;
    e = cudaMemsetAsync(mem, 0, bytes, zeroing);
    const cudaError_t synced = cudaStreamSynchronize(zeroing);
    const cudaError_t destroyed = cudaStreamDestroy(zeroing);
    return e != cudaSuccess ? e : synced != cudaSuccess ? synced : destroyed;
  });
  if (err != cudaSuccess) return err;
  Workspace ws{static_cast<unsigned long long*>(mem), reinterpret_cast<unsigned int*>(static_cast<char*>(mem) + slot_bytes)};
  workspaces[{device, stream}] = ws;
  *out = ws;
  return cudaSuccess;
}

// Raises a kernel's shared-memory limit to the device maximum and checks that one CTA of `threads`
// fits per SM, once per kernel and device: these calls cost host time on every launch otherwise.
cudaError_t PrepareOnce(const void* kernel, int device, int threads, const DeviceProperties& props) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, cudaError_t> prepared;
  std::lock_guard<std::mutex> lock(mu);
  auto it = prepared.find({kernel, device});
  if (it == prepared.end()) {
    const cudaError_t err = OutsideCapture([&] {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, props.smem_per_block);
      int per_sm = 0;
      if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, props.smem_per_block);
      return e == cudaSuccess && per_sm < 1 ? cudaErrorCooperativeLaunchTooLarge : e;
    });
    it = prepared.emplace(std::make_pair(kernel, device), err).first;
  }
  return it->second;
}

// The certified walks' counters (walk_config.h's CertStat), one buffer a device, allocated when a
// test asks for them (EnableCertifiedStats); a launch adds to them only where they exist.
std::mutex cert_stats_mu;
std::map<int, unsigned long long*> cert_stats;

unsigned long long* CertifiedStatsBuffer(int device) {
  std::lock_guard<std::mutex> lock(cert_stats_mu);
  auto it = cert_stats.find(device);
  return it == cert_stats.end() ? nullptr : it->second;
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

int DTypeCode(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kF32;
    case ffi::DataType::BF16: return kBF16;
    case ffi::DataType::F16: return kF16;
    default: return kNone;
  }
}

int W2Code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S8: return kW2Int8;
    case ffi::DataType::F16: return kW2F16;
    case ffi::DataType::BF16: return kW2BF16;
    default: return -1;
  }
}

ffi::Error MarkovWalkCudaImpl(cudaStream_t stream, ffi::AnyBuffer base, ffi::Buffer<ffi::S32> anchor, ffi::AnyBuffer w1,
                              ffi::AnyBuffer w2, ffi::Buffer<ffi::F32> w2_scale, ffi::Buffer<ffi::F32> temperature,
                              ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> d2t,
                              ffi::AnyBuffer w2_tiles, ffi::RemainingArgs certificate, ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                              ffi::Result<ffi::AnyBuffer> logits, ffi::Result<ffi::AnyBuffer> embeds, int64_t vocab_size,
                              float logit_scale, bool sampling) {
  const auto bd = base.dimensions();
  const auto w1d = w1.dimensions();
  const auto w2d = w2.dimensions();
  if (bd.size() != 3) return Invalid("base_logits must be [B, K, V]");
  if (w1d.size() != 2 || w2d.size() != 2) return Invalid("w1 and w2 must be rank 2");
  const int64_t batch = bd[0], steps = bd[1], vocab = bd[2];
  if (w2d[0] != vocab || w1d[1] != w2d[1]) return Invalid("w2 must be [V, r] and w1 [V_target, r]");
  WalkCall call;
  call.batch = batch;
  call.steps = steps;
  call.vocab = vocab;
  call.rank = w2d[1];
  call.w2 = W2Code(w2.element_type());
  call.w1_dtype = DTypeCode(w1.element_type());
  call.base_dtype = DTypeCode(base.element_type());
  const bool want_logits = logits->element_count() != 0, want_embeds = embeds->element_count() != 0;
  call.logits_dtype = want_logits ? DTypeCode(logits->element_type()) : kNone;
  call.sampling = sampling;
  call.base_aligned = reinterpret_cast<uintptr_t>(base.untyped_data()) % 16 == 0;
  call.logits_aligned = reinterpret_cast<uintptr_t>(logits->untyped_data()) % 16 == 0;
  if (call.base_dtype == kNone || call.w1_dtype == kNone) return Invalid("base_logits and w1 must be f32, bf16 or f16");
  if (want_logits && call.logits_dtype == kNone) return Invalid("logits must be f32, bf16 or f16");
  const bool int8 = call.w2 == kW2Int8;
  if (w2_scale.element_count() != (int8 ? vocab : 0)) return Invalid("w2_scale must be [V] for an int8 W2, [0] otherwise");
  if (anchor.element_count() != batch || temperature.element_count() != batch || position.element_count() != batch ||
      key.element_count() != 2 * batch) {
    return Invalid("anchor, temperature, key and position must have B requests");
  }
  if (d2t.element_count() != 0 && d2t.element_count() != vocab) return Invalid("d2t must be [V] or empty");
  // W2 stored tile by tile (QuantizedMarkovHead.tiles), or empty. Bulk copies read it 16 bytes aligned.
  if (w2_tiles.element_count() != 0) {
    const auto td = w2_tiles.dimensions();
    const int64_t tiles = (vocab + kTransposedTileRows - 1) / kTransposedTileRows;
    if (!int8 || w2_tiles.element_type() != ffi::DataType::S8 || td.size() != 2 || td[0] != tiles || td[1] != kTransposedTileBytes) {
      return Invalid("w2_tiles must be s8 [ceil(V / " + std::to_string(kTransposedTileRows) + "), " +
                     std::to_string(kTransposedTileBytes) + "] beside an s8 w2, or empty");
    }
    call.w2_tiled = reinterpret_cast<uintptr_t>(w2_tiles.untyped_data()) % 16 == 0;
  }
  // A CertifiedMarkovHead adds two operands: the unquantized W2 and its rows' residual norms.
  if (certificate.size() != 0 && certificate.size() != 2) {
    return Invalid("expected 10 operands, or 12 with a CertifiedMarkovHead's w2_exact and residual_norm, got " +
                   std::to_string(10 + certificate.size()));
  }
  call.certified = certificate.size() == 2;
  const void* w2_exact_data = nullptr;
  const float* residual_norm_data = nullptr;
  int w2_exact_dtype = kNone;
  if (call.certified) {
    const auto w2_exact = certificate.get<ffi::AnyBuffer>(0);
    const auto residual_norm = certificate.get<ffi::AnyBuffer>(1);
    if (!w2_exact.has_value() || !residual_norm.has_value()) return Invalid("w2_exact and residual_norm must be buffers");
    const auto ed = w2_exact->dimensions();
    w2_exact_dtype = DTypeCode(w2_exact->element_type());
    if (!int8 || w2_exact_dtype == kNone || ed.size() != 2 || ed[0] != vocab || ed[1] != w2d[1]) {
      return Invalid("w2_exact must be the unquantized W2, bf16/f16/f32 [V, r], beside an s8 w2");
    }
    if (residual_norm->element_type() != ffi::DataType::F32 || residual_norm->element_count() != vocab ||
        residual_norm->dimensions().size() != 1) {
      return Invalid("residual_norm must be f32 [V]");
    }
    w2_exact_data = w2_exact->untyped_data();
    residual_norm_data = static_cast<const float*>(residual_norm->untyped_data());
  }
  if (vocab_size < 1 || vocab_size > vocab) return Invalid("vocab_size must be in [1, V]");
  if (tokens->element_count() != batch * steps) return Invalid("tokens must be [B, K]");
  if (want_logits && logits->element_count() != batch * steps * vocab) return Invalid("logits must be [B, K, V] or empty");
  if (want_embeds && (embeds->element_count() != batch * steps * w1d[1] || embeds->element_type() != w1.element_type())) {
    return Invalid("embeds must be [B, K, r] in w1's dtype or empty");
  }

  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaError("cudaGetDevice", err);
  DeviceProperties props;
  err = QueryDeviceProperties(device, &props);
  if (err != cudaSuccess) return CudaError("device properties", err);
  const std::string unsupported = Unsupported(call, props);
  if (!unsupported.empty()) return Invalid(unsupported);
  Workspace ws;
  err = GetWorkspace(device, stream, &ws);
  if (err != cudaSuccess) return CudaError("workspace", err);

  WalkArgs args{};
  args.w1 = w1.untyped_data();
  args.w2 = w2.untyped_data();
  args.scale = int8 ? w2_scale.typed_data() : nullptr;
  args.d2t = d2t.element_count() ? d2t.typed_data() : nullptr;
  args.slots = ws.slots;
  args.counters = ws.counters;
  args.steps = int(steps);
  args.vocab = int(vocab);
  args.v_target = int(w1d[0]);
  args.vocab_size = int(vocab_size);
  args.base_dtype = call.base_dtype;
  args.w1_dtype = call.w1_dtype;
  // Logits not asked for are never rounded: the walk chooses from the fp32 l_k.
  args.logits_dtype = want_logits ? call.logits_dtype : kF32;
  args.logit_scale = logit_scale;
  args.w2_exact = w2_exact_data;
  args.w2_exact_dtype = w2_exact_dtype;
  args.residual_norm = residual_norm_data;
  args.cert_stats = call.certified ? CertifiedStatsBuffer(device) : nullptr;
#ifdef JAX_MARKOV_TIMELINE
  err = TimelineBuffer(props.sm_count, &args.timeline);
  if (err != cudaSuccess) return CudaError("timeline", err);
#endif
  // Requests are independent walks: each launch walks its own run of them, in order on the stream
  // (each leaves the workspace zeroed).
  const int64_t base_row = steps * vocab * ElementBytes(call.base_dtype), logits_row = steps * vocab * ElementBytes(args.logits_dtype);
  const int64_t embeds_row = steps * w1d[1] * ElementBytes(call.w1_dtype);
  for (const LaunchPlan& p : PlanCall(call, props)) {
    WalkArgs part = args;
    part.batch = p.batch;
    part.base = static_cast<const char*>(base.untyped_data()) + p.first * base_row;
    part.anchor = anchor.typed_data() + p.first;
    part.temperature = temperature.typed_data() + p.first;
    part.key = key.typed_data() + 2 * p.first;
    part.position = position.typed_data() + p.first;
    part.tokens = tokens->typed_data() + p.first * steps;
    part.logits = want_logits ? static_cast<char*>(logits->untyped_data()) + p.first * logits_row : nullptr;
    part.embeds = want_embeds ? static_cast<char*>(embeds->untyped_data()) + p.first * embeds_row : nullptr;
    part.tiles_per_cta = p.tiles_per_cta;
    part.resident_tiles = p.resident_tiles;
    part.noise_ahead = p.noise_ahead;
    part.noise_tiles = p.noise_tiles;
    part.logits_staged = p.logits_staged;
    part.sampling = p.sampling;
    part.run_when = p.run_when;
    part.w2_tiles = p.w2_tiled ? static_cast<const int8_t*>(w2_tiles.untyped_data()) : nullptr;
    const void* kernel = KernelFunction(p.kernel);
    if (kernel == nullptr) {
      return ffi::Error(ffi::ErrorCode::kInternal, "jax_markov CUDA walk: the plan names a kernel the build does not instantiate: " +
                                                       KernelName(p.kernel));
    }
    err = PrepareOnce(kernel, device, p.threads, props);
    if (err != cudaSuccess) return CudaError(("preparing " + KernelName(p.kernel)).c_str(), err);
    void* params[] = {&part};
    err = cudaLaunchCooperativeKernel(kernel, dim3(p.grid), dim3(p.threads), params, p.smem_bytes, stream);
    if (err != cudaSuccess) return CudaError(("launching " + KernelName(p.kernel)).c_str(), err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace walk

#ifdef JAX_MARKOV_TIMELINE
cudaError_t ReadTimeline(std::vector<unsigned long long>* out, int* ctas) {
  std::lock_guard<std::mutex> lock(walk::timeline_mu);
  *ctas = walk::timeline_ctas;
  out->assign(walk::TimelineWords(walk::timeline_ctas), 0);
  if (walk::timeline_buffer == nullptr) return cudaSuccess;
  return cudaMemcpy(out->data(), walk::timeline_buffer, out->size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
}
#endif

cudaError_t EnableCertifiedStats(int device) {
  std::lock_guard<std::mutex> lock(walk::cert_stats_mu);
  if (walk::cert_stats.count(device) != 0) return cudaSuccess;
  int current = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  void* mem = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&mem, walk::kCertStats * sizeof(unsigned long long));
  if (err == cudaSuccess) err = cudaMemset(mem, 0, walk::kCertStats * sizeof(unsigned long long));
  // cudaMemset may return before the zeros land, and XLA's streams do not wait for the legacy stream.
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  const cudaError_t restored = cudaSetDevice(current);
  if (err != cudaSuccess) return err;
  walk::cert_stats[device] = static_cast<unsigned long long*>(mem);
  return restored;
}

cudaError_t CertifiedStats(int device, bool reset, std::vector<unsigned long long>* out) {
  out->assign(walk::kCertStats, 0);
  unsigned long long* buffer = walk::CertifiedStatsBuffer(device);
  if (buffer == nullptr) return cudaSuccess;
  int current = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  const size_t bytes = out->size() * sizeof(unsigned long long);
  if (err == cudaSuccess) err = cudaMemcpy(out->data(), buffer, bytes, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && reset) err = cudaMemset(buffer, 0, bytes);
  if (err == cudaSuccess && reset) err = cudaDeviceSynchronize();  // before the next walk's counts
  const cudaError_t restored = cudaSetDevice(current);
  return err != cudaSuccess ? err : restored;
}

cudaError_t QueryDeviceProperties(int device, walk::DeviceProperties* out) {
  static std::mutex mu;
  static std::map<int, walk::DeviceProperties> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  walk::DeviceProperties p;
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
                                  .Arg<ffi::AnyBuffer>()           // base_logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // anchor
                                  .Arg<ffi::AnyBuffer>()           // w1
                                  .Arg<ffi::AnyBuffer>()           // w2
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w2_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()    // temperature
                                  .Arg<ffi::Buffer<ffi::U32>>()    // key
                                  .Arg<ffi::Buffer<ffi::S32>>()    // position
                                  .Arg<ffi::Buffer<ffi::S32>>()    // d2t
                                  .Arg<ffi::AnyBuffer>()           // w2_tiles
                                  .RemainingArgs()                 // w2_exact, residual_norm: a CertifiedMarkovHead's
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens
                                  .Ret<ffi::AnyBuffer>()           // logits
                                  .Ret<ffi::AnyBuffer>()           // embeds
                                  .Attr<int64_t>("vocab_size")
                                  .Attr<float>("logit_scale")
                                  .Attr<bool>("sampling"),
                              {ffi::Traits::kCmdBufferCompatible});
