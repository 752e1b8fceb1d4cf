"""benchmarks/run_gpu.sh's GPU test shards (CPU): together they run every GPU test exactly once."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_cuda.py", "tests/test_cuda_transposed.py", "tests/test_cuda_certified.py",
                  "tests/test_design_floor.py", "tests/test_command_buffers.py"]


def script_variable(name):
    """The value the tests part of run_gpu.sh gives a shell variable (files=..., shards=...)."""
    script = (ROOT / "benchmarks" / "run_gpu.sh").read_text()
    return re.search(rf'^\s*{name}="?([^"\n]*)"?$', script, re.M).group(1)


def collected(files, shard=None):
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    env = {key: value for key, value in os.environ.items() if key != "JAX_MARKOV_TEST_SHARD"}
    if shard is not None:
        env["JAX_MARKOV_TEST_SHARD"] = shard
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_the_shards_run_every_gpu_test_once():
    files = script_variable("files").split()
    assert sorted(files) == sorted(GPU_TEST_FILES)
    count = int(script_variable("shards"))
    assert count > 1
    runs = [collected(files, f"{i}/{count}") for i in range(count)]
    everything = collected(GPU_TEST_FILES)
    assert sorted(test for run in runs for test in run) == sorted(everything)
    # Round robin: the shards' sizes differ by at most one test.
    assert max(map(len, runs)) - min(map(len, runs)) <= 1


def test_a_shard_out_of_range_is_refused():
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "tests/test_design_floor.py"]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "JAX_MARKOV_TEST_SHARD": "3/3"},
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "JAX_MARKOV_TEST_SHARD" in result.stdout + result.stderr
