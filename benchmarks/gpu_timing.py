"""GPU table of benchmark_markov_walk.py: the eager walk (reference, bf16 head), the reference on the
int8 head, and the cooperative kernel on the int8 head and on the unquantized bf16 head, timed on
device with cold L2, beside the floors and the published H100 kernel of the same design.

    python3 benchmarks/gpu_timing.py                      # every row, mode and arm: benchmarks/results/<gpu>.*
    python3 benchmarks/gpu_timing.py --out OUT/h200 --repeats 5 --rows 151936,7,1 151936,7,16 \\
        --modes greedy probabilistic --arms kernel-int8 eager
    python3 benchmarks/gpu_timing.py --merge OUT1/h200.json OUT2/h200.json --out benchmarks/results/h200

Rows (V, K, B): the seven of the published figures (PUBLISHED_H100_US) and two wider batches.
Modes: greedy (no sampling arguments, tokens out), probabilistic (every request sampled at T = 0.8,
bf16 draft logits out) and greedy-t0 (the greedy batch passed as a serving loop passes a batch whose
rows may be greedy or sampled: temperature 0 for every request, with keys and positions; tokens out).

Timing (us/call): one jitted program walks N_SETS independent input sets (heads and base logits) in
a chain (each walk's anchor is the previous walk's last token, so nothing overlaps); N_SETS copies of
the head are larger than the L2, so every walk reads its W2 from HBM. The time per walk is the GPU's
busy time per program (kernels and copies, from the device activity that jax.profiler records)
divided by its walks, median over the repeats. Beside it, the wall time per walk: host-timed batches
of 4 programs in flight, which the host's dispatch cost bounds where it exceeds the GPU's.

Decode loop (us/iter): a jitted lax.fori_loop whose every iteration first reduces a buffer twice the
L2 (so the walk's W2 and inputs come from HBM), then walks from the last token; its device time per
iteration (first kernel start to last kernel end of a run, so launch gaps count) minus that of the
same loop without the walk, median over the repeats. Measured with XLA's default command buffers in
this process (with --xla_enable_command_buffers_during_profiling=true: XLA runs them op by op under a
profiler otherwise) and with command buffers off (--xla_gpu_enable_command_buffer=) in a child
process for each row, since XLA reads its flags once, at start: main() sets them, so it must run
before anything in its process uses JAX (benchmark_markov_walk.py starts it as a process of its own).

Memory per call: the head's persistent layouts (W1 and the W2 the arm walks: int8 + fp32 scales, or
bf16) and the scratch that XLA allocates for one walk (the compiled executable's temp size).

The table is written after every row (so a run cut short keeps its rows), as <out>.md, .json and,
with matplotlib, .png; --merge joins the .json of runs over different rows (one GPU, one commit)
into one table that records every run's command.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
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
from jax_markov import native  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
N_SETS = 4
ROWS = [(151936, 7, 1), (151936, 7, 16), (151936, 7, 64), (151936, 16, 1), (129280, 5, 1), (129280, 5, 64),
        (248320, 16, 1), (151936, 7, 128), (151936, 7, 256)]
# The published kernel of this design (vLLM, sm_90, int8 W2, one cooperative launch) on one H100:
# CUPTI, CUDA graph, cold L2, median us per call for all draft steps (shared/PEERS.md).
PUBLISHED_H100_US = {
    (151936, 7, 1, "greedy"): 60.5, (151936, 7, 1, "probabilistic"): 80.9,
    (151936, 7, 16, "greedy"): 68.0, (151936, 7, 16, "probabilistic"): 91.4,
    (151936, 7, 64, "greedy"): 112.3, (151936, 7, 64, "probabilistic"): 179.8,
    (151936, 16, 1, "greedy"): 124.9, (151936, 16, 1, "probabilistic"): 172.4,
    (129280, 5, 1, "greedy"): 41.8, (129280, 5, 1, "probabilistic"): 54.8,
    (129280, 5, 64, "greedy"): 77.1, (129280, 5, 64, "probabilistic"): 114.3,
    (248320, 16, 1, "greedy"): 270.3, (248320, 16, 1, "probabilistic"): 324.6,
}
MODES = ("greedy", "probabilistic", "greedy-t0")
# Arm (as the command line names it) -> its name in the tables.
ARMS = {"eager": "eager (reference, bf16 head)", "reference-int8": "reference, int8 head",
        "kernel-int8": "kernel (int8)", "kernel-bf16": "kernel (bf16 head)"}
KERNEL_INT8 = ARMS["kernel-int8"]
EAGER = ARMS["eager"]
# The arms each mode times unless --arms names others: greedy-t0 asks whether the int8 kernel slows
# down for sampling arguments that sample nothing.
MODE_ARMS = {"greedy": tuple(ARMS), "probabilistic": tuple(ARMS), "greedy-t0": ("kernel-int8",)}
# The issue's target for the int8 kernel's probabilistic / greedy device time: up to 16 requests, above.
SAMPLED_RATIO_TARGET = ((16, 1.3), (None, 1.5))
DECODE_ITERATIONS = 16
# Host pauses in a profiled trace, idle gaps on the GPU that tell the programs (ARM_GAP_S) and each
# program's runs (RUN_GAP_S) apart.
ARM_GAP_S = 0.05
RUN_GAP_S = 0.002
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="  # an empty list of command-buffer types: off
# XLA runs command buffers op by op while a profiler is active, unless told otherwise.
PROFILED_COMMAND_BUFFERS = "--xla_enable_command_buffers_during_profiling=true"


# ------------------------------------------------------------------------------------------------
# inputs and programs


def make_sets(vocab: int, steps: int, batch: int, n_sets: int = N_SETS, seed: int = 0):
    """n_sets independent ((bf16 head, its int8 quantization), base logits), and the anchors; the
    first set is the same for every n_sets."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        head = jm.MarkovHead(w1, w2)
        base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32) * 2.0, jnp.bfloat16)
        sets.append(((head, jm.quantize(head)), base))
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    return sets, anchor


