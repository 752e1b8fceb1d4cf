"""The Markov head as pytrees: float weights, and the int8 layout every fast path reads."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_ROWS_LISTED = 10


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class MarkovHead:
    """DSpark low-rank Markov head: bias = logit_scale * (w2 @ w1[prev]).

    w1: [V_target, r] embedding of the previous (target-vocabulary) token.
    w2: [V_draft, r] projection onto the draft vocabulary.
    """

    w1: jax.Array
    w2: jax.Array


    @property
    def rank(self) -> int:
        return self.w2.shape[1]

    @property
    def draft_vocab(self) -> int:
        return self.w2.shape[0]

    @property
    def target_vocab(self) -> int:
        return self.w1.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w1.nbytes + self.w2.nbytes

    def __repr__(self):
        return (f"MarkovHead(w1={self.w1.dtype}{list(self.w1.shape)}, w2={self.w2.dtype}{list(self.w2.shape)}, "
                f"memory={_mib(self.nbytes)})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class QuantizedMarkovHead:
    """Markov head with W2 in int8, one fp32 scale per row: W2[v, j] = q[v, j] * scale[v].

    The [V, r] row-major int8 layout is what the CPU and CUDA custom calls read directly:
    one row of r = 256 int8 values is 256 contiguous bytes.
    """

    w1: jax.Array
    q: jax.Array
    scale: jax.Array


    @property
    def rank(self) -> int:
        return self.q.shape[1]

    @property
    def draft_vocab(self) -> int:
        return self.q.shape[0]

    @property
    def target_vocab(self) -> int:
        return self.w1.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w1.nbytes + self.q.nbytes + self.scale.nbytes

    def dequantized_w2(self) -> jax.Array:
        """W2 as the walk uses it, in float32 (for inspection and tests; the walk never builds it)."""
        return self.q.astype(jnp.float32) * self.scale[:, None]

    def __repr__(self):
        w2_bytes = self.q.nbytes + self.scale.nbytes
        return (f"QuantizedMarkovHead(w1={self.w1.dtype}{list(self.w1.shape)}, q=int8{list(self.q.shape)}, "
                f"scale=float32[{self.scale.shape[0]}], w2 memory={_mib(w2_bytes)}, "
                f"total memory={_mib(self.nbytes)})")


def quantize(head: MarkovHead) -> QuantizedMarkovHead:
    """int8 W2 with one fp32 scale per row, exactly as docs/spec.md: scale = max|row| / 127
    (1 for an all-zero row), q = round_half_even(W2 / scale) clipped to [-127, 127].

    int8 cannot hold a NaN or an infinity: called eagerly, a W2 with such values is an error naming
    their rows; under a transformation (jit, vmap), where the values are not known, such a row gets
    a NaN scale (and q = 0), so that the int8 head's bias of that row is NaN, as the float head's is."""
    if isinstance(head, QuantizedMarkovHead):
        return head
    if not isinstance(head, MarkovHead):
        raise TypeError(f"quantize expects a MarkovHead, got {type(head).__name__}")
    if head.w2.ndim != 2 or head.w2.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"head.w2 must be a [V, r] bfloat16/float16/float32 array, got {head.w2.dtype}{list(head.w2.shape)}")
    w2 = head.w2.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(w2), axis=1)
    if not isinstance(finite, jax.core.Tracer):
        rows = np.flatnonzero(~np.asarray(finite))
        if rows.size:
            shown = ", ".join(map(str, rows[:_MAX_ROWS_LISTED]))
            more = f" (and {rows.size - _MAX_ROWS_LISTED} more)" if rows.size > _MAX_ROWS_LISTED else ""
            raise ValueError(f"quantize: W2 rows [{shown}]{more} hold NaN or infinite values, which int8 cannot "
                             f"represent ({rows.size} of {w2.shape[0]} rows)")
    amax = jnp.max(jnp.abs(w2), axis=1)
    # XLA rewrites `x / broadcast(y)` as `x * broadcast(1 / y)`, which is not the division docs/spec.md
    # asks for (scale and q would differ from max|row| / 127 and round(W2 / scale) in the last bit).
    # Full-size divisors behind an optimization barrier keep the true IEEE division. The 127s are
    # derived from amax so that under vmap they are batched too (not a broadcast of a constant).
    divisor = lax.optimization_barrier(jnp.where(amax >= 0, jnp.float32(127.0), jnp.float32(127.0)))
    scale = jnp.where(amax > 0, amax / divisor, jnp.float32(1.0))
    divisor = lax.optimization_barrier(jnp.broadcast_to(scale[:, None], w2.shape))
    q = jnp.clip(jnp.round(w2 / divisor), -127, 127).astype(jnp.int8)
    q = jnp.where(finite[:, None], q, jnp.int8(0))
    return QuantizedMarkovHead(w1=head.w1, q=q, scale=jnp.where(finite, scale, jnp.float32(jnp.nan)))
