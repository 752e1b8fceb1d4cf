"""jax_markov.speculative: the rejection sampler and the jitted decode loop.

- Lossless: greedy speculative decoding reproduces the target's own greedy decoding token for
  token, whatever the drafter (random, fitted, bf16 head, int8 head, no head).
- By construction, not by luck of the rounding: the reference `target_decode(verify_block_size=K)`
  runs the target at the verify step's shapes, and a position's logits and KV entries are bitwise
  the same alone (padded to K + 1 rows) and inside a verify block (bf16 weights).
- Distribution: sampled speculative decoding emits the target's distribution. Chi-square tests
  with fixed seeds; a test passes when its p-value is >= P_MIN = 1e-3, and a negative control
  (the same samples against a different temperature's distribution) must fall below 1e-6, which
  shows the sample size can see a wrong distribution.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import jax_markov
from jax_markov import flax as jmf
from jax_markov import philox
from jax_markov import speculative as sp

P_MIN = 1e-3  # chi-square p-value threshold
P_CONTROL = 1e-6  # the negative control must be rejected at least this strongly


def chi_square_p(counts, probs, min_expected=5.0):
    """Pearson chi-square p-value of observed counts against probabilities; cells expected below
    min_expected are pooled into one."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


# -- the rejection sampler alone -----------------------------------------------------------------
def test_greedy_verdicts():
    v = 6
    drafts = jnp.array([[1, 2, 3], [1, 2, 3], [4, 4, 4], [0, 5, 1]])
    choice = jnp.array([[1, 2, 3, 5], [1, 0, 3, 5], [2, 4, 4, 0], [0, 5, 2, 3]])  # target argmax per row
    logits = jax.nn.one_hot(choice, v) * 3.0 + 0.1 * jnp.arange(v)[::-1] / v
    verdict = jax.jit(functools.partial(sp.rejection_sample, fill_value=-7))(drafts, logits)
    np.testing.assert_array_equal(verdict.num_accepted, [3, 1, 0, 2])
    np.testing.assert_array_equal(verdict.next_token, [5, 0, 2, 2])
    np.testing.assert_array_equal(verdict.tokens, [[1, 2, 3, 5], [1, 0, -7, -7], [2, -7, -7, -7], [0, 5, 2, -7]])
    # max_accepted keeps at most that many drafts and continues with the target's own choice there
    capped = jax.jit(functools.partial(sp.rejection_sample, fill_value=-7))(drafts, logits, max_accepted=jnp.int32(1))
    np.testing.assert_array_equal(capped.num_accepted, [1, 1, 0, 1])
    np.testing.assert_array_equal(capped.tokens, [[1, 2, -7, -7], [1, 0, -7, -7], [2, -7, -7, -7], [0, 5, -7, -7]])
    none = sp.rejection_sample(drafts, logits, max_accepted=0)
    np.testing.assert_array_equal(none.tokens[:, 0], choice[:, 0])
    np.testing.assert_array_equal(none.num_accepted, 0)
    # greedy rows of a sampled call decide exactly the same, whatever the draft logits say
    sampled = jax.jit(sp.rejection_sample)(drafts, logits, jnp.zeros((4, 3, v)), temperature=jnp.zeros(4),
                                           key=jax.random.split(jax.random.key(0), 4), position=jnp.arange(4))
    np.testing.assert_array_equal(sampled.tokens[:, :3], jnp.where(verdict.tokens == -7, -1, verdict.tokens)[:, :3])
    # padding columns are never the target's choice
    padded = jax.jit(functools.partial(sp.rejection_sample, vocab_size=5))(drafts[:1], logits[:1].at[0, 0, 5].set(99.0))
    np.testing.assert_array_equal(padded.num_accepted, [3])
    with pytest.raises(ValueError, match="draft_logits are required"):
        sp.rejection_sample(drafts, logits, temperature=jnp.ones(4), key=jnp.zeros((4, 2), jnp.uint32), position=0)
    with pytest.raises(ValueError, match=r"target_logits must be \[B, K\+1, V\]"):
        sp.rejection_sample(drafts, logits[:, :3])


