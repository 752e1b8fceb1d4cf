"""The CPU custom call's tests (`jax_markov.walk(..., impl="ffi")` on cpu against `jax_markov.reference.walk`):
their fixtures and the parity check.

Every test draws fresh random inputs (never zeros) from its own seed, printed with the test's output
and reproducible with JAX_MARKOV_TEST_SEED=<seed>.

Parity rules (docs/spec.md, "Numerics and parity"):
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

Fixtures (tests/conftest.py's `rng` and `make_head` are replaced here):
- rng: a generator with a fresh seed per test; isa: runs a test on the CPU's SIMD path and on the portable one.
- make_head(rng, vocab, rank, *, w1_dtype=, w2_dtype=int8, v_target=, w1_scale=), quantize(w1, w2) (NumPy),
  make_base(rng, batch, steps, vocab, dtype=, scale=), make_sampling(rng, batch, mode).
- walk(impl, base, anchor, head, **kw): jitted, impl "ffi" or "reference"; compare(base, anchor, head, **kw):
  both, and check_parity(got, want, kw) between them; numpy_gumbel(k0, k1, v, position): docs/spec.md's noise.
- REQUIRE_NATIVE: whether JAX_MARKOV_REQUIRE_NATIVE is set.
"""
from __future__ import annotations

import functools
import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import native, reference

REQUIRE_NATIVE = os.environ.get("JAX_MARKOV_REQUIRE_NATIVE", "") not in ("", "0")

TIE_RTOL = 1e-4
LOGITS_TOL = {  # logits dtype -> (rtol, atol): fp32 sums in another order, then one rounding
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (8e-3, 1e-5),  # one bf16 ulp is 2^-8 relative
    jnp.dtype(jnp.float16): (1e-3, 1e-5),  # one f16 ulp is 2^-11 relative
}


@pytest.fixture(autouse=True)
def needs_native():
    """Skips every test here when the module is not built, unless JAX_MARKOV_REQUIRE_NATIVE is set."""
    if not native.cpu_available() and not REQUIRE_NATIVE:
        pytest.skip("jax_markov._markov_cpu is not built")


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
    """jax_markov.quantize (docs/spec.md's int8 layout) in numpy: no per-shape compilation in the tests."""
    w2 = np.asarray(w2, np.float32)
    amax = np.max(np.abs(w2), axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.round(w2 / scale[:, None]), -127, 127).astype(np.int8)
    return jax_markov.QuantizedMarkovHead(w1=jnp.asarray(w1), q=jnp.asarray(q), scale=jnp.asarray(scale))


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
    """docs/spec.md's noise g(v) in numpy (word v mod 4 of Philox4x32-10 at (v // 4, position, 0x40000000, 0)),
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
# the helpers as fixtures


@pytest.fixture(name="REQUIRE_NATIVE")
def require_native_fixture():
    return REQUIRE_NATIVE


@pytest.fixture(name="make_head")
def make_head_fixture():
    return make_head


@pytest.fixture(name="quantize")
def quantize_fixture():
    return quantize


@pytest.fixture(name="make_base")
def make_base_fixture():
    return make_base


@pytest.fixture(name="make_sampling")
def make_sampling_fixture():
    return make_sampling


@pytest.fixture(name="walk")
def walk_fixture():
    return walk


@pytest.fixture(name="compare")
def compare_fixture():
    return compare


@pytest.fixture(name="check_parity")
def check_parity_fixture():
    return check_parity


@pytest.fixture(name="numpy_gumbel")
def numpy_gumbel_fixture():
    return numpy_gumbel
