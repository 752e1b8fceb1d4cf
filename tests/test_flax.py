"""jax_markov.flax: the nnx MarkovHead, the DSpark drafter, the target model and checkpoints.

The drafter and the target are checked against straightforward re-implementations written here
from the raw weights (no cache, no shared code); checkpoints are written by the tests themselves.
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_markov
from jax_markov import flax as jmf
from jax_markov.flax import checkpoint as ckpt_module
from jax_markov.flax import head as head_module

V, H, R = 48, 32, 16

TARGET = jmf.CausalLMConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def drafter_config(**kw):
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, mask_token_id=V - 1, target_layer_ids=(0, 2), num_target_layers=3,
                block_size=4, markov_rank=R, initializer_range=0.2)
    base.update(kw)
    return jmf.DSparkConfig(**base)


# jitted entry points (eager op-by-op dispatch is slow on a small CPU)
@functools.partial(nnx.jit, static_argnames="layers")
def target_forward(model, tokens, start, cache, layers=()):
    return model(tokens, start, cache, feature_layers=layers)


@nnx.jit
def extend(drafter, features, start, context):
    return drafter.extend_context(features, start, context)


@nnx.jit
def block_logits(drafter, target, anchor, p, context):
    return drafter.base_logits(drafter.hidden(anchor, p, context, embed=target.embed), unembed=target.unembed)


@functools.partial(nnx.jit, static_argnames=("use_head", "confidence"))
def draft(drafter, target, anchor, p, context, temperature, keys, use_head=True, confidence=False):
    return drafter.draft(anchor, p, context, embed=target.embed, unembed=target.unembed, temperature=temperature,
                         key=keys, use_markov_head=use_head, return_logits=True, return_confidence=confidence)


def random_markov(drafter_or_head, seed, std=0.5):
    head = drafter_or_head.markov_head if isinstance(drafter_or_head, jmf.DSparkDrafter) else drafter_or_head
    rng = np.random.default_rng(seed)
    head.load_weights(rng.normal(0, std, head.markov_w1.shape), rng.normal(0, std, head.markov_w2.shape))


# -- MarkovHead --------------------------------------------------------------------------------------
def test_markov_head_parameters_are_named_and_shaped_as_released():
    head = jmf.MarkovHead(V, R, rngs=nnx.Rngs(0))
    params = nnx.state(head, nnx.Param)
    assert sorted(k for k, _ in params.items()) == ["markov_w1", "markov_w2"]
    assert head.markov_w1.shape == (V, R) and head.markov_w2.shape == (V, R)
    assert head.markov_w1.dtype == jnp.bfloat16  # the released heads are bf16
    assert sorted(jmf.state_dict(head)) == ["markov_w1.weight", "markov_w2.weight"]
    drafter = jmf.DSparkDrafter(drafter_config(), rngs=nnx.Rngs(0))
    names = set(jmf.state_dict(drafter))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names
    assert jmf.state_dict(drafter)["markov_head.markov_w2.weight"].shape == (V, R)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_walk_method_is_jax_markov_walk_with_every_option(quantization):
    head = jmf.MarkovHead(V, R, param_dtype=jnp.float32, logit_scale=0.7, rngs=nnx.Rngs(1))
    random_markov(head, 1)
    head.markov_quantization = quantization
    plain = jax_markov.MarkovHead(head.markov_w1[...], head.markov_w2[...])
    plain = jax_markov.quantize(plain) if quantization else plain
    rng = np.random.default_rng(2)
    b, k = 5, 4
    kw = dict(temperature=jnp.array([0.0, 1.0, 0.5, 0.0, 2.0]), key=jax.random.split(jax.random.key(3), b),
              position=jnp.arange(b) * 7, vocab_size=V - 3, return_logits=True, logits_dtype=jnp.bfloat16,
              return_embeds=True, d2t=jnp.zeros((V,), jnp.int32).at[5].set(2))
    base = jnp.asarray(rng.normal(0, 2, (b, k, V)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, V, b), jnp.int32)
    got = head.walk(base, anchor, **kw)
    want = jax_markov.walk(base, anchor, plain, logit_scale=0.7, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(np.asarray(got.logits, np.float32), np.asarray(want.logits, np.float32))
    np.testing.assert_array_equal(got.embeds, want.embeds)
    assert got.logits.dtype == jnp.bfloat16
    # logit_scale=0 on the call removes the bias: the walk is then the plain argmax of the base logits
    flat = head(base, anchor, logit_scale=0.0)
    np.testing.assert_array_equal(flat.tokens, jnp.argmax(base, -1))


def test_int8_layout_is_made_once_when_set_or_loaded(monkeypatch):
    calls = []
    real = head_module._head.quantize
    monkeypatch.setattr(head_module._head, "quantize", lambda h: calls.append(1) or real(h))
    head = jmf.MarkovHead(V, R, param_dtype=jnp.float32, rngs=nnx.Rngs(0), zero_w2=False)
    assert calls == [] and head.head().__class__ is jax_markov.MarkovHead
    head.markov_quantization = "int8"
    assert len(calls) == 1
    want = real(jax_markov.MarkovHead(head.markov_w1[...], head.markov_w2[...]))
    np.testing.assert_array_equal(head.markov_w2_int8[...], want.q)
    np.testing.assert_array_equal(head.markov_w2_scale[...], want.scale)
    assert head.head().tiles is None and want.tiles is None  # r = 16: no kernel reads tiles
    if jax_markov.native.plan_available():  # r = 256: the tiles are stored with the layout, and walked
        wide = jmf.MarkovHead(100, 256, param_dtype=jnp.float32, rngs=nnx.Rngs(1), zero_w2=False, markov_quantization="int8")
        tiled = real(jax_markov.MarkovHead(wide.markov_w1[...], wide.markov_w2[...]))
        assert tiled.tiles is not None
        np.testing.assert_array_equal(wide.head().tiles, tiled.tiles)
        del calls[1:]  # the wide head's own quantization
    base = jnp.asarray(np.random.default_rng(0).normal(0, 1, (3, 4, V)), jnp.float32)
    anchor = jnp.array([1, 2, 3])
    for _ in range(3):  # eager calls and a jitted one: no quantization per call
        head.walk(base, anchor)
    graphdef, state = nnx.split(head)
    jax.jit(lambda s, b, a: nnx.merge(graphdef, s).walk(b, a).tokens)(state, base, anchor)
    assert len(calls) == 1
    # loading weights rebuilds the layout, once
    rng = np.random.default_rng(5)
    new_w2 = rng.normal(0, 1, (V, R)).astype(np.float32)
    head.load_weights(head.markov_w1[...], new_w2)
    assert len(calls) == 2
    np.testing.assert_array_equal(head.markov_w2_int8[...], real(jax_markov.MarkovHead(head.markov_w1[...],
                                                                                        jnp.asarray(new_w2))).q)
    jmf.load_state_dict(head, {"markov_w1.weight": head.markov_w1[...], "markov_w2.weight": -new_w2})
    assert len(calls) == 3
    np.testing.assert_array_equal(head.markov_w2_int8[...],
                                  real(jax_markov.MarkovHead(head.markov_w1[...], jnp.asarray(-new_w2))).q)
    # the int8 layout is derived state: not a parameter, not in the checkpoint
    assert "markov_w2_int8" not in dict(nnx.state(head, nnx.Param).items())
    assert sorted(jmf.state_dict(head)) == ["markov_w1.weight", "markov_w2.weight"]
    head.markov_quantization = None
    assert head.markov_w2_int8 is None and isinstance(head.head(), jax_markov.MarkovHead)
    with pytest.raises(ValueError, match="markov_quantization"):
        head.markov_quantization = "int4"


def test_bias_is_trainable_and_fit_recovers_a_low_rank_matrix():
    head = jmf.MarkovHead(V, R, param_dtype=jnp.float32, rngs=nnx.Rngs(0), zero_w2=False)
    prev = jnp.array([[1, 2], [3, 4]])

    def loss(h):
        return jnp.sum(h.bias(prev) ** 2)

    grads = nnx.grad(loss)(head)
    assert float(jnp.abs(grads["markov_w1"][...]).sum()) > 0 and float(jnp.abs(grads["markov_w2"][...]).sum()) > 0
    rng = np.random.default_rng(0)
    low = rng.normal(0, 1, (V, 6)) @ rng.normal(0, 1, (6, V))
    assert head.fit(low) < 1e-5
    np.testing.assert_allclose(head.bias(jnp.arange(V)), low, atol=1e-4)
    full = rng.normal(0, 1, (V, V))
    assert 0.1 < head.fit(full) < 1.0  # rank 16 cannot hold a full-rank matrix


# -- the target model ------------------------------------------------------------------------------
def reference_lm_logits(model: jmf.CausalLM, tokens):
    """Plain full-sequence causal forward from the raw weights (no cache)."""
    c = model.config
    w = {k: np.asarray(v, np.float64) for k, v in jmf.state_dict(model).items()}
    return _reference_stack(w, "model.", c, np.asarray(w["model.embed_tokens.weight"])[np.asarray(tokens)],
                            None, causal=True, n_layers=c.num_hidden_layers, head=w["lm_head.weight"])


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    f = pos[..., None] * inv
    cos, sin = np.cos(np.concatenate([f, f], -1))[..., None, :], np.sin(np.concatenate([f, f], -1))[..., None, :]
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def _reference_stack(w, prefix, c, x, ctx, *, causal, n_layers, head=None, positions=None, ctx_positions=None,
                     ctx_visible=None, return_hidden=False):
    """Qwen3 layers from weights `w` (prefix 'model.' or ''); ctx: extra key/value inputs [B, S, H]."""
    b, t, _ = x.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
    hidden = [x]
    for i in range(n_layers):
        p = f"{prefix}layers.{i}."
        lin = lambda name, v: v @ w[p + name + ".weight"].T
        h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = _rope(_rms(lin("self_attn.q_proj", h).reshape(b, t, nh, hd), w[p + "self_attn.q_norm.weight"],
                       c.rms_norm_eps), pos, c.rope_theta)
        k = _rope(_rms(lin("self_attn.k_proj", h).reshape(b, t, nkv, hd), w[p + "self_attn.k_norm.weight"],
                       c.rms_norm_eps), pos, c.rope_theta)
        v = lin("self_attn.v_proj", h).reshape(b, t, nkv, hd)
        mask = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
        mask = np.broadcast_to(mask, (b, t, t))
        if ctx is not None:
            kc = _rope(_rms(lin("self_attn.k_proj", ctx).reshape(b, -1, nkv, hd), w[p + "self_attn.k_norm.weight"],
                            c.rms_norm_eps), ctx_positions, c.rope_theta)
            vc = lin("self_attn.v_proj", ctx).reshape(b, -1, nkv, hd)
            k, v = np.concatenate([kc, k], 1), np.concatenate([vc, v], 1)
            mask = np.concatenate([np.broadcast_to(ctx_visible[:, None, :], (b, t, ctx.shape[1])), mask], 2)
        g = nh // nkv
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
        s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
        s = np.where(mask[:, None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", a, v).reshape(b, t, nh * hd)
        x = x + lin("self_attn.o_proj", o)
        h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = lin("mlp.gate_proj", h)
        x = x + (gate / (1 + np.exp(-gate)) * lin("mlp.up_proj", h)) @ w[p + "mlp.down_proj.weight"].T
        hidden.append(x)
    out = _rms(x, w[prefix + "norm.weight"], c.rms_norm_eps)
    if return_hidden:
        return out, hidden
    return out @ head.T


def test_target_cached_decoding_matches_a_plain_forward():
    model = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (2, 9)), jnp.int32)
    want = reference_lm_logits(model, tokens)
    cache = model.init_cache(2, 12)
    out = target_forward(model, tokens[:, :5], jnp.zeros(2, jnp.int32), cache)  # prefill 5, then 2 + 2
    got = [out.logits]
    out = target_forward(model, tokens[:, 5:7], jnp.full(2, 5), out.cache)
    got.append(out.logits)
    # write garbage after position 7, then overwrite it: stale entries must never be read
    junk = target_forward(model, jnp.asarray(rng.integers(0, V, (2, 2)), jnp.int32), jnp.full(2, 8), out.cache)
    out = target_forward(model, tokens[:, 7:9], jnp.full(2, 7), junk.cache, layers=(-1, 1))
    got.append(out.logits)
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=2e-4, atol=2e-4)
    _, hidden = _reference_stack({k: np.asarray(v, np.float64) for k, v in jmf.state_dict(model).items()}, "model.",
                                 TARGET, np.asarray(model.model.embed_tokens.weight[...])[np.asarray(tokens)], None,
                                 causal=True, n_layers=3, return_hidden=True)
    np.testing.assert_allclose(out.features, np.concatenate([hidden[0][:, 7:9], hidden[2][:, 7:9]], -1),
                               rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="feature layer 3"):
        model(tokens[:, :1], jnp.zeros(2, jnp.int32), cache, feature_layers=(3,))


def test_rope_is_the_rotate_half_form_and_lowers_without_a_concatenate():
    from jax_markov.flax.layers import rope

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    positions = rng.integers(0, 64, (2, 3))  # small: the float32 angles stay within 1e-5 of the exact
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), 1e6))
    np.testing.assert_allclose(got, _rope(x.astype(np.float64), positions, 1e6), rtol=0, atol=2e-5)
    # the rotation is one elementwise pass: XLA's GPU backend leaves concatenates unfused
    text = jax.jit(rope, static_argnums=2).lower(jnp.asarray(x), jnp.asarray(positions, jnp.int32), 1e6).as_text()
    assert "concatenate" not in text and "reverse" in text


def test_the_kv_write_lands_each_request_at_its_own_position():
    from jax_markov.flax.layers import write_rows

    rng = np.random.default_rng(4)
    cache = rng.normal(size=(4, 2, 10, 5)).astype(np.float32)  # [B, Hkv, S, d]
    rows = rng.normal(size=(4, 3, 2, 5)).astype(np.float32)  # [B, T, Hkv, d]
    start = np.array([0, 4, 7, 9])  # request 2 ends at the last position; request 3 runs past it
    got = np.asarray(jax.jit(write_rows)(jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(start, jnp.int32)))
    want = cache.copy()
    for b in range(4):
        for t in range(3):
            if start[b] + t < 10:
                want[b, :, start[b] + t] = rows[b, t]  # past the cache: dropped
    np.testing.assert_array_equal(got, want)
    # a buffer a layer, holding the parameters' dtype unless told otherwise
    cache = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16).init_cache(1, 4)
    assert len(cache.k) == len(cache.v) == TARGET.num_hidden_layers and cache.k[0].dtype == jnp.bfloat16
    model = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, cache_dtype=jnp.float32)
    assert model.init_cache(2, 4).v[2].dtype == jnp.float32 and model.init_cache(2, 4).k[1].shape == (2, 2, 4, 8)


def test_attention_reads_the_cache_where_it_lies_and_never_transposes_its_scores():
    """The compiled forward copies no layer of the KV cache: each layer's buffer [B, Hkv, S, d] is laid
    out as the batched products read it, and is a buffer of its own (the CPU backend's HLO; a [B, S,
    Hkv, d] cache compiled to a transposed copy of every layer's keys and values per forward, and a
    stacked [L, B, Hkv, S, d] one to a slice copy of every layer's). Nor does it transpose the scores
    (B x H x T x S, the largest arrays of attention): an einsum of q [B, T, Hkv, G, d] compiled to
    two transposed copies of them per layer."""
    import math
    import re

    b, t, s = 2, 3, 11
    model = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    forward = nnx.jit(lambda m, tokens, start, cache: m(tokens, start, cache).logits)
    hlo = forward.lower(model, jnp.zeros((b, t), jnp.int32), jnp.zeros(b, jnp.int32),
                        model.init_cache(b, s)).compile().as_text()
    layer = sorted((b, TARGET.num_key_value_heads, s, TARGET.head_dim))
    moved = [(m.group(0), [int(n) for n in m.group(1).split(",")])
             for m in re.finditer(r"= \w+\[([\d,]+)\]\{[\d,]*\} (?:transpose|copy|slice|dynamic-slice)\(", hlo)]
    assert not [text for text, dims in moved if sorted(n for n in dims if n != 1) == layer]
    scores = b * TARGET.num_attention_heads * t * s
    assert not [text for text, dims in moved if math.prod(dims) == scores]


# -- the drafter -----------------------------------------------------------------------------------
def reference_draft_base_logits(drafter, target, features, anchor, p):
    """[anchor, mask x (K-1)] at positions p..p+K-1, non-causal, keys/values = projected target
    features at positions < p plus the block; the target's embedding and LM head."""
    c = drafter.config
    w = {k: np.asarray(v, np.float64) for k, v in jmf.state_dict(drafter).items()}
    emb = np.asarray(target.model.embed_tokens.weight[...], np.float64)
    b, s, _ = features.shape
    ids = np.concatenate([np.asarray(anchor)[:, None], np.full((b, c.block_size - 1), c.mask_token_id)], 1)
    ctx = _rms(np.asarray(features, np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], c.rms_norm_eps)
    positions = np.asarray(p)[:, None] + np.arange(c.block_size)
    visible = np.arange(s)[None, :] < np.asarray(p)[:, None]
    return _reference_stack(w, "", c, emb[ids], ctx, causal=False, n_layers=c.num_hidden_layers,
                            head=np.asarray(target.lm_head.weight[...], np.float64), positions=positions,
                            ctx_positions=np.broadcast_to(np.arange(s), (b, s)), ctx_visible=visible)


