"""Speculative decoding on top of `jax_markov.walk`: a rejection sampler and a jitted decode loop.

Random streams. Every random number here comes from Philox4x32-10 keyed, like the walk's noise,
with the request's two key words, and is told apart from the draft noise (counter word 2 =
0x40000000, docs/spec.md) by its own counter word 2:

- `ACCEPT_STREAM` (0x40000001): the uniform u that accepts the draft token at sequence position t,
  counter (0, t, 0x40000001, 0);
- `RESAMPLE_STREAM` (0x40000002): the Gumbel noise of the token the target itself chooses at
  position t (the residual resample after a rejection, the bonus token, the first token after the
  prompt, and every token of `target_decode`), counter (v, t, 0x40000002, 0).

Each sequence position is decided once: a draw at position t only shapes the committed text if
the token at t is committed by it, and the draws made for positions after the first rejection are
thrown away unused, so the streams are independent of everything already committed. Same key,
same prompt, same drafter: the same text, on every backend.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): with p the target's and q the
draft's distribution at a row (both softmax(logits * (1/T)), q from the draft logits the walk
returned, in the dtype it was asked for, which is exactly the distribution the walk sampled
from), the draft token d is accepted with probability min(1, p(d)/q(d)) (test: u * q(d) < p(d));
at the first rejection the token is drawn from max(p - q, 0) renormalised; when all K drafts are
accepted a bonus token is drawn from the target's last row. Greedy rows (T = 0) accept a draft
only if it equals the target's argmax and emit the argmax. The emitted text then has exactly the
target's distribution (sampled rows) or is exactly the target's greedy text (greedy rows).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import philox
from .arguments import request_keys, request_positions
from .reference import gumbel_max_score

ACCEPT_STREAM = np.uint32(0x40000001)
RESAMPLE_STREAM = np.uint32(0x40000002)
# The decode loops' parts run under these `jax.named_scope`s, so that the op names of their HLO ops
# (which a profile's events carry) say which part an op belongs to; `DSparkDrafter.draft` runs its
# walk under "walk", inside "drafter". Ops outside them are the loop's own bookkeeping.
PREFILL_SCOPE = "prefill"
STEP_SCOPES = ("drafter", "walk", "target_forward", "rejection_sampler", "drafter_context")


# -- random streams -------------------------------------------------------------------------------
# Philox's ten rounds run in a fori_loop here (unroll=False): one round traced instead of ten keeps
# the decode loop's compile short.
def accept_uniform(key_words, position):
    """u in (0, 1) for accepting the draft token at sequence position `position` ([B, ...]):
    Philox word 0 at counter (0, position, ACCEPT_STREAM, 0), key = the request's key words."""
    words = jnp.asarray(key_words, jnp.uint32)
    extra = (1,) * (jnp.ndim(position) - 1)
    key = (words[:, 0].reshape(-1, *extra), words[:, 1].reshape(-1, *extra))
    x = philox.philox4x32_10((np.uint32(0), position, ACCEPT_STREAM, np.uint32(0)), key, unroll=False)[0]
    return philox.uniform_from_bits(x)


def resample_noise(key_words, position, vocab: int):
    """Gumbel noise [B, V] for the token the target chooses at sequence position `position` [B]:
    -log(-log(u)), u from Philox word 0 at counter (v, position, RESAMPLE_STREAM, 0)."""
    words = jnp.asarray(key_words, jnp.uint32)
    counter = (jnp.arange(vocab, dtype=jnp.uint32)[None, :], jnp.asarray(position)[:, None], RESAMPLE_STREAM,
               np.uint32(0))
    x = philox.philox4x32_10(counter, (words[:, 0:1], words[:, 1:2]), unroll=False)[0]
    return philox.gumbel_from_bits(x)


def _mask_padding(logits, vocab_size):
    v = logits.shape[-1]
    if vocab_size is None or vocab_size >= v:
        return logits
    return jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)


def _inverse_temperature(temperature, batch):
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))
    sampled = t > 0
    # 1/T in fp32, computed once as the walk does; 1 (unused) on greedy rows keeps the math finite
    return sampled, jnp.where(sampled, jnp.float32(1.0) / jnp.where(sampled, t, 1.0), jnp.float32(1.0))


