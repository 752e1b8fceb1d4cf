"""The transposed kernel (ffi/cuda/transposed/: 17-64 requests over int8 W2, and 9-16 greedy ones of a
head with tiles) against the reference, on the GPU (skipped cleanly without one); tolerances as
tests/cuda_cases.py states them. Its sampled walks, ties and exchange are tested with the other
kernels' in tests/test_cuda.py.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from jax_markov import native
from tests.cuda_cases import MAX_NEAR_TIE_ROWS, NEAR_TIE, make_case, poison_device_memory

pytestmark = pytest.mark.skipif(not native.cuda_gpu_available(),
                                reason="needs a CUDA GPU and the jax_markov CUDA module")


# Greedy walks of 17-64 requests (a launch) with no logits out, over int8 W2 with V % 8 == 0, take the
# transposed kernel (walk_transposed.cuh), up to 32 requests in its packed layout (B = 17, 20 (a warp
# of requests past the batch), 24, 32, and the launches of 32 that f32 W1 takes at B = 64): every base
# and W1 dtype (16-bit base logits on four warpgroups, f32 ones on three: TransposedWarpgroups); padding, d2t and logit_scale; a last tile partly past V (V % 64 = 8, 16, 24, 40, 48: some
# threads' 16 rows end at V, some lie past it, one is cut in half); V = 270336 (24 of a CTA's 32 tiles
# stream); streamed tiles with a last tile partly past V (151952: V % 64 = 16, 151944: 8); a batch over
# two launches (64 + 36). V % 8 != 0 (20010) and odd V fall back to
# MarkovWalkKernel. Tokens against the reference (near-ties as check_parity counts them), embeds equal.
@pytest.mark.parametrize("batch,vocab,base_dtype,w1_dtype,extras", [
    (20, 40016, jnp.float16, jnp.bfloat16, True), (32, 151936, jnp.bfloat16, jnp.bfloat16, False),
    (17, 40008, jnp.bfloat16, jnp.bfloat16, False), (24, 30000, jnp.float32, jnp.float32, True),
    (40, 50008, jnp.float16, jnp.float16, True), (64, 151936, jnp.bfloat16, jnp.float32, False),
    (48, 270336, jnp.bfloat16, jnp.bfloat16, False), (100, 20008, jnp.bfloat16, jnp.bfloat16, True),
    (40, 151952, jnp.bfloat16, jnp.bfloat16, True), (24, 151944, jnp.float16, jnp.bfloat16, False),
    (36, 20010, jnp.bfloat16, jnp.bfloat16, False), (33, 20011, jnp.bfloat16, jnp.bfloat16, False)])
def test_parity_transposed_greedy(reference_scores, assert_tokens_match, batch, vocab, base_dtype, w1_dtype, extras):
    takes = native.cuda_transposed_launches(batch, vocab, w1_dtype)
    assert takes == [vocab % 8 == 0] * len(takes), takes
    rng = np.random.default_rng(batch + vocab)
    v_target = vocab + 5000 if extras else vocab
    base, anchor, head, _ = make_case(rng, batch, 7, vocab, v_target=v_target, base_dtype=base_dtype, w1_dtype=w1_dtype)
    kw = {}
    if extras:
        d2t = np.sort(rng.choice(v_target, vocab, replace=False)) - np.arange(vocab)
        kw = dict(d2t=jnp.asarray(d2t, jnp.int32), vocab_size=vocab - 37, logit_scale=0.7)
    ref = jm.walk(base, anchor, head, impl="reference", return_logits=True, return_embeds=True, **kw)
    poison_device_memory(batch * 7 * (4 + 256 * 4) * 2)
    got = jm.walk(base, anchor, head, impl="ffi", return_embeds=True, **kw)
    _, same_prefix = assert_tokens_match(reference_scores(ref.logits), ref.tokens, got.tokens, NEAR_TIE, rtol=NEAR_TIE,
                                         d2t=kw.get("d2t"), max_mismatch_rows=max(1, int(MAX_NEAR_TIE_ROWS * batch)))
    np.testing.assert_array_equal(np.asarray(got.embeds)[same_prefix], np.asarray(ref.embeds)[same_prefix])


# A head with tiles walks 9-16 greedy requests with no logits out from bf16 base logits on the transposed
# kernel (its packed layout, the A operand's rows past the batch unused), the head without them on EREGS:
# 9 at V = 5000 (a last tile of 8 rows, every tile resident), 12 with padding, d2t and logit_scale, 16 at
# V = 151936 (streamed tiles), 13 at 151952 from an fp32 W1 (a last streamed tile partly past V), 16 of a
# sampled call whose temperatures are all 0 (its guarded greedy launch). Tokens against the reference and
# the untiled head's (near-ties aside), embeds equal.
@pytest.mark.parametrize("batch,vocab,w1_dtype,extras,zero_temperatures", [
    (9, 5000, jnp.bfloat16, False, False), (12, 40008, jnp.float16, True, False), (16, 151936, jnp.bfloat16, False, False),
    (13, 151952, jnp.float32, False, False), (16, 60008, jnp.bfloat16, True, True)])
def test_parity_transposed_9_to_16_greedy(reference_scores, assert_tokens_match, batch, vocab, w1_dtype, extras,
                                          zero_temperatures):
    rng = np.random.default_rng(batch * 3 + vocab)
    v_target = vocab + 5000 if extras else vocab
    base, anchor, head, kw = make_case(rng, batch, 7, vocab, v_target=v_target, w1_dtype=w1_dtype,
                                       sampled=zero_temperatures)
    if zero_temperatures:
        kw["temperature"] = jnp.zeros((batch,), jnp.float32)
    bare = jm.quantize(head, tiles=False)
    for h, family in ((head, "transposed"), (bare, "walk")):
        plans = native.cuda_launch_plan(batch, 7, vocab, 256, w1_dtype, jnp.int8, base_dtype=jnp.bfloat16,
                                        sampling=zero_temperatures, w2_tiles=h.tiles is not None)
        (greedy,) = [p for p in plans if "all_greedy" in p["walks_in"]]
        assert greedy["family"] == family and (family == "transposed" or "eregs" in greedy["name"]), greedy
    if extras:
        d2t = np.sort(rng.choice(v_target, vocab, replace=False)) - np.arange(vocab)
        kw.update(d2t=jnp.asarray(d2t, jnp.int32), vocab_size=vocab - 37, logit_scale=0.7)
    ref = jm.walk(base, anchor, head, impl="reference", return_logits=True, return_embeds=True, **kw)
    scores = reference_scores(ref.logits)
    for h in (head, bare):
        poison_device_memory(batch * 7 * (4 + 256 * 4) * 2)
        got = jm.walk(base, anchor, h, impl="ffi", return_embeds=True, **kw)
        _, same_prefix = assert_tokens_match(scores, ref.tokens, got.tokens, NEAR_TIE, rtol=NEAR_TIE, d2t=kw.get("d2t"),
                                             max_mismatch_rows=max(1, int(MAX_NEAR_TIE_ROWS * batch)))
        np.testing.assert_array_equal(np.asarray(got.embeds)[same_prefix], np.asarray(ref.embeds)[same_prefix])


# The transposed kernel's W2 tiles land by one bulk copy each from the head's tiles (quantize's
# default, which every parity test above walks), or by cp.async from q for a head without them: the
# same arithmetic, so the same bits (tokens, logits, embeds) either way, and the reference's tokens.
# Packed greedy (20, a last tile partly past V), streamed tiles (48 at V = 270336), a last streamed
# tile partly past V (40 at 151952, sampled: the rotated layout), mixed rows over two launches (100).
@pytest.mark.parametrize("batch,vocab,mode", [(20, 40016, "greedy"), (48, 270336, "greedy"), (40, 151952, "sampled"),
                                              (100, 20008, "mixed")])
def test_transposed_tiles_by_bulk_copies_or_cp_async(check_parity, batch, vocab, mode):
    rng = np.random.default_rng(batch + vocab + 1)
    base, anchor, head, kw = make_case(rng, batch, 5, vocab, sampled=mode == "sampled", mixed=mode == "mixed")
    bare = jm.quantize(head, tiles=False)
    assert head.tiles is not None and bare.tiles is None
    for logits_dtype in (jnp.float32, None):
        plan = lambda tiles: native.cuda_launch_plan(batch, 5, vocab, 256, head.w1.dtype, jnp.int8, base_dtype=base.dtype,
                                                     logits_dtype=logits_dtype, sampling=bool(kw), w2_tiles=tiles)
        assert {p["family"] for p in plan(True)} == {"transposed"}
        assert all(p["w2_tiled"] for p in plan(True)) and not any(p["w2_tiled"] for p in plan(False))
    check_parity(base, anchor, head, kw)
    for out in (dict(return_logits=True, return_embeds=True), {}):
        walks = []
        for h in (head, bare):
            poison_device_memory(batch * 5 * vocab * 4 * 2)
            walks.append(jm.walk(base, anchor, h, impl="ffi", **kw, **out))
        for got, want in zip(*walks):
            assert (got is None) == (want is None) and (got is None or np.array_equal(np.asarray(got), np.asarray(want)))
