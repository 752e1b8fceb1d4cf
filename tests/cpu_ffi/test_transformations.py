"""The CPU custom call under jax.jit, lax.while_loop and jax.vmap, and over repeated calls: the custom
call in the lowering with its attributes, the same bits for the same inputs, a request's result
independent of the rest of its batch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_markov
from jax_markov import reference

def test_jit_and_auto_use_the_custom_call(rng, make_head, make_base, walk, check_parity):
    batch, steps, vocab = 3, 4, 1111
    head = make_head(rng, vocab, 64)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    for impl in ("ffi", "auto"):
        f = jax.jit(lambda b, a, h, impl=impl: jax_markov.walk(b, a, h, impl=impl).tokens)
        text = f.lower(base, anchor, head).as_text()
        assert "jax_markov_walk" in text, impl
        check_parity(jax_markov.WalkResult(f(base, anchor, head), None, None),
                     walk("reference", base, anchor, head, return_logits=True), {}, label=impl)


def test_lowering_has_custom_call_and_attributes(rng, make_head, make_base):
    batch, steps, vocab = 2, 3, 1001
    head = make_head(rng, vocab, 16)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.zeros((batch,), jnp.int32)
    f = lambda b, a, h: jax_markov.walk(b, a, h, vocab_size=1000, logit_scale=0.5, return_logits=True,
                                        logits_dtype=jnp.bfloat16, impl="ffi")
    text = jax.jit(f).lower(base, anchor, head).as_text()
    line = next(line for line in text.splitlines() if "custom_call" in line and "jax_markov_walk" in line)
    assert "@jax_markov_walk" in line
    assert "vocab_size = 1000 : i64" in line
    assert "logit_scale = 5.000000e-01 : f32" in line
    assert "tensor<2x3x1001xbf16>" in line  # the logits result
    ref_text = jax.jit(lambda b, a, h: jax_markov.walk(b, a, h, impl="reference")).lower(base, anchor, head).as_text()
    assert "jax_markov_walk" not in ref_text


def test_two_calls_and_identical_bits(rng, make_head, make_base, make_sampling, walk, check_parity):
    """Two calls in a row with other inputs give their own results; the same inputs the same bits."""
    batch, steps, vocab = 4, 4, 2500
    head = make_head(rng, vocab, 128)
    kw = dict(return_logits=True, return_embeds=True, **make_sampling(rng, batch, "mixed"))
    base1, base2 = make_base(rng, batch, steps, vocab), make_base(rng, batch, steps, vocab)
    anchor1 = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    anchor2 = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    r1 = walk("ffi", base1, anchor1, head, **kw)
    r2 = walk("ffi", base2, anchor2, head, **kw)
    r1_again = walk("ffi", base1, anchor1, head, **kw)
    check_parity(r2, walk("reference", base2, anchor2, head, **kw), kw, label="second call")
    assert not np.array_equal(np.asarray(r1.logits), np.asarray(r2.logits))
    for a, b in zip(r1, r1_again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_many_small_calls(rng, make_head, make_base):
    """Back-to-back calls on small vocabularies (pool tasks that start after the caller took every
    chunk must not touch a finished call): same inputs, same tokens, every time."""
    heads = [make_head(rng, vocab, 256) for vocab in (2100, 3001)]  # large enough to use the pool
    f = jax.jit(lambda b, a, h: jax_markov.walk(b, a, h, impl="ffi").tokens)
    inputs = [(make_base(rng, 3, 4, h.draft_vocab), jnp.asarray(rng.integers(0, h.draft_vocab, 3), jnp.int32), h)
              for h in heads]
    first = [np.asarray(f(*x)) for x in inputs]
    for i in range(60):
        np.testing.assert_array_equal(f(*inputs[i % 2]), first[i % 2])


def test_batch_invariance(rng, make_head, make_base, walk):
    """A request's result does not depend on the other requests of the batch (same bits)."""
    batch, steps, vocab = 7, 3, 2048
    head = make_head(rng, vocab, 256)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    whole = walk("ffi", base, anchor, head, return_logits=True)
    for b in (0, 4, 6):
        alone = walk("ffi", base[b:b + 1], anchor[b:b + 1], head, return_logits=True)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(whole.tokens)[b])
        np.testing.assert_array_equal(np.asarray(alone.logits)[0].view(np.uint32),
                                      np.asarray(whole.logits)[b].view(np.uint32))


