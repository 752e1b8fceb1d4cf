"""GPU arms of benchmark_markov_walk.py: the eager walk (reference, bf16 head), the reference on the
int8 head, and the cooperative kernel on the int8 head and on the unquantized bf16 head, timed on
device with cold L2.

Timing: one jitted program walks N_SETS independent input sets (heads and base logits) in a chain
(each walk's anchor is the previous walk's last token, so nothing overlaps); N_SETS copies of the
head are larger than the L2, so every walk reads its W2 from HBM. The time per walk is the GPU's
busy time per program (kernels and copies, from the device activity that jax.profiler records)
divided by its walks, median over REPEATS programs. Beside it, the wall time per walk: host-timed
batches of 4 programs in flight, which the host's dispatch cost bounds where it exceeds the GPU's.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

if not __package__:  # run as `python3 benchmarks/gpu_timing.py`: `benchmarks` imports from the repository
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # root, last, so an installed jax_markov comes first

import jax_markov as jm  # noqa: E402
from benchmarks import design_floor  # noqa: E402

N_SETS = 4
ROWS = [(151936, 7, 1), (151936, 7, 16), (151936, 7, 64), (151936, 16, 1), (129280, 5, 1), (129280, 5, 64),
        (248320, 16, 1), (151936, 7, 128), (151936, 7, 256)]
# The published kernel of the same design on one H100 (greedy, V = 151936, K = 7), in us.
PUBLISHED_H100_US = {(151936, 7, 1): 60.0, (151936, 7, 16): 68.0, (151936, 7, 64): 112.0}
MODES = ("greedy", "probabilistic")
ARMS = ("eager (reference, bf16 head)", "reference, int8 head", "kernel (int8)", "kernel (bf16 head)")
KERNEL_INT8 = ARMS[2]


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second of a large device-to-device copy-like pass."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def make_sets(vocab: int, steps: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sets = []
    for i in range(N_SETS):
        w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        head = jm.MarkovHead(w1, w2)
        base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32) * 2.0, jnp.bfloat16)
        sets.append((head, jm.quantize(head), base))
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    temperature = jnp.full((batch,), 0.8, jnp.float32)
    keys = jax.random.split(jax.random.key(seed), batch)
    position = jnp.asarray(rng.integers(0, 4096, batch), jnp.int32)
    return sets, anchor, temperature, keys, position


def chained_program(arm: str, mode: str):
    impl = "ffi" if arm.startswith("kernel") else "reference"
    use_int8 = "int8" in arm

    def walk_all(sets, anchor, temperature, keys, position):
        outs = []
        for head, qhead, base in sets:
            kw = {}
            if mode == "probabilistic":
                kw = dict(temperature=temperature, key=keys, position=position, return_logits=True,
                          logits_dtype=jnp.bfloat16)
            res = jm.walk(base, anchor, qhead if use_int8 else head, impl=impl, **kw)
            anchor = res.tokens[:, -1]
            outs.append(res.tokens if res.logits is None else (res.tokens, res.logits))
        return outs

    return jax.jit(walk_all)


ARM_GAP_S = 0.05  # host pause between the arms' profiled programs: an idle gap on the GPU


def gpu_events(trace_dir: str) -> list[tuple[float, float]]:
    """(start, stop) in ns of every kernel and copy in the GPU streams of the profiler trace in
    trace_dir (CUPTI device activity); empty if it holds none."""
    import glob

    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    events = []
    for plane in (ProfileData.from_file(files[0]).planes if files else []):
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
    return sorted(events)


def split_at_gaps(events: list[tuple[float, float]], gap_ns: float) -> list[list[tuple[float, float]]]:
    """Time-ordered events cut wherever the GPU idles longer than gap_ns."""
    groups, end = [], float("-inf")
    for start, stop in events:
        if start - end > gap_ns:
            groups.append([])
        groups[-1].append((start, stop))
        end = max(end, stop)
    return groups


def busy_per_program(events: list[tuple[float, float]], programs: int) -> list[float]:
    """Busy time (the union of the (start, stop) intervals) of each of `programs` equal, consecutive
    groups of events in time order; empty when the events do not split evenly."""
    events = sorted(events)
    if not events or len(events) % programs:
        return []
    per = len(events) // programs
    busy = []
    for i in range(programs):
        total, end = 0.0, float("-inf")
        for start, stop in events[i * per:(i + 1) * per]:
            total += max(0.0, stop - max(start, end))
            end = max(end, stop)
        busy.append(total)
    return busy


def time_arms(arms, mode, sets, anchor, temperature, keys, position, repeats: int = 30) -> dict:
    """{arm: (device seconds, wall seconds) per walk}. The device time is the median over programs of
    their GPU busy time in the profiler's device trace, which a host slower than the GPU does not
    inflate (all arms in one trace, apart by ARM_GAP_S); the wall time is the median of host-timed
    batches of 4 programs in flight."""
    import tempfile

    args = (sets, anchor, temperature, keys, position)
    programs, walls = {}, {}
    for arm in arms:
        program = programs[arm] = chained_program(arm, mode)
        jax.block_until_ready(program(*args))
        jax.block_until_ready(program(*args))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready([program(*args) for _ in range(4)])
            samples.append((time.perf_counter() - t0) / (4 * N_SETS))
        walls[arm] = statistics.median(samples)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for arm in arms:
                time.sleep(ARM_GAP_S)
                for _ in range(repeats):
                    jax.block_until_ready(programs[arm](*args))
        per_arm = split_at_gaps(gpu_events(trace_dir), gap_ns=ARM_GAP_S * 0.5e9)
    busy = [busy_per_program(events, repeats) for events in per_arm]
    if len(busy) != len(arms) or not all(busy):
        warnings.warn("the profiler trace does not show each arm's programs: reporting wall time",
                      RuntimeWarning, stacklevel=2)
        return {arm: (walls[arm], walls[arm]) for arm in arms}
    return {arm: (statistics.median(b) * 1e-9 / N_SETS, walls[arm]) for arm, b in zip(arms, busy)}


def w2_element_bytes(arm: str) -> int:
    """1 for the arms that walk the int8 head, 2 for those that walk the bf16 head."""
    return 1 if "int8" in arm else 2


def floor_bytes(vocab: int, steps: int, batch: int, mode: str, w2_bytes_per_element: int = 1) -> int:
    """Bytes that must move: W2 (and its scales, int8) once, base logits once, outputs once."""
    w2 = vocab * 256 * w2_bytes_per_element + (4 * vocab if w2_bytes_per_element == 1 else 0)
    base = batch * steps * vocab * 2
    out = batch * steps * 4 + (batch * steps * vocab * 2 if mode == "probabilistic" else 0)
    return w2 + base + out


def run_gpu(rows=ROWS, modes=MODES, repeats: int = 30, log=print, on_row=None):
    """Times every arm on every row; returns the copy bandwidth, the design constants measured by the
    probe kernels (None without them) and one result dict per (row, mode, arm). on_row(bandwidth,
    constants, results so far) runs after each row, so that a long run leaves its table as it goes."""
    constants = design_floor.measure()
    bandwidth = constants["hbm_copy_bytes_per_s"] if constants else measure_copy_bandwidth()
    log(f"measured copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    results = []
    for vocab, steps, batch in rows:
        data = make_sets(vocab, steps, batch)
        for mode in modes:
            floors = {}  # W2 bytes per element -> (bytes floor, design floor) in us
            for eb in (1, 2):
                design_us = float("nan")
                if constants:
                    out = batch * steps * 4 + (batch * steps * vocab * 2 if mode == "probabilistic" else 0)
                    design_us = design_floor.design_floor_us(
                        constants, vocab, steps, batch, base_bytes=batch * steps * vocab * 2, out_bytes=out,
                        sm_count=constants["sm_count"], smem_per_block=constants["smem_per_block"],
                        w2_element_bytes=eb, sampled=mode == "probabilistic")["design_floor_us"]
                floors[eb] = (floor_bytes(vocab, steps, batch, mode, eb) / bandwidth * 1e6, design_us)
            timed = time_arms(ARMS, mode, *data, repeats=repeats)
            times = {arm: timed[arm][0] * 1e6 for arm in ARMS}
            walls = {arm: timed[arm][1] * 1e6 for arm in ARMS}
            for arm in ARMS:
                log(f"  V={vocab} K={steps} B={batch} {mode:13s} {arm:30s} {times[arm]:9.1f} us device "
                    f"{walls[arm]:9.1f} us wall")
            eager = times[ARMS[0]]
            for arm in ARMS:
                floor_us, design_us = floors[w2_element_bytes(arm)]
                results.append(dict(vocab=vocab, steps=steps, batch=batch, mode=mode, arm=arm, us=times[arm],
                                    wall_us=walls[arm], speedup=eager / times[arm], floor_us=floor_us,
                                    floor_fraction=floor_us / times[arm], design_floor_us=design_us,
                                    design_fraction=design_us / times[arm],
                                    published_h100_us=PUBLISHED_H100_US.get((vocab, steps, batch))
                                    if mode == "greedy" and arm == KERNEL_INT8 else None))
        del data
        if on_row is not None:
            on_row(bandwidth, constants, results)
    return bandwidth, constants, results


def write_report(bandwidth, constants, results, out_prefix: str, *, command: str, gpu: str, commit: str) -> str:
    """Writes <out_prefix>.md, .json and (with matplotlib) .png; returns the markdown table."""
    import json
    import pathlib

    lines = [f"# Markov walk on {gpu}", "",
             f"- command: `{command}`", f"- GPU: {gpu}", f"- jax {jax.__version__}", f"- commit: {commit}",
             f"- measured copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)",
             f"- timing: {N_SETS} input sets walked in a chain per program (cold L2); us/call is the GPU's busy time"
             " per walk from the profiler's device activity, median over repeats (the floors and speedups use it);"
             " wall us/call is host-timed with 4 programs in flight",
             "- bytes floor: W2 once (the arm's head: int8 + scales, or bf16), base logits (bf16) once, outputs"
             " once, at the copy bandwidth; probabilistic rows sample every request at T = 0.8 and return bf16"
             " draft logits",
             "- design floor (benchmarks/design_floor.py): max(bytes floor, W2 load + K x (one on-chip pass over"
             " W2 + one grid-wide exchange)), the pass taking the tensor-core time or, for probabilistic rows, the"
             " Gumbel noise's time where that is longer, from constants the probe kernels measured on this GPU:", ""]
    if constants:
        lines += [design_floor.report(constants, rows=[]).split("\n\n")[0], ""]
    lines += ["| V | K | B | mode | arm | us/call | wall us/call | speedup vs eager | bytes floor us "
              "| fraction of bytes floor | design floor us | fraction of design floor | published H100 kernel us |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        published = f"{r['published_h100_us']:.0f}" if r.get("published_h100_us") else ""
        lines.append(f"| {r['vocab']} | {r['steps']} | {r['batch']} | {r['mode']} | {r['arm']} | {r['us']:.1f} | "
                     f"{r['wall_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['floor_us']:.1f} | {r['floor_fraction']:.2f} | "
                     f"{r['design_floor_us']:.1f} | {r['design_fraction']:.2f} | {published} |")
    table = "\n".join(lines) + "\n"
    prefix = pathlib.Path(out_prefix)
    prefix.with_suffix(".md").write_text(table)
    prefix.with_suffix(".json").write_text(json.dumps(dict(command=command, gpu=gpu, jax=jax.__version__,
                                                           commit=commit, bandwidth=bandwidth,
                                                           design_constants=constants, rows=results),
                                                      indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table
    configs = sorted({(r["vocab"], r["steps"], r["batch"], r["mode"]) for r in results},
                     key=lambda c: (c[3], c[0], c[1], c[2]))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(configs)), 5))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        ys = [next(r["us"] for r in results if (r["vocab"], r["steps"], r["batch"], r["mode"]) == c and r["arm"] == arm)
              for c in configs]
        ax.bar([x + i * width for x in range(len(configs))], ys, width, label=arm)
    # Each arm's floors (they depend on its head's W2 bytes), marked on its own bar.
    for i, arm in enumerate(ARMS):
        rows = [next(r for r in results if (r["vocab"], r["steps"], r["batch"], r["mode"]) == c and r["arm"] == arm)
                for c in configs]
        xs = [x + i * width for x in range(len(configs))]
        ax.scatter(xs, [r["floor_us"] for r in rows], marker="_", s=150, color="k",
                   label="bytes floor" if i == 0 else None)
        ax.scatter(xs, [r["design_floor_us"] for r in rows], marker="_", s=150, color="r",
                   label="design floor" if i == 0 else None)
    ax.set_xticks([x + width for x in range(len(configs))])
    ax.set_xticklabels([f"V={c[0]}\nK={c[1]} B={c[2]}\n{c[3][:5]}" for c in configs], fontsize=7)
    ax.set_ylabel("us per call (log)")
    ax.set_yscale("log")
    ax.set_title(f"DSpark Markov walk on {gpu}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=120)
    return table


def main(argv=None):
    import argparse
    import os
    import subprocess

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benchmarks/results/h200", help="output prefix (.md, .json, .png)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="two rows only")
    args = p.parse_args(argv)
    rows = ROWS[:1] + ROWS[2:3] if args.quick else ROWS
    gpu = jax.devices()[0].device_kind
    commit = os.environ.get("JAX_MARKOV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    command = "python3 " + " ".join(sys.argv if argv is None else ["benchmarks/benchmark_markov_walk.py"])
    report = lambda bandwidth, constants, results: write_report(bandwidth, constants, results, args.out,
                                                                command=command, gpu=gpu, commit=commit)
    bandwidth, constants, results = run_gpu(rows=rows, repeats=args.repeats, log=lambda s: print(s, flush=True),
                                            on_row=report)
    print(report(bandwidth, constants, results))


if __name__ == "__main__":
    main()
