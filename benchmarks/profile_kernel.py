"""Runs the kernel a few times per configuration, for a profiler to capture (ncu, compute-sanitizer).

    ncu --clock-control none --kernel-name regex:MarkovWalk --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_kernel.py 151936,7,1,greedy 151936,7,64,probabilistic 151936,7,1,greedy,bf16
    compute-sanitizer --tool memcheck python3 benchmarks/profile_kernel.py 5003,3,3,probabilistic
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm

MODES = ("greedy", "greedy-logits", "probabilistic", "greedy-logits-f32", "probabilistic-f32")


def walk_options(mode: str, batch: int) -> dict:
    """The keyword arguments of `jm.walk` for one mode."""
    if mode == "greedy":
        return {}
    kw = dict(return_logits=True, logits_dtype=jnp.float32 if mode.endswith("-f32") else jnp.bfloat16)
    if mode.startswith("probabilistic"):
        kw.update(temperature=jnp.full((batch,), 0.8), key=jax.random.split(jax.random.key(1), batch),
                  position=jnp.arange(batch, dtype=jnp.int32))
    return kw


def run(vocab: int, steps: int, batch: int, mode: str, head_format: str = "int8", calls: int = 3) -> None:
    """`calls` chained walks of one configuration; head_format "int8" (quantized) or "bf16"."""
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    head = jm.MarkovHead(w1, w2)
    head = jm.quantize(head) if head_format == "int8" else head
    base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    kw = walk_options(mode, batch)
    f = jax.jit(lambda base, anchor: jm.walk(base, anchor, head, impl="ffi", **kw))
    for _ in range(calls):
        out = f(base, anchor)
        anchor = out.tokens[:, -1]
    jax.block_until_ready(out)
    print(f"V={vocab} K={steps} B={batch} {mode} {head_format}: tokens[0] = {np.asarray(out.tokens[0]).tolist()}")


def parse(spec: str) -> tuple:
    """"V,K,B,mode[,head]" -> (V, K, B, mode, head_format). Modes: greedy (no logits out), greedy-logits
    (bf16 logits out), probabilistic (every request at T = 0.8, bf16 logits out); the "-f32" forms of
    the last two write float32 logits (the API's default) instead."""
    parts = spec.split(",")
    if parts[3] not in MODES:
        raise ValueError(f"mode {parts[3]!r} of {spec!r} is not one of {MODES}")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3], parts[4] if len(parts) > 4 else "int8"


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["151936,7,1,greedy"]:
        run(*parse(spec))
