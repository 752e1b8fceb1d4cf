"""benchmarks/stall_profile.py's summary of an ncu SASS source page (CPU)."""
from __future__ import annotations

from benchmarks import stall_profile

# The shape of `ncu --page source --csv --print-source sass`: a kernel line, then one row per instruction.
CSV = "\n".join([
    '"Kernel Name","void MarkovWalkKernel<1, 0, 1, 0, 384>(WalkArgs)",',
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","Thread Instructions Executed"',
    '"0x10","LDS R1, [R2]","30","20","66,472","2,127,104"',
    '"0x20","IMMA.16832.S8.S8 R4, R8, R12, R4","10","5","48,972","1,567,104"',
    '"0x30","FADD R1, R1, R3","1,200","900","66,472","2,127,104"',
    '"0x40","BAR.SYNC 0x0","60","60","11,088","354,816"',
])


def test_samples_grouped_by_execution_count_largest_first():
    lines = stall_profile.summarize(CSV, top=2).splitlines()
    assert lines[0] == "total samples 1300"
    # The two instructions executed 66472 times, apart in the listing, are one entry.
    assert lines[1].split() == ["exec=", "66472", "ninstr=", "2", "samples=", "1230", "94.6%"]
    assert lines[2].split()[1] == "11088" and lines[3].split()[1] == "48972"
    # The hottest instructions, with their samples and execution counts; the thread count is not used.
    assert lines[4].split()[:3] == ["1200", "66472", "FADD"]
    assert lines[5].split()[:3] == ["60", "11088", "BAR.SYNC"]
    assert len(lines) == 6


def test_headline_keeps_only_the_named_metrics():
    details = "    Duration   us   73.50\n    L1 Hit Rate   %   99\n    Registers Per Thread   register/thread   164"
    assert stall_profile.headline(details).splitlines() == ["    Duration   us   73.50",
                                                             "    Registers Per Thread   register/thread   164"]


def test_the_profiled_launch_is_one_that_walks():
    """The third call's first launch that walks: a sampled call's guarded pair (greedy launch first)
    profiles its sampled launch; a greedy or zero-temperature call its greedy one; a call of two
    launches (128 requests) its first."""
    always = {"walks_in": ["all_greedy", "mixed", "all_sampled"]}
    pair = [{"walks_in": ["all_greedy"]}, {"walks_in": ["mixed", "all_sampled"]}]
    assert stall_profile.launch_skip("151936,7,64,probabilistic", pair) == 5
    assert stall_profile.launch_skip("151936,7,64,greedy-t0", pair) == 4
    assert stall_profile.launch_skip("151936,7,64,greedy", [always]) == 2
    assert stall_profile.launch_skip("151936,7,128,greedy", [always] * 2) == 4
    certified = [{"walks_in": ["all_greedy", "mixed"]}, {"walks_in": ["all_sampled"]}]
    assert stall_profile.launch_skip("151936,7,1,probabilistic,certified", certified) == 5
    assert stall_profile.launch_skip("151936,7,1,greedy,certified", [always]) == 2


def test_stall_reasons_over_the_kernel_and_its_hottest_body():
    """ncu's per-reason columns as shares of all samples, largest first: over every instruction, and
    over those of the execution count with the most samples; their "(Not Issued)" twins left out."""
    header = CSV.splitlines()[1] + ',"stall_wait","stall_long_sb","stall_wait (Not Issued)"'
    rows = [line + extra for line, extra in zip(CSV.splitlines()[2:], (',"20","10","99"', ',"0","10","99"',
                                                                            ',"900","300","99"', ',"0","60","99"'))]
    lines = stall_profile.summarize("\n".join([CSV.splitlines()[0], header, *rows]), top=0).splitlines()
    assert lines[-2] == "stall reasons (% of all samples): wait 70.8, long_sb 29.2"
    assert lines[-1] == "stall reasons at exec=66472 (% of all samples): wait 70.8, long_sb 23.8"
