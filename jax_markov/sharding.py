"""The walk across devices: batch-parallel, vocab-parallel and replicated layouts on a device mesh.

`walk` has the signature and the results of `jax_markov.walk` plus a mesh and a layout. It is built
on `jax.shard_map`, so it runs the same under `jax.jit` (sharded or not) and eagerly, on meshes
whose axes are Auto or Explicit (`jax.make_mesh`'s default in jax >= 0.10):

- layout="batch": the requests are split over `batch_axis` (default: every axis of the mesh); the
  head is replicated. Every device runs the fused `markov_walk` primitive (the custom call where it
  fits) on its own rows. No collective at all: nothing of the head, the logits or the tokens is
  gathered.
- layout="vocab" (tensor parallel): base_logits, W2, its int8 scales, d2t and draft_logits are split
  along the vocabulary over `vocab_axis` (default: every axis not in `batch_axis`); requests may
  also be split over `batch_axis` (a 2-D mesh). W1 is replicated (default) or split along V_target
  (`w1_sharded=True`). Each step scores the local vocabulary shard and the devices agree on the
  token through ONE small all-gather of (ordered best score, target id) per request, [n, B, 2]
  uint32, so the tokens are exactly those of the single-device walk. With `w1_sharded=True` the
  embedding W1[prev] of the next step costs a second collective per step (a psum of [B, r]). An int8
  head's tiles (QuantizedMarkovHead.tiles) are not used in this layout.
- layout="replicated": the head is replicated and the base logits are gathered over every axis
  not in `batch_axis` (default: none): each device walks all the rows of its batch group. One
  all-gather of the base logits up front (when they arrive vocab-sharded), no collective per step.

The mesh axes named in `batch_axis` and `vocab_axis` must divide B and V. Pad the vocabulary with
columns marked by `vocab_size` (they are never chosen) when V does not divide.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from . import arguments, primitive
from .reference import ROW_BITS, lookup_rows, markov_bias, scan_steps, spec_argmax, step_scorer
from .result import WalkResult, to_result

LAYOUTS = ("batch", "vocab", "replicated")


def walk(base_logits, anchor, head, *, mesh=None, layout="batch", batch_axis=None, vocab_axis=None,
         w1_sharded=False, temperature=None, key=None, position=None, vocab_size=None, logit_scale=1.0,
         d2t=None, return_logits=False, logits_dtype=jnp.float32, return_embeds=False,
         impl="auto") -> WalkResult:
    """`jax_markov.walk` on a device mesh; same arguments and results (docs/spec.md), plus:

    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes); None = the mesh set with `jax.set_mesh`.
    layout: "batch", "vocab" or "replicated" (module docstring).
    batch_axis: mesh axis name (or tuple of names) splitting the requests. Default: every mesh axis
      for "batch", none for "vocab" and "replicated".
    vocab_axis: mesh axis name (or tuple) splitting the vocabulary, "vocab" layout only. Default:
      every mesh axis not in batch_axis.
    w1_sharded: "vocab" layout only: W1 split along V_target over vocab_axis (saves its memory,
      costs a [B, r] psum per step) instead of replicated.
    impl: "auto"/"ffi" run the `markov_walk` primitive on each device (the custom call where it
      fits; in the vocab layout, one K = 1 call per step scores the local shard); "reference"
      computes in pure JAX.

    Outputs are sharded like the inputs: tokens and embeds over batch_axis; draft_logits over
    batch_axis and, in the vocab layout, along the vocabulary over vocab_axis.
    """
    ops, params = arguments.normalize(
        base_logits, anchor, head, temperature=temperature, key=key, position=position,
        vocab_size=vocab_size, logit_scale=logit_scale, d2t=d2t, return_logits=return_logits,
        logits_dtype=logits_dtype, return_embeds=return_embeds, impl=impl)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("mesh is required: pass mesh=... or set one with jax.set_mesh(mesh)")
    names = tuple(mesh.axis_names)
    batch_axes = _axes("batch_axis", batch_axis, names, default=names if layout == "batch" else ())
    if layout == "vocab":
        vocab_axes = _axes("vocab_axis", vocab_axis, names,
                           default=tuple(n for n in names if n not in batch_axes))
        if set(batch_axes) & set(vocab_axes):
            raise ValueError(f"batch_axis {batch_axes} and vocab_axis {vocab_axes} must not share mesh axes")
        if not vocab_axes:
            raise ValueError("layout='vocab' needs at least one mesh axis to split the vocabulary over")
    else:
        if vocab_axis is not None:
            raise ValueError(f"vocab_axis is only used with layout='vocab', got layout={layout!r}")
        if w1_sharded:
            raise ValueError(f"w1_sharded is only used with layout='vocab', got layout={layout!r}")
        vocab_axes = ()

    batch, _, vocab = ops.base_logits.shape
    n_batch = _size(mesh, batch_axes)
    if batch % n_batch:
        raise ValueError(f"the batch B = {batch} must be a multiple of the size {n_batch} of batch_axis "
                         f"{batch_axes}")
    n_vocab = _size(mesh, vocab_axes)
    if vocab % n_vocab:
        raise ValueError(f"the vocabulary V = {vocab} must be a multiple of the size {n_vocab} of vocab_axis "
                         f"{vocab_axes}: pad base_logits and W2 to a multiple and pass vocab_size (padding "
                         f"columns are never chosen)")
    if w1_sharded and ops.w1.shape[0] % n_vocab:
        raise ValueError(f"w1_sharded: V_target = {ops.w1.shape[0]} must be a multiple of the size {n_vocab} "
                         f"of vocab_axis {vocab_axes}")

    if layout == "vocab":  # a device's tiles would have to be those of its vocabulary shard
        ops = ops._replace(w2_tiles=arguments.no_tiles())
    in_specs, out_specs = _specs(ops, params, batch_axes, vocab_axes, w1_sharded)
    ops = arguments.WalkOperands(*[_place(x, mesh, s) for x, s in zip(ops, in_specs)])
    if layout == "vocab":
        body = _vocab_parallel_body(params, vocab_axes, w1_sharded, n_vocab)
    else:
        body = lambda *a: tuple(primitive.bind(arguments.WalkOperands(*a), params))
    outs = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*ops)
    return to_result(outs, params)


def _axes(name, value, names, default):
    if value is None:
        return tuple(default)
    axes = (value,) if isinstance(value, str) else tuple(value)
    for a in axes:
        if a not in names:
            raise ValueError(f"{name}: {a!r} is not an axis of the mesh {names}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{name} names a mesh axis twice: {axes}")
    return axes


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _entry(axes):
    """A PartitionSpec entry for a tuple of mesh axes."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _specs(ops, params, batch_axes, vocab_axes, w1_sharded):
    b, v = _entry(batch_axes), _entry(vocab_axes)
    per_v = lambda x: P(v) if x.shape[0] else P()  # w2_scale / d2t, which may be empty
    in_specs = arguments.WalkOperands(
        base_logits=P(b, None, v), anchor=P(b), w1=P(v) if w1_sharded else P(), w2=P(v),
        w2_scale=per_v(ops.w2_scale), temperature=P(b), key=P(b), position=P(b), d2t=per_v(ops.d2t), w2_tiles=P())
    # Unrequested outputs are [0] placeholders that vary like the requests do.
    out_specs = (P(b), P(b, None, v) if params.return_logits else P(b), P(b))
    return in_specs, out_specs


