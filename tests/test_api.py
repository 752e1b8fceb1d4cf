"""jax_markov.walk: argument errors, transformations (jit, while_loop, vmap, grad), outputs, keys,
and the heads as pytrees (the lowerings: test_lowering.py).

`walk(impl="auto")` may run the CPU custom call when it is built; then tokens are compared with
reference.walk up to near-ties (assert_tokens_match, TOL = 1e-4, RTOL = 1e-5 on the reference's
scores, at most one such request per comparison) and float32 logits with rtol 1e-5, atol 1e-4.
Where both sides are the reference (impl="reference", or no CPU module), everything is exactly equal.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_markov
from jax_markov import native, reference
from jax_markov.head import MarkovHead, QuantizedMarkovHead

B, K, V, VT, R = 3, 3, 24, 29, 8
TOL, RTOL = 1e-4, 1e-5
EXACT_AUTO = not native.cpu_available()  # impl="auto" is the reference on this machine


@pytest.fixture
def setup(rng, make_head, make_inputs):
    head = make_head(rng, V, R, v_target=VT)
    inputs = make_inputs(rng, B, K, V, v_target=VT, sampled=True)
    return head, inputs


@pytest.fixture
def check_walk(assert_tokens_match, reference_scores):
    """check_walk(got, want, inputs, exact): tokens up to near-ties, logits/embeds where the prefix agrees."""

    def check(got, want, inputs, exact):
        assert got.tokens.dtype == jnp.int32 and got.tokens.shape == want.tokens.shape
        assert (got.logits is None) == (want.logits is None) and (got.embeds is None) == (want.embeds is None)
        if exact:
            np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
            for a, b in ((got.logits, want.logits), (got.embeds, want.embeds)):
                if b is not None:
                    assert a.dtype == b.dtype
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            return
        full = want.logits
        if full is None:
            full = reference.walk(**dict(inputs, return_logits=True)).logits
        scores = reference_scores(full, inputs.get("temperature"), inputs.get("key"), inputs.get("position"))
        _, mask = assert_tokens_match(scores, want.tokens, got.tokens, TOL, rtol=RTOL, d2t=inputs.get("d2t"),
                                      max_mismatch_rows=1)
        if want.logits is not None:
            rtol = {jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.float16): 2.0**-10}.get(want.logits.dtype, RTOL)
            np.testing.assert_allclose(np.asarray(got.logits, np.float32)[mask], np.asarray(want.logits, np.float32)[mask],
                                       rtol=rtol, atol=TOL if rtol == RTOL else 1e-3)
        if want.embeds is not None:
            np.testing.assert_array_equal(np.asarray(got.embeds)[mask], np.asarray(want.embeds)[mask])

    return check


# ---------------------------------------------------------------------------------------------
# Argument errors: at trace time, naming the argument
# ---------------------------------------------------------------------------------------------

STATIC = ("vocab_size", "logit_scale", "return_logits", "logits_dtype", "return_embeds", "impl")


def trace_walk(fn=jax_markov.walk, **kw):
    """Traces fn abstractly (jax.eval_shape): errors here are trace-time errors."""
    static = {k: kw.pop(k) for k in STATIC if k in kw}
    dynamic = {k: v for k, v in kw.items() if v is not None}
    return jax.eval_shape(lambda d: fn(**d, **static), dynamic)


def _valid():
    rng = np.random.default_rng(7)
    head = MarkovHead(jnp.asarray(rng.normal(size=(VT, R)), jnp.bfloat16), jnp.asarray(rng.normal(size=(V, R)), jnp.bfloat16))
    return dict(base_logits=jnp.asarray(rng.normal(size=(B, K, V)), jnp.float32),
                anchor=jnp.arange(B, dtype=jnp.int32), head=head)


def _sampled(kw):
    return dict(kw, temperature=jnp.ones((B,), jnp.float32), key=jax.random.split(jax.random.key(0), B),
                position=jnp.zeros((B,), jnp.int32))


def _with_head(kw, **fields):
    h = kw["head"]
    if "q" in fields or "scale" in fields:
        q = jax_markov.quantize(h)
        return dict(kw, head=QuantizedMarkovHead(fields.get("w1", q.w1), fields.get("q", q.q), fields.get("scale", q.scale)))
    return dict(kw, head=MarkovHead(fields.get("w1", h.w1), fields.get("w2", h.w2)))


ERRORS = [
    ("base_rank", lambda kw: dict(kw, base_logits=kw["base_logits"][:, 0]), ValueError,
     r"base_logits must be \[B, K, V\], got rank 2"),
    ("base_dtype", lambda kw: dict(kw, base_logits=kw["base_logits"].astype(jnp.int32)), TypeError,
     r"base_logits must be bfloat16, float16 or float32, got int32"),
    ("base_f64_like", lambda kw: dict(kw, base_logits=kw["base_logits"].astype(jnp.int8)), TypeError, r"base_logits"),
    ("V_mismatch", lambda kw: dict(kw, base_logits=kw["base_logits"][..., :-1]), ValueError,
     rf"base_logits vocabulary V = {V - 1} must equal the head's draft vocabulary {V}"),
    ("K_zero", lambda kw: dict(kw, base_logits=kw["base_logits"][:, :0]), ValueError, r"K >= 1"),
    ("B_mismatch_anchor", lambda kw: dict(kw, anchor=jnp.zeros((B + 1,), jnp.int32)), ValueError,
     rf"anchor must have shape \[B\] = \[{B}\]"),
    ("anchor_rank", lambda kw: dict(kw, anchor=jnp.zeros((B, 1), jnp.int32)), ValueError, r"anchor must have shape"),
    ("anchor_dtype", lambda kw: dict(kw, anchor=jnp.zeros((B,), jnp.float32)), TypeError,
     r"anchor must be an integer array"),
    ("r_mismatch", lambda kw: _with_head(kw, w2=jnp.zeros((V, R + 1), jnp.bfloat16)), ValueError,
     rf"head W2 must be \[V, r\] with r = {R}"),
    ("w1_rank", lambda kw: _with_head(kw, w1=jnp.zeros((VT,), jnp.bfloat16)), TypeError, r"head.w1 must be a \[V_target, r\]"),
    ("w1_dtype", lambda kw: _with_head(kw, w1=jnp.zeros((VT, R), jnp.int32)), TypeError, r"head.w1 .* got int32"),
    ("w2_dtype", lambda kw: _with_head(kw, w2=jnp.zeros((V, R), jnp.int32)), TypeError,
     r"head.w2 must be bfloat16, float16 or float32, got int32"),
    ("head_type", lambda kw: dict(kw, head=(kw["head"].w1, kw["head"].w2)), TypeError,
     r"head must be a jax_markov.MarkovHead or a jax_markov.QuantizedMarkovHead, got tuple"),
    ("q_dtype", lambda kw: _with_head(kw, q=jnp.zeros((V, R), jnp.float32)), TypeError, r"head.q .* must be int8"),
    ("scale_shape", lambda kw: _with_head(kw, scale=jnp.ones((V + 1,), jnp.float32)), ValueError,
     rf"head.scale must be float32 \[V\] = \[{V}\]"),
    ("scale_dtype", lambda kw: _with_head(kw, scale=jnp.ones((V,), jnp.bfloat16)), ValueError, r"head.scale"),
    ("temperature_without_key", lambda kw: dict(_sampled(kw), key=None), ValueError,
     r"key is required when temperature is given"),
    ("temperature_without_position", lambda kw: dict(_sampled(kw), position=None), ValueError,
     r"position is required when temperature is given"),
    ("key_without_temperature", lambda kw: dict(_sampled(kw), temperature=None), ValueError,
     r"key and position are only used with temperature"),
    ("position_without_temperature", lambda kw: dict(kw, position=jnp.zeros((B,), jnp.int32)), ValueError,
     r"key and position are only used with temperature"),
    ("temperature_shape", lambda kw: dict(_sampled(kw), temperature=jnp.ones((B + 1,), jnp.float32)), ValueError,
     rf"temperature must have shape \[B\] = \[{B}\]"),
    ("temperature_dtype", lambda kw: dict(_sampled(kw), temperature=jnp.ones((B,), jnp.int32)), TypeError,
     r"temperature must be a float array"),
    ("key_typed_shape", lambda kw: dict(_sampled(kw), key=jax.random.split(jax.random.key(0), B + 1)), ValueError,
     rf"key must hold one PRNG key per request, shape \[B\] = \[{B}\]"),
    ("key_raw_shape", lambda kw: dict(_sampled(kw), key=jnp.zeros((B, 3), jnp.uint32)), ValueError,
     r"key must be \[B\] typed PRNG keys or their \[B, 2\] uint32 data"),
    ("key_raw_dtype", lambda kw: dict(_sampled(kw), key=jnp.zeros((B, 2), jnp.int32)), ValueError, r"key must be"),
    ("key_rbg", lambda kw: dict(_sampled(kw), key=jax.random.split(jax.random.key(0, impl="rbg"), B)), ValueError,
     r"key must be a two-word PRNG key"),
    ("position_dtype", lambda kw: dict(_sampled(kw), position=jnp.zeros((B,), jnp.float32)), TypeError,
     r"position must be an integer array"),
    ("position_shape", lambda kw: dict(_sampled(kw), position=jnp.zeros((B - 1,), jnp.int32)), ValueError,
     r"position must have shape"),
    ("vocab_size_zero", lambda kw: dict(kw, vocab_size=0), ValueError, rf"vocab_size must be a static int in \[1, V = {V}\]"),
    ("vocab_size_big", lambda kw: dict(kw, vocab_size=V + 1), ValueError, r"vocab_size must be a static int"),
    ("vocab_size_float", lambda kw: dict(kw, vocab_size=2.0), ValueError, r"vocab_size must be a static int"),
    ("vocab_size_bool", lambda kw: dict(kw, vocab_size=True), ValueError, r"vocab_size must be a static int .*got True"),
    ("logit_scale_nan", lambda kw: dict(kw, logit_scale=float("nan")), ValueError, r"logit_scale must be finite"),
    ("logit_scale_inf", lambda kw: dict(kw, logit_scale=-np.inf), ValueError, r"logit_scale must be finite"),
    ("logit_scale_text", lambda kw: dict(kw, logit_scale="abc"), TypeError,
     r"logit_scale must be a static Python float, got 'abc'"),
    ("temperature_bool", lambda kw: dict(_sampled(kw), temperature=True), TypeError,
     r"temperature must be a float array, got bool"),
    ("d2t_shape", lambda kw: dict(kw, d2t=jnp.zeros((V + 1,), jnp.int32)), ValueError, rf"d2t must be an integer array \[V\] = \[{V}\]"),
    ("d2t_rank", lambda kw: dict(kw, d2t=jnp.zeros((1, V), jnp.int32)), ValueError, r"d2t must be"),
    ("d2t_dtype", lambda kw: dict(kw, d2t=jnp.zeros((V,), jnp.float32)), ValueError, r"d2t must be an integer array"),
    ("impl", lambda kw: dict(kw, impl="cuda"), ValueError, r"impl must be one of \('auto', 'reference', 'ffi'\)"),
    ("logits_dtype_int", lambda kw: dict(kw, return_logits=True, logits_dtype=jnp.int32), TypeError,
     r"logits_dtype must be float32, bfloat16 or float16, got int32"),
    ("logits_dtype_f64", lambda kw: dict(kw, return_logits=True, logits_dtype=np.float64), TypeError, r"logits_dtype"),
    ("logits_dtype_name", lambda kw: dict(kw, return_logits=True, logits_dtype="float33"), TypeError, r"logits_dtype"),
]


@pytest.mark.parametrize("mutate,exc,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_argument_errors_at_trace_time(mutate, exc, match):
    kw = _valid()
    trace_walk(**kw)  # the valid call traces
    with pytest.raises(exc, match=match):
        trace_walk(**mutate(kw))
    # reference.walk checks the same way (impl aside: it only has "reference")
    if "impl" not in mutate(kw):
        with pytest.raises(exc, match=match):
            trace_walk(reference.walk, **mutate(kw))


@pytest.mark.skipif(not native.plan_available(), reason="the jax_markov plan module is not built")
def test_tiles_errors_at_trace_time():
    """head.tiles must be q stored tile by tile: int8 [ceil(V / 64), 64 r] with r = 256."""
    rng = np.random.default_rng(3)
    head = jax_markov.quantize(MarkovHead(jnp.asarray(rng.normal(size=(40, 256)), jnp.bfloat16),
                                          jnp.asarray(rng.normal(size=(100, 256)), jnp.bfloat16)))
    kw = dict(base_logits=jnp.asarray(rng.normal(size=(2, 3, 100)), jnp.float32), anchor=jnp.arange(2))
    assert head.tiles.shape == (2, 16384)
    trace_walk(**kw, head=head)
    for tiles, got in [(head.tiles[:1], r"int8\[1, 16384\]"), (head.tiles.astype(jnp.uint8), r"uint8\[2, 16384\]"),
                       (head.tiles.reshape(4, 8192), r"int8\[4, 8192\]")]:
        bad = QuantizedMarkovHead(head.w1, head.q, head.scale, tiles)
        with pytest.raises(ValueError, match=rf"head.tiles must be int8 \[2, 16384\] .*got {got}"):
            trace_walk(**kw, head=bad)
    narrow = _valid()  # r = 8: no tiles are made, and none fit
    q = jax_markov.quantize(narrow["head"])
    assert q.tiles is None
    bad = QuantizedMarkovHead(q.w1, q.q, q.scale, jnp.zeros((1, 16384), jnp.int8))
    with pytest.raises(ValueError, match=r"head.tiles must be .* with r \* 64 = 16384"):
        trace_walk(**dict(narrow, head=bad))


def test_traced_static_arguments_rejected():
    kw = _valid()
    with pytest.raises(TypeError, match="logit_scale must be a static Python float"):
        jax.jit(lambda s: jax_markov.walk(**kw, logit_scale=s))(1.0)
    with pytest.raises(ValueError, match="vocab_size must be a static int"):
        jax.jit(lambda n: jax_markov.walk(**kw, vocab_size=n))(5)
    with pytest.raises(ValueError, match="only implements impl='reference'"):
        reference.walk(**kw, impl="auto")


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_temperature_is_any_real_scalar(setup, impl):
    """temperature=0 as a Python or NumPy int is greedy ("0 = greedy"), 1 as an int is 1.0."""
    head, inputs = setup
    kw = dict(inputs, head=head, impl=impl)
    greedy = np.asarray(jax_markov.walk(inputs["base_logits"], inputs["anchor"], head, impl=impl).tokens)
    for zero in (0, np.int32(0), np.uint8(0), 0.0, np.float64(0.0)):
        np.testing.assert_array_equal(np.asarray(jax_markov.walk(**dict(kw, temperature=zero)).tokens), greedy)
    one = np.asarray(jax_markov.walk(**dict(kw, temperature=1.0)).tokens)
    np.testing.assert_array_equal(np.asarray(jax_markov.walk(**dict(kw, temperature=1)).tokens), one)
    assert not np.array_equal(one, greedy)  # the rows really are sampled


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_wide_ids_are_clamped_in_their_own_width(rng, make_head, make_inputs, impl):
    """Anchors, positions and d2t values wider than int32 are clamped before the cast (they used to
    wrap mod 2^32: an anchor of 3e9 read W1[0], 2^32 + 3 read W1[3])."""
    head = make_head(rng, V, R, v_target=VT)
    inputs = make_inputs(rng, 2, K, V, v_target=VT, sampled=True)
    w1 = np.asarray(head.w1)
    embeds = lambda anchor, **kw: np.asarray(jax_markov.walk(
        inputs["base_logits"], anchor, head, return_embeds=True, impl=impl, **kw).embeds[:, 0])
    np.testing.assert_array_equal(embeds(jnp.array([3_000_000_000, 5], jnp.uint32)), w1[[VT - 1, 5]])
    np.testing.assert_array_equal(embeds(np.array([2**32 + 3, -(2**40)])), w1[[VT - 1, 0]])  # NumPy int64, x64 off
    with jax.enable_x64(True):
        np.testing.assert_array_equal(embeds(jnp.array([2**32 + 3, 5], jnp.int64)), w1[[VT - 1, 5]])
        d2t = np.zeros(V, np.int64)
        d2t[2] = 2**32 + 3
        base = inputs["base_logits"].at[:, 0, 2].set(1e4)  # column 2 first: target id 2 + (2^31 - V)
        tokens = jax_markov.walk(base, inputs["anchor"], head, d2t=jnp.asarray(d2t), impl=impl).tokens
        assert tokens.dtype == jnp.int32 and np.all(np.asarray(tokens)[:, 0] == 2**31 - V + 2)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_positions_keep_their_philox_counter_or_are_refused(setup, impl):
    """position: int32 and uint32 values are the counter bits (uint32)(position + k) (docs/spec.md), so a
    uint32 position equals the int32 one with its bits; a concrete wider value outside [-2^31, 2^32)
    is an error naming position (it would share a stream with another position); a traced one is
    clamped into that range."""
    head, inputs = setup
    inputs = dict(inputs, temperature=jnp.ones((B,), jnp.float32))
    walk = lambda **kw: np.asarray(jax_markov.walk(head=head, impl=impl, **dict(inputs, **kw)).tokens)
    bits = np.array([3_000_000_000, 4_000_000_000, 7], np.uint32)
    np.testing.assert_array_equal(walk(position=jnp.asarray(bits)), walk(position=jnp.asarray(bits.astype(np.int32))))
    np.testing.assert_array_equal(walk(position=bits.astype(np.int64)), walk(position=jnp.asarray(bits)))
    for bad in (np.array([2**32, 0, 0]), np.array([0, -(2**31) - 1, 0])):
        with pytest.raises(ValueError, match=r"position must lie in \[-2\^31, 2\^32\)"):
            walk(position=bad)
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="position must lie in"):
            walk(position=jnp.array([2**40, 0, 0], jnp.int64))
        traced = jax.jit(lambda p: jax_markov.walk(head=head, impl=impl, **dict(inputs, position=p)).tokens)
        np.testing.assert_array_equal(np.asarray(traced(jnp.array([2**40, -(2**40), 7], jnp.int64))),
                                      walk(position=jnp.array([2**32 - 1, -(2**31), 7], jnp.int64)))


@pytest.mark.skipif(native.cpu_available(), reason="the CPU custom call is built")
def test_ffi_without_module_is_a_clear_error():
    kw = _valid()
    with pytest.raises(RuntimeError, match="impl='ffi': the jax_markov CPU module is not built"):
        jax.jit(functools.partial(jax_markov.walk, impl="ffi")).lower(**kw)


# ---------------------------------------------------------------------------------------------
# Values: walk == reference.walk, eager, in jit, in a while_loop decode loop
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,quantized", [("auto", False), ("auto", True), ("reference", True)])
def test_walk_equals_reference(rng, setup, check_walk, impl, quantized):
    head, inputs = setup
    head = jax_markov.quantize(head) if quantized else head
    kw = dict(inputs, head=head, return_logits=True, return_embeds=True, logit_scale=0.75)
    got = jax_markov.walk(**kw, impl=impl)
    want = reference.walk(**kw)
    check_walk(got, want, kw, impl == "reference" or EXACT_AUTO)
    # greedy only, with padding and d2t: a second configuration
    d2t = jnp.asarray(np.sort(rng.choice(VT, V, replace=False)) - np.arange(V), jnp.int32)
    kw2 = dict(base_logits=inputs["base_logits"], anchor=inputs["anchor"], head=head, vocab_size=V - 5, d2t=d2t)
    got2, want2 = jax_markov.walk(**kw2, impl=impl), reference.walk(**kw2)
    check_walk(got2, want2, kw2, impl == "reference" or EXACT_AUTO)
    assert got2.logits is None and got2.embeds is None


def test_walk_in_jit(setup, check_walk):
    head, inputs = setup
    f = jax.jit(jax_markov.walk, static_argnames=STATIC)
    kw = dict(inputs, head=head, return_logits=True, logits_dtype=jnp.bfloat16)
    got = f(**kw)
    want = reference.walk(**kw)
    assert got.logits.dtype == jnp.bfloat16 and got.embeds is None
    check_walk(got, want, kw, EXACT_AUTO)
    # impl="reference" inside jit is exactly the reference
    got_ref = f(**kw, impl="reference")
    check_walk(got_ref, want, kw, True)


def test_while_loop_decode(rng, make_head, assert_tokens_match, reference_scores, impl="auto"):
    """A decode loop: each iteration drafts from the last drafted token, K positions further on."""
    iters, b, k, v = 4, 4, 3, 20
    head = make_head(rng, v, R)
    table = jnp.asarray(rng.normal(0, 2.0, (iters, b, k, v)), jnp.float32)
    anchor0 = jnp.asarray(rng.integers(0, v, b), jnp.int32)
    pos0 = jnp.asarray(rng.integers(0, 1000, b), jnp.int32)
    temps = jnp.asarray([0.0, 0.7, 1.0, 1.4], jnp.float32)
    keys = jax.random.split(jax.random.key(3), b)

    @jax.jit
    def decode(table, anchor0, pos0, head):
        def body(carry):
            i, anchor, pos, out = carry
            res = jax_markov.walk(table[i], anchor, head, temperature=temps, key=keys, position=pos, impl=impl)
            return i + 1, res.tokens[:, -1], pos + k, out.at[i].set(res.tokens)
        init = (jnp.int32(0), anchor0, pos0, jnp.zeros((iters, b, k), jnp.int32))
        return lax.while_loop(lambda c: c[0] < iters, body, init)[3]

    got = np.asarray(decode(table, anchor0, pos0, head))
    assert "while" in str(jax.make_jaxpr(decode)(table, anchor0, pos0, head))

    exact = EXACT_AUTO
    anchor, pos, free = anchor0, pos0, []
    for i in range(iters):  # the Python loop, free running
        res = reference.walk(table[i], anchor, head, temperature=temps, key=keys, position=pos)
        free.append(np.asarray(res.tokens))
        anchor, pos = res.tokens[:, -1], pos + k
    if exact:
        np.testing.assert_array_equal(got, np.stack(free))
    # teacher-forced: every iteration from the anchors the loop really used (valid with near-ties too)
    anchor, pos = anchor0, pos0
    for i in range(iters):
        res = reference.walk(table[i], anchor, head, temperature=temps, key=keys, position=pos, return_logits=True)
        scores = reference_scores(res.logits, temps, keys, pos)
        assert_tokens_match(scores, res.tokens, got[i], TOL, rtol=RTOL, max_mismatch_rows=1)
        anchor, pos = jnp.asarray(got[i][:, -1]), pos + k
    # the position really advances: the same loop with a fixed position differs
    assert not np.array_equal(np.stack(free)[1:, 1:], np.stack(
        [np.asarray(reference.walk(table[i], jnp.asarray(got[i - 1][:, -1]), head, temperature=temps, key=keys,
                                   position=pos0).tokens) for i in range(1, iters)])[:, 1:])


# ---------------------------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------------------------

def _eqns(jaxpr):
    """All equations of a closed jaxpr, sub-jaxprs included."""
    out = []
    for e in jaxpr.jaxpr.eqns:
        out.append(e)
        for p in e.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for sub in subs:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out.extend(_eqns(sub))
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out.extend(_eqns(jax.extend.core.ClosedJaxpr(sub, ())))
    return out


def _stack_inputs(rng, make_inputs, s, vt=VT):
    per = [make_inputs(rng, B, K, V, v_target=vt, sampled=True) for _ in range(s)]
    return per, {n: jnp.stack([p[n] for p in per]) for n in per[0]}


@pytest.mark.parametrize("outputs", [(False, False), (True, True)], ids=["tokens", "logits+embeds"])
def test_vmap_unmapped_head_folds_into_batch(rng, make_head, make_inputs, check_walk, outputs):
    s = 3
    head = make_head(rng, V, R, v_target=VT)
    per, stacked = _stack_inputs(rng, make_inputs, s)
    rl, re = outputs
    f = lambda kw: jax_markov.walk(head=head, return_logits=rl, return_embeds=re, **kw)
    got = jax.vmap(f)(stacked)
    assert (got.logits is None) == (not rl) and (got.embeds is None) == (not re)
    for i in range(s):
        want = reference.walk(head=head, return_logits=rl, return_embeds=re, **per[i])
        check_walk(jax.tree.map(lambda x: x[i], got), want, dict(per[i], head=head), EXACT_AUTO)
    # one walk over S * B requests, no loop
    eqns = _eqns(jax.make_jaxpr(jax.vmap(f))(stacked))
    walks = [e for e in eqns if e.primitive.name == "markov_walk"]
    assert len(walks) == 1 and walks[0].invars[0].aval.shape == (s * B, K, V)
    assert not any(e.primitive.name in ("scan", "while") for e in eqns)


def test_vmap_mapped_head_walks_each(rng, make_head, make_inputs, check_walk, quantized=True):
    s = 3
    heads = [make_head(rng, V, R, v_target=VT, w2_dtype="int8" if quantized else jnp.bfloat16) for _ in range(s)]
    stacked_head = jax.tree.map(lambda *x: jnp.stack(x), *heads)
    assert type(stacked_head) is type(heads[0])
    per, stacked = _stack_inputs(rng, make_inputs, s)
    f = lambda h, kw: jax_markov.walk(head=h, return_logits=True, return_embeds=True, **kw)
    got = jax.vmap(f)(stacked_head, stacked)
    for i in range(s):
        want = reference.walk(head=heads[i], return_logits=True, return_embeds=True, **per[i])
        check_walk(jax.tree.map(lambda x: x[i], got), want, dict(per[i], head=heads[i]), EXACT_AUTO)
    eqns = _eqns(jax.make_jaxpr(jax.vmap(f))(stacked_head, stacked))
    assert any(e.primitive.name == "scan" for e in eqns)
    # a mapped head with shared (unmapped) requests, tokens only
    got2 = jax.vmap(lambda h: jax_markov.walk(head=h, **per[0]).tokens)(stacked_head)
    for i in range(s):
        want = reference.walk(head=heads[i], return_logits=True, return_embeds=True, **per[0])
        check_walk(jax_markov.WalkResult(got2[i], None, None), want._replace(logits=None, embeds=None),
                   dict(per[0], head=heads[i]), EXACT_AUTO)


def test_vmap_partial_axes_and_nesting(rng, make_head, make_inputs, check_walk):
    head = make_head(rng, V, R, v_target=VT)
    s = 2
    per, stacked = _stack_inputs(rng, make_inputs, s)
    shared = per[0]
    # only base_logits mapped, along axis 1; everything else shared
    base_t = jnp.moveaxis(stacked["base_logits"], 0, 1)  # [B, S, K, V]
    f = lambda base: jax_markov.walk(base, shared["anchor"], head, temperature=shared["temperature"],
                                     key=shared["key"], position=shared["position"], return_logits=True)
    got = jax.vmap(f, in_axes=1)(base_t)
    for i in range(s):
        kw = dict(shared, base_logits=per[i]["base_logits"], head=head)
        check_walk(jax.tree.map(lambda x: x[i], got), reference.walk(**kw, return_logits=True), kw, EXACT_AUTO)
    # nested vmap: [S2, S, B, ...], mapped d2t in the inner level -> per-element walks
    d2ts = jnp.stack([jnp.asarray(np.sort(rng.choice(VT, V, replace=False)) - np.arange(V), jnp.int32)
                      for _ in range(s)])
    both = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), stacked)
    g = jax.vmap(jax.vmap(lambda kw, d: jax_markov.walk(head=head, d2t=d, **kw).tokens), in_axes=(0, None))
    got2 = jax.jit(g)(both, d2ts)
    for j in range(2):
        for i in range(s):
            kw = {n: both[n][j, i] for n in both}
            kw.update(head=head, d2t=d2ts[i])
            want = reference.walk(**kw, return_logits=True)
            check_walk(jax_markov.WalkResult(got2[j, i], None, None), want._replace(logits=None), kw, EXACT_AUTO)


# ---------------------------------------------------------------------------------------------
# Gradients, outputs, keys
# ---------------------------------------------------------------------------------------------

def test_grad_raises_clear_type_error(setup):
    head, inputs = setup
    base, anchor = inputs["base_logits"], inputs["anchor"]
    match = "jax_markov.walk is not differentiable"
    with pytest.raises(TypeError, match=match):
        jax.grad(lambda b: jax_markov.walk(b, anchor, head, return_logits=True).logits.sum())(base)
    with pytest.raises(TypeError, match=match):
        jax.grad(lambda h: jax_markov.walk(base, anchor, h, return_embeds=True).embeds.astype(jnp.float32).sum())(head)
    with pytest.raises(TypeError, match=match):
        jax.jit(jax.grad(lambda b: jax_markov.walk(b, anchor, head, impl="reference",
                                                   return_logits=True).logits.sum()))(base)
    with pytest.raises(TypeError, match=match):
        jax.jvp(lambda b: jax_markov.walk(b, anchor, head).tokens, (base,), (jnp.ones_like(base),))
    # no tangent flowing in: fine (stop_gradient in front of the walk)
    g = jax.grad(lambda b: jnp.sum(b) + jnp.sum(jax_markov.walk(lax.stop_gradient(b), anchor, head,
                                                                return_logits=True).logits[..., 0]))(base)
    np.testing.assert_array_equal(np.asarray(g), np.ones(base.shape, np.float32))


def test_unrequested_outputs_are_none(setup):
    head, inputs = setup
    plain = jax_markov.walk(head=head, **inputs)
    assert isinstance(plain, jax_markov.WalkResult)
    assert plain.logits is None and plain.embeds is None and plain.tokens.shape == (B, K)
    only_e = jax_markov.walk(head=head, return_embeds=True, **inputs)
    assert only_e.logits is None and only_e.embeds.shape == (B, K, R) and only_e.embeds.dtype == head.w1.dtype
    # asking for more outputs does not change the tokens (no logits asked for: nothing rounded)
    np.testing.assert_array_equal(np.asarray(only_e.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(only_e.embeds[:, 0]), np.asarray(head.w1)[np.asarray(inputs["anchor"])])
    # through jit: None leaves in the output pytree
    only_l = jax.jit(jax_markov.walk, static_argnames=STATIC)(head=head, return_logits=True,
                                                               logits_dtype=jnp.float16, **inputs)
    assert only_l.embeds is None and only_l.logits.shape == (B, K, V) and only_l.logits.dtype == jnp.float16
    assert jax.tree.structure(only_l) == jax.tree.structure(jax_markov.WalkResult(0, 0, None))
    want = reference.walk(head=head, return_logits=True, logits_dtype=jnp.float16, **inputs)
    np.testing.assert_allclose(np.asarray(only_l.logits, np.float32), np.asarray(want.logits, np.float32),
                               rtol=2.0**-10, atol=1e-3)


def test_typed_and_raw_keys_same_tokens(setup):
    head, inputs = setup
    inputs = dict(inputs, temperature=jnp.ones((B,), jnp.float32))  # every row sampled
    raw = dict(inputs, key=jax.random.key_data(inputs["key"]))
    assert raw["key"].shape == (B, 2) and raw["key"].dtype == jnp.uint32
    typed = jax_markov.walk(head=head, **inputs).tokens
    np.testing.assert_array_equal(np.asarray(jax_markov.walk(head=head, **raw).tokens), np.asarray(typed))
    jitted = jax.jit(lambda kw: jax_markov.walk(head=head, **kw).tokens)(raw)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(typed))
    # and the key matters: other keys, other tokens (every row is sampled)
    other = dict(inputs, key=jax.random.split(jax.random.key(12345), B))
    a = np.stack([np.asarray(jax_markov.walk(head=head, **dict(inputs, position=inputs["position"] + 10 * j)).tokens)
                  for j in range(4)])
    b = np.stack([np.asarray(jax_markov.walk(head=head, **dict(other, position=inputs["position"] + 10 * j)).tokens)
                  for j in range(4)])
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# The heads as pytrees
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True])
def test_heads_are_pytrees_through_jit_and_vmap(rng, make_head, quantized):
    head = make_head(rng, V, R, v_target=VT, w2_dtype="int8" if quantized else jnp.float16)
    leaves, treedef = jax.tree.flatten(head)
    assert len(leaves) == (3 if quantized else 2)
    back = jax.jit(lambda h: h)(head)
    assert type(back) is type(head) and jax.tree.structure(back) == treedef
    for a, b in zip(jax.tree.leaves(back), leaves):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    doubled = jax.jit(lambda h: jax.tree.map(lambda x: x * 2 if x.dtype != jnp.int8 else x, h))(head)
    assert type(doubled) is type(head)
    np.testing.assert_array_equal(np.asarray(doubled.w1, np.float32), 2 * np.asarray(head.w1, np.float32))

    heads = [make_head(rng, V, R, v_target=VT, w2_dtype="int8" if quantized else jnp.float16) for _ in range(3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *heads)
    assert stacked.w1.shape == (3, VT, R)
    if quantized:
        deq = jax.vmap(QuantizedMarkovHead.dequantized_w2)(stacked)
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(deq[i]), np.asarray(heads[i].dequantized_w2()))
    else:  # quantize under vmap is quantize per head
        q = jax.vmap(jax_markov.quantize)(stacked)
        assert isinstance(q, QuantizedMarkovHead)
        for i in range(3):
            one = jax_markov.quantize(heads[i])
            np.testing.assert_array_equal(np.asarray(q.q[i]), np.asarray(one.q))
            np.testing.assert_array_equal(np.asarray(q.scale[i]), np.asarray(one.scale))
    # a head is a jit argument like any array: new weights, no retrace, new tokens
    traces = []

    @jax.jit
    def f(h, base, anchor):
        traces.append(1)
        return jax_markov.walk(base, anchor, h).tokens
    base = jnp.asarray(rng.normal(0, 0.1, (B, K, V)), jnp.float32)
    anchor = jnp.zeros((B,), jnp.int32)
    toks = [np.asarray(f(h, base, anchor)) for h in heads]
    assert len(traces) == 1
    for h, t in zip(heads, toks):
        np.testing.assert_array_equal(t, np.asarray(reference.walk(base, anchor, h).tokens))
    assert not all(np.array_equal(toks[0], t) for t in toks[1:])
