"""A/B of kernel versions on one GPU: the walk's device time per launch (with the noise kernel that
a large sampled batch runs first), from ncu or from jax.profiler's device activity, for source trees
built side by side and measured in alternating rounds (so that drift of the GPU hits every tree).

Make one source tree per version, carry them to the GPU (for the device tool: under .dev/), then:

    git archive REV | tar -x -C .dev/REV                                      # per version
    python3 benchmarks/ab_kernels.py --out OUT --rounds 2 .dev/A .dev/B -- 151936,7,16,greedy ...
    python3 benchmarks/ab_kernels.py --out OUT --timer profiler --tokens "5003,3,17,greedy 151936,7,64,greedy" \
        --rounds 2 .dev/A .dev/B -- 151936,7,64,greedy

Each tree's CUDA and CPU modules are built into /tmp and copied into the tree's jax_markov/ (with
--no-build, the trees hold modules built elsewhere, as run_gpu.sh's JAX_MARKOV_PREBUILT does); every
round runs `benchmarks/profile_kernel.py CONFIG` of each tree under `ncu --metrics
gpu__time_duration.sum`, one ncu process per config (3 chained walks, ceil(B / 64) launches per walk);
with --timer profiler, one `profile_kernel.py --device-times CONFIGS` process per tree instead (the
same walks after a warm-up, timed from the profiler's trace: no ncu start per config). OUT gets the
raw durations (ab_durations.log) and the medians per config and tree, with the change against the
first tree (ab_kernels.md). With --tokens, each tree first runs `profile_kernel.py --tokens` on those
configs, and OUT gets their fingerprints side by side, each marked as equal to the first tree's or
not (tokens.md): a version meant to keep the numbers shows it does before it is timed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CALLS = 3  # profile_kernel.py's chained walks per config
MEASURE_TIMEOUT_S = 300  # one ncu run; a hung one fails with what it printed, not at the caller's limit
MAX_COLUMNS = 64  # one launch walks up to 64 requests (bf16 W1: one column each)
NCU = ["ncu", "--clock-control", "none", "--kernel-name", "regex:MarkovWalk", "--metrics", "gpu__time_duration.sum"]
_DURATION = re.compile(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)")
_KERNEL = re.compile(r"^\s+(?:void\s+)?(?:\w+::)*(MarkovWalk\w*)[<(]")
_UNIT_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def launches(config: str) -> int:
    """Kernel launches that profile_kernel.py makes for one config "V,K,B,mode[,head]"."""
    batch = int(config.split(",")[2])
    return CALLS * -(-batch // MAX_COLUMNS)


def fold_noise(kernels: list[tuple[str, float]]) -> list[float]:
    """Walk launch times (us) from (kernel, us) in launch order: a MarkovWalkNoise launch (the Gumbel
    noise of a large sampled batch, made just before its walk) counts in the walk launch after it."""
    walks, noise = [], 0.0
    for kernel, us in kernels:
        if kernel == "MarkovWalkNoise":
            noise += us
        else:
            walks.append(us + noise)
            noise = 0.0
    return walks


def parse_durations(ncu_output: str) -> list[float]:
    """The gpu__time_duration.sum of every walk launch of an ncu report, in launch order, in
    microseconds, the noise folded in (fold_noise)."""
    kernels, kernel = [], ""
    for line in ncu_output.splitlines():
        named = _KERNEL.match(line)
        if named:
            kernel = named.group(1)
            continue
        duration = _DURATION.search(line)
        if duration:
            kernels.append((kernel, float(duration.group(2).replace(",", "")) * _UNIT_US[duration.group(1)]))
    return fold_noise(kernels)


def parse_device_times(output: str, configs: list[str]) -> dict[str, list[float]]:
    """Walk launch times per config from `profile_kernel.py --device-times` ("KERNEL <config> <kernel>
    <us>" lines), the noise folded in."""
    kernels = {c: [] for c in configs}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "KERNEL" and parts[1] in kernels:
            kernels[parts[1]].append((parts[2], float(parts[3])))
    return {c: per_config(fold_noise(kernels[c]), [c])[c] for c in configs}


def per_config(durations: list[float], configs: list[str]) -> dict[str, list[float]]:
    """Splits one run's durations into the launches of each config (in the order given)."""
    expected = sum(launches(c) for c in configs)
    if len(durations) != expected:
        raise ValueError(f"ncu reported {len(durations)} kernel launches, the configs make {expected} (a sampled "
                         "call's guarded pairs launch twice: time them with --timer profiler)")
    out, i = {}, 0
    for c in configs:
        out[c] = durations[i:i + launches(c)]
        i += launches(c)
    return out


def summary(runs: dict[str, list[dict[str, list[float]]]], configs: list[str]) -> str:
    """Markdown: the median launch time (us) per config and tree over all rounds, and each tree's
    change against the first tree."""
    trees = list(runs)
    head = "| config | " + " | ".join(trees) + " | " + " | ".join(f"{t} vs {trees[0]}" for t in trees[1:]) + " |"
    lines = [head, "|" + "---|" * (2 * len(trees))]
    for c in configs:
        med = [statistics.median(v for run in runs[t] for v in run[c]) for t in trees]
        change = [f"{100 * (m / med[0] - 1):+.1f} %" for m in med[1:]]
        lines.append(f"| {c} | " + " | ".join(f"{m:.1f}" for m in med) + " | " + " | ".join(change) + " |")
    return "\n".join(lines)


def rounds_from_log(text: str) -> tuple[list[str], dict[str, list[dict[str, list[float]]]]]:
    """The configs and each tree's finished rounds from an ab_durations.log (its first line names the
    configs; each "== TREE round R: ..." line holds a round's launches, config by config), so that a run
    cut short by a time limit still gives its table (--from-log)."""
    lines = text.splitlines()
    configs = lines[0].rsplit(" of ", 1)[1].split()
    runs: dict[str, list[dict[str, list[float]]]] = {}
    for line in lines[1:]:
        if not line.startswith("== "):
            continue
        head, values = line[3:].split(": ", 1)
        durations, i = {}, 0
        numbers = [float(v) for v in values.split()]
        for c in configs:
            durations[c] = numbers[i:i + launches(c)]
            i += launches(c)
        if i != len(numbers):
            raise ValueError(f"{head}: {len(numbers)} launches, the configs make {i}")
        runs.setdefault(head.rsplit(" round ", 1)[0], []).append(durations)
    return configs, runs


def parse_tokens(output: str) -> dict[str, str]:
    """The fingerprint per config from `profile_kernel.py --tokens` ("TOKENS <config> <fingerprint>")."""
    found = {}
    for line in output.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0] == "TOKENS":
            found[parts[1]] = parts[2]
    return found


