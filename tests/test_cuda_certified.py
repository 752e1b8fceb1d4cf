"""The sm_90 kernels walking a CertifiedMarkovHead (ffi/cuda/walk/certified.cuh up to 16 requests,
ffi/cuda/transposed/certified.cuh for 17-64), on the GPU (skipped cleanly without one).

- Greedy rows choose the unquantized head's tokens: those of the reference walking
  `chead.unquantized` and of the bf16-head kernel, up to near-ties at fp32 rounding (the kernel
  re-scores with exact products summed in fp32, in its own order), including the constructed cases of
  tests/certified_cases.py where the plain int8 walk provably chooses another token (there at step 0
  exactly), also at V = 151936 with the pair placed as a lane's best and second, in a streamed tile
  and in two CTAs.
- Sampled rows are the plain int8 kernel's, and the returned logits are the int8 logits (teacher forced
  along the certified tokens where the greedy rows went another way).
- `_markov_cuda.certified_stats()`: every greedy decision counted; on random heads the grid's int8
  keys and bounds certify most choices (few exact rounds, few columns re-scored); every constructed
  disagreement takes an exact round; every row re-scored where the bound cannot be used (an infinite
  e, an element of e too large for the digits, a logit_scale that could overflow a bias) and lanes that
  re-score all their rows where many columns tie.
Every test draws fresh random inputs from its own seed, printed with its output and reproducible with
JAX_MARKOV_TEST_SEED=<seed>; outputs land on poisoned (NaN) device memory.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from jax_markov import native
from tests import certified_cases
from tests.cuda_cases import NEAR_TIE, poison_device_memory

pytestmark = pytest.mark.skipif(not native.cuda_gpu_available(),
                                reason="needs a CUDA GPU and the jax_markov CUDA module")

V = 151936
# An exact round re-scores the columns of each CTA that come near the grid's int8 best: a few a CTA,
# far below V. Where the head's bias is small beside the base logits' gaps (the benchmarks' heads),
# the int8 keys and bounds certify most choices (about 8 % of decisions have a second candidate
# there: a NumPy model of the bound); the O(1) biases of random_heads take an exact round at about
# half of them (25-57 of 112 decisions on an H100).
MAX_RESCORED_FRACTION = 0.02
MAX_CTA_RESCORED = 64
# In the transposed kernel a thread whose third-best score reaches the threshold re-scores its every row
# of the request: 16 of each of its warpgroup's tiles (96 at V = 151936 on 132 SMs).
MAX_CTA_RESCORED_TRANSPOSED = 256
# The small-bias heads' exact rounds: at most the count that `decisions` independent decisions, each
# taking one at this rate (above the model's 8 %), exceed with probability below EXACT_ROUND_TAIL.
# (One request's seven decisions are few: a bound of a quarter of them failed on an H100 with two.)
SMALL_BIAS_EXACT_ROUND_RATE = 0.1
EXACT_ROUND_TAIL = 1e-4


def most_exact_rounds(decisions: int) -> int:
    """The least k with P(X > k) < EXACT_ROUND_TAIL for X ~ Binomial(decisions, SMALL_BIAS_EXACT_ROUND_RATE)."""
    p = SMALL_BIAS_EXACT_ROUND_RATE
    above = 1.0
    for k in range(decisions + 1):
        above -= math.comb(decisions, k) * p ** k * (1 - p) ** (decisions - k)
        if above < EXACT_ROUND_TAIL:
            return k
    return decisions


@pytest.fixture
def rng(fresh_rng):
    """Every test here on a fresh seed (conftest's fresh_rng)."""
    return fresh_rng


@pytest.fixture
def stats():
    """Reads (and zeroes) the CUDA certified walks' counters of the first GPU."""
    ordinal = jax.devices("cuda")[0].local_hardware_id
    native._markov_cuda.enable_certified_stats(ordinal)
    native._markov_cuda.certified_stats(ordinal, reset=True)
    return lambda: native._markov_cuda.certified_stats(ordinal, reset=True)


def random_heads(rng, vocab, *, w1_dtype, w2_dtype=jnp.bfloat16):
    """(MarkovHead, CertifiedMarkovHead) with an O(1) bias, so that int8 and W2 disagree at some steps."""
    w1 = jnp.asarray(rng.standard_normal((vocab, 256)), w1_dtype)
    w2 = jnp.asarray(rng.standard_normal((vocab, 256)) / 16.0, w2_dtype)
    head = jm.MarkovHead(w1, w2)
    return head, jm.quantize(head, certified=True)


def walk(base, anchor, head, impl="ffi", **kw):
    batch, steps, vocab = base.shape
    poison_device_memory(batch * steps * vocab * 4 * 2)
    out = jm.walk(base, anchor, head, impl=impl, **kw)
    jax.block_until_ready(out)
    return out


def assert_unquantized_tokens(got, base, anchor, chead, kw, tokens_match):
    """Greedy rows of `got` against the reference walking the unquantized head (its logits, rounded as
    the call rounds them, are the scores) and against the bf16-head kernel; near-ties only."""
    ref = walk(base, anchor, chead.unquantized, "reference", **dict(kw, return_logits=True))
    greedy = np.asarray(kw.get("temperature", np.zeros(base.shape[0]))) <= 0
    narrow = jnp.dtype(kw.get("logits_dtype", jnp.float32)) != jnp.float32 and kw.get("return_logits", False)
    rtol = 2.0 ** -7 if narrow else NEAR_TIE  # one unit of bf16 where the walk chooses from rounded logits
    scores = np.asarray(ref.logits.astype(jnp.float32))[greedy]
    for other in (ref.tokens, walk(base, anchor, chead.unquantized, **kw).tokens):
        tokens_match(scores, np.asarray(other)[greedy], np.asarray(got.tokens)[greedy], NEAR_TIE, rtol=rtol,
                     d2t=kw.get("d2t"), max_mismatch_rows=1)


def int8_logits_along(tokens, base, anchor, qhead, **kw):
    """The plain int8 kernel's logits of each step walked from the given tokens (a K = 1 call a step)."""
    prev = np.concatenate([np.asarray(anchor)[:, None], np.asarray(tokens)[:, :-1]], axis=1)
    return np.concatenate([np.asarray(walk(base[:, k:k + 1], jnp.asarray(prev[:, k], jnp.int32), qhead,
                                           return_logits=True, **kw).logits.astype(jnp.float32))
                           for k in range(base.shape[1])], axis=1)


def assert_int8_logits(got, base, anchor, chead, logits_dtype, **kw):
    want = int8_logits_along(got.tokens, base, anchor, chead.quantized, logits_dtype=logits_dtype, **kw)
    narrow = jnp.dtype(logits_dtype) != jnp.float32
    # the same int8 logits, up to the last fp32 bit (each instance fuses its own multiply-adds) and so
    # one unit of a narrower dtype
    np.testing.assert_allclose(np.asarray(got.logits.astype(jnp.float32)), want, rtol=2.0 ** -7 if narrow else 1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("case,logits_dtype", certified_cases.CASE_PARAMS)
@pytest.mark.parametrize("batch", [1, 2, 4, 8])  # the digit kernel, the digit pairs at NT = 1 and 2
def test_constructed_disagreements(rng, stats, assert_tokens_match, case, logits_dtype, batch):
    c = certified_cases.CASES[case](rng, logits_dtype=logits_dtype, batch=batch, steps=4)
    chead = jm.quantize(c.head, certified=True)
    kw = {} if logits_dtype is None else dict(return_logits=True, logits_dtype=logits_dtype)
    plain = walk(c.base, c.anchor, chead.quantized, **kw)
    np.testing.assert_array_equal(plain.tokens[:, 0], c.int8)  # the construction: int8 chooses otherwise
    stats()
    got = walk(c.base, c.anchor, chead, **kw)
    counted = stats()
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    assert_unquantized_tokens(got, c.base, c.anchor, chead, kw, assert_tokens_match)
    steps = c.base.shape[1]
    assert counted["decisions"] == batch * steps and counted["uncertified"] == 0, counted
    assert counted["exact_rounds"] >= batch, counted  # each request's step 0
    assert counted["rescored"] >= 2 * batch, counted  # at least both columns of each step-0 pair
    if logits_dtype is not None:
        assert_int8_logits(got, c.base, c.anchor, chead, logits_dtype)


# the digit kernel, the digit pairs, EREGS, the transposed kernel
@pytest.mark.parametrize("batch,vocab", [(1, 512), (2, 512), (5, 512), (12, 4096), (24, 4096)])
def test_constructed_disagreement_at_the_last_step(rng, stats, assert_tokens_match, batch, vocab):
    """one_large_element walked one step: the exact round of the last step, which every CTA takes
    after the last exchange (not CTA 0 alone, as the plain walk's last choice)."""
    c = certified_cases.one_large_element(rng, vocab=vocab, batch=batch, steps=1)
    base = c.base.astype(jnp.bfloat16)
    chead = jm.quantize(c.head, certified=True)
    np.testing.assert_array_equal(walk(base, c.anchor, chead.quantized).tokens[:, 0], c.int8)
    stats()
    got = walk(base, c.anchor, chead)
    counted = stats()
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    assert counted["decisions"] == batch and counted["exact_rounds"] == batch, counted
    # the next call on the stream finds the workspace cleared: the same walk again
    np.testing.assert_array_equal(walk(base, c.anchor, chead).tokens, got.tokens)


def placed_pairs(placement, batch, plan):
    """Each request's (exact, int8) columns for certified_cases.one_large_element, placed in the CTAs'
    tiles of `plan` (CTA 3 + 5b for request b; warp w holds resident tiles w, w + 16, ... and the
    lanes of group g rows g and g + 8 of each of its tiles):
    - lane_rows: rows g and g + 8 of one resident tile, the int8 best and second of one lane;
    - lane_tiles: row g of two resident tiles of one warp, 16 tiles apart (one lane again);
    - streamed: two lanes' rows of one streamed tile;
    - two_ctas: the same row of two neighbouring CTAs (the grid's exchange of exact keys)."""
    rows, resident = plan["tiles_per_cta"] * 16, plan["resident_tiles"]
    assert 22 <= resident and resident + 3 <= plan["tiles_per_cta"], plan  # room for every placement
    pairs = []
    for b in range(batch):
        first = (3 + 5 * b) * rows
        large = first + 16 * (resident + 2 if placement == "streamed" else 5) + 3
        exact = large + {"lane_rows": 8, "lane_tiles": 16 * 16, "streamed": 1, "two_ctas": rows}[placement]
        pairs.append((exact, large))
    return pairs


@pytest.mark.parametrize("placement", ["lane_rows", "lane_tiles", "streamed", "two_ctas"])
@pytest.mark.parametrize("logits_dtype", [None, jnp.bfloat16])
def test_constructed_disagreements_placed(rng, stats, assert_tokens_match, placement, logits_dtype):
    """one_large_element at V = 151936 from bf16 base logits (tokens only: the plain form; logits out:
    the any form), its pair placed where the filter must keep the exact winner as a lane's second
    candidate, in a streamed tile, or in another CTA than the int8 winner (placed_pairs). Two requests,
    so that both lanes of a group that finish a request (t = 0 and t = 2) have a pair."""
    batch = 2
    kw = {} if logits_dtype is None else dict(return_logits=True, logits_dtype=logits_dtype)
    plan = native.cuda_launch_plan(batch, 4, V, 256, jnp.bfloat16, jnp.int8, base_dtype=jnp.bfloat16,
                                   logits_dtype=logits_dtype, certified=True)[0]
    assert ",certified," in plan["name"] and ("form=plain" if logits_dtype is None else "form=any") in plan["name"], plan
    c = certified_cases.one_large_element(rng, logits_dtype=logits_dtype, vocab=V, batch=batch, steps=4,
                                          pairs=placed_pairs(placement, batch, plan))
    base = c.base.astype(jnp.bfloat16)
    chead = jm.quantize(c.head, certified=True)
    # the construction holds in bf16 base logits: the unquantized and the int8 walks part at step 0
    np.testing.assert_array_equal(walk(base, c.anchor, chead.unquantized, "reference", **kw).tokens[:, 0], c.exact)
    np.testing.assert_array_equal(walk(base, c.anchor, chead.quantized, **kw).tokens[:, 0], c.int8)
    stats()
    got = walk(base, c.anchor, chead, **kw)
    counted = stats()
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    assert_unquantized_tokens(got, base, c.anchor, chead, kw, assert_tokens_match)
    assert counted["decisions"] == batch * 4 and counted["uncertified"] == 0, counted
    assert counted["exact_rounds"] >= batch and counted["rescored"] >= 2 * batch, counted
    if logits_dtype is not None:
        assert_int8_logits(got, base, c.anchor, chead, logits_dtype)


BF16, F32 = jnp.bfloat16, jnp.float32
# Each certified walk's calls: the digit kernel's 1-2 requests (tokens only: the plain form; logits out:
# the any form), the digit pairs' 3-8 (logits out from a bf16 W1 only; lane (g, t): rows g and g + 8 of
# request 4i + t), EREGS's 9-16 (tokens only; lane (g, t): rows 8h + 2t + c of requests g and g + 8) and
# the transposed kernel's 17-64 (tokens only, packed up to 32; 33-64 from a bf16 or f16 W1 only).
RANDOM_SHAPES = ([(b, w1, lg, "digits,certified") for b in (1, 2) for w1 in (BF16, F32) for lg in (None, BF16, F32)] +
                 [(b, w1, lg, "pairs,certified") for b in (3, 8) for w1, lg in ((BF16, None), (F32, None), (BF16, BF16),
                                                                               (BF16, F32))] +
                 [(b, w1, None, "eregs,certified") for b in (9, 16) for w1 in (BF16, F32)] +
                 [(24, BF16, None, "packed,certified>"), (32, F32, None, "packed,certified>"),
                  (64, BF16, None, "transposed<base=bfloat16,certified>")])


@pytest.mark.parametrize("batch,w1_dtype,logits_dtype,kernel", RANDOM_SHAPES)
def test_random_benchmark_shapes(rng, stats, assert_tokens_match, batch, w1_dtype, logits_dtype, kernel):
    """V = 151936, K = 7, bf16 base logits, in every certified walk (RANDOM_SHAPES)."""
    (plan,) = native.cuda_launch_plan(batch, 7, V, 256, w1_dtype, jnp.int8, base_dtype=jnp.bfloat16,
                                      logits_dtype=logits_dtype, certified=True)
    assert kernel in plan["name"], plan
    head, chead = random_heads(rng, V, w1_dtype=w1_dtype)
    base = jnp.asarray(rng.standard_normal((batch, 7, V)) * 2.0, jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, V, batch), jnp.int32)
    kw = {} if logits_dtype is None else dict(return_logits=True, logits_dtype=logits_dtype)
    stats()
    got = walk(base, anchor, chead, **kw)
    counted = stats()
    assert_unquantized_tokens(got, base, anchor, chead, kw, assert_tokens_match)
    decisions = batch * 7
    assert counted["decisions"] == decisions and counted["uncertified"] == 0, counted
    assert counted["rescored"] <= MAX_RESCORED_FRACTION * V * decisions, counted
    most = MAX_CTA_RESCORED_TRANSPOSED if "transposed" in plan["name"] else MAX_CTA_RESCORED
    assert counted["max_cta_rescored"] <= most, counted
    if "transposed" in plan["name"]:
        assert counted["exact_rounds"] == decisions, counted  # every step of 17 or more requests takes one
    # In an exact round, a lane whose second-best column reaches the threshold re-scores all its rows.
    assert counted["lane_fallbacks"] <= 3 * decisions, counted
    print(f"certified ({plan['name']}): {counted['exact_rounds']} exact rounds in {decisions} decisions, "
          f"{counted['rescored']} columns re-scored by {counted['cta_sets']} CTAs, {counted['lane_fallbacks']} lane "
          f"fallbacks")
    if logits_dtype is not None:
        assert_int8_logits(got, base, anchor, chead, logits_dtype)


@pytest.mark.parametrize("batch,vocab,kernel", [(12, 4096, "eregs,certified"), (12, 60010, "eregs,certified"),
                                                (24, 4096, "packed,certified>"),
                                                (40, 60008, "transposed<base=bfloat16,certified>")])
def test_constructed_disagreements_of_9_to_64_requests(rng, stats, assert_tokens_match, batch, vocab, kernel):
    """one_large_element from bf16 base logits: at step 0 the int8 walk chooses another column than the
    unquantized one for every request, and EREGS's (9-16) or the transposed kernel's (17-64) certified
    walk chooses the latter (V = 4096: a tile or two a CTA; 60008 and 60010: resident tiles, a last tile
    partly outside V)."""
    c = certified_cases.one_large_element(rng, vocab=vocab, batch=batch, steps=4)
    base = c.base.astype(jnp.bfloat16)
    chead = jm.quantize(c.head, certified=True)
    (plan,) = native.cuda_launch_plan(batch, 4, vocab, 256, jnp.bfloat16, jnp.int8, base_dtype=jnp.bfloat16,
                                      certified=True)
    assert kernel in plan["name"], plan
    # the construction holds in bf16 base logits: the unquantized and the int8 walks part at step 0
    np.testing.assert_array_equal(walk(base, c.anchor, chead.unquantized, "reference").tokens[:, 0], c.exact)
    np.testing.assert_array_equal(walk(base, c.anchor, chead.quantized).tokens[:, 0], c.int8)
    stats()
    got = walk(base, c.anchor, chead)
    counted = stats()
    np.testing.assert_array_equal(got.tokens[:, 0], c.exact)
    assert_unquantized_tokens(got, base, c.anchor, chead, {}, assert_tokens_match)
    assert counted["decisions"] == batch * 4 and counted["uncertified"] == 0, counted
    assert counted["exact_rounds"] >= batch and counted["rescored"] >= 2 * batch, counted


@pytest.mark.parametrize("logits_dtype", [None, jnp.bfloat16])
def test_mixed_batch(rng, stats, assert_tokens_match, reference_scores, logits_dtype):
    """One greedy and one sampled request in a call: the greedy row certified, the sampled row the plain
    int8 kernel's (same noise, int8 scores)."""
    head, chead = random_heads(rng, V, w1_dtype=jnp.bfloat16)
    base = jnp.asarray(rng.standard_normal((2, 7, V)) * 2.0, jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, V, 2), jnp.int32)
    kw = dict(temperature=jnp.asarray([0.0, 0.8], jnp.float32),
              key=jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 2),
              position=jnp.asarray(rng.integers(0, 4096, 2), jnp.int32))
    if logits_dtype is not None:
        kw.update(return_logits=True, logits_dtype=logits_dtype)
    stats()
    got = walk(base, anchor, chead, **kw)
    counted = stats()
    assert counted["decisions"] == 7, counted  # the greedy row's steps only
    assert_unquantized_tokens(got, base, anchor, chead, kw, assert_tokens_match)
    int8 = walk(base, anchor, chead.quantized, **dict(kw, return_logits=True, logits_dtype=logits_dtype or jnp.float32))
    scores = reference_scores(int8.logits, kw["temperature"], kw["key"], kw["position"])
    assert_tokens_match(np.asarray(scores)[1:], np.asarray(int8.tokens)[1:], np.asarray(got.tokens)[1:], NEAR_TIE,
                        rtol=NEAR_TIE, max_mismatch_rows=1)
    if logits_dtype is not None:
        np.testing.assert_allclose(np.asarray(got.logits.astype(jnp.float32))[1],
                                   np.asarray(int8.logits.astype(jnp.float32))[1], rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 2, 6])
