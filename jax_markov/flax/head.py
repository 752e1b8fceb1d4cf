"""`MarkovHead`: the DSpark low-rank Markov head as a flax.nnx module, walking with `jax_markov.walk`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .. import api
from .. import head as _head

QUANTIZATIONS = (None, "int8", "int8-certified")


class QuantizedWeight(nnx.Variable):
    """A derived, non-trainable layout of a parameter (the int8 W2, its row scales, tiles and residual norms).

    Not an `nnx.Param`: optimizers built with `wrt=nnx.Param` leave it alone, and it is not part
    of the checkpoint (which stores the float W2 under its released name)."""


class MarkovHead(nnx.Module):
    """bias(prev) = logit_scale * markov_w2 @ markov_w1[prev], as in the released DSpark heads.

    Parameters (names and shapes as in the checkpoints, `markov_head.markov_w1.weight` ...):
      markov_w1: [vocab_size, markov_rank], indexed by the previous (target-vocabulary) token;
      markov_w2: [draft_vocab_size, markov_rank], projecting onto the draft vocabulary.

    markov_quantization: None (the walk reads the float W2), "int8" (the walk reads int8 W2 with
    one float32 scale per row, docs/spec.md, and its tiles, see `jax_markov.QuantizedMarkovHead`) or
    "int8-certified" (a `jax_markov.CertifiedMarkovHead` over markov_w2 itself: greedy rows choose
    what the float head chooses, sampled rows and the returned logits are the int8 head's; it adds the
    rows' residual norms, 4 bytes a row, to the int8 layout). The int8 layout is computed once, when
    the option is set or when weights are loaded (`load_weights`, `jax_markov.flax.load_state_dict`), and stored as
    `QuantizedWeight` variables; it is never recomputed per call. If you change `markov_w2` any
    other way (an optimizer step, `nnx.update`), call `refresh_quantization()` afterwards.
    """

    def __init__(self, vocab_size: int, markov_rank: int, *, draft_vocab_size: int | None = None,
                 markov_quantization: str | None = None, logit_scale: float = 1.0, param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None, init_std: float = 0.02, zero_w2: bool = True):
        """rngs=None creates zero weights (to be loaded); otherwise markov_w1 ~ N(0, init_std) and
        markov_w2 is zero (zero_w2=True, as DSpark trains it: the walk starts as the plain drafter)
        or ~ N(0, init_std)."""
        if vocab_size < 1 or markov_rank < 1:
            raise ValueError(f"vocab_size and markov_rank must be >= 1, got {vocab_size} and {markov_rank}")
        draft_vocab_size = vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        self.logit_scale = float(logit_scale)
        if rngs is None:
            w1 = jnp.zeros((vocab_size, markov_rank), param_dtype)
            w2 = jnp.zeros((draft_vocab_size, markov_rank), param_dtype)
        else:
            w1 = (jax.random.normal(rngs.params(), (vocab_size, markov_rank)) * init_std).astype(param_dtype)
            w2 = jnp.zeros((draft_vocab_size, markov_rank), param_dtype) if zero_w2 else \
                (jax.random.normal(rngs.params(), (draft_vocab_size, markov_rank)) * init_std).astype(param_dtype)
        self.markov_w1 = nnx.Param(w1)
        self.markov_w2 = nnx.Param(w2)
        self.markov_w2_int8 = nnx.data(None)
        self.markov_w2_scale = nnx.data(None)
        self.markov_w2_tiles = nnx.data(None)
        self.markov_w2_residual_norm = nnx.data(None)
        self._quantization = None
        self.markov_quantization = markov_quantization

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.markov_w1.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.markov_w2.shape[0]

    @property
    def markov_rank(self) -> int:
        return self.markov_w1.shape[1]

    # -- quantization --------------------------------------------------------------------------
    @property
    def markov_quantization(self) -> str | None:
        return self._quantization

    @markov_quantization.setter
    def markov_quantization(self, value: str | None):
        if value not in QUANTIZATIONS:
            raise ValueError(f"markov_quantization must be one of {QUANTIZATIONS}, got {value!r}")
        self._quantization = value
        self.refresh_quantization()

    def refresh_quantization(self):
        """(Re)build the int8 layout from the current markov_w2 (a no-op without quantization). Where
        markov_w2 holds NaN or infinite values, `quantize` raises and the head is left without an int8
        layout (never a stale one): `head()` refuses until markov_w2 is fixed and this is called again."""
        self.markov_w2_int8 = None
        self.markov_w2_scale = None
        self.markov_w2_tiles = None
        self.markov_w2_residual_norm = None
        float_head = _head.MarkovHead(self.markov_w1[...], self.markov_w2[...])
        if self._quantization == "int8":
            quantized = _head.quantize(float_head)
        elif self._quantization == "int8-certified":
            certified = _head.quantize(float_head, certified=True)
            quantized = certified.quantized
            self.markov_w2_residual_norm = QuantizedWeight(certified.residual_norm)
        else:
            return
        self.markov_w2_int8 = QuantizedWeight(quantized.q)
        self.markov_w2_scale = QuantizedWeight(quantized.scale)
        if quantized.tiles is not None:
            self.markov_w2_tiles = QuantizedWeight(quantized.tiles)

    def after_load(self):
        """Called by the checkpoint loader once new weights are in."""
        self.refresh_quantization()

    def load_weights(self, markov_w1, markov_w2):
        """Replace both factors (shapes must match; values are cast to the parameter dtype)."""
        for name, var, value in (("markov_w1", self.markov_w1, markov_w1), ("markov_w2", self.markov_w2, markov_w2)):
            value = jnp.asarray(value)
            if value.shape != var.shape:
                raise ValueError(f"{name} must have shape {list(var.shape)}, got {list(value.shape)}")
            var[...] = value.astype(var.dtype)
        self.after_load()

    def fit(self, bias_matrix):
        """Set the factors to the best rank-r approximation of a wanted bias matrix
        [vocab_size, draft_vocab_size] (row: previous token, column: next token), by truncated SVD:
        markov_w1 = U_r sqrt(S_r), markov_w2 = V_r sqrt(S_r) / logit_scale. Returns the relative
        Frobenius error of the fit."""
        m = jnp.asarray(bias_matrix, jnp.float32)
        if m.shape != (self.vocab_size, self.draft_vocab_size):
            raise ValueError(f"bias_matrix must be [{self.vocab_size}, {self.draft_vocab_size}], got {list(m.shape)}")
        u, s, vt = jnp.linalg.svd(m, full_matrices=False)
        r = min(self.markov_rank, s.shape[0])
        root = jnp.sqrt(s[:r])
        w1 = jnp.zeros((self.vocab_size, self.markov_rank), jnp.float32).at[:, :r].set(u[:, :r] * root)
        w2 = jnp.zeros((self.draft_vocab_size, self.markov_rank), jnp.float32).at[:, :r].set(vt[:r].T * root)
        self.load_weights(w1, w2 / self.logit_scale)
        w1, w2 = self.markov_w1[...].astype(jnp.float32), self.markov_w2[...].astype(jnp.float32)
        approx = (w1 @ w2.T) * self.logit_scale
        return float(jnp.linalg.norm(approx - m) / jnp.maximum(jnp.linalg.norm(m), 1e-30))

    # -- the head as jax_markov pytrees ------------------------------------------------------------
    def head(self) -> _head.MarkovHead | _head.QuantizedMarkovHead | _head.CertifiedMarkovHead:
        """The head `jax_markov.walk` takes: float, int8 or certified int8, as markov_quantization says."""
        if self._quantization is None:
            return _head.MarkovHead(self.markov_w1[...], self.markov_w2[...])
        if self.markov_w2_int8 is None:
            raise ValueError(f"markov_quantization is {self._quantization!r} but the head has no int8 layout: quantizing "
                             "markov_w2 failed (see the error it raised); fix markov_w2 and call refresh_quantization()")
        tiles = None if self.markov_w2_tiles is None else self.markov_w2_tiles[...]
        quantized = _head.QuantizedMarkovHead(self.markov_w1[...], self.markov_w2_int8[...], self.markov_w2_scale[...], tiles)
        if self._quantization == "int8":
            return quantized
        return _head.CertifiedMarkovHead(quantized, self.markov_w2[...], self.markov_w2_residual_norm[...])

    def embed(self, prev):
        """markov_w1[prev] (ids clamped into range), the confidence head's Markov input."""
        w1 = self.markov_w1[...]
        return w1[jnp.clip(prev, 0, w1.shape[0] - 1)]

    def bias(self, prev):
        """Teacher-forced bias [..., draft_vocab] in float32 from the float weights (differentiable):
        logit_scale * markov_w2 @ markov_w1[prev]. For training; drafting uses `walk`."""
        e = self.embed(prev).astype(jnp.float32)
        return self.logit_scale * jnp.einsum("...r,vr->...v", e, self.markov_w2[...].astype(jnp.float32),
                                             precision=jax.lax.Precision.HIGHEST)

    def walk(self, base_logits, anchor, *, temperature=None, key=None, position=None, vocab_size=None,
             d2t=None, return_logits=False, logits_dtype=jnp.float32, return_embeds=False, impl="auto",
             logit_scale=None):
        """Draft K tokens per request with this head: `jax_markov.walk(base_logits, anchor, self.head(), ...)`.

        Every argument is as in `jax_markov.walk` (docs/spec.md); logit_scale defaults to the head's own."""
        return api.walk(base_logits, anchor, self.head(), temperature=temperature, key=key, position=position,
                        vocab_size=vocab_size,
                        logit_scale=self.logit_scale if logit_scale is None else logit_scale, d2t=d2t,
                        return_logits=return_logits, logits_dtype=logits_dtype, return_embeds=return_embeds,
                        impl=impl)

    __call__ = walk
