// nanobind module `_markov_plan` (always built; no GPU needed): the CUDA walk's envelope and launch
// plan as jax_markov/native.py asks for them, so that Python keeps no copy of a C++ limit or decision.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "plan/walk_plan.h"

namespace nb = nanobind;
using jax_markov::walk::DeviceProperties;
using jax_markov::walk::KernelKey;
using jax_markov::walk::LaunchPlan;
using jax_markov::walk::WalkCall;

namespace {

int DType(const std::string& name) {
  if (name == "float32") return jax_markov::walk::kF32;
  if (name == "bfloat16") return jax_markov::walk::kBF16;
  if (name == "float16") return jax_markov::walk::kF16;
  throw std::invalid_argument("a dtype of base logits, W1 or logits must be float32, bfloat16 or float16, got " + name);
}

int W2Format(const std::string& name) {
  if (name == "int8") return jax_markov::walk::kW2Int8;
  if (name == "float16") return jax_markov::walk::kW2F16;
  if (name == "bfloat16") return jax_markov::walk::kW2BF16;
  return -1;  // a W2 the kernel does not walk: Unsupported says so
}

DeviceProperties Properties(const nb::dict& d) {
  DeviceProperties p;
  p.sm_count = nb::cast<int>(d["sm_count"]);
  p.smem_per_block = nb::cast<int>(d["smem_per_block"]);
  p.l2_bytes = nb::cast<int>(d["l2_bytes"]);
  p.major = nb::cast<int>(d["major"]);
  p.minor = nb::cast<int>(d["minor"]);
  p.cooperative = nb::cast<bool>(d["cooperative"]);
  return p;
}

WalkCall Call(int64_t batch, int64_t steps, int64_t vocab, int64_t rank, const std::string& w2, const std::string& w1,
              const std::string& base, const std::optional<std::string>& logits, bool sampling, bool certified, bool w2_tiled) {
  WalkCall c;
  c.batch = batch;
  c.steps = steps;
  c.vocab = vocab;
  c.rank = rank;
  c.w2 = W2Format(w2);
  c.w1_dtype = DType(w1);
  c.base_dtype = DType(base);
  c.logits_dtype = logits ? DType(*logits) : jax_markov::walk::kNone;
  c.sampling = sampling;
  c.certified = certified;
  c.w2_tiled = w2_tiled;
  return c;
}

// A launch's RunWhen as Python sees it: the batch classes (walk_config.h) in which it walks.
const char* RunWhenName(int run_when) {
  using namespace jax_markov::walk;
  switch (run_when) {
    case kAlways: return "always";
    case kNoRowSamples: return "no_row_samples";
    case kSomeRowSamples: return "some_row_samples";
    case kSomeRowGreedy: return "some_row_greedy";
    case kMixedRows: return "mixed_rows";
    case kAllSampled: return "all_rows_sample";
  }
  throw std::logic_error("a launch plan's run_when is not a RunWhen: " + std::to_string(run_when));
}

// The batch classes (BatchClass) in which a launch of this RunWhen walks.
nb::list WalksIn(int run_when) {
  using namespace jax_markov::walk;
  nb::list classes;
  if (run_when & kAllGreedy) classes.append("all_greedy");
  if (run_when & kMixedRows) classes.append("mixed");
  if (run_when & kAllSampled) classes.append("all_sampled");
  return classes;
}

nb::dict KernelDict(const KernelKey& k) {
  nb::dict d;
  d["name"] = jax_markov::walk::KernelName(k);
  d["family"] = k.family == jax_markov::walk::kTransposedFamily ? "transposed" : "walk";
  return d;
}

}  // namespace

