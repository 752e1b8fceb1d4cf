// The CPU custom call `jax_markov_walk`: the DSpark Markov walk of docs/spec.md, exactly as
// jax_markov/reference.py computes it, fused into one pass over W2 per draft step.
//
// Per step k:
//   1. the caller thread gathers e_b = W1[clamp(prev_b)] for every request into an fp32 buffer E
//      (and writes the embeds);
//   2. the vocabulary is cut into chunks of rows that XLA's intra-op thread pool and the caller
//      thread take from a shared counter. A chunk converts its W2 rows to fp32 once, 8 rows at a
//      time (int8 -> fp32, or bf16/f16/f32 -> fp32), and takes the dot of each converted row with
//      every request's e (rows outer, requests inner: W2 is read once per step for the whole
//      batch). Then, per request: l = fp32(base) + logit_scale * (scale[v] * dot) (or
//      logit_scale * dot for a float head), rounded to the logits dtype, stored, and the chunk's
//      best PackArgmaxKey(score, v) is kept in its own slot;
//   3. the caller waits for every chunk (a counter and a condition variable; pool tasks never wait
//      on anything), merges the chunk keys and sets prev = token (+ d2t[token]).
// Sampled rows draw the Gumbel noise 8 columns at a time (two Philox blocks and the logs in AVX2
// registers), only for columns that could still win. Walks with little work per step stay on the
// calling thread.
//
// A CertifiedMarkovHead (int8 W2 plus the unquantized W2 and its rows' residual norms, operands 10
// and 11, given only for such a head) walks as an int8 head, except that a greedy request's chunk keeps, instead of its best int8
// key, the best exact key among the columns that its int8 logits and their error bound cannot rule
// out, re-scored from the unquantized rows (certified.h): the merge of step 3 is unchanged, and the
// token is the unquantized walk's.
//
// Overflow: each e is scaled down by a power of two before its dots (Headroom) so that no partial
// sum of a dot with a finite W2 row can overflow, and the dots are scaled back up: exact wherever
// the result is finite, and a bias too large for fp32 is +-inf by its sign, never the NaN of partial
// sums that overflowed in both directions (jax_markov/reference.py's markov_bias does the same).
//
// Determinism: a row's dot is always computed by the same code in the same order (8 fp32 lanes
// over j, then a fixed pairwise tree), whatever the chunk, thread, tile or batch size, and the key
// merge is a max over a total order, so the same inputs give the same bits on one machine. All
// workers run under the caller's MXCSR (XLA flushes denormals; pool threads may not).
//
// SIMD: an AVX2+FMA+F16C path chosen at run time (__builtin_cpu_supports), and a portable scalar
// path written so that compilers vectorise it. No -march flags: the wheel runs on other machines.
// Where FMA is used, it is used where XLA's CPU backend contracts the reference's expressions
// (l = fma(logit_scale, scale * dot, base), score = fma(l, 1/T, g)), so the logits agree bit for
// bit with the reference up to the dot's summation order.
//
// The files: this one checks the buffers, gathers e and runs each step's chunks on the pool;
// chunk_generic.cc and chunk_avx2.cc score a chunk (chunk.h), the latter with avx2_primitives.h;
// isa.h chooses between them; values.h and headroom.h hold the scalar conversions and the guard.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/walk_common.h"
#include "common/walk_config.h"
#include "cpu/certified.h"
#include "cpu/chunk.h"
#include "cpu/headroom.h"
#include "cpu/isa.h"
#include "cpu/values.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_markov {
namespace cpu {
namespace {

thread_local Scratch tls_scratch;

constexpr int64_t kMinParallelWork = int64_t{1} << 21;  // V * (r + 8) * (B + 2) below this: one thread

// The work of one step, shared with pool tasks. Tasks that start after every chunk is taken touch
// nothing but this object (they own a reference to it), so the caller never waits for them.
struct StepWork {
  const Problem* problem = nullptr;  // only read after taking a chunk (the caller is still waiting then)
  const Step* step = nullptr;        // same
  int64_t num_chunks = 0;
  Isa isa = Isa::kGeneric;
  unsigned mxcsr = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Work() {
    int64_t chunk = next.fetch_add(1, std::memory_order_relaxed);
    if (chunk >= num_chunks) return;
#if MARKOV_HAVE_AVX2
    const unsigned saved_mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr);
#endif
    Scratch& scratch = tls_scratch;
    int64_t finished = 0;
    for (; chunk < num_chunks; chunk = next.fetch_add(1, std::memory_order_relaxed)) {
#if MARKOV_HAVE_AVX2
      if (isa == Isa::kAvx2) {
        avx2::ProcessChunk(*problem, *step, chunk, scratch);
      } else {
        generic::ProcessChunk(*problem, *step, chunk, scratch);
      }
#else
      generic::ProcessChunk(*problem, *step, chunk, scratch);
#endif
      ++finished;
    }
#if MARKOV_HAVE_AVX2
    _mm_setcsr(saved_mxcsr);
#endif
    if (done.fetch_add(finished, std::memory_order_acq_rel) + finished == num_chunks) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Shape checks.

std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
}

bool HasShape(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

ffi::Error Bad(const std::string& what) { return ffi::Error::InvalidArgument("jax_markov_walk (cpu): " + what); }

}  // namespace
ffi::Error MarkovWalkCpu(ffi::ThreadPool pool, ffi::AnyBuffer base, ffi::AnyBuffer anchor, ffi::AnyBuffer w1,
                         ffi::AnyBuffer w2, ffi::AnyBuffer w2_scale, ffi::AnyBuffer temperature, ffi::AnyBuffer key,
                         ffi::AnyBuffer position, ffi::AnyBuffer d2t, ffi::AnyBuffer w2_tiles,
                         ffi::RemainingArgs certificate,
                         ffi::Result<ffi::AnyBuffer> tokens,
                         ffi::Result<ffi::AnyBuffer> logits, ffi::Result<ffi::AnyBuffer> embeds, int64_t vocab_size,
                         float logit_scale, bool sampling) {
  // ---- operands
  const auto bd = base.dimensions();
  if (bd.size() != 3 || !IsFloat(base.element_type())) {
    return Bad("base_logits must be a bf16/f16/f32 [B, K, V] array, got rank " + std::to_string(bd.size()) + " " +
               Dims(bd));
  }
  const int64_t B = bd[0], K = bd[1], V = bd[2];
  if (B < 1 || K < 1 || V < 1) return Bad("base_logits must have B, K, V >= 1, got " + Dims(bd));
  const auto w1d = w1.dimensions();
  if (w1d.size() != 2 || !IsFloat(w1.element_type()) || w1d[0] < 1 || w1d[1] < 1) {
    return Bad("w1 must be a non-empty bf16/f16/f32 [V_target, r] array, got " + Dims(w1d));
  }
  const int64_t v_target = w1d[0], rank = w1d[1];
  const bool int8 = w2.element_type() == ffi::DataType::S8;
  if (!int8 && !IsFloat(w2.element_type())) return Bad("w2 must be s8, bf16, f16 or f32");
  if (!HasShape(w2.dimensions(), {V, rank})) {
    return Bad("w2 must be [V, r] = [" + std::to_string(V) + ", " + std::to_string(rank) + "], got " +
               Dims(w2.dimensions()));
  }
  if (w2_scale.element_type() != ffi::DataType::F32 || !HasShape(w2_scale.dimensions(), {int8 ? V : 0})) {
    return Bad(std::string("w2_scale must be f32 ") + (int8 ? "[V] for an s8 w2" : "[0] for a float w2") + ", got " +
               Dims(w2_scale.dimensions()));
  }
  if (anchor.element_type() != ffi::DataType::S32 || !HasShape(anchor.dimensions(), {B})) {
    return Bad("anchor must be s32 [B] = [" + std::to_string(B) + "], got " + Dims(anchor.dimensions()));
  }
  if (temperature.element_type() != ffi::DataType::F32 || !HasShape(temperature.dimensions(), {B})) {
    return Bad("temperature must be f32 [B], got " + Dims(temperature.dimensions()));
  }
  if (key.element_type() != ffi::DataType::U32 || !HasShape(key.dimensions(), {B, 2})) {
    return Bad("key must be u32 [B, 2], got " + Dims(key.dimensions()));
  }
  if (position.element_type() != ffi::DataType::S32 || !HasShape(position.dimensions(), {B})) {
    return Bad("position must be s32 [B], got " + Dims(position.dimensions()));
  }
  const bool has_d2t = HasShape(d2t.dimensions(), {V});
  if (d2t.element_type() != ffi::DataType::S32 || !(has_d2t || HasShape(d2t.dimensions(), {0}))) {
    return Bad("d2t must be s32 [V] or [0], got " + Dims(d2t.dimensions()));
  }
  // W2 stored tile by tile for the CUDA kernel (QuantizedMarkovHead.tiles): checked, not read (this walk
  // reads w2).
  const int64_t tiles = (V + walk::kTransposedTileRows - 1) / walk::kTransposedTileRows;
  if (w2_tiles.element_type() != ffi::DataType::S8 ||
      !(HasShape(w2_tiles.dimensions(), {0}) || (int8 && HasShape(w2_tiles.dimensions(), {tiles, walk::kTransposedTileBytes})))) {
    return Bad("w2_tiles must be s8 [ceil(V / " + std::to_string(walk::kTransposedTileRows) + "), " +
               std::to_string(walk::kTransposedTileBytes) + "] beside an s8 w2, or [0], got " + Dims(w2_tiles.dimensions()));
  }
  // A CertifiedMarkovHead adds two operands: the unquantized W2 and its rows' residual norms.
  if (certificate.size() != 0 && certificate.size() != 2) {
    return Bad("expected 10 operands, or 12 with a CertifiedMarkovHead's w2_exact and residual_norm, got " +
               std::to_string(10 + certificate.size()));
  }
  const bool certified = certificate.size() == 2;
  const void* w2_exact_data = nullptr;
  const float* residual_norm_data = nullptr;
  ffi::DataType w2_exact_t = ffi::DataType::F32;
  if (certified) {
    const auto w2_exact = certificate.get<ffi::AnyBuffer>(0);
    const auto residual_norm = certificate.get<ffi::AnyBuffer>(1);
    if (!w2_exact.has_value() || !residual_norm.has_value()) return Bad("w2_exact and residual_norm must be buffers");
    if (!int8 || !IsFloat(w2_exact->element_type()) || !HasShape(w2_exact->dimensions(), {V, rank})) {
      return Bad("w2_exact must be the unquantized W2, bf16/f16/f32 [V, r], beside an s8 w2, got " +
                 Dims(w2_exact->dimensions()));
    }
    if (residual_norm->element_type() != ffi::DataType::F32 || !HasShape(residual_norm->dimensions(), {V})) {
      return Bad("residual_norm must be f32 [V], got " + Dims(residual_norm->dimensions()));
    }
    w2_exact_data = w2_exact->untyped_data();
    w2_exact_t = w2_exact->element_type();
    residual_norm_data = static_cast<const float*>(residual_norm->untyped_data());
  }
  if (vocab_size < 1 || vocab_size > V) {
    return Bad("vocab_size must be in [1, V = " + std::to_string(V) + "], got " + std::to_string(vocab_size));
  }
  // ---- results
  if (tokens->element_type() != ffi::DataType::S32 || !HasShape(tokens->dimensions(), {B, K})) {
    return Bad("tokens must be s32 [B, K], got " + Dims(tokens->dimensions()));
  }
  const bool want_logits = HasShape(logits->dimensions(), {B, K, V});
  if (!IsFloat(logits->element_type()) || !(want_logits || HasShape(logits->dimensions(), {0}))) {
    return Bad("logits must be f32/bf16/f16 [B, K, V] or [0], got " + Dims(logits->dimensions()));
  }
  const bool want_embeds = HasShape(embeds->dimensions(), {B, K, rank});
  if (embeds->element_type() != w1.element_type() || !(want_embeds || HasShape(embeds->dimensions(), {0}))) {
    return Bad("embeds must be [B, K, r] or [0] in w1's dtype, got " + Dims(embeds->dimensions()));
  }

  Problem p;
  p.batch = B;
  p.steps = K;
  p.vocab = V;
  p.rank = rank;
  p.rank8 = (rank + 7) & ~int64_t{7};
  p.vocab_size = vocab_size;
  p.v_target = v_target;
  p.base_t = base.element_type();
  p.w1_t = w1.element_type();
  p.w2_t = w2.element_type();
  p.logits_t = logits->element_type();
  p.int8 = int8;
  p.certified = certified;
  p.w2_exact_t = w2_exact_t;
  p.want_logits = want_logits;
  p.want_embeds = want_embeds;
  p.has_d2t = has_d2t;
  p.logit_scale = logit_scale;
  p.base = base.untyped_data();
  p.anchor = static_cast<const int32_t*>(anchor.untyped_data());
  p.w1 = w1.untyped_data();
  p.w2 = w2.untyped_data();
  p.w2_scale = static_cast<const float*>(w2_scale.untyped_data());
  p.w2_exact = w2_exact_data;
  p.residual_norm = residual_norm_data;
  p.temperature = static_cast<const float*>(temperature.untyped_data());
  p.key = static_cast<const uint32_t*>(key.untyped_data());
  p.position = static_cast<const int32_t*>(position.untyped_data());
  p.d2t = static_cast<const int32_t*>(d2t.untyped_data());
  p.tokens = static_cast<int32_t*>(tokens->untyped_data());
  p.logits = logits->untyped_data();
  p.embeds = embeds->untyped_data();

  // ---- per-request constants (a walk given no temperatures, `sampling` false, is all greedy)
  std::vector<float> inv_t(B);
  std::vector<uint8_t> sampled(B);
  for (int64_t b = 0; b < B; ++b) {
    const float t = p.temperature[b];
    sampled[b] = sampling && t > 0.0f;
    inv_t[b] = sampled[b] ? 1.0f / t : 0.0f;
  }
  std::vector<int32_t> prev(p.anchor, p.anchor + B);
  // A certified head: each greedy request's bound per step (from the largest row scale, NaN rows
  // left out: their bounds are NaN and they are always re-scored) and the rows each chunk re-scored.
  float scale_max = 0.0f;
  if (certified) {
    for (int64_t v = 0; v < V; ++v) scale_max = std::fmax(scale_max, p.w2_scale[v]);
  }
  std::vector<CertifiedBound> bounds(certified ? B : 0);
  CertifiedStats stats;

  // ---- chunking: enough chunks to balance the pool, each a multiple of the tile
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk_rows = (V + 8 * threads - 1) / (8 * threads);
  chunk_rows = std::clamp<int64_t>((chunk_rows + kTileRows - 1) / kTileRows * kTileRows, 64, 512);
  const int64_t num_chunks = (V + chunk_rows - 1) / chunk_rows;
  // The calling thread works too, so num_threads - 1 pool tasks keep one worker per pool thread
  // (the pool has one thread per core). Small steps (about a tenth of a millisecond of work) stay on
  // the calling thread: waking pool threads would cost more than it saves.
  const bool small = V * (rank + 8) * (B + 2) < kMinParallelWork;
  const int64_t tasks = small ? 0 : std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, num_chunks - 1));