def test_drafter_block_matches_a_plain_dflash_forward():
    target = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0))
    drafter = jmf.DSparkDrafter(drafter_config(), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    b, s = 3, 10
    tokens = jnp.asarray(rng.integers(0, V, (b, s)), jnp.int32)
    out = target_forward(target, tokens, jnp.zeros(b, jnp.int32), target.init_cache(b, s), layers=(0, 2))
    p = jnp.array([4, 7, 1])
    anchor = jnp.array([5, 9, 11])
    # the context cache, filled in two pieces, with junk written where it must not be read
    context = drafter.init_context(b, s + 4)
    context = extend(drafter, out.features[:, :6], jnp.zeros(b, jnp.int32), context)
    context = extend(drafter, out.features[:, 6:], jnp.full(b, 6), context)
    junk = extend(drafter, jnp.asarray(rng.normal(0, 5, (b, 4, out.features.shape[-1])), jnp.float32), p, context)
    got = block_logits(drafter, target, anchor, p, junk)
    # junk at positions >= p is invisible, so the reference only needs the true features
    want = reference_draft_base_logits(drafter, target, np.asarray(out.features), anchor, p)
    np.testing.assert_allclose(got, want, rtol=3e-4, atol=3e-4)
    # every row reads the context: changing a visible feature changes the block's logits
    moved = extend(drafter, out.features[:, :4] + 1.0, jnp.zeros(b, jnp.int32), context)
    assert not np.allclose(block_logits(drafter, target, anchor, p, moved), got, atol=1e-3)


def test_draft_is_the_markov_walk_of_the_base_logits():
    target = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0))
    drafter = jmf.DSparkDrafter(drafter_config(enable_confidence_head=True, confidence_head_with_markov=True),
                                rngs=nnx.Rngs(1))
    random_markov(drafter, 3)
    b = 4
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, V, (b, 6)), jnp.int32)
    out = target_forward(target, tokens, jnp.zeros(b, jnp.int32), target.init_cache(b, 6), layers=(0, 2))
    context = extend(drafter, out.features, jnp.zeros(b, jnp.int32), drafter.init_context(b, 16))
    anchor, p = tokens[:, -1], jnp.full(b, 5)
    temperature = jnp.array([0.0, 1.0, 0.7, 1.3])
    keys = jax.random.split(jax.random.key(0), b)
    drafted = draft(drafter, target, anchor, p, context, temperature, keys, confidence=True)
    base = block_logits(drafter, target, anchor, p, context)
    walk = drafter.markov_head.walk(base, anchor, temperature=temperature, key=keys, position=p + 1,
                                    return_logits=True, return_embeds=True)
    np.testing.assert_array_equal(drafted.tokens, walk.tokens)
    np.testing.assert_array_equal(drafted.logits, walk.logits)
    want_conf = jnp.concatenate([drafted.hidden, walk.embeds], -1) @ drafter.confidence_head.proj.weight[...][0] \
        + drafter.confidence_head.proj.bias[...][0]
    np.testing.assert_allclose(drafted.confidence, want_conf, rtol=1e-5, atol=1e-5)
    # without the head: the same choice rule on the base logits alone
    plain = draft(drafter, target, anchor, p, context, temperature, keys, use_head=False)
    zero = jmf.MarkovHead(V, R, param_dtype=jnp.float32)  # zero weights: bias 0
    want = zero.walk(base, anchor, temperature=temperature, key=keys, position=p + 1)
    np.testing.assert_array_equal(plain.tokens, want.tokens)
    assert not np.array_equal(plain.tokens, drafted.tokens)


