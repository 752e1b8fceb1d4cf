"""`DSparkDrafter`: a DFlash-shaped block drafter followed by the DSpark Markov walk.

The block is [anchor, mask x (K-1)] at positions p .. p+K-1 (p = the anchor's position). A few
Qwen3-style layers read it; their keys and values are the block's own plus a context made of the
target's hidden states (the layers `target_layer_ids`, concatenated, projected by `fc` and
normalised by `hidden_norm`) at positions < p, and the block attends to itself without a causal
mask. The target's input embedding and LM head are shared. Row k of the block predicts the token
at position p + k + 1 (draft token k); the Markov walk then chooses the K tokens left to right.

The context is kept in a per-request cache of keys and values (`DraftContext`), extended with the
target's features of every newly committed position, exactly as the target's own KV cache.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..arguments import request_keys, request_positions
from ..philox import gumbel_noise_range
from ..reference import gumbel_max_score, spec_argmax
from . import checkpoint
from .head import MarkovHead
from .layers import AttentionConfig, Linear, PreNormLayer, RMSNorm, attend, heads_first, layer_buffers, write_rows

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """The drafter's sizes; keys as in the released DFlash / DSpark configs (config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    attention_bias: bool = False
    hidden_act: str = "silu"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    initializer_range: float = 0.02
    dtype: str = "float32"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.draft_vocab_size is None:
            set_("draft_vocab_size", self.vocab_size)
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if self.markov_rank < 0:
            problems.append(f"markov_rank must be >= 0 (0: no Markov head), got {self.markov_rank}")
        if self.markov_rank > 0 and str(self.markov_head_type).lower() != "vanilla":
            problems.append(f"markov_head_type {self.markov_head_type!r} is not supported: jax_markov.walk "
                            f"implements the 'vanilla' head (bias = W2 @ W1[prev])")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id must be in [0, vocab_size = {self.vocab_size}), got {self.mask_token_id}")
        ids = self.target_layer_ids
        if not ids:
            problems.append("target_layer_ids must not be empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            problems.append(f"target_layer_ids must be strictly increasing, got {list(ids)}")
        upper = None if self.num_target_layers is None else self.num_target_layers - 1
        if any(i < -1 or (upper is not None and i > upper) for i in ids):
            top = upper if upper is not None else "num_target_layers-1"
            problems.append(f"target_layer_ids must lie in [-1, {top}] (-1 = the embedding output), got {list(ids)}")
        if self.draft_vocab_size != self.vocab_size:
            problems.append(f"draft_vocab_size ({self.draft_vocab_size}) != vocab_size ({self.vocab_size}): the "
                            f"DSparkDrafter drafts over the full target vocabulary (MarkovHead.walk takes d2t)")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.enable_confidence_head is False and self.confidence_head_with_markov:
            set_("confidence_head_with_markov", False)
        if self.confidence_head_with_markov and self.markov_rank == 0:
            problems.append("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if problems:
            raise ValueError("invalid DSparkConfig: " + "; ".join(problems))

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                               self.rms_norm_eps, self.rope_theta, self.attention_bias)

    @property
    def param_dtype(self):
        return _DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, config: Mapping) -> DSparkConfig:
        """From a released config (config.json as a dict). Entries of a nested `dflash_config` /
        `dspark_config` take precedence over top-level ones; keys that do not size the drafter
        (architectures, model_type, ...) are ignored."""
        flat = dict(config)
        for nested in ("dflash_config", "dspark_config"):
            flat.update(dict(flat.pop(nested, None) or {}))
        rope = dict(flat.get("rope_parameters") or flat.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            kind = rope.get("rope_type", rope.get("type"))
            raise ValueError(f"rope type {kind!r} is not supported (default RoPE only)")
        if "rope_theta" not in flat and "rope_theta" in rope:
            flat["rope_theta"] = rope["rope_theta"]
        layer_types = flat.get("layer_types") or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types {list(layer_types)}: only full_attention drafter layers are supported")
        for k in ("torch_dtype", "dtype"):
            if isinstance(flat.get(k), str):
                flat["dtype"] = flat[k]
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "mask_token_id", "target_layer_ids") if flat.get(n) is None]
        if missing:
            raise ValueError(f"the drafter config lacks {missing}")
        return cls(**{k: v for k, v in flat.items() if k in names and v is not None})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> DSparkConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["architectures"] = ["DSparkDrafter"]
        return d


class DraftContext(NamedTuple):
    """The drafter's context cache: per layer, the keys and values of the projected target features."""

    k: tuple[jax.Array, ...]  # L x [B, Hkv, S, d]: a buffer a layer, laid out as the target's KVCache
    v: tuple[jax.Array, ...]  # L x [B, Hkv, S, d]


class Draft(NamedTuple):
    tokens: jax.Array  # [B, K] int32
    logits: jax.Array | None  # [B, K, V] the distribution each token was drawn from (before temperature)
    confidence: jax.Array | None  # [B, K] float32 confidence-head logits
    hidden: jax.Array  # [B, K, H] the backbone's output


