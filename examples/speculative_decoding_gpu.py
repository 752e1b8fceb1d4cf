"""Speculative decoding at the published model's shape: output tokens per second of the whole decode
loop with the eager walk, the int8 kernel, the certified int8 kernel and the bf16-head kernel, beside
the target alone.

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
int8 kernel (the int8 head, impl="ffi"), the certified int8 kernel (`quantize(head, certified=True)`:
greedy drafts are the bf16 head's; at the batches the CUDA launch plan takes) and the bf16-head kernel
(the bf16 head, impl="ffi"; off a GPU, "ffi" is the CPU custom call). Sampled walks return bf16 draft
logits. A run of an arm decodes
the B requests, or at B = 1 4 requests one after another (`rounds_of`: one request's acceptance length
says little: a sampled arm's text parts from the others' at its first different draft, and a greedy
text's acceptance moves with the near-ties that each compilation's GEMMs round their own way). Each arm is run once
(untimed), then the arms run in turn (each repeat starting at the next arm) --repeats times; tokens/s
is the new tokens over the median wall time of one run (prefill included, compilation excluded).
Greedy arms must reproduce the target's own greedy text token for token (the exit status is 1 where
one does not; the report names the first differing token and the target's logit gap there): each
drafter arm's text against its own compiled program run with every draft set aside
(`speculative_decode(..., max_accepted=0)`: the target decoding one token per verify step, on the
verify step's shapes and kernels). Beside it, informative only, the separately compiled reference:
the target decoding alone on the verify step's K + 1 query rows (`target_decode(...,
verify_block_size=K)`), whose GEMMs XLA may tune otherwise; the target-alone arm is timed as the plain
decode, one query row per forward, and compared with that reference. The script first sets XLA_FLAGS
(`set_xla_flags`): XLA's command buffers off unless --command-buffers on; --deterministic-xla also
turns autotuning and atomics off.

One verify step is split into its parts from a profile of one decode of each arm
(examples/decode_profile.py): the device time of every op of the loop (GPU kernels and copies; XLA's
thunks on the host elsewhere) by the named scope its HLO op carries (target forward, drafter with its
context update, walk, rejection sampler, the rest of the step), per loop iteration, beside the timed
loop iteration. The device memory of the draft path: the head's layouts, the walk's scratch (the
compiled walk's temp size), the drafter backbone and its context.

Every program of the run (the head fit's, each setting's arms, references, the greedy check's
forward and the walks whose memory is reported) is compiled before the first is timed, many at once
(examples/compile_ahead.py; --compile-workers, default one per core as host memory allows): they are
lowered one after another while a thread pool compiles them and another thread fits the Markov heads
(the part of the fit that depends on the target alone once for both block sizes). The log gives each
phase's time, the compilation's wall time (also in the report's .json) and the XLA compilations that
still happened during the runs. With JAX_COMPILATION_CACHE_DIR set, later runs on the same machine load
the programs from that folder.

The report is written after every setting (a run cut short keeps what it measured); --merge joins the
.json of runs over different settings (one GPU, jax, commit and configuration) into one report.
"""
from __future__ import annotations

import argparse
import concurrent.futures
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

from benchmarks import gpu_measure  # noqa: E402
from benchmarks.gpu_timing import command_line, commit, results_name  # noqa: E402
from examples import compile_ahead, decode_profile  # noqa: E402
from examples import speculative_decoding as toy  # noqa: E402
from examples.speculative_gpu_report import (ARM_NAMES, QWEN3_4B_VOCAB, WALK_ARMS,  # noqa: E402
                                             merge_reports, write_report)
from jax_markov import speculative as sp  # noqa: E402

RESULTS = ROOT / "examples" / "results"
# The target and drafter sizes (keys as in the toy example's configuration).
QWEN3_4B = dict(vocab=QWEN3_4B_VOCAB, hidden=2560, intermediate=9728, target_layers=36, heads=32, kv_heads=8,
                head_dim=128, drafter_layers=1, dtype="bfloat16", markov_rank=256, bigram_rank=128, sharpness=5.0,
                context_scale=0.005, prompt_len=32, new_tokens=512, seed=0, b1_rounds=4)
