"""Qwen3-style building blocks in flax.nnx, with parameters in the PyTorch layout.

Every parameter is stored exactly as the released checkpoints store it (a `Linear` keeps
`weight` as [out, in], an RMSNorm keeps `weight` as [dim]), so a module's flat parameter
path joined with dots *is* its checkpoint name (`layers.0.self_attn.q_proj.weight`).
Activations are float32 whatever the parameter dtype: matmuls read the weights in their own
dtype and accumulate in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


def _normal(rngs: nnx.Rngs | None, shape, std: float, dtype):
    if rngs is None or std == 0.0:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T (+ bias), weight [out_features, in_features] as in torch.nn.Linear."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, std: float = 0.02,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), std, param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else nnx.data(None)

    def __call__(self, x):
        w = self.weight[...]
        y = lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


class Embedding(nnx.Module):
    """Row lookup in weight [num_embeddings, dim] (torch.nn.Embedding); ids are clamped into range."""

    def __init__(self, num_embeddings: int, dim: int, *, std: float = 0.02, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(_normal(rngs, (num_embeddings, dim), std, param_dtype))

    def __call__(self, ids):
        w = self.weight[...]
        return w[jnp.clip(ids, 0, w.shape[0] - 1)].astype(jnp.float32)

    def attend(self, x):
        """x @ weight.T: the tied output head."""
        w = self.weight[...]
        return lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """Qwen3RMSNorm: weight * x / sqrt(mean(x^2) + eps), computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        x = x.astype(jnp.float32)
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * self.weight[...].astype(jnp.float32)


class MLP(nnx.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden: int, intermediate: int, *, std: float, out_std: float, param_dtype,
                 rngs: nnx.Rngs | None):
        self.gate_proj = Linear(hidden, intermediate, std=std, param_dtype=param_dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, std=std, param_dtype=param_dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, std=out_std, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x, positions, theta: float):
    """Rotary embedding (the default HF `rotate_half` form): x * cos + rotate_half(x) * sin, with
    rotate_half(x) = (-x2, x1) for the halves x1, x2 of the last axis. x [B, T, heads, hd], positions
    [B, T]. The halves are an axis of their own (a reshape), and rotate_half flips it and negates the
    first: no concatenate, so that XLA fuses the whole rotation into one elementwise pass (on the GPU
    it leaves concatenates standing alone)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos, sin = jnp.cos(angles)[:, :, None, None, :], jnp.sin(angles)[:, :, None, None, :]
    halves = x.reshape(*x.shape[:-1], 2, hd // 2)  # [B, T, heads, (x1, x2), hd/2]
    rotated = jnp.flip(halves, axis=-2) * jnp.array([-1, 1], x.dtype)[:, None]  # (-x2, x1)
    return (halves * cos + rotated * sin).reshape(x.shape)


def attend(q, segments):
    """Grouped-query attention of q [B, T, H, d] over one or more segments of keys, each a triple
    (k [B, Hkv, S, d], v [B, Hkv, S, d], mask [B, T, S], True = visible): one softmax over all of
    their keys, in float32. Keys and values are laid out heads before positions, as the batched
    products read them, so that a cache is read where it lies rather than copied into another layout
    every forward; segments are scored apart and only their scores are joined, so that no segment's
    keys are copied next to another's. The queries are put in the products' order first ([B, Hkv,
    T * G, d], G = H / Hkv query heads a key head), so that the scores come out [B, Hkv, T * G, S],
    the layout the softmax and the product with the values read: only q and the output, not the
    scores, are transposed.

    Every query row must see at least one key."""
    b, t, h, d = q.shape
    hkv = segments[0][0].shape[1]
    g = h // hkv
    q = jnp.swapaxes(q.reshape(b, t, hkv, g, d), 1, 2).reshape(b, hkv, t * g, d).astype(jnp.float32)
    batched = ((0, 1), (0, 1))
    scores = []
    for k, _, mask in segments:
        part = lax.dot_general(q, k.astype(jnp.float32), (((3,), (3,)), batched)) * (d ** -0.5)
        part = jnp.where(mask[:, None, :, None, :], part.reshape(b, hkv, t, g, -1), -jnp.inf)
        scores.append(part.reshape(b, hkv, t * g, -1))
    weights = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    out, offset = 0.0, 0
    for (_, v, _), part in zip(segments, scores):
        n = part.shape[-1]
        out = out + lax.dot_general(weights[..., offset:offset + n], v.astype(jnp.float32), (((3,), (2,)), batched))
        offset += n
    return jnp.swapaxes(out.reshape(b, hkv, t, g, d), 1, 2).reshape(b, t, h * d)


def heads_first(x):
    """[B, T, Hkv, d] keys or values as `attend` and the caches take them: [B, Hkv, T, d]."""
    return jnp.swapaxes(x, 1, 2)


def layer_buffers(layers: int, shape, dtype) -> tuple:
    """`layers` zero buffers of one shape: a cache's keys or values, a buffer a layer."""
    return tuple(jnp.zeros(shape, dtype) for _ in range(layers))


def write_rows(buffer, rows, start):
    """buffer [B, Hkv, S, d] (one layer's keys or values) with rows [B, T, Hkv, d] written at positions
    start[b] + t of request b (rows past S are dropped): one scatter indexed by request, head and
    position, which XLA does in place (a decode loop's cache is never copied)."""
    b, t, h = rows.shape[:3]
    positions = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
    return buffer.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, None, :], positions[:, :, None]].set(
        rows.astype(buffer.dtype), mode="drop")


class AttentionConfig(NamedTuple):
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool


class Attention(nnx.Module):
    """Qwen3 attention: q/k/v/o projections, per-head q_norm/k_norm, RoPE, grouped KV heads."""

    def __init__(self, cfg: AttentionConfig, *, std: float, out_std: float, param_dtype,
                 rngs: nnx.Rngs | None):
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = float(cfg.rope_theta)
        h, d = cfg.hidden_size, cfg.head_dim
        bias = bool(cfg.attention_bias)
        self.q_proj = Linear(h, self.num_heads * d, bias=bias, std=std, param_dtype=param_dtype, rngs=rngs)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias, std=std, param_dtype=param_dtype, rngs=rngs)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias, std=std, param_dtype=param_dtype, rngs=rngs)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias, std=out_std, param_dtype=param_dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=param_dtype)

    def queries(self, x, positions):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim))
        return rope(q, positions, self.rope_theta)

    def keys_values(self, x, positions):
        """Post-norm, post-RoPE keys and values of x: what a KV cache stores."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return rope(k, positions, self.rope_theta), v

    def output(self, attended):
        return self.o_proj(attended)


class PreNormLayer(nnx.Module):
    """The parameters of a pre-norm decoder layer (attention and MLP, each behind an RMSNorm), named as
    in the released checkpoints; the drafter's and the target's layers differ only in __call__."""

    def __init__(self, cfg, *, param_dtype, rngs):
        std = cfg.initializer_range
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg.attention, std=std, out_std=std, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, std=std, out_std=std, param_dtype=param_dtype,
                       rngs=rngs)
