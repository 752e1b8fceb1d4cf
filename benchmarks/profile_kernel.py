"""Runs the kernel a few times per configuration, for a profiler to capture (ncu, compute-sanitizer),
or (--device-times) times its launches itself from the device activity that jax.profiler records.

    ncu --clock-control none --kernel-name regex:MarkovWalk --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_kernel.py 151936,7,1,greedy 151936,7,64,probabilistic 151936,7,1,greedy,bf16
    compute-sanitizer --tool memcheck python3 benchmarks/profile_kernel.py 5003,3,3,probabilistic
    python3 benchmarks/profile_kernel.py --device-times 151936,7,64,greedy 151936,7,24,probabilistic
    python3 benchmarks/profile_kernel.py --tokens 151936,7,64,greedy 5003,3,17,greedy
    python3 benchmarks/profile_kernel.py --device-times 151936,7,1,greedy 151936,7,1,greedy,certified

The head of a config is int8 (the default: quantize's head, with its tiles), untiled (the int8 head
without tiles: quantize(head, tiles=False)), certified (a CertifiedMarkovHead of the same weights, with
tiles: its certified walk: up to 8 requests, or 9-64 greedy ones), certified-untiled (the same without
tiles) or bf16.

With --device-times, each config's chained walks run once to compile and warm up, then again under
the profiler; every walk kernel launch of that run prints as a line "KERNEL <config> <name> <us>", in
launch order, a run of requests' guarded launches (a sampled call's, ffi/common/walk_config.h's
RunWhen) as one line: their sum, under the name of the one that walked. With --tokens, each config's chained walks print what they chose as a line
"TOKENS <config> <fingerprint>" (fingerprint: the last walk's tokens and logits, hashed), so that
kernel versions can be compared bit for bit (benchmarks/ab_kernels.py --tokens).
"""
from __future__ import annotations

import glob
import hashlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm

MODES = ("greedy", "greedy-logits", "probabilistic", "greedy-logits-f32", "probabilistic-f32", "greedy-t0")
# quantize's options for each int8 head; "bf16" walks the MarkovHead itself.
QUANTIZE = {"int8": dict(certified=False, tiles=True), "untiled": dict(certified=False, tiles=False),
            "certified": dict(certified=True, tiles=True), "certified-untiled": dict(certified=True, tiles=False)}
HEADS = (*QUANTIZE, "bf16")


def walk_options(mode: str, batch: int) -> dict:
    """The keyword arguments of `jm.walk` for one mode."""
    if mode == "greedy":
        return {}
    if mode == "greedy-t0":  # a serving loop's batch with no sampled row: temperatures 0, tokens only
        return dict(temperature=jnp.zeros((batch,)), key=jax.random.split(jax.random.key(1), batch),
                    position=jnp.arange(batch, dtype=jnp.int32))
    kw = dict(return_logits=True, logits_dtype=jnp.float32 if mode.endswith("-f32") else jnp.bfloat16)
    if mode.startswith("probabilistic"):
        kw.update(temperature=jnp.full((batch,), 0.8), key=jax.random.split(jax.random.key(1), batch),
                  position=jnp.arange(batch, dtype=jnp.int32))
    return kw


def prepare(vocab: int, steps: int, batch: int, mode: str, head_format: str = "int8"):
    """The jitted walk of one configuration and its inputs; head_format "int8" (quantized, with tiles),
    "untiled" (quantized without tiles), "certified" (quantize(head, certified=True): the certified walk
    of up to 8 requests or 9-64 greedy ones), "certified-untiled" (the same without tiles) or "bf16"."""
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    head = jm.MarkovHead(w1, w2)
    if head_format in QUANTIZE:
        head = jm.quantize(head, **QUANTIZE[head_format])
    base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    kw = walk_options(mode, batch)
    return jax.jit(lambda base, anchor: jm.walk(base, anchor, head, impl="ffi", **kw)), base, anchor


def walk_chain(f, base, anchor, calls: int):
    """`calls` walks, each anchored on the previous one's last token."""
    for _ in range(calls):
        out = f(base, anchor)
        anchor = out.tokens[:, -1]
    return jax.block_until_ready(out)


def fingerprint(out) -> str:
    """A walk's tokens and logits (if any), hashed: "tokens=<12 hex> logits=<12 hex or ->"."""
    tokens = hashlib.sha1(np.asarray(out.tokens).tobytes()).hexdigest()[:12]
    logits = "-" if out.logits is None else hashlib.sha1(np.asarray(out.logits).tobytes()).hexdigest()[:12]
    return f"tokens={tokens} logits={logits}"


