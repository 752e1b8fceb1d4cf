"""The GPU tests' inputs and their parity check against the reference (tests/test_cuda.py,
test_cuda_transposed.py, test_cuda_certified.py; conftest's check_parity fixture).

Tolerances: a token may differ from the reference only at a near-tie, where the reference's best
score and its score of the kernel's token differ by at most NEAR_TIE * (1 + |best|); after such a
step the two walks condition on different tokens, so the rest of that row is not compared. Logits
compare with LOGIT_RTOL/LOGIT_ATOL in float32 (one ulp of the narrower dtype otherwise); embeds
must be equal. Near-ties are counted and may touch at most MAX_NEAR_TIE_ROWS of the rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm

NEAR_TIE = 2e-5
LOGIT_RTOL, LOGIT_ATOL = 2e-5, 2e-5
MAX_NEAR_TIE_ROWS = 0.05
MAX_NEAR_TIE_ROWS_NARROW = 0.3


def make_case(rng, batch, steps, vocab, *, v_target=None, base_dtype=jnp.bfloat16, w1_dtype=jnp.bfloat16,
              w2_dtype=jnp.int8, sampled=False, mixed=False):
    """Inputs of one walk; w2_dtype int8 quantizes a bf16 W2, fp16/bf16 keeps the head unquantized."""
    v_target = v_target or vocab
    w1 = (rng.standard_normal((v_target, 256)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((vocab, 256)) * 0.05 * rng.uniform(0.5, 2.0, (vocab, 1))).astype(np.float32)
    head = jm.MarkovHead(jnp.asarray(w1, w1_dtype), jnp.asarray(w2, jnp.bfloat16 if w2_dtype == jnp.int8 else w2_dtype))
    head = jm.quantize(head) if w2_dtype == jnp.int8 else head
    base = jnp.asarray(rng.standard_normal((batch, steps, vocab)) * 2.0, base_dtype)
    anchor = jnp.asarray(rng.integers(0, v_target, batch), jnp.int32)
    kw = {}
    if sampled or mixed:
        temp = rng.uniform(0.5, 1.5, batch).astype(np.float32)
        if mixed:
            temp[::2] = 0.0
        kw = dict(temperature=jnp.asarray(temp),
                  key=jax.random.split(jax.random.key(int(rng.integers(1 << 30))), batch),
                  position=jnp.asarray(rng.integers(0, 4096, batch), jnp.int32))
    return base, anchor, head, kw


def poison_device_memory(nbytes: int):
    """Leave NaN bytes where the allocator will place the next outputs."""
    junk = jnp.full((max(nbytes, 4) // 4 + 1024,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def padding_d2t_and_scale(rng, vocab, v_target):
    """The walk's extras: d2t onto a target vocabulary of v_target, padding past vocab_size and a
    logit_scale."""
    d2t = jnp.asarray(np.sort(rng.choice(v_target, vocab, replace=False)) - np.arange(vocab), jnp.int32)
    return dict(d2t=d2t, vocab_size=vocab - 41, logit_scale=0.7)


def check_parity(reference_scores, assert_tokens_match, base, anchor, head, kw, *, logits_dtype=jnp.float32,
                 **walk_kw):
    """Runs kernel and reference on the same inputs and compares them; returns the near-tie rows
    (conftest's check_parity fixture passes reference_scores and assert_tokens_match)."""
    batch, steps, vocab = base.shape
    poison_device_memory(batch * steps * vocab * 4 * 2)
    outs = {impl: jm.walk(base, anchor, head, impl=impl, return_logits=True, logits_dtype=logits_dtype,
                          return_embeds=True, **kw, **walk_kw) for impl in ("ffi", "reference")}
    got, ref = outs["ffi"], outs["reference"]
    scores = reference_scores(ref.logits, kw.get("temperature"), kw.get("key"), kw.get("position"))
    # Rounding logits to bf16/f16 before choosing makes exact ties common, so near-ties are too.
    limit = MAX_NEAR_TIE_ROWS if logits_dtype == jnp.float32 else MAX_NEAR_TIE_ROWS_NARROW
    near_ties, same_prefix = assert_tokens_match(scores, ref.tokens, got.tokens, NEAR_TIE, rtol=NEAR_TIE,
                                                 d2t=walk_kw.get("d2t"),
                                                 max_mismatch_rows=max(1, int(limit * batch)))
    narrow = logits_dtype != jnp.float32
    lg_got = np.asarray(got.logits.astype(jnp.float32))[same_prefix]
    lg_ref = np.asarray(ref.logits.astype(jnp.float32))[same_prefix]
    np.testing.assert_allclose(lg_got, lg_ref, rtol=2.0 ** -7 if narrow else LOGIT_RTOL,
                               atol=LOGIT_ATOL * (100 if narrow else 1))
    np.testing.assert_array_equal(np.asarray(got.embeds)[same_prefix], np.asarray(ref.embeds)[same_prefix])
    # Walks with no logits out take other kernels: all-greedy ones the branch-free epilogue, and
    # with an int8 W2 those of 3-8 requests score on e's int8 digit pairs (with a bf16 W1 they do
    # with logits out too). (A sampled walk's tokens are compared where its logits were not
    # rounded to a narrower dtype before choosing.)
    if "temperature" not in kw or not narrow:
        poison_device_memory(batch * steps * 4 * 2)
        plain = jm.walk(base, anchor, head, impl="ffi", **kw, **walk_kw)
        assert_tokens_match(scores, ref.tokens, plain.tokens, NEAR_TIE, rtol=NEAR_TIE, d2t=walk_kw.get("d2t"),
                            max_mismatch_rows=max(1, int(limit * batch)))
    return near_ties