TINY = dict(QWEN3_4B, vocab=512, hidden=64, intermediate=128, target_layers=2, heads=4, kv_heads=2, head_dim=16,
            markov_rank=32, bigram_rank=16, context_scale=0.05, prompt_len=8, new_tokens=24)
SETTINGS = [(k, b, mode) for mode in ("greedy", "sampled") for k in (7, 16) for b in (1, 16)]


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


ARM_HEADS = {"eager": "bf16 head", "kernel-bf16": "bf16 head", "kernel-int8": "int8 head",
             "kernel-certified": "certified int8 head"}


def arm_drafter(drafters: dict, arm: str):
    return drafters[ARM_HEADS[arm]]


def setting_arms(arms, cfg, setting, log=print) -> tuple:
    """The arms that run at a setting: `arms` less those whose head the CUDA kernel cannot walk at its
    batch (the certified int8 head's beyond the plan's few requests; logged)."""
    block_size, batch, mode = setting
    chosen = []
    for arm in arms:
        why = gpu_measure.kernel_refuses(arm, "probabilistic" if mode == "sampled" else "greedy", cfg["vocab"],
                                         block_size, batch)
        if why:
            log(f"  K={block_size} B={batch} {mode}: no {arm} arm ({why})")
        else:
            chosen.append(arm)
    return tuple(chosen)


def rounds_of(cfg, batch: int) -> int:
    """Batches of B requests that one run decodes one after another: cfg["b1_rounds"] at B = 1, else
    one. The acceptance length of one request varies too much to compare arms: a sampled arm's text
    leaves the others' at its first draft that differs, and a greedy text's drafts are accepted or not
    at near-ties that each compiled program's GEMMs round their own way (the eager arm's one request
    took 38 verify steps in one H100 run and 40 in another). The same requests in every arm, several
    of them, make the comparison."""
    return cfg["b1_rounds"] if batch == 1 else 1


def round_arguments(cfg, batch: int, mode: str) -> list[dict]:
    """The keywords of each round's decode: its B prompts, their lengths, the new tokens and, when
    sampled, the temperatures and keys (every round's requests are others)."""
    rounds = rounds_of(cfg, batch)
    prompt, lengths = prompts(cfg, batch * rounds)
    sampling = sampling_arguments(cfg, mode, batch * rounds)
    return [dict(prompt=prompt[r * batch:(r + 1) * batch], prompt_lengths=lengths[r * batch:(r + 1) * batch],
                 max_new_tokens=cfg["new_tokens"], **{k: v[r * batch:(r + 1) * batch] for k, v in sampling.items()})
            for r in range(rounds)]


class Rounds:
    """One run of a setting's arm: its decode program called on each round's requests in turn (one
    program: the rounds' arrays have the same shapes), the results joined along the batch."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, lower: bool = False, **kw):
        if lower:
            return self.calls[0](lower=True, **kw)
        results = [call(**kw) for call in self.calls]
        return results[0] if len(results) == 1 else type(results[0])(*map(jnp.concatenate, zip(*results)))


def loop_iterations(result, rounds: int) -> int:
    """The loop iterations of one run: each round's loop runs as long as its longest request."""
    return int(jnp.sum(jnp.max(result.num_steps.reshape(rounds, -1), axis=1)))


def decode_runs(target, drafters, cfg, batch: int, mode: str, arms) -> dict:
    """{arm: Rounds}: the target alone, then the drafter with each walk arm."""
    parts = round_arguments(cfg, batch, mode)
    runs = {"target": Rounds([functools.partial(sp.target_decode, target, **kw) for kw in parts])}
    for arm in arms:
        impl = "ffi" if arm.startswith("kernel") else "reference"
        runs[arm] = Rounds([functools.partial(sp.speculative_decode, target, arm_drafter(drafters, arm), impl=impl,
                                              logits_dtype=jnp.bfloat16, **kw) for kw in parts])
    return runs


