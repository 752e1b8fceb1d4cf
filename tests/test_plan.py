"""The CUDA walk's launch plan (ffi/plan/), asked through `jax_markov.native` on any machine.

The plan decides, for every launch of a walk, which kernel instance runs it and with what shared
memory; the CUDA handler executes exactly these plans. These tests walk the plan over a grid of
shapes and check that every plan names a kernel the build instantiates, fits the GPU, and covers the
batch; that every instantiated kernel is some call's plan (none is dead); and the batch ranges each
kernel takes, a CertifiedMarkovHead's among them.
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jax_markov import native

pytestmark = pytest.mark.skipif(not native.plan_available(), reason="the jax_markov plan module is not built")

H100 = {"sm_count": 132, "smem_per_block": 232448, "l2_bytes": 50 * 2**20, "major": 9, "minor": 0, "cooperative": True}
H200 = dict(H100, l2_bytes=60 * 2**20)
SMALL = dict(H100, sm_count=16)  # a part with few SMs: more tiles a CTA, fewer resident
BATCHES = (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 31, 32, 33, 40, 48, 49, 64, 65, 100, 128, 256)
VOCABS = (5000, 5003, 20008, 20011, 30010, 129280, 151936)
W2 = ("int8", "float16", "bfloat16")
FLOATS = ("bfloat16", "float16", "float32")
LOGITS = (None, "bfloat16", "float32", "float16")


def _plans(batch, steps, vocab, w2, w1, base, logits, sampling, props, certified=False, w2_tiles=False):
    return native.cuda_launch_plan(batch, steps, vocab, native.cuda_envelope()["rank"], jnp.dtype(w1), jnp.dtype(w2),
                                   base_dtype=jnp.dtype(base), logits_dtype=None if logits is None else jnp.dtype(logits),
                                   sampling=sampling, props=props, certified=certified, w2_tiles=w2_tiles)


# The batch classes (walk_config.h's BatchClass) in which a launch of each run_when walks.
CLASSES = ("all_greedy", "mixed", "all_sampled")
WALKS_IN = {"always": set(CLASSES), "no_row_samples": {"all_greedy"}, "some_row_samples": {"mixed", "all_sampled"},
            "some_row_greedy": {"all_greedy", "mixed"}, "mixed_rows": {"mixed"}, "all_rows_sample": {"all_sampled"}}


def _walking(plans, batch_class):
    """The launches that walk for a batch of that class: one of each run's guarded launches, and every
    unguarded launch (each launch's walks_in, checked against WALKS_IN)."""
    for p in plans:
        assert set(p["walks_in"]) == WALKS_IN[p["run_when"]], p
    return [p for p in plans if batch_class in p["walks_in"]]


def _grid(seed=0, count=4000):
    """A fixed sample of (batch, steps, vocab, w2, w1, base, logits, sampling, props)."""
    rng = np.random.default_rng(seed)
    everything = list(itertools.product(BATCHES, (1, 7, 16), VOCABS, W2, FLOATS, FLOATS, LOGITS, (False, True),
                                        (H100, H200, SMALL)))
    return [everything[i] for i in rng.choice(len(everything), count, replace=False)]


def _supported(case, certified=False):
    batch, steps, vocab, w2, w1, base, logits, sampling, props = case
    return native._markov_plan.unsupported(batch, steps, vocab, native.cuda_envelope()["rank"], w2, w1, base, logits,
                                           sampling, props, certified) is None


def test_every_plan_is_an_instantiated_kernel_that_fits():
    instantiated = set(native._markov_plan.instantiated_kernels())
    assert len(instantiated) == len(native._markov_plan.instantiated_kernels()), "each kernel is listed once"
    envelope = native.cuda_envelope()
    checked = 0
    for case in _grid():
        if not _supported(case):
            continue
        batch, steps, vocab, w2, w1, base, logits, sampling, props = case
        plans = _plans(*case)
        per_launch = envelope["launch_columns"] // native.cuda_columns_per_request(jnp.dtype(w1), jnp.dtype(w2))
        for batch_class in CLASSES:
            walking = _walking(plans, batch_class)
            assert [p["first"] for p in walking] == list(range(0, batch, per_launch)), case
            assert sum(p["batch"] for p in walking) == batch
        for p in plans:
            assert p["name"] in instantiated, (case, p)
            assert 0 <= p["resident_tiles"] <= p["tiles_per_cta"], (case, p)
            assert 0 < p["smem_bytes"] <= props["smem_per_block"], (case, p)
            assert p["grid"] == props["sm_count"] and p["threads"] in (256, 384, 512)
            assert not (p["noise_ahead"] and p["noise_tiles"]), "a launch makes its noise one way"
            assert p["sampling"] or not (p["noise_ahead"] or p["noise_tiles"]), "greedy launches make no noise"
            assert p["sampling"] == (sampling and p["run_when"] != "no_row_samples"), (case, p)
            assert sampling or p["run_when"] == "always", "only sampled calls are guarded"
            if p["family"] == "transposed":
                assert w2 == "int8" and 16 < p["batch"] <= 64 and vocab % 8 == 0, (case, p)
            assert not p["w2_tiled"], "no tiles were given"
        if w2 == "int8":
            _check_tiled_plans(case, plans, instantiated)
        checked += 1
    assert checked > 1500


def _check_tiled_plans(case, plans, instantiated):
    """With the head's tiles, the same launches walk each batch class, the transposed ones reading the
    tiles, but for launches of 9-16 requests from bf16 base logits (V % 8 == 0; logits out from a bf16
    W1 only), which take the transposed kernel's packed instances wherever it walks 17 greedy requests
    of the call (a sampled call's then a guarded pair, the greedy launch the plain instance)."""
    batch, steps, vocab, w2, w1, base, logits, sampling, props = case
    tiled = _plans(*case, w2_tiles=True)
    transposed_fits = _plans(17, steps, vocab, w2, w1, base, None, False, props, w2_tiles=True)[0]["family"] == "transposed"
    unguarded = lambda plan: {k: v for k, v in plan.items() if k not in ("run_when", "walks_in")}
    for batch_class in CLASSES:
        for t, p in itertools.zip_longest(_walking(tiled, batch_class), _walking(plans, batch_class)):
            assert (t["first"], t["batch"]) == (p["first"], p["batch"]), case
            assert t["w2_tiled"] == (t["family"] == "transposed"), (case, t)
            moves = (8 < p["batch"] <= 16 and base == "bfloat16" and vocab % 8 == 0 and transposed_fits
                     and (logits is None or w1 == "bfloat16"))
            if moves:
                assert t["family"] == "transposed" and ",packed," in t["name"] and t["name"] in instantiated, (case, t)
                assert t["sampling"] == (sampling and batch_class != "all_greedy"), (case, t)
                assert 0 <= t["resident_tiles"] <= t["tiles_per_cta"] and 0 < t["smem_bytes"] <= props["smem_per_block"]
            else:
                assert unguarded(dict(t, w2_tiled=False)) == unguarded(p), (case, t, p)


@pytest.mark.parametrize("batch, sampling, logits, base, kernel", [
    (8, False, None, "bfloat16", "walk<nt=2,split,pairs,w2=int8,threads=512,form=any>"),
    (9, False, None, "bfloat16", "transposed<base=bfloat16,packed,plain>"),
    (16, False, None, "bfloat16", "transposed<base=bfloat16,packed,plain>"),
    (16, True, None, "bfloat16", "transposed<base=bfloat16,packed,plain>"),  # a sampled call's greedy launch
    (12, False, "bfloat16", "bfloat16", "transposed<base=bfloat16,packed,logits>"),
    (16, False, None, "float32", "walk<nt=2,w2=int8,threads=512,form=any>"),
])
def test_a_head_with_tiles_walks_9_to_16_requests_transposed(batch, sampling, logits, base, kernel):
    """A head with tiles: 9-16 requests from bf16 base logits take the transposed kernel's packed
    instances (docs/kernel_design.md section 8), reading the tiles; their other walks are the untiled
    head's."""
    (plan,) = _walking(_plans(batch, 7, 151936, "int8", "bfloat16", base, logits, sampling, H100, w2_tiles=True),
                       "all_greedy")
    assert plan["name"] == kernel and plan["w2_tiled"] == kernel.startswith("transposed")
    if sampling:  # its rows sampled: the packed sampled instance
        (plan,) = _walking(_plans(batch, 7, 151936, "int8", "bfloat16", base, logits, sampling, H100, w2_tiles=True),
                           "all_sampled")
        assert plan["name"] == "transposed<base=bfloat16,packed,sampled>" and plan["w2_tiled"]


def test_w2_tile_order_is_the_transposed_tile_layout():
    """A stored tile holds byte k of the tile's row TileRow(n) where the kernel's shared-memory tile
    does (smem_layout.h, restated here): at [k / 32][n / 8][(k % 32) / 16][n % 8][k % 16] of a 64 x 256
    tile, row TileRow(n) = 16 ((n % 8) / 2) + 2 (n / 8) + n % 2; every byte once."""
    rows, order = native.w2_tile_layout()
    rank = native.cuda_envelope()["rank"]
    assert rows == 64 and order.dtype == np.int32 and order.shape == (rows * rank,)
    assert np.array_equal(np.sort(order), np.arange(rows * rank))
    n, k = np.meshgrid(np.arange(rows), np.arange(rank), indexing="ij")
    offset = (k // 32) * (rows * 32) + (n // 8) * 256 + ((k % 32) // 16) * 128 + (n % 8) * 16 + k % 16
    tile_row = 16 * ((n % 8) // 2) + 2 * (n // 8) + n % 2
    assert np.array_equal(order[offset.ravel()], (tile_row * rank + k).ravel())
    with pytest.raises(ValueError, match="read-only"):
        order[0] = 1


def test_every_instantiated_kernel_is_some_plan():
    """No instance is dead: each is the plan of some call in a wider grid."""
    planned = set()
    for case in itertools.product(BATCHES, (7,), VOCABS, W2, FLOATS, FLOATS, LOGITS, (False, True), (H100,)):
        for certified in (False, True):
            if _supported(case, certified):
                planned.update(p["name"] for p in _plans(*case, certified=certified))
    assert planned == set(native._markov_plan.instantiated_kernels())


@pytest.mark.parametrize("batch, sampling, logits, base, kernel", [
    (1, False, None, "bfloat16", "walk<nt=1,digits,certified,w2=int8,threads=512,staged,form=plain>"),
    (2, False, None, "bfloat16", "walk<nt=1,digits,certified,w2=int8,threads=512,staged,form=plain>"),
    (1, False, "bfloat16", "bfloat16", "walk<nt=1,digits,certified,w2=int8,threads=512,staged,form=any>"),
    (2, True, "float32", "bfloat16", "walk<nt=1,digits,certified,w2=int8,threads=512,staged,form=any>"),
    (1, False, None, "float32", "walk<nt=1,digits,certified,w2=int8,threads=512,staged,form=any>"),
    (3, False, None, "bfloat16", "walk<nt=1,split,pairs,certified,w2=int8,threads=512,staged,form=any>"),
    (8, True, "bfloat16", "bfloat16", "walk<nt=2,split,pairs,certified,w2=int8,threads=512,form=any>"),
    (9, False, None, "bfloat16", "walk<nt=2,eregs,certified,w2=int8,threads=256,form=plain>"),
    (16, False, None, "bfloat16", "walk<nt=2,eregs,certified,w2=int8,threads=256,form=plain>"),
    (17, False, None, "bfloat16", "transposed<base=bfloat16,packed,certified>"),
    (32, False, None, "bfloat16", "transposed<base=bfloat16,packed,certified>"),
    (33, False, None, "bfloat16", "transposed<base=bfloat16,certified>"),
    (64, False, None, "bfloat16", "transposed<base=bfloat16,certified>"),
])
def test_certified_head_takes_the_certified_kernels(batch, sampling, logits, base, kernel):
    """A CertifiedMarkovHead's 1-2 requests walk on the digit kernel's certified instances (tokens only
    from bf16 base logits: the plain form; anything else: the any form), also the greedy half of a
    guarded pair; 3-8 on the digit pairs' (logits out from a bf16 W1 only); 9-16 greedy requests,
    tokens only from bf16 base logits, on EREGS's; 17 to a launch's requests (64, or 32 from a float32
    W1) the same on the transposed kernel's; other batches and forms are refused, naming the limits. A
    sampled batch whose rows all sample certifies nothing: it walks the plain head's sampled launch."""
    w1s = FLOATS if batch <= 2 or logits is None else ["bfloat16"]
    for w1 in [w for w in w1s if batch <= 32 or w != "float32"]:
        plans = _plans(batch, 7, 151936, "int8", w1, base, logits, sampling, H100, certified=True)
        assert all(p["batch"] == batch for p in plans), plans
        for batch_class in ("all_greedy", "mixed"):
            (walking,) = _walking(plans, batch_class)
            assert "certified" in walking["name"], (batch_class, plans)
        (plan,) = _walking(plans, "mixed")
        assert plan["name"] == kernel, plan
        assert plan["resident_tiles"] > 0
        (alone,) = _walking(plans, "all_sampled")
        if sampling:
            plain = _plans(batch, 7, 151936, "int8", w1, base, logits, sampling, H100)
            (plain_sampled,) = _walking(plain, "all_sampled")
            assert (alone["name"], alone["resident_tiles"]) == (plain_sampled["name"], plain_sampled["resident_tiles"])
            assert alone["run_when"] == "all_rows_sample" and alone["sampling"]
        else:
            assert alone is plan
    rank = native.cuda_envelope()["rank"]
    for batch, w1, logits, sampling, base, vocab, says in [
            (65, "bfloat16", None, False, "bfloat16", 151936, "9 to 64 greedy ones (no temperatures, no logits out) with "
                                                             "bfloat16 base logits and an even V (above 16: V a multiple "
                                                             "of 8 and the base logits 16-byte aligned), got B = 65"),
            (33, "float32", None, False, "bfloat16", 151936, "9 to 32 greedy ones"),
            (16, "bfloat16", "bfloat16", False, "bfloat16", 151936, "got B = 16 with logits out"),
            (17, "bfloat16", "bfloat16", False, "bfloat16", 151936, "got B = 17 with logits out"),
            (12, "bfloat16", None, True, "bfloat16", 151936, "got B = 12 with temperatures"),
            (40, "bfloat16", None, True, "bfloat16", 151936, "got B = 40 with temperatures"),
            (12, "bfloat16", None, False, "float32", 151936, "with float32 base logits"),
            (64, "bfloat16", None, False, "float32", 151936, "with float32 base logits"),
            (12, "bfloat16", None, False, "bfloat16", 151935, "at an odd V"),
            (24, "bfloat16", None, False, "bfloat16", 151930, "got B = 24 at V not a multiple of 8")]:
        why = native._markov_plan.unsupported(batch, 7, vocab, rank, "int8", w1, base, logits, sampling, H100, True)
        assert "CertifiedMarkovHead for B <= 8 requests" in why and says in why, why
        with pytest.raises(ValueError, match="B <= 8 requests"):
            _plans(batch, 7, vocab, "int8", w1, base, logits, sampling, H100, certified=True)
    why = native._markov_plan.unsupported(5, 7, 151936, rank, "int8", "float32", "bfloat16", "bfloat16", False, H100,
                                          True)
    assert "got B = 5 with logits out from a float32 W1" in why, why
    # the certified walk keeps a few bytes of state beside the plain walk's: at most one tile fewer
    plain = _plans(1, 7, 151936, "int8", "bfloat16", "bfloat16", None, False, H100)[0]
    certified = _plans(1, 7, 151936, "int8", "bfloat16", "bfloat16", None, False, H100, certified=True)[0]
    assert 0 <= plain["resident_tiles"] - certified["resident_tiles"] <= 1


@pytest.mark.parametrize("batch, sampling, logits, kernel", [
    (1, False, None, "walk<nt=1,digits,w2=int8,threads=512,staged,form=plain>"),
    (2, True, "bfloat16", "walk<nt=1,digits,w2=int8,threads=512,staged,form=bf16_logits>"),
    (2, True, None, "walk<nt=1,digits,w2=int8,threads=512,staged,form=any>"),
    (3, False, None, "walk<nt=1,split,pairs,w2=int8,threads=512,staged,form=any>"),
    (8, True, "bfloat16", "walk<nt=2,split,pairs,w2=int8,threads=512,form=any>"),
    (9, False, None, "walk<nt=2,eregs,w2=int8,threads=256,form=plain>"),
    (12, False, "bfloat16", "walk<nt=2,eregs,w2=int8,threads=256,form=bf16_logits>"),
    (16, False, "float32", "walk<nt=2,w2=int8,threads=512,form=any>"),
    (16, True, "bfloat16", "walk<nt=2,w2=int8,threads=512,form=any>"),
    (17, False, None, "transposed<base=bfloat16,packed,plain>"),
    (32, True, "bfloat16", "transposed<base=bfloat16,packed,sampled>"),
    (40, True, "bfloat16", "transposed<base=bfloat16,rotated_sampled>"),
    (64, False, "bfloat16", "transposed<base=bfloat16,logits>"),
    (64, True, "bfloat16", "transposed<base=bfloat16,sampled>"),
])
def test_batch_ranges_take_their_kernels(batch, sampling, logits, kernel):
    """docs/kernel_design.md's batch ranges, at V = 151936 with bf16 base logits and W1 on an H100."""
    (plan,) = _walking(_plans(batch, 7, 151936, "int8", "bfloat16", "bfloat16", logits, sampling, H100), "mixed")
    assert plan["name"] == kernel


def test_zero_temperature_batches_walk_as_greedy_ones():
    """A sampled call whose greedy launch would be another kernel, or the same one with more resident
    tiles, is a guarded pair per run of requests: the greedy launch (every row greedy) walks where no
    row samples, the sampled launch where some row does; elsewhere one launch walks either way."""
    guarded = 0
    for case in _grid(seed=1, count=1500):
        batch, steps, vocab, w2, w1, base, logits, sampling, props = case
        if not sampling or not _supported(case):
            continue
        plans = _plans(*case)
        greedy = _plans(batch, steps, vocab, w2, w1, base, logits, False, props)
        when_greedy = _walking(plans, "all_greedy")
        assert [p["name"] for p in when_greedy] == [p["name"] for p in greedy], case
        assert [p["resident_tiles"] for p in when_greedy] == [p["resident_tiles"] for p in greedy], case
        for p in plans:
            if p["run_when"] == "no_row_samples":
                twin = next(q for q in plans if q["first"] == p["first"] and q is not p)
                assert twin["run_when"] == "some_row_samples" and twin["batch"] == p["batch"], case
                assert (twin["name"], twin["resident_tiles"]) != (p["name"], p["resident_tiles"]), case
                guarded += 1
            elif p["run_when"] == "always":
                g = next(q for q in greedy if q["first"] == p["first"])
                assert (g["name"], g["resident_tiles"]) == (p["name"], p["resident_tiles"]), case
            else:
                assert p["run_when"] == "some_row_samples", "a plain head's call is guarded in pairs"
    assert guarded > 100
    # At 9-16 requests the greedy walk takes EREGS, the sampled one the fp16-column kernel.
    first, second = _plans(16, 7, 151936, "int8", "bfloat16", "bfloat16", None, True, H100)
    assert (first["name"], first["run_when"]) == ("walk<nt=2,eregs,w2=int8,threads=256,form=plain>", "no_row_samples")
    assert (second["name"], second["run_when"]) == ("walk<nt=2,w2=int8,threads=512,form=any>", "some_row_samples")


def test_noise_is_made_where_it_is_used():
    """No sampled launch needs scratch: small batches make each step's noise ahead in shared memory,
    9-16 requests in MarkovWalkKernel a tile at a time (noise tiles), the transposed kernel in its
    epilogue."""
    def sampled_launch(*args):
        (plan,) = _walking(_plans(*args), "all_sampled")
        return plan

    small = sampled_launch(2, 7, 151936, "int8", "bfloat16", "bfloat16", "bfloat16", True, H100)
    mid = sampled_launch(16, 7, 151936, "int8", "bfloat16", "bfloat16", "bfloat16", True, H100)
    wide = sampled_launch(64, 7, 151936, "int8", "bfloat16", "bfloat16", "bfloat16", True, H100)
    assert small["noise_ahead"] and not small["noise_tiles"]
    assert mid["noise_tiles"] and not mid["noise_ahead"]
    assert wide["family"] == "transposed"
    bf16_wide = sampled_launch(64, 7, 151936, "bfloat16", "bfloat16", "bfloat16", "bfloat16", True, H100)
    assert bf16_wide["noise_tiles"]


def test_envelope_refusals_name_the_limit():
    rank = native.cuda_envelope()["rank"]
    unsupported = native._markov_plan.unsupported
    assert "r = 256, got 128" in unsupported(1, 7, 5000, 128, "int8", "bfloat16", "bfloat16", None, False, H100)
    assert "K = 16 steps, got 17" in unsupported(1, 17, 5000, rank, "int8", "bfloat16", "bfloat16", None, False, H100)
    assert "W2, got float32" in unsupported(1, 7, 5000, rank, "float32", "bfloat16", "bfloat16", None, False, H100)
    assert "sm_80" in unsupported(1, 7, 5000, rank, "int8", "bfloat16", "bfloat16", None, False, dict(H100, major=8))
    assert "cooperative" in unsupported(1, 7, 5000, rank, "int8", "bfloat16", "bfloat16", None, False,
                                        dict(H100, cooperative=False))
    with pytest.raises(ValueError, match="got float64"):
        _plans(1, 7, 5000, "int8", "float64", "bfloat16", None, False, H100)


def test_int8_w2_past_l2_is_walked_but_auto_declines():
    """int8 W2 that neither fits in shared memory nor stays in L2 (V = 270336 streams 37.8 MiB a step on
    132 SMs: past 0.75 of an H100's 50 MiB L2, within an H200's 60 MiB) is walked when asked for
    (impl="ffi"), but impl="auto" takes the reference."""
    rank = native.cuda_envelope()["rank"]
    args = (1, 7, 270336, rank, "int8", "bfloat16", "bfloat16", None, False)
    assert native._markov_plan.unsupported(*args, H100) is None
    assert "L2" in native._markov_plan.slower_than_reference(*args, H100)
    assert native._markov_plan.slower_than_reference(*args, H200) is None
    assert native._markov_plan.slower_than_reference(1, 7, 151936, rank, "int8", "bfloat16", "bfloat16", None, False,
                                                     H100) is None
    assert native._markov_plan.slower_than_reference(1, 7, 400000, rank, "bfloat16", "bfloat16", "bfloat16", None,
                                                     False, H100) is None, "a float W2 is never declined for L2"
