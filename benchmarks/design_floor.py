"""Design floor of the cooperative walk kernel: the time its design (int8 W2 kept in shared memory and
L2, tensor-core scoring, one grid-wide exchange per step) could reach on this GPU, beside the bytes
floor. Probe kernels (ffi/cuda/probes.cu, the module jax_markov._markov_probes of a build with
-DJAX_MARKOV_PROBES=ON) measure the constants on the GPU that runs the benchmark.

For a walk of K steps over B requests, a vocabulary of V and rank r = 256:

    bytes_floor  = (V * r + 4 * V + base_bytes + out_bytes) / hbm_copy   every byte moves once
    w2_load      = (V * r + 4 * V) / hbm_copy                            int8 W2 + fp32 scales, once
    smem_share   = min(V * r, sm_count * (smem_per_block - 12 KiB))      W2 bytes resident in shared memory
    l2_share     = V * r - smem_share                                    W2 bytes re-read from L2 every step
    tensor(B)    = ceil(V / 16) * ceil(B / 8) * (r / 16) / mma_rate      B <= 16: mma.m16n8k16 per step
                 = ceil(V / 64) * ceil(B / 8) * (r / 16) / (8 * wgmma_rate)
                                                           B > 16: wgmma m64n64k16 (as m64n8k16 parts)
    noise(B)     = B * V / noise_rate for sampled rows, else 0               Gumbel noise per step
    on_chip_pass = max(smem_share / smem_read + l2_share / l2_read, tensor(B), noise(B))
    exchange(B)  = exchange_s + (B - 1) * exchange_per_request_s         atomicMax per request + grid barrier
    design_floor = max(bytes_floor, w2_load + K * (on_chip_pass + exchange(B)))

hbm_copy is bytes read + written per second of a 1 GiB device-to-device copy; smem_read and l2_read
are bytes read per second by all SMs together; 12 KiB is the kernel's fixed shared-memory state. The
kernel scores batches of up to WGMMA_MIN_BATCH - 1 requests with warp-level mma.sync and larger ones
with wgmma, so the tensor time takes the rate of the instruction it uses. A sampled row needs one
Gumbel noise value (docs/spec.md, version 2: a quarter of a Philox4x32-10 block and two logs) per
request, vocabulary row and step;
noise_rate is how many of them all SMs compute per second.

`python3 benchmarks/design_floor.py` measures the constants on the first CUDA GPU and prints them and
the floors of the benchmark's rows as markdown.
"""
from __future__ import annotations

import math
import sys
import warnings

import jax

try:
    from jax_markov import _markov_probes
except ImportError:  # built without -DJAX_MARKOV_PROBES=ON (the default) or without nvcc
    _markov_probes = None

RANK = 256
FIXED_SMEM_BYTES = 12 * 1024
MMA_M, MMA_N, MMA_K = 16, 8, 16
WGMMA_M, WGMMA_N = 64, 64
WGMMA_MIN_BATCH = 17
ROWS = [(151936, 7, 1), (151936, 7, 16), (151936, 7, 64), (151936, 16, 1), (129280, 5, 1), (129280, 5, 64),
        (248320, 16, 1), (151936, 7, 128), (151936, 7, 256)]


def measure(device=None) -> dict | None:
    """Runs the probes on `device` (a JAX CUDA device, default the first; about a second) and returns
    hbm_copy_bytes_per_s, smem_read_bytes_per_s, l2_read_bytes_per_s, exchange_s,
    exchange_per_request_s, mma_per_s, wgmma_per_s, noise_per_s, coop_launch_gap_s, sm_count and
    smem_per_block.
    Without the probe module or a CUDA GPU it warns why (RuntimeWarning) and returns None."""
    reason = None
    if _markov_probes is None:
        reason = "the probe kernels are not built (jax_markov._markov_probes: cmake -DJAX_MARKOV_PROBES=ON)"
    elif device is None:
        try:
            device = jax.devices("cuda")[0]
        except RuntimeError:
            reason = "no CUDA GPU is visible to JAX"
    if reason is not None:
        warnings.warn(f"design floor not measured: {reason}", RuntimeWarning, stacklevel=2)
        return None
    return dict(_markov_probes.measure_design_constants(device.local_hardware_id))


