"""The CPU benchmark script, quickly: benchmarks/benchmark_markov_walk.py --quick."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_quick(tmp_path):
    """benchmarks/benchmark_markov_walk.py --quick runs and writes its table (in a temporary folder)."""
    script = ROOT / "benchmarks" / "benchmark_markov_walk.py"
    if not script.exists():
        pytest.skip("no benchmark script in this checkout")
    run = subprocess.run([sys.executable, str(script), "--quick", "--out-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    table = (tmp_path / "cpu.md").read_text()
    assert "custom call" in table and "reference" in table
    assert (tmp_path / "cpu.json").exists()