def mode_inputs(mode: str, batch: int, seed: int = 0) -> dict:
    """The per-request sampling arguments of a mode: none for greedy; otherwise temperatures (0.8, or
    0 for greedy-t0), one PRNG key per request and positions."""
    if mode == "greedy":
        return {}
    temperature = np.zeros(batch, np.float32) if mode == "greedy-t0" else np.full(batch, 0.8, np.float32)
    position = np.random.default_rng(seed).integers(0, 4096, batch)
    return dict(temperature=jnp.asarray(temperature), key=jax.random.split(jax.random.key(seed), batch),
                position=jnp.asarray(position, jnp.int32))


def arm_head(arm: str, heads):
    """The head an arm walks, of (bf16 head, int8 head)."""
    return heads[1] if "int8" in arm else heads[0]


def walk_arm(arm: str, mode: str, head, base, anchor, inputs: dict):
    """One walk of an arm ("eager", "kernel-int8", ...) in a mode; probabilistic walks return bf16 logits."""
    impl = "ffi" if arm.startswith("kernel") else "reference"
    logits = dict(return_logits=True, logits_dtype=jnp.bfloat16) if mode == "probabilistic" else {}
    return jm.walk(base, anchor, head, impl=impl, **inputs, **logits)


def chained_program(arm: str, mode: str):
    """jit(sets, anchor, inputs): a walk of every input set, each from the previous one's last token."""
    def walk_all(sets, anchor, inputs):
        outs = []
        for heads, base in sets:
            res = walk_arm(arm, mode, arm_head(arm, heads), base, anchor, inputs)
            anchor = res.tokens[:, -1]
            outs.append(res.tokens if res.logits is None else (res.tokens, res.logits))
        return outs

    return jax.jit(walk_all)


FLUSH_NEVER = 4.0  # above every max(flush + x) of the decode loop (flush in [0, 1), x in {0, 1})


def decode_loop_program(arm: str | None, mode: str, iterations: int):
    """jit(flush, head, base, anchor, inputs, logits): `iterations` draft rounds in a lax.fori_loop.
    Each round first reduces `flush` (a buffer larger than the L2, which evicts the walk's W2 and
    inputs), then walks from the last token; arm None is the same loop without the walk. The
    reduction's result feeds the walk's anchor and the walk's last token the next reduction, so that
    neither is hoisted out of the loop or moved past the other. Probabilistic rounds keep their bf16
    logits in the loop's carry (`logits`, [B, K, V]), as a serving loop keeps them for acceptance;
    the other modes pass logits=None. Sampled rounds advance the positions by K."""
    def program(flush, head, base, anchor, inputs, logits):
        steps = base.shape[1]

        def body(i, carry):
            anchor, x, logits = carry
            r = jnp.max(flush + x)
            anchor = anchor + (r > FLUSH_NEVER).astype(jnp.int32)  # a data dependence, never a change
            if arm is not None:
                round_inputs = dict(inputs)
                if "position" in inputs:
                    round_inputs["position"] = inputs["position"] + i * steps
                res = walk_arm(arm, mode, head, base, anchor, round_inputs)
                anchor = res.tokens[:, -1]
                logits = logits if res.logits is None else res.logits
            return anchor, (anchor[0] % 2).astype(jnp.float32), logits

        return jax.lax.fori_loop(0, iterations, body, (anchor, jnp.float32(0), logits))

    return jax.jit(program)


