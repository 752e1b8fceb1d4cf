// Which SIMD path the CPU custom call runs: the AVX2+FMA+F16C path where the build and the CPU have
// it (chosen at run time, no -march flags: the wheel runs on other machines), else the portable one.
#pragma once

#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MARKOV_HAVE_AVX2 1
#include <immintrin.h>
#else
#define MARKOV_HAVE_AVX2 0
#endif

// The attributes of a function of the AVX2 path (compiled for it whatever the build's flags).
#define MARKOV_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define MARKOV_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace jax_markov {
namespace cpu {

enum class Isa : int { kGeneric = 0, kAvx2 = 1 };

// The path the handler runs: detected once, or forced by JAX_MARKOV_CPU_ISA=generic at load time.
Isa CurrentIsa();

// For tests and benchmarks (module.cc): which SIMD path runs ("avx2" or "generic"), and forcing one
// ("generic", "avx2" or "auto"; false when the name is unknown or the CPU lacks AVX2).
const char* CpuIsaName();
bool SetCpuIsa(const std::string& name);

}  // namespace cpu
}  // namespace jax_markov
