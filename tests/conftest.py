"""Shared test helpers: random heads and inputs, and the near-tie token comparison of docs/spec.md.

Use them as fixtures (the importlib import mode keeps conftest out of `import`):

    def test_x(make_head, make_inputs, assert_tokens_match): ...

- make_head(rng, vocab, rank, *, v_target=None, w1_dtype=..., w2_dtype=...): a MarkovHead, or a
  QuantizedMarkovHead (via jax_markov.quantize) when w2_dtype is "int8".
- make_inputs(rng, batch, steps, vocab, *, v_target=None, dtype=..., sampled=False, position=...):
  dict(base_logits=, anchor=, [temperature=, key=, position=]) ready for `walk(**inputs, head=...)`.
  With sampled=True the batch mixes greedy (T = 0) and sampled rows and every request has its own key.
- assert_tokens_match(ref_scores, tokens_ref, tokens_got, tol, *, rtol=0, d2t=None,
  max_mismatch_rows=None) -> (mismatch_rows, prefix_mask).
- reference_scores(logits, temperature=None, key=None, position=None): what a walk chose from,
  rebuilt from its float32 logits (the ref_scores argument of assert_tokens_match).
- check_parity(base, anchor, head, kw, *, logits_dtype=..., **walk_kw): the GPU tests' kernel walk
  against the reference (tests/cuda_cases.py).
"""
from __future__ import annotations

import functools
import os
import secrets
import sys

import numpy as np
import pytest

# The tests import the benchmark scripts as `from benchmarks import ...`; `benchmarks` lives in the
# repository root, which is not installed. The root goes at the END of sys.path: the installed
# jax_markov (site-packages, with its compiled modules) still comes first, and a source checkout
# that is not installed finds its jax_markov here.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

import jax
import jax.numpy as jnp

import jax_markov


def random_head(rng, vocab, rank, *, v_target=None, w1_dtype=jnp.bfloat16, w2_dtype=jnp.bfloat16, scale=0.5):
    """A head with N(0, scale) weights; w2_dtype "int8" quantizes a float32 W2."""
    v_target = vocab if v_target is None else v_target
    w1 = jnp.asarray(rng.normal(0.0, scale, (v_target, rank)).astype(np.float32), w1_dtype)
    if isinstance(w2_dtype, str) and w2_dtype == "int8":
        w2 = jnp.asarray(rng.normal(0.0, scale, (vocab, rank)).astype(np.float32))
        return jax_markov.quantize(jax_markov.MarkovHead(w1, w2))
    w2 = jnp.asarray(rng.normal(0.0, scale, (vocab, rank)).astype(np.float32), w2_dtype)
    return jax_markov.MarkovHead(w1, w2)


def random_inputs(rng, batch, steps, vocab, *, v_target=None, dtype=jnp.float32, sampled=False,
                  position=None, logit_std=2.0):
    """Fresh random (never zero) base logits and anchors; with sampled=True also temperatures
    (greedy and sampled rows mixed), one PRNG key per request and positions."""
    v_target = vocab if v_target is None else v_target
    base = rng.normal(0.0, logit_std, (batch, steps, vocab)).astype(np.float32)
    out = dict(base_logits=jnp.asarray(base, dtype),
               anchor=jnp.asarray(rng.integers(0, v_target, batch), jnp.int32))
    if sampled:
        temps = rng.uniform(0.5, 1.5, batch).astype(np.float32)
        temps[::3] = 0.0  # rows 0, 3, 6, ... greedy
        seed = int(rng.integers(0, 2**31))
        out["temperature"] = jnp.asarray(temps)
        out["key"] = jax.random.split(jax.random.key(seed), batch)
        pos = rng.integers(0, 10_000, batch) if position is None else np.broadcast_to(position, (batch,))
        out["position"] = jnp.asarray(pos, jnp.int32)
    return out


def _column_of(tokens, d2t):
    """Draft column of each returned token (tokens are target ids when d2t is given)."""
    tokens = np.asarray(tokens)
    if d2t is None:
        return tokens
    d2t = np.asarray(d2t)
    first = {}
    for v in range(d2t.shape[0]):
        first.setdefault(int(v + d2t[v]), v)
    return np.vectorize(lambda t: first.get(int(t), -1), otypes=[np.int64])(tokens)


