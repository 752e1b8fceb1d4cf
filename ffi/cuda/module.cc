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
        return nb::make_tuple(ctas, stamps);
      },
      "Timeline builds only: (grid size, the latest launch's %globaltimer stamps), see benchmarks/timeline.py.");
#endif
}
