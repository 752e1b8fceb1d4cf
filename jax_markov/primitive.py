"""The `markov_walk` primitive: one jaxpr equation for the whole walk, lowered per platform.

cpu  -> the C++ custom call when built, else the reference;
cuda -> the cooperative sm_90 kernel when the configuration fits it (for impl="auto" with an
        unquantized head, up to native.CUDA_FLOAT_W2_AUTO_MAX_BATCH requests; a CertifiedMarkovHead
        up to the plan's batch limit), else the reference;
any other platform -> the reference (`mlir.lower_fun` of reference.walk_operands).
Under jit on a mesh the custom call is partitioned along the requests (custom_partitioning): each
device walks its own rows.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax
from jax._src import dispatch
from jax._src.sharding_impls import ShardingContext
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

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


# The primitive's operands: the walk's ten, then a CertifiedMarkovHead's two (placeholders otherwise).
_WALK_OPERANDS = len(arguments.WalkOperands._fields)
_OPERAND_NAMES = arguments.WalkOperands._fields + arguments.CertifiedOperands._fields


def _split(args) -> tuple[arguments.WalkOperands, arguments.CertifiedOperands]:
    return arguments.WalkOperands(*args[:_WALK_OPERANDS]), arguments.CertifiedOperands(*args[_WALK_OPERANDS:])


def bind(ops: arguments.WalkOperands, params: arguments.WalkParams,
         certified: arguments.CertifiedOperands | None = None):
    operands = [*ops, *(arguments.no_certificate() if certified is None else certified)]
    # Inside shard_map all operands are made to vary over the same mesh axes; the results then
    # vary over them too (the abstract eval keeps base_logits' type).
    operands = [vary_like(x, *operands) for x in operands]
    return markov_walk_p.bind(*operands, params=params)


def _abstract_eval(*avals, params):
    ops, _ = _split(avals)
    return [avals[0].update(shape=s.shape, dtype=s.dtype, weak_type=False)
            for s in arguments.output_shapes(ops, params)]


markov_walk_p.def_abstract_eval(_abstract_eval)


def _reference_rule(ctx, *args, params):
    def impl(*a):
        ops, certified = _split(a)
        return reference.walk_operands(ops, params, certified)

    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)


def _ffi_call(params, *ops):
    """The custom call on operands as its device holds them (all of them, or its own rows): the
    walk's ten, and a CertifiedMarkovHead's two after them."""
    shapes = arguments.output_shapes(arguments.WalkOperands(*ops[:_WALK_OPERANDS]), params)
    return jax.ffi.ffi_call(native.TARGET, shapes)(
        *ops, vocab_size=np.int64(params.vocab_size), logit_scale=np.float32(params.logit_scale),
        sampling=bool(params.sampling))


# XLA cannot split an opaque custom call: it would gather every operand onto every device. Under
# jit on a mesh the call is wrapped in custom_partitioning, whose rule lets only the requests (factor
# "b") be split: each device walks its own rows with the whole head, and anything split otherwise
# (a vocabulary-split head or base logits) is gathered first. [0] placeholders get factors of their own.
_FACTORS = (*arguments.WalkOperands(base_logits="b k v", anchor="b", w1="t r", w2="v r", w2_scale="v",
                                    temperature="b", key="b w", position="b", d2t="v", w2_tiles="n z"),
            *arguments.CertifiedOperands(w2_exact="v r", residual_norm="v"))
_OUTPUT_FACTORS = ("b k", "b k v", "b k r")
_PER_REQUEST = ("base_logits", "anchor", "temperature", "key", "position")


def _sharding_rule(params, mesh, operand_types, result_types):
    """Shardy's rule: the factors above, each but "b" kept whole (need_replication)."""
    def mappings(types, factors, prefix):
        return [f"{prefix}{i}" if mlir.ir.RankedTensorType(t).shape == [0] else f
                for i, (t, f) in enumerate(zip(types, factors))]

    operands = mappings(operand_types, _FACTORS, "empty_operand")
    results = mappings(result_types, _OUTPUT_FACTORS, "empty_result")
    factors = dict.fromkeys(f for m in operands + results for f in m.split())  # Shardy wants them in order
    rule = f"{', '.join(operands)} -> {', '.join(results)}"
    return rule, dict(need_replication_factors=tuple(f for f in factors if f != "b"))


def _shardings(mesh, arg_shapes, result_shape):
    """(operand, result) shardings: requests and results split like base_logits' rows, the head
    and the placeholders replicated."""
    base = arg_shapes[0].sharding  # None where GSPMD does not know it yet
    rows = None if base is None else base.spec[0]
    args = tuple(NamedSharding(mesh, P(rows) if f in _PER_REQUEST else P())
                 for f in _OPERAND_NAMES[:len(arg_shapes)])
    return args, tuple(NamedSharding(mesh, P() if x.shape == (0,) else P(rows)) for x in result_shape)


