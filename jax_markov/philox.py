"""Philox4x32-10 and the Gumbel noise of docs/spec.md, in uint32 jnp arithmetic (no x64 needed).

The public functions are what every random stream of the package is made of:
- `philox4x32_10(counter, key)`: the four output words of Philox blocks;
- `uniform_from_bits(x)`: a uniform in (0, 1) from one output word;
- `gumbel_from_bits(x)`: -log(-log(u)) of that uniform;
- `gumbel_noise(key_words, column, position)`: the walk's draft noise g(v) for any columns;
- `gumbel_noise_range(key_words, start, count, position)`: the same for `count` consecutive
  columns, one Philox block per four columns.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_M0, _M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
DRAFT_STREAM = np.uint32(0x40000000)  # counter word 2: keeps draft noise apart from other streams
WORDS_PER_BLOCK = 4  # one Philox block gives the draft noise of four consecutive columns


def _mulhilo(a, b):
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 a and b, from 16-bit pieces."""
    m16 = np.uint32(0xFFFF)
    al, ah = a & m16, a >> 16
    bl, bh = b & m16, b >> 16
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> 16) + (lh & m16) + (hl & m16)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16)
    return hi, a * b


def _round(state):
    c0, c1, c2, c3, k0, k1 = state
    hi0, lo0 = _mulhilo(_M0, c0)
    hi1, lo1 = _mulhilo(_M1, c2)
    return hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0, k0 + _W0, k1 + _W1


def philox4x32_10(counter, key, *, unroll: bool = True):
    """Philox4x32-10 (Random123): the four output words (in output order) of the blocks at
    `counter` (4 uint32 arrays) under `key` (2 uint32 arrays), all broadcast together.

    unroll=False runs the ten rounds in a `lax.fori_loop`: one round traced instead of ten, which
    keeps the compile of a large program (the speculative decode loop) short."""
    words = [jnp.asarray(x).astype(jnp.uint32) for x in (*counter, *key)]
    shape = jnp.broadcast_shapes(*(w.shape for w in words))
    state = tuple(jnp.broadcast_to(w, shape) for w in words)
    if unroll:
        for _ in range(10):
            state = _round(state)
    else:
        state = lax.fori_loop(0, 10, lambda _, s: _round(s), state)
    return state[:4]


def uniform_from_bits(x):
    """u = (float(x >> 9) + 0.5) * 2^-23: exact in fp32, never 0 or 1."""
    return ((x >> 9).astype(jnp.float32) + jnp.float32(0.5)) * jnp.float32(2.0**-23)


def gumbel_from_bits(x):
    """-log(-log(u)) with u = uniform_from_bits(x): a standard Gumbel from one Philox word."""
    return -jnp.log(-jnp.log(uniform_from_bits(x)))


def gumbel_noise(key_words, column, position):
    """docs/spec.md's draft noise g(v) for arbitrary columns v: word v mod 4 of the Philox block at
    counter (v // 4, position, 0x40000000, 0).

    key_words: (k0, k1) uint32 key halves; column (ints >= 0) and position broadcast against them.
    One block per value: for a whole range of columns `gumbel_noise_range` needs a quarter of that."""
    v = jnp.asarray(column).astype(jnp.uint32)
    x = philox4x32_10((v // WORDS_PER_BLOCK, position, DRAFT_STREAM, np.uint32(0)), key_words)
    word = v % WORDS_PER_BLOCK
    return gumbel_from_bits(jnp.select([word == w for w in range(3)], x[:3], x[3]))


def gumbel_noise_range(key_words, start, count: int, position):
    """g(v) of `gumbel_noise` for the columns v = start, ..., start + count - 1, shape [..., count],
    where [...] is the shape key_words and position broadcast to.

    start: an int >= 0, or a traced integer scalar (the first global column of a vocabulary shard).
    Each block gives four consecutive columns; where start is traced and so its offset inside its
    block unknown, one more block per row is computed and the columns are sliced out."""
    lead = start % WORDS_PER_BLOCK if isinstance(start, int | np.integer) else WORDS_PER_BLOCK - 1
    n_blocks = -(-(lead + count) // WORDS_PER_BLOCK)
    start = jnp.asarray(start).astype(jnp.uint32)
    blocks = start // WORDS_PER_BLOCK + jnp.arange(n_blocks, dtype=jnp.uint32)
    k0, k1 = (jnp.asarray(k)[..., None] for k in key_words)
    x = philox4x32_10((blocks, jnp.asarray(position)[..., None], DRAFT_STREAM, np.uint32(0)), (k0, k1))
    x = jnp.stack(x, axis=-1)  # [..., n_blocks, 4]: columns in order
    x = x.reshape(*x.shape[:-2], n_blocks * WORDS_PER_BLOCK)
    lead = (start % WORDS_PER_BLOCK).astype(jnp.int32)
    return gumbel_from_bits(lax.dynamic_slice_in_dim(x, lead, count, axis=-1))
