"""Constructed walks where the plain int8 head provably chooses another token than the unquantized
head, for the certified walk's tests (tests/test_certified.py, tests/cpu_ffi/test_certified.py).

Each case is a bf16 MarkovHead, float32 base logits and anchors such that, at step 0 of every
request, the exact logits (float64 from the bf16 weights) put column `exact[b]` first and the int8
logits (float64 from q and scale) put column `int8[b]` first, each by a stated gap far above fp32
rounding, and above bf16/f16 rounding too (the pair's logits lie near 0), except in rounding_tie.
Later steps walk on from the exact choice with random base logits.

- one_large_element: e = 0.5 s (s a random sign vector) and a W2 row s[0], s[j] w_small: its scale is
  1/127 and each small element, just above half a step, rounds up to a whole step, all in e's
  direction, so that its int8 bias is about 0.5 above the exact one; a second row 0.25 s (exact in
  int8) is put 0.125 above it in exact logits. Gaps: 0.125 exact, about 0.37 int8.
- near_tie: random rows and e; of the columns of one 64-row block (one chunk of the CPU walk), the
  pair whose quantization errors differ most, put 1/4 of that difference apart in exact logits and
  so 3/4 of it apart the other way in int8 logits.
- rounding_tie (logits rounded to bf16/f16 only): see its docstring.
All other columns of step 0 sit 100 below. The pair of a request lies in one 64-row block.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import jax_markov

BLOCK = 64  # the CPU walk's chunks are multiples of 64 rows where V = 512 (ffi/cpu/handler.cc)


@dataclasses.dataclass
class Case:
    head: jax_markov.MarkovHead
    base: jnp.ndarray  # [B, K, V] float32
    anchor: jnp.ndarray  # [B] int32
    exact: np.ndarray  # [B] the unquantized walk's token at step 0
    int8: np.ndarray  # [B] the plain int8 walk's token at step 0


def _biases(head, e):
    """Exact and int8 biases [V] of embedding e (float64, from the stored weights)."""
    q = jax_markov.quantize(head)
    w2 = np.asarray(head.w2, np.float64)
    return w2 @ e, np.asarray(q.scale, np.float64) * (np.asarray(q.q, np.float64) @ e)


def _rounded(x, logits_dtype):
    return x if logits_dtype is None else np.asarray(x, logits_dtype).astype(np.float64)


def _random_rows(rng, vocab, rank):
    w1 = rng.normal(0.0, 1.0, (vocab, rank)).astype(np.float32)
    w2 = (rng.normal(0.0, 1.0, (vocab, rank)) / np.sqrt(rank)).astype(np.float32)
    return w1, w2


def _finish(rng, w1, w2, anchor, pairs, levels, steps, w1_dtype, logits_dtype):
    """The case of rows w1, w2 (float32; W2 stored in bf16) where request b's step 0 has pairs[b] =
    (exact, int8) columns at exact logits levels[b] and every other column 100 below; checks that the
    walk of either head, choosing from logits rounded to logits_dtype (None: not rounded), would
    choose as named."""
    batch, vocab = len(anchor), w2.shape[0]
    head = jax_markov.MarkovHead(jnp.asarray(w1, w1_dtype), jnp.asarray(w2, jnp.bfloat16))
    base = rng.normal(0.0, 2.0, (batch, steps, vocab))
    for b, (pair, level) in enumerate(zip(pairs, levels)):
        exact, int8 = _biases(head, np.asarray(head.w1[anchor[b]], np.float64))
        base[b, 0] = rng.normal(-100.0, 1.0, vocab) - exact
        base[b, 0, list(pair)] = np.asarray(level) - exact[list(pair)]
        assert np.argmax(_rounded(base[b, 0] + exact, logits_dtype)) == pair[0], "construction failed"
        assert np.argmax(_rounded(base[b, 0] + int8, logits_dtype)) == pair[1], "construction failed"
    pairs = np.asarray(pairs)
    return Case(head, jnp.asarray(base, jnp.float32), jnp.asarray(anchor, jnp.int32), pairs[:, 0], pairs[:, 1])


def _plant_large_element(rng, w1, w2, anchor, exact_row, large):
    """e = W1[anchor] = 0.5 s for a random sign vector s; W2[large] = s[0], s[j] w_small (its int8 bias
    about 0.5 above the exact one); W2[exact_row] = 0.25 s (exact in int8; bias 32)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    w_small = np.asarray(0.5 / 127, bf16)  # the smallest bf16 value above half a step of a row of max 1
    if float(w_small) <= 0.5 / 127:
        w_small = np.nextafter(w_small, np.asarray(1, bf16))
    s = rng.choice([-1.0, 1.0], w1.shape[1])
    w1[anchor] = 0.5 * s
    w2[large] = s * float(w_small)
    w2[large, 0] = s[0]
    w2[exact_row] = 0.25 * s


