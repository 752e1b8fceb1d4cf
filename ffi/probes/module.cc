// nanobind module `_markov_probes` (built with -DJAX_MARKOV_PROBES=ON): the design-floor probes
// (probes.cu), for benchmarks/design_floor.py.
#include <nanobind/nanobind.h>

#include "probes/probes.h"

namespace nb = nanobind;

NB_MODULE(_markov_probes, m) {
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
      nb::arg("ordinal"), "Runs the design-floor probes on CUDA device `ordinal` and returns their constants.");
}