def _decode(impl, head, base_all, anchor, rounds):
    """A decode loop in lax.while_loop: each round drafts K tokens from the last round's last token."""
    def body(state):
        i, prev, out = state
        res = jax_markov.walk(base_all[i], prev, head, return_logits=False, impl=impl)
        return i + 1, res.tokens[:, -1], out.at[i].set(res.tokens)

    batch, steps = base_all.shape[1:3]
    out = jnp.zeros((rounds, batch, steps), jnp.int32)
    return lax.while_loop(lambda s: s[0] < rounds, body, (0, anchor, out))[2]


def test_while_loop_decode(rng, make_head, walk, check_parity):
    rounds, batch, steps, vocab = 4, 3, 3, 1500
    head = make_head(rng, vocab, 64)
    base_all = jnp.asarray(rng.standard_normal((rounds, batch, steps, vocab)) * 3, jnp.float32)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    f = jax.jit(_decode, static_argnums=(0, 4))
    assert "jax_markov_walk" in f.lower("ffi", head, base_all, anchor, rounds).as_text()
    got = np.asarray(f("ffi", head, base_all, anchor, rounds))
    # each round starts from the loop's own previous round: check it against the reference walk
    prev = anchor
    for i in range(rounds):
        want = walk("reference", base_all[i], prev, head, return_logits=True)
        check_parity(jax_markov.WalkResult(jnp.asarray(got[i]), None, None), want, {}, label=f"round {i}")
        prev = jnp.asarray(got[i, :, -1])


def test_vmap_head_unmapped(rng, isa, make_head, check_parity):
    """vmap over requests with one shared head: the mapped axis folds into the batch (one call)."""
    outer, batch, steps, vocab = 3, 2, 3, 1700
    head = make_head(rng, vocab, 64)
    base = jnp.asarray(rng.standard_normal((outer, batch, steps, vocab)) * 2, jnp.float32)
    anchor = jnp.asarray(rng.integers(0, vocab, (outer, batch)), jnp.int32)
    temperature = jnp.asarray(rng.choice([0.0, 0.8], (outer, batch)), jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), (outer, batch))
    position = jnp.asarray(rng.integers(0, 1000, (outer, batch)), jnp.int32)

    def one(impl, b, a, t, k, p):
        fn = reference.walk if impl == "reference" else functools.partial(jax_markov.walk, impl=impl)
        return fn(b, a, head, temperature=t, key=k, position=p, return_logits=True)

    vf = jax.jit(jax.vmap(functools.partial(one, "ffi")))
    assert vf.lower(base, anchor, temperature, keys, position).as_text().count("@jax_markov_walk(") == 1
    got = vf(base, anchor, temperature, keys, position)
    want = jax.jit(jax.vmap(functools.partial(one, "reference")))(base, anchor, temperature, keys, position)
    flat = lambda r: jax_markov.WalkResult(*(None if x is None else x.reshape(-1, *x.shape[2:]) for x in r))
    kw = dict(temperature=temperature.reshape(-1), key=keys.reshape(-1), position=position.reshape(-1),
              return_logits=True)
    check_parity(flat(got), flat(want), kw, label="vmap")


def test_vmap_head_mapped(rng, make_head, walk, check_parity):
    """vmap over heads too (a stack of 2 heads): each element walks with its own head."""
    heads, batch, steps, vocab = 2, 3, 3, 1200
    hs = [make_head(rng, vocab, 32) for _ in range(heads)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *hs)
    base = jnp.asarray(rng.standard_normal((heads, batch, steps, vocab)) * 2, jnp.float32)
    anchor = jnp.asarray(rng.integers(0, vocab, (heads, batch)), jnp.int32)
    vf = jax.jit(jax.vmap(lambda b, a, h: jax_markov.walk(b, a, h, return_logits=True, impl="ffi")))
    assert "jax_markov_walk" in vf.lower(base, anchor, stacked).as_text()
    got = vf(base, anchor, stacked)
    for i in range(heads):
        want = walk("reference", base[i], anchor[i], hs[i], return_logits=True)
        one = jax_markov.WalkResult(got.tokens[i], got.logits[i], None)
        check_parity(one, want, dict(return_logits=True), label=f"head {i}")