def _place(x, mesh, spec):
    """Explicit mesh axes: reshard to the spec first (shard_map wants the types to agree). Auto
    axes need nothing: shard_map reshards at its boundary, a no-op when x already has the spec."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return x

    def keep(entry):
        entry = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return _entry(tuple(a for a in entry if a in explicit))

    target = P(*[keep(e) for e in spec])
    if isinstance(mesh, jax.sharding.Mesh):
        target = NamedSharding(mesh, target)
    return jax.sharding.reshard(x, target)


def ordered_score(score):
    """float32 -> uint32 whose unsigned order is the float order: every NaN largest, -0 == +0
    (ffi/common/walk_common.h's OrderedScore)."""
    bits = lax.bitcast_convert_type(jnp.where(score == 0, jnp.float32(0), score), jnp.uint32)
    ordered = jnp.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))
    return jnp.where(jnp.isnan(score), np.uint32(0xFFFFFFFF), ordered)


def _local_logits(base_k, e, w2, w2_scale, params):
    """float32 base_k + logit_scale * W2_local @ e for one step: [B, V_local].

    impl="reference" in pure JAX; otherwise one K = 1 `markov_walk` (the custom call where it fits)
    whose W1 is the already looked-up rows e and whose anchors are 0..B-1, so W1[anchor] = e."""
    if params.impl == "reference":
        return base_k.astype(jnp.float32) + markov_bias(e, w2, w2_scale, params.logit_scale)
    b, v_local = base_k.shape
    anchor = jnp.arange(b, dtype=jnp.int32)
    ops = arguments.WalkOperands(
        base_logits=base_k[:, None, :], anchor=anchor, w1=e, w2=w2, w2_scale=w2_scale,
        temperature=jnp.zeros((b,), jnp.float32), key=jnp.zeros((b, 2), jnp.uint32),
        position=jnp.zeros((b,), jnp.int32), d2t=jnp.zeros((0,), jnp.int32), w2_tiles=arguments.no_tiles())
    one_step = dataclasses.replace(params, vocab_size=v_local, sampling=False, return_logits=True,
                                   logits_dtype=jnp.dtype(jnp.float32), return_embeds=False)
    _, logits, _ = primitive.bind(ops, one_step)  # varies wherever its operands do
    return logits[:, 0, :]


