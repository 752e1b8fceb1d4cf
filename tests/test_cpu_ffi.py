"""The CPU custom call (`jax_markov.walk(..., impl="ffi")` on cpu) against `jax_markov.reference.walk`.

Every test draws fresh random inputs (never zeros) from its own seed, printed with the test's output
and reproducible with JAX_MARKOV_TEST_SEED=<seed>.

Parity rules (SPEC.md, "Numerics and parity"):
- tokens are equal, except at near-ties: a mismatch is allowed only at a step where the reference's
  best score and the reference's score of the token the custom call chose differ by less than
  TIE_RTOL * (1 + |best|) (plus one unit in the last place of the logits dtype, times 1/T, when the
  logits are rounded to bf16/f16 before choosing: an fp32 difference in the last bit can round
  to the neighbouring bf16/f16 value). After a mismatch the walks diverge, so the rest of that
  request is not compared. At most 1 + B*K/100 mismatches are allowed per call (in practice none).
- logits (up to and including a request's first mismatching step) are allclose with the
  per-dtype rtol/atol of LOGITS_TOL; -inf and NaN must sit at the same places.
- embeds (same steps) are equal bit for bit.
Exact ties, NaN and inf rows have no tolerance at all.

Without the compiled module these tests skip, unless JAX_MARKOV_REQUIRE_NATIVE=1 (CI), where they fail.
"""
from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_markov
from jax_markov import native, reference
from jax_markov.philox import gumbel_noise

REQUIRE_NATIVE = os.environ.get("JAX_MARKOV_REQUIRE_NATIVE", "") not in ("", "0")
ROOT = Path(__file__).resolve().parents[1]

TIE_RTOL = 1e-4
LOGITS_TOL = {  # logits dtype -> (rtol, atol): fp32 sums in another order, then one rounding
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (8e-3, 1e-5),  # one bf16 ulp is 2^-8 relative
    jnp.dtype(jnp.float16): (1e-3, 1e-5),  # one f16 ulp is 2^-11 relative
}

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def test_cpu_module_is_built():
    """Fails loudly when CI asks for the native module and it is missing."""
    if not native.cpu_available():
        if REQUIRE_NATIVE:
            pytest.fail("JAX_MARKOV_REQUIRE_NATIVE=1 but jax_markov._markov_cpu is not importable: the CPU custom "
                        "call was not built (pip install . must compile ffi/cpu/)")
        pytest.skip("jax_markov._markov_cpu is not built")
    assert callable(native._markov_cpu.handler)
    assert native._markov_cpu.isa() in ("avx2", "generic")


needs_native = pytest.mark.skipif(not native.cpu_available() and not REQUIRE_NATIVE,
                                  reason="jax_markov._markov_cpu is not built")
