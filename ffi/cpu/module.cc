// The nanobind module `jax_markov._markov_cpu`: hands the CPU custom call to jax.ffi.register_ffi_target.
#include <map>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include "cpu/certified.h"
#include "cpu/isa.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxMarkovWalkCpu(XLA_FFI_CallFrame* call_frame);

namespace nb = nanobind;

NB_MODULE(_markov_cpu, m) {
  m.doc() = "The jax_markov CPU custom call (XLA FFI target jax_markov_walk).";
  m.def("handler", [] { return nb::capsule(reinterpret_cast<void*>(&JaxMarkovWalkCpu)); },
        "The XLA FFI handler of jax_markov_walk, as a PyCapsule for jax.ffi.register_ffi_target.");
  m.def("isa", [] { return std::string(jax_markov::cpu::CpuIsaName()); },
        "The SIMD path the handler runs: 'avx2' (AVX2+FMA+F16C, chosen at run time) or 'generic'.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        if (!jax_markov::cpu::SetCpuIsa(name)) {
          throw nb::value_error(("set_isa: expected 'auto', 'generic' or (on a CPU that has it) 'avx2', got '" +
                                 name + "'").c_str());
        }
      },
      nb::arg("name"),
      "Force the SIMD path ('generic', 'avx2' or 'auto'), for tests and benchmarks. The environment variable "
      "JAX_MARKOV_CPU_ISA=generic does the same at load time.");
  m.def(
      "certified_stats",
      [] {
        const jax_markov::cpu::CertifiedStats s = jax_markov::cpu::CertifiedStatsSoFar();
        return std::map<std::string, int64_t>{{"decisions", s.decisions},       {"rescored", s.rescored},
                                              {"max_rescored", s.max_rescored}, {"chunk_sets", s.chunk_sets},
                                              {"max_chunk_set", s.max_chunk_set}, {"uncertified", s.uncertified}};
      },
      "What the certified walks (CertifiedMarkovHead) of this process re-scored since the last reset: greedy "
      "(request, step) decisions; rows re-scored exactly in all, and at most for one decision; (decision, chunk) "
      "pairs that re-scored a row (each chunk re-scores at least its own best) and the most rows one chunk "
      "re-scored; decisions whose bound could not be used (non-finite e, or a bias that could overflow: every row "
      "re-scored). Counted once per call, on the certified path only.");
  m.def("reset_certified_stats", [] { jax_markov::cpu::ResetCertifiedStats(); }, "Zero certified_stats().");
}