def _tempered(logits, inv_t):
    """logits * (1/T), -inf staying -inf (1/T is 0 at T = +inf): the masked and padding columns keep
    probability 0 and the others are uniform there, as in the walk (docs/spec.md)."""
    return jnp.where(logits == -jnp.inf, -jnp.inf, logits * inv_t)


def choose_token(logits, *, temperature=None, key_words=None, position=None, vocab_size=None):
    """The target's own choice from logits [B, V]: argmax on greedy rows, Gumbel-max with the
    resample stream at `position` [B] on sampled rows (an exact sample of softmax(logits / T))."""
    logits = _mask_padding(logits.astype(jnp.float32), vocab_size)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if temperature is None:
        return greedy
    sampled, inv_t = _inverse_temperature(temperature, logits.shape[0])
    score = gumbel_max_score(logits, inv_t[:, None], resample_noise(key_words, position, logits.shape[-1]))
    return jnp.where(sampled, jnp.argmax(score, axis=-1).astype(jnp.int32), greedy)


# -- the rejection sampler -----------------------------------------------------------------------
class Verdict(NamedTuple):
    num_accepted: jax.Array  # [B] int32 in [0, K]: drafts accepted
    next_token: jax.Array  # [B] int32: the correction (after a rejection) or the bonus token
    tokens: jax.Array  # [B, K+1] int32: the accepted drafts, next_token, then fill_value


def rejection_sample(draft_tokens, target_logits, draft_logits=None, *, temperature=None, key=None,
                     position=None, vocab_size=None, fill_value=-1, max_accepted=None) -> Verdict:
    """Verify a block of drafts against one target forward.

    draft_tokens [B, K]: the drafts (target ids); target_logits [B, K+1, V]: the target's logits on
    [anchor, drafts], row j predicting draft j (row K: the bonus token); draft_logits [B, K, V]:
    the logits each draft was drawn from (the walk's `logits`, before temperature), required with
    temperature. temperature [B] (or scalar; 0 = greedy row) and key ([B] PRNG keys or [B, 2]
    uint32) as in `jax_markov.walk`; position [B]: the sequence position of draft token 0 (the
    walk's `position`), which indexes the acceptance and resampling streams. Columns >= vocab_size
    are padding. Without temperature every row is greedy. max_accepted (an int, traced or not): a row
    keeps at most this many drafts and, where it gets that far, does not test the draft after them:
    its next token is the target's own at that row (its argmax, or for a sampled row a draw from p,
    never from the residual), so that the text follows the target's distribution as without drafts.
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {list(draft_tokens.shape)}")
    b, k = draft_tokens.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{b}, {k + 1}, V], got {list(target_logits.shape)}")
    vocab = target_logits.shape[2]
    tl = _mask_padding(target_logits.astype(jnp.float32), vocab_size)
    target_choice = jnp.argmax(tl, axis=-1).astype(jnp.int32)  # [B, K+1]
    greedy_accept = draft_tokens == target_choice[:, :k]
    steps = jnp.arange(k + 1, dtype=jnp.int32)

    def kept(accept):  # (drafts kept, whether the row reached max_accepted: its draft there is not tested)
        n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        if max_accepted is None:
            return n, jnp.zeros_like(accept[:, 0])
        return jnp.minimum(n, max_accepted), n >= max_accepted

    if temperature is None:
        n, _ = kept(greedy_accept)
        next_token = jnp.take_along_axis(target_choice, n[:, None], axis=1)[:, 0]
    else:
        if draft_logits is None:
            raise ValueError("draft_logits are required with temperature: rejection sampling needs the draft "
                             "distribution q (walk(..., return_logits=True))")
        if draft_logits.shape != (b, k, vocab):
            raise ValueError(f"draft_logits must be [B, K, V] = [{b}, {k}, {vocab}], got {list(draft_logits.shape)}")
        if key is None or position is None:
            raise ValueError("key and position are required with temperature")
        words = request_keys(key, b)
        position = request_positions(position, b)
        sampled, inv_t = _inverse_temperature(temperature, b)
        dl = _mask_padding(draft_logits.astype(jnp.float32), vocab_size)
        p = jax.nn.softmax(_tempered(tl, inv_t[:, None, None]), axis=-1)  # [B, K+1, V]
        q = jax.nn.softmax(_tempered(dl, inv_t[:, None, None]), axis=-1)  # [B, K, V]
        p_d = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
        u = accept_uniform(words, position[:, None] + steps[None, :k])
        n, cut = kept(jnp.where(sampled[:, None], u * q_d < p_d, greedy_accept))
        p_row = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
        q_row = jnp.take_along_axis(q, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
        q_row = jnp.where(((n < k) & ~cut)[:, None], q_row, 0.0)  # the residual where draft n was rejected, else p
        residual = jnp.maximum(p_row - q_row, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_row)
        score = jnp.log(residual) + resample_noise(words, position + n, vocab)
        drawn = jnp.argmax(score, axis=-1).astype(jnp.int32)
        greedy_next = jnp.take_along_axis(target_choice, n[:, None], axis=1)[:, 0]
        next_token = jnp.where(sampled, drawn, greedy_next)

    padded = jnp.concatenate([draft_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(steps[None] < n[:, None], padded,
                       jnp.where(steps[None] == n[:, None], next_token[:, None], jnp.asarray(fill_value, jnp.int32)))
    return Verdict(n, next_token, tokens)


# -- decode loops ---------------------------------------------------------------------------------
# The loops take flax.nnx modules (the `flax` extra); the sampler above needs only jax.
def _nnx():
    from flax import nnx

    return nnx


def write_rows(buffer, rows, start):
    """buffer [B, S, ...] with rows [B, T, ...] written at per-request offsets start [B]."""
    def one(buf, upd, s):
        return lax.dynamic_update_slice(buf, upd.astype(buf.dtype), (s,) + (0,) * (buf.ndim - 1))
    return jax.vmap(one)(buffer, rows, start)


class DecodeResult(NamedTuple):
    tokens: jax.Array  # [B, P + max_new_tokens] int32: prompt, generated tokens, then pad_id
    lengths: jax.Array  # [B] int32: prompt + generated
    prompt_lengths: jax.Array  # [B] int32
    num_steps: jax.Array  # [B] int32: target forwards after the prefill (verify steps)
    num_accepted: jax.Array  # [B] int32: drafts the verifier accepted (over all steps)
    acceptance_counts: jax.Array  # [B, K+1] int32: steps that accepted exactly j drafts

    @property
    def num_generated(self):
        return self.lengths - self.prompt_lengths

    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, as DFlash / DSpark report it: (accepted drafts + 1) per step,
        over the whole batch (the last step of a request counts in full even if max length cut it)."""
        steps = int(jnp.sum(self.num_steps))
        return float(jnp.sum(self.num_accepted) + steps) / max(steps, 1)

    def generated(self, b: int) -> np.ndarray:
        """Request b's generated tokens (numpy)."""
        start, end = int(self.prompt_lengths[b]), int(self.lengths[b])
        return np.asarray(self.tokens[b, start:end])