@pytest.mark.parametrize("logits_dtype", [None, jnp.bfloat16])
def test_batch_whose_rows_all_sample_walks_the_plain_kernel(rng, stats, batch, logits_dtype):
    """Every row sampled: nothing to certify, so the plan's plain sampled launch walks (the certified
    ones return at once): no decision counted, tokens and logits bit for bit the int8 head's walk. With
    one row greedy the certified launch walks again and counts that row's decisions."""
    head, chead = random_heads(rng, V, w1_dtype=jnp.bfloat16)
    base = jnp.asarray(rng.standard_normal((batch, 7, V)) * 2.0, jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, V, batch), jnp.int32)
    kw = dict(temperature=jnp.asarray(rng.uniform(0.5, 1.5, batch), jnp.float32),
              key=jax.random.split(jax.random.key(int(rng.integers(1 << 30))), batch),
              position=jnp.asarray(rng.integers(0, 4096, batch), jnp.int32))
    if logits_dtype is not None:
        kw.update(return_logits=True, logits_dtype=logits_dtype)
    stats()
    got = walk(base, anchor, chead, **kw)
    assert stats()["decisions"] == 0
    int8 = walk(base, anchor, chead.quantized, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(int8.tokens))
    if logits_dtype is not None:
        np.testing.assert_array_equal(np.asarray(got.logits.astype(jnp.float32)),
                                      np.asarray(int8.logits.astype(jnp.float32)))
    kw["temperature"] = kw["temperature"].at[0].set(0.0)
    walk(base, anchor, chead, **kw)
    assert stats()["decisions"] == 7


