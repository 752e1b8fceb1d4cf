"""Where a walk kernel's warps stall, from ncu's warp-state sampling, in a few lines per config.

For each config "V,K,B,mode[,head]" this runs `benchmarks/profile_kernel.py` under
`ncu --set full --import-source yes` on the first launch of its third call that walks (the first two
calls warm up; a sampled call's guarded pair launches its greedy kernel first, which returns at once
where a row samples), then prints:
the launch's headline metrics (duration, issue slots busy, warps per scheduler), the samples of
the instructions with each execution count (a loop body or a branch's side, largest first), and
the hottest instructions. The raw SASS-level CSV and ncu's details page (every section of the set:
the warp states by stall reason, the instruction cache, occupancy) go next to the summary, so that
they can be read again without a GPU.

    python3 benchmarks/stall_profile.py --out OUT 151936,7,1,probabilistic 151936,7,1,greedy
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import os
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as `python3 benchmarks/stall_profile.py`: `benchmarks` imports from the repository
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # root, last, so an installed jax_markov comes first

from benchmarks import profile_kernel  # noqa: E402

NCU = ["ncu", "--clock-control", "none", "--kernel-name", "regex:MarkovWalk(Transposed)?Kernel", "--launch-count", "1"]
WARM_CALLS = 2  # profile_kernel.py walks 3 chained calls; the third is profiled
HEADLINE = ("Duration", "Issue Slots Busy", "Issued Ipc Active", "No Eligible", "Active Warps Per Scheduler",
            "Warp Cycles Per Issued Instruction", "Registers Per Thread")


def run(cmd: list[str], env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def column(header: list[str], *words: str) -> int:
    """Index of the first column whose name contains every word."""
    for i, name in enumerate(header):
        if all(w in name for w in words):
            return i
    raise KeyError(f"no column with {words} in {header}")


def summarize(sass_csv: str, top: int = 25) -> str:
    """Samples per execution count (with the number of instructions that have it), and the hottest
    instructions."""
    lines = sass_csv.splitlines()
    start = next(i for i, line in enumerate(lines) if '"Address"' in line and '"Source"' in line)
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    src, samples = column(header, "Source"), column(header, "Stall Sampling", "All")
    executed = header.index("Instructions Executed")

    def number(text: str) -> float:
        return float(text.replace(",", "") or 0)

    total = sum(number(r[samples]) for r in body)
    per_count: dict[float, list] = {}  # execution count -> [instructions, samples]
    for r in body:
        entry = per_count.setdefault(number(r[executed]), [0, 0.0])
        entry[0] += 1
        entry[1] += number(r[samples])
    out = [f"total samples {total:.0f}"]
    ranked = sorted(per_count.items(), key=lambda kv: -kv[1][1])
    for count, (n, s) in ranked[:12]:
        out.append(f"exec={count:>9.0f} ninstr={n:>5} samples={s:>7.0f} {100 * s / max(total, 1):5.1f}%")
    # ncu's per-reason columns ("stall_wait", ...; not their "(Not Issued)" twins), as shares of all samples:
    # over the kernel, and over the instructions of the execution count with the most samples.
    reasons = {name[len("stall_"):]: i for i, name in enumerate(header)
               if name.startswith("stall_") and "Not Issued" not in name}
    if reasons and ranked:
        hottest = ranked[0][0]
        for label, rows_of in (("stall reasons", body), (f"stall reasons at exec={hottest:.0f}",
                                                         [r for r in body if number(r[executed]) == hottest])):
            shares = {k: sum(number(r[i]) for r in rows_of) for k, i in reasons.items()}
            top_shares = sorted(shares.items(), key=lambda kv: -kv[1])[:8]
            out.append(f"{label} (% of all samples): " +
                       ", ".join(f"{k} {100 * v / max(total, 1):.1f}" for k, v in top_shares))
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        out.append(f"{number(r[samples]):>6.0f} {number(r[executed]):>8.0f} {r[src].strip()}")
    return "\n".join(out)


def launch_skip(config: str, plan: list[dict] | None = None) -> int:
    """ncu's --launch-skip for the first launch of the third call that walks (`plan`: the call's
    launches, profile_kernel.launch_plan's by default)."""
    plan = profile_kernel.launch_plan(config) if plan is None else plan
    # profile_kernel.py's probabilistic rows all sample; its other modes' rows are all greedy.
    batch_class = "all_sampled" if profile_kernel.parse(config)[3].startswith("probabilistic") else "all_greedy"
    first = next(i for i, launch in enumerate(plan) if batch_class in launch["walks_in"])
    return WARM_CALLS * len(plan) + first


def headline(details: str) -> str:
    return "\n".join(line.rstrip() for line in details.splitlines() if line.strip().startswith(HEADLINE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for the summaries and the raw CSVs")
    p.add_argument("--from-csv", nargs="+", metavar="CSV_GZ", help="summarize these saved SASS CSVs (no GPU)")
    p.add_argument("configs", nargs="*", help='"V,K,B,mode[,head]" as profile_kernel.py takes them')
    args = p.parse_args()
    if args.from_csv:
        for path in args.from_csv:
            with gzip.open(path, "rt") as f:
                print(f"## {Path(path).name}\n{summarize(f.read())}\n", flush=True)
        return
    if not args.configs or not args.out:
        p.error("give --out and configs, or --from-csv")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for config in args.configs:
        name = config.replace(",", "_")
        report = out / f"stall_{name}"
        ncu = NCU + ["--launch-skip", str(launch_skip(config))]
        run(ncu + ["--set", "full", "--import-source", "yes", "-f", "-o", str(report), sys.executable,
                   str(Path(__file__).with_name("profile_kernel.py")), config], env)
        rep = f"{report}.ncu-rep"
        sass = run(["ncu", "-i", rep, "--page", "source", "--csv", "--print-source", "sass"])
        details = run(["ncu", "-i", rep, "--page", "details"])
        with gzip.open(out / f"stall_{name}.csv.gz", "wt") as f:
            f.write(sass)
        (out / f"stall_{name}_details.txt").write_text(details)
        os.remove(rep)
        try:
            summary = summarize(sass)
        except (KeyError, StopIteration) as e:  # an ncu whose CSV differs: the raw CSV still came back
            summary = f"no summary ({e!r}); the CSV begins:\n" + "\n".join(sass.splitlines()[:5])
        text = f"## {config}\n# {' '.join(ncu)} --set full --import-source yes\n{headline(details)}\n{summary}\n"
        (out / f"stall_{name}.md").write_text(text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
