"""The CUDA walk inside XLA's command buffers (CUDA graphs), on the GPU (skipped cleanly without one).

The handler is declared command-buffer compatible, so a jitted decode loop records the walk into its
CUDA graphs. XLA's flags only take effect when a process starts, so each side runs in a child
process: the same seeded decode loop (greedy and sampled rows, int8 and bf16 heads, batches that take
each kernel) with command buffers forced on for custom calls, and with command buffers off. The
tokens and logits must be equal bit for bit (the same kernels on the same inputs), and the greedy
tokens must equal the reference's up to near-ties.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jax_markov import native


pytestmark = pytest.mark.skipif(not native.cuda_gpu_available(),
                                reason="needs a CUDA GPU and the jax_markov CUDA module")

COMMAND_BUFFERS = {
    "on": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1",
    "off": "--xla_gpu_enable_command_buffer=",
}

# The child: a jitted lax.fori_loop that drafts ROUNDS times, each round from the last token of the
# one before, and saves every round's tokens and logits.
CHILD = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import jax_markov as jm

out, batch, w2 = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(batch)
vocab, steps, rounds = 20008, 4, 3
w1 = jnp.asarray(rng.standard_normal((vocab, 256)) * 0.05, jnp.bfloat16)
head = jm.MarkovHead(w1, jnp.asarray(rng.standard_normal((vocab, 256)) * 0.05, jnp.bfloat16))
head = jm.quantize(head) if w2 == "int8" else head
base = jnp.asarray(rng.standard_normal((rounds, batch, steps, vocab)) * 2.0, jnp.bfloat16)
temp = rng.uniform(0.5, 1.5, batch).astype(np.float32)
temp[::2] = 0.0
temp, keys = jnp.asarray(temp), jax.random.split(jax.random.key(7), batch)
position = jnp.asarray(rng.integers(0, 4096, batch), jnp.int32)
anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)

@jax.jit
def decode(base, anchor, position):
    def body(i, carry):
        anchor, position, tokens, logits = carry
        res = jm.walk(base[i], anchor, head, temperature=temp, key=keys, position=position, return_logits=True,
                      logits_dtype=jnp.bfloat16, impl="ffi")
        return res.tokens[:, -1], position + steps, tokens.at[i].set(res.tokens), logits.at[i].set(res.logits)
    init = (anchor, position, jnp.zeros((rounds, batch, steps), jnp.int32),
            jnp.zeros((rounds, batch, steps, vocab), jnp.bfloat16))
    return jax.lax.fori_loop(0, rounds, body, init)[2:]

tokens, logits = decode(base, anchor, position)
tokens, logits = decode(base, anchor, position)  # a second run replays what the first recorded
ref = jm.reference.walk(base[0], anchor, head, temperature=temp, key=keys, position=position, return_logits=True,
                        logits_dtype=jnp.bfloat16)
np.savez(out, tokens=np.asarray(tokens), logits=np.asarray(logits.astype(jnp.float32)),
         ref_tokens=np.asarray(ref.tokens), ref_logits=np.asarray(ref.logits.astype(jnp.float32)))
"""


def _run(tmp_path, mode, batch, w2):
    out = tmp_path / f"{mode}-{batch}-{w2}.npz"
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFERS[mode]).strip(),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), str(batch), w2], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out)


# 2: the digit kernel; 12: MarkovWalkKernel's noise tiles; 40: the transposed kernel.
@pytest.mark.parametrize("batch, w2", [(2, "int8"), (12, "int8"), (40, "int8")])
def test_decode_loop_same_with_command_buffers_on_and_off(tmp_path, batch, w2):
    on, off = _run(tmp_path, "on", batch, w2), _run(tmp_path, "off", batch, w2)
    np.testing.assert_array_equal(on["tokens"], off["tokens"])
    np.testing.assert_array_equal(on["logits"], off["logits"])
    # Round 0 against the reference: its logits within one bf16 ulp, its tokens equal but where the
    # reference's own scores of the two tokens nearly tie.
    np.testing.assert_allclose(on["logits"][0], on["ref_logits"], rtol=2**-7, atol=1e-5)
    tokens, ref = on["tokens"][0], on["ref_tokens"]
    first_step_equal = tokens[:, 0] == ref[:, 0]
    assert first_step_equal.mean() >= 0.9, (tokens[:, 0], ref[:, 0])
