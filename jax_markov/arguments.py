"""Checks and normalises the arguments of `walk` once, for every implementation.

Every error is raised at trace time and names the argument and the limit.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import native
from .head import FLOAT_DTYPES, CertifiedMarkovHead, MarkovHead, QuantizedMarkovHead, tile_shape

IMPLS = ("auto", "reference", "ffi")


class WalkOperands(NamedTuple):
    """The arrays of one walk, in the order the custom calls take them.

    w2_scale is float32 [V] for an int8 head and float32 [0] for a float head;
    d2t is int32 [V] or int32 [0] when no draft-to-target map is given;
    w2_tiles is an int8 head's tiles (QuantizedMarkovHead.tiles), or int8 [0].
    """

    base_logits: jax.Array  # [B, K, V] bf16/f16/f32
    anchor: jax.Array  # [B] int32 in [0, V_target) (`normalize` clamps it)
    w1: jax.Array  # [V_target, r] bf16/f16/f32
    w2: jax.Array  # [V, r] int8 or bf16/f16/f32
    w2_scale: jax.Array  # [V] or [0] float32
    temperature: jax.Array  # [B] float32, <= 0 (or NaN) means greedy
    key: jax.Array  # [B, 2] uint32 Philox key words
    position: jax.Array  # [B] int32: the bits of Philox counter word 1 (uint32)(position)
    d2t: jax.Array  # [V] or [0] int32
    w2_tiles: jax.Array  # [ceil(V / 64), 64 r] or [0] int8


class CertifiedOperands(NamedTuple):
    """What a CertifiedMarkovHead adds to the walk (operands 10 and 11 of the custom calls, passed only
    for such a head): the unquantized W2 and the residual norms of its rows, or two float32 [0]
    placeholders for any other head (the `markov_walk` primitive always has all twelve operands)."""

    w2_exact: jax.Array  # [V, r] bf16/f16/f32, or float32 [0]
    residual_norm: jax.Array  # [V] or [0] float32


def no_certificate() -> CertifiedOperands:
    """The placeholders of a head that is not certified."""
    return CertifiedOperands(jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32))


def no_tiles() -> jax.Array:
    """The w2_tiles placeholder of a head without tiles."""
    return jnp.zeros((0,), jnp.int8)


def _tiles(head: QuantizedMarkovHead, q) -> jax.Array:
    """head.tiles, checked against q's shape (`tile_shape`), or the placeholder (no tiles, or no plan
    module to say their layout: then nothing could read them)."""
    if head.tiles is None or not native.plan_available():
        return no_tiles()
    shape = tile_shape(*q.shape)
    got = f"{head.tiles.dtype}{list(head.tiles.shape)}"
    if shape is None:
        rows, order = native.w2_tile_layout()
        raise ValueError(f"head.tiles must be None for q of shape {list(q.shape)}: the CUDA kernel reads tiles only "
                         f"with r * {rows} = {order.size}, got {got}")
    if head.tiles.dtype != jnp.int8 or head.tiles.shape != shape:
        raise ValueError(f"head.tiles must be int8 {list(shape)} (q stored tile by tile, see quantize) for q of shape "
                         f"{list(q.shape)}, got {got}")
    return head.tiles


def is_certified(certified: CertifiedOperands) -> bool:
    """Whether the operands (arrays or avals) are a certificate rather than the placeholders."""
    return certified.w2_exact.ndim == 2


@dataclasses.dataclass(frozen=True)
class WalkParams:
    """Static configuration of one walk (hashable: it becomes primitive parameters)."""

    vocab_size: int
    logit_scale: float
    sampling: bool  # temperature was given: some rows may be sampled
    return_logits: bool
    logits_dtype: jnp.dtype
    return_embeds: bool
    impl: str


def _per_request(name: str, x, batch: int, kinds: str, *, scalar_kinds: str | None = None):
    """x as a [B] array of one of the dtype kinds ("f", "iu"; scalar_kinds for a scalar), in its own
    dtype: a jax.Array as it is, anything else through NumPy (jnp.asarray would wrap int64 values
    into int32 where x64 is off)."""
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    allowed = scalar_kinds if x.ndim == 0 and scalar_kinds else kinds
    if x.dtype.kind not in allowed:
        raise TypeError(f"{name} must be {'an integer' if kinds == 'iu' else 'a float'} array, got {x.dtype}")
    if x.ndim == 0:
        x = (np if isinstance(x, np.ndarray) else jnp).broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}] (or be a scalar), got {list(x.shape)}")
    return x


def clamp_to_int32(x, lo: int, hi: int):
    """Integer array x clamped into [lo, hi] in its own dtype (NumPy or jnp, as x is), then int32 (low
    32 bits): a value too wide for int32 saturates instead of wrapping."""
    info = np.iinfo(x.dtype)
    lo, hi = np.asarray(max(lo, info.min), x.dtype), np.asarray(min(hi, info.max), x.dtype)
    xp = np if isinstance(x, np.ndarray) else jnp
    return jnp.asarray(xp.clip(x, lo, hi).astype(np.int32))


# Philox counter word 1 is (uint32)(position + k) (docs/spec.md): int32 and uint32 positions both keep
# their meaning; wider ones must lie in their union, or two positions would share one noise stream.
POSITION_RANGE = (-(2**31), 2**32 - 1)


def request_positions(position, batch: int):
    """position [B] (any integer dtype, or a scalar) as int32 Philox counter bits. A concrete value
    outside POSITION_RANGE is an error; a traced one (checked only where the dtype is wider than 32
    bits) is clamped into it."""
    position = _per_request("position", position, batch, "iu")
    info = np.iinfo(position.dtype)
    lo, hi = POSITION_RANGE
    if info.min < lo or info.max > hi:
        try:
            low, high = int(position.min()), int(position.max())
        except jax.errors.ConcretizationTypeError:
            pass  # traced: clamped below
        else:
            if low < lo or high > hi:
                raise ValueError(f"position must lie in [-2^31, 2^32) (the Philox counter word is (uint32)(position "
                                 f"+ k)), got values in [{low}, {high}]")
    return clamp_to_int32(position, lo, hi)


def request_keys(key, batch: int):
    """key ([B] typed PRNG keys or their [B, 2] uint32 data) as [B, 2] uint32 Philox key words."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != (batch,):
            raise ValueError(f"key must hold one PRNG key per request, shape [B] = [{batch}], got {list(key.shape)}")
        key = jax.random.key_data(key)
        if key.shape != (batch, 2):
            raise ValueError(f"key must be a two-word PRNG key (threefry2x32 style); its data has shape {list(key.shape)}")
    if key.dtype != jnp.uint32 or key.shape != (batch, 2):
        raise ValueError(f"key must be [B] typed PRNG keys or their [B, 2] uint32 data with B = {batch}, "
                         f"got {key.dtype}{list(key.shape)}")
    return key


