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
one does not; the report names the first differing token and the target's logit gap there). The
reference is the target decoding alone on the verify step's K + 1 query rows (`target_decode(...,
verify_block_size=K)`), so that every position's logits round as in the verify step; the target-alone
arm is timed as the plain decode, one query row per forward. On a GPU the script first sets XLA_FLAGS
that keep the kernels of the same fusion alike across programs (`set_xla_flags`; --deterministic-xla
also turns autotuning off).

One verify step is split into its parts from a profile of one decode of each arm
(examples/decode_profile.py): the device time of every op of the loop (GPU kernels and copies; XLA's
thunks on the host elsewhere) by the named scope its HLO op carries (target forward, drafter with its
context update, walk, rejection sampler, the rest of the step), per loop iteration, beside the timed
loop iteration. The device memory of the draft path: the head's layouts, the walk's scratch (the
compiled walk's temp size), the drafter backbone and its context.

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
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a script: `examples` and `benchmarks` import from the repository root, put last
    sys.path.append(str(ROOT))  # so that an installed jax_markov comes first

from benchmarks.gpu_measure import memory_per_call  # noqa: E402
from benchmarks.gpu_report import ARMS  # noqa: E402
from benchmarks.gpu_timing import command_line, commit, results_name  # noqa: E402
from examples import decode_profile  # noqa: E402
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
PARTS = (*dict.fromkeys(decode_profile.PARTS.values()), decode_profile.REST)  # the verify step's columns
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


def draft_memory(target, drafters, cfg, block_size: int, batch: int, mode: str, arms) -> dict:
    """{arm: bytes of the head's layouts, the walk's scratch (the compiled walk's temp size), the
    drafter's backbone and its context} at the decode loop's shapes."""
    drafter = drafters["bf16 head"]
    total = cfg["prompt_len"] + cfg["new_tokens"] + block_size + 1
    prompt, _ = prompts(cfg, batch)
    sampling = sampling_arguments(cfg, mode, batch)
    walk_inputs = dict(sampling, position=jnp.full((batch,), cfg["prompt_len"], jnp.int32)) if sampling else {}
    walk_mode = "probabilistic" if sampling else "greedy"  # gpu_measure's name: bf16 draft logits returned
    base = jnp.zeros((batch, block_size, cfg["vocab"]), jnp.float32)

    def nbytes(tree):
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    shared = dict(drafter_bytes=nbytes(nnx.state(drafter)) - nbytes(nnx.state(drafter.markov_head)),
                  context_bytes=nbytes(jax.eval_shape(lambda: drafter.init_context(batch, total))))
    heads = {arm: arm_drafter(drafters, arm).markov_head.head() for arm in arms}
    return {arm: dict(shared, head_bytes=int(heads[arm].nbytes), walk_scratch_bytes=memory_per_call(
        arm, walk_mode, heads[arm], base, prompt[:, -1], walk_inputs)["scratch_bytes"]) for arm in arms}


def measure_setting(target, drafters, cfg, setting, arms, repeats: int, log) -> list[dict]:
    """One row per arm of a setting (K, B, mode): tokens/s, acceptance, the greedy check against the
    reference (the target decoded on the verify step's K + 1 query rows), the verify step's parts
    from a profile of one decode and the draft path's memory."""
    block_size, batch, mode = setting
    runs = decode_runs(target, drafters, cfg, batch, mode, arms)
    results, seconds = time_interleaved(runs, repeats, log)
    reference = None
    if mode == "greedy":
        prompt, lengths = prompts(cfg, batch)
        reference = jax.block_until_ready(sp.target_decode(target, prompt, lengths, max_new_tokens=cfg["new_tokens"],
                                                           verify_block_size=block_size))
    memory = draft_memory(target, drafters, cfg, block_size, batch, mode, arms)
    rows = []
    for arm, result in results.items():
        median = statistics.median(seconds[arm])
        iterations = int(jnp.max(result.num_steps))
        row = dict(block_size=block_size, batch=batch, mode=mode, arm=arm, seconds=seconds[arm],
                   tokens_per_s=batch * cfg["new_tokens"] / median,
                   tokens_per_s_range=[batch * cfg["new_tokens"] / max(seconds[arm]),
                                       batch * cfg["new_tokens"] / min(seconds[arm])],
                   iterations=iterations, ms_per_iteration=median * 1e3 / iterations)
        if reference is not None:
            row["divergences"] = divergences(target, result, reference)
        if arm != "target":
            split = decode_profile.step_split(runs[arm], iterations)
            row.update(acceptance_length=result.mean_acceptance_length(), accepted=int(jnp.sum(result.num_accepted)),
                       drafted=int(jnp.sum(result.num_steps)) * block_size, **memory[arm], parts_ms=split["ms"],
                       parts_method=split["method"])
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


def where(divergences: list[dict]) -> str:
    return "; ".join(f"request {d['request']} from new token {d['new_token']} (target logit gap {d['logit_gap']:.3g})"
                     for d in divergences)


def check_text(r: dict) -> str:
    if r["arm"] == "target":  # timed as the plain decode: one query row per forward
        if "divergences" not in r:
            return ""
        return ("the reference's text" if not r["divergences"] else
                f"not the reference's text (1-row forwards round otherwise: no failure): {where(r['divergences'])}")
    if r["mode"] == "sampled":
        return f"{r['accepted']} of {r['drafted']} drafts accepted"
    if not r["divergences"]:
        return "identical to the target's greedy text"
    return "DIFFERS from the target's greedy text: " + where(r["divergences"])


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
    plain = [r for r in rows if r["arm"] == "target" and "divergences" in r]
    lines = [f"- the int8 kernel's tokens/s beat the eager walk's at {len(beats)} of {len(kernel)} settings, and by "
             f"more than the published gain at {len(above)} of the {len(published)} settings that have one; its loop "
             f"iterations were faster than the eager walk's at {len(faster)} of {len(kernel)}",
             "- greedy output equal to the target's own greedy decoding (the reference), token for token: "
             f"{len(greedy) - len(differing)} of {len(greedy)} greedy drafter arms"
             + (" (see the check column)" if differing else "")]
    if plain:
        lines.append(f"- the timed target alone (one query row per forward) gave the reference's text at "
                     f"{sum(not r['divergences'] for r in plain)} of {len(plain)} greedy settings")
    return lines


def title(report: dict) -> str:
    shape = "Qwen3-4B's shape" if report["config"]["vocab"] == QWEN3_4B["vocab"] else "a toy of Qwen3-4B's structure"
    return f"Speculative decoding at {shape} on {report['device']}"


def markdown(report: dict) -> str:
    cfg, rows = report["config"], sorted(report["rows"], key=lambda r: (
        r["mode"] != "greedy", r["block_size"], r["batch"], list(ARM_NAMES).index(r["arm"])))
    gain = gains(rows)
    repeats = "/".join(sorted({str(len(r["seconds"])) for r in rows}))  # merged runs may differ
    fits = ", ".join(f"K = {k}: {e:.2e}" for k, e in sorted(report["fit_errors"].items(), key=lambda kv: int(kv[0])))
    method = next((r["parts_method"] for r in rows if "parts_method" in r), "not measured")
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
        "- greedy reference: `target_decode(..., verify_block_size=K)`, the target alone, one token per forward, "
        "each forward on K + 1 query rows (the last token, then the text buffer's padding) over a KV cache of the "
        "verify step's length, keeping row 0: the GEMMs and the attention of every position have the verify "
        "step's shapes, and a row's result does not depend on the other rows, so every position's logits round "
        "as in the verify step (tests/test_speculative.py). The target-alone arm is timed as the plain decode (one "
        "query row per forward), whose text can differ from the reference at near-ties that 1-row GEMMs round "
        f"otherwise (its check column). XLA_FLAGS: `{report.get('xla_flags') or 'none'}`.",
        f"- verify step: from a profile of one decode of each arm ({method}, `examples/decode_profile.py`): the "
        "time of every op of the loop, per loop iteration, goes to the part whose named scope its HLO op name holds "
        "(`jax_markov.speculative.STEP_SCOPES`; the drafter includes its context update, the rejection sampler the "
        "target's argmax); rest: ops of no part (the text and cache updates, the loop's control, ops that XLA fused "
        "across parts); the prefill is left out. Sum: the loop's profiled time per iteration, beside the timed loop "
        "iteration (wall time, which adds the prefill's share and the idle gaps between kernels).",
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
              "| K | B | mode | arm | " + " | ".join(f"{part} ms" for part in PARTS)
              + " | sum ms | loop iteration ms (timed) | sum / loop iteration | walk share of the sum |",
              "|---|---|---|---|" + "---|" * (len(PARTS) + 4)]
    for r in rows:
        if r["arm"] != "target":
            p = r["parts_ms"]
            total = sum(p.get(part, 0.0) for part in PARTS)
            lines.append(f"| {r['block_size']} | {r['batch']} | {r['mode']} | {ARM_NAMES[r['arm']]} | "
                         + " | ".join(f"{p.get(part, 0.0):.3f}" for part in PARTS)
                         + f" | {total:.3f} | {r['ms_per_iteration']:.3f} | {total / r['ms_per_iteration']:.2f} | "
                         f"{p['walk'] / total:.1%} |")
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
    p.add_argument("--deterministic-xla", action="store_true",
                   help="--xla_gpu_deterministic_ops=true: no autotuning (the greedy check's strongest footing; "
                        "slower kernels)")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (any device: the tests)")
    p.add_argument("--out", help="output prefix (.md, .json, .png); default "
                                 "examples/results/speculative_decoding_<gpu>, <gpu> from the device (h100, h200)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these reports (no device needed)")
    return p


def set_xla_flags(deterministic: bool) -> str:
    """Adds to XLA_FLAGS, before JAX starts its backend (one already started keeps its flags, as in
    the tests), what keeps the GPU's kernels the same for the same fusion in the reference's and the
    arms' programs: no kernels whose sums run in another order from run to run (atomics); with
    JAX_COMPILATION_CACHE_DIR, XLA's autotuning results kept beside it, so that a program loaded from
    the cache and one compiled now choose alike (in one process XLA reuses its choice per fusion);
    deterministic: no autotuning at all (every kernel a function of its fusion; timings change).
    Returns the XLA_FLAGS in effect."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    wanted = {"--xla_gpu_exclude_nondeterministic_ops": "true"}
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        autotune = Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) / "xla_autotune"
        autotune.mkdir(parents=True, exist_ok=True)
        wanted["--xla_gpu_per_fusion_autotune_cache_dir"] = str(autotune)
    if deterministic:
        wanted["--xla_gpu_deterministic_ops"] = "true"
    if xla_bridge.backends_are_initialized():
        return flags + " (set before this run)" if flags else ""
    flags = " ".join(([flags] if flags else []) + [f"{k}={v}" for k, v in wanted.items() if k not in flags])
    os.environ["XLA_FLAGS"] = flags
    return flags


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    command = command_line(sys.argv if argv is None else [__file__, *argv])
    if args.merge:
        report = merge_reports([json.loads(Path(f).read_text()) for f in args.merge], command)
        out = args.out or RESULTS / f"speculative_decoding_{results_name(report['device'])}"
        print(write_report(report, out))
        return 0
    xla_flags = set_xla_flags(args.deterministic_xla)
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
                  python=platform.python_version(), commit=commit(), config=cfg, xla_flags=xla_flags, fit_errors={},
                  rows=[],
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
    differing = [r for r in report["rows"] if r["arm"] != "target" and r.get("divergences")]
    if differing:
        print("error: greedy speculative decoding differs from the target's greedy decoding", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
