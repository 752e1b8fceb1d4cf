"""The pure-JAX walk: the parity oracle, the eager arm of the benchmarks, the fallback everywhere.

A `lax.scan` over the K draft steps, computing exactly docs/spec.md in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import arguments
from .philox import gumbel_noise_range
from .result import WalkResult, to_result

_HIGHEST = lax.Precision.HIGHEST
ROW_BITS = {2: jnp.uint16, 4: jnp.uint32}  # W1 itemsize -> the unsigned integer type of its bits
_CONTRACT_RANK = (((1,), (1,)), ((), ()))  # [B, r] x [V, r] -> [B, V]


def _power_of_two(k):
    """2^k as float32 for integer k in [-126, 127] (exact: the exponent bits set directly)."""
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def headroom_shifts(e, rank: int):
    """(s1, s2) [B] int32 >= 0 such that |e| * 2^-(s1 + s2) < 1 / (2r) for each row of e [B, r]: a dot
    of such a row with any finite fp32 row of W2 then never overflows in any partial sum. 0 where e
    is small, zero or holds an infinity or NaN (IEEE arithmetic then decides). Two shifts keep each
    power of two a normal float32 (s goes up to 128 + log2(2r))."""
    biased = (lax.bitcast_convert_type(jnp.max(jnp.abs(e.astype(jnp.float32)), axis=1), jnp.int32) >> 23) & 0xFF
    # max|e| < 2^(biased - 126), and h = (2r - 1).bit_length() is the least h with 2^h >= 2r
    s = jnp.where(biased == 0xFF, 0, jnp.maximum(biased - 126 + (2 * rank - 1).bit_length(), 0))
    return s // 2, s - s // 2


def markov_bias(e, w2, w2_scale, logit_scale: float):
    """logit_scale * (W2 @ e) for a batch of embeddings e [B, r], float32 [B, V].

    The fp32 dot runs on e scaled down by a power of two (`headroom_shifts`) and is scaled back up:
    exact wherever the result is finite, and a bias too large for fp32 is +-inf by its sign, never the
    NaN of partial sums that overflowed both ways. A float16 e and float16 W2
    need no scaling (|products| <= 2^32) and could not take it (float16's exponent range is narrow)."""
    dtype = jnp.dtype(jnp.float32) if w2.dtype == jnp.int8 else jnp.promote_types(e.dtype, w2.dtype)
    scaled = dtype != jnp.float16
    e = e.astype(dtype)
    if scaled:
        s1, s2 = headroom_shifts(e, w2.shape[1])
        e = e * _power_of_two(-s1)[:, None].astype(dtype) * _power_of_two(-s2)[:, None].astype(dtype)
    dot = lax.dot_general(e, w2.astype(dtype), _CONTRACT_RANK, precision=_HIGHEST,
                          preferred_element_type=jnp.float32)
    if scaled:
        dot = dot * _power_of_two(s1)[:, None] * _power_of_two(s2)[:, None]
    if w2.dtype == jnp.int8:
        return jnp.float32(logit_scale) * (w2_scale[None, :] * dot)
    return jnp.float32(logit_scale) * dot


def lookup_rows(w1, idx):
    """W1[idx] (idx [B], in range) in W1's own dtype, bit for bit, with no W1-sized temporary.

    A gather of W1 itself is not that: XLA's CPU backend runs a bf16/f16 gather in float32, so it
    widens all of W1 and hoists that convert out of the K-step loop (an f32[V_target, r] copy per
    call, 155 MB written at V_target = 151936) to widen the B rows it needs. Integer ops are never
    widened, so the rows are gathered as raw bits. The barrier ties W1 to idx, i.e. to the step:
    the bit view is then not hoisted either (a W1-sized integer copy per call) but fused into the
    gather of the B rows."""
    w1, idx = lax.optimization_barrier((w1, idx))
    bits = lax.bitcast_convert_type(w1, ROW_BITS[w1.dtype.itemsize])
    return lax.bitcast_convert_type(bits[idx], w1.dtype)


def spec_argmax(score):
    """docs/spec.md's choice over the last axis: the lowest index of the maximum, or the first NaN.

    jnp.argmax means the same, but XLA's GPU reduction does not keep "first NaN" (it returned the
    last of two NaNs on an H200), so NaNs are located separately."""
    nan = jnp.isnan(score)
    best = jnp.argmax(jnp.where(nan, -jnp.inf, score), axis=-1)
    return jnp.where(nan.any(axis=-1), jnp.argmax(nan, axis=-1), best).astype(jnp.int32)


def gumbel_max_score(logits, inv_t, noise):
    """The score of a sampled row (docs/spec.md): l * (1/T) + g, except that a column whose l is -inf (masked,
    or padding) scores -inf, never the NaN of -inf * 0 (1/T = 0 at T = +inf, where the row is then
    sampled uniformly among the other columns)."""
    return jnp.where(logits == -jnp.inf, -jnp.inf, logits * inv_t + noise)


def step_scorer(start, count: int, temperature, key, position, params: arguments.WalkParams):
    """f(logits, k, greedy_logits=None) -> (l_k, score) of docs/spec.md for the `count` columns from
    global vocabulary index `start` (an int, or traced in a vocabulary shard): padding -inf, l_k
    rounded to logits_dtype when logits are asked for, and the score chosen from (l_k for greedy rows,
    `gumbel_max_score` for sampled rows). greedy_logits (a CertifiedMarkovHead's unquantized l_k) gives
    greedy rows their scores instead, padded and rounded alike."""
    valid = start + jnp.arange(count, dtype=jnp.int32) < params.vocab_size
    sampled = temperature > 0
    inv_t = jnp.where(sampled, jnp.float32(1.0) / jnp.where(sampled, temperature, 1.0), 0.0)

    def visible(logits):
        logits = jnp.where(valid[None, :], logits, -jnp.inf)
        if params.return_logits:
            # The barrier keeps the rounding: XLA's GPU backend otherwise drops a narrowing convert
            # followed by a widening one (excess precision) and would choose from the fp32 l_k.
            rounded = lax.optimization_barrier(logits.astype(params.logits_dtype))
            logits = rounded.astype(jnp.float32)
        return logits

    def scores(logits, k, greedy_logits=None):
        logits = visible(logits)
        greedy = logits if greedy_logits is None else visible(greedy_logits)
        if not params.sampling:
            return logits, greedy
        noise = gumbel_noise_range((key[:, 0], key[:, 1]), start, count, position + k)
        return logits, jnp.where(sampled[:, None], gumbel_max_score(logits, inv_t[:, None], noise), greedy)

    return scores


def walk_operands(ops: arguments.WalkOperands, params: arguments.WalkParams,
                  certified: arguments.CertifiedOperands):
    """The walk on normalised operands; returns (tokens, logits, embeds) as `output_shapes` says.

    With a certificate (a CertifiedMarkovHead; placeholders otherwise) greedy rows choose from the
    unquantized W2's l_k and everything else (sampled rows, the logits returned) is the int8 head's."""
    base, anchor, w1, w2, w2_scale, temperature, key, position, d2t, _ = ops  # w2_tiles: the CUDA kernel's
    exact_w2 = certified.w2_exact if arguments.is_certified(certified) else None
    v_target = w1.shape[0]
    scores = step_scorer(0, base.shape[2], temperature, key, position, params)

    def step(prev, xs):
        base_k, k = xs
        e = lookup_rows(w1, jnp.clip(prev, 0, v_target - 1))
        base_k = base_k.astype(jnp.float32)
        exact = None if exact_w2 is None else base_k + markov_bias(e, exact_w2, None, params.logit_scale)
        logits, score = scores(base_k + markov_bias(e, w2, w2_scale, params.logit_scale), k, exact)
        token = spec_argmax(score)
        if d2t.shape[0]:
            token = token + d2t[token]
        return token, (token, logits.astype(params.logits_dtype), e)

    return scan_steps(step, base, anchor, params, w1.dtype)


def scan_steps(step, base, anchor, params, w1_dtype):
    """Runs step(prev, (base_k, k)) -> (token, (token, logits, e)) over the K steps of base
    [B, K, V] and returns (tokens, logits, embeds) shaped as `arguments.output_shapes` says."""
    xs = (jnp.moveaxis(base, 1, 0), jnp.arange(base.shape[1], dtype=jnp.int32))
    _, (tokens, logits, embeds) = lax.scan(step, anchor, xs)
    logits = jnp.moveaxis(logits, 0, 1) if params.return_logits else jnp.zeros((0,), params.logits_dtype)
    embeds = jnp.moveaxis(embeds, 0, 1) if params.return_embeds else jnp.zeros((0,), w1_dtype)
    return tokens.T, logits, embeds


# One compiled walk per (shapes, dtypes, params): called eagerly, a bare lax.scan over a fresh
# closure would be traced and compiled again on every call.
_walk_operands_jit = jax.jit(walk_operands, static_argnums=1)


def walk(base_logits, anchor, head, *, temperature=None, key=None, position=None, vocab_size=None,
         logit_scale=1.0, d2t=None, return_logits=False, logits_dtype=jnp.float32,
         return_embeds=False, impl="reference") -> WalkResult:
    """The DSpark Markov walk in pure JAX; same signature and results as `jax_markov.walk`."""
    if impl != "reference":
        raise ValueError(f"jax_markov.reference.walk only implements impl='reference', got {impl!r}")
    ops, certified, params = arguments.walk_arguments(
        base_logits, anchor, head, temperature=temperature, key=key, position=position,
        vocab_size=vocab_size, logit_scale=logit_scale, d2t=d2t, return_logits=return_logits,
        logits_dtype=logits_dtype, return_embeds=return_embeds, impl=impl)
    return to_result(_walk_operands_jit(ops, params, certified), params)
