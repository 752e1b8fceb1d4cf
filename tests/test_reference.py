"""jax_markov.reference.walk (and jax_markov.philox) against an independent, loop-based NumPy reading of
docs/spec.md.

The oracle below shares no code with the package: its own Philox4x32-10 in Python ints, its own
Gumbel noise, a loop over requests, steps and vocabulary in float32 NumPy arithmetic, int8 heads
dequantized as q * scale.

Tolerances (docs/spec.md "Numerics and parity"): tokens must be equal, except where the oracle's best
score and its score of the other token differ by at most TOL + RTOL * |best| (near-ties; the rest
of such a request is not compared because it walks from another token), with at most one such
request per case. TOL = 1e-4 and RTOL = 1e-5 for float32 logits; when the logits are rounded to
bfloat16 / float16 before choosing, RTOL = 2^-6 / 2^-9 (one ulp of the rounded logit times 1/T <= 2).
Logits: float32 rtol 1e-5 atol 1e-4; bfloat16 rtol 2^-7 atol 1e-3; float16 rtol 2^-10 atol 1e-3
(one ulp of the stored dtype). Embeddings: exactly equal.

The sampling law, quantize and the compiled walk's memory have files of their own (test_sampling.py,
test_quantize.py, test_reference_memory.py).
"""
from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_markov
from jax_markov import philox, reference

# ---------------------------------------------------------------------------------------------
# The independent oracle
# ---------------------------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF


