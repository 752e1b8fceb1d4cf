"""Speculative decoding with a DSpark drafter: no Markov head vs a bf16, an int8 and a certified int8 head.

A toy target whose next-token logits have a real low-rank bigram structure (plus what its
decoder layers add from the context), a DFlash-shaped block drafter that shares the target's
embedding and LM head, and a Markov head fit to the target's bigram table by a truncated SVD.
For each drafter arm the decode loop (`jax_markov.speculative.speculative_decode`, one jitted
`lax.while_loop`) drafts a block with the walk, verifies it with one target forward and accepts;
the report gives the mean acceptance length (tokens per target forward) and tokens per second,
greedy and sampled, next to the target decoding on its own. Greedy runs are checked to be
token-for-token the target's own greedy text.

    python examples/speculative_decoding.py            # embedded defaults, writes examples/results/
    python examples/speculative_decoding.py --quick    # a smaller run, nothing written

It runs on the default JAX device: the CPU, or the GPU where there is one (the report is then
`speculative_decoding_gpu.md`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import jax_markov.speculative  # noqa: F401  (an install that has it)
except ImportError:  # a source checkout: use it
    for name in [m for m in sys.modules if m == "jax_markov" or m.startswith("jax_markov.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.dirname(HERE))

import jax_markov  # noqa: E402
from jax_markov import flax as jmf  # noqa: E402
from jax_markov import native  # noqa: E402
from jax_markov import speculative as sp  # noqa: E402

DEFAULTS = dict(vocab=2048, hidden=256, intermediate=512, target_layers=4, heads=8, kv_heads=4, head_dim=32,
                drafter_layers=1, dtype="float32", block_size=8, markov_rank=256, bigram_rank=64, sharpness=5.0,
                context_scale=0.05, batch=4, prompt_len=32, new_tokens=128, temperature=1.0, repeats=5, seed=0)
QUICK = dict(vocab=512, hidden=128, intermediate=256, target_layers=2, heads=4, kv_heads=2, block_size=6,
             markov_rank=64, bigram_rank=32, new_tokens=48, repeats=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"default {value}")
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "ffi"], help="the walk's implementation")
    p.add_argument("--quick", action="store_true", help="a small configuration; writes no report unless --out")
    p.add_argument("--out", default=None,
                   help="report path (default examples/results/speculative_decoding_<cpu|gpu>.md)")
    p.add_argument("--no-write", action="store_true", help="print the report only")
    args = p.parse_args(argv)
    config = dict(DEFAULTS, **(QUICK if args.quick else {}))
    for name in DEFAULTS:
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return args, config


def build_target(cfg):
    """The target: a Qwen3-style `bigram_lm` whose last token (the drafter's mask token) the bigram
    never predicts."""
    config = jmf.CausalLMConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                                intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["target_layers"],
                                num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                                head_dim=cfg["head_dim"])
    return jmf.bigram_lm(config, rank=cfg["bigram_rank"], sharpness=cfg["sharpness"],
                         context_scale=cfg["context_scale"], silent_tokens=[mask_token(cfg)],
                         rngs=nnx.Rngs(cfg["seed"]), param_dtype=jnp.dtype(cfg["dtype"]))


def mask_token(cfg):
    return cfg["vocab"] - 1  # a token the target never predicts much


def build_drafters(cfg, target, block_size, factors=None):
    """A DSpark drafter of block size K for `target` (random backbone, head fitted by
    `fit_markov_head`, from `factors` where given) and the drafters of the arms, which share its
    backbone: {"bf16 head": ..., "int8 head": ..., "certified int8 head": ...}. Returns (drafter, arms,
    fit_error)."""
    drafter, arms = drafter_arms(cfg, target, block_size)
    fit_error = fit_markov_head(target, drafter, cfg, factors=factors)
    load_fitted_head(drafter, arms)
    return drafter, arms, fit_error


def drafter_arms(cfg, target, block_size):
    """The drafter of block size K (random backbone, head not fitted yet) and the drafters of the
    arms, which share its backbone and have heads of their own (zero until `load_fitted_head`):
    (drafter, {"bf16 head": ..., "int8 head": ..., "certified int8 head": ...}). Every array has its
    final shape and dtype, so that the arms' programs can be compiled before the fit."""
    layers = cfg["target_layers"]
    drafter_config = jmf.DSparkConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["drafter_layers"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        head_dim=cfg["head_dim"], mask_token_id=mask_token(cfg),
        target_layer_ids=(0, layers // 2, layers - 1) if layers > 2 else tuple(range(layers)),
        num_target_layers=layers, block_size=block_size, markov_rank=cfg["markov_rank"],
        markov_head_type="vanilla", dtype=cfg["dtype"])
    drafter = jmf.DSparkDrafter(drafter_config, rngs=nnx.Rngs(cfg["seed"] + 1))
    # An untrained backbone that does no harm: its layers' output projections are scaled as
    # `bigram_lm` scales the target's (std context_scale / sqrt(fan_in)), so that the block's rows keep
    # what their input embedding says (the anchor's bigram on row 0, a constant on the mask rows)
    # instead of random logits as large as the bigram's, which a layer of std 0.02 adds at a wide hidden size.
    for layer in drafter.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            scale = cfg["context_scale"] / proj.in_features ** 0.5 / drafter_config.initializer_range
            proj.weight[...] = (proj.weight[...].astype(jnp.float32) * scale).astype(proj.weight.dtype)
    v, r = cfg["vocab"], cfg["markov_rank"]
    arms = {}
    for name, quantization in (("bf16 head", None), ("int8 head", "int8"), ("certified int8 head", "int8-certified")):
        d = jmf.DSparkDrafter(drafter_config)
        nnx.update(d, nnx.state(drafter))  # same backbone (the fit changes only the drafter's own head)
        d.markov_head = jmf.MarkovHead(v, r, param_dtype=jnp.bfloat16, markov_quantization=quantization)
        arms[name] = d
    return drafter, arms


def load_fitted_head(drafter, arms):
    """The arms' heads from the drafter's fitted head: the bf16 head rounds it to bfloat16 (as the
    released heads), the int8 heads quantize that bf16 W2 (their int8 layout made here, once)."""
    bf16 = arms["bf16 head"].markov_head
    bf16.load_weights(drafter.markov_head.markov_w1[...], drafter.markov_head.markov_w2[...])
    for name in ("int8 head", "certified int8 head"):
        arms[name].markov_head.load_weights(bf16.markov_w1[...], bf16.markov_w2[...])


@nnx.jit
def final_hidden(model, ids):
    """The target's final hidden state [c, H] after each of the tokens ids [c], each alone at
    position 0, rounded to the dtype of the LM head (which rounds its input to it)."""
    layers = model.config.num_hidden_layers
    out = model(ids[:, None], jnp.zeros_like(ids), model.init_cache(ids.shape[0], 1), feature_layers=(layers - 1,))
    return model.model.norm(out.features[:, 0]).astype(model.lm_head.weight.dtype)


@nnx.jit
def mask_hidden(drafter, model, tokens):
    """The mean hidden state [H] of the drafter's mask rows after the contexts tokens [b, s]."""
    b, s = tokens.shape
    out = model(tokens, jnp.zeros(b, jnp.int32), model.init_cache(b, s), feature_layers=drafter.target_layer_ids)
    ctx = drafter.extend_context(out.features, jnp.zeros(b, jnp.int32), drafter.init_context(b, s + 1))
    hidden = drafter.hidden(tokens[:, -1], jnp.full(b, s - 1), ctx, embed=model.embed)
    return jnp.mean(hidden[:, 1:].astype(model.lm_head.weight.dtype).astype(jnp.float32), axis=(0, 1))


def fit_chunks(cfg, chunk: int = 2048) -> list:
    """The token ids [chunk] whose final hidden states the fit reads: every token, in whole chunks
    (one compiled shape; the last wraps around)."""
    v = cfg["vocab"]
    chunk = min(chunk, v)
    ids = jnp.arange(-(-v // chunk) * chunk) % v
    return [ids[i:i + chunk] for i in range(0, ids.shape[0], chunk)]


def mask_contexts(cfg):
    """The random contexts [16, 16] after which the fit averages the mask rows' hidden states."""
    return jax.random.randint(jax.random.key(cfg["seed"] + 2), (16, 16), 0, cfg["vocab"] - 1)


class TargetFactors(NamedTuple):
    """What the fit reads of the target, whatever the drafter (see `fit_markov_head`)."""
    hidden: jax.Array  # [V, H] the final hidden state after each single token, in the LM head's dtype
    q_right: jax.Array  # [V, H] and [H, H]: the QR factors of the LM head, its mean row subtracted
    r_right: jax.Array


def target_factors(target, cfg, chunk: int = 2048) -> TargetFactors:
    """The part of the fit that depends on the target alone: drafters of every block size share it."""
    hidden = jnp.concatenate([final_hidden(target, ids) for ids in fit_chunks(cfg, chunk)])[:cfg["vocab"]]
    right = target.lm_head.weight[...].astype(jnp.float32)
    right = right - jnp.mean(right, axis=0, keepdims=True)
    q_right, r_right = jnp.linalg.qr(right)
    return TargetFactors(hidden, q_right, r_right)


def fit_markov_head(target, drafter, cfg, chunk: int = 2048, factors: TargetFactors | None = None):
    """Fit the drafter's Markov head; returns the relative Frobenius error of the rank-r truncation
    (in float32, before the head rounds it to its dtype).

    The bias the head should add after token u is the target's next-token logits after u (its bigram
    table) minus what the drafter's mask rows already predict (their mean logits), rows centred (a
    constant shift changes nothing); its best rank-r approximation gives W1 and W2. Both logits are
    hidden states times the shared LM head W [V, H], so the bias is (Hs - h) (W - w)^T, with Hs [V, H]
    the target's final hidden state after each single token, h the mask rows' mean hidden state and
    w the mean row of W. Its truncated SVD comes from the QR factors of the two [V, H] matrices and
    the SVD of an [H, H] matrix: the [V, V] table is never formed (at V = 151936 it would take 92 GB).
    Hs and the QR factors of W - w depend on the target alone (`target_factors`, computed here unless
    given); h depends on the drafter and its block size."""
    if factors is None:
        factors = target_factors(target, cfg, chunk)
    left = factors.hidden.astype(jnp.float32) - mask_hidden(drafter, target, mask_contexts(cfg))[None, :]
    q_left, r_left = jnp.linalg.qr(left)
    highest = jax.lax.Precision.HIGHEST
    u, s, wt = jnp.linalg.svd(jnp.matmul(r_left, factors.r_right.T, precision=highest))
    head = drafter.markov_head
    rank = min(head.markov_rank, s.shape[0])
    root = jnp.sqrt(s[:rank])
    w1 = jnp.matmul(q_left, u[:, :rank], precision=highest) * root
    w2 = jnp.matmul(factors.q_right, wt[:rank].T, precision=highest) * root
    pad = ((0, 0), (0, head.markov_rank - rank))  # zero columns where the hidden size is below the rank
    head.load_weights(jnp.pad(w1, pad), jnp.pad(w2, pad) / head.logit_scale)
    return float(jnp.sqrt(jnp.sum(s[rank:] ** 2) / jnp.sum(s ** 2)))


def timed(fn, repeats):
    result = fn()  # compile
    jax.block_until_ready(result.tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        jax.block_until_ready(result.tokens)
        times.append(time.perf_counter() - start)
    return result, min(times)  # the least disturbed run: other processes only ever add time


def walk_implementation(cfg, impl, device):
    if impl == "reference":
        return "pure-JAX reference (impl='reference')"
    if device.platform == "cpu":
        return ("the CPU custom call" if native.cpu_available()
                else "pure-JAX reference (the CPU custom call is not built in this install)")
    if device.platform == "gpu" or device.platform == "cuda":
        reason = native.cuda_unsupported_reason(cfg["batch"], cfg["block_size"], cfg["vocab"], cfg["markov_rank"],
                                                jnp.bfloat16)
        return "the sm_90 CUDA kernel" if reason is None else f"pure-JAX reference ({reason})"
    return "pure-JAX reference"


def _origin():
    path = os.path.abspath(os.path.dirname(jax_markov.__file__))
    return "this source tree" if path.startswith(os.path.dirname(HERE) + os.sep) else f"an install ({path})"


def git_commit():
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=HERE, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    args, cfg = parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    target = build_target(cfg)
    drafter, heads, fit_error = build_drafters(cfg, target, cfg["block_size"])
    print(f"Markov head fit by truncated SVD at rank {cfg['markov_rank']}: relative error {fit_error:.2e}")
    rng = np.random.default_rng(cfg["seed"] + 3)
    b, p, n = cfg["batch"], cfg["prompt_len"], cfg["new_tokens"]
    prompt = jnp.asarray(rng.integers(0, cfg["vocab"] - 1, (b, p)), jnp.int32)
    lengths = jnp.full((b,), p, jnp.int32)
    modes = [("greedy", None, None),
             (f"sampled, T = {cfg['temperature']:g}", jnp.full((b,), cfg["temperature"], jnp.float32),
              jax.random.split(jax.random.key(cfg["seed"] + 4), b))]
    rows = []
    for mode, temperature, key in modes:
        kw = dict(max_new_tokens=n, temperature=temperature, key=key)
        ref, t_ref = timed(lambda: sp.target_decode(target, prompt, lengths, **kw), cfg["repeats"])
        rows.append((mode, "target alone", "1.000", float(jnp.mean(ref.num_steps)), b * n / t_ref, 1.0, "reference"))
        print(f"{mode:>16} | target alone   | {b * n / t_ref:9.1f} tok/s")
        arms = [("DSpark, no head", drafter, False), ("DSpark, bf16 head", heads["bf16 head"], True),
                ("DSpark, int8 head", heads["int8 head"], True),
                ("DSpark, certified int8 head", heads["certified int8 head"], True)]
        results = {}
        for name, d, use_head in arms:
            res, t = timed(lambda: sp.speculative_decode(target, d, prompt, lengths, use_markov_head=use_head,
                                                         impl=args.impl, **kw), cfg["repeats"])
            results[name] = res
            tau = res.mean_acceptance_length()
            if temperature is None:
                same = bool(np.array_equal(np.asarray(res.tokens), np.asarray(ref.tokens)))
                check = "identical to the target's greedy text" if same else "DIFFERS from the target's greedy text"
                if not same:
                    print("error: greedy speculative decoding differs from the target's greedy decoding",
                          file=sys.stderr)
                if name == "DSpark, certified int8 head":
                    # Its greedy drafts are the bf16 head's: the same accepted drafts at every step.
                    bf16_accepted = np.asarray(results["DSpark, bf16 head"].num_accepted)
                    equal = bool(np.array_equal(np.asarray(res.num_accepted), bf16_accepted))
                    check += "; accepted drafts " + ("equal to the bf16 head's" if equal else "DIFFER from the bf16 head's")
                    if not equal:
                        print("error: the certified int8 head's greedy drafts differ from the bf16 head's", file=sys.stderr)
            else:
                drafted = int(jnp.sum(res.num_steps)) * cfg["block_size"]
                check = f"{int(jnp.sum(res.num_accepted))} of {drafted} drafts accepted"
            rows.append((mode, name, f"{tau:.3f}", float(jnp.mean(res.num_steps)), b * n / t, t_ref / t, check))
            print(f"{mode:>16} | {name:<17} | acceptance length {tau:.3f} | {b * n / t:9.1f} tok/s "
                  f"| x{t_ref / t:.2f} | {check}")
    report = render(args, cfg, device, fit_error, rows)
    print()
    print(report)
    write = not args.no_write and (args.out is not None or not args.quick)
    if write:
        kind = "cpu" if device.platform == "cpu" else "gpu"
        out = args.out or os.path.join(HERE, "results", f"speculative_decoding_{kind}.md")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            f.write(report)
        print(f"report written to {os.path.relpath(out)}")
    if any("DIFFERS" in r[-1] for r in rows):
        return 1
    return 0


def render(args, cfg, device, fit_error, rows):
    command = "python examples/speculative_decoding.py" + ("" if not sys.argv[1:] else " " + " ".join(sys.argv[1:]))
    import flax
    import jaxlib

    lines = [
        "# Speculative decoding with the DSpark Markov walk",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- jax_markov commit: {git_commit()}",
        f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"flax {flax.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
        f"- device: {device.device_kind} ({device.platform}, {os.cpu_count()} host cores), "
        f"{jax.device_count()} device(s)",
        f"- jax_markov {jax_markov.__version__} from {_origin()}; the walk ran as: "
        f"{walk_implementation(cfg, args.impl, device)}",
        "",
        "## Setup",
        "",
        f"- target: Qwen3-style, {cfg['target_layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads "
        f"({cfg['kv_heads']} KV), vocabulary {cfg['vocab']}; its next-token logits are a rank-{cfg['bigram_rank']} "
        f"bigram (scale {cfg['sharpness']:g}) plus a context term from its layers (context scale "
        f"{cfg['context_scale']:g}) (`jax_markov.flax.bigram_lm`).",
        f"- drafter: `DSparkDrafter`, {cfg['drafter_layers']} layer(s), block size K = {cfg['block_size']} "
        f"([anchor, mask x {cfg['block_size'] - 1}]), "
        f"conditioned on the target's hidden states, sharing its embedding and LM head; random (untrained) backbone "
        f"whose layers add little to the block's rows (output projections scaled like the target's: std "
        f"{cfg['context_scale']:g} / sqrt(fan-in)).",
        f"- Markov head: rank r = {cfg['markov_rank']}, fit to the target's bigram table minus the drafter's mask-row "
        f"logits by a truncated SVD (relative error {fit_error:.2e}); the bf16 head rounds it to bfloat16, the "
        f"int8 head quantizes that W2 per row (docs/spec.md), and the certified int8 head walks that int8 W2 but "
        f"chooses greedy rows' tokens exactly as the bf16 head does (`quantize(head, certified=True)`).",
        f"- batch {cfg['batch']} requests, prompts of {cfg['prompt_len']} random tokens, {cfg['new_tokens']} new "
        f"tokens each; tokens/s = batch x new tokens / wall time of one jitted decode (prefill included, "
        f"compilation excluded), best of {cfg['repeats']} runs.",
        "- mean acceptance length = tokens emitted per target forward (accepted drafts + 1), over all verify steps.",
        "",
        "## Results",
        "",
        "| decoding | drafter | mean acceptance length | target forwards per request | tokens/s "
        "| speedup vs target | check |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode, name, tau, forwards, tps, speedup, check in rows:
        lines.append(f"| {mode} | {name} | {tau} | {forwards:.1f} | {tps:.1f} | {speedup:.2f}x | {check} |")
    lines += [
        "",
        "Target forwards per request: after the prefill, one per verify step (one per token for the target alone).",
        "Acceptance length and forwards are properties of the drafter and the target, not of the machine. "
        "Tokens/s is what this machine made of them: on a small CPU a verify forward over K + 1 tokens costs "
        "several single-token forwards (the toy model is compute-bound, not memory-bound as real decoding on an "
        "accelerator is), the drafter's block and the walk (V x r per step, with r as large as the toy's hidden "
        "size) weigh far more than next to a real target, and other processes sharing the cores add noise.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
