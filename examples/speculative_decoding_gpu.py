"""Speculative decoding at the published model's shape: output tokens per second of the whole decode
loop with the eager walk, the int8 kernel and the bf16-head kernel, beside the target alone.

    python3 examples/speculative_decoding_gpu.py          # every setting: examples/results/speculative_decoding_<gpu>.*
    python3 examples/speculative_decoding_gpu.py --settings 7,1,greedy 7,1,sampled --out OUT/h100
    python3 examples/speculative_decoding_gpu.py --merge OUT1/h100.json OUT2/h100.json   # one report of two runs
    python3 examples/speculative_decoding_gpu.py --tiny --settings 3,2,greedy --out /tmp/tiny   # a toy, any device

The target has Qwen3-4B's shape (hidden 2560, 36 layers, 32 query / 8 KV heads of 128, intermediate
9728, vocabulary 151936, bf16 weights) with random weights and the low-rank bigram structure of the
toy example (examples/speculative_decoding.py: `bigram_lm`), so that a DSpark drafter whose Markov
head is fitted to it (the toy's fit) drafts what the target accepts at a realistic rate. The drafter
is one layer of the target's width (random backbone, sharing the target's embedding and LM head),
with blocks of K = 7 and 16 drafts.

A setting is (K, B, mode): B requests (fixed random prompts), greedy or sampled at T = 1, 512 new
tokens each. Its arms are jitted decode loops (`jax_markov.speculative`): the target alone, and the
drafter with the eager walk (the pure-JAX reference walking the bf16 head, impl="reference"), the
int8 kernel (the int8 head, impl="ffi") and the bf16-head kernel (the bf16 head, impl="ffi"; off a
GPU, "ffi" is the CPU custom call). Sampled walks return bf16 draft logits. Each arm is compiled and
run once, then the arms run in turn (each repeat starting at the next arm) --repeats times; tokens/s
is B x new tokens over the median wall time of one decode (prefill included, compilation excluded).
Greedy arms must reproduce the target's own greedy text token for token (the exit status is 1 where
one does not; the report names the first differing token and the target's logit gap there).

One verify step is split into its parts, each jitted alone at the loop's shapes (target forward over
K + 1 tokens with the whole KV cache, drafter block with its LM head and context update, walk,
rejection sampler): the GPU's busy time per call from the profiler's device activity
(benchmarks/gpu_measure.py), wall time off a GPU. The device memory of the draft path: the head's
layouts, the walk's scratch (the compiled walk's temp size), the drafter backbone and its context.

The report is written after every setting (a run cut short keeps what it measured); --merge joins the
.json of runs over different settings (one GPU, jax, commit and configuration) into one report. Most of
a run's time is compiling the 36-layer programs: with JAX_COMPILATION_CACHE_DIR set, later runs on the
same machine load the ones they share (the head fit, the target's programs) from that folder.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a script: `examples` and `benchmarks` import from the repository root, put last
    sys.path.append(str(ROOT))  # so that an installed jax_markov comes first

from benchmarks.gpu_measure import memory_per_call, profile_programs, walk_arm  # noqa: E402
from benchmarks.gpu_report import ARMS  # noqa: E402
from benchmarks.gpu_timing import command_line, commit, results_name  # noqa: E402
from examples import speculative_decoding as toy  # noqa: E402
from jax_markov import speculative as sp  # noqa: E402

RESULTS = ROOT / "examples" / "results"
# The target and drafter sizes (keys as in the toy example's configuration).
QWEN3_4B = dict(vocab=151936, hidden=2560, intermediate=9728, target_layers=36, heads=32, kv_heads=8, head_dim=128,
                drafter_layers=1, dtype="bfloat16", markov_rank=256, bigram_rank=128, sharpness=5.0,
                context_scale=0.005, prompt_len=32, new_tokens=512, seed=0)
TINY = dict(QWEN3_4B, vocab=512, hidden=64, intermediate=128, target_layers=2, heads=4, kv_heads=2, head_dim=16,
            markov_rank=32, bigram_rank=16, context_scale=0.05, prompt_len=8, new_tokens=24)
SETTINGS = [(k, b, mode) for mode in ("greedy", "sampled") for k in (7, 16) for b in (1, 16)]
WALK_ARMS = ("eager", "kernel-int8", "kernel-bf16")  # the drafter's arms, named as benchmarks/gpu_report.ARMS
ARM_NAMES = dict(target="target alone", **{arm: ARMS[arm] for arm in WALK_ARMS})
# The published kernel of this design end to end on Qwen3-4B, one H100: output tokens/s of the int8
# kernel over the eager walk (vLLM's sequential loop on the bf16 head), in percent, by (K, B, mode).
# Source: issue 66, quoting the kernel's publication (shared/PEERS.md: "+4.3% to +11.7% output
# tokens/s over the eager loop"); sampled figures were published at batch 1 only.
PUBLISHED_GAIN_PERCENT = {(7, 1, "greedy"): 4.3, (7, 16, "greedy"): 4.6, (16, 1, "greedy"): 9.3,
                          (16, 16, "greedy"): 8.8, (7, 1, "sampled"): 5.5, (16, 1, "sampled"): 11.7}
PARTS = ("target forward", "drafter", "walk", "rejection sampler")
MB = 1e6


# ------------------------------------------------------------------------------------------------
# the runs


def prompts(cfg, batch: int):
    """Fixed random prompts [B, P] (request b is the same for every B) and their lengths."""
    rng = np.random.default_rng(cfg["seed"] + 3)
    prompt = rng.integers(0, toy.mask_token(cfg), (batch, cfg["prompt_len"]))
    return jnp.asarray(prompt, jnp.int32), jnp.full((batch,), cfg["prompt_len"], jnp.int32)


def sampling_arguments(cfg, mode: str, batch: int) -> dict:
    """temperature and key of a mode: none for greedy, T = 1 and a key per request for sampled."""
    if mode == "greedy":
        return {}
    return dict(temperature=jnp.ones((batch,), jnp.float32),
                key=jax.random.split(jax.random.key(cfg["seed"] + 4), batch))


def arm_drafter(drafters: dict, arm: str):
    return drafters["int8 head" if "int8" in arm else "bf16 head"]


def decode_runs(target, drafters, cfg, batch: int, mode: str, arms) -> dict:
    """{arm: fn() -> DecodeResult}: the target alone, then the drafter with each walk arm."""
    prompt, lengths = prompts(cfg, batch)
    kw = dict(max_new_tokens=cfg["new_tokens"], **sampling_arguments(cfg, mode, batch))
    runs = {"target": functools.partial(sp.target_decode, target, prompt, lengths, **kw)}
    for arm in arms:
        impl = "ffi" if arm.startswith("kernel") else "reference"
        runs[arm] = functools.partial(sp.speculative_decode, target, arm_drafter(drafters, arm), prompt, lengths,
                                      impl=impl, logits_dtype=jnp.bfloat16, **kw)
    return runs


def time_interleaved(runs: dict, repeats: int, log):
    """Each run compiled and run once, then all of them in turn, `repeats` times, each repeat starting
    at the next run. Returns ({name: first result}, {name: [seconds]})."""
    results, seconds = {}, {name: [] for name in runs}
    for name, fn in runs.items():
        start = time.perf_counter()
        results[name] = jax.block_until_ready(fn())
        log(f"    {name}: compiled and ran in {time.perf_counter() - start:.1f} s")
    names = list(runs)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(runs[name]())
            seconds[name].append(time.perf_counter() - start)
    return results, seconds


@nnx.jit
def logits_at(model, tokens, position):
    """The target's logits [B, V] for the token at `position` [B] of `tokens` [B, S] (one forward)."""
    b, s = tokens.shape
    out = model(tokens, jnp.zeros(b, jnp.int32), model.init_cache(b, s),
                feature_layers=(model.config.num_hidden_layers - 1,))
    hidden = jnp.take_along_axis(out.features, (position - 1)[:, None, None], axis=1)[:, 0]
    return model.unembed(model.model.norm(hidden))