pytestmark = needs_native


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("JAX_MARKOV_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.name}: seed {seed} (rerun with JAX_MARKOV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture(params=["native", "generic"])
def isa(request):
    """Runs a test on the SIMD path this CPU gets, and again on the portable path."""
    if not native.cpu_available():
        pytest.fail("the CPU module is not built")
    before = native._markov_cpu.isa()
    if request.param == "generic":
        native._markov_cpu.set_isa("generic")
    yield native._markov_cpu.isa()
    native._markov_cpu.set_isa("auto" if before != "generic" else "generic")


# ------------------------------------------------------------------------------------------------
# inputs


def make_head(rng, vocab, rank, *, w1_dtype=jnp.bfloat16, w2_dtype=jnp.int8, v_target=None, w1_scale=1.0):
    """A random head: W1 ~ N(0, 1), W2 ~ N(0, 1/r) so that the bias is O(1) like the base logits."""
    v_target = vocab if v_target is None else v_target
    w1 = (rng.standard_normal((v_target, rank)) * w1_scale).astype(np.float32)
    w2 = (rng.standard_normal((vocab, rank)) / np.sqrt(rank)).astype(np.float32)
    if w2_dtype == jnp.int8:
        return quantize(jnp.asarray(w1, w1_dtype), w2)
    return jax_markov.MarkovHead(jnp.asarray(w1, w1_dtype), jnp.asarray(w2, w2_dtype))


def quantize(w1, w2):
    """jax_markov.quantize (SPEC.md's int8 layout) in numpy: no per-shape compilation in the tests."""
    w2 = np.asarray(w2, np.float32)
    amax = np.max(np.abs(w2), axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.round(w2 / scale[:, None]), -127, 127).astype(np.int8)
    return jax_markov.QuantizedMarkovHead(w1=jnp.asarray(w1), q=jnp.asarray(q), scale=jnp.asarray(scale))


def test_numpy_quantize_matches(rng):
    w2 = rng.standard_normal((300, 40)).astype(np.float32)
    w2[7] = 0.0
    w1 = jnp.asarray(rng.standard_normal((300, 40)), jnp.bfloat16)
    want, got = jax_markov.quantize(jax_markov.MarkovHead(w1, jnp.asarray(w2))), quantize(w1, w2)
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_array_equal(got.scale, want.scale)


def make_base(rng, batch, steps, vocab, dtype=jnp.float32, scale=2.0):
    return jnp.asarray(rng.standard_normal((batch, steps, vocab)) * scale, dtype)


def make_sampling(rng, batch, mode):
    """temperature / key / position for 'greedy' (None), 'sampled' or 'mixed' rows."""
    if mode == "greedy":
        return {}
    temperature = rng.uniform(0.3, 2.0, batch).astype(np.float32)
    if mode == "mixed":
        temperature[rng.permutation(batch)[: max(1, batch // 2)]] = 0.0
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), batch)
    position = rng.integers(0, 2**20, batch).astype(np.int32)
    return dict(temperature=jnp.asarray(temperature), key=keys, position=jnp.asarray(position))


_ARRAY_KWARGS = ("temperature", "key", "position", "d2t")


@functools.lru_cache(maxsize=None)
def _jitted(fn, static_items):
    return jax.jit(functools.partial(fn, **dict(static_items)))


def walk(impl, base, anchor, head, **kw):
    """jax.jit of the custom call (impl='ffi') or of the reference (impl='reference')."""
    arrays = {k: v for k, v in kw.items() if k in _ARRAY_KWARGS and v is not None}
    static = tuple(sorted((k, v) for k, v in kw.items() if k not in _ARRAY_KWARGS))
    if impl == "reference":
        fn = _jitted(reference.walk, static)
    else:
        fn = _jitted(jax_markov.walk, static + (("impl", impl),))
    return jax.block_until_ready(fn(base, anchor, head, **arrays))


# ------------------------------------------------------------------------------------------------
# the parity check


def numpy_gumbel(k0, k1, v, position):
    """SPEC.md's noise g(v) in numpy (word v mod 4 of Philox4x32-10 at (v // 4, position, 0x40000000, 0)),
    to judge near-ties; broadcasts its arguments. (The walk itself is checked against jax_markov.philox.)"""
    m = np.uint64(0xFFFFFFFF)
    v = np.asarray(v, np.uint64)
    c0, c1 = v // np.uint64(4), np.asarray(position, np.uint64) & m
    c2, c3 = np.uint64(0x40000000), np.uint64(0)
    k0, k1 = np.asarray(k0, np.uint64), np.asarray(k1, np.uint64)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m, (k1 + np.uint64(0xBB67AE85)) & m
    word = np.choose((v % np.uint64(4)).astype(np.int64), np.broadcast_arrays(c0, c1, c2, c3))
    u = ((word >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -np.log(-np.log(u))


def test_numpy_gumbel_matches_jax(rng):
    key = rng.integers(0, 2**32, 2, dtype=np.uint32)
    v, pos = np.arange(3000, dtype=np.uint32), np.uint32(rng.integers(0, 2**31))
    want = np.asarray(gumbel_noise((key[0], key[1]), v, pos))
    np.testing.assert_allclose(numpy_gumbel(key[0], key[1], v, pos), want, rtol=1e-6, atol=1e-6)


def reference_scores(ref_logits, kw, steps):
    """The reference's choice scores [B, K, V] from its logits (already rounded to logits_dtype)."""
    logits = np.asarray(ref_logits, np.float32)
    if kw.get("temperature") is None:
        return logits
    temperature = np.asarray(kw["temperature"], np.float32)
    sampled = temperature > 0
    inv_t = np.where(sampled, np.float32(1) / np.where(sampled, temperature, 1), 0).astype(np.float32)
    key = np.asarray(jax.random.key_data(kw["key"]))
    position = np.asarray(kw["position"]).astype(np.int64)
    vocab = logits.shape[-1]
    noise = numpy_gumbel(key[:, 0, None, None], key[:, 1, None, None], np.arange(vocab)[None, None, :],
                         (position[:, None] + np.arange(steps))[:, :, None])
    with np.errstate(invalid="ignore"):
        scores = np.where(logits == -np.inf, -np.inf, logits * inv_t[:, None, None] + noise)  # -inf scores -inf
    return np.where(sampled[:, None, None], scores, logits)


def check_parity(got, want, kw, *, label=""):
    """Asserts the rules of the module docstring; returns the number of near-tie mismatches."""
    tokens, ref_tokens = np.asarray(got.tokens), np.asarray(want.tokens)
    batch, steps = ref_tokens.shape
    assert tokens.shape == ref_tokens.shape and tokens.dtype == np.int32
    logits_dtype = jnp.dtype(kw.get("logits_dtype", jnp.float32))
    ref_logits = np.asarray(want.logits, np.float32)  # the reference always returns them (see compare)
    scores = reference_scores(want.logits, kw, steps)
    vocab = ref_logits.shape[-1]
    vocab_size = kw.get("vocab_size") or vocab
    d2t = kw.get("d2t")
    if d2t is not None:  # tests build injective maps: invert target -> draft
        targets = np.arange(vocab) + np.asarray(d2t)
        to_draft = {int(t): v for v, t in enumerate(targets)}
    else:
        to_draft = {}
    temperature = kw.get("temperature")
    temperature = np.zeros(batch, np.float32) if temperature is None else np.asarray(temperature)

    compared_steps = np.full(batch, steps)  # per request: steps 0..n-1 are comparable
    mismatches = []
    for b in range(batch):
        for k in range(steps):
            if tokens[b, k] == ref_tokens[b, k]:
                continue
            want_v = to_draft.get(int(ref_tokens[b, k]), int(ref_tokens[b, k]))
            got_v = to_draft.get(int(tokens[b, k]), int(tokens[b, k]))
            where = f"{label} request {b} step {k}: custom call chose {tokens[b, k]}, reference {ref_tokens[b, k]}"
            assert 0 <= got_v < vocab_size, f"{where}: chose a padding or out-of-range column"
            best, chosen = float(scores[b, k, want_v]), float(scores[b, k, got_v])
            tol = TIE_RTOL * (1 + abs(best))
            if logits_dtype != jnp.float32 and kw.get("return_logits"):
                ulp = float(np.spacing(np.abs(np.asarray(ref_logits[b, k, want_v], logits_dtype))).astype(np.float32))
                tol += ulp * (1.0 / temperature[b] if temperature[b] > 0 else 1.0)
            assert abs(best - chosen) < tol, (f"{where}: not a near-tie, reference scores best {best!r} vs chosen "
                                              f"{chosen!r} (tolerance {tol:.3g})")
            mismatches.append((b, k))
            compared_steps[b] = k + 1  # logits / embeds of the mismatching step still share prev
            break
    assert len(mismatches) <= 1 + batch * steps // 100, f"{label}: too many near-tie mismatches: {mismatches}"

    if kw.get("return_logits"):
        assert got.logits is not None and got.logits.dtype == logits_dtype
        assert got.logits.shape == (batch, steps, vocab)
        rtol, atol = LOGITS_TOL[logits_dtype]
        got_logits = np.asarray(got.logits, np.float32)
        for b in range(batch):
            n = compared_steps[b]
            np.testing.assert_allclose(got_logits[b, :n], ref_logits[b, :n], rtol=rtol, atol=atol, equal_nan=True,
                                       err_msg=f"{label} logits of request {b}")
        if vocab_size < vocab:
            assert np.all(got_logits[:, :, vocab_size:] == -np.inf), f"{label}: padding logits are not -inf"
    else:
        assert got.logits is None
    if kw.get("return_embeds"):
        assert got.embeds is not None and got.embeds.dtype == want.embeds.dtype
        got_e, want_e = np.asarray(got.embeds), np.asarray(want.embeds)
        for b in range(batch):
            n = compared_steps[b]
            np.testing.assert_array_equal(got_e[b, :n].view(np.uint8), want_e[b, :n].view(np.uint8),
                                          err_msg=f"{label} embeds of request {b}")
    else:
        assert got.embeds is None
    return len(mismatches)


def compare(base, anchor, head, *, label="", **kw):
    """Runs both implementations and checks parity. The reference always returns its logits (in the
    requested logits dtype, which is what it chose from) so that near-ties can be judged."""
    got = walk("ffi", base, anchor, head, **kw)
    ref_kw = dict(kw, return_logits=True, logits_dtype=kw.get("logits_dtype", jnp.float32) if kw.get("return_logits")
                  else jnp.float32)
    want = walk("reference", base, anchor, head, **ref_kw)
    check_parity(got, want, kw, label=label)
    return got, want


# ------------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("batch,steps,vocab,rank", [
    (1, 1, 1000, 256), (1, 7, 4099, 256), (2, 3, 1001, 64), (3, 4, 2003, 256), (5, 2, 1777, 100),
    (7, 5, 3001, 24), (16, 3, 2500, 256), (4, 3, 999, 5), (33, 2, 1203, 40),
])
@pytest.mark.parametrize("w2_dtype", [jnp.int8, jnp.bfloat16])
def test_greedy_shapes(rng, isa, batch, steps, vocab, rank, w2_dtype):
    head = make_head(rng, vocab, rank, w2_dtype=w2_dtype)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, return_logits=True, return_embeds=True, label=f"{isa} B={batch} K={steps} V={vocab}")


@pytest.mark.parametrize("mode", ["sampled", "mixed"])
@pytest.mark.parametrize("batch,steps,vocab", [(1, 3, 1000), (4, 4, 2999), (9, 2, 1500)])
def test_sampled_and_mixed(rng, isa, mode, batch, steps, vocab):
    head = make_head(rng, vocab, 256)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, return_logits=True, return_embeds=True, label=f"{isa} {mode}",
            **make_sampling(rng, batch, mode))