def run(vocab: int, steps: int, batch: int, mode: str, head_format: str = "int8", calls: int = 3) -> None:
    """`calls` chained walks of one configuration."""
    out = walk_chain(*prepare(vocab, steps, batch, mode, head_format), calls)
    print(f"V={vocab} K={steps} B={batch} {mode} {head_format}: tokens[0] = {np.asarray(out.tokens[0]).tolist()}")


# The walk's kernels, in a demangled name ("void jax_markov::walk::MarkovWalkKernel<...>(...)") or a
# mangled one ("_ZN10jax_markov4walk16MarkovWalkKernelILi2E...").
_WALK_KERNEL = re.compile(r"(MarkovWalk(?:TransposedKernel|Kernel|Noise))")


def walk_kernel_events(planes) -> list[tuple[str, float]]:
    """(kernel, microseconds) of every walk kernel (MarkovWalk*) on the GPU streams of a profile's
    planes, in start order; the kernel is its bare name (MarkovWalkKernel, MarkovWalkNoise, ...)."""
    events = []
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                named = _WALK_KERNEL.search(e.name)
                if named:
                    events.append((e.start_ns, named.group(1), e.duration_ns / 1e3))
    return [(name, us) for _, name, us in sorted(events)]


def fold_guarded_pairs(events: list[tuple[str, float]], plan: list[dict]) -> list[tuple[str, float]]:
    """One (kernel, us) per run of requests of chained calls whose launches `plan` lists (one call's,
    native.cuda_launch_plan): a run's guarded launches (those of one "first" request, of which one walks
    and the others return at once) count as one, their sum under the longest one's name."""
    if len(events) % len(plan):
        raise ValueError(f"{len(events)} walk kernel launches are not whole calls of {len(plan)} launches")
    folded, group = [], []
    calls = len(events) // len(plan)
    for i, (launch, event) in enumerate(zip(plan * calls, events)):
        group.append(event)
        following = plan[(i + 1) % len(plan)]
        if i + 1 == len(events) or (i + 1) % len(plan) == 0 or following["first"] != launch["first"]:
            folded.append((max(group, key=lambda e: e[1])[0], sum(us for _, us in group)))
            group = []
    return folded


def launch_plan(spec: str) -> list[dict]:
    """The launches of one call of a config (as `prepare` builds it) on this machine's GPU."""
    from jax_markov import native

    vocab, steps, batch, mode, head_format = parse(spec)
    kw = walk_options(mode, batch)
    w2_dtype = jnp.int8 if head_format in QUANTIZE else jnp.bfloat16
    options = QUANTIZE.get(head_format, dict(certified=False, tiles=False))
    return native.cuda_launch_plan(batch, steps, vocab, 256, jnp.bfloat16, w2_dtype, base_dtype=jnp.bfloat16,
                                   logits_dtype=kw.get("logits_dtype"), sampling="temperature" in kw,
                                   certified=options["certified"], w2_tiles=options["tiles"])


def device_times(spec: str, calls: int = 3) -> list[tuple[str, float]]:
    """The walk kernels of `calls` chained walks of one config, timed by the profiler, after a warm-up
    (a guarded pair's launches folded into one)."""
    from jax.profiler import ProfileData

    f, base, anchor = prepare(*parse(spec))
    walk_chain(f, base, anchor, calls)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            walk_chain(f, base, anchor, calls)
        files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        events = walk_kernel_events(ProfileData.from_file(files[0]).planes if files else [])
    return fold_guarded_pairs(events, launch_plan(spec))


def parse(spec: str) -> tuple:
    """"V,K,B,mode[,head]" -> (V, K, B, mode, head_format). Modes: greedy (no logits out), greedy-logits
    (bf16 logits out), probabilistic (every request at T = 0.8, bf16 logits out); the "-f32" forms of
    the last two write float32 logits (the API's default) instead; greedy-t0 (temperatures 0 with keys
    and positions, no logits out)."""
    parts = spec.split(",")
    if parts[3] not in MODES:
        raise ValueError(f"mode {parts[3]!r} of {spec!r} is not one of {MODES}")
    head = parts[4] if len(parts) > 4 else "int8"
    if head not in HEADS:
        raise ValueError(f"head {head!r} of {spec!r} is not one of {HEADS}")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3], head


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--device-times"]:
        for spec in args[1:]:
            for name, us in device_times(spec):
                print(f"KERNEL {spec} {name} {us:.3f}", flush=True)
    elif args[:1] == ["--tokens"]:
        for spec in args[1:]:
            print(f"TOKENS {spec} {fingerprint(walk_chain(*prepare(*parse(spec)), 3))}", flush=True)
    else:
        for spec in args or ["151936,7,1,greedy"]:
            run(*parse(spec))