def flush_buffer(l2_bytes: int):
    """float32 values in [0, 1), twice the L2's bytes."""
    return jax.random.uniform(jax.random.key(1), (2 * l2_bytes // 4,), jnp.float32)


def memory_per_call(arm: str, mode: str, head, base, anchor, inputs: dict) -> dict:
    """The head's persistent bytes (its layouts: W1 and the W2 the arm walks) and the scratch bytes
    that XLA allocates for one walk of the arm (the compiled executable's temp size)."""
    compiled = jax.jit(lambda head, base, anchor, inputs: walk_arm(arm, mode, head, base, anchor, inputs)).lower(
        head, base, anchor, inputs).compile()
    return dict(persistent_bytes=int(head.nbytes), scratch_bytes=int(compiled.memory_analysis().temp_size_in_bytes))


# ------------------------------------------------------------------------------------------------
# device time from the profiler


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


def busy_and_span(events: list[tuple[float, float]]) -> tuple[float, float]:
    """The busy time (the union of the (start, stop) intervals) and the span (last stop minus first
    start) of time-ordered events."""
    busy, end = 0.0, float("-inf")
    for start, stop in events:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy, end - events[0][0]


def run_times(events: list[tuple[float, float]], runs: int) -> list[tuple[float, float]] | None:
    """(busy, span) of each run in one program's time-ordered events, the runs apart by RUN_GAP_S;
    None where the events do not make `runs` runs."""
    split = split_at_gaps(events, gap_ns=RUN_GAP_S * 0.5e9)
    return [busy_and_span(run) for run in split] if len(split) == runs else None


def profile_programs(programs: dict, repeats: int) -> dict | None:
    """{name: [(busy ns, span ns) per run]} of `repeats` runs of each (warmed-up) program fn() in one
    profiler trace, the programs ARM_GAP_S apart and their runs RUN_GAP_S apart; None where the
    trace does not show them so."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for fn in programs.values():
                time.sleep(ARM_GAP_S)
                for _ in range(repeats):
                    time.sleep(RUN_GAP_S)
                    jax.block_until_ready(fn())
        groups = split_at_gaps(gpu_events(trace_dir), gap_ns=ARM_GAP_S * 0.5e9)
    times = [run_times(group, repeats) for group in groups]
    if len(times) != len(programs) or None in times:
        return None
    return dict(zip(programs, times))


def time_chained(arms, mode: str, sets, anchor, inputs: dict, repeats: int) -> dict:
    """{arm: dict(us=device us per walk, wall_us=host-timed us per walk)}: the chained programs' median
    busy time and the median of host-timed batches of 4 programs in flight (where the profiler shows no
    device activity, the wall time stands for both, with a warning)."""
    programs, walls = {}, {}
    for arm in arms:
        program = chained_program(arm, mode)
        programs[arm] = lambda program=program: program(sets, anchor, inputs)
        jax.block_until_ready(programs[arm]())
        jax.block_until_ready(programs[arm]())
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready([programs[arm]() for _ in range(4)])
            samples.append((time.perf_counter() - t0) / (4 * N_SETS))
        walls[arm] = statistics.median(samples) * 1e6
    profiled = profile_programs(programs, repeats)
    if profiled is None:
        warnings.warn("the profiler trace does not show each arm's programs: reporting wall time",
                      RuntimeWarning, stacklevel=2)
        return {arm: dict(us=walls[arm], wall_us=walls[arm]) for arm in arms}
    return {arm: dict(us=statistics.median(b for b, _ in profiled[arm]) * 1e-3 / N_SETS, wall_us=walls[arm])
            for arm in arms}


def loop_walk_us(with_walk: list[tuple[float, float]], without: list[tuple[float, float]],
                 iterations: int) -> dict:
    """The walk's cost per decode-loop iteration from the (busy ns, span ns) runs of the loop with the
    walk and without it: medians' difference over the iterations, span (us) and busy (busy_us)."""
    def per_iteration(column):
        return (statistics.median(t[column] for t in with_walk)
                - statistics.median(t[column] for t in without)) * 1e-3 / iterations

    return dict(us=per_iteration(1), busy_us=per_iteration(0))


def time_decode_loop(arms, mode: str, heads, base, anchor, inputs: dict, repeats: int, iterations: int) -> dict:
    """{arm: dict(us=, busy_us=)}: the walk's device time per decode-loop iteration (loop_walk_us),
    all arms and the loop without a walk in one trace; {} where the profiler shows no device activity."""
    flush = flush_buffer(native._gpu_properties()["l2_bytes"])
    logits = jnp.zeros(base.shape, jnp.bfloat16) if mode == "probabilistic" else None
    programs = {}
    for arm in (None, *arms):
        program = decode_loop_program(arm, mode, iterations)
        head = arm_head(arm, heads) if arm else heads[1]
        programs[arm] = lambda program=program, head=head: program(flush, head, base, anchor, inputs, logits)
        jax.block_until_ready(programs[arm]())
        jax.block_until_ready(programs[arm]())
    profiled = profile_programs(programs, repeats)
    if profiled is None:
        warnings.warn("the profiler trace does not show the decode loops: no decode-loop column",
                      RuntimeWarning, stacklevel=2)
        return {}
    return {arm: loop_walk_us(profiled[arm], profiled[None], iterations) for arm in arms}


# ------------------------------------------------------------------------------------------------
# the runs


def mode_arms(mode: str, arms=None) -> tuple:
    """The arms to time in a mode: `arms` where given, else the mode's own (MODE_ARMS)."""
    return tuple(arms) if arms else MODE_ARMS[mode]


def run_gpu(rows=ROWS, modes=MODES, arms=None, repeats: int = 15, iterations: int = DECODE_ITERATIONS,
            log=print, on_row=None, without_command_buffers: bool = False):
    """Times the arms of every row and mode; returns the copy bandwidth, the design constants that the
    probe kernels measured (None without them) and one measured row dict per (row, mode, arm). With
    without_command_buffers, each row's decode loops are also timed in a child process with command
    buffers off. on_row(bandwidth, constants, rows so far) runs after each row, so that a long run
    leaves its table as it goes."""
    constants = design_floor.measure()
    bandwidth = constants["hbm_copy_bytes_per_s"] if constants else measure_copy_bandwidth()
    log(f"measured copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    results = []
    for vocab, steps, batch in rows:
        sets, anchor = make_sets(vocab, steps, batch)
        heads, base = sets[0]
        for mode in modes:
            inputs = mode_inputs(mode, batch)
            chosen = mode_arms(mode, arms)
            timed = time_chained(chosen, mode, sets, anchor, inputs, repeats)
            loop = time_decode_loop(chosen, mode, heads, base, anchor, inputs, repeats, iterations)
            for arm in chosen:
                memory = memory_per_call(arm, mode, arm_head(arm, heads), base, anchor, inputs)
                row = dict(vocab=vocab, steps=steps, batch=batch, mode=mode, arm=ARMS[arm], **timed[arm],
                           decode_loop_us=loop.get(arm, {}).get("us"),
                           decode_loop_busy_us=loop.get(arm, {}).get("busy_us"), **memory)
                results.append(row)
                log(f"  V={vocab} K={steps} B={batch} {mode:13s} {arm:15s} {row['us']:9.1f} us device "
                    f"{row['wall_us']:9.1f} us wall {fmt(row['decode_loop_us'], '9.1f')} us/iter decode loop "
                    f"{memory['scratch_bytes'] / 1e6:8.1f} MB scratch")
        del sets, heads, base
        if without_command_buffers:
            add_no_command_buffer_loops(results, run_decode_loops_without_command_buffers(
                [(vocab, steps, batch)], modes, arms, repeats, iterations, log))
        if on_row is not None:
            on_row(bandwidth, constants, results)
    return bandwidth, constants, results


def run_decode_loops(rows=ROWS, modes=MODES, arms=None, repeats: int = 15,
                     iterations: int = DECODE_ITERATIONS) -> list[dict]:
    """The decode-loop column alone (the child process with command buffers off): one dict per
    (row, mode, arm) with decode_loop_us and decode_loop_busy_us."""
    out = []
    for vocab, steps, batch in rows:
        sets, anchor = make_sets(vocab, steps, batch, n_sets=1)
        heads, base = sets[0]
        for mode in modes:
            chosen = mode_arms(mode, arms)
            loop = time_decode_loop(chosen, mode, heads, base, anchor, mode_inputs(mode, batch), repeats, iterations)
            out += [dict(vocab=vocab, steps=steps, batch=batch, mode=mode, arm=ARMS[arm],
                         decode_loop_us=loop[arm]["us"], decode_loop_busy_us=loop[arm]["busy_us"])
                    for arm in chosen if arm in loop]
        del sets, heads, base
    return out


def selection_args(rows, modes, arms, repeats: int, iterations: int) -> list[str]:
    """The command-line arguments that select these rows, modes and arms (for the child process)."""
    args = ["--rows", *(f"{v},{k},{b}" for v, k, b in rows), "--modes", *modes, "--repeats", str(repeats),
            "--iterations", str(iterations)]
    return args + (["--arms", *arms] if arms else [])


def with_flag(flags: str, flag: str) -> str:
    """XLA_FLAGS `flags` with `flag` appended, unless it is among them."""
    return flags if flag in flags.split() else f"{flags} {flag}".strip()


def no_command_buffer_flags() -> str:
    """XLA_FLAGS of the child process: this process's, with command buffers off."""
    return with_flag(os.environ.get("XLA_FLAGS", ""), NO_COMMAND_BUFFERS)


def run_decode_loops_without_command_buffers(rows, modes, arms, repeats: int, iterations: int, log=print) -> list[dict]:
    """run_decode_loops in a child process whose XLA has command buffers off (this process's flags
    are fixed at its start); [] (with a warning) if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode_loops.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--decode-loop-only", str(path),
               *selection_args(rows, modes, arms, repeats, iterations)]
        log(f"decode loops with command buffers off: XLA_FLAGS='{no_command_buffer_flags()}' {shlex.join(cmd)}")
        done = subprocess.run(cmd, env=dict(os.environ, XLA_FLAGS=no_command_buffer_flags()), capture_output=True,
                              text=True)
        if done.returncode != 0 or not path.exists():
            warnings.warn(f"the decode loops with command buffers off failed:\n{done.stdout[-2000:]}"
                          f"{done.stderr[-2000:]}", RuntimeWarning, stacklevel=2)
            return []
        return json.loads(path.read_text())


def add_no_command_buffer_loops(results: list[dict], loops: list[dict]) -> None:
    """Puts the child's decode-loop times into the rows they belong to, as
    decode_loop_no_cmd_buffer_us and decode_loop_no_cmd_buffer_busy_us."""
    by_key = {row_key(r): r for r in loops}
    for r in results:
        loop = by_key.get(row_key(r))
        if loop is not None:
            r["decode_loop_no_cmd_buffer_us"] = loop["decode_loop_us"]
            r["decode_loop_no_cmd_buffer_busy_us"] = loop["decode_loop_busy_us"]


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second of a large device-to-device copy-like pass (without the probes)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


# ------------------------------------------------------------------------------------------------
# floors, derived columns and summaries (no GPU needed)


def w2_element_bytes(arm: str) -> int:
    """1 for the arms that walk the int8 head, 2 for those that walk the bf16 head."""
    return 1 if "int8" in arm else 2


def out_bytes(vocab: int, steps: int, batch: int, mode: str) -> int:
    """Tokens (int32), and for probabilistic walks the bf16 draft logits."""
    return batch * steps * 4 + (batch * steps * vocab * 2 if mode == "probabilistic" else 0)


def floor_bytes(vocab: int, steps: int, batch: int, mode: str, w2_bytes_per_element: int = 1) -> int:
    """Bytes that must move: W2 (and its scales, int8) once, base logits once, outputs once."""
    w2 = vocab * 256 * w2_bytes_per_element + (4 * vocab if w2_bytes_per_element == 1 else 0)
    return w2 + batch * steps * vocab * 2 + out_bytes(vocab, steps, batch, mode)


def row_key(r: dict) -> tuple:
    return r["vocab"], r["steps"], r["batch"], r["mode"], r["arm"]


def complete_rows(rows: list[dict], bandwidth: float, constants: dict | None) -> list[dict]:
    """The rows with the fields computed from the measured ones: speedup against the eager arm of the same row and mode
    (None where it was not timed), both floors and the fractions of them reached, and the published
    H100 figure on the int8 kernel's rows. Sorted by ROWS, MODES and ARMS."""
    eager = {row_key(r)[:4]: r["us"] for r in rows if r["arm"] == EAGER}
    out = []
    for r in rows:
        vocab, steps, batch, mode = row_key(r)[:4]
        eb = w2_element_bytes(r["arm"])
        floor_us = floor_bytes(vocab, steps, batch, mode, eb) / bandwidth * 1e6
        design_us = float("nan")
        if constants:
            design_us = design_floor.design_floor_us(
                constants, vocab, steps, batch, base_bytes=batch * steps * vocab * 2,
                out_bytes=out_bytes(vocab, steps, batch, mode), sm_count=constants["sm_count"],
                smem_per_block=constants["smem_per_block"], w2_element_bytes=eb,
                sampled=mode == "probabilistic")["design_floor_us"]
        base = eager.get((vocab, steps, batch, mode))
        out.append(dict(r, speedup=base / r["us"] if base else None, floor_us=floor_us,
                        floor_fraction=floor_us / r["us"], design_floor_us=design_us,
                        design_fraction=design_us / r["us"],
                        published_h100_us=PUBLISHED_H100_US.get((vocab, steps, batch, mode))
                        if r["arm"] == KERNEL_INT8 else None))
    return sorted(out, key=sort_key)


def sort_key(r: dict) -> tuple:
    shape = (r["vocab"], r["steps"], r["batch"])
    return (ROWS.index(shape) if shape in ROWS else len(ROWS), shape,
            MODES.index(r["mode"]) if r["mode"] in MODES else len(MODES), r["mode"],
            list(ARMS.values()).index(r["arm"]) if r["arm"] in ARMS.values() else len(ARMS), r["arm"])


def published_summary(rows: list[dict]) -> dict:
    """Per mode with published figures: of the published cells that the int8 kernel's rows cover
    (`cells`), on how many it is faster in device time (`faster`), and of those with a decode-loop
    time (`loop_cells`), on how many that is below the published figure (`loop_faster`)."""
    summary = {}
    for r in rows:
        published = PUBLISHED_H100_US.get((r["vocab"], r["steps"], r["batch"], r["mode"]))
        if r["arm"] != KERNEL_INT8 or published is None:
            continue
        s = summary.setdefault(r["mode"], dict(cells=0, faster=0, loop_cells=0, loop_faster=0))
        s["cells"] += 1
        s["faster"] += r["us"] < published
        if r.get("decode_loop_us") is not None:
            s["loop_cells"] += 1
            s["loop_faster"] += r["decode_loop_us"] < published
    return summary


def sampled_target(batch: int) -> float:
    """The issue's bound on the int8 kernel's probabilistic / greedy device time at this batch."""
    return next(bound for most, bound in SAMPLED_RATIO_TARGET if most is None or batch <= most)


def mode_ratios(rows: list[dict]) -> list[dict]:
    """Per row shape with an int8-kernel greedy time: probabilistic / greedy and greedy-t0 / greedy of
    the int8 kernel's device time (None where a mode was not timed), and the target of the first."""
    us = {row_key(r)[:4]: r["us"] for r in rows if r["arm"] == KERNEL_INT8}
    out = []
    for (vocab, steps, batch, mode), greedy in us.items():
        if mode != "greedy":
            continue
        sampled, zero = us.get((vocab, steps, batch, "probabilistic")), us.get((vocab, steps, batch, "greedy-t0"))
        out.append(dict(vocab=vocab, steps=steps, batch=batch, greedy_us=greedy, probabilistic_us=sampled,
                        sampled_ratio=sampled / greedy if sampled else None, target=sampled_target(batch),
                        greedy_t0_us=zero, zero_temperature_ratio=zero / greedy if zero else None))
    return out


def fmt(value, spec: str) -> str:
    """value formatted by spec; blank for None and NaN (a column that a row does not have)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


# ------------------------------------------------------------------------------------------------
# the report


def markdown(table: dict) -> str:
    """The .md of a table (the dict that the .json holds)."""
    rows, runs = table["rows"], table["runs"]
    lines = [f"# Markov walk on {table['gpu']}", ""]
    lines += [f"- command: `{run['command']}` (XLA_FLAGS: `{run['xla_flags'] or 'none'}`)" for run in runs]
    if table.get("merge_command"):
        lines.append(f"- merged into one table by `{table['merge_command']}`")
    lines += [f"- GPU: {table['gpu']}", f"- jax {table['jax']}", f"- commit: {table['commit']}",
              f"- measured copy bandwidth: {table['bandwidth'] / 1e12:.2f} TB/s (read + write)",
              f"- us/call: {N_SETS} input sets walked in a chain per program (cold L2); the GPU's busy time per walk"
              " from the profiler's device activity, median over repeats (the floors and speedups use it); wall"
              " us/call is host-timed with 4 programs in flight",
              "- decode loop us/iter: the walk's device time per iteration of a jitted lax.fori_loop that first"
              " reduces a buffer of twice the L2 and then walks from the last token (first kernel start to last"
              " kernel end of a run, minus the same loop without the walk, over the iterations; median over"
              " repeats), with XLA's default command buffers (kept on under the profiler:"
              f" `{PROFILED_COMMAND_BUFFERS}`) and with command buffers off (`{NO_COMMAND_BUFFERS}`, a child"
              " process)",
              "- modes: greedy passes no sampling arguments; probabilistic samples every request at T = 0.8 and"
              " returns bf16 draft logits; greedy-t0 passes temperature 0 for every request with keys and positions"
              " (a serving loop's mixed batch with no sampled row), tokens only",
              "- head MB: the persistent layouts the arm walks (W1 bf16 and W2: int8 + fp32 scales, or bf16);"
              " scratch MB: what XLA allocates for one walk (the compiled executable's temp size)",
              "- bytes floor: W2 once (the arm's head: int8 + scales, or bf16), base logits (bf16) once, outputs"
              " once, at the copy bandwidth",
              "- design floor (benchmarks/design_floor.py): max(bytes floor, W2 load + K x (one on-chip pass over"
              " W2 + one grid-wide exchange)), the pass taking the tensor-core time or, for probabilistic rows, the"
              " Gumbel noise's time where that is longer, from constants the probe kernels measured on this GPU"
              + (" (those of the first run):" if table["design_constants"] else ": not measured (no probe kernels)"),
              ""]
    if table["design_constants"]:
        lines += [design_floor.report(table["design_constants"], rows=[]).split("\n\n")[0], ""]
    lines += ["## Against the published H100 kernel", "",
              "The published kernel of this design on one H100 (shared/PEERS.md: CUPTI, CUDA graph, cold L2),"
              " against the int8 kernel here:", ""]
    summary = published_summary(rows)
    for mode, s in summary.items():
        loop = (f", in the decode loop on {s['loop_faster']} of {s['loop_cells']}" if s["loop_cells"]
                else "")
        lines.append(f"- {mode}: the int8 kernel is faster on {s['faster']} of {s['cells']} published cells in "
                     f"device time{loop}")
    ratios = mode_ratios(rows)
    if ratios:
        lines += ["", "## Sampled and zero-temperature walks against greedy", "",
                  "The int8 kernel's device time; the issue's target for probabilistic / greedy: "
                  + ", ".join(f"<= {bound}x up to {most} requests" if most else f"<= {bound}x above"
                              for most, bound in SAMPLED_RATIO_TARGET) + ".", "",
                  "| V | K | B | greedy us | probabilistic us | probabilistic / greedy | target | met "
                  "| greedy-t0 us | greedy-t0 / greedy |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for q in ratios:
            met = "" if q["sampled_ratio"] is None else ("yes" if q["sampled_ratio"] <= q["target"] else "no")
            lines.append(f"| {q['vocab']} | {q['steps']} | {q['batch']} | {q['greedy_us']:.1f} | "
                         f"{fmt(q['probabilistic_us'], '.1f')} | {fmt(q['sampled_ratio'], '.2f')} | "
                         f"{q['target']} | {met} | {fmt(q['greedy_t0_us'], '.1f')} | "
                         f"{fmt(q['zero_temperature_ratio'], '.2f')} |")
    lines += ["", "## Every arm", "",
              "| V | K | B | mode | arm | us/call | wall us/call | decode loop us/iter | decode loop us/iter, "
              "command buffers off | speedup vs eager | bytes floor us | fraction of bytes floor | design floor us "
              "| fraction of design floor | published H100 kernel us | head MB | scratch MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['steps']} | {r['batch']} | {r['mode']} | {r['arm']} | {r['us']:.1f} | "
            f"{r['wall_us']:.1f} | {fmt(r.get('decode_loop_us'), '.1f')} | "
            f"{fmt(r.get('decode_loop_no_cmd_buffer_us'), '.1f')} | {fmt(r['speedup'], '.2f')}"
            f"{'x' if r['speedup'] else ''} | {r['floor_us']:.1f} | {r['floor_fraction']:.2f} | "
            f"{fmt(r['design_floor_us'], '.1f')} | {fmt(r['design_fraction'], '.2f')} | "
            f"{fmt(r['published_h100_us'], '.1f')} | {r['persistent_bytes'] / 1e6:.1f} | "
            f"{r['scratch_bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def write_table(table: dict, out_prefix) -> str:
    """Writes <out_prefix>.md, .json and (with matplotlib) .png of a table; returns the markdown."""
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(table)
    prefix.with_suffix(".md").write_text(text)
    prefix.with_suffix(".json").write_text(json.dumps(table, indent=1) + "\n")
    plot(table, prefix.with_suffix(".png"))
    return text


def make_table(runs: list[dict], rows: list[dict], *, gpu: str, jax_version: str, commit: str,
               merge_command: str | None = None) -> dict:
    """A table: the runs that measured it (each: command, xla_flags, no_cmd_buffer_xla_flags, bandwidth,
    design_constants) and its rows, completed with the first run's bandwidth and constants."""
    bandwidth, constants = runs[0]["bandwidth"], runs[0]["design_constants"]
    table = dict(gpu=gpu, jax=jax_version, commit=commit, bandwidth=bandwidth, design_constants=constants,
                 runs=runs, rows=complete_rows(rows, bandwidth, constants))
    if merge_command:
        table["merge_command"] = merge_command
    return table


def merge_tables(tables: list[dict], merge_command: str) -> dict:
    """One table from the tables of several runs of one GPU, jax and commit; a row measured in more
    than one run is the later run's, and the derived columns are computed again with the first run's
    bandwidth and constants. Raises ValueError where the tables do not belong together."""
    for field in ("gpu", "jax", "commit"):
        values = {t[field] for t in tables}
        if len(values) > 1:
            raise ValueError(f"the tables differ in {field}: {sorted(values)}")
    rows = {}
    for t in tables:
        for r in t["rows"]:
            rows[row_key(r)] = r
    return make_table([run for t in tables for run in t["runs"]], list(rows.values()), gpu=tables[0]["gpu"],
                      jax_version=tables[0]["jax"], commit=tables[0]["commit"], merge_command=merge_command)


def plot(table: dict, path: Path) -> None:
    """Bars of every arm's device time per row and mode (log scale), with each bar's floors, its
    decode-loop time and, on the int8 kernel's bars, the published H100 figure; nothing without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = table["rows"]
    configs = list(dict.fromkeys(row_key(r)[:4] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by_key = {row_key(r): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(configs)), 5))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        placed = [(x + i * width, by_key[(*c, arm)]) for x, c in enumerate(configs) if (*c, arm) in by_key]
        xs = [x for x, _ in placed]
        ax.bar(xs, [r["us"] for _, r in placed], width, label=arm)
        ax.scatter(xs, [r["floor_us"] for _, r in placed], marker="_", s=150, color="k",
                   label="bytes floor" if i == 0 else None)
        ax.scatter(xs, [r["design_floor_us"] for _, r in placed], marker="_", s=150, color="r",
                   label="design floor" if i == 0 else None)
        for column, marker, color, label in (("decode_loop_us", "x", "c", "decode loop us/iter"),
                                             ("published_h100_us", "*", "m", "published H100 kernel")):
            points = [(x, r[column]) for x, r in placed if r.get(column)]
            if points:
                ax.scatter(*zip(*points), marker=marker, s=60, color=color,
                           label=None if label in ax.get_legend_handles_labels()[1] else label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))])
    ax.set_xticklabels([f"V={c[0]}\nK={c[1]} B={c[2]}\n{c[3]}" for c in configs], fontsize=7)
    ax.set_ylabel("us per call (log)")
    ax.set_yscale("log")
    ax.set_title(f"DSpark Markov walk on {table['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# the command line


def results_name(device_kind: str) -> str:
    """The results' file name of a GPU: its model in lower case ("NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA H200" -> "h200"), else the whole name, with "_" for what is not a letter or digit."""
    model = re.search(r"\b[A-Z]{1,2}\d{3}\b", device_kind)
    return (model.group(0) if model else re.sub(r"[^0-9A-Za-z]+", "_", device_kind)).lower()


def command_line(argv: list[str]) -> str:
    """How this run was started, the script's path relative to the repository root."""
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    return "python3 " + shlex.join([script, *argv[1:]])


def commit() -> str:
    """$JAX_MARKOV_COMMIT (the device tool's machine, where git's HEAD is not the tree that runs) or
    git's HEAD."""
    return os.environ.get("JAX_MARKOV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip() or "unknown"


def parse_row(text: str) -> tuple[int, int, int]:
    vocab, steps, batch = (int(x) for x in text.split(","))
    return vocab, steps, batch


def parser():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", help="output prefix (.md, .json, .png); default benchmarks/results/<gpu>, "
                                 "<gpu> from the device's kind (h100, h200)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--iterations", type=int, default=DECODE_ITERATIONS, help="draft rounds of a decode loop")
    p.add_argument("--rows", type=parse_row, nargs="+", default=ROWS, metavar="V,K,B")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--arms", nargs="+", choices=list(ARMS),
                   help="the arms of every mode (default: every arm; greedy-t0 only kernel-int8)")
    p.add_argument("--quick", action="store_true", help="the rows (151936,7,1) and (151936,7,64) only")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these tables (no GPU) into --out")
    p.add_argument("--decode-loop-only", metavar="JSON", help=argparse.SUPPRESS)  # the child process
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    command = command_line(sys.argv if argv is None else [__file__, *argv])
    rows = [ROWS[0], ROWS[2]] if args.quick else args.rows
    if args.merge:
        if not args.out:
            p.error("--merge needs --out")
        table = merge_tables([json.loads(Path(f).read_text()) for f in args.merge], command)
        print(write_table(table, args.out))
        return
    # Before this process's first use of JAX's backends: the GPU's memory stays free for the child
    # process (JAX preallocates 75% of it by default), and command buffers run under the profiler.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ["XLA_FLAGS"] = with_flag(os.environ.get("XLA_FLAGS", ""), PROFILED_COMMAND_BUFFERS)
    if args.decode_loop_only:
        loops = run_decode_loops(rows, args.modes, args.arms, args.repeats, args.iterations)
        Path(args.decode_loop_only).write_text(json.dumps(loops))
        return
    if jax.devices()[0].platform != "gpu":
        p.error(f"no GPU: JAX's first device is {jax.devices()[0]}")
    gpu = jax.devices()[0].device_kind
    out = args.out or str(RESULTS / results_name(gpu))
    run = dict(command=command, xla_flags=os.environ.get("XLA_FLAGS", ""),
               no_cmd_buffer_xla_flags=no_command_buffer_flags())
    info = dict(gpu=gpu, jax_version=jax.__version__, commit=commit())

    def report(bandwidth, constants, results):
        return write_table(make_table([dict(run, bandwidth=bandwidth, design_constants=constants)], results, **info),
                           out)

    log = lambda s: print(s, flush=True)  # noqa: E731
    bandwidth, constants, results = run_gpu(rows, args.modes, args.arms, args.repeats, args.iterations, log=log,
                                            on_row=report, without_command_buffers=True)
    print(report(bandwidth, constants, results))


if __name__ == "__main__":
    main()
