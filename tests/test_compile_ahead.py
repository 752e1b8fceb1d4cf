"""examples/compile_ahead.py: programs lowered here and compiled on a thread pool before they run.

- the pool's size: one compilation per core, as host memory allows, at most one per program;
- every submitted program is compiled once (a key submitted again is not), on the pool, and a later
  call of the jitted function runs that executable without compiling again;
- `compilations` records the compilations inside its block by function name, from any thread.
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from examples import compile_ahead


def test_the_pool_has_a_thread_per_core_as_memory_allows_and_at_most_one_per_program():
    gib = 2**30
    assert compile_ahead.default_workers(40, cpus=16, memory=128 * gib) == 16
    assert compile_ahead.default_workers(40, cpus=16, memory=10 * gib) == 10 * gib // compile_ahead.COMPILE_BYTES
    assert compile_ahead.default_workers(3, cpus=16, memory=128 * gib) == 3
    assert compile_ahead.default_workers(5, cpus=16, memory=gib) == 1  # never none
    assert compile_ahead.default_workers(5, cpus=2) >= 1  # memory read from the host where it can be


@jax.jit
def _step(x, w):
    for _ in range(4):
        x = jnp.tanh(x @ w)
    return x


@jax.jit
def _other(x):
    return jnp.sin(x) * 2


def test_programs_compiled_ahead_run_without_compiling_again():
    x, w = jnp.ones((8, 32)), jnp.full((32, 32), 0.01)
    y = jnp.ones((8, 16))  # shapes no other test compiles these functions for
    logged = []
    with compile_ahead.compilations() as ahead:
        pool = compile_ahead.AheadOfTime(2, logged.append)
        pool.submit("step", lambda: _step.lower(x, w))
        pool.submit("other", lambda: _other.lower(y))
        pool.submit("step", lambda: _step.lower(x, w))  # the same key: not lowered or compiled again
        assert "step" in pool and "missing" not in pool
        stats = pool.wait()
    assert ahead.names.count("jit(_step)") == 1 and ahead.names.count("jit(_other)") == 1
    assert stats["programs"] == 2 and stats["workers"] == 2 and stats["wall_s"] >= stats["longest_s"] > 0
    assert stats["compile_s"] >= stats["longest_s"] and stats["lowering_s"] > 0
    assert pool.result("other").as_text() == _other.lower(y).compile().as_text()
    with compile_ahead.compilations() as runs:
        jax.block_until_ready((_step(x, w), _other(y)))
    assert "jit(_step)" not in runs.names and "jit(_other)" not in runs.names


def test_compilations_are_recorded_from_any_thread():
    z = jnp.ones((3, 5))
    with compile_ahead.compilations() as seen:
        thread = threading.Thread(target=lambda: jax.block_until_ready(_other(z)))
        thread.start()
        thread.join()
    assert seen.names == ["jit(_other)"]
