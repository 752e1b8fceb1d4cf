"""The table of benchmarks/gpu_timing.py, no GPU needed: the rows, modes and arms it times and the
published figures; the floors, the derived columns and the summaries; the .md, .json and .png;
and the merge of several runs' tables.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import design_floor
from benchmarks.gpu_measure import N_SETS, NO_COMMAND_BUFFERS, PROFILED_COMMAND_BUFFERS

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
        "kernel-int8": "kernel (int8)", "kernel-certified": "kernel (certified int8)",
        "kernel-bf16": "kernel (bf16 head)"}
KERNEL_INT8 = ARMS["kernel-int8"]
KERNEL_CERTIFIED = ARMS["kernel-certified"]
CERTIFIED_RATIO_TARGET = 1.15  # issue 65: the certified walk at most this times the int8 kernel's device time
EAGER = ARMS["eager"]
# The issue's target for the int8 kernel's probabilistic / greedy device time: up to 16 requests, above.
SAMPLED_RATIO_TARGET = ((16, 1.3), (None, 1.5))


# ------------------------------------------------------------------------------------------------
# floors, derived columns and summaries (no GPU needed)


def w2_element_bytes(arm: str) -> int:
    """1 for the arms that walk the int8 head (the certified one too: it reads the unquantized rows of
    only the few columns it re-scores), 2 for those that walk the bf16 head."""
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


def certified_ratios(rows: list[dict]) -> list[dict]:
    """Per row shape and mode with both: the certified kernel's device time over the int8 kernel's,
    and whether it meets CERTIFIED_RATIO_TARGET."""
    int8 = {row_key(r)[:4]: r["us"] for r in rows if r["arm"] == KERNEL_INT8}
    out = []
    for r in rows:
        plain = int8.get(row_key(r)[:4])
        if r["arm"] == KERNEL_CERTIFIED and plain:
            ratio = r["us"] / plain
            out.append(dict(vocab=r["vocab"], steps=r["steps"], batch=r["batch"], mode=r["mode"], int8_us=plain,
                            certified_us=r["us"], ratio=ratio, met=ratio <= CERTIFIED_RATIO_TARGET))
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
    certified = certified_ratios(rows)
    if certified:
        lines += ["", "## The certified int8 walk against the int8 kernel", "",
                  "A CertifiedMarkovHead's walk (greedy rows choose what the unquantized head chooses) over the"
                  f" plain int8 kernel's, device time; the target: <= {CERTIFIED_RATIO_TARGET}x. The kernel walks"
                  " it for the batches its plan takes; the other rows have no certified arm.", "",
                  "| V | K | B | mode | int8 us | certified us | certified / int8 | met |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {q['vocab']} | {q['steps']} | {q['batch']} | {q['mode']} | {q['int8_us']:.1f} | "
                  f"{q['certified_us']:.1f} | {q['ratio']:.3f} | {'yes' if q['met'] else 'no'} |" for q in certified]
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
    return write_outputs(table, out_prefix, markdown, plot)


def write_outputs(data: dict, out_prefix, to_markdown, to_plot) -> str:
    """<out_prefix>.md (to_markdown(data)), .json (data) and .png (to_plot(data, path), which may
    write nothing); returns the markdown."""
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = to_markdown(data)
    prefix.with_suffix(".md").write_text(text)
    prefix.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    to_plot(data, prefix.with_suffix(".png"))
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