class DraftLayer(PreNormLayer):
    def __call__(self, x, positions, ctx_k, ctx_v, ctx_visible):
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        b, t = x.shape[:2]
        context = (ctx_k, ctx_v, jnp.broadcast_to(ctx_visible[:, None, :], (b, t, ctx_k.shape[2])))
        block = (heads_first(k), heads_first(v), jnp.ones((b, t, t), bool))
        x = x + self.self_attn.output(attend(q, [context, block]))
        return x + self.mlp(self.post_attention_layernorm(x))


class ConfidenceHead(nnx.Module):
    """DSpark's acceptance predictor: a logit from [hidden, markov_w1[prev]] (`confidence_head.proj`)."""

    def __init__(self, input_dim: int, *, param_dtype, rngs):
        self.proj = Linear(input_dim, 1, bias=True, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, features):
        return self.proj(features)[..., 0]


class DSparkDrafter(nnx.Module):
    """DFlash block drafter + DSpark Markov head (parameter names as in the released checkpoints)."""

    def __init__(self, config: DSparkConfig | Mapping, *, rngs: nnx.Rngs | None = None, param_dtype=None,
                 markov_quantization: str | None = None):
        if not isinstance(config, DSparkConfig):
            config = DSparkConfig.from_dict(config)
        self.config = config
        dtype = config.param_dtype if param_dtype is None else param_dtype
        h = config.hidden_size
        self.fc = Linear(len(config.target_layer_ids) * h, h, std=config.initializer_range, param_dtype=dtype,
                         rngs=rngs)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps, param_dtype=dtype)
        self.layers = nnx.List([DraftLayer(config, param_dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, eps=config.rms_norm_eps, param_dtype=dtype)
        if config.markov_rank > 0:
            self.markov_head = MarkovHead(config.vocab_size, config.markov_rank,
                                          draft_vocab_size=config.draft_vocab_size,
                                          markov_quantization=markov_quantization, param_dtype=dtype, rngs=rngs,
                                          init_std=config.initializer_range)
        else:
            if markov_quantization is not None:
                raise ValueError("markov_quantization needs a Markov head (markov_rank > 0)")
            self.markov_head = nnx.data(None)
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(h + extra, param_dtype=dtype, rngs=rngs)
        else:
            self.confidence_head = nnx.data(None)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    # -- the context cache ---------------------------------------------------------------------
    def init_context(self, batch_size: int, max_length: int) -> DraftContext:
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_length, c.head_dim)
        return DraftContext(layer_buffers(c.num_hidden_layers, shape, jnp.float32),
                            layer_buffers(c.num_hidden_layers, shape, jnp.float32))

    def extend_context(self, features, start, context: DraftContext) -> DraftContext:
        """Write the keys/values of target features [B, T, len(target_layer_ids) * H] for positions
        start[b] .. start[b]+T-1 into the context cache."""
        want = len(self.config.target_layer_ids) * self.config.hidden_size
        if features.shape[-1] != want:
            raise ValueError(f"features must be [B, T, {want}] (target_layer_ids {list(self.target_layer_ids)} x "
                             f"hidden {self.config.hidden_size}), got {list(features.shape)}")
        start = jnp.asarray(start, jnp.int32)
        positions = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
        ctx = self.hidden_norm(self.fc(features))
        kv = [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]
        return DraftContext(tuple(write_rows(buffer, k, start) for buffer, (k, _) in zip(context.k, kv)),
                            tuple(write_rows(buffer, v, start) for buffer, (_, v) in zip(context.v, kv)))

    # -- the block ----------------------------------------------------------------------------
    def hidden(self, anchor, anchor_position, context: DraftContext, *, embed):
        """The backbone on [anchor, mask x (K-1)] at positions p .. p+K-1, seeing the context at
        positions < p. Returns the normalised hidden states [B, K, H]."""
        anchor = jnp.asarray(anchor, jnp.int32)
        p = jnp.asarray(anchor_position, jnp.int32)
        b, k = anchor.shape[0], self.config.block_size
        ids = jnp.concatenate([anchor[:, None], jnp.full((b, k - 1), self.config.mask_token_id, jnp.int32)], axis=1)
        x = embed(ids).astype(jnp.float32) * self.config.input_embedding_scale
        positions = p[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
        visible = jnp.arange(context.k[0].shape[2], dtype=jnp.int32)[None, :] < p[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, context.k[i], context.v[i], visible)
        return self.norm(x)

    def base_logits(self, hidden, *, unembed):
        """The block drafter's logits [B, K, V] from the shared LM head (DFlash's output multiplier
        and soft-capping when the config sets them)."""
        logits = unembed(hidden).astype(jnp.float32)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def confidence(self, hidden, markov_embeds=None):
        """Confidence-head logits [B, K] (float32), or None when the config has no confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden.astype(jnp.float32)
        if self.config.confidence_head_with_markov:
            if markov_embeds is None:
                raise ValueError("this confidence head reads markov_w1[prev]: pass the walk's embeds")
            features = jnp.concatenate([features, markov_embeds.astype(jnp.float32)], axis=-1)
        return self.confidence_head(features)

    def draft(self, anchor, anchor_position, context: DraftContext, *, embed, unembed, temperature=None, key=None,
              use_markov_head: bool = True, return_logits: bool = False, logits_dtype=jnp.float32,
              vocab_size: int | None = None, impl: str = "auto", return_confidence: bool = False) -> Draft:
        """Draft K = block_size tokens after each anchor.

        anchor [B]: the last committed token; anchor_position [B]: its position p, so the walk's
        `position` (the first draft token's) is p + 1. temperature/key as in `jax_markov.walk`.
        use_markov_head=False drafts from the base logits alone (the plain DFlash drafter), with the
        same noise as the walk (docs/spec.md), so greedy and seeded runs stay comparable.
        """
        hidden = self.hidden(anchor, anchor_position, context, embed=embed)
        base = self.base_logits(hidden, unembed=unembed)
        position = jnp.asarray(anchor_position, jnp.int32) + 1
        want_embeds = return_confidence and self.config.confidence_head_with_markov
        if use_markov_head and self.markov_head is None:
            raise ValueError("this drafter has no Markov head (markov_rank = 0); pass use_markov_head=False")
        if use_markov_head:
            with jax.named_scope("walk"):  # the walk's part of a profile (jax_markov.speculative.STEP_SCOPES)
                result = self.markov_head.walk(
                    base, anchor, temperature=temperature, key=key,
                    position=None if temperature is None else position, vocab_size=vocab_size,
                    return_logits=return_logits, logits_dtype=logits_dtype, return_embeds=want_embeds, impl=impl)
            tokens, logits, embeds = result
        else:
            with jax.named_scope("walk"):
                tokens, logits = draft_without_head(base, temperature=temperature, key=key, position=position,
                                                    vocab_size=vocab_size, logits_dtype=logits_dtype)
            logits = logits if return_logits else None
            embeds = None
            if want_embeds:
                prev = jnp.concatenate([jnp.asarray(anchor, jnp.int32)[:, None], tokens[:, :-1]], axis=1)
                embeds = self.markov_head.embed(prev)
        conf = self.confidence(hidden, embeds) if return_confidence else None
        return Draft(tokens, logits, conf, hidden)

    # -- checkpoints ---------------------------------------------------------------------------
    def load_state_dict(self, tensors: Mapping[str, object], *, strict: bool = True, prefix: str = ""):
        """Load a released-format state dict. The target's embedding and LM head, which a drafter
        checkpoint may carry (`embed_tokens.weight`, `lm_head.weight`), are shape-checked and skipped:
        the drafter uses its target's. Returns a `LoadReport`; raises `CheckpointError` on a missing,
        unexpected or misshaped tensor."""
        c = self.config
        shared = {"embed_tokens.weight": (c.vocab_size, c.hidden_size),
                  "lm_head.weight": (c.vocab_size, c.hidden_size)}
        return checkpoint.load_state_dict(self, tensors, prefix=prefix, strict=strict, shared=shared,
                                          what=f"DSparkDrafter({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                                               f"markov_rank {c.markov_rank})")

    def load_safetensors(self, path, **kwargs):
        return self.load_state_dict(checkpoint.read_safetensors(path), **kwargs)

    def state_dict(self, dtype=None) -> dict[str, jax.Array]:
        return checkpoint.state_dict(self, dtype=dtype)

    def save_pretrained(self, directory: str | os.PathLike, *, dtype=None):
        """config.json + model.safetensors, in the released layout."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        checkpoint.save_safetensors(self, os.path.join(directory, "model.safetensors"), dtype=dtype)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, param_dtype=None, markov_quantization=None,
                        strict: bool = True) -> DSparkDrafter:
        """A drafter from a directory holding config.json and safetensors weights (sharded or not)."""
        config = DSparkConfig.from_json(os.path.join(directory, "config.json"))
        drafter = cls(config, rngs=None, param_dtype=param_dtype, markov_quantization=markov_quantization)
        drafter.load_safetensors(directory, strict=strict)
        return drafter


def draft_without_head(base_logits, *, temperature=None, key=None, position=None, vocab_size=None,
                       logits_dtype=jnp.float32):
    """Tokens [B, K] from base logits alone, choosing as the walk does (docs/spec.md: greedy = lowest
    argmax, sampled = Gumbel-max with the draft stream's noise at position + k). Returns
    (tokens, logits rounded to logits_dtype)."""
    b, k, v = base_logits.shape
    logits = base_logits.astype(jnp.float32)
    if vocab_size is not None and vocab_size < v:
        logits = jnp.where(jnp.arange(v) < vocab_size, logits, -jnp.inf)
    logits = logits.astype(logits_dtype).astype(jnp.float32)
    score = logits
    if temperature is not None:
        t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
        words = request_keys(key, b)
        sampled = t > 0
        inv_t = jnp.where(sampled, 1.0 / jnp.where(sampled, t, 1.0), 0.0)
        pos = request_positions(position, b)
        noise = gumbel_noise_range((words[:, 0, None], words[:, 1, None]), 0, v, pos[:, None] + jnp.arange(k))
        score = jnp.where(sampled[:, None, None], gumbel_max_score(logits, inv_t[:, None, None], noise), logits)
    return spec_argmax(score), logits.astype(logits_dtype)