def _infer_sharding_from_operands(params, mesh, arg_shapes, result_shape):
    """GSPMD's propagation (Shardy uses the rule)."""
    return _shardings(mesh, arg_shapes, result_shape)[1]


def _partition(params, mesh, arg_shapes, result_shape):
    args, results = _shardings(mesh, arg_shapes, result_shape)
    return mesh, functools.partial(_ffi_call, params), results, args


_partitioned_ffi_call = custom_partitioning(_ffi_call, static_argnums=(0,))
_partitioned_ffi_call.def_partition(_partition, infer_sharding_from_operands=_infer_sharding_from_operands,
                                    sharding_rule=_sharding_rule)
# custom_partitioning needs the devices and the mesh while lowering; jit gives them (the mesh of
# the program's NamedShardings) only to programs with such a primitive.
dispatch.prim_requires_devices_during_lowering.add(markov_walk_p)


def _ffi_rule(ctx, *args, params, operands):
    """The custom call on the first `operands` operands (the certificate's placeholders are not passed)."""
    axis_context = ctx.module_context.axis_context
    # jit over a mesh: partitioned per device. Inside shard_map the operands are the device's own
    # already, and without a mesh custom_partitioning could not name the split: the plain call.
    if isinstance(axis_context, ShardingContext) and axis_context.abstract_mesh is not None:
        call = lambda *a: _partitioned_ffi_call(params, *a[:operands])
    else:
        call = lambda *a: _ffi_call(params, *a[:operands])
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def _cpu_rule(ctx, *args, params):
    if params.impl == "reference":
        return _reference_rule(ctx, *args, params=params)
    if not native.cpu_available():
        if params.impl == "ffi":
            raise RuntimeError("impl='ffi': the jax_markov CPU module is not built; reinstall the package "
                               "(pip install .) or use impl='auto'")
        return _reference_rule(ctx, *args, params=params)
    certified = arguments.is_certified(_split(ctx.avals_in)[1])
    return _ffi_rule(ctx, *args, params=params, operands=len(_OPERAND_NAMES) if certified else _WALK_OPERANDS)


def _cuda_rule(ctx, *args, params):
    if params.impl == "reference":
        return _reference_rule(ctx, *args, params=params)
    # A CertifiedMarkovHead walks on the kernel where the plan takes it (its batch limit), with its
    # certificate's two operands; elsewhere on the reference.
    certified = arguments.is_certified(_split(ctx.avals_in)[1])
    base, _, w1, w2 = ctx.avals_in[:4]
    batch, steps, vocab = base.shape
    reason = native.cuda_unsupported_reason(batch, steps, vocab, w1.shape[1], w1.dtype, w2.dtype, base_dtype=base.dtype,
                                            logits_dtype=params.logits_dtype if params.return_logits else None,
                                            sampling=params.sampling, certified=certified)
    if reason is None and (params.impl == "ffi" or
                           native.cuda_auto_declines(batch, steps, vocab, w1.shape[1], w1.dtype, w2.dtype) is None):
        return _ffi_rule(ctx, *args, params=params, operands=len(_OPERAND_NAMES) if certified else _WALK_OPERANDS)
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

def _batch_rule(args, dims, *, params):
    """vmap over an extra leading axis. With one head for all mapped elements the mapped axis
    folds into the request batch (one walk, no copies of the head); a mapped head (any other
    operand mapped) walks each element in turn with lax.map."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    mapped = [d is not None for d in dims]
    if any(m for name, m in zip(_OPERAND_NAMES, mapped) if name not in _PER_REQUEST):
        xs = [a for a, m in zip(moved, mapped) if m]

        def one(x_list):
            it = iter(x_list)
            ops, certified = _split([next(it) if m else a for a, m in zip(moved, mapped)])
            return bind(ops, params, certified)

        outs = lax.map(one, xs)
        return list(outs), [0, 0, 0]

    base_dim = dims[_OPERAND_NAMES.index("base_logits")]
    batch = moved[0].shape[0 if base_dim is None else 1]

    def fold(x, d):  # [size, B, ...] -> [size * B, ...]
        if d is None:
            x = jax.numpy.broadcast_to(x, (size, *x.shape))
        return x.reshape(size * batch, *x.shape[2:])

    folded = [fold(a, d) if name in _PER_REQUEST else a for name, a, d in zip(_OPERAND_NAMES, moved, dims)]
    ops, certified = _split(folded)
    tokens, logits, embeds = bind(ops, params, certified)
    unfold = lambda x: x if x.shape == (0,) else x.reshape(size, batch, *x.shape[1:])
    outs = [unfold(tokens), unfold(logits), unfold(embeds)]
    return outs, [None if o.shape == (0,) else 0 for o in outs]


batching.primitive_batchers[markov_walk_p] = _batch_rule
