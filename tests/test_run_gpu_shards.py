"""benchmarks/run_gpu.sh's shards (CPU): together the GPU test shards run every GPU test exactly once,
and the sanitizer parts every sanitizer job."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax_markov

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


def _sanitizer_run(tmp_path, part=None):
    """run_gpu.sh's memcheck part in a copy of the repository, with nvidia-smi and compute-sanitizer
    stubbed (the stub prints the job it was given instead of running it) and the installed package's
    modules as the prebuilt ones: (exit status, output, {log name: jobs in it})."""
    tree = tmp_path / "tree"
    if not tree.exists():
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
        for name in files.stdout.split("\0"):
            if name and (ROOT / name).is_file():
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, tree / name)
        stubs = tmp_path / "bin"
        stubs.mkdir()
        (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
        (stubs / "compute-sanitizer").write_text("#!/bin/sh\nshift 2\necho \"JOB $*\"\n"
                                                 "echo '========= ERROR SUMMARY: 0 errors'\n")
        for stub in stubs.iterdir():
            stub.chmod(0o755)
        modules = tmp_path / "modules"
        modules.mkdir()
        for module in Path(jax_markov.__file__).parent.glob("_markov_*.so"):
            shutil.copy2(module, modules / module.name)
        if not any(modules.iterdir()):  # run_gpu.sh copies at least one module
            (modules / "_markov_absent.so").write_bytes(b"")
    env = {key: value for key, value in os.environ.items() if key != "JAX_MARKOV_SANITIZER_PART"}
    env.update(PATH=f"{tmp_path / 'bin'}:{env['PATH']}", JAX_MARKOV_PREBUILT=str(tmp_path / "modules"),
               JAX_MARKOV_COMMIT="test")
    if part is not None:
        env["JAX_MARKOV_SANITIZER_PART"] = part
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    result = subprocess.run(["bash", "benchmarks/run_gpu.sh", str(out), "memcheck"], cwd=tree, env=env,
                            capture_output=True, text=True)
    logs = {log.name: re.findall(r"^JOB (.*)$", log.read_text(), re.M) for log in out.glob("*.log")}
    return result.returncode, result.stdout + result.stderr, logs


def test_the_sanitizer_parts_run_every_job_once(tmp_path):
    status, output, logs = _sanitizer_run(tmp_path)
    assert status == 0, output
    everything = logs.pop("h100_memcheck.log")
    assert not logs and len(everything) > 30 and len(set(everything)) == len(everything)
    assert any("profile_kernel.py 151936,2,16,greedy,certified" in job for job in everything)
    assert any("pytest" in job and "test_cuda_certified.py::" in job for job in everything)
    parts = []
    for i in range(2):
        status, output, logs = _sanitizer_run(tmp_path, f"{i}/2")
        assert status == 0, output
        assert list(logs) == [f"h100_memcheck_{i}of2.log"], logs
        parts.append(logs[f"h100_memcheck_{i}of2.log"])
    assert sorted(parts[0] + parts[1]) == sorted(everything)
    assert abs(len(parts[0]) - len(parts[1])) <= 1
    for bad in ("2/2", "1", "a/b"):
        status, output, _ = _sanitizer_run(tmp_path, bad)
        assert status == 2 and f"JAX_MARKOV_SANITIZER_PART must be i/n with 0 <= i < n, got {bad}" in output
