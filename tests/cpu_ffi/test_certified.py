"""The CPU custom call walking a CertifiedMarkovHead (ffi/cpu/certified.h), on the SIMD path this
CPU gets and on the portable one.

- Greedy rows choose exactly the tokens of the CPU custom call walking the unquantized head (equal,
  no tolerance: the candidates are re-scored by the float walk's own code), including the
  constructed cases of tests/certified_cases.py where the plain int8 walk provably chooses another
  token, and against the reference of the unquantized head by conftest.py's parity rules.
- Sampled rows and every returned logit are the plain int8 call's, bit for bit (teacher forced along
  the certified tokens where its greedy rows went another way).
- The rows re-scored, from `_markov_cpu.certified_stats()`: on random heads whose int8 and exact
  choices differ at some steps, at most MAX_ROWS_PER_CHUNK a chunk on average (each re-scores its own
  best and about half a row more, measured), a small part of V; both columns of a constructed
  near-tie in one chunk; every row where the bound cannot be used (a non-finite e, a bias that could
  overflow).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_markov
from jax_markov import native
from tests import certified_cases

MAX_ROWS_PER_CHUNK = 2.0


def stats():
    return native._markov_cpu.certified_stats()


def random_heads(rng, vocab, rank, *, w1_dtype, w2_dtype=jnp.bfloat16):
    """(MarkovHead, CertifiedMarkovHead) with an O(1) bias, so that int8 and W2 disagree at some steps."""
    w1 = jnp.asarray(rng.standard_normal((vocab, rank)), w1_dtype)
    w2 = jnp.asarray(rng.standard_normal((vocab, rank)) / np.sqrt(rank), w2_dtype)
    head = jax_markov.MarkovHead(w1, w2)
    return head, jax_markov.quantize(head, certified=True)


def int8_logits_along(walk, tokens, base, anchor, qhead, **kw):
    """The int8 call's logits of each step walked from the given tokens (one K = 1 call a step)."""
    prev = np.concatenate([np.asarray(anchor)[:, None], np.asarray(tokens)[:, :-1]], axis=1)
    return np.concatenate([np.asarray(walk("ffi", base[:, k:k + 1], jnp.asarray(prev[:, k]), qhead, return_logits=True,
                                           **kw).logits, np.float32) for k in range(base.shape[1])], axis=1)


@pytest.mark.parametrize("case,logits_dtype", certified_cases.CASE_PARAMS)
def test_constructed_disagreements(rng, isa, case, logits_dtype, walk):
    c = certified_cases.CASES[case](rng, logits_dtype=logits_dtype)
    chead = jax_markov.quantize(c.head, certified=True)
    kw = {} if logits_dtype is None else dict(return_logits=True, logits_dtype=logits_dtype)
    plain = walk("ffi", c.base, c.anchor, chead.quantized, **kw)
    np.testing.assert_array_equal(plain.tokens[:, 0], c.int8)  # the construction: int8 chooses otherwise
    native._markov_cpu.reset_certified_stats()
    got = walk("ffi", c.base, c.anchor, chead, **kw)
    counted = stats()
    want = walk("ffi", c.base, c.anchor, c.head, **kw)
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    batch, steps = c.base.shape[:2]
    assert counted["decisions"] == batch * steps and counted["uncertified"] == 0
    assert counted["max_chunk_set"] >= 2  # the pair, in one chunk, both re-scored
    if logits_dtype is not None:
        np.testing.assert_array_equal(np.asarray(got.logits, np.float32),
                                      int8_logits_along(walk, got.tokens, c.base, c.anchor, chead.quantized,
                                                        logits_dtype=logits_dtype))


