"""benchmarks/gpu_timing.py's device-time arithmetic (CPU): busy time per program from device events."""
from __future__ import annotations

import pytest

from benchmarks import gpu_timing


def test_busy_per_program_counts_overlaps_once_and_skips_gaps():
    # program 0: [0, 10) and [5, 12) overlap (12 busy), program 1: [100, 103) and [200, 207) (10 busy)
    events = [(200.0, 207.0), (0.0, 10.0), (100.0, 103.0), (5.0, 12.0)]
    assert gpu_timing.busy_per_program(events, 2) == [12.0, 10.0]
    # a contained interval adds nothing
    assert gpu_timing.busy_per_program([(0.0, 10.0), (2.0, 3.0)], 1) == [10.0]


@pytest.mark.parametrize("events,programs", [([], 2), ([(0.0, 1.0)] * 3, 2)])
def test_busy_per_program_refuses_uneven_splits(events, programs):
    assert gpu_timing.busy_per_program(events, programs) == []


def test_split_at_gaps_separates_the_arms():
    events = [(0.0, 5.0), (8.0, 9.0), (1000.0, 1002.0), (1003.0, 1004.0), (5000.0, 5001.0)]
    groups = gpu_timing.split_at_gaps(events, gap_ns=500.0)
    assert groups == [[(0.0, 5.0), (8.0, 9.0)], [(1000.0, 1002.0), (1003.0, 1004.0)], [(5000.0, 5001.0)]]
    assert gpu_timing.split_at_gaps([], 1.0) == []


def test_floor_bytes_follow_the_head_format():
    int8 = gpu_timing.floor_bytes(1000, 2, 1, "greedy", 1)
    bf16 = gpu_timing.floor_bytes(1000, 2, 1, "greedy", 2)
    assert bf16 - int8 == 1000 * 256 - 4 * 1000  # twice the W2 bytes, no scales
    assert gpu_timing.w2_element_bytes("kernel (int8)") == 1
    assert gpu_timing.w2_element_bytes("kernel (bf16 head)") == 2
    assert gpu_timing.w2_element_bytes("eager (reference, bf16 head)") == 2