def reference_run(target, cfg, setting) -> Rounds:
    """The greedy reference of a setting: the target decoding alone on the verify step's K + 1 query
    rows, the same rounds of requests as the arms."""
    block_size, batch, mode = setting
    return Rounds([functools.partial(sp.target_decode, target, verify_block_size=block_size, **kw)
                   for kw in round_arguments(cfg, batch, mode)])


def time_interleaved(runs: dict, repeats: int, log):
    """Each run once (its result kept; the first call of its executable, not timed), then all of them
    in turn, `repeats` times, each repeat starting at the next run. Returns ({name: first result},
    {name: [seconds]})."""
    results, seconds = {}, {name: [] for name in runs}
    for name, fn in runs.items():
        start = time.perf_counter()
        results[name] = jax.block_until_ready(fn())
        log(f"    {name}: first run in {time.perf_counter() - start:.1f} s")
    names = list(runs)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(runs[name]())
            seconds[name].append(time.perf_counter() - start)
    return results, seconds


def time_arms(runs: dict, repeats: int, log, target_timings: dict, key) -> tuple[dict, dict]:
    """`time_interleaved` over a setting's arms, the target alone ("target") among them only where
    target_timings ({(B, mode): (result, seconds)}) has no timing for key yet: its program does not
    depend on K, so a later block size of the same batch and mode takes that timing."""
    shared = target_timings.get(key)
    results, seconds = time_interleaved({arm: run for arm, run in runs.items() if not (shared and arm == "target")},
                                        repeats, log)
    if shared:
        log(f"    target: timed at an earlier block size of B = {key[0]} {key[1]}")
        results, seconds = {"target": shared[0], **results}, {"target": shared[1], **seconds}
    target_timings[key] = (results["target"], seconds["target"])
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


def walk_arguments(drafters, cfg, setting, arm) -> tuple:
    """(arm, mode, head, base, anchor, inputs) of one walk of an arm at a setting's shapes, as
    `benchmarks.gpu_measure.walk_program` takes them (its mode names: "probabilistic" for sampled
    walks, which return bf16 draft logits)."""
    block_size, batch, mode = setting
    prompt, _ = prompts(cfg, batch)
    sampling = sampling_arguments(cfg, mode, batch)
    inputs = dict(sampling, position=jnp.full((batch,), cfg["prompt_len"], jnp.int32)) if sampling else {}
    base = jnp.zeros((batch, block_size, cfg["vocab"]), jnp.float32)
    return (arm, "probabilistic" if sampling else "greedy", arm_drafter(drafters, arm).markov_head.head(), base,
            prompt[:, -1], inputs)


def draft_memory(drafters, cfg, setting, arms, walks: dict) -> dict:
    """{arm: bytes of the head's layouts, the walk's scratch (the temp size of the arm's compiled walk
    in `walks`), the drafter's backbone and its context} at the decode loop's shapes."""
    block_size, batch, _ = setting
    drafter = drafters["bf16 head"]
    total = cfg["prompt_len"] + cfg["new_tokens"] + block_size + 1

    def nbytes(tree):
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    shared = dict(drafter_bytes=nbytes(nnx.state(drafter)) - nbytes(nnx.state(drafter.markov_head)),
                  context_bytes=nbytes(jax.eval_shape(lambda: drafter.init_context(batch, total))))
    heads = {arm: arm_drafter(drafters, arm).markov_head.head() for arm in arms}
    return {arm: dict(shared, head_bytes=int(heads[arm].nbytes),
                      walk_scratch_bytes=gpu_measure.memory_of(heads[arm], walks[arm])["scratch_bytes"])
            for arm in arms}


