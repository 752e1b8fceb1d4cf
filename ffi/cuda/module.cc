// nanobind module `_markov_cuda`: the CUDA FFI handler and what the Python side asks of the GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "cuda/markov_walk_cuda.h"
#include "cuda/probes.h"

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
  m.def(
      "launch_takes_transposed",
      [](int batch, int vocab, const std::string& w1_dtype, bool logits_out, int sm_count, int smem_per_block) {
        jax_markov::DeviceProperties p;
        p.sm_count = sm_count;
        p.smem_per_block = smem_per_block;
        return jax_markov::LaunchTakesTransposed(batch, vocab, w1_dtype, logits_out, p);
      },
      nb::arg("batch"), nb::arg("vocab"), nb::arg("w1_dtype"), nb::arg("logits_out"), nb::arg("sm_count"),
      nb::arg("smem_per_block"),
      "Whether one launch of `batch` requests over int8 W2 runs the transposed kernel (needs no GPU).");
  m.def(
      "measure_design_constants",
      [](int ordinal) {
        jax_markov::DesignConstants c;
        {
          nb::gil_scoped_release release;  // the probes take about a second
          c = jax_markov::MeasureDesignConstants(ordinal);
        }
        nb::dict d;
        d["hbm_copy_bytes_per_s"] = c.hbm_copy_bytes_per_s;
        d["smem_read_bytes_per_s"] = c.smem_read_bytes_per_s;
        d["l2_read_bytes_per_s"] = c.l2_read_bytes_per_s;
        d["exchange_s"] = c.exchange_s;
        d["exchange_per_request_s"] = c.exchange_per_request_s;
        d["mma_per_s"] = c.mma_per_s;
        d["wgmma_per_s"] = c.wgmma_per_s;
        d["noise_per_s"] = c.noise_per_s;
        d["coop_launch_gap_s"] = c.coop_launch_gap_s;
        d["sm_count"] = c.sm_count;
        d["smem_per_block"] = c.smem_per_block;
        return d;
      },
      nb::arg("ordinal"),
      "Runs the design-floor probes (ffi/cuda/probes.cu) on CUDA device `ordinal` and returns their constants.");
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