# -- configs and checkpoints ----------------------------------------------------------------------------
RELEASED_STYLE = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "layer_types": ["full_attention", "full_attention"], "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "block_size": 4, "mask_token_id": V - 1, "target_layer_ids": [0, 2], "num_target_layers": 3,
    "num_anchors": 512, "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "attention_bias": False, "max_position_embeddings": 4096,
}


def test_config_from_a_released_style_dict():
    c = jmf.DSparkConfig.from_dict(RELEASED_STYLE)
    assert (c.block_size, c.markov_rank, c.mask_token_id, c.target_layer_ids) == (4, R, V - 1, (0, 2))
    assert (c.rope_theta, c.dtype, c.head_dim, c.num_key_value_heads) == (10000.0, "bfloat16", 8, 2)
    nested = dict(RELEASED_STYLE, block_size=16, dflash_config={"block_size": 7, "mask_token_id": 3})
    assert (jmf.DSparkConfig.from_dict(nested).block_size, jmf.DSparkConfig.from_dict(nested).mask_token_id) == (7, 3)
    for bad, match in [(dict(markov_head_type="gated"), "gated"), (dict(target_layer_ids=[2, 0]), "increasing"),
                       (dict(target_layer_ids=[0, 5]), "target_layer_ids"), (dict(mask_token_id=V), "mask_token_id"),
                       (dict(layer_types=["sliding_attention"] * 2), "full_attention"),
                       (dict(markov_rank=0, confidence_head_with_markov=True), "Markov head")]:
        with pytest.raises(ValueError, match=match):
            jmf.DSparkConfig.from_dict(dict(RELEASED_STYLE, **bad))
    with pytest.raises(ValueError, match="lacks"):
        jmf.DSparkConfig.from_dict({k: v for k, v in RELEASED_STYLE.items() if k != "target_layer_ids"})


