"""The sampled reference walk: the law of its tokens (chi-square tests against the softmax of the
logits with the Markov bias, with the power to reject the law without it), reproducibility and
independence of its draws, greedy rows, and T = +inf (uniform among the columns that are neither
masked nor padding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jax_markov
from jax_markov import reference

P_MIN = 1e-3  # chi-square p-value threshold (fixed seeds: the outcome is deterministic)


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sampling_setup(rng, n, k, v, r, temperature, seed):
    head = jax_markov.MarkovHead(jnp.asarray(rng.normal(0, 0.5, (v, r)), jnp.float32),
                                 jnp.asarray(rng.normal(0, 0.5, (v, r)), jnp.float32))
    row = rng.normal(0, 0.7, (k, v)).astype(np.float32)
    base = jnp.broadcast_to(jnp.asarray(row), (n, k, v))
    keys = jax.random.split(jax.random.key(seed), n)
    kw = dict(temperature=jnp.full((n,), temperature, jnp.float32), key=keys,
              position=jnp.full((n,), 1000, jnp.int32))
    return head, row, base, kw


def _bias64(head, prev):
    w1, w2 = (np.asarray(w, np.float64) for w in (head.w1, head.w2))  # _sampling_setup's float32 heads
    return w2 @ w1[prev]


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampling_distribution_one_step(rng, temperature):
    n, v = 40_000, 8
    head, row, base, kw = _sampling_setup(rng, n, 1, v, 8, temperature, seed=11)
    anchor = jnp.full((n,), 5, jnp.int32)
    tokens = np.asarray(reference.walk(base, anchor, head, **kw).tokens[:, 0])
    probs = softmax64((row[0] + _bias64(head, 5)) / temperature)
    assert probs.min() * n > 20
    counts = np.bincount(tokens, minlength=v)
    p = stats.chisquare(counts, probs * n).pvalue
    assert p > P_MIN, (counts, probs * n, p)
    # the test has power: the distribution without the Markov bias is rejected
    probs_nobias = softmax64(row[0] / temperature)
    assert stats.chisquare(counts, probs_nobias * n).pvalue < 1e-6


def test_sampling_distribution_two_steps_with_markov_bias(rng):
    """Joint law of (tok_0, tok_1): p(t0) * p(t1 | t0), the second step biased by the first token."""
    n, v, t = 40_000, 6, 1.3
    head, row, base, kw = _sampling_setup(rng, n, 2, v, 8, t, seed=12)
    anchor = jnp.full((n,), 2, jnp.int32)
    tokens = np.asarray(reference.walk(base, anchor, head, **kw).tokens)
    p0 = softmax64((row[0] + _bias64(head, 2)) / t)
    joint = np.stack([p0[a] * softmax64((row[1] + _bias64(head, a)) / t) for a in range(v)])
    assert joint.min() * n > 5
    counts = np.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v)
    p = stats.chisquare(counts, joint.ravel() * n).pvalue
    assert p > P_MIN, p
    # power: the law with the bias of the anchor (not of the drafted token) at step 1 is rejected
    wrong = np.outer(p0, softmax64((row[1] + _bias64(head, 2)) / t))
    assert stats.chisquare(counts, wrong.ravel() * n).pvalue < 1e-6


def test_same_key_and_position_same_tokens(rng, make_head, make_inputs):
    b, k, v = 8, 4, 32
    head = make_head(rng, v, 8)
    inputs = make_inputs(rng, b, k, v, sampled=True)
    inputs["temperature"] = jnp.full((b,), 1.0, jnp.float32)
    first = np.asarray(reference.walk(head=head, **inputs).tokens)
    np.testing.assert_array_equal(np.asarray(reference.walk(head=head, **inputs).tokens), first)
    # a request's tokens do not depend on the rest of the batch
    for i in (0, 5):
        alone = reference.walk(head=head, **{n: x[i:i + 1] for n, x in inputs.items()})
        np.testing.assert_array_equal(np.asarray(alone.tokens[0]), first[i])
    # raw key words give the same tokens as typed keys
    raw = dict(inputs, key=jax.random.key_data(inputs["key"]))
    np.testing.assert_array_equal(np.asarray(reference.walk(head=head, **raw).tokens), first)


def test_different_position_independent_tokens(rng):
    n, v, t = 20_000, 6, 1.0
    head, row, base, kw = _sampling_setup(rng, n, 1, v, 8, t, seed=13)
    anchor = jnp.full((n,), 1, jnp.int32)
    a = np.asarray(reference.walk(base, anchor, head, **kw).tokens[:, 0])
    kw2 = dict(kw, position=kw["position"] + 17)
    c = np.asarray(reference.walk(base, anchor, head, **kw2).tokens[:, 0])
    probs = softmax64((row[0] + _bias64(head, 1)) / t)
    # both follow the law, differ where an independent draw would, and are independent of each other
    for tok in (a, c):
        assert stats.chisquare(np.bincount(tok, minlength=v), probs * n).pvalue > P_MIN
    expected_diff = 1 - (probs**2).sum()
    assert abs(np.mean(a != c) - expected_diff) < 5 * np.sqrt(expected_diff * (1 - expected_diff) / n)
    table = np.zeros((v, v))
    np.add.at(table, (a, c), 1)
    assert stats.chi2_contingency(table).pvalue > P_MIN
    # another key at the same position is also another draw
    kw3 = dict(kw, key=jax.random.split(jax.random.key(99), n))
    d = np.asarray(reference.walk(base, anchor, head, **kw3).tokens[:, 0])
    assert abs(np.mean(a != d) - expected_diff) < 5 * np.sqrt(expected_diff * (1 - expected_diff) / n)


def test_greedy_rows_ignore_key_and_position(rng, make_head, make_inputs):
    b, k, v = 6, 3, 32
    head = make_head(rng, v, 8)
    inputs = make_inputs(rng, b, k, v, sampled=True)
    inputs["temperature"] = jnp.asarray([0.0, 1.0, 0.0, -1.0, jnp.nan, 0.7], jnp.float32)  # <= 0 or NaN: greedy
    got = np.asarray(reference.walk(head=head, **inputs).tokens)
    greedy = np.asarray(reference.walk(inputs["base_logits"], inputs["anchor"], head).tokens)
    np.testing.assert_array_equal(got[[0, 2, 3, 4]], greedy[[0, 2, 3, 4]])
    other = dict(inputs, key=jax.random.split(jax.random.key(5), b), position=inputs["position"] + 100)
    np.testing.assert_array_equal(np.asarray(reference.walk(head=head, **other).tokens)[[0, 2, 3, 4]],
                                  greedy[[0, 2, 3, 4]])


def test_infinite_temperature_is_uniform_among_the_other_columns(rng):
    """n requests with their own keys: T = +inf draws uniformly among the 5 columns that are neither
    masked (-inf) nor padding, whatever their logits; T = 1 does not (the negative control)."""
    n, v = 20_000, 9
    head = jax_markov.MarkovHead(jnp.asarray(rng.normal(0, 0.5, (v, 8)), jnp.float32),
                                 jnp.asarray(rng.normal(0, 0.5, (v, 8)), jnp.float32))
    row = np.array([3.0, -np.inf, 0.0, -2.0, -np.inf, 1.0, 4.0, 9.0, 9.0], np.float32)  # 7, 8: padding
    base = jnp.broadcast_to(jnp.asarray(row), (n, 1, v))
    kw = dict(key=jax.random.split(jax.random.key(21), n), position=jnp.full((n,), 7, jnp.int32), vocab_size=7)
    anchor = jnp.zeros((n,), jnp.int32)
    tokens = np.asarray(reference.walk(base, anchor, head, temperature=jnp.full((n,), jnp.inf), **kw).tokens[:, 0])
    counts = np.bincount(tokens, minlength=v)
    assert counts[[1, 4, 7, 8]].sum() == 0
    assert stats.chisquare(counts[[0, 2, 3, 5, 6]]).pvalue > P_MIN, counts
    warm = np.asarray(reference.walk(base, anchor, head, temperature=jnp.ones((n,)), **kw).tokens[:, 0])
    assert stats.chisquare(np.bincount(warm, minlength=v)[[0, 2, 3, 5, 6]]).pvalue < 1e-6