@jax.jit
def _streams(words, pos, many):
    u = sp.accept_uniform(words, pos)
    u_want = philox.uniform_from_bits(philox.philox4x32_10(
        (np.uint32(0), pos.astype(jnp.uint32), np.uint32(0x40000001), np.uint32(0)), (words[:, 0], words[:, 1]))[0])
    g = sp.resample_noise(words, pos, 11)
    bits = philox.philox4x32_10((jnp.arange(11, dtype=jnp.uint32)[None], pos[:, None].astype(jnp.uint32),
                                 np.uint32(0x40000002), np.uint32(0)), (words[:, 0:1], words[:, 1:2]))[0]
    g_want = -jnp.log(-jnp.log(philox.uniform_from_bits(bits)))
    draft_g = philox.gumbel_noise((words[:, 0:1], words[:, 1:2]), jnp.arange(11)[None], pos[:, None])
    u_many = sp.accept_uniform(many, jnp.full(many.shape[0], 9))
    d_many = philox.uniform_from_bits(philox.philox4x32_10(
        (np.uint32(0), np.uint32(9), philox.DRAFT_STREAM, np.uint32(0)), (many[:, 0], many[:, 1]))[0])
    return u, u_want, g, g_want, draft_g, u_many, d_many


def test_random_streams_are_separate_from_the_draft_noise():
    words = jax.random.key_data(jax.random.split(jax.random.key(0), 3))
    many = jax.random.key_data(jax.random.split(jax.random.key(1), 4096))
    u, u_want, g, g_want, draft_g, u_many, d_many = _streams(words, jnp.array([0, 17, 1 << 20]), many)
    np.testing.assert_array_equal(u, u_want)  # acceptance: Philox counter word 2 = 0x40000001
    np.testing.assert_array_equal(g, g_want)  # resampling: counter word 2 = 0x40000002
    assert int(sp.ACCEPT_STREAM) != int(philox.DRAFT_STREAM) != int(sp.RESAMPLE_STREAM)
    assert not np.any(np.isclose(g, draft_g))  # not the walk's noise at the same key and position
    # across many keys the acceptance uniforms are uncorrelated with the draft's uniforms
    assert abs(np.corrcoef(u_many, d_many)[0, 1]) < 0.06


def test_infinite_temperature_keeps_padding_and_masked_columns_out():
    """T = +inf (1/T = 0): the target's choice and the rejection sampler treat -inf (masked) and padding
    columns as probability 0, never as the NaN of -inf * 0, and are uniform over the other columns: the
    drafts (drawn uniformly too) are all accepted and the bonus token is uniform."""
    v, k, n, vocab_size = 8, 2, 20_000, 6
    logits = jnp.asarray([2.0, -jnp.inf, 0.5, -1.0, 3.0, 0.0, 50.0, 50.0])  # 6, 7: padding
    keys = jax.random.split(jax.random.key(8), n)
    temperature = jnp.full((n,), jnp.inf)
    words = jax.random.key_data(keys)
    allowed = [0, 2, 3, 4, 5]

    @jax.jit
    def run(logits, keys, words):
        first = sp.choose_token(jnp.broadcast_to(logits, (n, v)), temperature=temperature, key_words=words,
                                position=jnp.full((n,), 4), vocab_size=vocab_size)
        drafts = jnp.asarray(allowed)[jax.random.randint(jax.random.key(9), (n, k), 0, len(allowed))]
        verdict = sp.rejection_sample(drafts, jnp.broadcast_to(logits, (n, k + 1, v)),
                                      jnp.broadcast_to(logits, (n, k, v)), temperature=temperature, key=keys,
                                      position=jnp.full((n,), 4), vocab_size=vocab_size)
        return first, verdict

    first, verdict = run(logits, keys, words)
    for tokens in (np.asarray(first), np.asarray(verdict.next_token)):
        counts = np.bincount(tokens, minlength=v)
        assert counts[[1, 6, 7]].sum() == 0
        assert chi_square_p(counts[allowed], np.ones(len(allowed))) >= P_MIN
    np.testing.assert_array_equal(verdict.num_accepted, k)
    # the negative control: at T = 1 the same columns are not uniform
    warm = sp.choose_token(jnp.broadcast_to(logits, (n, v)), temperature=jnp.ones(n), key_words=words,
                           position=jnp.full((n,), 4), vocab_size=vocab_size)
    assert chi_square_p(np.bincount(np.asarray(warm), minlength=v)[allowed], np.ones(len(allowed))) < P_CONTROL