@pytest.mark.parametrize("batch,steps,vocab,rank,w1_dtype,base_dtype,w2_dtype", [
    (1, 7, 4099, 256, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (5, 4, 3000, 256, jnp.float32, jnp.float32, jnp.bfloat16),
    (16, 7, 2048, 256, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (3, 3, 1500, 100, jnp.float16, jnp.float16, jnp.float32),
    (9, 2, 2500, 256, jnp.bfloat16, jnp.float32, jnp.float16),
])
@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_random_shapes(rng, isa, batch, steps, vocab, rank, w1_dtype, base_dtype, w2_dtype, mode, walk, make_base,
                       make_sampling, check_parity):
    head, chead = random_heads(rng, vocab, rank, w1_dtype=w1_dtype, w2_dtype=w2_dtype)
    base = make_base(rng, batch, steps, vocab, base_dtype, scale=1.0)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    # greedy rows choose from fp32 logits; mixed ones return bf16 logits and choose from those
    kw = make_sampling(rng, batch, mode) if mode == "greedy" else dict(make_sampling(rng, batch, mode),
                                                                       return_logits=True, logits_dtype=jnp.bfloat16)
    native._markov_cpu.reset_certified_stats()
    got = walk("ffi", base, anchor, chead, **kw)
    counted = stats()
    exact = walk("ffi", base, anchor, head, **kw)
    int8 = walk("ffi", base, anchor, chead.quantized, **kw)
    greedy = np.asarray(kw.get("temperature", np.zeros(batch))) == 0
    np.testing.assert_array_equal(np.asarray(got.tokens)[greedy], np.asarray(exact.tokens)[greedy])
    np.testing.assert_array_equal(np.asarray(got.tokens)[~greedy], np.asarray(int8.tokens)[~greedy])
    assert counted["decisions"] == greedy.sum() * steps and counted["uncertified"] == 0
    assert counted["rescored"] <= MAX_ROWS_PER_CHUNK * counted["chunk_sets"], counted
    if mode == "greedy":
        # against the oracle: the reference walk of the unquantized head, up to near-ties
        check_parity(got, walk("reference", base, anchor, head, return_logits=True), kw, label="certified")
    else:
        np.testing.assert_array_equal(np.asarray(got.logits)[~greedy], np.asarray(int8.logits)[~greedy])
        np.testing.assert_array_equal(np.asarray(got.logits, np.float32),
                                      int8_logits_along(walk, got.tokens, base, anchor, chead.quantized,
                                                        logits_dtype=jnp.bfloat16))


def test_masked_padding_nan_d2t_and_logit_scale(rng, isa, walk):
    """The spec's rules on a constructed near-tie: the exact winner masked (-inf) or in the padding
    (vocab_size), a NaN base logit (the first NaN wins), d2t and a negative logit_scale."""
    c = certified_cases.near_tie(rng, batch=4, steps=3)
    chead = jax_markov.quantize(c.head, certified=True)
    base = np.asarray(c.base).copy()
    base[0, 0, c.exact[0]] = -np.inf  # masked: the next best exact column
    base[2, 0, [c.int8[2], c.exact[2]]] = np.nan
    vocab = base.shape[2]
    d2t = jnp.asarray(rng.integers(0, 3, vocab), jnp.int32)
    for kw in (dict(), dict(vocab_size=int(c.exact[1])), dict(d2t=d2t, logit_scale=-0.75)):
        got = walk("ffi", jnp.asarray(base), c.anchor, chead, **kw)
        want = walk("ffi", jnp.asarray(base), c.anchor, c.head, **kw)
        np.testing.assert_array_equal(got.tokens, want.tokens)
    first_nan = min(c.int8[2], c.exact[2])
    assert walk("ffi", jnp.asarray(base), c.anchor, chead).tokens[2, 0] == first_nan


def test_every_row_rescored_where_the_bound_cannot_be_used(rng, isa, walk):
    """An infinity in e (W1[anchor]) or a logit_scale that could overflow a bias: the step is not
    certified, every row is re-scored, and the tokens are still the unquantized call's."""
    head, _ = random_heads(rng, 600, 64, w1_dtype=jnp.float32)
    head = jax_markov.MarkovHead(head.w1.at[5, 3].set(jnp.inf), head.w2)
    chead = jax_markov.quantize(head, certified=True)
    base = jnp.asarray(rng.standard_normal((3, 2, 600)), jnp.float32)
    anchor = jnp.asarray([5, 1, 2], jnp.int32)
    for kw in (dict(), dict(logit_scale=1e36)):
        native._markov_cpu.reset_certified_stats()
        got = walk("ffi", base, anchor, chead, **kw)
        counted = stats()
        np.testing.assert_array_equal(got.tokens, walk("ffi", base, anchor, head, **kw).tokens)
        assert counted["uncertified"] >= 1 and counted["max_rescored"] == 600


def test_jit_vmap_and_decode_loop(rng, walk):
    b, k, v = 3, 3, 1024
    head, chead = random_heads(rng, v, 256, w1_dtype=jnp.bfloat16)
    base = jnp.asarray(rng.standard_normal((2, b, k, v)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, v, (2, b)), jnp.int32)
    one = lambda x, a, h: jax_markov.walk(x, a, h, impl="ffi").tokens
    want = np.stack([walk("ffi", base[i], anchor[i], head).tokens for i in range(2)])
    np.testing.assert_array_equal(jax.vmap(one, in_axes=(0, 0, None))(base, anchor, chead), want)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), chead)
    np.testing.assert_array_equal(jax.jit(jax.vmap(one))(base, anchor, stacked), want)

    @jax.jit
    def rounds(h):
        def body(i, carry):
            prev, out = carry
            tokens = one(base[i], prev, h)
            return tokens[:, -1], out.at[i].set(tokens)
        return lax.fori_loop(0, 2, body, (anchor[0], jnp.zeros((2, b, k), jnp.int32)))[1]

    assert "custom_call @jax_markov_walk" in rounds.lower(chead).as_text()
    np.testing.assert_array_equal(rounds(chead), rounds(head))
