"""The certified int8 head (jax_markov.CertifiedMarkovHead, `quantize(head, certified=True)`) on the
reference, and what every implementation shares: the head, its residual norms and memory, its
arguments' errors, its routing on CUDA, the Flax head's "int8-certified" layout
(tests/cpu_ffi/test_certified.py: the CPU custom call).

The contract checked: greedy rows choose exactly what the unquantized head's reference walk chooses
(tokens equal, no tolerance: both choose from the same unquantized logits), sampled rows exactly what
the plain int8 walk's sampled rows choose, and the returned logits are the int8 logits along the
certified walk's own tokens (float32 within rtol 1e-6: one fp32 dot in another program).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_markov
from jax_markov import native, reference
from tests import certified_cases
from tests.test_lowering import _custom_call_operands

LOGITS_RTOL = 1e-6


def certified_head(rng, vocab, rank, *, w1_dtype=jnp.bfloat16, w2_dtype=jnp.bfloat16):
    """A random head whose bias is O(1) like the base logits (W1 ~ N(0, 1), W2 ~ N(0, 1/r)), so that
    int8 and the unquantized W2 disagree at some steps; returns (MarkovHead, CertifiedMarkovHead)."""
    w1 = jnp.asarray(rng.normal(0.0, 1.0, (vocab, rank)), w1_dtype)
    w2 = jnp.asarray(rng.normal(0.0, 1.0, (vocab, rank)) / np.sqrt(rank), w2_dtype)
    head = jax_markov.MarkovHead(w1, w2)
    return head, jax_markov.quantize(head, certified=True)


def int8_logits_along(tokens, base, anchor, qhead, **kw):
    """The int8 logits [B, K, V] of each step, walked from the given tokens (teacher forced: one
    K = 1 int8 walk per step from the previous token)."""
    prev = jnp.concatenate([jnp.asarray(anchor, jnp.int32)[:, None], tokens[:, :-1]], axis=1)
    steps = [reference.walk(base[:, k:k + 1], prev[:, k], qhead, return_logits=True, **kw).logits
             for k in range(base.shape[1])]
    return jnp.concatenate(steps, axis=1)


# ---------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_quantize_certified_keeps_the_int8_head_the_w2_and_bounds_of_the_residual(rng, dtype):
    v, r = 300, 256
    head = jax_markov.MarkovHead(jnp.asarray(rng.normal(0, 1, (50, r)), jnp.bfloat16),
                                 jnp.asarray(rng.normal(0, 0.2, (v, r)), dtype).at[7].set(0))
    chead = jax_markov.quantize(head, certified=True)
    plain = jax_markov.quantize(head)
    assert isinstance(chead, jax_markov.CertifiedMarkovHead) and chead.w2 is head.w2 and chead.w1 is head.w1
    np.testing.assert_array_equal(chead.quantized.q, plain.q)
    np.testing.assert_array_equal(chead.quantized.scale, plain.scale)
    w2 = np.asarray(head.w2, np.float64)
    residual = w2 - np.asarray(plain.scale, np.float64)[:, None] * np.asarray(plain.q, np.float64)
    true = np.sqrt((residual ** 2).sum(axis=1))
    rho = np.asarray(chead.residual_norm, np.float64)
    assert chead.residual_norm.dtype == jnp.float32 and rho.shape == (v,)
    assert np.all(rho >= true), "a residual norm below the true one"
    nonzero = true > 0
    assert np.all(rho[nonzero] <= true[nonzero] * (1 + 1e-3)), "residual norms far from tight"
    assert rho[7] < 1e-15  # a zero row: no residual (up to the underflow term)
    assert (chead.rank, chead.draft_vocab, chead.target_vocab) == (r, v, 50)
    assert chead.unquantized.w2 is head.w2
    assert jax_markov.quantize(chead) is chead.quantized and jax_markov.quantize(chead, certified=True) is chead
    bare = jax_markov.quantize(chead, certified=True, tiles=False)
    assert bare.quantized.tiles is None and bare.w2 is chead.w2 and bare.residual_norm is chead.residual_norm
    assert jax_markov.quantize(bare, tiles=False) is bare.quantized
    with pytest.raises(TypeError, match="needs the MarkovHead"):
        jax_markov.quantize(plain, certified=True)


def test_certified_repr_states_its_memory():
    v, r, vt = 4096, 256, 6000
    head = jax_markov.MarkovHead(jnp.ones((vt, r), jnp.bfloat16), jnp.full((v, r), 0.5, jnp.bfloat16))
    int8 = v * r + 4 * v
    certificate = v * r * 2 + 4 * v
    for tiles in (True, False):
        chead = jax_markov.quantize(head, certified=True, tiles=tiles)
        held = chead.quantized.tiles  # q again, tile by tile, where the plan module is built
        assert (held is None) == (not tiles or not native.plan_available())
        tile_bytes = 0 if held is None else v * r
        assert chead.nbytes == vt * r * 2 + int8 + tile_bytes + certificate
        text = repr(chead)
        assert f"int8 w2 memory={int8 / 2**20:.1f} MiB" in text
        assert f"certificate memory={certificate / 2**20:.1f} MiB" in text
        assert f"total memory={chead.nbytes / 2**20:.1f} MiB" in text
        assert f"residual_norm=float32[{v}]" in text and f"w2=bfloat16[{v}, {r}]" in text
        assert ("tiles=None" if held is None else f"tiles=int8[{v // 64}, {64 * r}]") in text


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_certified_non_finite_rows_refused_eagerly_and_always_rescored_under_jit(rng, bad):
    """As `quantize`: eagerly an error naming the rows; under jit a NaN scale and a NaN residual norm,
    and the certified walk drafts as the float head does (the NaN column wins every greedy step)."""
    v, r = 40, 16
    w2 = rng.normal(0, 0.3, (v, r)).astype(np.float32)
    w2[3, 5] = bad
    head = jax_markov.MarkovHead(jnp.asarray(rng.normal(0, 1, (v, r)), jnp.float32), jnp.asarray(w2))
    with pytest.raises(ValueError, match=r"W2 rows \[3\] hold NaN or infinite values"):
        jax_markov.quantize(head, certified=True)
    chead = jax.jit(lambda h: jax_markov.quantize(h, certified=True))(head)
    assert np.isnan(chead.quantized.scale[3]) and np.isnan(chead.residual_norm[3])
    assert not np.isnan(np.delete(np.asarray(chead.residual_norm), 3)).any()
    base = jnp.asarray(rng.normal(0, 1, (4, 3, v)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, v, 4), jnp.int32)
    want = reference.walk(base, anchor, head).tokens
    np.testing.assert_array_equal(reference.walk(base, anchor, chead).tokens, want)
    if np.isnan(bad):
        np.testing.assert_array_equal(want, 3)


# ---------------------------------------------------------------------------------------------
# The reference walk of a certified head
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,logits_dtype", certified_cases.CASE_PARAMS)
def test_reference_greedy_rows_choose_the_unquantized_token_where_int8_does_not(rng, case, logits_dtype):
    c = certified_cases.CASES[case](rng, logits_dtype=logits_dtype)
    chead = jax_markov.quantize(c.head, certified=True)
    kw = {} if logits_dtype is None else dict(return_logits=True, logits_dtype=logits_dtype)
    plain = reference.walk(c.base, c.anchor, chead.quantized, **kw).tokens
    np.testing.assert_array_equal(plain[:, 0], c.int8)  # the construction: int8 chooses otherwise
    got = reference.walk(c.base, c.anchor, chead, return_logits=True, logits_dtype=logits_dtype or jnp.float32)
    want = reference.walk(c.base, c.anchor, c.head, **kw).tokens
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    np.testing.assert_array_equal(got.tokens, want)
    # the logits returned are the int8 logits along the certified tokens
    int8 = int8_logits_along(got.tokens, c.base, c.anchor, chead.quantized,
                             logits_dtype=logits_dtype or jnp.float32)
    np.testing.assert_allclose(np.asarray(got.logits, np.float32), np.asarray(int8, np.float32), rtol=LOGITS_RTOL)


def test_reference_certified_with_every_option(rng):
    """Mixed greedy and sampled rows, d2t, vocab_size, a negative logit_scale, masked columns and bf16
    base logits: greedy rows are the unquantized walk's, sampled rows the int8 walk's."""
    b, k, v = 9, 5, 700
    head, chead = certified_head(rng, v, 64, w1_dtype=jnp.float32)
    base = rng.normal(0, 1, (b, k, v))
    base[rng.random(base.shape) < 0.05] = -np.inf
    temps = rng.uniform(0.5, 1.5, b).astype(np.float32)
    temps[::2] = 0.0
    kw = dict(temperature=jnp.asarray(temps), key=jax.random.split(jax.random.key(int(rng.integers(2**31))), b),
              position=jnp.asarray(rng.integers(0, 1000, b), jnp.int32), vocab_size=v - 20, logit_scale=-1.5,
              d2t=jnp.asarray(rng.integers(0, 4, v), jnp.int32), return_logits=True, return_embeds=True)
    base = jnp.asarray(base, jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, v, b), jnp.int32)
    got = reference.walk(base, anchor, chead, **kw)
    exact = reference.walk(base, anchor, head, **kw)
    int8 = reference.walk(base, anchor, chead.quantized, **kw)
    greedy = temps == 0
    np.testing.assert_array_equal(got.tokens[greedy], exact.tokens[greedy])
    np.testing.assert_array_equal(got.tokens[~greedy], int8.tokens[~greedy])
    np.testing.assert_array_equal(got.logits[~greedy], int8.logits[~greedy])
    np.testing.assert_array_equal(got.embeds[greedy], exact.embeds[greedy])
    assert np.all(np.isneginf(np.asarray(got.logits)[:, :, v - 20:]))


def test_certified_head_under_jit_vmap_and_a_decode_loop(rng):
    b, k, v = 4, 3, 256
    head, chead = certified_head(rng, v, 32)
    base = jnp.asarray(rng.normal(0, 1, (2, b, k, v)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, v, (2, b)), jnp.int32)
    want = [reference.walk(base[i], anchor[i], head).tokens for i in range(2)]
    walk = lambda x, a, h: jax_markov.walk(x, a, h, impl="reference").tokens
    np.testing.assert_array_equal(jax.jit(walk)(base[0], anchor[0], chead), want[0])
    np.testing.assert_array_equal(jax.vmap(walk, in_axes=(0, 0, None))(base, anchor, chead), np.stack(want))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), chead)  # a mapped head walks each in turn
    np.testing.assert_array_equal(jax.vmap(walk)(base, anchor, stacked), np.stack(want))

    @jax.jit
    def rounds(h):
        def body(i, carry):
            prev, out = carry
            tokens = walk(base[i], prev, h)
            return tokens[:, -1], out.at[i].set(tokens)
        return lax.fori_loop(0, 2, body, (anchor[0], jnp.zeros((2, b, k), jnp.int32)))[1]

    np.testing.assert_array_equal(rounds(chead), rounds(head))


# ---------------------------------------------------------------------------------------------
# Errors and routing
# ---------------------------------------------------------------------------------------------

def test_certified_head_fields_are_checked(rng):
    head, chead = certified_head(rng, 64, 16)
    base, anchor = jnp.asarray(rng.normal(0, 1, (2, 2, 64)), jnp.float32), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match=r"head.w2 of a CertifiedMarkovHead must be the unquantized W2"):
        jax_markov.walk(base, anchor, jax_markov.CertifiedMarkovHead(chead.quantized, head.w2[:, :8],
                                                                      chead.residual_norm))
    with pytest.raises(ValueError, match=r"head.residual_norm must be float32 \[V\] = \[64\]"):
        jax_markov.walk(base, anchor, jax_markov.CertifiedMarkovHead(chead.quantized, head.w2,
                                                                      chead.residual_norm.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match="head.quantized of a CertifiedMarkovHead must be a QuantizedMarkovHead"):
        jax_markov.walk(base, anchor, jax_markov.CertifiedMarkovHead(head, head.w2, chead.residual_norm))


def test_sharding_walk_refuses_a_certified_head(rng):
    from jax_markov import sharding

    _, chead = certified_head(rng, 64, 16)
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(TypeError, match="does not walk a CertifiedMarkovHead yet"):
        sharding.walk(jnp.zeros((2, 2, 64)), jnp.zeros(2, jnp.int32), chead, mesh=mesh)


def test_cuda_lowering_walks_a_certified_head_up_to_its_batch_limit(rng):
    """On cuda (lowered for it on any machine) a certified head of up to 64 requests (tokens only)
    lowers to the custom call with the certificate's two operands where the CUDA module is built; more
    requests lower the reference with impl="auto", and impl="ffi" says why, naming the limit."""
    _, chead = certified_head(rng, 64, 256)

    def lowered(impl, batch):
        base = jnp.asarray(rng.normal(0, 1, (batch, 3, 64)), jnp.bfloat16)
        anchor = jnp.arange(batch, dtype=jnp.int32)
        f = jax.jit(lambda x, a, h: jax_markov.walk(x, a, h, impl=impl).tokens)
        return f.trace(base, anchor, chead).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered("auto", 65)
    assert "custom_call @jax_markov_walk" not in text and "stablehlo.while" in text
    with pytest.raises(ValueError, match=r"impl='ffi' on cuda: .*(CertifiedMarkovHead for B <= 8 requests.*got B = 65|"
                                         r"CUDA module is not built)"):
        lowered("ffi", 65)
    if native.cuda_available():
        for batch in (1, 2, 5, 16, 17, 64):  # the digit kernel's, the digit pairs', EREGS's, the transposed kernel's
            assert _custom_call_operands(lowered("auto", batch)) == 12  # the walk's ten, w2_exact, residual_norm
        assert _custom_call_operands(lowered("ffi", 1)) == 12
    else:
        assert "custom_call @jax_markov_walk" not in lowered("auto", 2)


def test_flax_head_int8_certified():
    nnx = pytest.importorskip("flax.nnx")
    import jax_markov.flax as jmf

    v, r = 96, 16
    module = jmf.MarkovHead(v, r, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3), zero_w2=False, init_std=0.3,
                            markov_quantization="int8-certified")
    chead = module.head()
    assert isinstance(chead, jax_markov.CertifiedMarkovHead)
    np.testing.assert_array_equal(chead.w2, module.markov_w2[...])
    want = jax_markov.quantize(jax_markov.MarkovHead(module.markov_w1[...], module.markov_w2[...]), certified=True)
    np.testing.assert_array_equal(chead.quantized.q, want.quantized.q)
    np.testing.assert_array_equal(chead.residual_norm, want.residual_norm)
    rng = np.random.default_rng(4)
    base = jnp.asarray(rng.normal(0, 1, (3, 4, v)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, v, 3), jnp.int32)
    np.testing.assert_array_equal(module.walk(base, anchor, impl="reference").tokens,
                                  reference.walk(base, anchor, module.head().unquantized).tokens)
    module.markov_quantization = "int8"
    assert isinstance(module.head(), jax_markov.QuantizedMarkovHead) and module.markov_w2_residual_norm is None
