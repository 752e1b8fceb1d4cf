"""GPU table of benchmark_markov_walk.py: the eager walk (reference, bf16 head), the reference on the
int8 head, and the cooperative kernel on the int8 head, on the certified int8 head (the batches its
plan takes) and on the unquantized bf16 head, timed on
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

The measurements are in gpu_measure.py, the table in gpu_report.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax

if not __package__:  # run as `python3 benchmarks/gpu_timing.py`: `benchmarks` imports from the repository
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # root, last, so an installed jax_markov comes first

from benchmarks import design_floor  # noqa: E402
from benchmarks.gpu_measure import (NO_COMMAND_BUFFERS, PROFILED_COMMAND_BUFFERS, arm_head,  # noqa: E402
                                    kernel_refuses, make_sets, measure_copy_bandwidth, memory_per_call,
                                    mode_inputs, time_chained, time_decode_loop)
from benchmarks.gpu_report import (ARMS, MODES, ROWS, fmt, make_table, merge_tables, row_key,  # noqa: E402
                                   write_table)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The arms each mode times unless --arms names others: greedy-t0 asks whether the int8 kernel slows
# down for sampling arguments that sample nothing.
MODE_ARMS = {"greedy": tuple(ARMS), "probabilistic": tuple(ARMS), "greedy-t0": ("kernel-int8",)}
DECODE_ITERATIONS = 16


# ------------------------------------------------------------------------------------------------
# the runs


def mode_arms(mode: str, arms=None, row=None, log=print) -> tuple:
    """The arms to time in a mode: `arms` where given, else the mode's own (MODE_ARMS); at a row
    (V, K, B), less those whose head the kernel cannot walk there (logged)."""
    chosen = tuple(arms) if arms else MODE_ARMS[mode]
    if row is None:
        return chosen
    refused = {arm: kernel_refuses(arm, mode, *row) for arm in chosen}
    for arm, why in refused.items():
        if why:
            log(f"  V={row[0]} K={row[1]} B={row[2]} {mode}: no {arm} arm ({why})")
    return tuple(arm for arm in chosen if not refused[arm])


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
            chosen = mode_arms(mode, arms, (vocab, steps, batch), log)
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
            chosen = mode_arms(mode, arms, (vocab, steps, batch), log=lambda line: None)
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