def _prepare(prompt, prompt_lengths, temperature, key, max_new_tokens):
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, P] with P >= 1 (right-padded), got shape {list(prompt.shape)}")
    b, p = prompt.shape
    lengths = jnp.broadcast_to(jnp.asarray(prompt_lengths, jnp.int32), (b,))
    try:
        lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
    except jax.errors.ConcretizationTypeError:  # traced: cannot be checked here
        lo, hi = 1, p
    if lo < 1 or hi > p:
        raise ValueError(f"prompt_lengths must lie in [1, P = {p}], got [{lo}, {hi}]")
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a static int >= 1, got {max_new_tokens!r}")
    if temperature is None:
        if key is not None:
            raise ValueError("key is only used with temperature (pass temperature, 0 for greedy rows)")
        return prompt, lengths, None, None
    if key is None:
        raise ValueError("key is required with temperature (one PRNG key per request)")
    t = jnp.asarray(temperature, jnp.float32)
    if t.ndim not in (0, 1) or (t.ndim == 1 and t.shape != (b,)):
        raise ValueError(f"temperature must be a scalar or [B] = [{b}], got shape {list(t.shape)}")
    return prompt, lengths, jnp.broadcast_to(t, (b,)), request_keys(key, b)


def _finish(tokens, length, done, count_new, emitted, limit, eos_id):
    """Write emitted[:count] at each request's length, return (tokens, length, done).
    eos_id: a traced int32 scalar, -1 for none."""
    steps = jnp.arange(emitted.shape[1], dtype=jnp.int32)
    is_eos = (emitted == eos_id) & (eos_id >= 0) & (steps[None] < count_new[:, None])
    first = jnp.argmax(is_eos, axis=1).astype(jnp.int32)
    hit = jnp.any(is_eos, axis=1)
    count_new = jnp.where(hit, first + 1, count_new)
    count_new = jnp.minimum(count_new, limit - length)
    count_new = jnp.where(done, 0, count_new)
    old = jax.vmap(lambda row, s: lax.dynamic_slice(row, (s,), (emitted.shape[1],)))(tokens, length)
    new = jnp.where(steps[None] < count_new[:, None], emitted, old)
    tokens = write_rows(tokens, new, length)
    length = length + count_new
    done = done | (length >= limit) | (hit & ~done)
    return tokens, length, done


