"""benchmarks/run_gpu.sh's GPU test shards (CPU): together they run every GPU test exactly once."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_cuda.py", "tests/test_cuda_certified.py", "tests/test_design_floor.py",
                  "tests/test_command_buffers.py"]
# The tests part's shell variables (files=, k1=, ...) and each shard's pytest line.
_VARIABLE = re.compile(r'^\s*(\w+)="([^"]*)"$', re.M)
_SHARD = re.compile(r'--durations=12 (\S+) -k "([^"]+)"')


def shards():
    """Each shard's files and -k expression, with the script's variables put in."""
    script = (ROOT / "benchmarks" / "run_gpu.sh").read_text()
    variables = dict(_VARIABLE.findall(script))

    def expand(text):
        return re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], text)

    return [(expand(files).split(), expand(expression)) for files, expression in _SHARD.findall(script)]


def collected(files, expression=None):
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    if expression is not None:
        command += ["-k", expression]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_the_shards_run_every_gpu_test_once():
    found = shards()
    assert len(found) == 3, found
    runs = [test for files, expression in found for test in collected(files, expression)]
    assert sorted(runs) == sorted(collected(GPU_TEST_FILES))