  const Isa isa = CurrentIsa();
#if MARKOV_HAVE_AVX2
  const unsigned mxcsr = _mm_getcsr();
#else
  const unsigned mxcsr = 0;
#endif

  AlignedFloats e_buf;
  float* e = e_buf.Get(B * p.rank8);
  if (e == nullptr) return ffi::Error::Internal("jax_markov_walk (cpu): out of memory");
  std::vector<uint64_t> keys(num_chunks * B);
  std::vector<int32_t> rescored(certified ? num_chunks * B : 0);
  std::vector<float> up(2 * B);
  const size_t w1_bytes = ElementBytes(p.w1_t);

  for (int64_t k = 0; k < K; ++k) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t id = ClampIndex(prev[b], v_target);
      const char* src = static_cast<const char*>(p.w1) + id * rank * w1_bytes;
      float* dst = e + b * p.rank8;
      for (int64_t j = 0; j < rank; ++j) dst[j] = LoadAsF32(src, p.w1_t, j);
      for (int64_t j = rank; j < p.rank8; ++j) dst[j] = 0.0f;
      Headroom(dst, rank, up.data() + 2 * b);
      if (certified && !sampled[b]) {
        bounds[b] = MakeCertifiedBound(dst, rank, p.rank8, up.data() + 2 * b, logit_scale, scale_max);
      }
      if (want_embeds) std::memcpy(static_cast<char*>(p.embeds) + ((b * K + k) * rank) * w1_bytes, src, rank * w1_bytes);
    }
    Step step{k,          e,          up.data(),     inv_t.data(),   sampled.data(),
              chunk_rows, num_chunks, keys.data(), bounds.data(), rescored.data()};
    auto work = std::make_shared<StepWork>();
    work->problem = &p;
    work->step = &step;
    work->num_chunks = num_chunks;
    work->isa = isa;
    work->mxcsr = mxcsr;
    for (int64_t t = 0; t < tasks; ++t) pool.Schedule([work] { work->Work(); });
    work->Work();
    {
      std::unique_lock<std::mutex> lock(work->mu);
      work->cv.wait(lock, [&] { return work->done.load(std::memory_order_acquire) == num_chunks; });
    }
    for (int64_t b = 0; b < B; ++b) {
      uint64_t best = 0;
      for (int64_t c = 0; c < num_chunks; ++c) best = std::max(best, keys[c * B + b]);
      const int32_t token = static_cast<int32_t>(ArgmaxKeyIndex(best));
      const int32_t target =
          has_d2t ? static_cast<int32_t>(static_cast<uint32_t>(token) + static_cast<uint32_t>(p.d2t[token])) : token;
      p.tokens[b * K + k] = target;
      prev[b] = target;
      if (certified && !sampled[b]) {
        int64_t rows = 0;
        for (int64_t c = 0; c < num_chunks; ++c) {
          const int64_t count = rescored[c * B + b];
          rows += count;
          stats.chunk_sets += count > 0;
          stats.max_chunk_set = std::max(stats.max_chunk_set, count);
        }
        stats.decisions += 1;
        stats.rescored += rows;
        stats.max_rescored = std::max(stats.max_rescored, rows);
        stats.uncertified += !bounds[b].safe;
      }
    }
  }
  if (certified) RecordCertifiedStats(stats);
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jax_markov

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarkovWalkCpu, jax_markov::cpu::MarkovWalkCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // base_logits
                                  .Arg<ffi::AnyBuffer>()  // anchor
                                  .Arg<ffi::AnyBuffer>()  // w1
                                  .Arg<ffi::AnyBuffer>()  // w2
                                  .Arg<ffi::AnyBuffer>()  // w2_scale
                                  .Arg<ffi::AnyBuffer>()  // temperature
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // position
                                  .Arg<ffi::AnyBuffer>()  // d2t
                                  .Arg<ffi::AnyBuffer>()  // w2_tiles (checked, not read)
                                  .RemainingArgs()        // w2_exact, residual_norm: a CertifiedMarkovHead's
                                  .Ret<ffi::AnyBuffer>()  // tokens
                                  .Ret<ffi::AnyBuffer>()  // logits
                                  .Ret<ffi::AnyBuffer>()  // embeds
                                  .Attr<int64_t>("vocab_size")
                                  .Attr<float>("logit_scale")
                                  .Attr<bool>("sampling"));