def measure_setting(target, drafters, cfg, setting, arms, repeats: int, log, walks: dict,
                    target_timings: dict) -> list[dict]:
    """One row per arm of a setting (K, B, mode): tokens/s, acceptance, the greedy check (each drafter
    arm against its own program with every draft set aside, max_accepted=0; beside it, and for the
    target alone, the separately compiled reference on the verify step's K + 1 query rows), the verify
    step's parts from a profile of one decode and the draft path's memory (walks: {arm: its compiled
    walk}); target_timings: the target alone's timing per batch and mode (`time_arms`)."""
    block_size, batch, mode = setting
    runs = decode_runs(target, drafters, cfg, batch, mode, arms)
    results, seconds = time_arms(runs, repeats, log, target_timings, (batch, mode))
    reference = jax.block_until_ready(reference_run(target, cfg, setting)()) if mode == "greedy" else None
    own = {arm: jax.block_until_ready(runs[arm](max_accepted=0)) for arm in arms} if mode == "greedy" else {}
    memory = draft_memory(drafters, cfg, setting, arms, walks)
    rows = []
    rounds = rounds_of(cfg, batch)
    for arm, result in results.items():
        median = statistics.median(seconds[arm])
        iterations = loop_iterations(result, rounds)
        tokens = rounds * batch * cfg["new_tokens"]
        row = dict(block_size=block_size, batch=batch, mode=mode, arm=arm, rounds=rounds, seconds=seconds[arm],
                   tokens_per_s=tokens / median,
                   tokens_per_s_range=[tokens / max(seconds[arm]), tokens / min(seconds[arm])],
                   iterations=iterations, ms_per_iteration=median * 1e3 / iterations)
        if arm in own:
            row["divergences"] = divergences(target, result, own[arm])
            row["reference_divergences"] = divergences(target, result, reference)
        elif reference is not None:
            row["divergences"] = divergences(target, result, reference)
        if arm != "target":
            split = decode_profile.step_split(runs[arm], iterations)
            row.update(acceptance_length=result.mean_acceptance_length(), accepted=int(jnp.sum(result.num_accepted)),
                       drafted=int(jnp.sum(result.num_steps)) * block_size, **memory[arm], parts_ms=split["ms"],
                       parts_method=split["method"], top_ops=split["top_ops"],
                       op_families=split["op_families"])
        rows.append(row)
        log(f"  K={block_size} B={batch} {mode:7s} {ARM_NAMES[arm]:28s} {row['tokens_per_s']:9.1f} tok/s  "
            f"{row['ms_per_iteration']:7.2f} ms/iteration" + (f"  acceptance length {row['acceptance_length']:.3f}"
                                                             if arm != "target" else ""))
    return rows


# ------------------------------------------------------------------------------------------------
# every program compiled before the runs


def program_key(setting, arm: str) -> tuple:
    """The key of an arm's decode program; the target alone's does not depend on K."""
    block_size, batch, mode = setting
    return ("target", batch, mode) if arm == "target" else (arm, block_size, batch, mode)


def programs(target, structures: dict, cfg, settings, arms) -> dict:
    """{key: a function that lowers the program}: every program a run compiles (structures: {K:
    (drafter, arm drafters)}, `toy.drafter_arms`). The fit's (the target's hidden states, the mask
    rows' per K) first, then per setting: the decode arms, the greedy reference and the forward that
    the greedy check runs where a text differs, and each walk arm whose scratch memory is reported."""
    out = {("fit", "hidden"): functools.partial(toy.final_hidden.lower, target, toy.fit_chunks(cfg)[0])}
    for block_size, (drafter, _) in structures.items():
        out[("fit", "mask", block_size)] = functools.partial(toy.mask_hidden.lower, drafter, target,
                                                             toy.mask_contexts(cfg))
    for setting in settings:
        block_size, batch, mode = setting
        drafters = structures[block_size][1]
        arms_here = setting_arms(arms, cfg, setting, log=lambda line: None)
        for arm, run in decode_runs(target, drafters, cfg, batch, mode, arms_here).items():
            out[program_key(setting, arm)] = functools.partial(run, lower=True)
        if mode == "greedy":
            out[("reference", block_size, batch)] = functools.partial(reference_run(target, cfg, setting), lower=True)
            requests = batch * rounds_of(cfg, batch)  # every round's, as `divergences` calls it
            tokens = jnp.zeros((requests, cfg["prompt_len"] + cfg["new_tokens"]), jnp.int32)
            out[("logits_at", requests)] = functools.partial(logits_at.lower, target, tokens,
                                                             jnp.ones(requests, jnp.int32))
        for arm in arms_here:
            out[("walk", arm, *setting)] = functools.partial(gpu_measure.walk_program,
                                                             *walk_arguments(drafters, cfg, setting, arm))
    return out