def _prefill(target, prompt, lengths, total, temperature, words, pad_id, vocab_size, feature_layers, max_new_tokens):
    b, p = prompt.shape
    valid = jnp.arange(p)[None, :] < lengths[:, None]
    tokens = jnp.full((b, total), pad_id, jnp.int32).at[:, :p].set(jnp.where(valid, prompt, pad_id))
    cache = target.init_cache(b, total)
    out = target(tokens[:, :p], jnp.zeros((b,), jnp.int32), cache, feature_layers=feature_layers)
    last = jnp.take_along_axis(out.logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = choose_token(last, temperature=temperature, key_words=words, position=lengths, vocab_size=vocab_size)
    return tokens, out, first


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "max_new_tokens", "use_markov_head",
                                             "logits_dtype", "vocab_size", "impl"))
def _speculative(target_def, target_state, drafter_def, drafter_state, prompt, lengths, temperature, words, eos_id,
                 pad_id, max_accepted, *, max_new_tokens, use_markov_head, logits_dtype, vocab_size, impl):
    nnx = _nnx()
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    b, p = prompt.shape
    k = drafter.block_size
    total = p + max_new_tokens + k + 1
    limit = lengths + max_new_tokens
    sampling = temperature is not None
    layers = tuple(drafter.target_layer_ids)
    with jax.named_scope(PREFILL_SCOPE):
        tokens, out, first = _prefill(target, prompt, lengths, total, temperature, words, pad_id, vocab_size, layers,
                                      max_new_tokens)
        context = drafter.extend_context(out.features, jnp.zeros((b,), jnp.int32), drafter.init_context(b, total))
        done = jnp.zeros((b,), bool)
        tokens, length, done = _finish(tokens, lengths, done, jnp.ones((b,), jnp.int32), first[:, None], limit,
                                       eos_id)
    zeros = jnp.zeros((b,), jnp.int32)
    state = (jnp.int32(0), tokens, length, done, out.cache, context, zeros, zeros, jnp.zeros((b, k + 1), jnp.int32))

    def cond(s):
        return jnp.any(~s[3]) & (s[0] < max_new_tokens)

    def body(s):
        it, tokens, length, done, cache, context, steps, accepted, counts = s
        anchor_pos = length - 1
        anchor = jnp.take_along_axis(tokens, anchor_pos[:, None], axis=1)[:, 0]
        with jax.named_scope("drafter"):
            draft = drafter.draft(anchor, anchor_pos, context, embed=target.embed, unembed=target.unembed,
                                  temperature=temperature, key=words, use_markov_head=use_markov_head,
                                  return_logits=sampling, logits_dtype=logits_dtype, vocab_size=vocab_size, impl=impl)
        block = jnp.concatenate([anchor[:, None], draft.tokens], axis=1)
        with jax.named_scope("target_forward"):
            verify = target(block, anchor_pos, cache, feature_layers=layers)
        with jax.named_scope("rejection_sampler"):
            verdict = rejection_sample(draft.tokens, verify.logits, draft.logits, temperature=temperature, key=words,
                                       position=anchor_pos + 1, vocab_size=vocab_size, fill_value=pad_id,
                                       max_accepted=max_accepted)
        n = verdict.num_accepted
        active = ~done
        tokens, length, done = _finish(tokens, length, done, n + 1, verdict.tokens, limit, eos_id)
        with jax.named_scope("drafter_context"):
            context = drafter.extend_context(verify.features, anchor_pos, context)
        steps = steps + active.astype(jnp.int32)
        accepted = accepted + jnp.where(active, n, 0)
        counts = counts + (jax.nn.one_hot(n, k + 1, dtype=jnp.int32) * active[:, None].astype(jnp.int32))
        return it + 1, tokens, length, done, verify.cache, context, steps, accepted, counts

    _, tokens, length, _, _, _, steps, accepted, counts = lax.while_loop(cond, body, state)
    return DecodeResult(tokens[:, :p + max_new_tokens], length, lengths, steps, accepted, counts)