def _vocab_parallel_body(params, vocab_axes, w1_sharded, n_vocab):
    """The per-device walk of the vocab layout (inside shard_map): the reference walk of docs/spec.md on
    a vocabulary shard, with global column indices, and one all-gather per step to agree."""

    def body(base, anchor, w1, w2, w2_scale, temperature, key, position, d2t, w2_tiles):
        v_local = base.shape[2]
        shard = lax.axis_index(vocab_axes)
        offset = shard * v_local
        scores = step_scorer(offset, v_local, temperature, key, position, params)  # global columns
        w1_rows = w1.shape[0]
        v_target = w1_rows * (n_vocab if w1_sharded else 1)

        def embed(prev):
            idx = jnp.clip(prev, 0, v_target - 1)
            if not w1_sharded:
                return lookup_rows(w1, idx)
            # The owner of row idx contributes its row's bits, everyone else zeros: an integer psum
            # is exact.
            local = idx - shard * w1_rows
            mine = (local >= 0) & (local < w1_rows)
            rows = lookup_rows(w1, jnp.clip(local, 0, w1_rows - 1))
            bits = lax.bitcast_convert_type(rows, ROW_BITS[w1.dtype.itemsize])
            bits = lax.psum(jnp.where(mine[:, None], bits, jnp.zeros_like(bits)), vocab_axes)
            return lax.bitcast_convert_type(bits, w1.dtype)

        def step(prev, xs):
            base_k, k = xs
            e = embed(prev)
            logits, score = scores(_local_logits(base_k, e, w2, w2_scale, params), k)
            local = spec_argmax(score)  # lowest local index, first NaN
            best = jnp.take_along_axis(score, local[:, None], axis=-1)[:, 0]
            token = offset + local
            if d2t.shape[0]:
                token = token + d2t[local]
            payload = jnp.stack([ordered_score(best), lax.bitcast_convert_type(token, jnp.uint32)], axis=-1)
            # The one collective of the step: [n_vocab, B, 2] uint32. Shards hold increasing global
            # columns, so the first shard with the largest key holds the lowest global argmax.
            gathered = lax.all_gather(payload, vocab_axes, to="invarying")
            winner = jnp.argmax(gathered[:, :, 0], axis=0)
            token = lax.bitcast_convert_type(
                jnp.take_along_axis(gathered[:, :, 1], winner[None, :], axis=0)[0], jnp.int32)
            return token, (token, logits.astype(params.logits_dtype), e)

        return scan_steps(step, base, anchor, params, w1.dtype)

    return body