def test_one_step_of_rejection_sampling_emits_the_target_distribution():
    """Drafts drawn by the walk from q (a zero head: q = softmax(base)), verified against p: the
    first emitted token (accepted draft or residual resample) must follow p, and so must the
    second one given that the first draft was accepted (p's row 1 is the same for every prefix)."""
    v, k, n = 6, 2, 40000
    p_logits = jnp.log(jnp.array([0.30, 0.05, 0.25, 0.02, 0.18, 0.20]))
    q_logits = jnp.log(jnp.array([0.05, 0.40, 0.10, 0.15, 0.20, 0.10]))
    head = jax_markov.MarkovHead(jnp.zeros((v, 4)), jnp.zeros((v, 4)))
    keys = jax.random.split(jax.random.key(42), n)

    @jax.jit
    def run(keys, p_logits, q_logits, head):  # arguments, not constants: nothing to constant-fold
        base = jnp.broadcast_to(q_logits, (n, k, v))
        walk = jax_markov.walk(base, jnp.zeros(n, jnp.int32), head, temperature=jnp.ones(n), key=keys,
                               position=jnp.full(n, 3), return_logits=True)
        target = jnp.broadcast_to(p_logits, (n, k + 1, v))
        verdicts = [sp.rejection_sample(walk.tokens, target, walk.logits, temperature=jnp.ones(n), key=keys,
                                        position=jnp.full(n, 3), max_accepted=cap) for cap in (None, 0)]
        return walk.tokens, *verdicts

    drafts, verdict, none = run(keys, p_logits, q_logits, head)
    p = np.asarray(jax.nn.softmax(p_logits))
    first = np.asarray(verdict.tokens[:, 0])
    assert chi_square_p(np.bincount(first, minlength=v), p) >= P_MIN
    second = np.asarray(verdict.tokens[:, 1])[np.asarray(verdict.num_accepted) >= 1]
    assert chi_square_p(np.bincount(second, minlength=v), p) >= P_MIN
    # the drafts themselves follow q, not p (the control: the test can tell them apart)
    assert chi_square_p(np.bincount(np.asarray(drafts[:, 0]), minlength=v), np.asarray(jax.nn.softmax(q_logits))) \
        >= P_MIN
    assert chi_square_p(np.bincount(np.asarray(drafts[:, 0]), minlength=v), p) < P_CONTROL
    acc = float(jnp.mean(verdict.num_accepted >= 1))
    assert abs(acc - np.minimum(p, np.asarray(jax.nn.softmax(q_logits))).sum()) < 0.01  # sum min(p, q)
    # max_accepted = 0: every draft set aside, the first token a draw from p whether or not its draft
    # passed the test (which is then not made); without the cap, a rejected draft's row follows the
    # residual (the control: the test tells it from p)
    np.testing.assert_array_equal(none.num_accepted, 0)
    kept = np.asarray(verdict.num_accepted) >= 1
    for rows in (kept, ~kept):
        assert chi_square_p(np.bincount(np.asarray(none.tokens[:, 0])[rows], minlength=v), p) >= P_MIN
    residual = np.maximum(p - np.asarray(jax.nn.softmax(q_logits)), 0)
    rejected = np.bincount(np.asarray(verdict.tokens[:, 0])[~kept], minlength=v)
    assert chi_square_p(rejected, residual / residual.sum()) >= P_MIN
    assert chi_square_p(rejected, p) < P_CONTROL