def test_masked_padding_nan_d2t_and_logit_scale(rng, assert_tokens_match):
    """The spec's rules on a constructed near-tie: the exact winner masked (-inf) or in the padding
    (vocab_size), d2t and a negative logit_scale; a NaN base logit (the first NaN wins)."""
    c = certified_cases.near_tie(rng, batch=2, steps=3, vocab=4096)
    chead = jm.quantize(c.head, certified=True)
    base = np.asarray(c.base).copy()
    base[0, 0, c.exact[0]] = -np.inf  # masked: the next best exact column
    vocab = base.shape[2]
    d2t = jnp.asarray(rng.integers(0, 3, vocab), jnp.int32)
    for kw in (dict(), dict(vocab_size=int(c.exact[1])), dict(d2t=d2t, logit_scale=-0.75)):
        got = walk(jnp.asarray(base), c.anchor, chead, **kw)
        assert_unquantized_tokens(got, jnp.asarray(base), c.anchor, chead, kw, assert_tokens_match)
    base[1, 0, [c.int8[1], c.exact[1]]] = np.nan
    got = walk(jnp.asarray(base), c.anchor, chead)
    assert got.tokens[1, 0] == min(c.int8[1], c.exact[1])


@pytest.mark.parametrize("batch", [1, 2])
def test_masked_vocabulary(rng, stats, assert_tokens_match, batch):
    """Base logits of -inf outside one range of 4096 columns (a constrained decoder's mask): most CTAs
    hold masked rows only, and their best, -inf, is far below any bound of the winner's: the int8 keys
    certify most choices as on unmasked heads; the tokens are the unquantized walk's."""
    head, chead = random_heads(rng, V, w1_dtype=jnp.bfloat16)
    base = np.full((batch, 7, V), -np.inf, np.float32)
    lo = int(rng.integers(0, V - 4096))
    base[:, :, lo:lo + 4096] = rng.standard_normal((batch, 7, 4096)) * 2.0
    base = jnp.asarray(base, jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, V, batch), jnp.int32)
    stats()
    got = walk(base, anchor, chead)
    counted = stats()
    assert np.all((np.asarray(got.tokens) >= lo) & (np.asarray(got.tokens) < lo + 4096))
    assert_unquantized_tokens(got, base, anchor, chead, {}, assert_tokens_match)
    decisions = batch * 7
    assert counted["decisions"] == decisions and counted["uncertified"] == 0, counted
    assert counted["rescored"] <= MAX_RESCORED_FRACTION * V * decisions, counted


