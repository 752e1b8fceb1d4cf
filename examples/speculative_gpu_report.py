"""The report of examples/speculative_decoding_gpu.py: markdown, .json and a plot of its rows, and
the merge of runs over different settings (`--merge`).

A row is one arm of one setting (K, B, mode): tokens/s, acceptance, the greedy check, the verify
step's parts and the draft path's memory, as `speculative_decoding_gpu.measure_setting` measures them.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_report import ARMS, write_outputs
from examples import decode_profile

QWEN3_4B_VOCAB = 151936  # the published target's vocabulary: a report at it is at the published shape
# The drafter's arms, named as benchmarks/gpu_report.ARMS; the certified int8 head's where the CUDA plan
# takes the batch.
WALK_ARMS = ("eager", "kernel-int8", "kernel-certified", "kernel-bf16")
ARM_NAMES = dict(target="target alone", **{arm: ARMS[arm] for arm in WALK_ARMS})
# The published kernel of this design end to end on Qwen3-4B, one H100: output tokens/s of the int8
# kernel over the eager walk (vLLM's sequential loop on the bf16 head), in percent, by (K, B, mode).
# Source: issue 66, quoting the kernel's publication (shared/PEERS.md: "+4.3% to +11.7% output
# tokens/s over the eager loop"); sampled figures were published at batch 1 only.
PUBLISHED_GAIN_PERCENT = {(7, 1, "greedy"): 4.3, (7, 16, "greedy"): 4.6, (16, 1, "greedy"): 9.3,
                          (16, 16, "greedy"): 8.8, (7, 1, "sampled"): 5.5, (16, 1, "sampled"): 11.7}
PARTS = (*dict.fromkeys(decode_profile.PARTS.values()), decode_profile.REST)  # the verify step's columns
MB = 1e6


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
    text = ("identical to the target's greedy text" if not r["divergences"] else
            "DIFFERS from the target's greedy text: " + where(r["divergences"]))
    if r.get("reference_divergences"):
        text += f"; the separately compiled reference's differs: {where(r['reference_divergences'])}"
    return text


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
    compared = [r for r in greedy if "reference_divergences" in r]
    lines = [f"- the int8 kernel's tokens/s beat the eager walk's at {len(beats)} of {len(kernel)} settings, and by "
             f"more than the published gain at {len(above)} of the {len(published)} settings that have one; its loop "
             f"iterations were faster than the eager walk's at {len(faster)} of {len(kernel)}",
             "- greedy output equal to the target's own greedy decoding (the same program with every draft set "
             f"aside), token for token: {len(greedy) - len(differing)} of {len(greedy)} greedy drafter arms"
             + (" (see the check column)" if differing else "")]
    if compared:
        lines.append(f"- and equal to the separately compiled reference's text: "
                     f"{sum(not r['reference_divergences'] for r in compared)} of {len(compared)}")
    if plain:
        lines.append(f"- the timed target alone (one query row per forward) gave the reference's text at "
                     f"{sum(not r['divergences'] for r in plain)} of {len(plain)} greedy settings")
    certified = certified_acceptance(rows)
    if certified:
        lines.append(f"- the certified int8 head's greedy drafts accepted as the bf16 head's (kernel), draft for "
                     f"draft: {sum(certified.values())} of {len(certified)} greedy settings")
    return lines


def certified_acceptance(rows: list[dict]) -> dict:
    """{(K, B): whether the certified int8 head's accepted drafts equal the bf16-head kernel's} at every
    greedy setting that has both arms: its greedy drafts are the unquantized head's, so acceptance
    must match exactly (the drafter's base logits permitting: each arm is a program of its own)."""
    by_key = {row_key(r): r for r in rows}
    out = {}
    for r in rows:
        bf16 = by_key.get((*row_key(r)[:3], "kernel-bf16"))
        if r["arm"] == "kernel-certified" and r["mode"] == "greedy" and bf16 is not None:
            out[row_key(r)[:2]] = (r["accepted"], r["drafted"]) == (bf16["accepted"], bf16["drafted"])
    return out


def rounds_text(cfg: dict) -> str:
    rounds = cfg["b1_rounds"]
    if rounds == 1:
        return ""
    return (f"; a run of a setting at B = 1 decodes {rounds} requests one after another (one request's acceptance "
            "length varies too much to compare arms: a sampled arm's text leaves the others' at its first draft "
            "that differs, and greedy drafts are accepted or not at near-ties that each compiled program rounds its "
            "own way), its tokens/s all of their tokens over the run's time")


def title(report: dict) -> str:
    shape = "Qwen3-4B's shape" if report["config"]["vocab"] == QWEN3_4B_VOCAB else "a toy of Qwen3-4B's structure"
    return f"Speculative decoding at {shape} on {report['device']}"


def compiled(run: dict) -> str:
    """How a run compiled its programs, where its report says (runs before it was recorded do not)."""
    c = run.get("compile")
    return "" if c is None else (f"; compiled {c['programs']} programs in {c['wall_s']:.0f} s on {c['workers']} "
                                 "threads before the runs")


def markdown(report: dict) -> str:
    cfg, rows = report["config"], sorted(report["rows"], key=lambda r: (
        r["mode"] != "greedy", r["block_size"], r["batch"], list(ARM_NAMES).index(r["arm"])))
    gain = gains(rows)
    repeats = "/".join(sorted({str(len(r["seconds"])) for r in rows}))  # merged runs may differ
    fits = ", ".join(f"K = {k}: {e:.2e}" for k, e in sorted(report["fit_errors"].items(), key=lambda kv: int(kv[0])))
    method = next((r["parts_method"] for r in rows if "parts_method" in r), "not measured")
    lines = [f"# {title(report)}", ""]
    lines += [f"- command: `{run['command']}` ({run['date']}{compiled(run)})" for run in report["runs"]]
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
        f"{cfg['vocab']}, {cfg['dtype']} weights (untied LM head) and KV cache; random weights with a "
        f"rank-{cfg['bigram_rank']} bigram structure (scale {cfg['sharpness']:g}) and a context term from every "
        f"layer (context scale {cfg['context_scale']:g}) (`jax_markov.flax.bigram_lm`).",
        f"- drafter: `DSparkDrafter`, {cfg['drafter_layers']} layer of the target's width ({cfg['dtype']}, random "
        f"backbone), reading 3 of the target's layers, sharing its embedding and LM head; Markov head of rank "
        f"{cfg['markov_rank']} fitted to the target's bigram table minus the drafter's mask-row logits "
        f"(examples/speculative_decoding.py: `fit_markov_head`; relative error of the rank-r truncation: {fits}); "
        "the eager walk and the bf16-head kernel walk that head in bf16, the int8 kernel its per-row int8 W2.",
        f"- B requests with fixed prompts of {cfg['prompt_len']} random tokens, {cfg['new_tokens']} new tokens each, "
        "greedy or sampled at T = 1 (sampled walks return bf16 draft logits); every arm is one jitted "
        "`lax.while_loop` (`jax_markov.speculative`)" + rounds_text(cfg) + ".",
        f"- tokens/s: new tokens of every request a run decodes over the median wall time of one run (prefill "
        f"included, compilation "
        f"excluded; range: slowest and fastest run), the arms run in turn, {repeats} times each (the target "
        "alone, whose program does not depend on K, at the first block size of its batch and mode only: its "
        "row at the other block size repeats that timing). "
        "Gain: over the eager walk's tokens/s at the same setting. Mean acceptance length: tokens per verify step "
        "(accepted drafts + 1). ms per iteration: the median run over its loop iterations; iteration gain: the "
        "eager walk's ms per iteration over the arm's, a speed that acceptance does not change (a sampled int8 "
        "arm drafts other tokens than the bf16 arms, so its text and acceptance length vary apart from theirs).",
        "- greedy check: each drafter arm's text against its own compiled program run with every draft set aside "
        "(`speculative_decode(..., max_accepted=0)`, an argument of the program, not part of it): the target "
        "decoding one token per verify step with the very kernels that XLA chose for that program, so that "
        "speculative decoding is lossless exactly when the texts agree. "
        "Separately compiled reference (informative: XLA may tune its GEMMs otherwise, and a bf16 near-tie "
        "then goes the other way): `target_decode(..., verify_block_size=K)`, the target alone, one token per "
        "forward, each forward on K + 1 query rows (the last token, then the text buffer's padding) over a KV "
        "cache of the verify step's length, keeping row 0: the GEMMs and the attention of every position have the "
        "verify step's shapes, and a row's result does not depend on the other rows, so that on the same kernels "
        "every position's logits round as in the verify step (tests/test_speculative.py). The target-alone arm is "
        "timed as the plain decode (one query row per forward), whose text can differ from the reference at near-ties that 1-row GEMMs round "
        f"otherwise (its check column). XLA_FLAGS: `{report.get('xla_flags') or 'none'}`.",
        f"- verify step: from a profile of one decode of each arm ({method}, `examples/decode_profile.py`): the "
        "time of every op of the loop, per loop iteration, goes to the part whose named scope its HLO op name holds "
        "(`jax_markov.speculative.STEP_SCOPES`; the drafter includes its context update, the rejection sampler the "
        "target's argmax); rest: ops of no part (the text and cache updates, the loop's control, ops that XLA fused "
        "across parts); the prefill is left out. Sum: the loop's profiled time per iteration, beside the timed loop "
        "iteration (wall time, which adds the prefill's share and the idle gaps between kernels). The .json's "
        "`top_ops` give each arm's heaviest ops per loop iteration, its `op_families` the heaviest kinds of op "
        "(a layer's ops of one kind together).",
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
    return write_outputs(report, prefix, markdown, plot)


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
