"""benchmarks/design_floor.py: the floor formula against hand-computed values (CPU), and the probe
kernels on the GPU (skipped cleanly without one or without a build of them)."""
from __future__ import annotations

import math

import jax
import pytest

from benchmarks import design_floor
from jax_markov import native


def _has_probes() -> bool:
    """A CUDA GPU, and the probe kernels built (-DJAX_MARKOV_PROBES=ON) beside the CUDA module."""
    return native.cuda_gpu_available() and design_floor._markov_probes is not None


# Round numbers: V = 160000 gives 10000 row tiles and 40.96 MB of int8 W2 (+ 0.64 MB of scales);
# 100 SMs x 200000 bytes keep 20 MB of it in shared memory, 20.96 MB stream from L2.
CONSTANTS = dict(hbm_copy_bytes_per_s=4e12, smem_read_bytes_per_s=20e12, l2_read_bytes_per_s=10.48e12,
                 exchange_s=1e-6, exchange_per_request_s=1e-8, mma_per_s=1.6e11, wgmma_per_s=1e10,
                 noise_per_s=3.2e11, coop_launch_gap_s=3e-6)
V, SM_COUNT, SMEM_PER_BLOCK = 160000, 100, 200000 + design_floor.FIXED_SMEM_BYTES


def floor(K, B, *, V=V, base_bytes=None, out_bytes=None, constants=CONSTANTS, sampled=False):
    base_bytes = B * K * V * 2 if base_bytes is None else base_bytes
    out_bytes = B * K * 4 if out_bytes is None else out_bytes
    return design_floor.design_floor_us(constants, V, K, B, base_bytes, out_bytes, SM_COUNT, SMEM_PER_BLOCK,
                                        sampled=sampled)


def test_hand_computed_memory_bound_step():
    # W2 load 41.6 MB / 4 TB/s = 10.4 us; a step: smem 20 MB / 20 TB/s = 1 us + L2 20.96 MB / 10.48 TB/s
    # = 2 us, above the tensor time (10000 tiles x 1 column tile x 16 k-steps / 1.6e11 = 1 us); exchange 1 us.
    f = floor(7, 1)
    assert f["w2_load_us"] == pytest.approx(10.4)
    assert f["smem_share_bytes"] == 20_000_000 and f["l2_share_bytes"] == 20_960_000
    assert f["smem_pass_us"] == pytest.approx(1.0) and f["l2_pass_us"] == pytest.approx(2.0)
    assert f["tensor_us"] == pytest.approx(1.0)
    assert f["on_chip_pass_us"] == pytest.approx(3.0)
    assert f["exchange_us"] == pytest.approx(1.0)
    assert f["design_floor_us"] == pytest.approx(10.4 + 7 * (3.0 + 1.0))
    assert f["bytes_floor_us"] == pytest.approx((41.6e6 + 7 * V * 2 + 7 * 4) / 4e12 * 1e6)


def test_hand_computed_tensor_bound_step():
    # B = 64 takes wgmma: 2500 64-row tiles x 8 column tiles x 16 k-steps / (8 x 1e10) = 4 us per step,
    # above the 3 us memory pass; exchange 1 + 63 x 0.01 us.
    f = floor(7, 64)
    assert f["tensor_us"] == pytest.approx(4.0)
    assert f["on_chip_pass_us"] == pytest.approx(4.0)
    assert f["exchange_us"] == pytest.approx(1.63)
    assert f["design_floor_us"] == pytest.approx(10.4 + 7 * (4.0 + 1.63))


def test_tensor_rate_follows_the_kernels_instruction():
    # Up to 16 requests mma.m16n8k16 (10000 x 2 column tiles x 16 / 1.6e11 = 2 us), from 17 wgmma.
    assert floor(7, 16)["tensor_us"] == pytest.approx(2.0)
    assert floor(7, 17)["tensor_us"] == pytest.approx(2500 * 3 * 16 / 8e10 * 1e6)