def fit_heads(target, structures: dict, cfg, ahead, log) -> dict:
    """{K: fit error}: each block size's drafter's head fitted (`toy.fit_markov_head`), what depends on
    the target alone computed once for all of them; each program waits for its compiled executable."""
    ahead.result(("fit", "hidden"))
    start = time.perf_counter()
    factors = jax.block_until_ready(toy.target_factors(target, cfg))
    log(f"  fit: the target's hidden state after every token and the LM head's QR in "
        f"{time.perf_counter() - start:.1f} s")
    errors = {}
    for block_size, (drafter, _) in structures.items():
        ahead.result(("fit", "mask", block_size))
        start = time.perf_counter()
        errors[block_size] = toy.fit_markov_head(target, drafter, cfg, factors=factors)
        log(f"  fit for K = {block_size} in {time.perf_counter() - start:.1f} s: relative error "
            f"{errors[block_size]:.2e}")
    return errors


def build_and_compile(target, cfg, settings, arms, workers: int | None, log):
    """The drafters of every block size, their heads fitted, and every program of the run compiled:
    the programs lowered here, one after another, and compiled on a thread pool; meanwhile the heads
    are fitted on a thread of their own (their programs first), and loaded into the arms' drafters
    once every program is lowered. Returns ({K: arm drafters}, {K: fit error}, the compiled walks
    {(arm, K, B, mode): ...}, the compilation's dict from `AheadOfTime.wait`)."""
    structures = {k: toy.drafter_arms(cfg, target, k) for k in sorted({k for k, _, _ in settings})}
    log("built the drafters")
    plan = programs(target, structures, cfg, settings, arms)
    workers = workers or compile_ahead.default_workers(len(plan))
    log(f"lowering {len(plan)} programs, compiling them on {workers} threads; fitting the heads meanwhile")
    ahead = compile_ahead.AheadOfTime(workers, log)
    for key in [key for key in plan if key[0] == "fit"]:
        ahead.submit(key, plan[key])
    # The fit's thread calls nnx.jit functions, which write the state back into the module objects they
    # are given; on the target that this thread lowers the programs from, a layer could be read while
    # that write-back empties it. The fit reads a clone (new module objects, the same arrays).
    fit_target = nnx.clone(target)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fit") as fitter:
        fitted = fitter.submit(fit_heads, fit_target, structures, cfg, ahead, log)
        for key, lower in plan.items():
            ahead.submit(key, lower)
        log(f"lowered {len(plan)} programs in {ahead.lowering_s:.1f} s")
        fit_errors = fitted.result()
    for drafter, drafters in structures.values():
        toy.load_fitted_head(drafter, drafters)  # values only: the programs compiled for them still apply
    compiled = ahead.wait()
    log(f"compiled {compiled['programs']} programs in {compiled['wall_s']:.1f} s on {workers} threads (lowering "
        f"{compiled['lowering_s']:.1f} s, compilation {compiled['compile_s']:.1f} s in all, the longest "
        f"{compiled['longest_s']:.1f} s: {compiled['longest']})")
    walks = {key[1:]: ahead.result(key) for key in plan if key[0] == "walk"}
    return {k: drafters for k, (_, drafters) in structures.items()}, fit_errors, walks, compiled


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
    p.add_argument("--command-buffers", choices=("on", "off"), default="off",
                   help="XLA's command buffers (CUDA graphs of a loop body's kernels; default off: with them "
                        "the verify step's profile cannot split the step into its parts)")
    p.add_argument("--deterministic-xla", action="store_true",
                   help="--xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true: no "
                        "autotuning, no atomics (the greedy check's strongest footing; much slower GEMMs)")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (any device: the tests)")
    p.add_argument("--out", help="output prefix (.md, .json, .png); default "
                                 "examples/results/speculative_decoding_<gpu>, <gpu> from the device (h100, h200)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these reports (no device needed)")
    p.add_argument("--compile-workers", type=int,
                   help="programs compiled at once (default: one per core, as host memory allows)")
    return p


