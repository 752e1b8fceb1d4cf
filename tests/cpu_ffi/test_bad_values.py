"""The CPU custom call on bad values, as the reference: masked (-inf) columns and T = +inf (the noise
alone decides: version 2 of the noise, on both SIMD paths), dots that overflow fp32, a NaN scale,
ids wider than int32; and the handler's own errors on buffers the Python API would have refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import native

def _window_case(rng, batch, steps, vocab):
    """Flat base logits (the noise decides), -inf outside a window of columns per row (the windows
    start anywhere, not at multiples of 4 or 8), a zero head, a sampled row per request."""
    base = np.full((batch, steps, vocab), -np.inf, np.float32)
    windows = []
    for b, k in np.ndindex(batch, steps):
        start = int(rng.integers(0, vocab - 40))
        width = int(rng.integers(1, 40))
        base[b, k, start:start + width] = 0.25
        windows.append((b, k, start, width))
    head = jax_markov.MarkovHead(jnp.asarray(rng.standard_normal((vocab, 16)), jnp.float32),
                                 jnp.zeros((vocab, 16), jnp.float32))
    return jnp.asarray(base), head, windows


@pytest.mark.parametrize("temperature", [1.0, np.inf])
def test_noise_is_version_2_and_masked_columns_are_never_sampled(rng, isa, temperature,
                                                                 make_sampling, walk, numpy_gumbel):
    """Every token is the argmax of the numpy oracle's noise (word v mod 4 of block v // 4) over its
    row's unmasked window, on both SIMD paths, at T = 1 and at T = +inf (1/T = 0: a -inf logit must
    still score -inf, not NaN)."""
    batch, steps, vocab = 6, 3, 2003
    base, head, windows = _window_case(rng, batch, steps, vocab)
    sampling = make_sampling(rng, batch, "sampled")
    sampling["temperature"] = jnp.full((batch,), temperature, jnp.float32)
    got = walk("ffi", base, jnp.zeros(batch, jnp.int32), head, **sampling)
    key = np.asarray(jax.random.key_data(sampling["key"]))
    position = np.asarray(sampling["position"]).astype(np.int64)
    for b, k, start, width in windows:
        noise = numpy_gumbel(key[b, 0], key[b, 1], np.arange(start, start + width), position[b] + k)
        assert got.tokens[b, k] == start + int(np.argmax(noise)), (b, k, start, width)
    want = walk("reference", base, jnp.zeros(batch, jnp.int32), head, **sampling)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.parametrize("mode", ["sampled", "mixed"])
def test_infinite_temperature_with_padding_and_masked_columns(rng, isa, mode,
                                                              make_head, make_base, make_sampling, compare):
    """Issue 64: T = +inf with padding (huge logits past vocab_size) and masked (-inf) columns: the
    tokens are the reference's exactly (the noise alone decides) and never padding or masked."""
    batch, steps, vocab, vocab_size = 5, 4, 1500, 1203
    head = make_head(rng, vocab, 32)
    base = np.array(make_base(rng, batch, steps, vocab))
    base[:, :, vocab_size:] = 1e4
    masked = rng.random((batch, steps, vocab)) < 0.5
    base[masked] = -np.inf
    sampling = make_sampling(rng, batch, mode)
    sampling["temperature"] = jnp.where(sampling["temperature"] > 0, jnp.inf, 0.0)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got, want = compare(jnp.asarray(base), anchor, head, vocab_size=vocab_size, return_logits=True, label="T=inf",
                        **sampling)
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(want.tokens))
    assert tokens.max() < vocab_size
    assert not masked[np.arange(batch)[:, None], np.arange(steps)[None, :], tokens].any()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("w2_dtype", [jnp.float32, jnp.int8])
def test_overflow_agrees_with_the_reference(rng, isa, batch, w2_dtype, quantize, make_base, walk):
    """Weights near 1e19 with random signs: the dots overflow in partial sums of both signs. The
    custom call gives the reference's logits: +-inf by the sign of the dot, never NaN (it gave NaN
    where its 8 lanes overflowed in opposite directions), and the same tokens."""
    vocab, rank = 1000, 256
    w1 = rng.uniform(0.5, 1.5, (vocab, rank)) * 1e19 * rng.choice([-1, 1], (vocab, rank))
    w2 = rng.uniform(0.5, 1.5, (vocab, rank)) * 1e19 * rng.choice([-1, 1], (vocab, rank))
    head = (quantize(jnp.asarray(w1, jnp.float32), w2) if w2_dtype == jnp.int8
            else jax_markov.MarkovHead(jnp.asarray(w1, jnp.float32), jnp.asarray(w2, jnp.float32)))
    base = make_base(rng, batch, 3, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got = walk("ffi", base, anchor, head, return_logits=True)
    want = walk("reference", base, anchor, head, return_logits=True)
    logits, ref = np.asarray(got.logits), np.asarray(want.logits)
    assert not np.isnan(logits).any() and np.isinf(logits).mean() > 0.5
    np.testing.assert_array_equal(np.isinf(logits), np.isinf(ref))
    np.testing.assert_array_equal(logits[np.isinf(ref)], ref[np.isinf(ref)])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_nan_scale_row_is_chosen_like_the_float_heads_nan_row(rng, isa, make_base, make_sampling, walk):
    """A NaN in W2's row 3: `quantize` under jit gives that row a NaN scale; the custom call then
    chooses column 3 at every step with the int8 head and with the float head, as the reference."""
    batch, steps, vocab = 4, 3, 1100
    w2 = (rng.standard_normal((vocab, 32)) / np.sqrt(32)).astype(np.float32)
    w2[3, 7] = np.nan
    head = jax_markov.MarkovHead(jnp.asarray(rng.standard_normal((vocab, 32)), jnp.bfloat16), jnp.asarray(w2))
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "mixed")
    for h in (head, jax.jit(jax_markov.quantize)(head)):
        np.testing.assert_array_equal(np.asarray(walk("ffi", base, anchor, h, **sampling).tokens), 3)


