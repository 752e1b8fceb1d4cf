"""The measurements of benchmarks/gpu_timing.py on the GPU: the input sets and the jitted programs of
each arm (a chain of walks, a decode loop), their device time from the profiler's trace, the memory
of one call, and the copy bandwidth.
"""
from __future__ import annotations

import statistics
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm
from jax_markov import native

N_SETS = 4  # input sets (heads and base logits) that a timed program walks in a chain
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
    """n_sets independent ((bf16 head, its int8 quantization, its certified int8 quantization), base
    logits), and the anchors; the first set is the same for every n_sets."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
        head = jm.MarkovHead(w1, w2)
        base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32) * 2.0, jnp.bfloat16)
        sets.append(((head, jm.quantize(head), jm.quantize(head, certified=True)), base))
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


ARM_HEADS = {"eager": 0, "kernel-bf16": 0, "reference-int8": 1, "kernel-int8": 1, "kernel-certified": 2}


def arm_head(arm: str, heads):
    """The head an arm walks, of (bf16 head, int8 head, certified int8 head)."""
    return heads[ARM_HEADS[arm]]


def kernel_refuses(arm: str, mode: str, vocab: int, steps: int, batch: int) -> str | None:
    """Why the CUDA kernel cannot walk this arm's head at this row and mode (its plan's reason), or None:
    the certified walk takes a few requests only."""
    if arm != "kernel-certified":
        return None
    logits = jnp.bfloat16 if mode == "probabilistic" else None
    return native.cuda_unsupported_reason(batch, steps, vocab, 256, jnp.bfloat16, jnp.int8, base_dtype=jnp.bfloat16,
                                          logits_dtype=logits, sampling=mode != "greedy", certified=True)


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
    return memory_of(head, walk_program(arm, mode, head, base, anchor, inputs).compile())


def walk_program(arm: str, mode: str, head, base, anchor, inputs: dict):
    """One walk of an arm, jitted and lowered for these arguments (a `jax.stages.Lowered`)."""
    return jax.jit(lambda head, base, anchor, inputs: walk_arm(arm, mode, head, base, anchor, inputs)).lower(
        head, base, anchor, inputs)


def memory_of(head, compiled) -> dict:
    """memory_per_call's bytes from the head and its walk's compiled program (`walk_program`)."""
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