def set_xla_flags(deterministic: bool, command_buffers: bool = False) -> str:
    """Adds to XLA_FLAGS, before JAX starts its backend (one already started keeps its flags, as in
    the tests): unless command_buffers, XLA's command buffers off, so that every kernel of a loop is
    launched by the host as the HLO op it computes and the profile finds each op's named scope (with
    them, runs of a loop body's kernels are CUDA graphs, and on the H100 the verify step's whole
    profile fell to "rest": no op kept its part); with JAX_COMPILATION_CACHE_DIR, XLA's autotuning
    results kept beside it, so that a program loaded from the cache and one compiled now choose alike
    (separately compiled programs may still tune the same GEMM otherwise, which is
    why the greedy check runs each arm's own program); deterministic: no autotuning and no kernels whose
    sums run in another order from run to run (atomics), every kernel a function of its fusion (the
    greedy check's strongest footing; much slower GEMMs). Returns the XLA_FLAGS in effect."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    wanted = {} if command_buffers else {"--xla_gpu_enable_command_buffer": ""}
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        autotune = Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) / "xla_autotune"
        autotune.mkdir(parents=True, exist_ok=True)
        wanted["--xla_gpu_per_fusion_autotune_cache_dir"] = str(autotune)
    if deterministic:
        wanted["--xla_gpu_deterministic_ops"] = "true"
        wanted["--xla_gpu_exclude_nondeterministic_ops"] = "true"
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
    xla_flags = set_xla_flags(args.deterministic_xla, args.command_buffers == "on")
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
    drafters, fit_errors, walks, compiled = build_and_compile(target, cfg, args.settings, args.arms,
                                                              args.compile_workers, log)
    report["fit_errors"] = {str(k): e for k, e in fit_errors.items()}
    report["runs"][0]["compile"] = compiled
    runs_started = time.perf_counter()
    target_timings = {}
    with compile_ahead.compilations() as late:
        for i, setting in enumerate(args.settings):
            started = time.perf_counter()
            log(f"setting K={setting[0]} B={setting[1]} {setting[2]}")
            arms = setting_arms(args.arms, cfg, setting, log)
            report["rows"] += measure_setting(target, drafters[setting[0]], cfg, setting, arms, args.repeats,
                                              log, {arm: walks[(arm, *setting)] for arm in arms}, target_timings)
            write_report(report, out)
            left, pace = len(args.settings) - i - 1, (time.perf_counter() - runs_started) / (i + 1)
            log(f"setting done in {time.perf_counter() - started:.1f} s"
                + (f"; {left} to go, about {left * pace:.0f} s at this pace" if left else ""))
    report["runs"][0]["compiled_during_runs"] = late.names  # eager ops' small programs; no decode loop's
    names = sorted(set(late.names))
    log(f"XLA compilations during the runs: {len(late.names)}" + (f" ({', '.join(names)})" if names else ""))
    print(write_report(report, out))
    log(f"report written to {out}.md")
    differing = [r for r in report["rows"] if r["arm"] != "target" and r.get("divergences")]
    if differing:
        print("error: greedy speculative decoding differs from the target's greedy decoding", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