def normalize(base_logits, anchor, head, **kw) -> tuple[WalkOperands, WalkParams]:
    """`walk_arguments` for the entry points that walk a MarkovHead or a QuantizedMarkovHead only
    (jax_markov.sharding.walk): a CertifiedMarkovHead is an error there, never walked as plain int8."""
    if isinstance(head, CertifiedMarkovHead):
        raise TypeError("head: jax_markov.sharding.walk (and jax_markov.walk with requests split over Explicit mesh "
                        "axes, which takes it) does not walk a CertifiedMarkovHead yet; jax_markov.walk and "
                        "jax_markov.reference.walk do. Pass head.quantized (int8) or head.unquantized here")
    ops, _, params = walk_arguments(base_logits, anchor, head, **kw)
    return ops, params


def walk_arguments(base_logits, anchor, head, *, temperature, key, position, vocab_size, logit_scale, d2t,
                   return_logits, logits_dtype, return_embeds,
                   impl) -> tuple[WalkOperands, CertifiedOperands, WalkParams]:
    """The checked, normalised arguments of `walk`: its operands, a CertifiedMarkovHead's certificate
    (placeholders for any other head) and its static parameters."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    certified = no_certificate()
    if isinstance(head, CertifiedMarkovHead):
        if not isinstance(head.quantized, QuantizedMarkovHead):
            raise TypeError(f"head.quantized of a CertifiedMarkovHead must be a QuantizedMarkovHead (see quantize), "
                            f"got {type(head.quantized).__name__}")
        w2_exact, norms = head.w2, head.residual_norm
        if w2_exact.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES] or w2_exact.shape != head.quantized.q.shape:
            raise ValueError(f"head.w2 of a CertifiedMarkovHead must be the unquantized W2, bfloat16/float16/float32 "
                             f"{list(head.quantized.q.shape)} like q, got {w2_exact.dtype}{list(w2_exact.shape)}")
        if norms.dtype != jnp.float32 or norms.shape != w2_exact.shape[:1]:
            raise ValueError(f"head.residual_norm must be float32 [V] = {list(w2_exact.shape[:1])} (one bound per row "
                             f"of W2), got {norms.dtype}{list(norms.shape)}")
        certified = CertifiedOperands(w2_exact, norms)
        head = head.quantized
    w2_tiles = no_tiles()
    if isinstance(head, MarkovHead):
        w1, w2 = head.w1, head.w2
        w2_scale = jnp.zeros((0,), jnp.float32)
        if w2.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise TypeError(f"head.w2 must be bfloat16, float16 or float32, got {w2.dtype}")
    elif isinstance(head, QuantizedMarkovHead):
        w1, w2, w2_scale = head.w1, head.q, head.scale
        if w2.dtype != jnp.int8:
            raise TypeError(f"head.q of a QuantizedMarkovHead must be int8 (see quantize), got {w2.dtype}")
        if w2_scale.dtype != jnp.float32 or w2_scale.shape != w2.shape[:1]:
            raise ValueError(f"head.scale must be float32 [V] = {list(w2.shape[:1])} (one scale per row of q), "
                             f"got {w2_scale.dtype}{list(w2_scale.shape)}")
        w2_tiles = _tiles(head, w2)
    else:
        kind = type(head).__qualname__
        kind = kind if type(head).__module__ == "builtins" else f"{type(head).__module__}.{kind}"
        hint = " (a module: pass its .head(), or call its .walk)" if callable(getattr(head, "head", None)) else ""
        raise TypeError(f"head must be a jax_markov.MarkovHead or a jax_markov.QuantizedMarkovHead, got {kind}{hint}. "
                        f"A jax_markov.CertifiedMarkovHead (quantize(head, certified=True)) walks too")
    if w1.ndim != 2 or w1.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"head.w1 must be a [V_target, r] bfloat16/float16/float32 array, got {w1.dtype}{list(w1.shape)}")
    v_target, rank = w1.shape
    if w2.ndim != 2 or w2.shape[1] != rank:
        raise ValueError(f"head W2 must be [V, r] with r = {rank} (the rank of w1), got {list(w2.shape)}")
    if v_target < 1 or rank < 1:
        raise ValueError(f"head.w1 must be non-empty, got shape {list(w1.shape)}")

    base_logits = jnp.asarray(base_logits) if not isinstance(base_logits, jax.Array) else base_logits
    if base_logits.ndim != 3:
        raise ValueError(f"base_logits must be [B, K, V], got rank {base_logits.ndim} shape {list(base_logits.shape)}")
    if base_logits.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"base_logits must be bfloat16, float16 or float32, got {base_logits.dtype}")
    batch, steps, vocab = base_logits.shape
    if batch < 1 or steps < 1:
        raise ValueError(f"base_logits must have B >= 1 and K >= 1, got shape {list(base_logits.shape)}")
    if vocab != w2.shape[0]:
        raise ValueError(f"base_logits vocabulary V = {vocab} must equal the head's draft vocabulary {w2.shape[0]}")

    anchor = clamp_to_int32(_per_request("anchor", anchor, batch, "iu"), 0, v_target - 1)

    if vocab_size is None:
        vocab_size = vocab
    if (not isinstance(vocab_size, int | np.integer) or isinstance(vocab_size, bool)
            or not 1 <= int(vocab_size) <= vocab):
        raise ValueError(f"vocab_size must be a static int in [1, V = {vocab}], got {vocab_size!r}")

    try:
        logit_scale = float(logit_scale)
    except (TypeError, ValueError) as e:  # a traced value is a TypeError (ConcretizationTypeError)
        raise TypeError(f"logit_scale must be a static Python float, got {logit_scale!r}") from e
    if not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be finite (it multiplies every bias), got {logit_scale}")

    sampling = temperature is not None
    if sampling:
        if key is None:
            raise ValueError("key is required when temperature is given (one PRNG key per request)")
        if position is None:
            raise ValueError("position is required when temperature is given (the sequence position of "
                             "each request's first draft token)")
        temperature = jnp.asarray(_per_request("temperature", temperature, batch, "f", scalar_kinds="iuf"),
                                  jnp.float32)
        key = request_keys(key, batch)
        position = request_positions(position, batch)
    else:
        if key is not None or position is not None:
            raise ValueError("key and position are only used with temperature; pass temperature "
                             "(0 for greedy rows) to sample")
        temperature = jnp.zeros((batch,), jnp.float32)
        key = jnp.zeros((batch, 2), jnp.uint32)
        position = jnp.zeros((batch,), jnp.int32)

    if d2t is None:
        d2t = jnp.zeros((0,), jnp.int32)
    else:
        d2t = d2t if isinstance(d2t, jax.Array) else np.asarray(d2t)
        if d2t.dtype.kind not in "iu" or d2t.shape != (vocab,):
            raise ValueError(f"d2t must be an integer array [V] = [{vocab}] (target id = draft id + d2t[id]), "
                             f"got {d2t.dtype}{list(d2t.shape)}")
        # no target id v + d2t[v] (v < V) leaves int32
        d2t = clamp_to_int32(d2t, -(2**31), 2**31 - vocab)

    try:
        logits_dtype = jnp.dtype(logits_dtype)
    except TypeError as e:
        raise TypeError(f"logits_dtype must be float32, bfloat16 or float16, got {logits_dtype!r}") from e
    if logits_dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"logits_dtype must be float32, bfloat16 or float16, got {logits_dtype}")

    operands = WalkOperands(base_logits, anchor, w1, w2, w2_scale, temperature, key, position, d2t, w2_tiles)
    params = WalkParams(vocab_size=int(vocab_size), logit_scale=logit_scale, sampling=sampling,
                        return_logits=bool(return_logits), logits_dtype=logits_dtype,
                        return_embeds=bool(return_embeds), impl=impl)
    return operands, certified, params


def output_shapes(ops: WalkOperands, params: WalkParams):
    """ShapeDtypeStructs of (tokens, logits, embeds); unrequested outputs have shape [0]."""
    batch, steps, vocab = ops.base_logits.shape
    rank = ops.w1.shape[1]
    tokens = jax.ShapeDtypeStruct((batch, steps), jnp.int32)
    logits = jax.ShapeDtypeStruct((batch, steps, vocab) if params.return_logits else (0,), params.logits_dtype)
    embeds = jax.ShapeDtypeStruct((batch, steps, rank) if params.return_embeds else (0,), ops.w1.dtype)
    return tokens, logits, embeds
