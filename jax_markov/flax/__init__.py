"""flax.nnx modules for DSpark drafting with `jax_markov.walk`.

- `MarkovHead`: the low-rank Markov head (`markov_w1`, `markov_w2`, [V, r]), optionally int8, with a
  `walk` method that calls `jax_markov.walk`.
- `DSparkDrafter` / `DSparkConfig`: a DFlash-shaped block drafter followed by the Markov walk,
  sized by a released-style config and loaded from released-style state dicts / safetensors.
- `CausalLM` / `CausalLMConfig`: a small Qwen3-style target model with a KV cache, implementing
  the target protocol that `jax_markov.speculative` drives.
- `load_state_dict`, `read_safetensors`, `load_safetensors`, `save_safetensors`, `state_dict`:
  checkpoints under the released tensor names (`markov_head.markov_w1.weight`, ...).

Needs the `flax` extra: `pip install jax-markov[flax]`.
"""
from .checkpoint import (CheckpointError, LoadReport, load_safetensors, load_state_dict, parameters,
                         read_safetensors, save_safetensors, state_dict)
from .drafter import Draft, DraftContext, DSparkConfig, DSparkDrafter, draft_without_head
from .head import MarkovHead, QuantizedWeight
from .target import CausalLM, CausalLMConfig, KVCache, TargetOutput, bigram_lm

__all__ = [
    "CausalLM", "CausalLMConfig", "CheckpointError", "DSparkConfig", "DSparkDrafter", "Draft", "DraftContext",
    "KVCache", "LoadReport", "bigram_lm", "MarkovHead", "QuantizedWeight", "TargetOutput", "draft_without_head",
    "load_safetensors", "load_state_dict", "parameters", "read_safetensors", "save_safetensors", "state_dict",
]