def one_large_element(rng, *, logits_dtype=None, vocab=512, rank=256, batch=3, steps=3, w1_dtype=jnp.bfloat16,
                      pairs=None):
    """pairs: each request's (exact, int8) columns where the caller places them; by default (c + 1, c) for
    a random even c (one block)."""
    w1, w2 = _random_rows(rng, vocab, rank)
    anchor = rng.choice(vocab, batch, replace=False)
    if pairs is None:
        pairs = [(c + 1, c) for c in rng.choice(vocab // 2, batch, replace=False) * 2]
    for b, (exact, large) in enumerate(pairs):
        _plant_large_element(rng, w1, w2, anchor[b], exact, large)
    return _finish(rng, w1, w2, anchor, pairs, [(0.125, 0.0)] * batch, steps, w1_dtype, logits_dtype)


def near_tie(rng, *, logits_dtype=None, vocab=512, rank=256, batch=3, steps=3, w1_dtype=jnp.bfloat16):
    w1, w2 = _random_rows(rng, vocab, rank)
    head = jax_markov.MarkovHead(jnp.asarray(w1, w1_dtype), jnp.asarray(w2, jnp.bfloat16))
    anchor = rng.choice(vocab, batch, replace=False)
    pairs, levels = [], []
    for b in range(batch):
        exact, int8 = _biases(head, np.asarray(head.w1[anchor[b]], np.float64))
        start = int(rng.integers(vocab // BLOCK)) * BLOCK
        err = (int8 - exact)[start:start + BLOCK]
        top, other = start + int(np.argmin(err)), start + int(np.argmax(err))  # the exact winner errs lowest
        pairs.append((top, other))
        levels.append((float(err.max() - err.min()) / 4, 0.0))
    return _finish(rng, w1, w2, anchor, pairs, levels, steps, w1_dtype, logits_dtype)


def rounding_tie(rng, *, logits_dtype, vocab=512, rank=256, batch=3, steps=3, w1_dtype=jnp.bfloat16):
    """Logits rounded to bf16 or f16 (logits_dtype) only: the exact row (the lower column) at 64 and the
    large-element row at 64.02 read 64 both, and the lower column wins; the int8 logit of the latter,
    about 0.5 higher, reads 64.5. The int8 best is then the higher column, whose lower bound rounds
    to 64 too: a filter that kept only the columns above that bound, and not those within a unit of
    the logits dtype below it, would lose the lower column."""
    w1, w2 = _random_rows(rng, vocab, rank)
    anchor = rng.choice(vocab, batch, replace=False)
    pairs = []
    for b, c in enumerate(rng.choice(vocab // 2, batch, replace=False) * 2):
        _plant_large_element(rng, w1, w2, anchor[b], c, c + 1)
        pairs.append((c, c + 1))
    return _finish(rng, w1, w2, anchor, pairs, [(64.0, 64.02)] * batch, steps, w1_dtype, logits_dtype)


CASES = {"one_large_element": one_large_element, "near_tie": near_tie, "rounding_tie": rounding_tie}
# (case, logits dtype) pairs to test: rounding_tie is one only where the logits are rounded
CASE_PARAMS = [(name, dtype) for name in CASES for dtype in (None, jnp.bfloat16, jnp.float16)
               if name != "rounding_tie" or dtype is not None]
