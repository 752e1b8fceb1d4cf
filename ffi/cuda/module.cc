// nanobind module `_markov_cuda`: the CUDA FFI handler and the properties of a GPU (for the launch
// plan that Python asks of `_markov_plan`).
#include <nanobind/nanobind.h>

#include <string>
#include <vector>

#include "cuda/handler.h"

namespace nb = nanobind;

NB_MODULE(_markov_cuda, m) {
  m.def("handler", []() { return nb::capsule(reinterpret_cast<void*>(MarkovWalkCuda)); });
  m.def(
      "device_properties",
      [](int ordinal) {
        jax_markov::walk::DeviceProperties p;
        const cudaError_t err = jax_markov::QueryDeviceProperties(ordinal, &p);
        if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(err));
        nb::dict d;
        d["sm_count"] = p.sm_count;
        d["smem_per_block"] = p.smem_per_block;
        d["l2_bytes"] = p.l2_bytes;
        d["major"] = p.major;
        d["minor"] = p.minor;
        d["cooperative"] = p.cooperative;
        return d;
      },
      nb::arg("ordinal"), "Properties of CUDA device `ordinal` that the launch plan takes.");
  m.def(
      "enable_certified_stats",
      [](int ordinal) {
        const cudaError_t err = jax_markov::EnableCertifiedStats(ordinal);
        if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(err));
      },
      nb::arg("ordinal") = 0,
      "Keep the certified walks' counters on CUDA device `ordinal` from now on (for tests: certified_stats()).");
  m.def(
      "certified_stats",
      [](int ordinal, bool reset) {
        std::vector<unsigned long long> words;
        const cudaError_t err = jax_markov::CertifiedStats(ordinal, reset, &words);
        if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(err));
        static const char* names[] = {"decisions", "uncertified", "exact_rounds", "rescored", "max_cta_rescored", "cta_sets",
                                      "lane_fallbacks"};
        static_assert(sizeof(names) / sizeof(names[0]) == jax_markov::walk::kCertStats, "a name per counter");
        nb::dict d;
        for (int i = 0; i < jax_markov::walk::kCertStats; ++i) d[names[i]] = words[i];
        return d;
      },
      nb::arg("ordinal") = 0, nb::arg("reset") = false,
      "What the certified walks (CertifiedMarkovHead) on CUDA device `ordinal` re-scored since enable_certified_stats "
      "(or the last reset): greedy (request, step) decisions; those whose bound could not be used (non-finite e, a "
      "bias that could overflow, or unusable scales or residual norms: every row re-scored); those that took an "
      "exact round (the grid's int8 keys and bounds did not single out the choice); columns re-scored exactly from their unquantized W2 rows (masked columns and the padding need none) in all and at most by one "
      "CTA for one decision; (decision, CTA) pairs that re-scored a column; lanes "
      "that re-scored all their rows (two candidates or more, or no usable bound). Waits for the device.");
#ifdef JAX_MARKOV_TIMELINE
  m.def(
      "read_timeline",
      []() {
        std::vector<unsigned long long> words;
        int ctas = 0;
        const cudaError_t err = jax_markov::ReadTimeline(&words, &ctas);
        if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(err));
        nb::list stamps;
        for (unsigned long long w : words) stamps.append(w);
        nb::dict d;
        d["ctas"] = ctas;
        d["steps"] = jax_markov::walk::kMaxSteps;  // a CTA's phase stamps: [steps + 1][phases]
        d["phases"] = jax_markov::walk::kPhases;
        d["warps"] = jax_markov::walk::kMaxWarps;  // then a warp's stamp a CTA and step: [ctas][steps][warps]
        d["stamps"] = stamps;
        return d;
      },
      "Timeline builds only: the latest launch's %globaltimer stamps and their layout, see benchmarks/timeline.py.");
#endif
}
