"""jax_markov: the DSpark Markov walk for JAX, fused into one custom call on CPU and on Hopper GPUs."""
from . import reference
from .api import walk
from .head import CertifiedMarkovHead, MarkovHead, QuantizedMarkovHead, quantize
from .result import WalkResult

__all__ = ["CertifiedMarkovHead", "MarkovHead", "QuantizedMarkovHead", "WalkResult", "quantize", "reference", "walk"]
__version__ = "0.1.0"