def tokens_summary(fingerprints: dict[str, dict[str, str]], configs: list[str]) -> str:
    """Markdown: each tree's fingerprint per config, and whether it equals the first tree's."""
    trees = list(fingerprints)
    lines = ["| config | " + " | ".join(trees) + " | " + " | ".join(f"{t} = {trees[0]}" for t in trees[1:]) + " |",
             "|" + "---|" * (2 * len(trees))]
    for c in configs:
        prints = [fingerprints[t].get(c, "missing") for t in trees]
        same = ["yes" if p == prints[0] and p != "missing" else "NO" for p in prints[1:]]
        lines.append(f"| {c} | " + " | ".join(prints) + " | " + " | ".join(same) + " |")
    return "\n".join(lines)


def build(tree: Path) -> None:
    """Builds the tree's modules (all of its build's default targets) into /tmp and copies them into its
    jax_markov/."""
    build_dir = Path("/tmp") / f"ab_build_{tree_name(tree)}"
    cmake = ["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}",
             "-DCMAKE_BUILD_TYPE=Release"]
    for cmd in (cmake, ["ninja", "-C", str(build_dir)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {tree} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    for module in build_dir.glob("_markov_*.so"):
        shutil.copy(module, tree / "jax_markov")


def tree_name(tree: Path) -> str:
    """A tree's name in the tables: its folder's name, also for "." ."""
    return tree.resolve().name


def measure(tree: Path, configs: list[str], timer: str = "ncu") -> dict[str, list[float]]:
    """The launch durations per config in the tree: one ncu run of profile_kernel.py each (one run of
    eight configs once printed nothing in 600 s, where runs of one config each took 10-60 s), or
    (timer "profiler") one run of profile_kernel.py --device-times for all of them."""
    if timer == "profiler":
        return measure_profiler(tree, configs)
    return {c: measure_one(tree, c) for c in configs}


def measure_profiler(tree: Path, configs: list[str]) -> dict[str, list[float]]:
    """The launch durations of all configs in the tree from one profile_kernel.py --device-times run."""
    printed = run_in_tree(tree, [sys.executable, "benchmarks/profile_kernel.py", "--device-times", *configs],
                          "profile_kernel.py --device-times")
    return parse_device_times(printed, configs)


def measure_one(tree: Path, config: str) -> list[float]:
    """One ncu run of profile_kernel.py for one config in the tree: its launch durations."""
    printed = run_in_tree(tree, NCU + [sys.executable, "benchmarks/profile_kernel.py", config], "ncu")
    return per_config(parse_durations(printed), [config])[config]


def run_in_tree(tree: Path, cmd: list[str], what: str) -> str:
    """Runs cmd in the tree with its own jax_markov, within MEASURE_TIMEOUT_S; returns what it printed.
    A run that fails or hangs is an error that shows the end of its output."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        printed = (e.stdout or b"").decode(errors="replace")[-3000:]  # bytes even with text=True
        raise RuntimeError(f"{what} in {tree} ran past {MEASURE_TIMEOUT_S} s; it printed:\n{printed}") from e
    if done.returncode != 0:
        raise RuntimeError(f"{what} in {tree} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for ab_durations.log and ab_kernels.md")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timer", choices=("ncu", "profiler"), default="ncu",
                   help="ncu (a run a config) or profiler (jax.profiler's device activity, a run a tree)")
    p.add_argument("--no-build", action="store_true", help="the trees' jax_markov/ hold their modules already "
                   "(built elsewhere for this machine's Python)")
    p.add_argument("--tokens", default="", help="configs (space-separated) whose tokens and logits each tree "
                   "prints first, compared with the first tree's (tokens.md)")
    p.add_argument("--from-log", help="write ab_kernels.md from this ab_durations.log's finished rounds (a run cut "
                   "short), measuring nothing")
    p.add_argument("trees", nargs="*", help="source trees, then -- and the configs V,K,B,mode[,head]")
    argv = sys.argv[1:]
    if "--from-log" in argv:
        args = p.parse_args(argv)
        configs, runs = rounds_from_log(Path(args.from_log).read_text())
        rounds = sorted({len(r) for r in runs.values()})
        table = summary(runs, configs)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab_kernels.md").write_text(f"# Kernel A/B ({' or '.join(map(str, rounds))} rounds a tree, from "
                                           f"{Path(args.from_log).name}; median us per launch)\n\n{table}\n")
        print(table)
        return
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        p.error("no configs: give them after --")
    args = p.parse_args(argv[:argv.index("--")])
    configs = argv[argv.index("--") + 1:]
    trees = [Path(t) for t in args.trees]
    names = {t: tree_name(t) for t in trees}
    if len(set(names.values())) != len(trees):  # the tables' columns, and each tree's build folder
        p.error(f"the trees' folders need distinct names, got {[names[t] for t in trees]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_build:
        with ThreadPoolExecutor(len(trees)) as pool:
            list(pool.map(build, trees))
    if args.tokens:
        token_configs = args.tokens.split()
        printed = {names[t]: parse_tokens(run_in_tree(t, [sys.executable, "benchmarks/profile_kernel.py", "--tokens",
                                                          *token_configs], "profile_kernel.py --tokens"))
                   for t in trees}
        table = tokens_summary(printed, token_configs)
        (out / "tokens.md").write_text(f"# Tokens and logits of each tree (profile_kernel.py --tokens)\n\n{table}\n")
        print(table, flush=True)
    runs = {names[t]: [] for t in trees}
    with open(out / "ab_durations.log", "w") as log:
        how = (f"{' '.join(NCU)} python3 benchmarks/profile_kernel.py CONFIG, a run each" if args.timer == "ncu" else
               "python3 benchmarks/profile_kernel.py --device-times CONFIGS, a run a tree")
        log.write(f"# {how} of {' '.join(configs)}\n")
        for r in range(args.rounds):
            for t in trees:
                durations = measure(t, configs, args.timer)
                runs[names[t]].append(durations)
                line = " ".join(f"{v:.2f}" for c in configs for v in durations[c])
                log.write(f"== {names[t]} round {r + 1}: {line}\n")
                log.flush()  # a run cut short by a time limit keeps the rounds it finished
                print(f"{names[t]} round {r + 1} done", flush=True)
    table = summary(runs, configs)
    (out / "ab_kernels.md").write_text(f"# Kernel A/B ({args.rounds} rounds, median us per launch)\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
