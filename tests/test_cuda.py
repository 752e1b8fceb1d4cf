"""The sm_90 kernel against the reference with the same head (int8, or unquantized fp16/bf16 W2),
on the GPU (skipped cleanly without one); tolerances as tests/cuda_cases.py states them, the
transposed kernel's own cases in tests/test_cuda_transposed.py.

The parity tests of the benchmark shapes, sampled rows, float heads, narrow logits and masked columns
draw fresh random inputs (conftest's fresh_rng: the seed printed with the test's output, reproducible
with JAX_MARKOV_TEST_SEED=<seed>); the others a fixed seed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from jax_markov import native
from tests.cuda_cases import NEAR_TIE, make_case, padding_d2t_and_scale, poison_device_memory


pytestmark = pytest.mark.skipif(not native.cuda_gpu_available(),
                                reason="needs a CUDA GPU and the jax_markov CUDA module")

@pytest.mark.parametrize("batch,steps,vocab", [(1, 7, 151936), (16, 7, 151936), (64, 7, 151936), (1, 16, 151936),
                                               (1, 5, 129280), (64, 5, 129280), (1, 16, 248320), (3, 1, 5003),
                                               (16, 16, 20011), (1, 7, 270336)])
@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_parity_benchmark_shapes(fresh_rng, check_parity, batch, steps, vocab, mode):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, mixed=mode == "mixed")
    check_parity(base, anchor, head, kw)


# Every request sampled. Up to 5 requests at V = 151936 (noise of 24 KB per CTA) compute each
# step's Gumbel noise ahead, in shared memory; B = 6 computes it in the scoring epilogue. With 17-64
# requests and V % 8 == 0 the transposed kernel walks and makes the noise in its epilogue (packed at
# 24; not at 40 and 48, in the rotated order, nor at 56; the last tile half outside V = 100008 and
# 60008), as it does for the mixed benchmark shapes at B = 64. Otherwise batches of 9 or more whose
# noise does not fit in shared memory make it a tile at a time, just before the tile is scored (noise
# tiles: the mixed benchmark shape at B = 16); at V = 8003 the noise of 40 requests fits in shared memory
# (MarkovWalkKernel's wgmma kernel fills it). With this bf16 W1, 3-8 requests score on e's int8 digit
# pairs, their logits out too (test_parity_sampled_fp16_w1 walks MarkovWalkKernel's fp16 columns
# there). bf16 base logits with bf16 logits out take the epilogue specialised for that launch: B = 2
# (digits, noise ahead); B = 12's sampled launch stages its logits for 16-byte stores and makes its
# noise in tiles, its greedy one is EREGS's bf16-logits form; with float32 logits out, the
# digit kernel's instance for them: B = 1 at V = 151936 and 270336, 2 at 248320.
@pytest.mark.parametrize("batch,steps,vocab,base_dtype,logits_dtype", [
    (1, 7, 151936, jnp.bfloat16, jnp.float32), (1, 7, 151936, jnp.float32, jnp.bfloat16),
    (2, 7, 151936, jnp.bfloat16, jnp.bfloat16), (4, 5, 151936, jnp.bfloat16, jnp.bfloat16),
    (12, 3, 151936, jnp.bfloat16, jnp.bfloat16),
    (3, 5, 129280, jnp.bfloat16, jnp.float32), (4, 7, 151936, jnp.float16, jnp.float32),
    (5, 3, 151936, jnp.float32, jnp.float16), (6, 7, 151936, jnp.bfloat16, jnp.float32),
    (2, 16, 248320, jnp.bfloat16, jnp.float32),
    (1, 7, 270336, jnp.bfloat16, jnp.float32), (40, 5, 100008, jnp.bfloat16, jnp.float32),
    (24, 5, 100008, jnp.float16, jnp.bfloat16), (48, 3, 60008, jnp.float32, jnp.float16),
    (56, 3, 60008, jnp.bfloat16, jnp.bfloat16), (40, 3, 8003, jnp.bfloat16, jnp.float32)])
def test_parity_sampled(fresh_rng, check_parity, batch, steps, vocab, base_dtype, logits_dtype):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, base_dtype=base_dtype, sampled=True)
    transposed = native.cuda_transposed_launches(batch, vocab, head.w1.dtype, logits_out=True)
    assert transposed == [batch > 16 and vocab % 8 == 0], transposed
    check_parity(base, anchor, head, kw, logits_dtype=logits_dtype)


# With an fp16 W1, walks of 3-8 requests with logits out keep MarkovWalkKernel's fp16 columns (one a
# request), where 16-bit logits go out through shared memory at V % 8 == 0: B = 4 with its noise
# ahead and bf16 base and logits (the specialised epilogue), 6 with the noise made in the scoring
# epilogue, 3 and 8 with the last tile half outside V = 40008.
@pytest.mark.parametrize("batch,steps,vocab,logits_dtype", [(4, 5, 151936, jnp.bfloat16), (6, 7, 151936, jnp.float32),
                                                            (3, 6, 40008, jnp.bfloat16), (8, 6, 40008, jnp.float16)])
def test_parity_sampled_fp16_w1(fresh_rng, check_parity, batch, steps, vocab, logits_dtype):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, w1_dtype=jnp.float16, sampled=True)
    check_parity(base, anchor, head, kw, logits_dtype=logits_dtype)


@pytest.mark.parametrize("base_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("w1_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_parity_dtypes(check_parity, base_dtype, w1_dtype):
    rng = np.random.default_rng(7)
    base, anchor, head, kw = make_case(rng, 5, 4, 30011, v_target=30500, base_dtype=base_dtype, w1_dtype=w1_dtype,
                                       mixed=True)
    check_parity(base, anchor, head, kw)


# B <= 2 scores with int8 tensor cores on e split into three int8 digits: every W1 dtype.
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("w1_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_parity_small_batch_digits(check_parity, batch, w1_dtype):
    rng = np.random.default_rng(17 + batch)
    base, anchor, head, kw = make_case(rng, batch, 6, 30011, v_target=30500, w1_dtype=w1_dtype, mixed=True)
    check_parity(base, anchor, head, kw)


# 9-16 greedy requests with no logits out, bf16 base logits and an even V score on e's int8 digit pairs as
# the A operand (EREGS; check_parity's walk without logits): every W1 dtype (tokens only), V = 30010 (the
# staged base logits, a last tile half outside V) and 100002 (not staged, tiles streamed), padding past
# vocab_size, d2t and logit_scale. With float32 logits out the same inputs take the fp16 columns.
@pytest.mark.parametrize("batch,vocab,w1_dtype,extras", [(9, 30010, jnp.bfloat16, False), (13, 100002, jnp.float32, False),
                                                         (16, 30010, jnp.float16, True), (16, 100002, jnp.bfloat16, True)])
def test_parity_e_operands(check_parity, batch, vocab, w1_dtype, extras):
    rng = np.random.default_rng(batch + vocab)
    v_target = vocab + 3000 if extras else vocab
    base, anchor, head, kw = make_case(rng, batch, 5, vocab, v_target=v_target, w1_dtype=w1_dtype)
    walk_kw = padding_d2t_and_scale(rng, vocab, v_target) if extras else {}
    check_parity(base, anchor, head, kw, **walk_kw)


# The same kernel with bf16 logits out (its bf16-logits form: each lane stores its two adjacent rows of a
# request in one 4-byte store, and chooses from them rounded): base logits staged (V = 5000, 30010) and
# not, tiles streamed (100002, 151936), every W1 dtype, padding past vocab_size, d2t and logit_scale.
@pytest.mark.parametrize("batch,vocab,w1_dtype,extras", [(12, 5000, jnp.bfloat16, False), (9, 30010, jnp.float16, True),
                                                         (13, 100002, jnp.float32, True), (16, 151936, jnp.bfloat16, False)])
def test_parity_e_operands_bf16_logits(check_parity, batch, vocab, w1_dtype, extras):
    rng = np.random.default_rng(batch * vocab)
    v_target = vocab + 3000 if extras else vocab
    base, anchor, head, kw = make_case(rng, batch, 5, vocab, v_target=v_target, w1_dtype=w1_dtype)
    walk_kw = padding_d2t_and_scale(rng, vocab, v_target) if extras else {}
    (plan,) = native.cuda_launch_plan(batch, 5, vocab, 256, w1_dtype, jnp.int8, base_dtype=jnp.bfloat16,
                                      logits_dtype=jnp.bfloat16)
    assert "eregs" in plan["name"] and "form=bf16_logits" in plan["name"], plan
    check_parity(base, anchor, head, kw, logits_dtype=jnp.bfloat16, **walk_kw)


# The unquantized walk: fp16 W2 scores with fp16 MMAs, bf16 W2 with bf16 MMAs (fp16 and fp32 W1 in
# hi + lo columns), every W1 dtype, batches across the n-tile widths and beyond one launch.
@pytest.mark.parametrize("w2_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("w1_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("batch", [1, 5, 20, 40])
def test_parity_float_head(fresh_rng, check_parity, w2_dtype, w1_dtype, batch):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, 5, 30011, v_target=30500, w1_dtype=w1_dtype, w2_dtype=w2_dtype,
                                       mixed=True)
    assert head.w2.dtype == w2_dtype
    check_parity(base, anchor, head, kw)


@pytest.mark.parametrize("batch,steps,vocab", [(1, 7, 151936), (16, 7, 151936), (64, 7, 151936), (1, 16, 248320),
                                               (70, 3, 20011), (1, 7, 270336)])
@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_parity_bf16_head_benchmark_shapes(fresh_rng, check_parity, batch, steps, vocab, mode):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, w2_dtype=jnp.bfloat16, mixed=mode == "mixed")
    check_parity(base, anchor, head, kw)


# 16-bit logits go out 16 bytes a store where V % 8 == 0 (40008 and 100008 end in a half tile): through
# shared memory in MarkovWalkKernel (16 requests; 3 and 8 with an fp16 W1 in test_parity_sampled_fp16_w1),
# from registers in the transposed kernel (40 mixed and 64 greedy); one value a store otherwise (40009,
# 100003, 3-8 requests on the digit pairs, and 1-2 requests: the digit kernel, whose instance for bf16
# logits with bf16 base logits stages its base logits at 40008, not at 40009). 24 and 48 sampled
# requests at V = 100003 make their noise in tiles (at 48 in the general epilogue); 40 at
# V = 100008 make it in the transposed kernel.
@pytest.mark.parametrize("batch,vocab,mode", [(1, 40009, "sampled"), (2, 40008, "mixed"), (3, 40008, "sampled"),
                                              (8, 40009, "sampled"), (16, 40008, "greedy"), (24, 100003, "mixed"),
                                              (40, 100008, "mixed"), (48, 100003, "mixed"), (64, 40008, "greedy")])
@pytest.mark.parametrize("logits_dtype", [jnp.bfloat16, jnp.float16])
def test_parity_narrow_logits(fresh_rng, check_parity, batch, vocab, mode, logits_dtype):
    rng = fresh_rng
    base, anchor, head, kw = make_case(rng, batch, 6, vocab, sampled=mode == "sampled", mixed=mode == "mixed")
    check_parity(base, anchor, head, kw, logits_dtype=logits_dtype)


# One launch walks 64 columns (32 requests with fp32 W1); wider batches walk in chunks, the last
# one partial. At V = 20000 a CTA's 10 tiles leave some warps of a warpgroup a tile short: the wgmma
# kernels' idle-warp iterations. With logits out, launches of more than 16 requests take the transposed
# kernel for a bf16 W1 only; fp32 and fp16 W1 keep MarkovWalkKernel, whose logits hold the tolerance.
@pytest.mark.parametrize("batch,w1_dtype", [(64, jnp.float32), (100, jnp.float32), (40, jnp.float16),
                                            (130, jnp.bfloat16), (256, jnp.bfloat16)])
def test_batches_beyond_one_launch(check_parity, batch, w1_dtype):
    rng = np.random.default_rng(batch)
    base, anchor, head, kw = make_case(rng, batch, 3, 20000, w1_dtype=w1_dtype, mixed=True)
    transposed = native.cuda_transposed_launches(batch, 20000, w1_dtype, logits_out=True)
    per_launch = 32 if w1_dtype == jnp.float32 else 64
    assert transposed == [w1_dtype == jnp.bfloat16 and min(per_launch, batch - b0) > 16
                          for b0 in range(0, batch, per_launch)], transposed
    check_parity(base, anchor, head, kw)


@pytest.mark.parametrize("batch", [128, 256])
def test_large_batches_benchmark_shape(check_parity, batch):
    rng = np.random.default_rng(batch + 1)
    base, anchor, head, kw = make_case(rng, batch, 7, 151936, mixed=True)
    check_parity(base, anchor, head, kw)


# 6 requests exchange through per-CTA slots, 24 and 40 through the atomic keys; 24 and 40 walk in the
# transposed kernel (V % 8 == 0), which makes their noise itself.
@pytest.mark.parametrize("batch", [6, 24, 40])
def test_padding_d2t_logit_scale(check_parity, batch):
    rng = np.random.default_rng(3 + batch)
    vocab, v_target = 32000, 128256
    base, anchor, head, kw = make_case(rng, batch, 7, vocab, v_target=v_target, mixed=True)
    d2t = jnp.asarray(np.sort(rng.choice(v_target, vocab, replace=False)) - np.arange(vocab), jnp.int32)
    check_parity(base, anchor, head, kw, d2t=d2t, vocab_size=vocab - 77, logit_scale=1.7)
    got = jm.walk(base, anchor, head, impl="ffi", vocab_size=vocab - 77, return_logits=True)
    assert np.all(np.isneginf(np.asarray(got.logits[:, :, vocab - 77:])))


# Batch 4 scores with mma.sync, greedy walks without logits in the branch-free epilogue, with logits in
# the general epilogue; 16 with bf16 base logits and no logits out on e's digit pairs as the A operand
# (EREGS); 24 and 40 take the transposed kernel (packed at 24, not at 40), its plain epilogue without
# logits and its GENERAL one with them.
@pytest.mark.parametrize("batch,base_dtype", [(4, jnp.float32), (16, jnp.bfloat16), (24, jnp.bfloat16), (24, jnp.float16),
                                              (40, jnp.float32)])
@pytest.mark.parametrize("return_logits", [False, True])
def test_exact_ties_and_nan(batch, base_dtype, return_logits):
    rng = np.random.default_rng(5)
    steps, vocab = 3, 50000
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, base_dtype=jnp.float32)
    zero_head = jm.QuantizedMarkovHead(head.w1, jnp.zeros_like(head.q), head.scale)
    base = np.array(base)
    base[0, :, [17, 4000, 49999]] = 50.0  # exact tie: lowest index wins
    # First NaN wins, whatever its sign and payload: a negative NaN with a payload before a positive one.
    base[1, :, 31000] = np.array(0xFFD00001, np.uint32).view(np.float32)
    base[1, :, 45000] = np.nan
    base[2, :, :] = -np.inf  # all -inf: index 0
    base[3, :, :] = -1.0
    base[3, :, 12] = -0.0  # -0 ties with +0: the lower index wins
    base[3, :, 123] = 0.0
    base = base.astype(jnp.dtype(base_dtype))  # on the host, which keeps the NaN's sign (the GPU's cast would not)
    assert np.signbit(base[1, 0, 31000].astype(np.float32))
    base = jnp.asarray(base)
    transposed = native.cuda_transposed_launches(batch, vocab, head.w1.dtype, logits_out=return_logits)
    assert transposed == [batch > 16]
    got = jm.walk(base, anchor, zero_head, impl="ffi", return_logits=return_logits)
    ref = jm.walk(base, anchor, zero_head, impl="reference")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.tokens)[:4, 0], [17, 31000, 0, 12])


# The same rules where the tied rows sit in W2 tiles that stream from L2, at V = 151936 (on 132 SMs a CTA
# owns rows 1152 c .. 1152 c + 1151 and keeps roughly its first 850 on chip). Where a warp keeps its last
# streamed tile for the next step (kKeepsStreamed: the digit kernel's known forms, the digit pairs), odd
# steps take its streamed tiles in reverse, so rows do not come in increasing order there; steps 1 and 2
# take both orders. Every kernel that streams: the digit kernel (1-2 requests), the digit pairs (4), the
# fp16 columns (12 and 16 with logits out), e's digit pairs as the A operand (12 and 16 without, EREGS,
# which keeps its streamed tile too), the transposed kernel (24 packed, 40 not).
@pytest.mark.parametrize("batch", [1, 2, 4, 12, 16, 24, 40])
@pytest.mark.parametrize("return_logits", [False, True])
def test_exact_ties_and_nan_in_streamed_tiles(batch, return_logits):
    rng = np.random.default_rng(11)
    steps, vocab, span = 3, 151936, 1152
    base, anchor, head, kw = make_case(rng, batch, steps, vocab)
    zero_head = jm.QuantizedMarkovHead(head.w1, jnp.zeros_like(head.q), head.scale)
    base = np.array(base.astype(jnp.float32))
    expected = {}
    # Request 0: one value at six rows of CTA 5's last ~300 and at a row of CTA 100; the lowest wins.
    rows = [5 * span + o for o in (850, 900, 960, 1020, 1100, 1140)] + [100 * span + 1000]
    base[0][:, rows] = 50.0
    expected[0] = rows[0]
    if batch > 1:  # request 1: NaNs in CTA 7's streamed rows and CTA 9's; the first wins
        rows = [7 * span + o for o in (900, 1100, 1140)] + [9 * span + 1000]
        base[1][:, rows] = np.nan
        expected[1] = rows[0]
    if batch > 3:
        base[2][:, [3 * span + 700, 3 * span + 1100]] = 50.0  # a row on chip and a streamed one
        expected[2] = 3 * span + 700
        base[3][:, :] = -1.0  # -0 at the lower streamed row ties with +0: the lower index wins
        base[3][:, 2 * span + 1140] = 0.0
        base[3][:, 2 * span + 1000] = -0.0
        expected[3] = 2 * span + 1000
    base = jnp.asarray(base.astype(jnp.bfloat16))
    poison_device_memory(batch * steps * vocab * 4 * 2)  # the two parametrizations' outputs look alike
    got = jm.walk(base, anchor, zero_head, impl="ffi", return_logits=return_logits)
    ref = jm.walk(base, anchor, zero_head, impl="reference", return_logits=return_logits)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    if return_logits:  # a zero W2 leaves the base logits, exactly
        np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(ref.logits))
    for b, row in expected.items():
        np.testing.assert_array_equal(np.asarray(got.tokens)[b], [row] * steps)


@pytest.mark.parametrize("batch,vocab,w2_dtype", [(1, 151936, jnp.int8), (2, 40008, jnp.int8), (5, 40008, jnp.int8),
                                                   (12, 151936, jnp.int8), (16, 40008, jnp.int8), (40, 60008, jnp.int8),
                                                   (100, 40008, jnp.int8), (3, 40008, jnp.bfloat16),
                                                   (20, 40008, jnp.bfloat16)])
@pytest.mark.parametrize("return_logits", [False, True])
def test_zero_temperature_batch_walks_as_greedy(reference_scores, assert_tokens_match, batch, vocab, w2_dtype,
                                                return_logits):
    """A batch passed with temperatures, keys and positions whose temperatures are all 0 walks on the
    greedy call's kernel (the plan's guarded pair, walk_config.h's RunWhen): tokens and logits bit for
    bit the greedy walk's. With one sampled row the sampled launch walks instead, and matches the
    reference."""
    rng = np.random.default_rng(batch * 7 + vocab)
    base, anchor, head, kw = make_case(rng, batch, 5, vocab, w2_dtype=w2_dtype, sampled=True)
    kw["temperature"] = jnp.zeros((batch,), jnp.float32)
    out_kw = dict(return_logits=return_logits, logits_dtype=jnp.bfloat16) if return_logits else {}
    poison_device_memory(batch * 5 * vocab * 4 * 2)
    greedy = jm.walk(base, anchor, head, impl="ffi", **out_kw)
    poison_device_memory(batch * 5 * vocab * 4 * 2)
    zero = jm.walk(base, anchor, head, impl="ffi", **kw, **out_kw)
    np.testing.assert_array_equal(np.asarray(zero.tokens), np.asarray(greedy.tokens))
    if return_logits:
        np.testing.assert_array_equal(np.asarray(zero.logits.astype(jnp.float32)),
                                      np.asarray(greedy.logits.astype(jnp.float32)))
    kw["temperature"] = kw["temperature"].at[batch - 1].set(1.0)
    # Every row chooses from its l_k rounded as returned (bf16 here when logits are asked for), so the
    # reference rounds alike: two columns in one bf16 step tie, and the lower index wins.
    ref = jm.walk(base, anchor, head, impl="reference", **kw, **(out_kw or dict(return_logits=True)))
    poison_device_memory(batch * 5 * vocab * 4 * 2)
    one = jm.walk(base, anchor, head, impl="ffi", **kw, **out_kw)
    scores = reference_scores(ref.logits, kw["temperature"], kw["key"], kw["position"])
    assert_tokens_match(scores, np.asarray(ref.tokens), np.asarray(one.tokens), NEAR_TIE, rtol=NEAR_TIE,
                        max_mismatch_rows=max(1, batch // 20))


# Issue 64's rules for sampled rows on every kernel that samples: a column whose logit is -inf (masked) is
# never sampled, padding (vocab_size) is never chosen, and T = +inf (1/T = 0) samples uniformly among the
# other columns: its score there is the noise alone, never the NaN of -inf * 0. B = 1 with its noise
# ahead, 6 made in the scoring epilogue, 12 made in tiles, 24 and 40 on the transposed kernel
# (int8 W2, V % 8 == 0), and the unquantized heads; with and without logits out.
@pytest.mark.parametrize("batch,vocab,w2_dtype", [(1, 151936, jnp.int8), (6, 151936, jnp.int8),
                                                  (12, 151936, jnp.int8), (24, 100008, jnp.int8),
                                                  (40, 60008, jnp.int8), (3, 30011, jnp.bfloat16),
                                                  (20, 30011, jnp.float16)])
@pytest.mark.parametrize("return_logits", [False, True])
def test_masked_columns_padding_and_infinite_temperature(fresh_rng, reference_scores, assert_tokens_match, batch, vocab, w2_dtype,
                                                         return_logits):
    rng = fresh_rng
    steps, vocab_size = 5, vocab - 1000
    base, anchor, head, kw = make_case(rng, batch, steps, vocab, w2_dtype=w2_dtype, mixed=True)
    if w2_dtype == jnp.int8:
        transposed = native.cuda_transposed_launches(batch, vocab, head.w1.dtype, logits_out=return_logits)
        assert transposed == [batch > 16 and vocab % 8 == 0], transposed
    base = np.array(base.astype(jnp.float32))
    masked = rng.random(base.shape) < 0.5
    base[masked] = -np.inf
    base[:, :, vocab_size:] = 1e4  # padding that would win every step
    base = jnp.asarray(base, jnp.bfloat16)
    kw["temperature"] = jnp.where(kw["temperature"] > 0, jnp.inf, 0.0)  # every other row greedy
    poison_device_memory(batch * steps * vocab * 4 * 2)
    got = jm.walk(base, anchor, head, impl="ffi", vocab_size=vocab_size, return_logits=return_logits, **kw)
    ref = jm.walk(base, anchor, head, impl="reference", vocab_size=vocab_size, return_logits=True, **kw)
    tokens, ref_tokens = np.asarray(got.tokens), np.asarray(ref.tokens)
    assert tokens.max() < vocab_size
    assert not masked[np.arange(batch)[:, None], np.arange(steps)[None, :], tokens].any()
    scores = reference_scores(ref.logits, kw["temperature"], kw["key"], kw["position"])
    assert not np.isnan(np.asarray(scores)).any()
    assert_tokens_match(scores, ref_tokens, tokens, NEAR_TIE, rtol=NEAR_TIE, max_mismatch_rows=max(1, batch // 20))
    # T = +inf rows choose by the noise alone, the same on both: their tokens are the reference's exactly
    hot = np.asarray(kw["temperature"]) > 0
    np.testing.assert_array_equal(tokens[hot], ref_tokens[hot])


def test_jit_while_loop_and_vmap():
    rng = np.random.default_rng(9)
    base, anchor, head, kw = make_case(rng, 4, 7, 60013, mixed=True)

    @jax.jit
    def decode(base, anchor, position):
        def body(state):
            i, anchor, position, out = state
            res = jm.walk(base * (1.0 + 0.1 * i.astype(base.dtype)), anchor, head, temperature=kw["temperature"],
                          key=kw["key"], position=position)
            return i + 1, res.tokens[:, -1], position + 7, out.at[i].set(res.tokens)
        out = jnp.zeros((3, *base.shape[:2]), jnp.int32)
        return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, anchor, position, out))[3]

    got = decode(base, anchor, kw["position"])
    a, p = anchor, kw["position"]
    for i in range(3):
        ref = jm.walk(base * (1.0 + 0.1 * i), a, head, temperature=kw["temperature"], key=kw["key"], position=p,
                      impl="reference")
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(ref.tokens))
        a, p = ref.tokens[:, -1], p + 7

    stacked = jnp.stack([base, base[::-1]])
    anchors = jnp.stack([anchor, anchor[::-1]])
    vm = jax.jit(jax.vmap(lambda b, a: jm.walk(b, a, head, impl="ffi").tokens))(stacked, anchors)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(vm[i]), np.asarray(jm.walk(stacked[i], anchors[i], head,
                                                                            impl="reference").tokens))


# 16 requests with logits exchange directly in MarkovWalkKernel; 40 walk in the transposed kernel
# (atomic exchange), without logits and with them (GENERAL). Each leaves the workspace as the next call
# needs it: the second input set's tokens equal the reference's and the first set's bits repeat.
@pytest.mark.parametrize("batch,vocab,return_logits", [(16, 80021, True), (40, 80024, False), (40, 80024, True)])
def test_repeatable_and_nothing_stale(batch, vocab, return_logits):
    rng = np.random.default_rng(21)
    f = jax.jit(lambda b, a, h: jm.walk(b, a, h, impl="ffi", return_logits=return_logits))
    base1, anchor1, head1, _ = make_case(rng, batch, 7, vocab)
    assert native.cuda_transposed_launches(batch, vocab, head1.w1.dtype, logits_out=return_logits) == [batch == 40]
    base2, anchor2, head2, _ = make_case(rng, batch, 7, vocab)
    r1 = f(base1, anchor1, head1)
    r2 = f(base2, anchor2, head2)
    r1b = f(base1, anchor1, head1)
    np.testing.assert_array_equal(np.asarray(r1.tokens), np.asarray(r1b.tokens))
    if return_logits:
        np.testing.assert_array_equal(np.asarray(r1.logits), np.asarray(r1b.logits))
    ref2 = jm.walk(base2, anchor2, head2, impl="reference")
    np.testing.assert_array_equal(np.asarray(r2.tokens), np.asarray(ref2.tokens))


# The exchange's words of one call must all be zero for the next, whatever its shape: a larger call
# followed by smaller ones (fewer requests, fewer steps). The atomic exchange in the transposed kernel
# (int8 W2) and in MarkovWalkKernel (bf16 W2, above 16 requests); the direct one (up to 16 requests),
# whose slots each CTA clears as it goes and CTA 0 clears for the last two steps, at K = 1 and 2 too.
# A stale key would win its slot, or a stale direct slot read as published, and change a token.
@pytest.mark.parametrize("w2_dtype,shapes", [
    (jnp.int8, [(64, 7), (24, 3), (40, 5), (17, 7)]),
    (jnp.bfloat16, [(64, 7), (24, 3), (40, 5), (17, 7)]),
    (jnp.int8, [(16, 16), (16, 1), (3, 2), (16, 7), (1, 3), (9, 2), (2, 1)]),
], ids=["atomic-int8", "atomic-bf16", "direct-int8"])
def test_keys_clean_across_shapes(check_parity, w2_dtype, shapes):
    rng = np.random.default_rng(22)
    for batch, steps in shapes:
        base, anchor, head, _ = make_case(rng, batch, steps, 80024, w2_dtype=w2_dtype)
        if w2_dtype == jnp.int8:
            assert native.cuda_transposed_launches(batch, 80024, head.w1.dtype, logits_out=True) == [batch > 16]
        check_parity(base, anchor, head, {})


def test_outside_envelope_falls_back_or_refuses():
    rng = np.random.default_rng(2)
    base, anchor, head, _ = make_case(rng, 2, 17, 5000)
    auto = jm.walk(base, anchor, head)  # K = 17 > 16: reference
    np.testing.assert_array_equal(np.asarray(auto.tokens),
                                  np.asarray(jm.walk(base, anchor, head, impl="reference").tokens))
    with pytest.raises(ValueError, match="K = 16"):
        jm.walk(base, anchor, head, impl="ffi")
    # an fp32 W2 is not walked by the kernel
    base, anchor, head, _ = make_case(rng, 2, 3, 5000, w2_dtype=jnp.float32)
    auto = jm.walk(base, anchor, head)
    np.testing.assert_array_equal(np.asarray(auto.tokens),
                                  np.asarray(jm.walk(base, anchor, head, impl="reference").tokens))
    with pytest.raises(ValueError, match="float16 or bfloat16 W2, got float32"):
        jm.walk(base, anchor, head, impl="ffi")