def test_sampled_peaked_logits(rng):
    """Sharp distributions (where most noise is never computed) and a very low temperature."""
    batch, steps, vocab = 6, 4, 4001
    head = make_head(rng, vocab, 128)
    base = make_base(rng, batch, steps, vocab, scale=30.0)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "sampled")
    sampling["temperature"] = jnp.asarray([0.01, 0.5, 1.0, 5.0, 100.0, 1e-6], jnp.float32)
    compare(base, anchor, head, return_logits=True, label="peaked", **sampling)


def test_sampling_is_reproducible(rng):
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
def test_dtypes(rng, base_dtype, w2_dtype, logits_dtype, w1_dtype, mode):
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
def test_exact_ties(rng, isa, logits_dtype):
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


def test_ties_signed_zero_and_inf(rng, isa):
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
def test_nan_rows(rng, isa, mode):
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
def test_padding(rng, isa, mode, vocab, vocab_size):
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
def test_noise_is_version_2_and_masked_columns_are_never_sampled(rng, isa, temperature):
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
def test_infinite_temperature_with_padding_and_masked_columns(rng, isa, mode):
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
def test_overflow_agrees_with_the_reference(rng, isa, batch, w2_dtype):
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


def test_nan_scale_row_is_chosen_like_the_float_heads_nan_row(rng, isa):
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