def test_safetensors_round_trip_with_released_names(tmp_path):
    target = jmf.CausalLM(TARGET, rngs=nnx.Rngs(0))
    drafter = jmf.DSparkDrafter(RELEASED_STYLE, rngs=nnx.Rngs(1), param_dtype=jnp.float32)
    random_markov(drafter, 4)
    # a released checkpoint carries the target's embedding and LM head too: they are checked and skipped
    extra = {"embed_tokens.weight": np.zeros((V, H), np.float32), "lm_head.weight": np.zeros((V, H), np.float32)}
    directory = tmp_path / "dspark"
    directory.mkdir()
    with open(directory / "config.json", "w") as f:
        json.dump(RELEASED_STYLE, f)
    jmf.save_safetensors(drafter, directory / "model.safetensors", dtype=jnp.bfloat16, extra=extra)
    with open(directory / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    w1_entry = header["markov_head.markov_w1.weight"]
    assert (w1_entry["dtype"], w1_entry["shape"]) == ("BF16", [V, R])
    assert header["fc.weight"]["shape"] == [H, 2 * H] and header["confidence_head.proj.weight"]["shape"] == [1, H + R]
    loaded = jmf.DSparkDrafter.from_pretrained(directory, markov_quantization="int8")
    assert loaded.markov_head.markov_w1.dtype == jnp.bfloat16  # config torch_dtype
    for name, value in jmf.state_dict(drafter, dtype=jnp.bfloat16).items():
        np.testing.assert_array_equal(np.asarray(jmf.state_dict(loaded)[name], np.float32),
                                      np.asarray(value, np.float32), err_msg=name)
    head = loaded.markov_head
    want = jax_markov.quantize(jax_markov.MarkovHead(head.markov_w1[...], head.markov_w2[...]))
    np.testing.assert_array_equal(loaded.markov_head.markov_w2_int8[...], want.q)  # made on load
    report = loaded.load_safetensors(directory / "model.safetensors")
    assert sorted(report.skipped) == ["embed_tokens.weight", "lm_head.weight"] and not report.missing
    # a bare head from the whole drafter checkpoint
    head = jmf.MarkovHead(V, R)
    jmf.load_safetensors(head, directory, prefix="markov_head.")
    np.testing.assert_array_equal(head.markov_w2[...], loaded.markov_head.markov_w2[...])
    # a f32 drafter loaded from the bf16 file drafts what the bf16-rounded weights draft
    b = 2
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (b, 5)), jnp.int32)
    out = target_forward(target, tokens, jnp.zeros(b, jnp.int32), target.init_cache(b, 5), layers=(0, 2))
    f32 = jmf.DSparkDrafter(RELEASED_STYLE, param_dtype=jnp.float32)
    f32.load_safetensors(directory)
    assert f32.fc.weight.dtype == jnp.float32
    drafts = []
    for d in (f32, loaded):
        ctx = extend(d, out.features, jnp.zeros(b, jnp.int32), d.init_context(b, 12))
        drafts.append(draft(d, target, tokens[:, -1], jnp.full(b, 5), ctx, jnp.zeros(b), jax.random.split(
            jax.random.key(0), b), use_head=False).tokens)
    np.testing.assert_array_equal(*drafts)


