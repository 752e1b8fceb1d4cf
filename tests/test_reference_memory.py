"""The compiled reference walk's memory: it gathers the W1 rows it looks up, and builds no W1-sized
temporary (compiled HLO text).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import reference

_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_HLO_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (\S+?)(?:\{[^}]*\})? ([\w-]+)\(")
_HLO_CALLS = re.compile(r"calls=%([\w.-]+)")


def hlo_buffers(hlo_text):
    """(type, opcode) of the instructions of compiled HLO text that live in memory: those outside
    fused computations (inside a fusion, an elementwise op on W1 feeding a gather of B rows only
    computes those rows)."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        if current is None:
            match = _HLO_COMPUTATION.match(line)
            if match and line.rstrip().endswith("{"):
                current = computations.setdefault(match.group(1), [])
        elif line.startswith("}"):
            current = None
        else:
            current.append(line)
    fused = {c for lines in computations.values() for line in lines if " fusion(" in line
             for c in _HLO_CALLS.findall(line)}
    return [match.groups() for name, lines in computations.items() if name not in fused
            for match in map(_HLO_INSTRUCTION.match, lines) if match]


@pytest.mark.parametrize("entry", ["reference.walk", "walk"])
@pytest.mark.parametrize("w1_dtype,w2_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, "int8"),
                                               (jnp.float16, jnp.float16), (jnp.float32, "int8")],
                         ids=["bf16", "bf16-int8", "f16", "f32-int8"])
@pytest.mark.parametrize("batch", [1, 16])
def test_compiled_walk_widens_only_the_rows_it_looks_up(rng, make_head, make_inputs, entry, w1_dtype, w2_dtype,
                                                        batch):
    """The jitted reference walk (the fallback and the eager arm of the benchmarks) gathers the B
    rows of W1 it needs per step; it never builds a float32 copy of all of W1 (XLA's CPU backend
    did: it runs a bf16 gather in float32 and hoists the widening of W1 out of the loop), nor any
    other W1-sized temporary. V_target = 5003 (prime, unlike any other dimension) names W1."""
    v, v_target, r, k = 384, 5003, 256, 7
    cpu = jax.devices("cpu")[0]
    head = jax.device_put(make_head(rng, v, r, v_target=v_target, w1_dtype=w1_dtype, w2_dtype=w2_dtype), cpu)
    inputs = jax.device_put(make_inputs(rng, batch, k, v, v_target=v_target, dtype=jnp.bfloat16), cpu)
    fn = reference.walk if entry == "reference.walk" else functools.partial(jax_markov.walk, impl="reference")
    walk = jax.jit(lambda base, anchor, head: fn(base, anchor, head, return_logits=True, return_embeds=True))
    compiled = walk.lower(inputs["base_logits"], inputs["anchor"], head).compile()
    text = compiled.as_text()
    w1_shape = f"[{v_target},{r}]"
    if w1_dtype != jnp.float32:
        assert f"f32{w1_shape}" not in text, "a float32 copy of all of W1"
    temporaries = [(t, op) for t, op in hlo_buffers(text)
                   if t.endswith(w1_shape) and op not in ("parameter", "get-tuple-element", "bitcast")]
    assert not temporaries, f"W1-sized temporaries: {temporaries}"
    # and the rows are W1's own, bit for bit
    got = compiled(inputs["base_logits"], inputs["anchor"], head)
    prev = np.concatenate([np.asarray(inputs["anchor"])[:, None], np.asarray(got.tokens)[:, :-1]], axis=1)
    want = np.asarray(jax.lax.bitcast_convert_type(head.w1, jnp.uint16 if head.w1.dtype.itemsize == 2 else jnp.uint32))
    have = np.asarray(jax.lax.bitcast_convert_type(got.embeds, want.dtype))
    np.testing.assert_array_equal(have, want[prev])