def divergences(target, result, reference) -> list[dict]:
    """Where a greedy decode's tokens differ from the target's own: per differing request, the first
    differing new token and the target's logit gap there between its own token and the arm's (from one
    forward over the target's text: a gap near 0 is a near-tie that rounding can flip)."""
    got, want = np.asarray(result.tokens), np.asarray(reference.tokens)
    differing = [b for b in range(got.shape[0]) if not np.array_equal(got[b], want[b])]
    if not differing:
        return []
    first = np.array([int(np.argmax(got[b] != want[b])) if b in differing else 1 for b in range(got.shape[0])])
    logits = np.asarray(logits_at(target, jnp.asarray(want), jnp.asarray(first, jnp.int32)))
    prompt_length = int(reference.prompt_lengths[0])
    return [dict(request=b, new_token=int(first[b]) - prompt_length,
                 logit_gap=float(logits[b, want[b, first[b]]] - logits[b, got[b, first[b]]])) for b in differing]


def device_ms(programs: dict, repeats: int) -> tuple[dict, str]:
    """({name: ms per call}, how): each zero-argument program's GPU busy time per call from the
    profiler's device activity (median over repeats) on a GPU; the median wall time elsewhere, or
    where the profiler shows no device activity."""
    for fn in programs.values():
        jax.block_until_ready(fn())
    if jax.devices()[0].platform == "gpu":
        profiled = profile_programs(programs, repeats)
        if profiled is not None:
            return ({name: statistics.median(busy for busy, _ in runs) * 1e-6 for name, runs in profiled.items()},
                    "GPU busy time per call from the profiler's device activity (benchmarks/gpu_measure.py)")
        warnings.warn("the profiler trace does not show the verify step's parts: reporting wall time",
                      RuntimeWarning, stacklevel=2)
    times = {}
    for name, fn in programs.items():
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e3
    return times, "wall time per call (block_until_ready), median"