NB_MODULE(_markov_plan, m) {
  m.def(
      "envelope",
      []() {
        nb::dict d;
        d["rank"] = jax_markov::walk::kRank;
        d["max_steps"] = jax_markov::walk::kMaxSteps;
        d["launch_columns"] = jax_markov::walk::kMaxBatch;
        nb::list w2;
        for (const char* name : {"int8", "float16", "bfloat16"}) w2.append(name);
        d["w2_dtypes"] = w2;
        return d;
      },
      "The CUDA walk's fixed limits: rank, most draft steps, B columns a launch, the W2 dtypes it walks.");
  m.def(
      "columns_per_request",
      [](const std::string& w2, const std::string& w1) { return jax_markov::walk::ColumnsPerRequest(W2Format(w2), DType(w1)); },
      nb::arg("w2_dtype"), nb::arg("w1_dtype"), "B columns a request takes (2 where the MMA format needs hi + lo parts of W1).");
  m.def(
      "unsupported",
      [](int64_t batch, int64_t steps, int64_t vocab, int64_t rank, const std::string& w2, const std::string& w1,
         const std::string& base, const std::optional<std::string>& logits, bool sampling, const nb::dict& props, bool certified,
         bool w2_tiled) {
        const std::string why = jax_markov::walk::Unsupported(Call(batch, steps, vocab, rank, w2, w1, base, logits, sampling, certified, w2_tiled), Properties(props));
        if (why.empty()) return std::optional<std::string>();
        return std::optional<std::string>(W2Format(w2) < 0 ? why + ", got " + w2 : why);
      },
      nb::arg("batch"), nb::arg("steps"), nb::arg("vocab"), nb::arg("rank"), nb::arg("w2_dtype"), nb::arg("w1_dtype"),
      nb::arg("base_dtype"), nb::arg("logits_dtype").none(), nb::arg("sampling"), nb::arg("props"),
      nb::arg("certified") = false, nb::arg("w2_tiles") = false,
      "Why the CUDA kernel cannot walk this call on a GPU with these properties, or None.");
  m.def(
      "slower_than_reference",
      [](int64_t batch, int64_t steps, int64_t vocab, int64_t rank, const std::string& w2, const std::string& w1,
         const std::string& base, const std::optional<std::string>& logits, bool sampling, const nb::dict& props, bool certified,
         bool w2_tiled) {
        const std::string why =
            jax_markov::walk::SlowerThanReference(Call(batch, steps, vocab, rank, w2, w1, base, logits, sampling, certified, w2_tiled), Properties(props));
        return why.empty() ? std::optional<std::string>() : std::optional<std::string>(why);
      },
      nb::arg("batch"), nb::arg("steps"), nb::arg("vocab"), nb::arg("rank"), nb::arg("w2_dtype"), nb::arg("w1_dtype"),
      nb::arg("base_dtype"), nb::arg("logits_dtype").none(), nb::arg("sampling"), nb::arg("props"),
      nb::arg("certified") = false, nb::arg("w2_tiles") = false,
      "Why impl='auto' takes the reference although the kernel can walk this call (int8 W2 past L2), or None.");
  m.def(
      "plan",
      [](int64_t batch, int64_t steps, int64_t vocab, int64_t rank, const std::string& w2, const std::string& w1,
         const std::string& base, const std::optional<std::string>& logits, bool sampling, const nb::dict& props, bool certified,
         bool w2_tiled) {
        const WalkCall call = Call(batch, steps, vocab, rank, w2, w1, base, logits, sampling, certified, w2_tiled);
        const DeviceProperties p = Properties(props);
        const std::string why = jax_markov::walk::Unsupported(call, p);
        if (!why.empty()) throw std::invalid_argument(why);
        nb::list launches;
        for (const LaunchPlan& l : jax_markov::walk::PlanCall(call, p)) {
          nb::dict d = KernelDict(l.kernel);
          d["first"] = l.first;
          d["batch"] = l.batch;
          d["grid"] = l.grid;
          d["threads"] = l.threads;
          d["smem_bytes"] = l.smem_bytes;
          d["tiles_per_cta"] = l.tiles_per_cta;
          d["resident_tiles"] = l.resident_tiles;
          d["noise_ahead"] = l.noise_ahead;
          d["noise_tiles"] = l.noise_tiles;
          d["logits_staged"] = l.logits_staged;
          d["sampling"] = l.sampling;
          d["w2_tiled"] = l.w2_tiled;
          d["run_when"] = RunWhenName(l.run_when);
          d["walks_in"] = WalksIn(l.run_when);
          launches.append(d);
        }
        return launches;
      },
      nb::arg("batch"), nb::arg("steps"), nb::arg("vocab"), nb::arg("rank"), nb::arg("w2_dtype"), nb::arg("w1_dtype"),
      nb::arg("base_dtype"), nb::arg("logits_dtype").none(), nb::arg("sampling"), nb::arg("props"),
      nb::arg("certified") = false, nb::arg("w2_tiles") = false,
      "The launches of a call the kernel walks (ValueError naming the limit otherwise): kernel, threads, shared memory, tiles.");
  m.def(
      "w2_tile_layout",
      []() {
        nb::dict d;
        d["rows"] = jax_markov::walk::kTransposedTileRows;
        nb::list order;
        for (int32_t i : jax_markov::walk::W2TileOrder()) order.append(i);
        d["order"] = order;
        return d;
      },
      "W2 stored tile by tile (QuantizedMarkovHead.tiles): rows a tile, and for each byte of a stored tile the "
      "index of its byte in the tile's rows of W2 taken row-major.");
  m.def(
      "instantiated_kernels",
      []() {
        nb::list names;
        for (const KernelKey& k : jax_markov::walk::InstantiatedKernels()) names.append(jax_markov::walk::KernelName(k));
        return names;
      },
      "The names of every kernel the build instantiates (ffi/plan/kernel_list.h).");
}
