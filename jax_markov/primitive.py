"""The `markov_walk` primitive: one jaxpr equation for the whole walk, lowered per platform.

cpu  -> the C++ custom call when built, else the reference;
cuda -> the cooperative sm_90 kernel when the configuration fits it, else the reference;
any other platform -> the reference (`mlir.lower_fun` of reference.walk_operands).
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import arguments, native, reference

markov_walk_p = Primitive("markov_walk")
markov_walk_p.multiple_results = True
markov_walk_p.def_impl(lambda *args, params: dispatch.apply_primitive(markov_walk_p, *args, params=params))


def manual_axes(x) -> frozenset:
    """The shard_map mesh axes x varies over (`aval.vma`; `aval.mat.varying` in jax 0.10)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def vary_like(x, *others):
    """x, made to vary over every shard_map axis that one of `others` varies over."""
    missing = frozenset().union(*(manual_axes(o) for o in others)) - manual_axes(x)
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def bind(ops: arguments.WalkOperands, params: arguments.WalkParams):
    # Inside shard_map all operands are made to vary over the same mesh axes; the results then
    # vary over them too (the abstract eval keeps base_logits' type).
    ops = [vary_like(x, *ops) for x in ops]
    return markov_walk_p.bind(*ops, params=params)


def _abstract_eval(*avals, params):
    ops = arguments.WalkOperands(*avals)
    return [avals[0].update(shape=s.shape, dtype=s.dtype, weak_type=False)
            for s in arguments.output_shapes(ops, params)]


markov_walk_p.def_abstract_eval(_abstract_eval)


def _reference_rule(ctx, *args, params):
    impl = lambda *a: reference.walk_operands(arguments.WalkOperands(*a), params)
    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)


def _ffi_rule(ctx, *args, params):
    return jax.ffi.ffi_lowering(native.TARGET)(
        ctx, *args, vocab_size=np.int64(params.vocab_size), logit_scale=np.float32(params.logit_scale))


def _cpu_rule(ctx, *args, params):
    if params.impl == "reference":
        return _reference_rule(ctx, *args, params=params)
    if not native.cpu_available():
        if params.impl == "ffi":
            raise RuntimeError("impl='ffi': the jax_markov CPU module is not built; reinstall the package "
                               "(pip install .) or use impl='auto'")
        return _reference_rule(ctx, *args, params=params)
    return _ffi_rule(ctx, *args, params=params)


def _cuda_rule(ctx, *args, params):
    if params.impl == "reference":
        return _reference_rule(ctx, *args, params=params)
    base, _, w1, w2 = ctx.avals_in[:4]
    batch, steps, vocab = base.shape
    reason = native.cuda_unsupported_reason(batch, steps, vocab, w1.shape[1], w1.dtype, w2.dtype,
                                            auto=params.impl == "auto")
    if reason is None:
        return _ffi_rule(ctx, *args, params=params)
    if params.impl == "ffi":
        raise ValueError(f"impl='ffi' on cuda: {reason}")
    return _reference_rule(ctx, *args, params=params)


def _other_platform_rule(ctx, *args, params):
    if params.impl == "ffi":
        raise ValueError(f"impl='ffi': jax_markov has no custom call for platform(s) "
                         f"{ctx.module_context.platforms}; use impl='auto' or 'reference'")
    return _reference_rule(ctx, *args, params=params)


mlir.register_lowering(markov_walk_p, _other_platform_rule)
mlir.register_lowering(markov_walk_p, _cpu_rule, platform="cpu")
mlir.register_lowering(markov_walk_p, _cuda_rule, platform="cuda")


def _no_jvp(primals, tangents, *, params):
    raise TypeError("jax_markov.walk is not differentiable: choosing tokens (argmax / Gumbel-max) has no "
                    "gradient. Differentiate the base logits or the head outside the walk instead.")


ad.primitive_jvps[markov_walk_p] = _no_jvp

_HEAD_FIELDS = ("w1", "w2", "w2_scale", "d2t")


def _batch_rule(args, dims, *, params):
    """vmap over an extra leading axis. With one head for all mapped elements the mapped axis
    folds into the request batch (one walk, no copies of the head); a mapped head walks each
    element in turn with lax.map."""
    ops = arguments.WalkOperands(*args)
    in_dims = arguments.WalkOperands(*dims)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = arguments.WalkOperands(*[
        a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(ops, in_dims)])
    if any(getattr(in_dims, f) is not None for f in _HEAD_FIELDS):
        mapped = [d is not None for d in in_dims]
        xs = [a for a, m in zip(moved, mapped) if m]

        def one(x_list):
            it = iter(x_list)
            full = [next(it) if m else a for a, m in zip(moved, mapped)]
            return bind(arguments.WalkOperands(*full), params)

        outs = lax.map(one, xs)
        return list(outs), [0, 0, 0]

    batch = moved.base_logits.shape[0 if in_dims.base_logits is None else 1]

    def fold(x, d):  # [size, B, ...] -> [size * B, ...]
        if d is None:
            x = jax.numpy.broadcast_to(x, (size, *x.shape))
        return x.reshape(size * batch, *x.shape[2:])

    per_request = ("base_logits", "anchor", "temperature", "key", "position")
    folded = moved._replace(**{f: fold(getattr(moved, f), getattr(in_dims, f)) for f in per_request})
    tokens, logits, embeds = bind(folded, params)
    unfold = lambda x: x if x.shape == (0,) else x.reshape(size, batch, *x.shape[1:])
    outs = [unfold(tokens), unfold(logits), unfold(embeds)]
    return outs, [None if o.shape == (0,) else 0 for o in outs]


batching.primitive_batchers[markov_walk_p] = _batch_rule