def test_ids_wider_than_int32_are_clamped_before_the_call(rng):
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


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_d2t(rng, isa, mode):
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
def test_logit_scale(rng, isa, logit_scale):
    batch, steps, vocab = 4, 4, 1800
    head = make_head(rng, vocab, 96, w2_dtype=jnp.float32)
    base = make_base(rng, batch, steps, vocab, scale=0.5)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    compare(base, anchor, head, logit_scale=logit_scale, return_logits=True, return_embeds=True, label="scale",
            **make_sampling(rng, batch, "mixed"))


def test_anchor_clamped(rng, isa):
    """Anchor ids outside [0, V_target) are clamped, never read out of bounds."""
    batch, steps, vocab = 5, 2, 1300
    head = make_head(rng, vocab, 32)
    base = make_base(rng, batch, steps, vocab)
    anchor = jnp.asarray([-1, -(2**31), vocab, vocab + 12345, 2**31 - 1], jnp.int32)
    got, _ = compare(base, anchor, head, return_embeds=True, label="clamp")
    w1 = np.asarray(head.w1)
    np.testing.assert_array_equal(np.asarray(got.embeds)[:, 0], w1[[0, 0, vocab - 1, vocab - 1, vocab - 1]])


def test_embeds_follow_tokens(rng):
    """embeds[b, k] = W1[prev_k] exactly: the anchor, then the tokens."""
    batch, steps, vocab = 3, 5, 2222
    head = make_head(rng, vocab, 80, w1_dtype=jnp.float16, w2_dtype=jnp.float16)
    base = make_base(rng, batch, steps, vocab, dtype=jnp.float16)
    anchor = np.asarray(rng.integers(0, vocab, batch), np.int32)
    got = walk("ffi", base, jnp.asarray(anchor), head, return_embeds=True)
    prev = np.concatenate([anchor[:, None], np.asarray(got.tokens)[:, :-1]], axis=1)
    np.testing.assert_array_equal(np.asarray(got.embeds), np.asarray(head.w1)[prev])


