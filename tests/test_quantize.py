"""jax_markov.quantize against NumPy (docs/spec.md's int8 layout: one fp32 scale per row, q = rint(w / scale)),
the heads' memory report, and W2 rows holding NaN or infinities (refused eagerly, a NaN scale under
transforms, so that the int8 head drafts as the float head does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import native, reference

def quantize_np(w2):
    w2 = np.asarray(w2, np.float32)
    amax = np.abs(w2).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w2 / scale[:, None]), -127, 127).astype(np.int8)  # rint: round half to even
    return q, scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_matches_numpy(rng, dtype):
    v, r = 37, 24
    w2 = rng.normal(0, 0.3, (v, r)).astype(np.float32)
    w2[3] = 0.0  # zero row: scale 1, q 0
    w2[5, :8] = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5]  # scale 1, exact halves -> even
    w2[5, 8:] = 0.25
    w2[6] = -w2[5]
    w2 = np.asarray(jnp.asarray(w2, dtype).astype(jnp.float32))
    w1 = jnp.asarray(rng.normal(0, 1, (11, r)), jnp.bfloat16)
    qhead = jax_markov.quantize(jax_markov.MarkovHead(w1, jnp.asarray(w2, dtype)))
    assert qhead.q.dtype == jnp.int8 and qhead.scale.dtype == jnp.float32 and qhead.w1 is w1
    q, scale = quantize_np(w2)
    np.testing.assert_array_equal(np.asarray(qhead.scale), scale)
    np.testing.assert_array_equal(np.asarray(qhead.q), q)
    assert scale[3] == 1.0 and not q[3].any()
    np.testing.assert_array_equal(q[5, :8], [127, 0, 2, 2, 0, -2, 4, -126])
    np.testing.assert_array_equal(q[6, :8], [-127, 0, -2, -2, 0, 2, -4, 126])
    assert np.abs(q).max(axis=1)[np.abs(w2).max(axis=1) > 0].min() == 127  # every nonzero row uses the range
    np.testing.assert_array_equal(np.asarray(qhead.dequantized_w2()), q.astype(np.float32) * scale[:, None])
    # quantization error at most half a step per element
    assert np.all(np.abs(q * scale[:, None] - w2) <= scale[:, None] * (0.5 + 1e-6))
    assert jax_markov.quantize(qhead) is qhead
    with pytest.raises(TypeError, match="MarkovHead"):
        jax_markov.quantize((w1, w2))


def test_head_repr_reports_memory():
    v, r, vt = 4096, 256, 6000
    head = jax_markov.MarkovHead(jnp.zeros((vt, r), jnp.bfloat16), jnp.zeros((v, r), jnp.bfloat16))
    total = (vt * r * 2 + v * r * 2) / 2**20
    assert head.nbytes == vt * r * 2 + v * r * 2
    assert repr(head) == f"MarkovHead(w1=bfloat16[{vt}, {r}], w2=bfloat16[{v}, {r}], memory={total:.1f} MiB)"
    qhead = jax_markov.quantize(head, tiles=False)
    w2_bytes = v * r + 4 * v
    assert qhead.nbytes == vt * r * 2 + w2_bytes
    text = repr(qhead)
    assert f"w2 memory={w2_bytes / 2**20:.1f} MiB" in text
    assert f"total memory={(vt * r * 2 + w2_bytes) / 2**20:.1f} MiB" in text
    assert f"q=int8[{v}, {r}]" in text and "tiles=None" in text
    assert (head.rank, head.draft_vocab, head.target_vocab) == (r, v, vt)
    assert (qhead.rank, qhead.draft_vocab, qhead.target_vocab) == (r, v, vt)
    if native.plan_available():  # the tiles: q's bytes again, V / 64 tiles of 64 rows
        tiled = jax_markov.quantize(head)
        assert tiled.nbytes == qhead.nbytes + v * r and f"tiles=int8[{v // 64}, {64 * r}]" in repr(tiled)
        assert f"total memory={(vt * r * 2 + w2_bytes + v * r) / 2**20:.1f} MiB" in repr(tiled)


def _tiles_np(q):
    """q stored tile by tile as native.w2_tile_layout says, from NumPy: rows past V zero."""
    rows, order = native.w2_tile_layout()
    count = -(-q.shape[0] // rows)
    padded = np.zeros((count * rows, q.shape[1]), np.int8)
    padded[:q.shape[0]] = q
    return padded.reshape(count, -1)[:, order]


@pytest.mark.skipif(not native.plan_available(), reason="the jax_markov plan module is not built")
@pytest.mark.parametrize("vocab", [64, 200, 1000])
def test_quantize_stores_q_tile_by_tile(rng, vocab):
    """quantize's tiles hold q's bytes in the plan's tile order (tests/test_plan.py pins that order
    against the kernel's layout), eagerly, under jit and under vmap; quantize adds them to a head
    without, drops them with tiles=False, gives them to a certified head's int8 head as to any, and
    never to a rank the CUDA kernel does not walk."""
    w1 = jnp.asarray(rng.normal(0, 1, (50, 256)), jnp.bfloat16)
    w2 = jnp.asarray(rng.normal(0, 0.3, (vocab, 256)), jnp.bfloat16)
    head = jax_markov.MarkovHead(w1, w2)
    qhead = jax_markov.quantize(head)
    want = _tiles_np(np.asarray(qhead.q))
    assert qhead.tiles.dtype == jnp.int8 and qhead.tiles.shape == (-(-vocab // 64), 64 * 256)
    np.testing.assert_array_equal(np.asarray(qhead.tiles), want)
    rows_back = np.empty_like(want)  # undo the order: q's rows, then zero rows up to a whole tile
    rows_back[:, native.w2_tile_layout()[1]] = want
    np.testing.assert_array_equal(rows_back.reshape(-1, 256)[:vocab], np.asarray(qhead.q))
    assert not rows_back.reshape(-1, 256)[vocab:].any()
    np.testing.assert_array_equal(np.asarray(jax.jit(jax_markov.quantize)(head).tiles), want)
    heads = jax_markov.MarkovHead(jnp.stack([w1, -w1]), jnp.stack([w2, -w2]))
    both = jax.vmap(jax_markov.quantize)(heads)
    np.testing.assert_array_equal(np.asarray(both.tiles[0]), want)
    np.testing.assert_array_equal(np.asarray(both.tiles[1]), _tiles_np(-np.asarray(qhead.q)))

    bare = jax_markov.quantize(head, tiles=False)
    assert bare.tiles is None and jax_markov.quantize(bare, tiles=False) is bare
    np.testing.assert_array_equal(np.asarray(jax_markov.quantize(bare).tiles), want)
    assert jax_markov.quantize(qhead) is qhead and jax_markov.quantize(qhead, tiles=False).tiles is None
    certified = jax_markov.quantize(head, certified=True)
    np.testing.assert_array_equal(np.asarray(certified.quantized.tiles), want)
    assert jax_markov.quantize(head, certified=True, tiles=False).quantized.tiles is None
    narrow = jax_markov.MarkovHead(w1[:, :128], w2[:, :128])
    assert jax_markov.quantize(narrow).tiles is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_refuses_non_finite_rows_and_poisons_them_under_transforms(rng, bad):
    """Eagerly, a W2 row holding a NaN or an infinity is an error naming the rows; under jit and vmap
    it gets a NaN scale (and q = 0) while every other row quantizes as usual."""
    v, r = 40, 16
    w2 = rng.normal(0, 0.3, (v, r)).astype(np.float32)
    w2[3, 11] = bad
    w2[17, 0] = bad
    w1 = jnp.asarray(rng.normal(0, 1, (v, r)), jnp.float32)
    head = jax_markov.MarkovHead(w1, jnp.asarray(w2))
    with pytest.raises(ValueError, match=r"W2 rows \[3, 17\] hold NaN or infinite values"):
        jax_markov.quantize(head)
    clean = w2.copy()
    clean[[3, 17]] = 0.0
    q_clean, s_clean = quantize_np(clean)
    for q in (jax.jit(jax_markov.quantize)(head),
              jax.tree.map(lambda x: x[0], jax.vmap(jax_markov.quantize)(jax.tree.map(lambda x: x[None], head)))):
        scale = np.asarray(q.scale)
        assert np.isnan(scale[[3, 17]]).all() and not np.isnan(np.delete(scale, [3, 17])).any()
        np.testing.assert_array_equal(np.delete(scale, [3, 17]), np.delete(s_clean, [3, 17]))
        np.testing.assert_array_equal(np.asarray(q.q), q_clean)


def test_nan_row_drafts_alike_with_the_float_and_the_int8_head(rng, make_inputs):
    """A NaN in W2's row 3: the float head's bias of column 3 is NaN at every step, so is the int8
    head's (NaN scale): both choose column 3 at every step, greedy and sampled rows alike."""
    v, r = 24, 8
    w2 = rng.normal(0, 0.5, (v, r)).astype(np.float32)
    w2[3, 5] = np.nan
    head = jax_markov.MarkovHead(jnp.asarray(rng.normal(0, 0.5, (v, r)), jnp.float32), jnp.asarray(w2))
    inputs = make_inputs(rng, 6, 3, v, sampled=True)
    for h in (head, jax.jit(jax_markov.quantize)(head)):
        tokens = np.asarray(reference.walk(head=h, **inputs).tokens)
        np.testing.assert_array_equal(tokens, 3)