@pytest.mark.parametrize("batch", [1, 2, 8, 16])  # the digit kernel, the digit pairs, EREGS
def test_small_biases_are_certified_without_rescoring(rng, stats, assert_tokens_match, batch):
    """The benchmarks' heads (W1 and W2 of 0.05 N(0, 1), base logits N(0, 1)): the grid's int8 keys,
    second-best scores and margins single out most choices, with no unquantized row read."""
    w1 = jnp.asarray(rng.standard_normal((V, 256)) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((V, 256)) * 0.05, jnp.bfloat16)
    chead = jm.quantize(jm.MarkovHead(w1, w2), certified=True)
    base = jnp.asarray(rng.standard_normal((batch, 7, V)), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, V, batch), jnp.int32)
    stats()
    got = walk(base, anchor, chead)
    counted = stats()
    assert_unquantized_tokens(got, base, anchor, chead, {}, assert_tokens_match)
    decisions = batch * 7
    assert counted["decisions"] == decisions and counted["uncertified"] == 0, counted
    assert counted["exact_rounds"] <= most_exact_rounds(decisions), counted
    print(f"B = {batch}: {counted['exact_rounds']} exact rounds in {decisions} decisions, {counted['rescored']} columns "
          f"re-scored")


@pytest.mark.parametrize("batch", [2, 24])  # the digit kernel (float32 base logits), the transposed kernel (bf16)
@pytest.mark.parametrize("element, w2_divisor, kw, uncertified", [
    (np.inf, 16.0, dict(), None),
    (np.inf, 16.0, dict(logit_scale=1e37), "every decision"),
    # finite, but above RowShift's limit (its integers saturate); W2 small enough that 127 s ||e||_1
    # stays below 2^124, so that only that limit makes the bound unusable
    (3.2e38, 256.0, dict(), None),
])
def test_every_row_rescored_where_the_bound_cannot_be_used(rng, stats, assert_tokens_match, element, w2_divisor, kw,
                                                           uncertified, batch):
    """An infinity in e (W1[anchor]), an element of e too large for the digits, or a logit_scale that
    could overflow a bias: every CTA re-scores all its rows of that step, and the tokens are still the
    unquantized walk's (step 0 of request 0 has infinite logits, or logits that one element of e
    dominates by far: no tolerance there)."""
    vocab = 20011 if batch == 2 else 20008
    w1 = rng.standard_normal((vocab, 256)).astype(np.float32)
    w1[5, 3] = element
    head = jm.MarkovHead(jnp.asarray(w1), jnp.asarray(rng.standard_normal((vocab, 256)) / w2_divisor, jnp.bfloat16))
    chead = jm.quantize(head, certified=True)
    base = jnp.asarray(rng.standard_normal((batch, 3, vocab)), jnp.float32 if batch == 2 else jnp.bfloat16)
    anchor = jnp.asarray([5, *rng.integers(6, vocab, batch - 1)], jnp.int32)
    stats()
    got = walk(base, anchor, chead, **kw)
    counted = stats()
    if uncertified == "every decision":
        uncertified = batch * 3
    ref = walk(base, anchor, chead.unquantized, "reference", return_logits=True, **kw)
    assert ref.tokens[0, 0] == got.tokens[0, 0]
    assert_tokens_match(np.asarray(ref.logits), np.asarray(ref.tokens), np.asarray(got.tokens), NEAR_TIE,
                        rtol=NEAR_TIE, max_mismatch_rows=1)
    assert counted["uncertified"] == (uncertified or counted["uncertified"]) >= 1, counted
    assert counted["rescored"] >= counted["uncertified"] * vocab, counted


