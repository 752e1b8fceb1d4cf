// nanobind module `_markov_cuda`: the CUDA FFI handler and what the Python side asks of the GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cuda/markov_walk_cuda.h"

namespace nb = nanobind;

NB_MODULE(_markov_cuda, m) {
  m.def("handler", []() { return nb::capsule(reinterpret_cast<void*>(MarkovWalkCuda)); });
  m.def(
      "device_properties",
      [](int ordinal) {
        jax_markov::DeviceProperties p;
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
      nb::arg("ordinal"), "Properties of CUDA device `ordinal` that decide whether the kernel runs there.");
}
