"""The GPU noise's arithmetic helpers (ffi/common/walk_common.h), over every u that docs/spec.md's noise can
take: u = (m + 0.5) * 2^-23 for all 2^23 values of m. UnitOfWord must give docs/spec.md's u bit for bit,
and LogOfUnit (the inner log) must stay within an ulp of log in double precision. The GPU is their
user, so this compiles them for the host with the system's C++ compiler."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FFI = Path(__file__).resolve().parents[1] / "ffi"
CHECK = r"""
#include <cmath>
#include <cstdio>
#include "common/walk_common.h"
int main() {
  double worst = 0;
  for (unsigned m = 0; m < (1u << 23); ++m) {
    const float u = (static_cast<float>(m) + 0.5f) * 1.1920928955078125e-07f;
    const double exact = std::log(static_cast<double>(u));
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(exact)) - 23);
    worst = std::fmax(worst, std::fabs(jax_markov::LogOfUnit(u) - exact) / ulp);
  }
  std::printf("%.6f\n", worst);
}
"""


UNIT = r"""
#include <cstdio>
#include <cstring>
#include "common/walk_common.h"
int main() {
  unsigned wrong = 0;
  for (unsigned m = 0; m < (1u << 23); ++m) {
    const float spec = (static_cast<float>(m) + 0.5f) * 1.1920928955078125e-07f;
    const float got = jax_markov::UnitOfWord((m << 9) | (m & 0x1FFu));  // the low 9 bits are dropped
    wrong += std::memcmp(&spec, &got, sizeof(float)) != 0;
  }
  std::printf("%u\n", wrong);
}
"""


def run_check(tmp_path, source: str) -> str:
    (tmp_path / "check.cc").write_text(source)
    subprocess.run(["c++", "-O2", "-std=c++17", f"-I{FFI}", "check.cc", "-o", "check"], cwd=tmp_path, check=True)
    return subprocess.run(["./check"], cwd=tmp_path, check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_log_of_unit_within_an_ulp_of_log(tmp_path):
    worst = float(run_check(tmp_path, CHECK))
    assert 0.0 < worst <= 1.0, worst  # the CUDA math library's logf, whose polynomial it is: within 1 ulp


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_unit_of_word_is_spec_u(tmp_path):
    assert int(run_check(tmp_path, UNIT)) == 0