def verify_step(target, drafters, cfg, block_size: int, batch: int, mode: str, arms, repeats: int) -> dict:
    """The parts of one verify step, each jitted alone at the decode loop's shapes (anchor halfway
    through the new tokens, caches of the loop's length; their contents do not change the work), and
    the draft path's device memory per arm. Returns dict(parts={part: ms, "walk": {arm: ms}}, memory=
    {arm: {...}}, method=how the parts were timed)."""
    drafter = drafters["bf16 head"]
    layers = drafter.target_layer_ids
    total = cfg["prompt_len"] + cfg["new_tokens"] + block_size + 1
    prompt, _ = prompts(cfg, batch)
    anchor, anchor_pos = prompt[:, -1], jnp.full((batch,), cfg["prompt_len"] + cfg["new_tokens"] // 2, jnp.int32)
    cache, context = target.init_cache(batch, total), drafter.init_context(batch, total)
    sampling = sampling_arguments(cfg, mode, batch)
    walk_inputs = dict(sampling, position=anchor_pos + 1) if sampling else {}
    walk_mode = "probabilistic" if sampling else "greedy"  # gpu_measure's name: bf16 draft logits returned
    target_def, target_state = nnx.split(target)
    drafter_def, drafter_state = nnx.split(drafter)

    @jax.jit
    def target_forward(state, block, cache):
        return nnx.merge(target_def, state)(block, anchor_pos, cache, feature_layers=layers)

    @jax.jit
    def drafter_step(state, target_state, context, features):  # the block's base logits; the context update
        d, t = nnx.merge(drafter_def, state), nnx.merge(target_def, target_state)
        base = d.base_logits(d.hidden(anchor, anchor_pos, context, embed=t.embed), unembed=t.unembed)
        return base, d.extend_context(features, anchor_pos, context)

    rejection = jax.jit(functools.partial(sp.rejection_sample, position=anchor_pos + 1, **sampling))
    heads = {arm: arm_drafter(drafters, arm).markov_head.head() for arm in arms}
    walks = {arm: jax.jit(functools.partial(walk_arm, arm, walk_mode)) for arm in arms}

    block = jnp.tile(anchor[:, None], (1, block_size + 1))  # [anchor, drafts]: which tokens does not matter
    verify = target_forward(target_state, block, cache)
    base, _ = drafter_step(drafter_state, target_state, context, verify.features)
    draft = walks[arms[0]](heads[arms[0]], base, anchor, walk_inputs)
    programs = {"target forward": lambda: target_forward(target_state, block, cache),
                "drafter": lambda: drafter_step(drafter_state, target_state, context, verify.features),
                "rejection sampler": lambda: rejection(draft.tokens, verify.logits, draft.logits)}
    programs.update({arm: functools.partial(walks[arm], heads[arm], base, anchor, walk_inputs) for arm in arms})
    times, method = device_ms(programs, repeats)

    def nbytes(tree):
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    shared = dict(drafter_bytes=nbytes(nnx.state(drafter)) - nbytes(nnx.state(drafter.markov_head)),
                  context_bytes=nbytes(jax.eval_shape(lambda: drafter.init_context(batch, total))))
    memory = {arm: dict(shared, head_bytes=int(heads[arm].nbytes), walk_scratch_bytes=memory_per_call(
        arm, walk_mode, heads[arm], base, anchor, walk_inputs)["scratch_bytes"]) for arm in arms}
    parts = {part: times[part] for part in PARTS if part != "walk"}
    return dict(parts=dict(parts, walk={arm: times[arm] for arm in arms}), memory=memory, method=method)


def measure_setting(target, drafters, cfg, setting, arms, repeats: int, log) -> list[dict]:
    """One row per arm of a setting (K, B, mode): tokens/s, acceptance, the greedy check, the verify
    step's parts and the draft path's memory."""
    block_size, batch, mode = setting
    results, seconds = time_interleaved(decode_runs(target, drafters, cfg, batch, mode, arms), repeats, log)
    step = verify_step(target, drafters, cfg, block_size, batch, mode, arms, repeats)
    reference = results["target"]
    rows = []
    for arm, result in results.items():
        median = statistics.median(seconds[arm])
        iterations = int(jnp.max(result.num_steps))
        row = dict(block_size=block_size, batch=batch, mode=mode, arm=arm, seconds=seconds[arm],
                   tokens_per_s=batch * cfg["new_tokens"] / median,
                   tokens_per_s_range=[batch * cfg["new_tokens"] / max(seconds[arm]),
                                       batch * cfg["new_tokens"] / min(seconds[arm])],
                   iterations=iterations, ms_per_iteration=median * 1e3 / iterations)
        if arm != "target":
            row.update(acceptance_length=result.mean_acceptance_length(), accepted=int(jnp.sum(result.num_accepted)),
                       drafted=int(jnp.sum(result.num_steps)) * block_size, **step["memory"][arm],
                       parts_ms=dict(step["parts"], walk=step["parts"]["walk"][arm]), parts_method=step["method"])
            if mode == "greedy":
                row["divergences"] = divergences(target, result, reference)
        rows.append(row)
        log(f"  K={block_size} B={batch} {mode:7s} {ARM_NAMES[arm]:28s} {row['tokens_per_s']:9.1f} tok/s  "
            f"{row['ms_per_iteration']:7.2f} ms/iteration" + (f"  acceptance length {row['acceptance_length']:.3f}"
                                                             if arm != "target" else ""))
    return rows


# ------------------------------------------------------------------------------------------------
# the report


def row_key(r: dict) -> tuple:
    return r["block_size"], r["batch"], r["mode"], r["arm"]


def gains(rows: list[dict]) -> dict:
    """{row_key: dict(gain=, iteration_gain=, speedup=)}: a drafter arm's gain in tokens/s over the eager
    walk at the same setting and that of its loop iterations' speed (eager ms per iteration over the
    arm's, which acceptance does not change), in percent; every arm's speedup over the target alone.
    None where the arm compared with was not measured."""
    by_key = {row_key(r): r for r in rows}
    out = {}
    for r in rows:
        eager, alone = by_key.get((*row_key(r)[:3], "eager")), by_key.get((*row_key(r)[:3], "target"))
        compared = eager is not None and r["arm"] != "target"
        out[row_key(r)] = dict(
            gain=100.0 * (r["tokens_per_s"] / eager["tokens_per_s"] - 1.0) if compared else None,
            iteration_gain=100.0 * (eager["ms_per_iteration"] / r["ms_per_iteration"] - 1.0) if compared else None,
            speedup=None if alone is None else r["tokens_per_s"] / alone["tokens_per_s"])
    return out


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def percent(value) -> str:
    return "" if value is None else f"{value:+.1f}%"


def check_text(r: dict) -> str:
    if r["arm"] == "target":
        return "reference"
    if r["mode"] == "sampled":
        return f"{r['accepted']} of {r['drafted']} drafts accepted"
    if not r["divergences"]:
        return "identical to the target's greedy text"
    return "DIFFERS from the target's greedy text: " + "; ".join(
        f"request {d['request']} from new token {d['new_token']} (target logit gap {d['logit_gap']:.3g})"
        for d in r["divergences"])


def summary(rows: list[dict]) -> list[str]:
    """The int8 kernel against the eager walk at every setting, against the published gains, and the
    greedy check."""
    gain = gains(rows)
    kernel = [r for r in rows if r["arm"] == "kernel-int8" and gain[row_key(r)]["gain"] is not None]
    beats = [r for r in kernel if gain[row_key(r)]["gain"] > 0]
    faster = [r for r in kernel if gain[row_key(r)]["iteration_gain"] > 0]
    published = [r for r in kernel if row_key(r)[:3] in PUBLISHED_GAIN_PERCENT]
    above = [r for r in published if gain[row_key(r)]["gain"] > PUBLISHED_GAIN_PERCENT[row_key(r)[:3]]]
    greedy = [r for r in rows if r["mode"] == "greedy" and r["arm"] != "target"]
    differing = [r for r in greedy if r["divergences"]]
    return [f"- the int8 kernel's tokens/s beat the eager walk's at {len(beats)} of {len(kernel)} settings, and by "
            f"more than the published gain at {len(above)} of the {len(published)} settings that have one; its loop "
            f"iterations were faster than the eager walk's at {len(faster)} of {len(kernel)}",
            "- greedy output equal to the target's own greedy decoding, token for token: "
            f"{len(greedy) - len(differing)} of {len(greedy)} greedy drafter arms"
            + (" (see the check column)" if differing else "")]


def title(report: dict) -> str:
    shape = "Qwen3-4B's shape" if report["config"]["vocab"] == QWEN3_4B["vocab"] else "a toy of Qwen3-4B's structure"
    return f"Speculative decoding at {shape} on {report['device']}"


def markdown(report: dict) -> str:
    cfg, rows = report["config"], sorted(report["rows"], key=lambda r: (
        r["mode"] != "greedy", r["block_size"], r["batch"], list(ARM_NAMES).index(r["arm"])))
    gain = gains(rows)
    repeats = "/".join(sorted({str(len(r["seconds"])) for r in rows}))  # merged runs may differ
    fits = ", ".join(f"K = {k}: {e:.2e}" for k, e in sorted(report["fit_errors"].items(), key=lambda kv: int(kv[0])))
    lines = [f"# {title(report)}", ""]
    lines += [f"- command: `{run['command']}` ({run['date']})" for run in report["runs"]]
    if report.get("merge_command"):
        lines.append(f"- merged into one report by `{report['merge_command']}`")
    lines += [
        f"- device: {report['device']}; jax {report['jax']}, jaxlib {report['jaxlib']}, flax {report['flax']}, "
        f"Python {report['python']}",
        f"- commit: {report['commit']}",
        "",
        "## Setup",
        "",
        f"- target: Qwen3-style `CausalLM`, {cfg['target_layers']} layers, hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}, {cfg['heads']} query / {cfg['kv_heads']} KV heads of {cfg['head_dim']}, vocabulary "
        f"{cfg['vocab']}, {cfg['dtype']} weights (untied LM head), float32 KV cache; random weights with a "
        f"rank-{cfg['bigram_rank']} bigram structure (scale {cfg['sharpness']:g}) and a context term from every "
        f"layer (context scale {cfg['context_scale']:g}) (`jax_markov.flax.bigram_lm`).",
        f"- drafter: `DSparkDrafter`, {cfg['drafter_layers']} layer of the target's width ({cfg['dtype']}, random "
        f"backbone), reading 3 of the target's layers, sharing its embedding and LM head; Markov head of rank "
        f"{cfg['markov_rank']} fitted to the target's bigram table minus the drafter's mask-row logits "
        f"(examples/speculative_decoding.py: `fit_markov_head`; relative error of the rank-r truncation: {fits}); "
        "the eager walk and the bf16-head kernel walk that head in bf16, the int8 kernel its per-row int8 W2.",
        f"- B requests with fixed prompts of {cfg['prompt_len']} random tokens, {cfg['new_tokens']} new tokens each, "
        "greedy or sampled at T = 1 (sampled walks return bf16 draft logits); every arm is one jitted "
        "`lax.while_loop` (`jax_markov.speculative`).",
        f"- tokens/s: B x new tokens over the median wall time of one decode (prefill included, compilation "
        f"excluded; range: slowest and fastest run), the arms run in turn, {repeats} times each. "
        "Gain: over the eager walk's tokens/s at the same setting. Mean acceptance length: tokens per verify step "
        "(accepted drafts + 1). ms per iteration: the median decode over its loop iterations; iteration gain: the "
        "eager walk's ms per iteration over the arm's, a speed that acceptance does not change (a sampled int8 "
        "arm drafts other tokens than the bf16 arms, so its text and acceptance length vary apart from theirs).",
        "- verify step: its parts each jitted alone at the loop's shapes (anchor halfway through the new tokens, "
        f"caches of the loop's length); {next(r['parts_method'] for r in rows if 'parts_method' in r)}. The loop "
        "iteration adds what runs between the parts (the cache and text updates, the loop's control).",
        "- published: the gain in output tokens/s of the published int8 kernel over its eager walk end to end on "
        "Qwen3-4B, one H100 (issue 66; shared/PEERS.md).",
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
        "## Output tokens per second",
        "",
        "| K | B | mode | arm | tokens/s | range | gain vs eager | published gain | speedup vs target "
        "| mean acceptance length | loop iterations | ms per iteration | iteration gain vs eager | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = gain[row_key(r)]
        published = PUBLISHED_GAIN_PERCENT.get(row_key(r)[:3]) if r["arm"] == "kernel-int8" else None
        lo, hi = r["tokens_per_s_range"]
        lines.append(f"| {r['block_size']} | {r['batch']} | {r['mode']} | {ARM_NAMES[r['arm']]} | "
                     f"{r['tokens_per_s']:.1f} | {lo:.1f}-{hi:.1f} | {percent(g['gain'])} | {percent(published)} | "
                     f"{fmt(g['speedup'], '.2f')}x | {fmt(r.get('acceptance_length'), '.3f')} | {r['iterations']} | "
                     f"{r['ms_per_iteration']:.2f} | {percent(g['iteration_gain'])} | {check_text(r)} |")
    lines += ["", "## One verify step", "",
              "| K | B | mode | arm | target forward ms | drafter ms | walk ms | rejection sampler ms | sum ms "
              "| loop iteration ms | walk share of the iteration |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["arm"] != "target":
            p = r["parts_ms"]
            total = sum(p[part] for part in PARTS)
            lines.append(f"| {r['block_size']} | {r['batch']} | {r['mode']} | {ARM_NAMES[r['arm']]} | "
                         + " | ".join(f"{p[part]:.3f}" for part in PARTS)
                         + f" | {total:.3f} | {r['ms_per_iteration']:.3f} | {p['walk'] / r['ms_per_iteration']:.1%} |")
    lines += ["", "## Device memory of the draft path", "",
              "| K | B | mode | arm | head MB | walk scratch MB | drafter backbone MB | drafter context MB |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["arm"] != "target":
            lines.append(f"| {r['block_size']} | {r['batch']} | {r['mode']} | {ARM_NAMES[r['arm']]} | "
                         f"{r['head_bytes'] / MB:.1f} | {r['walk_scratch_bytes'] / MB:.1f} | "
                         f"{r['drafter_bytes'] / MB:.1f} | {r['context_bytes'] / MB:.1f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Bars of every arm's tokens/s per setting, the gain over the eager walk on the drafter arms and,
    where published, the published gain as a mark above the eager bar; nothing without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["rows"]
    settings = sorted({row_key(r)[:3] for r in rows}, key=lambda s: (s[2] != "greedy", s[0], s[1]))
    arms = [a for a in ARM_NAMES if any(r["arm"] == a for r in rows)]
    by_key, gain = {row_key(r): r for r in rows}, gains(rows)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(settings)), 5))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        placed = [(x + i * width, by_key[(*s, arm)]) for x, s in enumerate(settings) if (*s, arm) in by_key]
        ax.bar([x for x, _ in placed], [r["tokens_per_s"] for _, r in placed], width, label=ARM_NAMES[arm])
        for x, r in placed:
            g = gain[row_key(r)]["gain"]
            if arm != "eager" and g is not None:
                ax.annotate(f"{g:+.1f}%", (x, r["tokens_per_s"]), ha="center", va="bottom", fontsize=7)
    marks = [(x + arms.index("kernel-int8") * width, by_key[(*s, "eager")]["tokens_per_s"]
              * (1 + PUBLISHED_GAIN_PERCENT[s] / 100)) for x, s in enumerate(settings)
             if s in PUBLISHED_GAIN_PERCENT and (*s, "eager") in by_key and "kernel-int8" in arms]
    if marks:  # on the int8 kernel's bar: the tokens/s that the published gain would give it
        ax.scatter(*zip(*marks), marker="_", s=200, color="k", zorder=3, label="eager x (1 + published gain)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(settings))])
    ax.set_xticklabels([f"K={k} B={b}\n{mode}" for k, b, mode in settings], fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title(report))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, prefix) -> str:
    """<prefix>.md, .json and (with matplotlib) .png; returns the markdown."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    prefix.with_suffix(".md").write_text(text)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, prefix.with_suffix(".png"))
    return text


def merge_reports(reports: list[dict], merge_command: str) -> dict:
    """One report from several runs' of one device, jax, commit and configuration; a row measured in
    more than one run is the later run's. Raises ValueError where they do not belong together."""
    for field in ("device", "jax", "commit", "config"):
        if len({json.dumps(r[field], sort_keys=True) for r in reports}) > 1:
            raise ValueError(f"the reports differ in {field}")
    rows = {row_key(row): row for r in reports for row in r["rows"]}
    fit_errors = {k: e for r in reports for k, e in r["fit_errors"].items()}
    return dict(reports[0], runs=[run for r in reports for run in r["runs"]], rows=list(rows.values()),
                fit_errors=fit_errors, merge_command=merge_command)


# ------------------------------------------------------------------------------------------------
# the command line


def parse_setting(text: str) -> tuple[int, int, str]:
    block_size, batch, mode = text.split(",")
    if mode not in ("greedy", "sampled"):
        raise argparse.ArgumentTypeError(f"mode must be greedy or sampled, got {mode!r}")
    return int(block_size), int(batch), mode


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--settings", type=parse_setting, nargs="+", default=SETTINGS, metavar="K,B,MODE",
                   help="block size, batch, greedy|sampled (default: K 7 and 16, B 1 and 16, both modes)")
    p.add_argument("--arms", nargs="+", choices=WALK_ARMS, default=list(WALK_ARMS),
                   help="the drafter's arms (the target alone always runs: it is the greedy reference)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each arm")
    p.add_argument("--new-tokens", type=int, help=f"new tokens per request (default {QWEN3_4B['new_tokens']})")
    p.add_argument("--context-scale", type=float,
                   help=f"the target's context term (default {QWEN3_4B['context_scale']})")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (any device: the tests)")
    p.add_argument("--out", help="output prefix (.md, .json, .png); default "
                                 "examples/results/speculative_decoding_<gpu>, <gpu> from the device (h100, h200)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these reports (no device needed)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    command = command_line(sys.argv if argv is None else [__file__, *argv])
    if args.merge:
        report = merge_reports([json.loads(Path(f).read_text()) for f in args.merge], command)
        out = args.out or RESULTS / f"speculative_decoding_{results_name(report['device'])}"
        print(write_report(report, out))
        return 0
    device = jax.devices()[0]
    if args.out is None and device.platform != "gpu":
        p.error(f"no GPU (JAX's first device is {device}): name the report with --out")
    cfg = dict(TINY if args.tiny else QWEN3_4B)
    for name in ("new_tokens", "context_scale"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    out = args.out or RESULTS / f"speculative_decoding_{results_name(device.device_kind)}"
    start = time.perf_counter()

    def log(text):
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", flush=True)

    import flax
    import jaxlib

    report = dict(device=device.device_kind, jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax.__version__,
                  python=platform.python_version(), commit=commit(), config=cfg, fit_errors={}, rows=[],
                  runs=[dict(command=command,
                             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))])
    log(f"{device.device_kind}, jax {jax.__version__}; settings {args.settings}, arms {args.arms}")
    target = toy.build_target(cfg)
    log("built the target")
    drafters = {}
    for block_size in sorted({k for k, _, _ in args.settings}):
        _, drafters[block_size], fit_error = toy.build_drafters(cfg, target, block_size)
        report["fit_errors"][str(block_size)] = fit_error
        log(f"fitted the drafter's head for K = {block_size}: relative error {fit_error:.2e}")
    for setting in args.settings:
        log(f"setting K={setting[0]} B={setting[1]} {setting[2]}")
        report["rows"] += measure_setting(target, drafters[setting[0]], cfg, setting, args.arms, args.repeats, log)
        write_report(report, out)
    print(markdown(report))
    log(f"report written to {out}.md")
    differing = [r for r in report["rows"] if r.get("divergences")]
    if differing:
        print("error: greedy speculative decoding differs from the target's greedy decoding", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
