"""`walk`: the public entry point, binding the `markov_walk` primitive."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import arguments, primitive
from .result import WalkResult, to_result


def walk(base_logits, anchor, head, *, temperature=None, key=None, position=None, vocab_size=None,
         logit_scale=1.0, d2t=None, return_logits=False, logits_dtype=jnp.float32, return_embeds=False,
         impl="auto") -> WalkResult:
    """Draft K tokens per request with the DSpark Markov walk (docs/spec.md), in one primitive.

    base_logits: [B, K, V] block-drafter logits (bf16/f16/f32); row k predicts draft token k.
    anchor: [B] last committed (target-vocabulary) token of each request, any integer dtype; clamped
      into [0, V_target) in its own width.
    head: a MarkovHead (float W2), a QuantizedMarkovHead (int8 W2, see `quantize`) or a
      CertifiedMarkovHead (`quantize(head, certified=True)`): int8 W2 whose greedy rows choose exactly
      what the unquantized head chooses with the same arguments, while sampled rows and the returned
      logits (for every row) are the int8 head's (see CertifiedMarkovHead). Under jit on a CUDA device
      the kernel walks it for up to 2 requests, the reference for more (impl="ffi" is an error there).
    temperature: [B] float array, or any real scalar; 0 (or negative, or NaN) = greedy, +inf = uniform
      over the columns that are neither masked (-inf) nor padding; None = every row greedy.
    key: one PRNG key per request ([B] typed keys or [B, 2] uint32), required with temperature.
    position: [B] sequence position of each request's first draft token, required with temperature;
      the Philox counter word is (uint32)(position + k), so it must lie in [-2^31, 2^32).
    vocab_size: columns >= vocab_size are padding, never chosen, -inf in the logits.
    logit_scale: static finite float multiplying the Markov bias.
    d2t: [V] int offsets of a reduced draft vocabulary: target id = draft id + d2t[draft id] (offsets
      are clamped so that no target id leaves int32).
    return_logits / logits_dtype: also return l_k, rounded to logits_dtype before choosing.
    return_embeds: also return W1[prev_k], the confidence head's input.
    impl: "auto" (fastest supported), "reference" (pure JAX) or "ffi" (custom call, or an error).
    """
    ops, certified, params = arguments.walk_arguments(
        base_logits, anchor, head, temperature=temperature, key=key, position=position,
        vocab_size=vocab_size, logit_scale=logit_scale, d2t=d2t, return_logits=return_logits,
        logits_dtype=logits_dtype, return_embeds=return_embeds, impl=impl)
    batch_axes = _explicit_batch_axes(ops.base_logits)
    if batch_axes:
        # Requests split over Explicit mesh axes: each device walks its own rows in the sharded
        # walk's batch layout, whose shard_map gives the results their sharded types (the bare
        # primitive's outputs would carry base_logits' [B, K, V] spec).
        from . import sharding
        return sharding.walk(base_logits, anchor, head, mesh=jax.typeof(ops.base_logits).sharding.mesh,
                             layout="batch", batch_axis=batch_axes, temperature=temperature, key=key,
                             position=position, vocab_size=vocab_size, logit_scale=logit_scale, d2t=d2t,
                             return_logits=return_logits, logits_dtype=logits_dtype,
                             return_embeds=return_embeds, impl=impl)
    return to_result(primitive.bind(ops, params, certified), params)


def _explicit_batch_axes(base_logits) -> tuple:
    """The Explicit mesh axes that base_logits' request dimension is split over (none outside an
    Explicit mesh, or inside shard_map where the walk sees per-device rows)."""
    spec = getattr(getattr(jax.typeof(base_logits), "sharding", None), "spec", None)
    entry = spec[0] if spec else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