def test_large_vocab(rng):
    """The released head's shape: V = 151936, r = 256 (int8), with logits, embeds, mixed rows."""
    batch, steps, vocab = 2, 3, 151936
    head = make_head(rng, vocab, 256)
    base = make_base(rng, batch, steps, vocab, dtype=jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    sampling = make_sampling(rng, batch, "sampled")
    sampling["temperature"] = sampling["temperature"].at[0].set(0.0)
    compare(base, anchor, head, return_logits=True, logits_dtype=jnp.bfloat16, return_embeds=True,
            vocab_size=vocab - 100, label="V=151936", **sampling)


# ------------------------------------------------------------------------------------------------
# transformations and repeated calls


def test_jit_and_auto_use_the_custom_call(rng):
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


def test_lowering_has_custom_call_and_attributes(rng):
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


def test_two_calls_and_identical_bits(rng):
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


def test_many_small_calls(rng):
    """Back-to-back calls on small vocabularies (pool tasks that start after the caller took every
    chunk must not touch a finished call): same inputs, same tokens, every time."""
    heads = [make_head(rng, vocab, 256) for vocab in (2100, 3001)]  # large enough to use the pool
    f = jax.jit(lambda b, a, h: jax_markov.walk(b, a, h, impl="ffi").tokens)
    inputs = [(make_base(rng, 3, 4, h.draft_vocab), jnp.asarray(rng.integers(0, h.draft_vocab, 3), jnp.int32), h)
              for h in heads]
    first = [np.asarray(f(*x)) for x in inputs]
    for i in range(60):
        np.testing.assert_array_equal(f(*inputs[i % 2]), first[i % 2])


def test_batch_invariance(rng):
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


def test_while_loop_decode(rng):
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


def test_vmap_head_unmapped(rng, isa):
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


def test_vmap_head_mapped(rng):
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


# ------------------------------------------------------------------------------------------------
# errors from the handler itself (shapes the Python API would have refused)


def _raw_call(base, anchor, w1, w2, scale, temperature, key, position, d2t, *, vocab_size, logits_shape=(0,)):
    batch, steps, _ = base.shape
    outs = (jax.ShapeDtypeStruct((batch, steps), jnp.int32), jax.ShapeDtypeStruct(logits_shape, jnp.float32),
            jax.ShapeDtypeStruct((0,), w1.dtype))
    call = jax.ffi.ffi_call(native.TARGET, outs)
    return jax.jit(lambda *a: call(*a, vocab_size=np.int64(vocab_size), logit_scale=np.float32(1.0), sampling=False))(
        base, anchor, w1, w2, scale, temperature, key, position, d2t)


def test_handler_errors(rng):
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


# ------------------------------------------------------------------------------------------------
# the benchmark script


def test_benchmark_quick(tmp_path):
    """benchmarks/benchmark_markov_walk.py --quick runs and writes its table (in a temporary folder)."""
    script = ROOT / "benchmarks" / "benchmark_markov_walk.py"
    if not script.exists():
        pytest.skip("no benchmark script in this checkout")
    run = subprocess.run([sys.executable, str(script), "--quick", "--out-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    table = (tmp_path / "cpu.md").read_text()
    assert "custom call" in table and "reference" in table
    assert (tmp_path / "cpu.json").exists()
