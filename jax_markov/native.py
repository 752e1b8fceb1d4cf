"""Loads the compiled modules and asks them which configurations each custom call supports.

- `_markov_cpu`: the CPU custom call (always built).
- `_markov_plan`: the CUDA walk's envelope and launch plan (ffi/plan/; host C++, always built): which
  kernel walks a call, on how much shared memory, or why none can. Python keeps no copy of those
  limits and decisions: it asks this module.
- `_markov_cuda`: the CUDA custom call, built only where nvcc was found.
Any may be missing (a source checkout without a build): then `impl="auto"` uses the reference.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

TARGET = "jax_markov_walk"

try:
    from . import _markov_cpu
except ImportError:  # not built
    _markov_cpu = None

try:
    from . import _markov_plan
except ImportError:  # not built
    _markov_plan = None

try:
    from . import _markov_cuda
except ImportError:  # built without nvcc, or no CUDA runtime on this machine
    _markov_cuda = None

if _markov_cpu is not None:
    jax.ffi.register_ffi_target(TARGET, _markov_cpu.handler(), platform="cpu")
if _markov_cuda is not None:
    jax.ffi.register_ffi_target(TARGET, _markov_cuda.handler(), platform="CUDA")

# impl="auto" policy: above this batch the unquantized walk stops winning against the reference's
# GEMMs (benchmarks/results/h200.md: the bf16-head kernel against the eager walk is 1.1-1.6x at
# B <= 16, 0.8-1.2x at B = 64 and below 1x beyond), so impl="auto" takes the reference there;
# impl="ffi" still runs the kernel.
CUDA_FLOAT_W2_AUTO_MAX_BATCH = 16
# Where no GPU can be asked (lowering for "cuda" on a CPU-only machine): an H100/H200.
ASSUMED_GPU = {"sm_count": 132, "smem_per_block": 232448, "l2_bytes": 50 * 2**20, "major": 9, "minor": 0,
               "cooperative": True}


def cpu_available() -> bool:
    return _markov_cpu is not None


def cuda_available() -> bool:
    return _markov_cuda is not None


def plan_available() -> bool:
    return _markov_plan is not None


def _plan_module():
    if _markov_plan is None:
        raise RuntimeError("the jax_markov plan module is not built; reinstall the package (pip install .)")
    return _markov_plan


@functools.cache
def cuda_envelope() -> dict:
    """The CUDA walk's fixed limits (ffi/common/walk_config.h): rank, max_steps, launch_columns (B
    columns a launch), w2_dtypes."""
    return dict(_plan_module().envelope())


def _cuda_devices() -> list:
    try:
        return jax.devices("cuda")
    except RuntimeError:  # no CUDA backend on this machine
        return []


def cuda_gpu_available() -> bool:
    """Whether the CUDA custom call can run here: the module is built and JAX sees a CUDA GPU."""
    return _markov_cuda is not None and bool(_cuda_devices())


@functools.cache
def _gpu_properties() -> dict:
    if not cuda_gpu_available():
        return ASSUMED_GPU
    return dict(_markov_cuda.device_properties(_cuda_devices()[0].local_hardware_id))


def _name(dtype) -> str:
    return np.dtype(dtype).name


def cuda_columns_per_request(w1_dtype, w2_dtype) -> int:
    """B columns a request takes: one, or two (hi + lo parts) where the MMA's format holds fewer bits
    than W1 (fp16 MMAs for int8 and fp16 W2 split an fp32 W1; bf16 MMAs split fp32 and fp16 W1)."""
    return _plan_module().columns_per_request(_name(w2_dtype), _name(w1_dtype))


@functools.cache
def w2_tile_layout() -> tuple[int, np.ndarray]:
    """W2 stored tile by tile (QuantizedMarkovHead.tiles, ffi/plan/walk_plan.h's W2TileOrder): the rows
    of a tile, and for each byte of a stored tile the index of its byte in the tile's rows of W2 taken
    row-major (int32 [rows x r], a permutation). Needs no GPU."""
    layout = _plan_module().w2_tile_layout()
    order = np.asarray(layout["order"], np.int32)
    order.setflags(write=False)
    return int(layout["rows"]), order


def cuda_launch_plan(batch: int, steps: int, vocab: int, rank: int, w1_dtype, w2_dtype, *, base_dtype=np.float32,
                     logits_dtype=None, sampling: bool = False, props: dict | None = None,
                     certified: bool = False, w2_tiles: bool = False) -> list[dict]:
    """The launches of a CUDA walk (ffi/plan/walk_plan.h) on this machine's GPU (an H100/H200 where none
    can be asked, or `props`): per launch its kernel, requests, threads, shared memory and resident W2
    tiles, whether its rows may sample, and when it walks ("run_when": "always", or for a sampled call
    whose greedy launch is another kernel, the guarded pair "no_row_samples" / "some_row_samples", and
    for a certified head's sampled call the plain sampled walk "all_rows_sample" after the certified
    "some_row_greedy", or "mixed_rows" where a greedy launch precedes it; decided on the device from
    the temperatures; "walks_in": the batch classes "all_greedy", "mixed", "all_sampled" in which it
    walks), and whether its W2 tiles land by bulk copies ("w2_tiled"). certified: a
    CertifiedMarkovHead's walk; w2_tiles: the head carries W2 stored tile by tile (QuantizedMarkovHead.tiles).
    ValueError naming the limit where the kernel cannot walk the call."""
    return [dict(p) for p in _plan_module().plan(
        batch, steps, vocab, rank, _name(w2_dtype), _name(w1_dtype), _name(base_dtype),
        None if logits_dtype is None else _name(logits_dtype), sampling, props or _gpu_properties(), certified,
        w2_tiles)]


def cuda_transposed_launches(batch: int, vocab: int, w1_dtype, *, logits_out: bool = False,
                             w2_tiles: bool = False, props: dict | None = None) -> list[bool]:
    """For each launch of a greedy CUDA walk over int8 W2 from bf16 base logits: whether it runs the
    transposed kernel (ffi/cuda/transposed/) rather than MarkovWalkKernel, base logits being 16-byte
    aligned as XLA allocates them; w2_tiles: the head carries its tiles (QuantizedMarkovHead.tiles).
    Needs no GPU."""
    bf16 = jax.numpy.bfloat16
    plans = cuda_launch_plan(batch, 1, vocab, cuda_envelope()["rank"], w1_dtype, np.int8, base_dtype=bf16,
                             logits_dtype=bf16 if logits_out else None, props=props, w2_tiles=w2_tiles)
    return [p["family"] == "transposed" for p in plans]


def cuda_unsupported_reason(batch: int, steps: int, vocab: int, rank: int, w1_dtype, w2_dtype, *,
                            base_dtype=np.float32, logits_dtype=None, sampling: bool = False,
                            certified: bool = False) -> str | None:
    """Why the CUDA kernel cannot run this walk (certified: of a CertifiedMarkovHead) on this machine's
    GPUs, or None if it can (see `cuda_auto_declines` for where impl="auto" prefers the reference
    although it can)."""
    if _markov_cuda is None:
        return "the jax_markov CUDA module is not built (nvcc was not found at install time)"
    return _plan_module().unsupported(batch, steps, vocab, rank, _name(w2_dtype), _name(w1_dtype), _name(base_dtype),
                                      None if logits_dtype is None else _name(logits_dtype), sampling,
                                      _gpu_properties(), certified)


def cuda_auto_declines(batch: int, steps: int, vocab: int, rank: int, w1_dtype, w2_dtype) -> str | None:
    """Why impl="auto" walks on the reference although the kernel could run, or None: an int8 W2 that
    would neither fit in shared memory nor stay in L2 (the plan's SlowerThanReference); an unquantized
    W2 above CUDA_FLOAT_W2_AUTO_MAX_BATCH requests. The int8 kernel was faster than the jitted int8
    reference at every measured row."""
    if np.dtype(w2_dtype) != np.int8 and batch > CUDA_FLOAT_W2_AUTO_MAX_BATCH:
        return (f"B = {batch} > {CUDA_FLOAT_W2_AUTO_MAX_BATCH} with an unquantized W2: the reference's GEMMs are "
                "faster there (quantize the head to keep the kernel)")
    return _plan_module().slower_than_reference(batch, steps, vocab, rank, _name(w2_dtype), _name(w1_dtype), "bfloat16",
                                                None, False, _gpu_properties())
