"""The walk's result type."""
from __future__ import annotations

from typing import NamedTuple

import jax


class WalkResult(NamedTuple):
    tokens: jax.Array  # [B, K] int32 draft tokens (target ids when d2t is given)
    logits: jax.Array | None  # [B, K, V] l_k before temperature, -inf on padding; None unless asked for
    embeds: jax.Array | None  # [B, K, r] W1[prev_k]; None unless asked for


def to_result(outputs, params) -> WalkResult:
    tokens, logits, embeds = outputs
    return WalkResult(tokens, logits if params.return_logits else None,
                      embeds if params.return_embeds else None)