def test_checkpoint_errors_name_missing_unexpected_and_misshaped_tensors(tmp_path):
    drafter = jmf.DSparkDrafter(RELEASED_STYLE, rngs=nnx.Rngs(1))
    good = {k: np.asarray(v, np.float32) for k, v in jmf.state_dict(drafter).items()}
    fresh = lambda: jmf.DSparkDrafter(RELEASED_STYLE)
    fresh().load_state_dict(good)  # fits

    missing = dict(good)
    del missing["markov_head.markov_w2.weight"], missing["layers.1.mlp.up_proj.weight"]
    with pytest.raises(jmf.CheckpointError, match=r"missing \(2\): layers.1.mlp.up_proj.weight, "
                                                  r"markov_head.markov_w2.weight"):
        fresh().load_state_dict(missing)
    with pytest.raises(jmf.CheckpointError, match=r"unexpected \(1\): markov_head.gate_proj.weight"):
        fresh().load_state_dict(dict(good, **{"markov_head.gate_proj.weight": np.zeros((R, H + R))}))
    with pytest.raises(jmf.CheckpointError, match=r"misshaped \(1\): markov_head.markov_w1.weight: expected "
                                                  rf"\[{V}, {R}\], got \[{V}, {R + 1}\]"):
        fresh().load_state_dict(dict(good, **{"markov_head.markov_w1.weight": np.zeros((V, R + 1))}))
    with pytest.raises(jmf.CheckpointError, match=r"misshaped \(1\): lm_head.weight"):
        fresh().load_state_dict(dict(good, **{"lm_head.weight": np.zeros((V + 1, H))}))
    # a failed load leaves the module untouched
    d = fresh()
    before = np.asarray(d.fc.weight[...])
    with pytest.raises(jmf.CheckpointError):
        d.load_state_dict(dict(missing, **{"fc.weight": np.ones_like(good["fc.weight"])}))
    np.testing.assert_array_equal(d.fc.weight[...], before)
    # non-strict loads what is there and reports the rest; misshaped stays an error
    report = fresh().load_state_dict(dict(missing, extra_tensor=np.zeros(3)), strict=False)
    assert sorted(report.missing) == ["layers.1.mlp.up_proj.weight", "markov_head.markov_w2.weight"]
    assert report.unexpected == ["extra_tensor"]
    # the same errors through a file
    from safetensors.numpy import save_file
    save_file(missing, str(tmp_path / "m.safetensors"))
    with pytest.raises(jmf.CheckpointError, match="missing"):
        fresh().load_safetensors(tmp_path / "m.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(jmf.CheckpointError, match="no .safetensors"):
        ckpt_module.read_safetensors(tmp_path / "empty")
    # a head: extra tensors under its prefix are errors, other prefixes are ignored
    head = jmf.MarkovHead(V, R)
    jmf.load_state_dict(head, good, prefix="markov_head.")
    with pytest.raises(jmf.CheckpointError, match="markov_head.markov_w3.weight"):
        jmf.load_state_dict(head, dict(good, **{"markov_head.markov_w3.weight": np.zeros((V, R))}),
                            prefix="markov_head.")


def test_corrupt_or_truncated_safetensors_name_the_file(tmp_path):
    """A file that is not a valid safetensors file (truncated, garbage, missing, a broken index) is a
    CheckpointError naming it, not the library's bare deserialisation error."""
    from safetensors.numpy import save_file
    drafter = jmf.DSparkDrafter(RELEASED_STYLE, rngs=nnx.Rngs(1))
    good = {k: np.asarray(v, np.float32) for k, v in jmf.state_dict(drafter).items()}
    save_file(good, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[:len(data) // 2])
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint at all")
    (tmp_path / "broken.index.json").write_text("{\"weight_map\": ")
    for name in ("truncated.safetensors", "garbage.safetensors", "missing.safetensors", "broken.index.json"):
        path = tmp_path / name
        with pytest.raises(jmf.CheckpointError, match=f"cannot read the safetensors (file|index) {path}"):
            jmf.DSparkDrafter(RELEASED_STYLE).load_safetensors(path)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.safetensors").write_bytes(data)
    (shards / "b.safetensors").write_bytes(data[:100])
    with pytest.raises(jmf.CheckpointError, match=f"{shards / 'b.safetensors'}"):
        ckpt_module.read_safetensors(shards)
    jmf.DSparkDrafter(RELEASED_STYLE).load_safetensors(tmp_path / "model.safetensors")  # the intact file loads


def test_the_module_passed_to_jax_markov_walk_says_what_to_pass():
    head = jmf.MarkovHead(V, R, rngs=nnx.Rngs(0))
    base, anchor = jnp.zeros((2, 3, V), jnp.float32) + jnp.arange(V) / V, jnp.zeros(2, jnp.int32)
    with pytest.raises(TypeError, match=r"got jax_markov.flax.head.MarkovHead \(a module: pass its .head\(\), or "
                                        r"call its .walk\)"):
        jax_markov.walk(base, anchor, head)
    np.testing.assert_array_equal(jax_markov.walk(base, anchor, head.head()).tokens, head.walk(base, anchor).tokens)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_int8_head_refuses_non_finite_w2_rows(bad):
    """markov_quantization="int8" quantizes eagerly: a W2 row that int8 cannot hold is an error naming
    it, when the option is set and when weights are loaded."""
    rng = np.random.default_rng(4)
    w1, w2 = rng.normal(0, 1, (V, R)), rng.normal(0, 1, (V, R))
    w2[[5, 30], 2] = bad
    head = jmf.MarkovHead(V, R, param_dtype=jnp.float32)
    head.load_weights(w1, w2)  # float: fine (its walk sees the NaN/inf as they are)
    with pytest.raises(ValueError, match=r"W2 rows \[5, 30\] hold NaN or infinite values"):
        head.markov_quantization = "int8"
    quantized = jmf.MarkovHead(V, R, param_dtype=jnp.float32, markov_quantization="int8")
    with pytest.raises(ValueError, match=r"W2 rows \[5, 30\]"):
        quantized.load_weights(w1, w2)
    with pytest.raises(ValueError, match=r"W2 rows \[5, 30\]"):
        jmf.load_state_dict(quantized, {"markov_w1.weight": w1, "markov_w2.weight": w2})
    # no stale int8 layout is left behind to walk with
    with pytest.raises(ValueError, match="has no int8 layout"):
        quantized.walk(jnp.zeros((1, 2, V)), jnp.zeros(1, jnp.int32))
    w2[[5, 30], 2] = 0.5
    quantized.load_weights(w1, w2)
    assert quantized.head().scale.shape == (V,)


def test_draft_without_head_at_infinite_temperature_skips_padding_and_masked_columns():
    """The plain drafter chooses as the walk does: at T = +inf uniformly among the columns that are
    neither masked (-inf) nor padding, never a NaN score of -inf * 0."""
    b, k = 4, 3
    base = jnp.asarray(np.random.default_rng(5).normal(0, 1, (b, k, V)), jnp.float32).at[:, :, :20].set(-jnp.inf)
    kw = dict(temperature=jnp.full((b,), jnp.inf), key=jax.random.split(jax.random.key(2), b),
              position=jnp.arange(b) * 3, vocab_size=V - 8)
    tokens, _ = jmf.draft_without_head(base, **kw)
    tokens = np.asarray(tokens)
    assert tokens.min() >= 20 and tokens.max() < V - 8
    zero = jmf.MarkovHead(V, R, param_dtype=jnp.float32)  # zero weights: the walk of the base logits alone
    np.testing.assert_array_equal(tokens, zero.walk(base, jnp.zeros(b, jnp.int32), **kw).tokens)