def test_ids_wider_than_int32_are_clamped_before_the_call(rng, make_head, make_base, make_sampling):
    """Anchors, positions and d2t values of any integer width reach the custom call clamped in their
    own width (not wrapped mod 2^32): the custom call and the reference agree on them."""
    batch, steps, vocab, v_target = 4, 3, 1200, 1500
    head = make_head(rng, vocab, 32, v_target=v_target)
    base = make_base(rng, batch, steps, vocab)
    anchor = np.array([3_000_000_000, 5, 2**32 + 3, -(2**40)], np.int64)  # NumPy int64, x64 off
    d2t = np.sort(rng.choice(v_target, vocab, replace=False)) - np.arange(vocab)
    d2t[0] = 2**32 + 3  # target id 0 + (2^31 - V): the largest id that cannot overflow
    sampling = make_sampling(rng, batch, "sampled")
    sampling["position"] = np.array([3_000_000_000, 7, 2**32 - 1, 0], np.uint32)
    base = base.at[1, 0, 0].set(1e4)  # request 1 drafts column 0 first: target id 2^31 - V
    got, want = (jax_markov.walk(base, anchor, head, d2t=d2t, return_embeds=True, impl=impl, **sampling)
                 for impl in ("ffi", "reference"))
    w1 = np.asarray(head.w1)
    for res in (got, want):
        np.testing.assert_array_equal(np.asarray(res.embeds)[:, 0], w1[[v_target - 1, 5, v_target - 1, 0]])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert got.tokens[1, 0] == 2**31 - vocab and got.embeds[1, 1].tolist() == w1[v_target - 1].tolist()
    # uint32 positions are the same counter bits as the int32 ones they wrap to
    wrapped = dict(sampling, position=jnp.asarray(sampling["position"].astype(np.int32)))
    again = jax_markov.walk(base, anchor, head, d2t=d2t, impl="ffi", **wrapped)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(got.tokens))


# ------------------------------------------------------------------------------------------------
# errors from the handler itself (shapes the Python API would have refused)


def _raw_call(base, anchor, w1, w2, scale, temperature, key, position, d2t, tiles=None, *, vocab_size, logits_shape=(0,)):
    batch, steps, _ = base.shape
    outs = (jax.ShapeDtypeStruct((batch, steps), jnp.int32), jax.ShapeDtypeStruct(logits_shape, jnp.float32),
            jax.ShapeDtypeStruct((0,), w1.dtype))
    call = jax.ffi.ffi_call(native.TARGET, outs)
    return jax.jit(lambda *a: call(*a, vocab_size=np.int64(vocab_size), logit_scale=np.float32(1.0), sampling=False))(
        base, anchor, w1, w2, scale, temperature, key, position, d2t, jnp.zeros((0,), jnp.int8) if tiles is None else tiles)


def test_handler_errors(rng, walk, check_parity):
    batch, steps, vocab, rank = 2, 2, 500, 16
    base = jnp.asarray(rng.standard_normal((batch, steps, vocab)), jnp.float32)
    anchor = jnp.zeros((batch,), jnp.int32)
    w1 = jnp.asarray(rng.standard_normal((vocab, rank)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (vocab, rank)), jnp.int8)
    scale = jnp.ones((vocab,), jnp.float32)
    t, key, pos = jnp.zeros((batch,), jnp.float32), jnp.zeros((batch, 2), jnp.uint32), jnp.zeros((batch,), jnp.int32)
    d2t = jnp.zeros((0,), jnp.int32)
    ok = _raw_call(base, anchor, w1, q, scale, t, key, pos, d2t, vocab_size=vocab)
    want = walk("reference", base, anchor, jax_markov.QuantizedMarkovHead(w1, q, scale), return_logits=True)
    check_parity(jax_markov.WalkResult(ok[0], None, None), want, {}, label="raw call")
    # Without `sampling` every row is greedy, whatever the temperature operand holds.
    hot = _raw_call(base, anchor, w1, q, scale, t + 1.0, key, pos, d2t, vocab_size=vocab)
    check_parity(jax_markov.WalkResult(hot[0], None, None), want, {}, label="raw call, sampling off")
    bad = [
        (dict(scale=jnp.ones((vocab - 1,), jnp.float32)), "w2_scale"),
        (dict(w2=q[:, :-1]), "w2 must be"),
        (dict(anchor=jnp.zeros((batch + 1,), jnp.int32)), "anchor"),
        (dict(d2t=jnp.zeros((3,), jnp.int32)), "d2t"),
        (dict(tiles=jnp.zeros((8, 64 * rank), jnp.int8)), r"w2_tiles must be s8 \[ceil\(V / 64\), 16384\]"),
        (dict(tiles=jnp.zeros((0,), jnp.uint8)), "w2_tiles"),
        (dict(vocab_size=vocab + 1), "vocab_size"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(logits_shape=(batch, steps, vocab + 1)), "logits"),
    ]
    args = dict(base=base, anchor=anchor, w1=w1, w2=q, scale=scale, temperature=t, key=key, position=pos, d2t=d2t)
    for change, message in bad:
        kw = dict(args, vocab_size=vocab)
        kw.update(change)
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(_raw_call(**kw))
