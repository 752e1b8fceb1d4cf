"""Philox4x32-10 and the Gumbel noise of SPEC.md, in uint32 jnp arithmetic (no x64 needed)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_M0, _M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
DRAFT_STREAM = np.uint32(0x40000000)  # counter word 2: keeps draft noise apart from other streams


def _mulhilo(a, b):
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 a and b, from 16-bit pieces."""
    m16 = np.uint32(0xFFFF)
    al, ah = a & m16, a >> 16
    bl, bh = b & m16, b >> 16
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    mid = (ll >> 16) + (lh & m16) + (hl & m16)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16)
    return hi, a * b


def philox4x32_10(counter, key):
    """Philox4x32-10 (Random123). counter: 4 uint32 arrays, key: 2 uint32 arrays (broadcastable)."""
    c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
    k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + _W0, k1 + _W1
    return c0, c1, c2, c3


def uniform_from_bits(x):
    """u = (float(x >> 9) + 0.5) * 2^-23: exact in fp32, never 0 or 1."""
    return ((x >> 9).astype(jnp.float32) + jnp.float32(0.5)) * jnp.float32(2.0**-23)


def gumbel_noise(key_words, vocab_index, position):
    """g(v) = -log(-log(u)), u from Philox word 0 at counter (v, position, 0x40000000, 0).

    key_words: ([...], [...]) uint32 key halves; vocab_index and position broadcast against them.
    """
    v = jnp.asarray(vocab_index).astype(jnp.uint32)
    p = jnp.asarray(position).astype(jnp.uint32)
    x, _, _, _ = philox4x32_10((v, p, DRAFT_STREAM, np.uint32(0)), key_words)
    return -jnp.log(-jnp.log(uniform_from_bits(x)))