def tokens_match(ref_scores, tokens_ref, tokens_got, tol, *, rtol=0.0, d2t=None, max_mismatch_rows=None):
    """Token parity up to near-ties (docs/spec.md "Numerics and parity").

    ref_scores [B, K, V]: the scores the *reference* chose from (the logits for greedy rows,
    l * (1/T) + g for sampled rows). Per request, steps are compared left to right; where the
    tokens differ, the reference's score of its own token and of the other token must differ by
    at most tol + rtol * |best| (finite, non-NaN), and the rest of that row is not compared (it
    walks from a different previous token). tokens are target ids when d2t is given.

    Returns (number of rows with a near-tie mismatch, prefix_mask [B, K] bool: steps whose
    previous tokens all matched, where logits/embeds can be compared).
    """
    ref_scores = np.asarray(jnp.asarray(ref_scores, jnp.float32))
    tokens_ref, tokens_got = np.asarray(tokens_ref), np.asarray(tokens_got)
    assert tokens_ref.shape == tokens_got.shape == ref_scores.shape[:2], (
        tokens_ref.shape, tokens_got.shape, ref_scores.shape)
    col_ref, col_got = _column_of(tokens_ref, d2t), _column_of(tokens_got, d2t)
    batch, steps, vocab = ref_scores.shape
    mask = np.zeros((batch, steps), bool)
    mismatch_rows, problems = 0, []
    for b in range(batch):
        for k in range(steps):
            mask[b, k] = True
            if tokens_ref[b, k] == tokens_got[b, k]:
                continue
            cr, cg = int(col_ref[b, k]), int(col_got[b, k])
            ok = 0 <= cr < vocab and 0 <= cg < vocab
            if ok:
                best, other = ref_scores[b, k, cr], ref_scores[b, k, cg]
                ok = (np.isfinite(best) and np.isfinite(other)
                      and abs(float(best) - float(other)) <= tol + rtol * abs(float(best)))
            if not ok:
                problems.append(f"request {b} step {k}: reference {tokens_ref[b, k]} (score "
                                f"{ref_scores[b, k, cr] if 0 <= cr < vocab else '?'}), got {tokens_got[b, k]} "
                                f"(score {ref_scores[b, k, cg] if 0 <= cg < vocab else '?'}), tol {tol} rtol {rtol}")
            mismatch_rows += 1
            break
    assert not problems, "tokens differ beyond near-ties:\n" + "\n".join(problems[:10])
    if max_mismatch_rows is not None:
        assert mismatch_rows <= max_mismatch_rows, f"{mismatch_rows} near-tie rows > {max_mismatch_rows}"
    return mismatch_rows, mask


def reference_scores(logits, temperature=None, key=None, position=None):
    """The scores a walk chose from, given its logits [B, K, V] (docs/spec.md): the logits for greedy
    rows, l * (1/T) + g(v) for sampled rows (temperature > 0), -inf where l is -inf (also at 1/T = 0).
    For assert_tokens_match."""
    logits = jnp.asarray(logits).astype(jnp.float32)
    if temperature is None:
        return logits
    batch = logits.shape[0]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    position = jnp.broadcast_to(jnp.asarray(position, jnp.int32), (batch,))
    return _sampled_scores(logits, temperature, key, position)


@jax.jit
def _sampled_scores(logits, temperature, key, position):
    from jax_markov.philox import gumbel_noise

    _, steps, vocab = logits.shape
    sampled = temperature > 0
    inv_t = jnp.float32(1.0) / jnp.where(sampled, temperature, 1.0)
    pos = position[:, None, None] + jnp.arange(steps, dtype=jnp.int32)[None, :, None]
    noise = gumbel_noise((key[:, 0, None, None], key[:, 1, None, None]),
                         jnp.arange(vocab, dtype=jnp.int32)[None, None, :], pos)
    scores = jnp.where(logits == -jnp.inf, -jnp.inf, logits * inv_t[:, None, None] + noise)  # -inf stays -inf
    return jnp.where(sampled[:, None, None], scores, logits)


def pytest_collection_modifyitems(config, items):
    """JAX_MARKOV_TEST_SHARD="i/n" keeps every n-th test from the i-th (0-based) in collection order,
    so that n processes side by side (benchmarks/run_gpu.sh's GPU tests) each run a similar mix."""
    shard = os.environ.get("JAX_MARKOV_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"JAX_MARKOV_TEST_SHARD={shard!r}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = items[index::count]


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@pytest.fixture
def fresh_rng(request):
    """A generator on a fresh random seed (JAX_MARKOV_TEST_SEED fixes it), printed with the test's
    name so that a failure can be rerun on the same inputs."""
    seed = int(os.environ.get("JAX_MARKOV_TEST_SEED", secrets.randbits(32)))
    print(f"{request.node.name}: seed {seed} (rerun with JAX_MARKOV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture
def make_head():
    return random_head


@pytest.fixture
def make_inputs():
    return random_inputs


@pytest.fixture(name="reference_scores")
def reference_scores_fixture():
    return reference_scores


@pytest.fixture(name="assert_tokens_match")
def assert_tokens_match_fixture():
    return tokens_match


@pytest.fixture
def check_parity():
    """The GPU tests' kernel-against-reference check (tests/cuda_cases.py), as
    check_parity(base, anchor, head, kw, *, logits_dtype=..., **walk_kw) -> near-tie rows."""
    from tests import cuda_cases

    return functools.partial(cuda_cases.check_parity, reference_scores, tokens_match)
