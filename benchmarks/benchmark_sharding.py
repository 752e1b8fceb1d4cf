"""The three layouts of jax_markov.sharding.walk on 8 CPU host devices, against the unsharded walk.

    python3 benchmarks/benchmark_sharding.py            # writes benchmarks/results/sharding_cpu.md

The 8 devices are XLA host devices (--xla_force_host_platform_device_count=8, set here before jax
is imported): they share this machine's cores and "communicate" through memory. So the table
measures the arithmetic each layout makes every device do and the cost of its collectives on one
host, not a GPU interconnect; it is the evidence for the README's "when each layout pays".

Arms (int8 W2, bf16 W1 replicated unless said, bf16 base logits, r = 256):
- unsharded: jax_markov.walk on one device, inputs there.
- batch 8x1: requests split 8 ways, head replicated: no collective.
- vocab 1x8 / 2x4: base logits, W2 and scales split along V (8 or 4 ways; 2x4 also splits the
  requests 2 ways): one [n, B_local, 2] uint32 all-gather per draft step. "W1 split" also shards
  W1 along V_target: one more [B_local, r] psum per step.
- replicated 1x8 / 2x4: the base logits arrive split along V (as from a tensor-parallel LM head),
  are gathered once, and every device walks all the requests of its batch group.

Timing: every arm is jitted and warmed up; then the arms take turns call by call (a busy machine
slows them alike), each call timed to `block_until_ready`; the table gives the median and the
minimum. `--quick` is a seconds-long smoke run.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={N_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as `python3 benchmarks/benchmark_sharding.py`: `benchmarks` imports from the repository
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # root, last, so an installed jax_markov comes first

import jax_markov  # noqa: E402
from benchmarks.benchmark_markov_walk import cpu_model, git_commit  # noqa: E402
from jax_markov import native, sharding  # noqa: E402


def commit_line() -> str:
    info = git_commit()
    return info["commit"] + (" (working tree has uncommitted changes)" if info["dirty"] else "")



AXES = ("batch", "vocab")


def make_problem(batch, steps, vocab, rank, seed=0):
    rng = np.random.default_rng(seed)
    w1 = jnp.asarray(rng.normal(0, 0.5, (vocab, rank)), jnp.bfloat16)
    w2 = jnp.asarray(rng.normal(0, 0.5, (vocab, rank)), jnp.float32)
    head = jax_markov.quantize(jax_markov.MarkovHead(w1, w2))
    temps = rng.uniform(0.5, 1.5, batch).astype(np.float32)
    temps[::2] = 0.0  # mixed: half the rows greedy
    inputs = dict(base_logits=jnp.asarray(rng.normal(0, 2, (batch, steps, vocab)), jnp.bfloat16),
                  anchor=jnp.asarray(rng.integers(0, vocab, batch), jnp.int32))
    sampled = dict(temperature=jnp.asarray(temps), key=jax.random.split(jax.random.key(seed), batch),
                   position=jnp.asarray(rng.integers(0, 10_000, batch), jnp.int32))
    return head, inputs, sampled


def arms(impl):
    """(label, mesh shape or None, walk kwargs, how the inputs are laid out)."""
    return [
        ("unsharded (1 device)", None, {}, None),
        ("batch 8x1", (8, 1), dict(layout="batch"), "batch"),
        ("vocab 1x8", (1, 8), dict(layout="vocab", batch_axis="batch"), "vocab"),
        ("vocab 1x8, W1 split", (1, 8), dict(layout="vocab", batch_axis="batch", w1_sharded=True), "vocab+w1"),
        ("vocab 2x4", (2, 4), dict(layout="vocab", batch_axis="batch"), "vocab"),
        ("replicated 1x8", (1, 8), dict(layout="replicated", batch_axis="batch"), "replicated"),
        ("replicated 2x4", (2, 4), dict(layout="replicated", batch_axis="batch"), "replicated"),
    ]


def place(mesh, how, head, inputs, sampled):
    if mesh is None:
        dev = jax.devices()[0]
        return jax.device_put((head, inputs, sampled), dev)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    rows = ("batch", "vocab") if how == "batch" else "batch"
    cols = None if how == "batch" else "vocab"
    along = "vocab" if how.startswith("vocab") else None
    head = type(head)(w1=put(head.w1, "vocab" if how == "vocab+w1" else None), q=put(head.q, along),
                      scale=put(head.scale, along))
    inputs = dict(base_logits=put(inputs["base_logits"], rows, None, cols), anchor=put(inputs["anchor"], rows))
    sampled = {k: put(v, rows) for k, v in sampled.items()}
    return head, inputs, sampled


def build(label, shape, walk_kw, how, impl, sampled_mode, problem):
    head, inputs, sampled = problem
    mesh = None if shape is None else jax.make_mesh(shape, AXES)
    head, inputs, sampled = place(mesh, how, head, inputs, sampled)
    extra = sampled if sampled_mode else {}
    if mesh is None:
        fn = jax.jit(lambda head, inputs, extra: jax_markov.walk(head=head, impl=impl, **inputs, **extra).tokens)
    else:
        fn = jax.jit(lambda head, inputs, extra: sharding.walk(head=head, mesh=mesh, impl=impl, **walk_kw,
                                                                **inputs, **extra).tokens)
    compiled = fn.lower(head, inputs, extra).compile()
    return lambda: compiled(head, inputs, extra).block_until_ready()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--impls", default="reference,auto")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sharding_cpu.md")
    ap.add_argument("--note", action="append", default=[], help="an extra line for the results header")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats, no file written")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.vocab, args.rank, args.repeats = 8, 2, 512, 16, 2
    assert jax.device_count() >= N_DEVICES, jax.devices()
    problem = make_problem(args.batch, args.steps, args.vocab, args.rank)

    rows, runners = [], []
    for impl in args.impls.split(","):
        for mode in ("greedy", "mixed"):
            for label, shape, walk_kw, how in arms(impl):
                runners.append(((label, impl, mode), build(label, shape, walk_kw, how, impl, mode == "mixed", problem)))
    times = {key: [] for key, _ in runners}
    for _, run in runners:  # warm up
        run()
        run()
    for _ in range(args.repeats):
        for key, run in runners:
            t = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t)
    base = {(impl, mode): statistics.median(times[("unsharded (1 device)", impl, mode)])
            for (_, impl, mode) in times}
    for (label, impl, mode), ts in times.items():
        med = statistics.median(ts)
        rows.append((impl, mode, label, med * 1e3, min(ts) * 1e3, base[(impl, mode)] / med))

    b, k, v, r = args.batch, args.steps, args.vocab, args.rank
    per_step = lambda n, bl: n * bl * 2 * 4
    custom_call = ('built: impl="auto" runs it on every device' if native.cpu_available()
                   else 'not built: impl="auto" is the reference')
    lines = [
        "# jax_markov.sharding on 8 CPU host devices",
        "",
        f"- command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores shared by the 8 XLA host devices",
        f"- jax {jax.__version__}, jax_markov from `{Path(jax_markov.__file__).parent}`; CPU custom call {custom_call}",
        f"- commit: {commit_line()}",
        f"- problem: B = {b}, K = {k}, V = V_target = {v}, r = {r}; int8 W2 ({v * r / 2**20:.1f} MiB + scales), "
        f"bf16 W1, bf16 base logits ({b * k * v * 2 / 2**20:.1f} MiB); mixed = half the rows sampled",
        f"- collectives per call: batch none; vocab 1x8 {k} all-gathers of {per_step(8, b)} B "
        f"(2x4: {per_step(4, b // 2)} B), W1 split adds {k} psums of {b * r * 2} B; replicated one all-gather of "
        f"the base logits ({b * k * v * 2 / 2**20:.1f} MiB in bf16, gathered as f32 by XLA on the CPU)",
        f"- timing: arms interleaved call by call, {args.repeats} timed calls each after 2 warm-up calls",
        *[f"- {note}" for note in args.note],
        "",
        "| impl | rows | layout | median ms | min ms | speedup vs unsharded |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {impl} | {mode} | {label} | {med:.2f} | {mn:.2f} | {sp:.2f}x |" for impl, mode, label, med, mn, sp in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