# -- the decode loop: a bigram-structured target and DSpark drafters -----------------------------------
V, H, K, R = 64, 32, 4, 16
MASK = V - 1
TARGET = jmf.CausalLMConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
DRAFTER = jmf.DSparkConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, mask_token_id=MASK, target_layer_ids=(0, 1),
                           num_target_layers=2, block_size=K, markov_rank=R)


def single_token_logits(target):
    """The target's next-token logits after each single token: its bigram table [V, V]."""
    @nnx.jit
    def forward(model):
        n = model.config.vocab_size
        return model(jnp.arange(n)[:, None], jnp.zeros(n, jnp.int32), model.init_cache(n, 1)).logits[:, 0]
    return forward(target)


def fitted_bias(target):
    table = single_token_logits(target)
    return table - table.mean(axis=1, keepdims=True)


def make_drafters(target):
    fit = jmf.DSparkDrafter(DRAFTER, rngs=nnx.Rngs(1))
    fit.markov_head.fit(fitted_bias(target))
    rnd = jmf.DSparkDrafter(DRAFTER, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(0)
    rnd.markov_head.load_weights(rng.normal(0, 0.5, (V, R)), rng.normal(0, 0.5, (V, R)))
    bf16 = jmf.DSparkDrafter(DRAFTER, rngs=nnx.Rngs(1))
    bf16.markov_head = jmf.MarkovHead(V, R, param_dtype=jnp.bfloat16)
    bf16.markov_head.fit(fitted_bias(target))
    int8 = jmf.DSparkDrafter(DRAFTER, rngs=nnx.Rngs(1))
    int8.markov_head = jmf.MarkovHead(V, R, param_dtype=jnp.bfloat16, markov_quantization="int8")
    int8.markov_head.fit(fitted_bias(target))  # the int8 layout of the bf16 head, made once by fit
    return {"random": (rnd, True), "fitted": (fit, True), "fitted-bf16": (bf16, True),
            "fitted-int8": (int8, True), "no-head": (fit, False)}


@pytest.fixture(scope="module")
def greedy():
    target = jmf.bigram_lm(TARGET, rank=8, sharpness=4.0, context_scale=0.4, silent_tokens=[MASK], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(0, V - 1, (4, 8)), jnp.int32)
    lengths = jnp.array([8, 5, 2, 1])
    ref = sp.target_decode(target, prompt, lengths, max_new_tokens=24)
    runs = {name: sp.speculative_decode(target, drafter, prompt, lengths, max_new_tokens=24, use_markov_head=use)
            for name, (drafter, use) in make_drafters(target).items()}
    return target, prompt, lengths, ref, runs


@pytest.mark.parametrize("name", ["random", "fitted", "fitted-bf16", "fitted-int8", "no-head"])
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(greedy, name):
    target, prompt, lengths, ref, runs = greedy
    res = runs[name]
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    padded = sp.target_decode(target, prompt, lengths, max_new_tokens=24, verify_block_size=K)
    np.testing.assert_array_equal(res.tokens, padded.tokens)  # the reference at the verify step's shapes
    drafter, use = make_drafters(target)[name]
    own = sp.speculative_decode(target, drafter, prompt, lengths, max_new_tokens=24, use_markov_head=use,
                                max_accepted=0)  # the same program, every draft set aside
    np.testing.assert_array_equal(own.tokens, ref.tokens)
    np.testing.assert_array_equal(own.num_accepted, 0)
    np.testing.assert_array_equal(own.num_steps, 23)
    np.testing.assert_array_equal(res.lengths, lengths + 24)
    np.testing.assert_array_equal(ref.num_steps, 23)  # the reference: one forward per token after the first
    # the statistics add up: a histogram per request, accepted drafts, fewer target forwards
    counts = np.asarray(res.acceptance_counts)
    np.testing.assert_array_equal(counts.sum(1), res.num_steps)
    np.testing.assert_array_equal((counts * np.arange(K + 1)).sum(1), res.num_accepted)
    assert np.all(np.asarray(res.num_accepted) + np.asarray(res.num_steps) >= 23)
    print(f"\n{name}: mean acceptance length {res.mean_acceptance_length():.3f} "
          f"(steps per request {np.asarray(res.num_steps).tolist()})")
    if name.startswith("fitted"):  # the lossless check must have seen many accepted drafts
        assert res.mean_acceptance_length() > 2.5
        assert len({tuple(c) for c in counts}) > 1  # requests advanced by different amounts


def test_int8_and_bf16_heads_agree_and_report_their_acceptance(greedy, record_property):
    _, _, _, ref, runs = greedy
    lengths = {name: runs[name].mean_acceptance_length() for name in runs}
    for name, value in lengths.items():
        record_property(f"acceptance_length_{name}", round(value, 4))
    print("\nmean acceptance length (tokens per target forward, K = %d): %s" % (
        K, ", ".join(f"{n} {v:.3f}" for n, v in lengths.items())))
    np.testing.assert_array_equal(runs["fitted-int8"].tokens, runs["fitted-bf16"].tokens)
    np.testing.assert_array_equal(runs["fitted-int8"].tokens, ref.tokens)
    assert lengths["fitted-int8"] > lengths["no-head"] + 0.5 and lengths["fitted-bf16"] > lengths["no-head"] + 0.5
    assert abs(lengths["fitted-int8"] - lengths["fitted-bf16"]) < 0.3


def test_eos_and_max_length_stop_each_request_on_its_own(greedy):
    target, prompt, lengths, ref, _ = greedy
    drafter = make_drafters(target)["fitted"][0]
    gen0 = ref.generated(0)
    eos = int(gen0[9])  # request 0 stops at its 10th token (or earlier, where eos appears first)
    res = sp.speculative_decode(target, drafter, prompt, lengths, max_new_tokens=24, eos_id=eos, pad_id=V)
    for b in range(4):
        full = ref.generated(b)
        stop = int(np.argmax(full == eos)) + 1 if np.any(full == eos) else len(full)
        np.testing.assert_array_equal(res.generated(b), full[:stop])
        assert int(res.lengths[b]) == int(lengths[b]) + stop
        assert np.all(np.asarray(res.tokens[b, int(res.lengths[b]):]) == V)  # pad after the end
    assert int(res.lengths[0]) <= int(lengths[0]) + 10


def test_arguments_are_checked(greedy):
    target, prompt, lengths, _, _ = greedy
    drafter = jmf.DSparkDrafter(DRAFTER)
    with pytest.raises(ValueError, match="prompt_lengths"):
        sp.speculative_decode(target, drafter, prompt, jnp.array([9, 1, 1, 1]), max_new_tokens=4)
    with pytest.raises(ValueError, match="key is required"):
        sp.speculative_decode(target, drafter, prompt, lengths, max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sp.target_decode(target, prompt, lengths, max_new_tokens=0)
    with pytest.raises(ValueError, match="verify_block_size"):
        sp.target_decode(target, prompt, lengths, max_new_tokens=4, verify_block_size=-1)
    other = jmf.DSparkDrafter(dataclasses.replace(DRAFTER, vocab_size=V + 1, draft_vocab_size=None))
    with pytest.raises(ValueError, match="vocab_size"):
        sp.speculative_decode(target, other, prompt, lengths, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_accepted must be in \[0, K = 4\]"):
        sp.speculative_decode(target, drafter, prompt, lengths, max_new_tokens=4, max_accepted=5)


def test_a_position_rounds_alike_alone_on_padded_rows_and_inside_a_verify_block():
    """The reference's footing, bitwise: with bf16 weights (activations rounded to bf16 before every
    GEMM, as on the GPU), the target's logits of a position and the KV entries it writes are the same
    whether the position is row 0 of K + 1 rows padded with other tokens (the reference's step) or row
    j of a verify block, given the same cache before it. A target whose rows mixed (a row's GEMM or
    attention reading the other rows, a norm over the block) fails here."""
    target = jmf.bigram_lm(TARGET, rank=8, sharpness=4.0, context_scale=0.4, silent_tokens=[MASK],
                           rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    rng = np.random.default_rng(5)
    b, p, total = 3, 6, 6 + 2 * (K + 1)
    forward = nnx.jit(lambda model, tokens, start, cache: model(tokens, start, cache))
    prompt = jnp.asarray(rng.integers(0, V - 1, (b, p)), jnp.int32)
    cache = forward(target, prompt, jnp.zeros(b, jnp.int32), target.init_cache(b, total)).cache
    block = jnp.asarray(rng.integers(0, V - 1, (b, K + 1)), jnp.int32)
    inside = forward(target, block, jnp.full(b, p, jnp.int32), cache)
    for j in range(K + 1):  # position p + j alone, after the cache entries of positions < p + j
        padding = jnp.asarray(rng.integers(0, V - 1, (b, K)), jnp.int32)
        alone = forward(target, jnp.concatenate([block[:, j:j + 1], padding], axis=1), jnp.full(b, p + j, jnp.int32),
                        cache)
        np.testing.assert_array_equal(alone.logits[:, 0], inside.logits[:, j])
        cache = alone.cache
    for got, want in zip(cache.k + cache.v, inside.cache.k + inside.cache.v):  # positions up to p + K
        np.testing.assert_array_equal(got[..., :p + K + 1, :], want[..., :p + K + 1, :])


class RecordingLM(jmf.CausalLM):
    """A CausalLM that records the shapes of every forward it traces: (tokens, a layer's keys)."""
    shapes: list = []

    def __call__(self, tokens, start, cache, **kwargs):
        RecordingLM.shapes.append((tuple(tokens.shape), tuple(cache.k[0].shape)))
        return super().__call__(tokens, start, cache, **kwargs)


def test_the_reference_runs_the_target_at_the_verify_steps_shapes(greedy):
    """target_decode(verify_block_size=K) traces the target's forwards at exactly the shapes of
    speculative_decode's (prefill, then K + 1 query rows over a cache of the same length), and
    the plain decode at one row."""
    target, prompt, lengths, ref, runs = greedy
    recording = RecordingLM(TARGET, rngs=nnx.Rngs(0))
    nnx.update(recording, nnx.state(target))
    drafter = make_drafters(target)["fitted"][0]
    traced = {}
    for name, decode in (("reference", functools.partial(sp.target_decode, verify_block_size=K)),
                         ("speculative", functools.partial(sp.speculative_decode, drafter=drafter)),
                         ("plain", sp.target_decode)):
        RecordingLM.shapes.clear()
        out = decode(target=recording, prompt=prompt, prompt_lengths=lengths, max_new_tokens=24)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        traced[name] = list(RecordingLM.shapes)
    b, p = prompt.shape
    cache = (b, TARGET.num_key_value_heads, p + 24 + K + 1, TARGET.head_dim)
    assert traced["reference"] == traced["speculative"] == [((b, p), cache), ((b, K + 1), cache)]
    assert traced["plain"][1][0] == (b, 1)


# -- sampled decoding has the target's distribution -------------------------------------------------------
SV = 8  # tiny vocabulary: every sequence of the first tokens can be enumerated
SMALL_TARGET = jmf.CausalLMConfig(vocab_size=SV, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1)
SMALL_DRAFTER = jmf.DSparkConfig(vocab_size=SV, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, mask_token_id=SV - 1,
                                 target_layer_ids=(0, 1), block_size=3, markov_rank=8)
N_SAMPLES = 16000
NEW = 4  # the first emitted token comes from the prefill; tokens 2..4 from the first verify steps


@functools.cache
def exact_distribution(prompt: tuple, temperature: float):
    """P(x1..x4 | prompt) at a temperature, [SV]*4, from full forwards of all SV^4 continuations."""
    target = small_target()
    seqs = np.array(list(itertools.product(range(SV), repeat=NEW)), np.int32)
    full = np.concatenate([np.broadcast_to(np.array(prompt, np.int32), (len(seqs), len(prompt))), seqs], 1)

    @nnx.jit
    def logits(model, tokens):
        return model(tokens, jnp.zeros(tokens.shape[0], jnp.int32), model.init_cache(*tokens.shape)).logits

    lp = np.asarray(jax.nn.log_softmax(logits(target, jnp.asarray(full))[:, len(prompt) - 1:-1] / temperature, -1),
                    np.float64)
    total = np.take_along_axis(lp, seqs[..., None], -1)[..., 0].sum(1)
    return np.exp(total).reshape((SV,) * NEW)


@functools.cache
def small_target():
    return jmf.bigram_lm(SMALL_TARGET, rank=4, sharpness=2.5, context_scale=0.5, silent_tokens=[SV - 1],
                         rngs=nnx.Rngs(7))


@pytest.mark.parametrize("head, logits_dtype", [("float32", "float32"), ("int8", "bfloat16")])
def test_sampled_speculative_decoding_has_the_targets_distribution(head, logits_dtype):
    target = small_target()
    drafter = jmf.DSparkDrafter(SMALL_DRAFTER, rngs=nnx.Rngs(8))
    if head == "int8":
        drafter.markov_head = jmf.MarkovHead(SV, 8, param_dtype=jnp.bfloat16, markov_quantization="int8")
    # an imperfect head (the target's bigram plus noise): drafts are often, not always, accepted
    noise = np.random.default_rng(9).normal(0, 1.0, (SV, SV))
    drafter.markov_head.fit(fitted_bias(target) + noise)
    prompt = (3, 1, 4)
    n = N_SAMPLES
    temps = np.where(np.arange(n) % 2 == 0, 1.0, 0.6).astype(np.float32)
    temps[:16] = 0.0  # a few greedy rows in the same batch
    res = sp.speculative_decode(target, drafter, jnp.tile(jnp.array(prompt), (n, 1)), jnp.full(n, 3),
                                max_new_tokens=NEW, temperature=jnp.asarray(temps),
                                key=jax.random.split(jax.random.key(2024), n), logits_dtype=logits_dtype)
    out = np.asarray(res.tokens[:, 3:3 + NEW])
    assert np.all(np.asarray(res.lengths) == 3 + NEW)
    # the greedy rows are the target's greedy text
    greedy_ref = sp.target_decode(target, jnp.array([prompt]), jnp.array([3]), max_new_tokens=NEW)
    np.testing.assert_array_equal(out[:16], np.broadcast_to(greedy_ref.generated(0), (16, NEW)))
    # both paths of the sampler were taken: accepted drafts and rejections
    accepted = int(jnp.sum(res.num_accepted[16:]))
    drafted = int(jnp.sum(res.num_steps[16:])) * SMALL_DRAFTER.block_size
    print(f"\n{head} head, {logits_dtype} draft logits: {accepted}/{drafted} drafts accepted, "
          f"mean acceptance length {res.mean_acceptance_length():.3f}")
    assert 0.2 * drafted < accepted < 0.9 * drafted
    codes = lambda x: np.ravel_multi_index(tuple(x.T), (SV,) * x.shape[1])
    for t in (1.0, 0.6):
        rows = out[(temps == t)]
        exact = exact_distribution(prompt, t)
        p_first3 = chi_square_p(np.bincount(codes(rows[:, :3]), minlength=SV ** 3), exact.sum(axis=3))
        p_last3 = chi_square_p(np.bincount(codes(rows[:, 1:]), minlength=SV ** 3), exact.sum(axis=0))
        print(f"T={t}: {len(rows)} samples, chi-square p-values: tokens 1-3 {p_first3:.4f}, tokens 2-4 {p_last3:.4f}")
        assert p_first3 >= P_MIN and p_last3 >= P_MIN
        # negative control: the same samples against the other temperature's distribution
        other = exact_distribution(prompt, 0.6 if t == 1.0 else 1.0)
        assert chi_square_p(np.bincount(codes(rows[:, 1:]), minlength=SV ** 3), other.sum(axis=0)) < P_CONTROL
