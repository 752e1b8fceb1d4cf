"""Where a step of the kernel's walk goes: a per-phase timeline of every CTA and step.

Needs the timeline build of the CUDA module, in which thread 0 of each CTA stamps %globaltimer at
every phase of every step and lane 0 of each warp when its tiles are scored:

    cmake -S . -B /tmp/tl -G Ninja -DJAX_MARKOV_TIMELINE=ON -DPython_EXECUTABLE=$(which python3) \\
        && ninja -C /tmp/tl && cp /tmp/tl/_markov_*.so jax_markov/
    python3 benchmarks/timeline.py --out benchmarks/results/h200_timeline 151936,7,1,greedy
    python3 benchmarks/timeline.py --render benchmarks/results/h200_timeline.json  # its .md again

Phases of step k, per CTA (medians over CTAs, in us):
  issue    the next step's loads that do not depend on the choice (k = 0: the kernel's setup and
           the loads of the resident W2 tiles issued)
  wait     the grid-wide wait: spinning on the arrival count, then the CTA barrier (batches up to
           16 wait for the keys themselves, in `e ready`)
  e ready  the chosen token's key, its W1 row and the B fragments built from it (a certified walk:
           also the certificate from every CTA's bounds and the exact round where one is taken)
  score    the CTA's tiles scored and reduced to one key per request; of it, `after scoring` is
           from the CTA's last warp done with its tiles to the end of the reduction (a certified
           walk also merges the second-best scores) and the CTA barrier. A certified walk's warps
           with fewer tiles make the step's margins after their tiles, before their stamp
  publish  the keys published (a certified walk: with their bounds words) and the arrival counted
and across CTAs: `arrival spread` (last CTA's arrival minus the median arrival) and `release`
(the last arrival to the median CTA's end of wait at the next step). With the direct exchange only
CTA 0 waits for the last step's keys (the other CTAs end after publishing them): the last step's
`release` and `step` are CTA 0's. A certified walk's every CTA waits for them (an exact round at the
last step needs every CTA). For a certified config the report also states the walk's counters
(greedy decisions, exact rounds, columns re-scored: `certified_stats`), from its launches run again
once every timeline is taken (the counters' atomics stay on from then on).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

if not __package__:  # run as `python3 benchmarks/timeline.py`: `benchmarks` imports from the repository
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # root, last, so an installed jax_markov comes first

from benchmarks import profile_kernel  # noqa: E402
from jax_markov import native  # noqa: E402

COLUMNS = ("issue", "wait", "e ready", "score", "publish")


def read_stamps():
    """The latest launch's stamps: phases [ctas, max steps + 1, phases] and warps [ctas, max steps, max
    warps], in the layout the module states."""
    t = native._markov_cuda.read_timeline()
    words = np.asarray(t["stamps"], np.int64)
    phase_words = t["ctas"] * (t["steps"] + 1) * t["phases"]
    phases = words[:phase_words].reshape(t["ctas"], t["steps"] + 1, t["phases"])
    warps = words[phase_words:].reshape(t["ctas"], t["steps"], t["warps"])
    return phases, warps


def summarize(phases, warps, steps: int) -> tuple[list[dict], dict]:
    """One dict per step (the COLUMNS' medians and the spreads, in us) and the kernel's totals."""
    start = phases[:, 0, 0].min()
    stamped = phases >= start  # the others are an earlier launch's
    us = lambda x: float(x) / 1e3
    rows = []
    for k in range(steps):
        s = phases[:, k, :]
        durations = [np.median(s[:, p + 1] - s[:, p]) for p in range(5)]
        arrival = s[:, 5]
        spread = arrival.max() - np.median(arrival)
        waited = stamped[:, k + 1, 2]  # every CTA but at the last step (direct exchange: CTA 0)
        release = np.median(phases[waited, k + 1, 2]) - arrival.max()
        step_len = np.median(phases[waited, k + 1, 2] - (s[waited, 2] if k > 0 else s[waited, 0]))
        w = warps[:, k, :]
        valid = w >= s[:, 3:4]
        first = np.where(valid, w, np.iinfo(np.int64).max).min(axis=1)
        last = np.where(valid, w, 0).max(axis=1)
        warp_spread = np.median(last - first)
        after_scoring = np.median(s[:, 4] - last)
        rows.append(dict(zip(COLUMNS, map(us, durations)), step=k, warp_spread=us(warp_spread),
                         after_scoring=us(after_scoring),
                         arrival_spread=us(spread), release=us(release), total=us(step_len)))
    end = np.where(stamped, phases, start).max()
    totals = dict(kernel_us=us(end - start),
                  launch_skew_us=us(phases[:, 0, 0].max() - start))
    return rows, totals


def certified_counts(spec: str) -> dict:
    """The certified walk's counters (`certified_stats`: greedy decisions, exact rounds, columns
    re-scored, ...) over the launches that `profile_kernel.run` makes of a certified config, run again
    with the counters on: the same inputs, so the same choices as the timed launches."""
    ordinal = jax.devices("cuda")[0].local_hardware_id
    native._markov_cuda.enable_certified_stats(ordinal)
    native._markov_cuda.certified_stats(ordinal, reset=True)
    profile_kernel.run(*profile_kernel.parse(spec))
    return {name: int(n) for name, n in native._markov_cuda.certified_stats(ordinal, reset=True).items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=["151936,7,1,greedy"],
                   help="V,K,B,mode[,head] as benchmarks/profile_kernel.py takes them (head int8, the default, "
                   "bf16 or certified)")
    p.add_argument("--out", default=None, help="output prefix: writes <out>.md and <out>.json")
    p.add_argument("--render", metavar="JSON", help="only write the .md of a report that --out wrote")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(render(report))
        return
    if native._markov_cuda is None or not hasattr(native._markov_cuda, "read_timeline"):
        sys.exit("needs the timeline build of the CUDA module (cmake -DJAX_MARKOV_TIMELINE=ON), see the docstring")
    commit = os.environ.get("JAX_MARKOV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    command = f"python3 {' '.join(sys.argv)}"
    results = []
    for spec in args.configs:
        vocab, steps, batch, mode, head_format = profile_kernel.parse(spec)
        profile_kernel.run(vocab, steps, batch, mode, head_format)
        phases, warps = read_stamps()
        rows, totals = summarize(phases, warps, steps)
        results.append(dict(vocab=vocab, steps=steps, batch=batch, mode=mode, head=head_format, steps_us=rows,
                            **totals))
    for spec, result in zip(args.configs, results):
        if result["head"] == "certified":  # after every timeline: the counters stay on once enabled
            result["certified_counts"] = certified_counts(spec)
    report = dict(command=command, gpu=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit,
                  configs=results)
    text = render(report)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)


def render(report: dict) -> str:
    """The markdown table of a timeline report (the JSON that --out writes)."""
    lines = ["# Kernel timeline (benchmarks/timeline.py)", "",
             f"- command: `{report['command']}`", f"- GPU: {report['gpu']}",
             f"- jax {report['jax']}", f"- commit: {report['commit']}",
             "- the timeline build's stamps cost a few ns each; medians over CTAs, us", ""]
    for c in report["configs"]:
        lines += [f"## V={c['vocab']} K={c['steps']} B={c['batch']} {c['mode']}, {c['head']} W2 (last of 3 launches; "
                  f"batches over 64 columns: the last launch)", "",
                  f"kernel {c['kernel_us']:.1f} us from the first CTA's start to the last CTA's end; "
                  f"CTA start skew {c['launch_skew_us']:.2f} us", ""]
        if "certified_counts" in c:
            lines += ["the certified walk's counters over those 3 launches (run again with them on): " +
                      ", ".join(f"{name} {n}" for name, n in c["certified_counts"].items()), ""]
        lines += ["| step | " + " | ".join(COLUMNS) + " | warp spread (score) | after scoring | arrival spread | release | step |",
                  "|---|" + "---|" * (len(COLUMNS) + 5)]
        lines += [f"| {r['step']} | " + " | ".join(f"{r[col]:.2f}" for col in COLUMNS) +
                  f" | {r['warp_spread']:.2f} | {r.get('after_scoring', float('nan')):.2f} | {r['arrival_spread']:.2f}"
                  f" | {r['release']:.2f} | {r['total']:.2f} |"
                  for r in c["steps_us"]] + [""]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