def philox_py(counter, key):
    """Philox4x32-10 (Random123) in Python ints."""
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    k0, k1 = (int(k) & MASK32 for k in key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def uniform_py(x):
    return np.float32((x >> 9) + 0.5) * np.float32(2.0**-23)  # both factors exact in fp32


def gumbel_py(k0, k1, v, position):
    """docs/spec.md's g(v) (version 2): word v mod 4 of the block at counter (v // 4, position, 0x40000000, 0)."""
    x = philox_py((int(v) // 4, position, 0x40000000, 0), (k0, k1))[int(v) % 4]
    u = uniform_py(x)
    return -np.log(-np.log(u))  # float32 throughout


NP_DTYPES = {jnp.dtype(jnp.float32): np.float32, jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16,
             jnp.dtype(jnp.float16): np.float16}


def round_to(x, dtype):
    return np.asarray(x, np.float32).astype(NP_DTYPES[jnp.dtype(dtype)]).astype(np.float32)


def head_f32(head):
    """(W1, W2) as float32 NumPy arrays; an int8 W2 dequantized as q * scale (docs/spec.md)."""
    w1 = np.array(head.w1.astype(jnp.float32))
    if isinstance(head, jax_markov.QuantizedMarkovHead):
        q = np.asarray(head.q).astype(np.float32)
        w2 = q * np.asarray(head.scale, np.float32)[:, None]
    else:
        w2 = np.asarray(head.w2.astype(jnp.float32))
    return w1, w2


def oracle_walk(base_logits, anchor, head, *, temperature=None, key=None, position=None, vocab_size=None,
                logit_scale=1.0, d2t=None, logits_dtype=jnp.float32):
    """docs/spec.md, one request, one step, one column at a time. Returns dict(tokens [B, K] int64,
    logits [B, K, V] f32 (rounded to logits_dtype), scores [B, K, V] f32, embeds [B, K, r] f32)."""
    base = np.asarray(jnp.asarray(base_logits).astype(jnp.float32))
    batch, steps, vocab = base.shape
    w1, w2 = head_f32(head)
    v_target, rank = w1.shape
    vocab_size = vocab if vocab_size is None else vocab_size
    anchor = np.asarray(anchor).astype(np.int64)
    if temperature is None:
        temperature = np.zeros(batch, np.float32)
        key_words = np.zeros((batch, 2), np.uint32)
        position = np.zeros(batch, np.int64)
    else:
        temperature = np.broadcast_to(np.asarray(temperature, np.float32), (batch,))
        key_words = np.asarray(jax.random.key_data(key)) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) \
            else np.asarray(key)
        position = np.broadcast_to(np.asarray(position).astype(np.int64), (batch,))
    d2t = None if d2t is None else np.asarray(d2t).astype(np.int64)
    scale = np.float32(logit_scale)

    tokens = np.zeros((batch, steps), np.int64)
    logits = np.zeros((batch, steps, vocab), np.float32)
    scores = np.zeros((batch, steps, vocab), np.float32)
    embeds = np.zeros((batch, steps, rank), np.float32)
    for b in range(batch):
        prev = int(anchor[b])
        t = np.float32(temperature[b])
        sampled = bool(t > 0)
        inv_t = np.float32(1.0) / t if sampled else None
        for k in range(steps):
            e = w1[min(max(prev, 0), v_target - 1)]
            embeds[b, k] = e
            row = np.empty(vocab, np.float32)
            for v in range(vocab):
                if v >= vocab_size:
                    row[v] = -np.inf
                else:
                    bias = scale * np.dot(w2[v], e)  # float32 accumulation
                    row[v] = np.float32(base[b, k, v]) + np.float32(bias)
            row = round_to(row, logits_dtype)  # rounded *before* choosing
            logits[b, k] = row
            best, tok = None, None
            for v in range(vocab):
                s = row[v]
                if sampled and s != -np.inf:  # a -inf logit scores -inf, even where 1/T is 0
                    s = np.float32(s * inv_t) + gumbel_py(key_words[b, 0], key_words[b, 1], v, position[b] + k)
                scores[b, k, v] = s
                if best is None:
                    best, tok = s, v
                elif np.isnan(best):
                    continue  # the first NaN wins
                elif np.isnan(s) or s > best:  # strict: the lowest index wins ties (-0 == +0)
                    best, tok = s, v
            if d2t is not None:
                tok = tok + int(d2t[tok])
            tokens[b, k] = tok
            prev = tok
    return dict(tokens=tokens, logits=logits, scores=scores, embeds=embeds)


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------

TOKEN_RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2.0**-6, jnp.dtype(jnp.float16): 2.0**-9}
LOGIT_TOL = {jnp.dtype(jnp.float32): (1e-5, 1e-4), jnp.dtype(jnp.bfloat16): (2.0**-7, 1e-3),
             jnp.dtype(jnp.float16): (2.0**-10, 1e-3)}  # (rtol, atol)


def walk_both(base_logits, anchor, head, check, *, return_logits=True, return_embeds=True, **kw):
    """Runs reference.walk and the oracle on the same inputs and compares them; returns both."""
    got = reference.walk(base_logits, anchor, head, return_logits=return_logits,
                         return_embeds=return_embeds, **kw)
    want = oracle_walk(base_logits, anchor, head, **kw)
    logits_dtype = jnp.dtype(kw.get("logits_dtype", jnp.float32)) if return_logits else jnp.dtype(jnp.float32)
    assert got.tokens.dtype == jnp.int32 and got.tokens.shape == want["tokens"].shape
    mismatches, mask = check(want["scores"], want["tokens"], got.tokens, 1e-4, rtol=TOKEN_RTOL[logits_dtype],
                             d2t=kw.get("d2t"), max_mismatch_rows=1)
    if mismatches:  # allowed (docs/spec.md), but shown in pytest's warnings summary with its count
        warnings.warn(f"reference vs oracle: {mismatches} request(s) differ at a near-tie", stacklevel=2)
    if return_logits:
        assert got.logits.dtype == logits_dtype and got.logits.shape == want["logits"].shape
        rtol, atol = LOGIT_TOL[logits_dtype]
        np.testing.assert_allclose(np.asarray(got.logits.astype(jnp.float32))[mask], want["logits"][mask],
                                   rtol=rtol, atol=atol, equal_nan=True)
    else:
        assert got.logits is None
    if return_embeds:
        assert got.embeds.dtype == head.w1.dtype
        np.testing.assert_array_equal(np.asarray(got.embeds.astype(jnp.float32))[mask], want["embeds"][mask])
    else:
        assert got.embeds is None
    return got, want


# ---------------------------------------------------------------------------------------------
# Philox and Gumbel
# ---------------------------------------------------------------------------------------------

KAT = [  # Random123 kat_vectors, philox4x32 10 rounds: counter, key, result
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = philox.philox4x32_10(tuple(np.uint32(c) for c in counter), tuple(np.uint32(k) for k in key))
    assert tuple(int(x) for x in got) == expected
    assert philox_py(counter, key) == expected  # the oracle's own Philox


def test_philox_and_gumbel_match_python_ints(rng):
    n = 64
    ctr = rng.integers(0, 2**32, (4, n), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 2**32, (2, n), dtype=np.uint64).astype(np.uint32)
    got = np.stack([np.asarray(w) for w in philox.philox4x32_10(tuple(ctr), tuple(key))])
    want = np.array([philox_py(ctr[:, i], key[:, i]) for i in range(n)], np.uint32).T
    np.testing.assert_array_equal(got, want)

    # u is exact and never 0 or 1, including at the extremes of the 32-bit word
    x = np.array([0, 1, 511, 512, 2**31, MASK32 - 511, MASK32], np.uint32)
    u = np.asarray(philox.uniform_from_bits(jnp.asarray(x)))
    np.testing.assert_array_equal(u, np.array([uniform_py(int(v)) for v in x], np.float32))
    assert u.min() > 0 and u.max() < 1 and u[0] == np.float32(2.0**-24) and u[-1] == np.float32(1 - 2.0**-24)

    v = rng.integers(0, 50_000, n)
    pos = rng.integers(0, 2**31, n)
    g = np.asarray(philox.gumbel_noise((jnp.asarray(key[0]), jnp.asarray(key[1])), jnp.asarray(v, jnp.int32),
                                       jnp.asarray(pos, jnp.int32)))
    want_g = np.array([gumbel_py(key[0, i], key[1, i], v[i], pos[i]) for i in range(n)], np.float32)
    np.testing.assert_allclose(g, want_g, rtol=1e-6, atol=1e-6)


V1_WORD0 = lambda k0, k1, v, pos: philox_py((v, pos, 0x40000000, 0), (k0, k1))[0]  # version 1 of the noise


@pytest.mark.parametrize("start,count", [(0, 64), (1, 9), (2, 3), (3, 14), (4097, 30)])
def test_draft_noise_is_word_v_mod_4_of_block_v_div_4(rng, start, count):
    """Version 2 of the draft noise against the Python-int oracle, for any first column (a multiple
    of 4 or not): per column (gumbel_noise), for a static range (the reference's) and for a traced
    start (a vocabulary shard's first global column)."""
    k0, k1, pos = (int(x) for x in rng.integers(0, 2**32, 3, dtype=np.uint64))
    columns = np.arange(start, start + count)
    want = np.array([gumbel_py(k0, k1, v, pos) for v in columns], np.float32)
    key = (jnp.uint32(k0), jnp.uint32(k1))
    per_column = philox.gumbel_noise(key, jnp.asarray(columns, jnp.int32), jnp.uint32(pos))
    static = philox.gumbel_noise_range(key, start, count, jnp.uint32(pos))
    traced = jax.jit(lambda s: philox.gumbel_noise_range(key, s, count, jnp.uint32(pos)))(jnp.int32(start))
    for got in (per_column, static, traced):
        assert got.shape == (count,) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # the test tells the word order apart: version 1 (word 0 of block v) and a reversed word order differ
    u_of = lambda x: -np.log(-np.log(uniform_py(x)))
    v1 = np.array([u_of(V1_WORD0(k0, k1, v, pos)) for v in columns], np.float32)
    reversed_words = np.array([u_of(philox_py((v // 4, pos, 0x40000000, 0), (k0, k1))[3 - v % 4]) for v in columns],
                              np.float32)
    for wrong in (v1, reversed_words):
        assert np.mean(np.isclose(wrong, want, rtol=1e-6, atol=1e-6)) < 0.5


def test_draft_noise_range_broadcasts_keys_and_positions(rng):
    """[B, K] keys and positions give [B, K, count] noise, each row its own (key, position) stream."""
    keys = rng.integers(0, 2**32, (3, 1, 2), dtype=np.uint64).astype(np.uint32)
    pos = rng.integers(0, 2**31, (3, 1)) + np.arange(4)
    got = np.asarray(philox.gumbel_noise_range((jnp.asarray(keys[..., 0]), jnp.asarray(keys[..., 1])), 6, 7,
                                               jnp.asarray(pos, jnp.int32)))
    assert got.shape == (3, 4, 7)
    for b, k in itertools.product(range(3), range(4)):
        want = [gumbel_py(keys[b, 0, 0], keys[b, 0, 1], v, pos[b, k]) for v in range(6, 13)]
        np.testing.assert_allclose(got[b, k], want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The walk against the oracle
# ---------------------------------------------------------------------------------------------

FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]
W2_TYPES = FLOATS + ["int8"]
# Every base dtype with every W2 type; for each W2 type, W1 and logits_dtype take every value too
# (a covering set of the 3 x 3 x 4 x 3 product: one compile per case keeps the file fast).
DTYPE_CASES = [(FLOATS[ib], FLOATS[(ib + iw) % 3], W2_TYPES[iw], FLOATS[(ib + 2 * iw) % 3], (ib + iw) % 3 != 1)
               for ib, iw in itertools.product(range(3), range(4))]


def _name(d):
    return d if isinstance(d, str) else jnp.dtype(d).name


@pytest.mark.parametrize("base_dtype,w1_dtype,w2_dtype,logits_dtype,sampled", DTYPE_CASES,
                         ids=[f"base_{_name(a)}-w1_{_name(b)}-w2_{_name(c)}-logits_{_name(d)}-{'mixed' if e else 'greedy'}"
                              for a, b, c, d, e in DTYPE_CASES])
def test_walk_matches_oracle_every_dtype(rng, make_head, make_inputs, assert_tokens_match,
                                         base_dtype, w1_dtype, w2_dtype, logits_dtype, sampled):
    b, k, v, r = 6, 3, 40, 16
    head = make_head(rng, v, r, w1_dtype=w1_dtype, w2_dtype=w2_dtype)
    inputs = make_inputs(rng, b, k, v, dtype=base_dtype, sampled=sampled)
    got, want = walk_both(head=head, check=assert_tokens_match, logits_dtype=logits_dtype, **inputs)
    # the oracle's logits really carry the Markov bias (so the comparison above checks it)
    bias = want["logits"] - np.asarray(inputs["base_logits"].astype(jnp.float32))
    assert np.abs(bias).mean() > 0.3


def test_walk_f32_logits_without_rounding(rng, make_head, make_inputs, assert_tokens_match):
    """return_logits=False: no rounding, the float32 l_k is chosen from."""
    head = make_head(rng, 33, 8, w1_dtype=jnp.float32, w2_dtype=jnp.float32)
    inputs = make_inputs(rng, 7, 4, 33, sampled=True)
    walk_both(head=head, check=assert_tokens_match, return_logits=False, return_embeds=False, **inputs)


@pytest.mark.parametrize("w2_dtype", [jnp.bfloat16, "int8"])
def test_exact_ties_lowest_index_wins(rng, make_head, make_inputs, assert_tokens_match, w2_dtype):
    b, k, v, r = 5, 3, 32, 8
    head = make_head(rng, v, r, w2_dtype=jnp.float32)
    w2 = np.array(head.w2)
    tied = [(4, 9, 30), (2, 17), (11, 12, 13)]  # per step: columns with identical rows and base logits
    for cols in tied:
        w2[list(cols)] = w2[cols[0]]
    head = jax_markov.MarkovHead(head.w1, jnp.asarray(w2, jnp.float32 if w2_dtype == "int8" else w2_dtype))
    if w2_dtype == "int8":
        head = jax_markov.quantize(head)
    inputs = make_inputs(rng, b, k, v)
    base = np.array(inputs["base_logits"])
    for step, cols in enumerate(tied):
        base[:, step, list(cols)] = 40.0  # far above everything else: the tied columns are the maximum
    inputs["base_logits"] = jnp.asarray(base)
    got, want = walk_both(head=head, check=assert_tokens_match, **inputs)
    np.testing.assert_array_equal(np.asarray(got.tokens), want["tokens"])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.broadcast_to([c[0] for c in tied], (b, k)))
    logits = np.asarray(got.logits)
    for step, cols in enumerate(tied):  # a real tie, not a near one
        assert np.all(logits[:, step, list(cols)] == logits[:, step, cols[:1]])


def test_nan_first_nan_wins(rng, make_head, make_inputs, assert_tokens_match):
    b, k, v, r = 6, 3, 24, 8
    head = make_head(rng, v, r)
    inputs = make_inputs(rng, b, k, v, sampled=True)  # rows 0 and 3 greedy, the others sampled
    inputs["anchor"] = jnp.asarray(rng.integers(4, v, b), jnp.int32)  # not 3 (see the W1 NaN below)
    base = np.array(inputs["base_logits"])
    base[:, 0, [7, 3, 19]] = np.nan  # step 0: first NaN is column 3, for greedy and sampled rows
    base[1, 1, :] = np.nan  # all NaN: column 0
    base[3, 2, [21, 5]] = np.nan
    inputs["base_logits"] = jnp.asarray(base)
    got, want = walk_both(head=head, check=assert_tokens_match, **inputs)
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens, want["tokens"])
    assert np.all(tokens[:, 0] == 3) and tokens[1, 1] == 0 and tokens[3, 2] == 5
    assert np.isnan(np.asarray(got.logits)[:, 0, [3, 7, 19]]).all()

    # a NaN in W1 poisons every column of the step after the token whose row it is
    w1 = np.array(head.w1.astype(jnp.float32))
    w1[tokens[2, 0], 1] = np.nan
    head2 = jax_markov.MarkovHead(jnp.asarray(w1, jnp.bfloat16), head.w2)
    got2, want2 = walk_both(head=head2, check=assert_tokens_match, **inputs)
    np.testing.assert_array_equal(np.asarray(got2.tokens), want2["tokens"])
    assert got2.tokens[2, 1] == 0 and np.isnan(np.asarray(got2.logits)[2, 1]).all()


def test_signed_zeros_tie(rng, make_head, assert_tokens_match):
    """-0 and +0 compare equal: the lower column wins whichever sign it has."""
    b, k, v, r = 4, 2, 12, 8
    head = make_head(rng, v, r, w2_dtype=jnp.float32)
    w2 = np.array(head.w2)
    w2[[1, 2, 4, 6]] = 0.0  # bias exactly +0 there
    head = jax_markov.MarkovHead(head.w1, jnp.asarray(w2))
    base = -rng.uniform(20.0, 30.0, (b, k, v)).astype(np.float32)
    base[:, 0, 2], base[:, 0, 6] = -0.0, 0.0
    base[:, 1, 1], base[:, 1, 4] = 0.0, -0.0
    anchor = jnp.asarray(rng.integers(0, v, b), jnp.int32)
    for logit_scale in (1.0, 0.0, -1.0):
        # logit_scale 0 * a negative dot product is -0: every column gets a signed zero added
        got, want = walk_both(jnp.asarray(base), anchor, head, assert_tokens_match, logit_scale=logit_scale)
        np.testing.assert_array_equal(np.asarray(got.tokens), want["tokens"])
        np.testing.assert_array_equal(np.asarray(got.tokens), np.broadcast_to([2, 1], (b, k)))


@pytest.mark.parametrize("vocab_size", [1, 29])
def test_padding_never_chosen(rng, make_head, make_inputs, assert_tokens_match, vocab_size):
    b, k, v, r = 6, 3, 48, 8
    head = make_head(rng, v, r, w2_dtype="int8")
    inputs = make_inputs(rng, b, k, v, sampled=True)
    base = np.array(inputs["base_logits"])
    base[:, :, vocab_size:] = 1e4  # would win everywhere if it were not padding
    inputs["base_logits"] = jnp.asarray(base)
    got, want = walk_both(head=head, check=assert_tokens_match, vocab_size=vocab_size, **inputs)
    tokens = np.asarray(got.tokens)
    assert tokens.max() < vocab_size
    assert np.all(np.asarray(got.logits)[:, :, vocab_size:] == -np.inf)
    assert np.isfinite(np.asarray(got.logits)[:, :, :vocab_size]).all()
    if vocab_size == 1:
        assert not tokens.any()


def test_d2t_target_ids_fed_back(rng, make_head, make_inputs, assert_tokens_match):
    b, k, v, vt, r = 6, 4, 24, 61, 8
    head = make_head(rng, v, r, v_target=vt, w1_dtype=jnp.float32, w2_dtype=jnp.bfloat16)
    assert head.w1.shape == (vt, r)
    targets = np.sort(rng.choice(vt, v, replace=False))
    targets[-1] = vt + 5  # one draft id maps outside the target vocabulary: returned as is, clamped when fed back
    d2t = jnp.asarray(targets - np.arange(v), jnp.int32)
    inputs = make_inputs(rng, b, k, v, v_target=vt, sampled=True)
    base = np.array(inputs["base_logits"])
    base[0, 1, v - 1] = 50.0  # request 0 drafts the out-of-range id at step 1
    inputs["base_logits"] = jnp.asarray(base)
    got, want = walk_both(head=head, check=assert_tokens_match, d2t=d2t, **inputs)
    tokens = np.asarray(got.tokens)
    assert np.isin(tokens, targets).all() and tokens[0, 1] == vt + 5
    embeds = np.asarray(got.embeds)
    w1 = np.asarray(head.w1)
    np.testing.assert_array_equal(embeds[:, 1:], w1[np.clip(tokens[:, :-1], 0, vt - 1)])
    np.testing.assert_array_equal(embeds[:, 0], w1[np.asarray(inputs["anchor"])])
    assert (tokens >= v).any()  # target ids beyond the draft vocabulary really are returned and fed back


@pytest.mark.parametrize("logit_scale", [-1.5, 3.0])
def test_logit_scale(rng, make_head, make_inputs, assert_tokens_match, logit_scale):
    head = make_head(rng, 30, 8, w2_dtype=jnp.float16)
    inputs = make_inputs(rng, 6, 3, 30, sampled=True)
    got, want = walk_both(head=head, check=assert_tokens_match, logit_scale=logit_scale, **inputs)
    one = reference.walk(head=head, return_logits=True, return_embeds=True, **inputs)
    # l - base is linear in logit_scale (same embeddings where the tokens agree)
    same = np.asarray(one.embeds == got.embeds).all(axis=-1)
    assert same[:, 0].all()
    base = np.array(inputs["base_logits"])
    delta_s = (np.asarray(got.logits) - base)[same]
    delta_1 = (np.asarray(one.logits) - base)[same]
    np.testing.assert_allclose(delta_s, logit_scale * delta_1, rtol=1e-4, atol=1e-4)


def test_anchor_out_of_range_is_clamped(rng, make_head, make_inputs, assert_tokens_match):
    v, vt, r = 20, 33, 8
    head = make_head(rng, v, r, v_target=vt)
    anchor = jnp.asarray([-7, vt, vt + 100, 2**31 - 1, -(2**31), 0, vt - 1], jnp.int32)
    inputs = make_inputs(rng, anchor.shape[0], 3, v, v_target=vt, sampled=True)
    inputs["anchor"] = anchor
    got, want = walk_both(head=head, check=assert_tokens_match, **inputs)
    clamped = np.clip(np.asarray(anchor), 0, vt - 1)
    np.testing.assert_array_equal(np.asarray(got.embeds[:, 0]), np.asarray(head.w1)[clamped])
    inputs["anchor"] = jnp.asarray(clamped)
    again = reference.walk(head=head, return_logits=True, return_embeds=True, **inputs)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(got.tokens))
    np.testing.assert_array_equal(np.asarray(again.logits), np.asarray(got.logits))


@pytest.mark.parametrize("logits_dtype,expected", [(jnp.float32, 7), (jnp.bfloat16, 3), (jnp.float16, 3)])
def test_logits_rounded_before_choosing(rng, make_head, assert_tokens_match, logits_dtype, expected):
    """f32 l: column 7 (1.0004) beats column 3 (1.0003); both round to 1.0 in bf16/f16, a tie that
    the lower column wins. The stored row is exactly what was chosen from."""
    b, k, v, r = 3, 2, 16, 8
    head = make_head(rng, v, r, w2_dtype=jnp.float32)
    w2 = np.array(head.w2)
    w2[[3, 7]] = 0.0
    head = jax_markov.MarkovHead(head.w1, jnp.asarray(w2))
    base = rng.uniform(-30.0, -20.0, (b, k, v)).astype(np.float32)
    base[:, 0, 3], base[:, 0, 7] = 1.0003, 1.0004
    anchor = jnp.asarray(rng.integers(0, v, b), jnp.int32)
    got, want = walk_both(jnp.asarray(base), anchor, head, assert_tokens_match, logits_dtype=logits_dtype)
    np.testing.assert_array_equal(np.asarray(got.tokens[:, 0]), expected)
    np.testing.assert_array_equal(np.asarray(got.tokens), want["tokens"])
    if expected == 3:
        assert np.all(np.asarray(got.logits[:, 0, 3]) == 1.0) and np.all(np.asarray(got.logits[:, 0, 7]) == 1.0)
    # without asking for logits nothing is rounded
    plain = reference.walk(jnp.asarray(base), anchor, head, logits_dtype=logits_dtype)
    np.testing.assert_array_equal(np.asarray(plain.tokens[:, 0]), 7)


def test_sampled_bf16_logits_choose_from_the_stored_row(rng, make_head, make_inputs, assert_tokens_match):
    """Sampled rows with bf16 logits: the Gumbel-max of the *stored* row reproduces the tokens."""
    head = make_head(rng, 40, 8)
    inputs = make_inputs(rng, 9, 3, 40, sampled=True)
    got, _ = walk_both(head=head, check=assert_tokens_match, logits_dtype=jnp.bfloat16, **inputs)
    key = np.asarray(jax.random.key_data(inputs["key"]))
    temps, pos = np.asarray(inputs["temperature"]), np.asarray(inputs["position"])
    logits = np.asarray(got.logits.astype(jnp.float32))
    for bi in range(9):
        for ki in range(3):
            s = logits[bi, ki]
            if temps[bi] > 0:
                inv_t = np.float32(1.0) / temps[bi]
                s = np.array([np.float32(s[c] * inv_t) + gumbel_py(key[bi, 0], key[bi, 1], c, pos[bi] + ki)
                              for c in range(40)], np.float32)
            assert got.tokens[bi, ki] == np.argmax(s)


# ---------------------------------------------------------------------------------------------
# Masked columns, padding and infinite temperatures; overflow
# ---------------------------------------------------------------------------------------------

def test_infinite_temperature_never_samples_padding_or_masked_columns(rng, make_head, assert_tokens_match):
    """Issue 64's reproducer: T = +inf (1/T = 0) with padding (vocab_size = 50) and -inf (masked)
    base logits. Padding and masked columns are never chosen (not -inf * 0 = NaN, which would win);
    the tokens are the oracle's, i.e. the argmax of the noise alone over the other columns."""
    b = jax.random.normal(jax.random.key(0), (2, 3, 64))
    b = b.at[0, :, 5:40].set(-jnp.inf).at[1, 1].set(-jnp.inf).at[1, 1, 17].set(0.5)  # row 1 step 1: only 17
    head = make_head(rng, 64, 8, w1_dtype=jnp.float32, w2_dtype=jnp.float32)
    kw = dict(temperature=jnp.full(2, jnp.inf), key=jax.random.split(jax.random.key(1), 2),
              position=jnp.asarray([5, 2**31 - 2], jnp.int32), vocab_size=50)
    got, want = walk_both(b, jnp.asarray([1, 60], jnp.int32), head, assert_tokens_match, **kw)
    tokens = np.asarray(got.tokens)
    np.testing.assert_array_equal(tokens, want["tokens"])
    assert tokens.max() < 50 and not np.isin(tokens[0], np.arange(5, 40)).any() and tokens[1, 1] == 17
    assert not np.isnan(want["scores"]).any()
    # the noise alone decides among the columns that are neither masked nor padding
    key = np.asarray(jax.random.key_data(kw["key"]))
    for i, k in itertools.product(range(2), range(3)):
        allowed = [v for v in range(50) if np.asarray(b)[i, k, v] != -np.inf]
        noise = [gumbel_py(key[i, 0], key[i, 1], v, int(kw["position"][i]) + k) for v in allowed]
        assert tokens[i, k] == allowed[int(np.argmax(noise))]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("w2_dtype", [jnp.float32, jnp.bfloat16, "int8"])
def test_overflowing_bias_is_infinite_by_its_sign_never_nan(rng, batch, w2_dtype):
    """Weights near 1e19 with random signs: every product is finite but the fp32 dot overflows, in
    partial sums of both signs. The bias is then +-inf by the sign of the exact (float64) dot, never
    NaN, for one request (a matrix-vector product) and several; where the exact dot is inside the
    fp32 range, the logit is finite and close to it."""
    v, r = 64, 256
    w1 = rng.uniform(0.5, 1.5, (v, r)) * 1e19 * rng.choice([-1, 1], (v, r))
    w2 = rng.uniform(0.5, 1.5, (v, r)) * 1e19 * rng.choice([-1, 1], (v, r))
    head = jax_markov.MarkovHead(jnp.asarray(w1, jnp.float32),
                                 jnp.asarray(w2, jnp.float32 if w2_dtype == "int8" else w2_dtype))
    head = jax_markov.quantize(head) if w2_dtype == "int8" else head
    base = jnp.asarray(rng.normal(0, 1, (batch, 2, v)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, v, batch), jnp.int32)
    got = reference.walk(base, anchor, head, return_logits=True, return_embeds=True)
    logits = np.asarray(got.logits)
    assert not np.isnan(logits).any()
    w1_64, w2_64 = (np.asarray(w, np.float64) for w in head_f32(head))
    prev = np.concatenate([np.asarray(anchor)[:, None], np.asarray(got.tokens)[:, :-1]], axis=1)
    exact = np.einsum("bkr,vr->bkv", w1_64[prev], w2_64) + np.asarray(base, np.float64)
    big = np.abs(exact) > 3.5e38
    assert big.mean() > 0.5 and (~big).any()
    np.testing.assert_array_equal(logits[big], np.sign(exact[big]) * np.inf)
    small = np.abs(exact) < 3.3e38
    np.testing.assert_allclose(logits[small], exact[small], rtol=1e-4, atol=1e35)
    # greedy: the first +inf column, where no column before it is a borderline case
    for b, k in itertools.product(range(batch), range(2)):
        first = int(np.argmax(exact[b, k] > 3.5e38))
        if exact[b, k, first] > 3.5e38 and np.all(small[b, k, :first]):
            assert got.tokens[b, k] == first