def speculative_decode(target, drafter, prompt, prompt_lengths, *, max_new_tokens: int, temperature=None, key=None,
                       eos_id: int | None = None, pad_id: int = 0, use_markov_head: bool = True,
                       logits_dtype=jnp.float32, vocab_size: int | None = None, impl: str = "auto",
                       max_accepted: int | None = None, lower: bool = False) -> DecodeResult:
    """Speculative decoding of a batch of requests, in one jitted `lax.while_loop`.

    target: a model following the target protocol (`jax_markov.flax.CausalLM` documents it);
    drafter: a `jax_markov.flax.DSparkDrafter` (its block size K is the number of drafts per step).
    prompt [B, P] int (right-padded) with prompt_lengths [B] in [1, P]. Each request stops after
    max_new_tokens generated tokens or after emitting eos_id; requests advance by different amounts
    at every step. temperature [B] (or scalar; 0 = greedy) with key ([B] PRNG keys or [B, 2] uint32
    words), or None for all-greedy. use_markov_head=False drafts from the block drafter's logits
    alone. logits_dtype: the dtype of the draft logits the walk returns, i.e. of the q the verifier
    uses (docs/spec.md). impl: the walk's implementation ("auto", "reference", "ffi").

    Each step: draft K tokens after the anchor (the last committed token, at position p) with the
    walk at position p + 1, run the target once on [anchor, drafts] (positions p .. p+K), accept
    with `rejection_sample`, commit the accepted drafts and the correction/bonus token (which becomes
    the next anchor), and extend the drafter's context with the target's features of the committed
    positions. Greedy rows commit only the target's argmax of a verify row, so their text is exactly
    `target_decode(..., verify_block_size=K)`'s, bit for bit, wherever the target computes each row of
    a block apart from the others (as `CausalLM` does: every op of a row is row-wise, or a GEMM or
    attention over the cache whose row does not read the other rows) and XLA gives both programs the
    same kernels (autotuning can differ between compilations; max_accepted=0 below needs no second
    program).

    max_accepted: each verify step keeps at most this many drafts (`rejection_sample`); it is an
    argument of the compiled program, not part of it, so max_accepted=0 runs the very same program
    with every draft set aside: the target decoding one token per verify step, on the verify step's
    shapes and kernels. Greedy rows then give the text that the same call with drafts must give, bit
    for bit, whatever kernels XLA chose for this program.

    lower=True returns the jitted program lowered for these arguments (a `jax.stages.Lowered`;
    `.compile().as_text()` is the HLO whose op names a profile of this decode reports, see
    `STEP_SCOPES`) instead of running it; after a run with the same arguments both come from JAX's
    caches.
    """
    prompt, lengths, temperature, words = _prepare(prompt, prompt_lengths, temperature, key, max_new_tokens)
    if drafter.config.vocab_size != _vocab_of(target, drafter):
        raise ValueError(f"the drafter's vocab_size ({drafter.config.vocab_size}) differs from the target's "
                         f"({_vocab_of(target, drafter)})")
    target_def, target_state = _nnx().split(target)
    drafter_def, drafter_state = _nnx().split(drafter)
    block_size = drafter.block_size
    keep = block_size if max_accepted is None else int(max_accepted)
    if not 0 <= keep <= block_size:
        raise ValueError(f"max_accepted must be in [0, K = {block_size}], got {max_accepted}")
    return _run(_speculative, lower, target_def, target_state, drafter_def, drafter_state, prompt, lengths,
                temperature, words, _eos(eos_id), jnp.asarray(pad_id, jnp.int32), jnp.asarray(keep, jnp.int32),
                max_new_tokens=int(max_new_tokens),
                use_markov_head=bool(use_markov_head), logits_dtype=jnp.dtype(logits_dtype).name,
                vocab_size=vocab_size, impl=impl)


def _run(program, lower: bool, *args, **static):
    return program.lower(*args, **static) if lower else program(*args, **static)


def _eos(eos_id):
    if eos_id is None:
        return jnp.int32(-1)
    if not isinstance(eos_id, int | np.integer) or eos_id < 0:
        raise ValueError(f"eos_id must be None or a token id >= 0, got {eos_id!r}")
    return jnp.int32(eos_id)


