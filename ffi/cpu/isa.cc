// The SIMD path's choice (isa.h).
#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <string>

namespace jax_markov {
namespace cpu {
namespace {

Isa DetectIsa() {
#if MARKOV_HAVE_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kGeneric;
}

std::atomic<int> g_isa{-1};

}  // namespace

Isa CurrentIsa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    const char* force = std::getenv("JAX_MARKOV_CPU_ISA");
    isa = static_cast<int>(force && std::string(force) == "generic" ? Isa::kGeneric : DetectIsa());
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<Isa>(isa);
}

const char* CpuIsaName() { return CurrentIsa() == Isa::kAvx2 ? "avx2" : "generic"; }

bool SetCpuIsa(const std::string& name) {
  if (name == "generic") {
    g_isa.store(static_cast<int>(Isa::kGeneric));
    return true;
  }
  if (name == "avx2" || name == "auto") {
    const Isa detected = DetectIsa();
    if (name == "avx2" && detected != Isa::kAvx2) return false;
    g_isa.store(static_cast<int>(detected));
    return true;
  }
  return false;
}

}  // namespace cpu
}  // namespace jax_markov