def test_sampled_rows_pay_for_their_noise():
    # 160000 noise values per request and step at 3.2e11 / s: 0.5 us per request. At B = 1 the 3 us
    # memory pass hides it; at B = 64 its 32 us per step exceed the 4 us tensor time.
    assert floor(7, 1, sampled=True)["noise_us"] == pytest.approx(0.5)
    assert floor(7, 1, sampled=True)["design_floor_us"] == pytest.approx(floor(7, 1)["design_floor_us"])
    f = floor(7, 64, sampled=True)
    assert f["noise_us"] == f["on_chip_pass_us"] == pytest.approx(32.0)
    assert f["design_floor_us"] == pytest.approx(10.4 + 7 * (32.0 + 1.63))
    assert floor(7, 64)["noise_us"] == 0


def test_bytes_floor_dominates_without_steps_or_with_huge_inputs():
    no_steps = floor(0, 1)
    assert no_steps["design_floor_us"] == no_steps["bytes_floor_us"]
    huge = floor(7, 1, base_bytes=10**12)
    assert huge["design_floor_us"] == huge["bytes_floor_us"] == pytest.approx((41.6e6 + 10**12 + 28) / 4e12 * 1e6)


def test_small_vocabulary_fits_in_shared_memory():
    f = floor(7, 1, V=1600)
    assert f["smem_share_bytes"] == 1600 * 256 and f["l2_share_bytes"] == 0 and f["l2_pass_us"] == 0


def test_tensor_time_counts_whole_tiles():
    # ceil(V / 16) row tiles, ceil(B / 8) column tiles.
    assert floor(7, 9)["tensor_us"] == floor(7, 16)["tensor_us"] == pytest.approx(2 * floor(7, 8)["tensor_us"])
    assert floor(7, 1, V=V + 1)["tensor_us"] == pytest.approx(1.0 * 10001 / 10000)


def test_design_floor_grows_with_steps():
    assert floor(16, 1)["design_floor_us"] > floor(7, 1)["design_floor_us"] > floor(1, 1)["design_floor_us"]


def test_report_has_every_row():
    constants = dict(CONSTANTS, sm_count=132, smem_per_block=232448)
    table = design_floor.report(constants)
    for V_, K, B in design_floor.ROWS:
        for mode in ("greedy", "probabilistic"):
            assert f"| {V_} | {K} | {B} | {mode} |" in table


@pytest.mark.skipif(_has_probes(), reason="checks the answer without a GPU or without the probes")
def test_measure_without_gpu_or_probes_warns_and_returns_none():
    with pytest.warns(RuntimeWarning, match="design floor not measured"):
        assert design_floor.measure() is None


@pytest.mark.skipif(not _has_probes(), reason="needs a CUDA GPU and the probe kernels (-DJAX_MARKOV_PROBES=ON)")
def test_measure_on_gpu_gives_plausible_constants():
    device = jax.devices("cuda")[0]
    c = design_floor.measure(device)
    props = native._markov_cuda.device_properties(device.local_hardware_id)
    assert c["sm_count"] == props["sm_count"] and c["smem_per_block"] == props["smem_per_block"]
    # Wide bounds around an H100/H200 (3-5 TB/s copy, ~30 TB/s shared memory, ~5-10 TB/s L2, ~1 us exchange).
    assert 3e11 < c["hbm_copy_bytes_per_s"] < 2e13
    assert 1e12 < c["smem_read_bytes_per_s"] < 2e14
    assert 5e11 < c["l2_read_bytes_per_s"] < 1e14
    assert c["smem_read_bytes_per_s"] > c["l2_read_bytes_per_s"]
    assert 5e-8 < c["exchange_s"] < 1e-4
    assert 0 <= c["exchange_per_request_s"] < 1e-6
    assert 1e10 < c["mma_per_s"] < 1e13
    # wgmma m64n64k16 is 32 m16n8k16 of work, and the faster way to do it.
    assert c["mma_per_s"] < 32 * c["wgmma_per_s"] < 1e15
    # Philox4x32-10 and two logs take on the order of 100 instructions per value.
    assert 1e10 < c["noise_per_s"] < 1e13
    assert 1e-7 < c["coop_launch_gap_s"] < 1e-4
    f = design_floor.design_floor_us(c, 151936, 7, 1, 151936 * 7 * 2, 7 * 4, c["sm_count"], c["smem_per_block"])
    assert all(math.isfinite(v) and v >= 0 for v in f.values())
    assert f["design_floor_us"] >= f["bytes_floor_us"] > 0
