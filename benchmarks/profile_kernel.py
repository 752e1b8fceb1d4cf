"""Runs the kernel a few times per configuration, for a profiler to capture (ncu, compute-sanitizer).

    ncu --clock-control none --kernel-name regex:MarkovWalk --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_kernel.py 151936,7,1,greedy 151936,7,64,probabilistic
    compute-sanitizer --tool memcheck python3 benchmarks/profile_kernel.py 5003,3,3,probabilistic
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm


def run(vocab: int, steps: int, batch: int, mode: str, calls: int = 3) -> None:
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((vocab, 256), np.float32) * 0.05, jnp.bfloat16)
    head = jm.quantize(jm.MarkovHead(w1, w2))
    base = jnp.asarray(rng.standard_normal((batch, steps, vocab), np.float32), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    kw = {}
    if mode == "probabilistic":
        kw = dict(temperature=jnp.full((batch,), 0.8), key=jax.random.split(jax.random.key(1), batch),
                  position=jnp.arange(batch, dtype=jnp.int32), return_logits=True, logits_dtype=jnp.bfloat16)
    f = jax.jit(lambda base, anchor: jm.walk(base, anchor, head, impl="ffi", **kw))
    for _ in range(calls):
        out = f(base, anchor)
        anchor = out.tokens[:, -1]
    jax.block_until_ready(out)
    print(f"V={vocab} K={steps} B={batch} {mode}: tokens[0] = {np.asarray(out.tokens[0]).tolist()}")


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["151936,7,1,greedy"]:
        v, k, b, mode = spec.split(",")
        run(int(v), int(k), int(b), mode)
