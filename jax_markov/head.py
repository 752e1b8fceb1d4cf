"""The Markov head as pytrees: float weights, the int8 layout every fast path reads, and the certified
int8 head (int8 plus what certifies its greedy choices against the float weights)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import native

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

    tiles: q stored tile by tile (`tile_w2(q)`), or None. The CUDA kernel of 17-64 requests moves each
    64-row tile of W2 into shared memory by one bulk copy from it, instead of 1024 copies of 16 bytes
    from q, and with it walks 9-16 requests too (docs/kernel_design.md), as does a CertifiedMarkovHead's
    walk of 17-64 greedy requests; nothing else reads it.
    `quantize` makes it (the same bytes as q again: 37.1 MiB at V = 151936); the walk trusts that it
    holds q's bytes, so after changing q make the head again with
    `quantize(QuantizedMarkovHead(w1, q, scale))`.
    """

    w1: jax.Array
    q: jax.Array
    scale: jax.Array
    tiles: jax.Array | None = None


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
        return self.w1.nbytes + self.q.nbytes + self.scale.nbytes + (0 if self.tiles is None else self.tiles.nbytes)

    def dequantized_w2(self) -> jax.Array:
        """W2 as the walk uses it, in float32 (for inspection and tests; the walk never builds it)."""
        return self.q.astype(jnp.float32) * self.scale[:, None]

    def __repr__(self):
        w2_bytes = self.q.nbytes + self.scale.nbytes
        tiles = "None" if self.tiles is None else f"int8{list(self.tiles.shape)}"
        return (f"QuantizedMarkovHead(w1={self.w1.dtype}{list(self.w1.shape)}, q=int8{list(self.q.shape)}, "
                f"scale=float32[{self.scale.shape[0]}], tiles={tiles}, w2 memory={_mib(w2_bytes)}, "
                f"total memory={_mib(self.nbytes)})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class CertifiedMarkovHead:
    """An int8 head that keeps what certifies its greedy choices: the unquantized W2 and, per row, an
    upper bound of the norm of its quantization residual, residual_norm[v] >= ||W2[v] - scale[v] q[v]||_2.
    Build it with `quantize(head, certified=True)`, which derives every field from one MarkovHead (the
    walk trusts that they agree).

    The walk of this head:
    - greedy rows choose the token the unquantized head's walk (`unquantized`) chooses with the same
      arguments: the docs/spec.md choice (lowest index of the maximum, the first NaN) over
      l = f32(base) + logit_scale * (W2 @ e) of the unquantized W2, padding and -inf masking as
      always, rounded to logits_dtype first when logits are returned. The CPU custom call scores every
      column with int8 W2 and re-scores exactly, from the unquantized rows, only the columns whose int8
      logit plus its error bound reaches the best int8 logit minus its bound (ffi/cpu/certified.h);
    - sampled rows are the int8 walk's (`quantized`): scores from the int8 logits, as docs/spec.md;
    - the returned logits are the int8 logits for every row, greedy ones included (rejection sampling
      needs the distribution that sampled rows drew from); embeds, d2t, vocab_size and logit_scale
      mean what they mean for any head (the bound scales with |logit_scale|).
    The reference computes both biases in full. On a GPU the CUDA kernel walks this head for up to 64
    requests (the launch plan's limits) with the same bound: up to 16, the grid's int8 keys,
    second-best scores and margins certify most greedy choices, and only where they do not are the
    candidates re-scored exactly (ffi/cuda/walk/certified.cuh); above 16, where nearly every step has
    a choice they could not certify, every step re-scores its candidates (ffi/cuda/transposed/
    certified.cuh); the reference walks it elsewhere. jax_markov.sharding.walk refuses it.
    """

    quantized: QuantizedMarkovHead
    w2: jax.Array  # [V, r] the unquantized W2 (bf16/f16/f32), the array the MarkovHead held
    residual_norm: jax.Array  # [V] float32

    @property
    def w1(self) -> jax.Array:
        return self.quantized.w1

    @property
    def rank(self) -> int:
        return self.quantized.rank

    @property
    def draft_vocab(self) -> int:
        return self.quantized.draft_vocab

    @property
    def target_vocab(self) -> int:
        return self.quantized.target_vocab

    @property
    def unquantized(self) -> MarkovHead:
        """The MarkovHead whose greedy choices this head reproduces."""
        return MarkovHead(self.w1, self.w2)

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes + self.w2.nbytes + self.residual_norm.nbytes

    def __repr__(self):
        q = self.quantized
        int8_bytes = q.q.nbytes + q.scale.nbytes
        tiles = "None" if q.tiles is None else f"int8{list(q.tiles.shape)}"
        return (f"CertifiedMarkovHead(w1={self.w1.dtype}{list(self.w1.shape)}, q=int8{list(q.q.shape)}, "
                f"scale=float32[{q.scale.shape[0]}], tiles={tiles}, residual_norm=float32[{self.residual_norm.shape[0]}], "
                f"w2={self.w2.dtype}{list(self.w2.shape)}, int8 w2 memory={_mib(int8_bytes)}, "
                f"certificate memory={_mib(self.w2.nbytes + self.residual_norm.nbytes)}, "
                f"total memory={_mib(self.nbytes)})")


def quantize(head, *, certified: bool = False, tiles: bool = True) -> QuantizedMarkovHead | CertifiedMarkovHead:
    """int8 W2 with one fp32 scale per row, exactly as docs/spec.md: scale = max|row| / 127
    (1 for an all-zero row), q = round_half_even(W2 / scale) clipped to [-127, 127].

    tiles: whether the int8 head also holds q stored tile by tile (QuantizedMarkovHead.tiles, made
    where the package's plan module is built and r is the CUDA kernel's 256), which the CUDA walk of
    17-64 requests (and, with them, of 9-16) reads faster; tiles=False saves its memory.

    certified=True returns a CertifiedMarkovHead: the int8 head (with tiles as `tiles` says: its CUDA
    walk of 17-64 greedy requests reads them, those of up to 16 do not) plus the unquantized W2 (the
    same array, not a copy) and each row's residual norm, whose greedy rows choose what the
    unquantized head chooses. quantize(h) of a QuantizedMarkovHead is h, its tiles made or dropped as
    `tiles` says; of a CertifiedMarkovHead, its int8 head so, or with certified=True h itself so.

    int8 cannot hold a NaN or an infinity: called eagerly, a W2 with such values is an error naming
    their rows; under a transformation (jit, vmap), where the values are not known, such a row gets
    a NaN scale (and q = 0), so that the int8 head's bias of that row is NaN, as the float head's is
    (and a NaN residual norm: the certified walk always re-scores that row exactly)."""
    if isinstance(head, CertifiedMarkovHead):
        quantized = _with_tiles(head.quantized, tiles)
        if not certified:
            return quantized
        return head if quantized is head.quantized else dataclasses.replace(head, quantized=quantized)
    if isinstance(head, QuantizedMarkovHead):
        if certified:
            raise TypeError("quantize(certified=True) needs the MarkovHead: a QuantizedMarkovHead no longer has "
                            "the unquantized W2 that certifies its greedy choices")
        return _with_tiles(head, tiles)
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
    scale = jnp.where(finite, scale, jnp.float32(jnp.nan))
    quantized = _with_tiles(QuantizedMarkovHead(w1=head.w1, q=q, scale=scale), tiles)
    if not certified:
        return quantized
    return CertifiedMarkovHead(quantized=quantized, w2=head.w2, residual_norm=residual_norm(w2, q, scale, amax))


def _with_tiles(head: QuantizedMarkovHead, tiles: bool) -> QuantizedMarkovHead:
    """head with its tiles made (where tile_w2 makes them) or dropped; head itself where that changes nothing."""
    if not tiles:
        return head if head.tiles is None else dataclasses.replace(head, tiles=None)
    made = None if head.tiles is not None else tile_w2(head.q)
    return head if made is None else dataclasses.replace(head, tiles=made)


def tile_shape(vocab: int, rank: int) -> tuple[int, int] | None:
    """The shape of QuantizedMarkovHead.tiles for q [vocab, rank]: [ceil(V / rows), rows x r]; None where
    the plan module is not built or r is not the CUDA kernel's rank (no kernel would read tiles)."""
    if not native.plan_available():
        return None
    rows, order = native.w2_tile_layout()
    return (-(-vocab // rows), order.size) if rows * rank == order.size else None


def tile_w2(q) -> jax.Array | None:
    """int8 q [V, r] stored tile by tile (QuantizedMarkovHead.tiles, `tile_shape`): a tile's rows zero
    past V and its bytes in the order that the CUDA kernel holds a tile in shared memory
    (native.w2_tile_layout, from ffi/plan); None where `tile_shape` is."""
    shape = tile_shape(*q.shape)
    if shape is None:
        return None
    rows, order = native.w2_tile_layout()
    padded = jnp.pad(q, ((0, shape[0] * rows - q.shape[0]), (0, 0)))
    return jnp.take(padded.reshape(shape), order, axis=1)


def residual_norm(w2, q, scale, amax):
    """An upper bound of ||W2[v] - scale[v] q[v]||_2 per row, from W2 [V, r] in float32.

    The residual and its norm are computed in fp32, so the computed norm is inflated to cover their
    roundings: each residual element is off by at most 2^-24 (|residual| + 1.01 max|row|) (the product
    scale q and the difference each round once), the sum of r squares and the root by at most
    (r + 6) 2^-24 relative; and by flushed underflows (a square or a residual below 2^-126 read as
    0), at most sqrt(r) 2^-62 in all. NaN for a row holding NaN or infinities (NaN scale)."""
    rank = w2.shape[1]
    residual = w2 - scale[:, None] * q.astype(jnp.float32)
    computed = jnp.sqrt(jnp.sum(residual * residual, axis=1))
    relative = np.float32(1.0 + (rank + 8) * 2.0**-24)
    per_amax = np.float32(2.0**-21 * 1.01 * np.sqrt(rank))  # >= 1.01 * 2^-24 sqrt(r), with room for its own roundings
    underflow = np.float32(2.0**-62 * np.sqrt(rank))
    return computed * relative + amax * per_amax + underflow
