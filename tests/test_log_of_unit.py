"""LogOfUnit (ffi/common/walk_common.h), the GPU noise's inner log, against log in double precision
over every u that SPEC.md's noise can take: u = (m + 0.5) * 2^-23 for all 2^23 values of m. It runs
on the device only, so this compiles it for the host with the system's C++ compiler."""
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


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_log_of_unit_within_an_ulp_of_log(tmp_path):
    (tmp_path / "check.cc").write_text(CHECK)
    subprocess.run(["c++", "-O2", "-std=c++17", f"-I{FFI}", "check.cc", "-o", "check"], cwd=tmp_path, check=True)
    worst = float(subprocess.run(["./check"], cwd=tmp_path, check=True, capture_output=True, text=True).stdout)
    assert 0.0 < worst <= 1.0, worst  # the CUDA math library's logf, whose polynomial it is: within 1 ulp
