"""The CPU custom call against the reference, by the parity rules of conftest.py: shapes, greedy,
sampled and mixed rows, every dtype, exact ties, NaN rows, padding, d2t, logit_scale, anchors,
embeds, the released head's vocabulary; and the parity check's own NumPy quantize and noise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import native
from jax_markov.philox import gumbel_noise

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def test_cpu_module_is_built(REQUIRE_NATIVE):
    """Fails loudly when CI asks for the native module and it is missing."""
    if not native.cpu_available():
        if REQUIRE_NATIVE:
            pytest.fail("JAX_MARKOV_REQUIRE_NATIVE=1 but jax_markov._markov_cpu is not importable: the CPU custom "
                        "call was not built (pip install . must compile ffi/cpu/)")
        pytest.skip("jax_markov._markov_cpu is not built")
    assert callable(native._markov_cpu.handler)
    assert native._markov_cpu.isa() in ("avx2", "generic")


# ------------------------------------------------------------------------------------------------
# the parity check's own pieces


def test_numpy_quantize_matches(rng, quantize):
    w2 = rng.standard_normal((300, 40)).astype(np.float32)
    w2[7] = 0.0
    w1 = jnp.asarray(rng.standard_normal((300, 40)), jnp.bfloat16)
    want, got = jax_markov.quantize(jax_markov.MarkovHead(w1, jnp.asarray(w2))), quantize(w1, w2)
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_array_equal(got.scale, want.scale)


def test_numpy_gumbel_matches_jax(rng, numpy_gumbel):
    key = rng.integers(0, 2**32, 2, dtype=np.uint32)
    v, pos = np.arange(3000, dtype=np.uint32), np.uint32(rng.integers(0, 2**31))
    want = np.asarray(gumbel_noise((key[0], key[1]), v, pos))
    np.testing.assert_allclose(numpy_gumbel(key[0], key[1], v, pos), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("batch,steps,vocab,rank", [
    (1, 1, 1000, 256), (1, 7, 4099, 256), (2, 3, 1001, 64), (3, 4, 2003, 256), (5, 2, 1777, 100),
    (7, 5, 3001, 24), (16, 3, 2500, 256), (4, 3, 999, 5), (33, 2, 1203, 40),
])
@pytest.mark.parametrize("w2_dtype", [jnp.int8, jnp.bfloat16])
def test_greedy_shapes(rng, isa, batch, steps, vocab, rank, w2_dtype, make_head, make_base, compare):
    head = make_head(rng, vocab, rank, w2_dtype=w2_dtype)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, return_logits=True, return_embeds=True, label=f"{isa} B={batch} K={steps} V={vocab}")


@pytest.mark.parametrize("mode", ["sampled", "mixed"])
@pytest.mark.parametrize("batch,steps,vocab", [(1, 3, 1000), (4, 4, 2999), (9, 2, 1500)])
def test_sampled_and_mixed(rng, isa, mode, batch, steps, vocab, make_head, make_base, make_sampling, compare):
    head = make_head(rng, vocab, 256)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, return_logits=True, return_embeds=True, label=f"{isa} {mode}",
            **make_sampling(rng, batch, mode))


def test_sampled_peaked_logits(rng, make_head, make_base, make_sampling, compare):
    """Sharp distributions (where most noise is never computed) and a very low temperature."""
    batch, steps, vocab = 6, 4, 4001
    head = make_head(rng, vocab, 128)
    base = make_base(rng, batch, steps, vocab, scale=30.0)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "sampled")
    sampling["temperature"] = jnp.asarray([0.01, 0.5, 1.0, 5.0, 100.0, 1e-6], jnp.float32)
    compare(base, anchor, head, return_logits=True, label="peaked", **sampling)


def test_sampling_is_reproducible(rng, make_head, make_base, make_sampling, walk):
    """Same key and position, same tokens; another key, other tokens."""
    batch, steps, vocab = 4, 5, 3000
    head = make_head(rng, vocab, 64)
    base = make_base(rng, batch, steps, vocab, scale=0.1)  # flat: the noise decides
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "sampled")
    a = walk("ffi", base, anchor, head, **sampling).tokens
    b = walk("ffi", base, anchor, head, **sampling).tokens
    np.testing.assert_array_equal(a, b)
    other = dict(sampling, key=jax.random.split(jax.random.key(int(rng.integers(2**31)) + 1), batch))
    c = walk("ffi", base, anchor, head, **other).tokens
    assert not np.array_equal(a, c)
    moved = dict(sampling, position=sampling["position"] + 1)
    assert not np.array_equal(a, walk("ffi", base, anchor, head, **moved).tokens)


_DTYPE_CASES = [(b, w2, lg, FLOATS[(i + j + m) % 3], "mixed" if (i + m) % 3 == 0 else "greedy")
                for i, b in enumerate(FLOATS)
                for j, w2 in enumerate((jnp.int8,) + FLOATS)
                for m, lg in enumerate(FLOATS)]


@pytest.mark.parametrize("base_dtype,w2_dtype,logits_dtype,w1_dtype,mode", _DTYPE_CASES,
                         ids=[f"base_{jnp.dtype(b).name}-w2_{jnp.dtype(w).name}-logits_{jnp.dtype(l).name}-"
                              f"w1_{jnp.dtype(e).name}-{mode}" for b, w, l, e, mode in _DTYPE_CASES])
def test_dtypes(rng, base_dtype, w2_dtype, logits_dtype, w1_dtype, mode, make_head, make_base, make_sampling, compare):
    """Every base / W2 / logits dtype combination (36); each W1 dtype meets every W2 dtype, and every
    W2 dtype meets sampled rows with every logits dtype."""
    batch, steps, vocab = 4, 3, 1237
    head = make_head(rng, vocab, 48, w1_dtype=w1_dtype, w2_dtype=w2_dtype)
    base = make_base(rng, batch, steps, vocab, dtype=base_dtype)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got, _ = compare(base, anchor, head, return_logits=True, logits_dtype=logits_dtype, return_embeds=True,
                     label="dtypes", **make_sampling(rng, batch, mode))
    assert got.logits.dtype == jnp.dtype(logits_dtype)
    assert got.embeds.dtype == jnp.dtype(w1_dtype)


@pytest.mark.parametrize("logits_dtype", FLOATS)
def test_exact_ties(rng, isa, logits_dtype, quantize, compare):
    """Columns built to tie exactly at the top: the lowest index wins, on every path and dtype."""
    batch, steps, vocab, rank = 6, 3, 2000, 32
    w1 = rng.standard_normal((vocab, rank)).astype(np.float32)
    w2 = (rng.standard_normal((vocab, rank)) / np.sqrt(rank)).astype(np.float32)
    base = rng.standard_normal((batch, steps, vocab)).astype(np.float32)
    tied = np.sort(rng.choice(vocab, size=(batch, 3), replace=False).reshape(batch, 3), axis=1)  # disjoint
    for b, cols in enumerate(tied):
        for c in cols[1:]:
            w2[c] = w2[cols[0]]
        base[b, :, cols] = 40.0  # far above everything else
    head = quantize(jnp.asarray(w1, jnp.bfloat16), w2)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got, want = compare(jnp.asarray(base), anchor, head, return_logits=True, logits_dtype=logits_dtype,
                        label="ties")
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(want.tokens))
    for b in range(batch):
        assert np.all(tokens[b] == tied[b][0]), (b, tokens[b], tied[b])


def test_ties_signed_zero_and_inf(rng, isa, quantize, compare):
    """-0 ties with +0, +inf ties with +inf: the lowest index wins."""
    batch, steps, vocab = 3, 2, 1500
    head = quantize(jnp.asarray(rng.standard_normal((vocab, 16)), jnp.float32),
                    rng.standard_normal((vocab, 16)) * 0.1)
    base = (-100.0 - rng.random((batch, steps, vocab))).astype(np.float32)
    base[0, :, [200, 700, 900]] = np.inf
    base[1, :, 300] = -0.0
    base[1, :, 301] = 0.0
    got, want = compare(jnp.asarray(base), jnp.zeros(batch, jnp.int32), head, return_logits=True,
                        logit_scale=0.0, label="zero/inf")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert np.all(np.asarray(got.tokens)[0] == 200) and np.all(np.asarray(got.tokens)[1] == 300)


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_nan_rows(rng, isa, mode, make_head, make_sampling, compare):
    """A NaN counts as the largest value and the first NaN wins (as jnp.argmax), sampled rows too."""
    batch, steps, vocab = 4, 3, 2100
    head = make_head(rng, vocab, 64)
    base = (rng.standard_normal((batch, steps, vocab)) * 2).astype(np.float32)
    base[0, :, :] = np.nan  # a whole NaN row: token 0
    base[1, 1, [1500, 77, 1900]] = np.nan  # first NaN at 77
    base[2, 0, vocab - 1] = np.nan  # the very last column
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got, want = compare(jnp.asarray(base), anchor, head, return_logits=True, label="nan",
                        **make_sampling(rng, batch, mode))
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(want.tokens))
    assert np.all(tokens[0] == 0) and tokens[1, 1] == 77 and tokens[2, 0] == vocab - 1


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
@pytest.mark.parametrize("vocab,vocab_size", [(1000, 999), (3001, 2048), (1024, 1), (2000, 7)])
def test_padding(rng, isa, mode, vocab, vocab_size, make_head, make_base, make_sampling, compare):
    """Columns >= vocab_size read -inf and are never chosen, even with the largest base logits."""
    batch, steps = 5, 3
    head = make_head(rng, vocab, 40)
    base = make_base(rng, batch, steps, vocab)
    base = base.at[:, :, vocab_size:].set(1e4)  # tempting padding
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got, _ = compare(base, anchor, head, vocab_size=vocab_size, return_logits=True, label="padding",
                     **make_sampling(rng, batch, mode))
    assert np.all(np.asarray(got.tokens) < vocab_size)
    assert np.all(np.asarray(got.logits)[:, :, vocab_size:] == -np.inf)


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_d2t(rng, isa, mode, make_head, make_base, make_sampling, compare):
    """A reduced draft vocabulary: tokens are target ids, and prev indexes W1 by target id."""
    batch, steps, vocab, v_target = 5, 4, 1500, 6007
    head = make_head(rng, vocab, 64, v_target=v_target, w1_scale=3.0)
    targets = np.sort(rng.choice(v_target, size=vocab, replace=False))
    d2t = jnp.asarray(targets - np.arange(vocab), jnp.int32)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, v_target, batch), jnp.int32)
    got, _ = compare(base, anchor, head, d2t=d2t, return_logits=True, return_embeds=True, label="d2t",
                     **make_sampling(rng, batch, mode))
    assert np.all(np.isin(np.asarray(got.tokens), targets))


@pytest.mark.parametrize("logit_scale", [0.0, -1.5, 0.37, 4.0])
def test_logit_scale(rng, isa, logit_scale, make_head, make_base, make_sampling, compare):
    batch, steps, vocab = 4, 4, 1800
    head = make_head(rng, vocab, 96, w2_dtype=jnp.float32)
    base = make_base(rng, batch, steps, vocab, scale=0.5)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, logit_scale=logit_scale, return_logits=True, return_embeds=True, label="scale",
            **make_sampling(rng, batch, "mixed"))


def test_anchor_clamped(rng, isa, make_head, make_base, compare):
    """Anchor ids outside [0, V_target) are clamped, never read out of bounds."""
    batch, steps, vocab = 5, 2, 1300
    head = make_head(rng, vocab, 32)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray([-1, -(2**31), vocab, vocab + 12345, 2**31 - 1], jnp.int32)
    got, _ = compare(base, anchor, head, return_embeds=True, label="clamp")
    w1 = np.asarray(head.w1)
    np.testing.assert_array_equal(np.asarray(got.embeds)[:, 0], w1[[0, 0, vocab - 1, vocab - 1, vocab - 1]])


def test_embeds_follow_tokens(rng, make_head, make_base, walk):
    """embeds[b, k] = W1[prev_k] exactly: the anchor, then the tokens."""
    batch, steps, vocab = 3, 5, 2222
    head = make_head(rng, vocab, 80, w1_dtype=jnp.float16, w2_dtype=jnp.float16)
    base = make_base(rng, batch, steps, vocab, dtype=jnp.float16)
    anchor = np.asarray(rng.integers(0, vocab, batch), np.int32)
    got = walk("ffi", base, jnp.asarray(anchor), head, return_embeds=True)
    prev = np.concatenate([anchor[:, None], np.asarray(got.tokens)[:, :-1]], axis=1)
    np.testing.assert_array_equal(np.asarray(got.embeds), np.asarray(head.w1)[prev])


def test_large_vocab(rng, make_head, make_base, make_sampling, compare):
    """The released head's shape: V = 151936, r = 256 (int8), with logits, embeds, mixed rows."""
    batch, steps, vocab = 2, 3, 151936
    head = make_head(rng, vocab, 256)
    base = make_base(rng, batch, steps, vocab, dtype=jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "sampled")
    sampling["temperature"] = sampling["temperature"].at[0].set(0.0)
    compare(base, anchor, head, return_logits=True, logits_dtype=jnp.bfloat16, return_embeds=True,
            vocab_size=vocab - 100, label="V=151936", **sampling)