def _vocab_of(target, drafter):
    config = getattr(target, "config", None)
    return getattr(config, "vocab_size", drafter.config.vocab_size)


@functools.partial(jax.jit, static_argnames=("target_def", "max_new_tokens", "vocab_size", "verify_block_size"))
def _autoregressive(target_def, target_state, prompt, lengths, temperature, words, eos_id, pad_id, query_row, *,
                    max_new_tokens, vocab_size, verify_block_size):
    target = _nnx().merge(target_def, target_state)
    b, p = prompt.shape
    rows = verify_block_size + 1  # query rows per forward
    total = p + max_new_tokens + rows  # with verify_block_size = K: _speculative's cache length
    limit = lengths + max_new_tokens
    with jax.named_scope(PREFILL_SCOPE):
        tokens, out, first = _prefill(target, prompt, lengths, total, temperature, words, pad_id, vocab_size, (),
                                      max_new_tokens)
        tokens, length, done = _finish(tokens, lengths, jnp.zeros((b,), bool), jnp.ones((b,), jnp.int32),
                                       first[:, None], limit, eos_id)
    zeros = jnp.zeros((b,), jnp.int32)

    def cond(s):
        return jnp.any(~s[3]) & (s[0] < max_new_tokens)

    def body(s):
        it, tokens, length, done, cache, steps = s
        pos = length - 1
        # The last token, then (with verify_block_size) what the text buffer holds after it: data, not
        # constants, so that XLA computes every row as the verify step does
        block = jax.vmap(lambda row, start: lax.dynamic_slice(row, (start,), (rows,)))(tokens, pos)
        with jax.named_scope("target_forward"):
            step = target(block, pos, cache)
        # row 0 through a traced index: XLA cannot narrow the forward to the one row it keeps
        logits = step.logits[:, 0] if rows == 1 else lax.dynamic_index_in_dim(step.logits, query_row, 1, False)
        nxt = choose_token(logits, temperature=temperature, key_words=words, position=pos + 1, vocab_size=vocab_size)
        active = ~done
        tokens, length, done = _finish(tokens, length, done, jnp.ones((b,), jnp.int32), nxt[:, None], limit, eos_id)
        return it + 1, tokens, length, done, step.cache, steps + active.astype(jnp.int32)

    _, tokens, length, _, _, steps = lax.while_loop(cond, body, (jnp.int32(0), tokens, length, done, out.cache, zeros))
    return DecodeResult(tokens[:, :p + max_new_tokens], length, lengths, steps, zeros, steps[:, None])


def target_decode(target, prompt, prompt_lengths, *, max_new_tokens: int, temperature=None, key=None,
                  eos_id: int | None = None, pad_id: int = 0, vocab_size: int | None = None,
                  verify_block_size: int = 0, lower: bool = False) -> DecodeResult:
    """The target's own autoregressive decoding (one token per forward), jitted the same way: the
    reference that greedy speculative decoding reproduces token for token, and the baseline of the
    example. Sampled rows draw token t with the resample stream at position t.

    verify_block_size=K runs each forward as `speculative_decode` with a drafter of block size K runs
    its verify step: on K + 1 query rows (the last token, then what the text buffer holds after it)
    over a KV cache of the same length, keeping row 0. The text is the same; the rounding is that of
    the verify step, row for row: where GEMMs and attention of other shapes round otherwise (bf16 on
    a GPU), this is the reference whose greedy text speculative decoding reproduces bit for bit, as
    long as XLA gives the two programs the same kernels for the same shapes (autotuning can differ
    between compilations; `speculative_decode(..., max_accepted=0)` is the reference that holds
    whatever XLA chose).
    lower=True: as in `speculative_decode`.
    """
    prompt, lengths, temperature, words = _prepare(prompt, prompt_lengths, temperature, key, max_new_tokens)
    if not isinstance(verify_block_size, int | np.integer) or verify_block_size < 0:
        raise ValueError(f"verify_block_size must be a static int >= 0, got {verify_block_size!r}")
    target_def, target_state = _nnx().split(target)
    return _run(_autoregressive, lower, target_def, target_state, prompt, lengths, temperature, words, _eos(eos_id),
                jnp.asarray(pad_id, jnp.int32), jnp.zeros((), jnp.int32), max_new_tokens=int(max_new_tokens),
                vocab_size=vocab_size, verify_block_size=int(verify_block_size))