def design_floor_us(constants: dict, V: int, K: int, B: int, base_bytes: int, out_bytes: int, sm_count: int,
                    smem_per_block: int, w2_element_bytes: int = 1, sampled: bool = False) -> dict:
    """Bytes floor and design floor of one walk in microseconds, with the parts of the design floor
    (the formula of the module docstring). `constants` is what `measure` returns; base_bytes and
    out_bytes are the bytes of the base logits and of the outputs. w2_element_bytes = 2 is the
    unquantized (fp16/bf16) walk: twice the W2 bytes and no scales. `sampled`: every request samples."""
    c = constants
    w2_bytes = V * RANK * w2_element_bytes
    head_bytes = w2_bytes + (4 * V if w2_element_bytes == 1 else 0)
    smem_share = min(w2_bytes, sm_count * (smem_per_block - FIXED_SMEM_BYTES))
    l2_share = w2_bytes - smem_share
    smem_pass = smem_share / c["smem_read_bytes_per_s"]
    l2_pass = l2_share / c["l2_read_bytes_per_s"]
    if B < WGMMA_MIN_BATCH:
        tensor = math.ceil(V / MMA_M) * math.ceil(B / MMA_N) * (RANK // MMA_K) / c["mma_per_s"]
    else:
        tensor = (math.ceil(V / WGMMA_M) * math.ceil(B / MMA_N) * (RANK // MMA_K)
                  / (c["wgmma_per_s"] * (WGMMA_N // MMA_N)))
    noise = B * V / c["noise_per_s"] if sampled else 0.0
    on_chip_pass = max(smem_pass + l2_pass, tensor, noise)
    exchange = c["exchange_s"] + (B - 1) * c["exchange_per_request_s"]
    w2_load = head_bytes / c["hbm_copy_bytes_per_s"]
    bytes_floor = (head_bytes + base_bytes + out_bytes) / c["hbm_copy_bytes_per_s"]
    design = max(bytes_floor, w2_load + K * (on_chip_pass + exchange))
    return dict(bytes_floor_us=bytes_floor * 1e6, design_floor_us=design * 1e6, w2_load_us=w2_load * 1e6,
                smem_pass_us=smem_pass * 1e6, l2_pass_us=l2_pass * 1e6, tensor_us=tensor * 1e6, noise_us=noise * 1e6,
                on_chip_pass_us=on_chip_pass * 1e6, exchange_us=exchange * 1e6, smem_share_bytes=smem_share,
                l2_share_bytes=l2_share)


def report(constants: dict, rows=ROWS) -> str:
    """The constants and the floors of `rows` (V, K, B) as markdown: bf16 base logits, greedy rows
    return tokens, probabilistic rows also bf16 draft logits (as in gpu_measure.py)."""
    c = constants
    lines = [f"- HBM copy: {c['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)",
             f"- shared-memory read: {c['smem_read_bytes_per_s'] / 1e12:.1f} TB/s ({c['sm_count']} SMs, "
             f"{c['smem_per_block']} bytes per block)",
             f"- L2 read: {c['l2_read_bytes_per_s'] / 1e12:.2f} TB/s",
             f"- grid exchange: {c['exchange_s'] * 1e6:.2f} us + {c['exchange_per_request_s'] * 1e9:.2f} ns "
             "per further request",
             f"- mma.m16n8k16 (fp16, fp32 accumulate): {c['mma_per_s']:.3g} /s "
             f"({c['mma_per_s'] * 2 * MMA_M * MMA_N * MMA_K / 1e12:.0f} TFLOP/s), for B < {WGMMA_MIN_BATCH}",
             f"- wgmma m64n64k16 (fp16, fp32 accumulate): {c['wgmma_per_s']:.3g} /s "
             f"({c['wgmma_per_s'] * 2 * WGMMA_M * WGMMA_N * MMA_K / 1e12:.0f} TFLOP/s), for B >= {WGMMA_MIN_BATCH}",
             f"- Gumbel noise: {c['noise_per_s']:.3g} values/s, for sampled rows",
             f"- cooperative launch gap: {c['coop_launch_gap_s'] * 1e6:.2f} us (not in the floors)", "",
             "| V | K | B | mode | bytes floor us | W2 load us | smem + L2 pass us | tensor us | noise us "
             "| exchange us | design floor us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for V, K, B in rows:
        for mode in ("greedy", "probabilistic"):
            out_bytes = B * K * 4 + (B * K * V * 2 if mode == "probabilistic" else 0)
            f = design_floor_us(c, V, K, B, base_bytes=B * K * V * 2, out_bytes=out_bytes, sm_count=c["sm_count"],
                                smem_per_block=c["smem_per_block"], sampled=mode == "probabilistic")
            lines.append(f"| {V} | {K} | {B} | {mode} | {f['bytes_floor_us']:.1f} | {f['w2_load_us']:.1f} | "
                         f"{f['smem_pass_us'] + f['l2_pass_us']:.2f} | {f['tensor_us']:.2f} | {f['noise_us']:.2f} | "
                         f"{f['exchange_us']:.2f} | {f['design_floor_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    constants = measure()
    if constants is None:
        return 1
    print(f"# Design floor on {jax.devices('cuda')[0].device_kind}\n")
    print(report(constants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
