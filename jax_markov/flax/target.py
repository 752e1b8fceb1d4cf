"""A small Qwen3-style causal language model with a per-request KV cache: the target model of the
tests and the example, and the reference implementation of the target protocol that
`jax_markov.speculative` drives.

The target protocol (what `jax_markov.speculative` needs from a target model):

- `init_cache(batch_size, max_length)` -> any pytree: an empty cache for `max_length` positions.
- `__call__(tokens [B, T], start [B], cache, *, feature_layers=())` -> `TargetOutput`:
  the tokens sit at positions `start[b] + t`; entries for positions < start[b] are read from the
  cache (they hold the committed prefix), entries for positions start[b] .. start[b]+T-1 are
  written. Logits row t predicts the token at position start[b] + t + 1. `features` is the
  concatenation over `feature_layers` of the hidden states (layer id i: the output of decoder
  layer i; -1: the embedding output), the drafter's context.
- `embed(ids)` -> [.., H] float32 input embeddings and `unembed(hidden)` -> [.., V] float32
  logits (the LM head): the DFlash / DSpark drafter shares both with its target.

Stale cache entries at positions >= start[b] + T are never read (the mask is key position <=
query position), so a speculative step can write a whole block and simply overwrite the
rejected part at the next step.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import AttentionConfig, Embedding, Linear, PreNormLayer, RMSNorm, attend, layer_buffers, write_rows


class KVCache(NamedTuple):
    """Per layer, a buffer of its own (a layer's attention reads its buffer where it lies; a stacked
    [L, ...] cache costs a copy of every layer's slice per forward), heads before positions, as the
    batched products of attention read them."""

    k: tuple[jax.Array, ...]  # L x [B, Hkv, S, d]
    v: tuple[jax.Array, ...]  # L x [B, Hkv, S, d]


class TargetOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    features: jax.Array | None  # [B, T, len(feature_layers) * H] float32, None when no layer is asked for
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class CausalLMConfig:
    """Sizes of a Qwen3-style decoder (keys as in a Hugging Face Qwen3 config.json)."""

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                               self.rms_norm_eps, self.rope_theta, self.attention_bias)


class DecoderLayer(PreNormLayer):
    def __call__(self, x, positions, k_cache, v_cache, start):
        """The layer's output, and its key and value buffers [B, Hkv, S, d] with x's written in."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        k_cache, v_cache = write_rows(k_cache, k, start), write_rows(v_cache, v, start)
        key_pos = jnp.arange(k_cache.shape[2], dtype=jnp.int32)
        mask = key_pos[None, None, :] <= positions[:, :, None]
        x = x + self.self_attn.output(attend(q, [(k_cache, v_cache, mask)]))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


class Backbone(nnx.Module):
    def __init__(self, cfg: CausalLMConfig, *, param_dtype, rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, std=1.0, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)


class CausalLM(nnx.Module):
    """A Qwen3-style causal LM (parameter names as Qwen3ForCausalLM: `model.layers.0...`, `lm_head.weight`).
    Its KV cache holds `cache_dtype` (default: the parameters' dtype), a [B, Hkv, S, d] buffer per layer
    (`KVCache`); attention computes in float32."""

    def __init__(self, config: CausalLMConfig, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 cache_dtype=None):
        self.config = config
        self.cache_dtype = jnp.dtype(param_dtype if cache_dtype is None else cache_dtype)
        self.model = Backbone(config, param_dtype=param_dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, std=config.initializer_range,
                                  param_dtype=param_dtype, rngs=rngs)

    # -- the target protocol -------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_length, c.head_dim)
        return KVCache(layer_buffers(c.num_hidden_layers, shape, self.cache_dtype),
                       layer_buffers(c.num_hidden_layers, shape, self.cache_dtype))

    def embed(self, ids):
        return self.model.embed_tokens(ids)

    def unembed(self, hidden):
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def __call__(self, tokens, start, cache: KVCache, *, feature_layers=()) -> TargetOutput:
        tokens = jnp.asarray(tokens, jnp.int32)
        start = jnp.asarray(start, jnp.int32)
        num_layers = self.config.num_hidden_layers
        for layer_id in feature_layers:
            if not -1 <= layer_id < num_layers:
                raise ValueError(f"feature layer {layer_id} is out of range [-1, {num_layers - 1}] "
                                 f"(-1 is the embedding output)")
        b, t = tokens.shape
        if cache.k[0].shape[0] != b:
            raise ValueError(f"the cache holds {cache.k[0].shape[0]} requests, tokens hold {b}")
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        x = self.embed(tokens)
        hidden = {-1: x}
        ks, vs = [], []
        for i, layer in enumerate(self.model.layers):
            x, k_cache, v_cache = layer(x, positions, cache.k[i], cache.v[i], start)
            ks.append(k_cache)
            vs.append(v_cache)
            hidden[i] = x
        logits = self.unembed(self.model.norm(x))
        features = jnp.concatenate([hidden[i] for i in feature_layers], axis=-1) if feature_layers else None
        return TargetOutput(logits, features, KVCache(tuple(ks), tuple(vs)))


def bigram_lm(config: CausalLMConfig, *, rank: int, sharpness: float = 4.0, context_scale: float = 0.05,
              silent_tokens=(), rngs: nnx.Rngs, param_dtype=jnp.float32) -> CausalLM:
    """A CausalLM whose next-token logits have a real low-rank bigram structure.

    The embedding of token v is [A[v], noise] (unit RMS) and the LM head is [C, 0], so through the
    residual stream the logits of the next token are about A[v] . C[u] (rank `rank`, scale
    `sharpness`), plus what the decoder layers add from the context (their output projections are
    rescaled to std context_scale / sqrt(fan_in), so each layer adds about context_scale times a
    unit-RMS perturbation; 0 gives a pure bigram model). Tokens in `silent_tokens` (a drafter's
    mask token, say) get no bigram signal. Used by the tests and the example."""
    if not 1 <= rank < config.hidden_size:
        raise ValueError(f"rank must be in [1, hidden_size = {config.hidden_size}), got {rank}")
    model = CausalLM(config, rngs=rngs, param_dtype=param_dtype)
    v, h = config.vocab_size, config.hidden_size
    a = jax.random.normal(rngs.params(), (v, rank))
    c = jax.random.normal(rngs.params(), (v, rank)) * (sharpness / rank ** 0.5)
    noise = jax.random.normal(rngs.params(), (v, h - rank))
    a = a.at[jnp.asarray(silent_tokens, jnp.int32)].set(0.0) if len(silent_tokens) else a
    emb = jnp.concatenate([a, noise], axis=1)
    emb = emb / jnp.sqrt(jnp.mean(emb * emb, axis=1, keepdims=True))
    model.model.embed_tokens.weight[...] = emb.astype(param_dtype)
    head = jnp.concatenate([c, jnp.zeros((v, h - rank))], axis=1).astype(param_dtype)
    if model.lm_head is None:
        raise ValueError("bigram_lm needs an untied LM head (tie_word_embeddings=False)")
    model.lm_head.weight[...] = head
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            std = context_scale / proj.in_features ** 0.5
            proj.weight[...] = (proj.weight[...].astype(jnp.float32) * (std / config.initializer_range)
                                ).astype(param_dtype)
    return model
