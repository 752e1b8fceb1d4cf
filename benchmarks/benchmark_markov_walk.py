"""The main benchmark: the DSpark Markov walk per call, against its memory floor.

CPU (always): the jitted pure-JAX reference on the int8 head against the CPU custom call
(`impl="ffi"`), at V = 151936, r = 256, K = 7, B = 1 and B = 16, greedy rows.

Timing: each arm is jitted and warmed up; then the arms take turns call by call (so that a busy
machine slows them alike), every call on the next of a few input sets (its own head, base logits
and anchors), each call timed to `block_until_ready`; the table gives the median.

Memory floor: the walk must read the int8 W2 and its scales once per draft step, K passes of
V * (r + 4) bytes, at the bandwidth of a large numpy copy on this machine (bytes read + written
per second, the best of one thread and all threads). "fraction of floor" = floor / measured.

Writes <out-dir>/cpu.md and cpu.json with the exact command, the CPU model, the jax version and
the git commit. `--quick` is a seconds-long smoke run on a small vocabulary (tests call it).

GPU rows: on a machine with a CUDA GPU, `run_gpu(args)` runs benchmarks/gpu_timing.py after the CPU rows.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RANK = 256
REFERENCE_ARM = "reference (jit, int8 head)"
FFI_ARM = "custom call (int8)"


# ------------------------------------------------------------------------------------------------
# the machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict:
    def git(*a):
        r = subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in changed.splitlines()] if changed else []
    return dict(commit=commit, dirty=bool(changed), changed_files=changed)


def memory_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """Bytes read + written per second of a large numpy copy, with one thread and with all threads
    (numpy releases the GIL while copying)."""
    n = nbytes // 8
    src = np.random.default_rng(0).random(n)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in

    def best_of(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 2 * src.nbytes / min(times)

    one = best_of(lambda: np.copyto(dst, src))
    threads = os.cpu_count() or 1
    parts = np.array_split(np.arange(n), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if len(p)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def copy_all():
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
        many = best_of(copy_all)
    return dict(bytes=int(src.nbytes), one_thread=one, all_threads=many, threads=threads, best=max(one, many))


# ------------------------------------------------------------------------------------------------
# inputs and arms


def make_sets(vocab: int, steps: int, batch: int, n_sets: int, seed: int = 0):
    """n_sets independent (int8 head, base logits, anchor): W1 bf16 N(0, 0.05), W2 quantized from
    N(0, 0.05), base logits bf16 N(0, 2)."""
    import jax.numpy as jnp

    import jax_markov as jm

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        w1 = jnp.asarray(rng.standard_normal((vocab, RANK), np.float32) * 0.05, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((vocab, RANK), np.float32) * 0.05)
        head = jm.quantize(jm.MarkovHead(w1, w2))
        base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32) * 2.0, jnp.bfloat16)
        anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
        sets.append((base, anchor, head))
    return sets


def cpu_arms():
    """name -> jitted fn(base, anchor, head) -> tokens, for the CPU rows (greedy)."""
    import jax

    import jax_markov as jm

    return {
        REFERENCE_ARM: jax.jit(lambda base, anchor, head: jm.reference.walk(base, anchor, head).tokens),
        FFI_ARM: jax.jit(lambda base, anchor, head: jm.walk(base, anchor, head, impl="ffi").tokens),
    }


def time_arms(arms: dict, sets, runs: int, warmup: int) -> tuple[dict, dict]:
    """Per arm: wall seconds and process CPU seconds (all threads) of `runs` calls, the arms taking
    turns, rotating over the sets."""
    for fn in arms.values():
        for _ in range(warmup):
            for s in sets:
                fn(*s).block_until_ready()
    times = {name: [] for name in arms}
    cpu = {name: [] for name in arms}
    for i in range(runs):
        s = sets[i % len(sets)]
        order = list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]
        for name, fn in order:
            c0, t0 = time.process_time(), time.perf_counter()
            fn(*s).block_until_ready()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return times, cpu


def floor_bytes(vocab: int, steps: int) -> int:
    """K passes over the int8 W2 and its fp32 scales."""
    return steps * vocab * (RANK + 4)


# ------------------------------------------------------------------------------------------------
# CPU rows


def run_cpu(args, bandwidth: float) -> list[dict]:
    import jax

    from jax_markov import native

    if not native.cpu_available():
        raise SystemExit("the jax_markov CPU custom call is not built: pip install . first")
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU rows stay on the CPU where a GPU exists
        return _cpu_rows(args, bandwidth)


def _cpu_rows(args, bandwidth: float) -> list[dict]:
    arms = cpu_arms()
    rows = []
    for batch in args.batch:
        sets = make_sets(args.vocab, args.steps, batch, args.sets, seed=batch)
        # the arms must agree (tokens equal up to near-ties; with these inputs, exactly)
        same = [bool(np.array_equal(arms[REFERENCE_ARM](*s), arms[FFI_ARM](*s))) for s in sets]
        times, cpu = time_arms(arms, sets, args.runs, args.warmup)
        floor_s = floor_bytes(args.vocab, args.steps) / bandwidth
        ref_median = statistics.median(times[REFERENCE_ARM])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(dict(platform="cpu", vocab=args.vocab, rank=RANK, steps=args.steps, batch=batch, mode="greedy",
                             arm=name, us=med * 1e6, us_min=min(ts) * 1e6,
                             us_p90=float(np.percentile(ts, 90)) * 1e6, runs=len(ts),
                             cpu_ms=statistics.median(cpu[name]) * 1e3,
                             speedup=ref_median / med, floor_us=floor_s * 1e6, floor_fraction=floor_s / med,
                             tokens_equal_reference=all(same)))
            print(f"  V={args.vocab} K={args.steps} B={batch:<3d} {name:28s} median {med * 1e6:10.1f} us  "
                  f"min {min(ts) * 1e6:10.1f} us  speedup {ref_median / med:5.2f}x  "
                  f"floor {floor_s / med:5.1%}  cpu {statistics.median(cpu[name]) * 1e3:8.1f} ms", flush=True)
        del sets
    return rows


def run_gpu(args) -> None:
    """On a machine with a CUDA GPU and the jax_markov CUDA module: the GPU table of
    benchmarks/gpu_timing.py (eager walk, reference on the int8 head, kernel), written to
    benchmarks/results/<gpu>.md/.json/.png, in a process of its own (it sets XLA's flags, which a
    process reads once). Elsewhere nothing."""
    import jax

    from jax_markov import native

    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if not gpus or not native.cuda_available():
        print("no CUDA GPU with the jax_markov CUDA module here: GPU rows skipped", flush=True)
        return
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_timing.py"), *(["--quick"] if args.quick else [])],
                   check=True)


# ------------------------------------------------------------------------------------------------
# the report


def markdown(meta: dict, rows: list[dict]) -> str:
    bw = meta["bandwidth"]
    lines = [
        "# Markov walk on the CPU",
        "",
        f"- command: `{meta['command']}`",
        f"- CPU: {meta['cpu']} ({meta['cpu_count']} logical cores), custom call SIMD path: {meta['isa']}",
        f"- jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python {meta['python']}; jax_markov from `{meta['package']}`",
        f"- commit: {meta['commit']}{' (dirty: ' + ', '.join(meta['changed_files']) + ')' if meta['dirty'] else ''}",
        f"- date: {meta['date']}; load average before / after: {meta['load_before']} / {meta['load_after']}",
        f"- memory bandwidth (numpy copy of {bw['bytes'] / 2**20:.0f} MiB, read + written): "
        f"{bw['one_thread'] / 1e9:.1f} GB/s one thread, {bw['all_threads'] / 1e9:.1f} GB/s {bw['threads']} threads",
        f"- timing: median of {meta['runs']} calls per arm after {meta['warmup']} warm-up round(s), arms taking "
        f"turns, rotating over {meta['sets']} input sets (own head, base logits, anchors); greedy rows, "
        "bf16 base logits and W1, int8 W2",
        f"- memory floor: K passes over the int8 W2 + fp32 scales, K * V * (r + 4) bytes, at "
        f"{bw['best'] / 1e9:.1f} GB/s; fraction of floor = floor / measured",
        "- the machine may be shared: a load average above its core count means other processes took CPU "
        "time and memory bandwidth from both arms (the arms take turns, so the speedup holds better than the "
        "absolute times; the min column is the least disturbed call)",
        "",
        "| config | arm | us per call (median) | speedup vs reference | memory floor us | fraction of floor "
        "| min us | fraction of floor at min | CPU ms per call (all threads) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        config = f"V={r['vocab']} r={r['rank']} K={r['steps']} B={r['batch']} {r['mode']}"
        lines.append(f"| {config} | {r['arm']} | {r['us']:.1f} | {r['speedup']:.2f}x | {r['floor_us']:.1f} | "
                     f"{r['floor_fraction']:.2f} | {r['us_min']:.1f} | {r['floor_us'] / r['us_min']:.2f} | "
                     f"{r['cpu_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--steps", type=int, default=7, help="K, draft steps")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="B values (one row each)")
    p.add_argument("--runs", type=int, default=21, help="timed calls per arm and config")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds over all input sets")
    p.add_argument("--sets", type=int, default=3, help="input sets to rotate over")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the copy measuring bandwidth")
    p.add_argument("--out-dir", default=None,
                   help=f"where cpu.md / cpu.json go (default {RESULTS.relative_to(ROOT)}; a temporary folder "
                        "with --quick)")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: V=4099, K=3, B=1,2, 3 runs")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU rows")
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.steps, args.batch, args.runs, args.sets, args.bandwidth_mib = 4099, 3, [1, 2], 3, 2, 64
    out_dir = Path(args.out_dir) if args.out_dir else (Path(tempfile.mkdtemp(prefix="markov_bench_")) if args.quick
                                                       else RESULTS)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT) if argv is None else "benchmarks/benchmark_markov_walk.py"
    command = "python3 " + shlex.join([script, *(sys.argv[1:] if argv is None else argv)])

    # The GPU table's process (run_gpu) needs the GPU's memory, which JAX would preallocate here.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jaxlib

    import jax_markov
    from jax_markov import native

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"measuring memory bandwidth ({args.bandwidth_mib} MiB copy) ...", flush=True)
    bandwidth = memory_bandwidth(args.bandwidth_mib * 2**20)
    print(f"  {bandwidth['one_thread'] / 1e9:.1f} GB/s one thread, {bandwidth['all_threads'] / 1e9:.1f} GB/s "
          f"{bandwidth['threads']} threads", flush=True)
    rows = [] if args.no_cpu else run_cpu(args, bandwidth["best"])

    meta = dict(command=command, cpu=cpu_model(), cpu_count=os.cpu_count(), isa=native._markov_cpu.isa()
                if native.cpu_available() else "not built", jax=jax.__version__, jaxlib=jaxlib.__version__,
                python=platform.python_version(), package=os.path.dirname(jax_markov.__file__), **git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                load_before=load_before, load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                bandwidth=bandwidth, runs=args.runs, warmup=args.warmup, sets=args.sets, quick=args.quick)
    table = markdown(meta, [r for r in rows if r["platform"] == "cpu"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu.md").write_text(table)
    (out_dir / "cpu.json").write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    print()
    print(table)
    print(f"wrote {out_dir / 'cpu.md'} and {out_dir / 'cpu.json'}")
    run_gpu(args)
    return rows


if __name__ == "__main__":
    main()