@pytest.mark.parametrize("batch", [2, 4, 12, 40])  # the digit kernel, the digit pairs, EREGS, transposed
def test_ties_make_lanes_rescore_all_their_rows(rng, stats, batch):
    """W2 rows repeating every 8 rows and base logits too: the best class ties at thousands of columns.
    The grid's int8 keys cannot single out a choice (the winner's CTA has its second at the same
    score): every decision takes an exact round. At this V every warp scores two tiles or more, so that
    a lane's rows (g and g + 8 of each, one class; EREGS: 8h + 2t + c; transposed: 16 t .. 16 t + 15 of
    each tile, two of each class) hold two candidates or more (transposed: three) and it re-scores all of
    them; the lowest index still wins, as in the unquantized walk."""
    vocab = 69632  # 33 tiles a CTA on 132 SMs
    w1 = jnp.asarray(rng.standard_normal((vocab, 256)), jnp.bfloat16)
    w2 = jnp.asarray(np.tile(rng.standard_normal((8, 256)) / 16.0, (vocab // 8, 1)), jnp.bfloat16)
    head = jm.MarkovHead(w1, w2)
    chead = jm.quantize(head, certified=True)
    base = jnp.asarray(np.tile(rng.standard_normal((batch, 3, 8)), (1, 1, vocab // 8)), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    got = walk(base, anchor, chead)
    counted = stats()
    want = walk(base, anchor, head, "reference")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert np.all(np.asarray(got.tokens) < 8)
    assert counted["exact_rounds"] == batch * 3 and counted["lane_fallbacks"] > 0, counted


def test_decode_loop_and_auto(rng, stats):
    """impl="auto" walks a certified head of 1-2 requests on the kernel (its counters move), inside a
    jitted decode loop too; 17 requests at an odd V walk on the reference, 24 at V = 20008 on the kernel."""
    head, chead = random_heads(rng, 20011, w1_dtype=jnp.bfloat16)
    base = jnp.asarray(rng.standard_normal((2, 2, 5, 20011)), jnp.bfloat16)
    anchor = jnp.asarray(rng.integers(0, 20011, 2), jnp.int32)

    @jax.jit
    def rounds(h):
        def body(i, carry):
            prev, out = carry
            tokens = jm.walk(base[i], prev, h).tokens
            return tokens[:, -1], out.at[i].set(tokens)
        return jax.lax.fori_loop(0, 2, body, (anchor, jnp.zeros((2, 2, 5), jnp.int32)))[1]

    assert "custom_call @jax_markov_walk" in rounds.lower(chead).as_text()
    got = np.asarray(rounds(chead))
    assert stats()["decisions"] == 2 * 2 * 5
    want = np.asarray(rounds(head))
    assert (got == want).mean() > 0.9  # the bf16-head kernel: equal up to near-ties (and the walk after them)
    wide = jnp.asarray(rng.standard_normal((17, 5, 20011)), jnp.bfloat16)
    text = jax.jit(lambda x, a, h: jm.walk(x, a, h).tokens).lower(wide, jnp.zeros(17, jnp.int32), chead).as_text()
    assert "custom_call @jax_markov_walk" not in text
    with pytest.raises(ValueError, match="B <= 8 requests"):
        jm.walk(wide, jnp.zeros(17, jnp.int32), chead, impl="ffi")
    _, even = random_heads(rng, 20008, w1_dtype=jnp.bfloat16)
    wider = jnp.asarray(rng.standard_normal((24, 5, 20008)), jnp.bfloat16)
    text = jax.jit(lambda x, a, h: jm.walk(x, a, h).tokens).lower(wider, jnp.zeros(24, jnp.int32), even).as_text()
    assert "custom_call @jax_markov_walk" in text
