"""Loads the compiled custom calls and says which configurations each one supports.

The CPU module is always built; the CUDA module only where nvcc was found. Either may be
missing (a source checkout without a build): then `impl="auto"` uses the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jax_markov_walk"

try:
    from . import _markov_cpu
except ImportError:  # not built
    _markov_cpu = None

try:
    from . import _markov_cuda
except ImportError:  # built without nvcc, or no CUDA runtime on this machine
    _markov_cuda = None

if _markov_cpu is not None:
    jax.ffi.register_ffi_target(TARGET, _markov_cpu.handler(), platform="cpu")
if _markov_cuda is not None:
    jax.ffi.register_ffi_target(TARGET, _markov_cuda.handler(), platform="CUDA")

# The CUDA kernel's envelope (see ffi/cuda/markov_walk.cu).
CUDA_RANK = 256
CUDA_MAX_STEPS = 16
# One launch walks up to 64 B columns: a request each, two (hi and lo parts) where the MMA format
# holds fewer bits than W1 (see `cuda_columns_per_request`). Wider batches walk in chunks of that
# many columns, one launch each.
CUDA_LAUNCH_COLUMNS = 64
CUDA_W2_DTYPES = (np.dtype(np.int8), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# Above this batch the unquantized walk stops winning against the reference's GEMMs
# (benchmarks/results/h200.md of aeb4d5d: the bf16-head kernel against the eager walk is 1.1-1.6x at
# B <= 16, 0.8-1.2x at B = 64 and below 1x beyond), so impl="auto" takes the reference there;
# impl="ffi" still runs the kernel.
CUDA_FLOAT_W2_AUTO_MAX_BATCH = 16
CUDA_MIN_CAPABILITY = (9, 0)
# Where no GPU can be asked (lowering for "cuda" on a CPU-only machine): an H100/H200.
_ASSUMED_GPU = {"sm_count": 132, "smem_per_block": 232448, "l2_bytes": 50 * 2**20, "major": 9, "minor": 0,
                "cooperative": True}


def cpu_available() -> bool:
    return _markov_cpu is not None


def cuda_available() -> bool:
    return _markov_cuda is not None


@functools.cache
def _gpu_properties() -> dict:
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if not gpus or _markov_cuda is None:
        return _ASSUMED_GPU
    return dict(_markov_cuda.device_properties(gpus[0].local_hardware_id))


def cuda_columns_per_request(w1_dtype, w2_dtype) -> int:
    """B columns per request: int8 and fp16 W2 score with fp16 MMAs, which hold bf16/fp16 W1 rows
    (scaled) but need hi + lo parts for fp32; bf16 W2 scores with bf16 MMAs, which need them for
    fp16 and fp32 W1."""
    w1_dtype = np.dtype(w1_dtype)
    if np.dtype(w2_dtype) == np.dtype(jnp.bfloat16):
        return 1 if w1_dtype == np.dtype(jnp.bfloat16) else 2
    return 2 if w1_dtype == np.dtype(np.float32) else 1


def cuda_transposed_launches(batch: int, vocab: int, w1_dtype, *, logits_out: bool = False) -> list[bool]:
    """For each launch of a CUDA walk over int8 W2 (a batch walks in chunks of CUDA_LAUNCH_COLUMNS
    columns): whether it runs the transposed kernel (ffi/cuda/walk_transposed.cuh) rather than
    MarkovWalkKernel on this machine's GPU (an H100/H200 where none can be asked), base logits being
    16-byte aligned as XLA allocates them. Needs the CUDA module, not a GPU."""
    if _markov_cuda is None:
        raise RuntimeError("the jax_markov CUDA module is not built")
    props = _gpu_properties()
    per_launch = CUDA_LAUNCH_COLUMNS // cuda_columns_per_request(w1_dtype, np.int8)
    return [bool(_markov_cuda.launch_takes_transposed(min(per_launch, batch - b0), vocab, np.dtype(w1_dtype).name,
                                                      logits_out, props["sm_count"], props["smem_per_block"]))
            for b0 in range(0, batch, per_launch)]


def cuda_unsupported_reason(batch: int, steps: int, vocab: int, rank: int, w1_dtype, w2_dtype) -> str | None:
    """Why the CUDA kernel cannot run this walk on this machine's GPUs, or None if it can (see
    `cuda_auto_declines` for where impl="auto" prefers the reference although it can)."""
    if _markov_cuda is None:
        return "the jax_markov CUDA module is not built (nvcc was not found at install time)"
    if np.dtype(w2_dtype) not in CUDA_W2_DTYPES:
        return (f"the CUDA kernel walks an int8 (jax_markov.quantize), float16 or bfloat16 W2, "
                f"got {np.dtype(w2_dtype).name}")
    props = _gpu_properties()
    if (props["major"], props["minor"]) < CUDA_MIN_CAPABILITY or props["major"] != 9:
        return f"the CUDA kernel needs an sm_90 GPU, this one is sm_{props['major']}{props['minor']}"
    if not props["cooperative"]:
        return "the GPU does not support cooperative launches"
    if rank != CUDA_RANK:
        return f"the CUDA kernel needs rank r = {CUDA_RANK}, got {rank}"
    if steps > CUDA_MAX_STEPS:
        return f"the CUDA kernel walks at most K = {CUDA_MAX_STEPS} steps, got {steps}"
    per_launch = min(batch, CUDA_LAUNCH_COLUMNS // cuda_columns_per_request(w1_dtype, w2_dtype))
    if per_launch * steps * vocab >= 2**32:
        return (f"the CUDA kernel addresses one launch's base logits in 32 bits: {per_launch} requests x K = {steps} x "
                f"V = {vocab} is not below 2^32")
    if np.dtype(w2_dtype) != np.int8:
        # A float W2 that the chip does not hold streams from L2 and HBM each step, still well
        # ahead of the reference, which reads all of it from HBM each step.
        return None
    columns = min(CUDA_LAUNCH_COLUMNS, batch * cuda_columns_per_request(w1_dtype, w2_dtype))
    n_tiles = 1 << max(0, (columns - 1) // 8).bit_length()  # B fragments: 4 KB per 8 columns
    shared_bytes = props["sm_count"] * (props["smem_per_block"] - 4096 * (n_tiles + 1))
    streamed = vocab * rank - shared_bytes
    if streamed > 0.75 * props["l2_bytes"]:
        return (f"V = {vocab} is too large for this GPU: {streamed / 2**20:.0f} MiB of int8 W2 would not fit in "
                f"shared memory and would not stay in its {props['l2_bytes'] / 2**20:.0f} MiB L2")
    return None


def cuda_auto_declines(batch: int, w2_dtype) -> str | None:
    """Why impl="auto" walks on the reference although the kernel could run, or None. The int8
    kernel was faster than the jitted int8 reference at every measured row; the unquantized one
    only up to CUDA_FLOAT_W2_AUTO_MAX_BATCH requests."""
    if np.dtype(w2_dtype) != np.int8 and batch > CUDA_FLOAT_W2_AUTO_MAX_BATCH:
        return (f"B = {batch} > {CUDA_FLOAT_W2_AUTO_MAX_BATCH} with an unquantized W2: the reference's GEMMs are "
                "faster there (quantize the head to keep the kernel)")
    return None
