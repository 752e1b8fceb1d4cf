"""benchmarks/gpu_timing.py, gpu_measure.py and gpu_report.py on the CPU: device-time arithmetic from
profiler events, the decode loop's programs and subtraction, memory per call, the derived columns and
summaries, the table, --merge."""
from __future__ import annotations

import importlib.util
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from benchmarks import gpu_measure, gpu_report, gpu_timing

KERNEL, EAGER, BF16 = gpu_report.KERNEL_INT8, gpu_report.EAGER, gpu_report.ARMS["kernel-bf16"]
CERTIFIED = gpu_report.KERNEL_CERTIFIED


def test_busy_and_span_count_overlaps_once():
    # [0, 10) and [5, 12) overlap: 12 busy; [100, 103) adds 3; the span runs from 0 to 103
    assert gpu_measure.busy_and_span([(0.0, 10.0), (5.0, 12.0), (100.0, 103.0)]) == (15.0, 103.0)
    assert gpu_measure.busy_and_span([(0.0, 10.0), (2.0, 3.0)]) == (10.0, 10.0)  # a contained interval adds nothing


def test_run_times_split_a_programs_runs_at_their_gaps():
    gap = gpu_measure.RUN_GAP_S * 1e9
    runs = [[(0.0, 10.0), (12.0, 20.0)], [(gap + 20.0, gap + 25.0)], [(3 * gap, 3 * gap + 7.0), (3 * gap + 1.0, 3 * gap + 2.0)]]
    events = [e for run in runs for e in run]
    assert gpu_measure.run_times(events, 3) == [(18.0, 20.0), (5.0, 5.0), (7.0, 7.0)]
    assert gpu_measure.run_times(events, 2) is None  # runs that the trace does not show are no result


def test_split_at_gaps_separates_the_arms():
    events = [(0.0, 5.0), (8.0, 9.0), (1000.0, 1002.0), (1003.0, 1004.0), (5000.0, 5001.0)]
    groups = gpu_measure.split_at_gaps(events, gap_ns=500.0)
    assert groups == [[(0.0, 5.0), (8.0, 9.0)], [(1000.0, 1002.0), (1003.0, 1004.0)], [(5000.0, 5001.0)]]
    assert gpu_measure.split_at_gaps([], 1.0) == []


def test_loop_walk_us_subtracts_the_loop_without_the_walk_per_iteration():
    # (busy ns, span ns) per run; medians: with the walk 900 / 1600, without 100 / 400, over 4 iterations
    with_walk = [(900.0, 1600.0), (800.0, 1500.0), (1000.0, 9000.0)]
    without = [(100.0, 400.0), (100.0, 300.0), (100.0, 500.0)]
    got = gpu_measure.loop_walk_us(with_walk, without, iterations=4)
    assert got == pytest.approx(dict(us=(1600 - 400) / 4 / 1e3, busy_us=(900 - 100) / 4 / 1e3))


def test_floor_bytes_follow_the_head_format():
    int8 = gpu_report.floor_bytes(1000, 2, 1, "greedy", 1)
    bf16 = gpu_report.floor_bytes(1000, 2, 1, "greedy", 2)
    assert bf16 - int8 == 1000 * 256 - 4 * 1000  # twice the W2 bytes, no scales
    assert gpu_report.floor_bytes(1000, 2, 1, "probabilistic", 1) - int8 == 2 * 1000 * 2  # bf16 logits out
    assert gpu_report.floor_bytes(1000, 2, 1, "greedy-t0", 1) == int8
    assert gpu_report.w2_element_bytes(KERNEL) == 1
    assert gpu_report.w2_element_bytes(BF16) == 2
    assert gpu_report.w2_element_bytes(EAGER) == 2


def test_every_published_row_is_timed_in_both_modes():
    published_rows = {key[:3] for key in gpu_report.PUBLISHED_H100_US}
    assert len(published_rows) == 7 and published_rows <= set(gpu_report.ROWS)
    assert {mode for *_, mode in gpu_report.PUBLISHED_H100_US} == {"greedy", "probabilistic"}
    assert len(gpu_report.PUBLISHED_H100_US) == 14


def test_mode_inputs_pass_zero_temperatures_with_keys_and_positions():
    assert gpu_measure.mode_inputs("greedy", 3) == {}
    zero, sampled = gpu_measure.mode_inputs("greedy-t0", 3), gpu_measure.mode_inputs("probabilistic", 3)
    assert set(zero) == set(sampled) == {"temperature", "key", "position"}
    assert np.all(np.asarray(zero["temperature"]) == 0) and np.all(np.asarray(sampled["temperature"]) == 0.8)
    assert np.array_equal(np.asarray(zero["position"]), np.asarray(sampled["position"]))


@pytest.fixture(scope="module")
def small_problem():
    sets, anchor = gpu_measure.make_sets(1024, 3, 2, n_sets=1)
    heads, base = sets[0]
    return heads, base, anchor


@pytest.mark.parametrize("mode", gpu_report.MODES)
def test_decode_loop_walks_each_round_from_the_last_token(small_problem, mode):
    heads, base, anchor = small_problem
    inputs = gpu_measure.mode_inputs(mode, 2)
    flush = jax.random.uniform(jax.random.key(1), (4096,), jnp.float32)
    logits = jnp.zeros(base.shape, jnp.bfloat16) if mode == "probabilistic" else None
    loop = gpu_measure.decode_loop_program("eager", mode, 3)
    got_anchor, _, got_logits = loop(flush, heads[0], base, anchor, inputs, logits)
    # The same three rounds one walk at a time: each from the last token, positions advanced by K.
    want = anchor
    for i in range(3):
        rounds = dict(inputs, position=inputs["position"] + 3 * i) if inputs else {}
        res = gpu_measure.walk_arm("eager", mode, heads[0], base, want, rounds)
        want = res.tokens[:, -1]
    np.testing.assert_array_equal(got_anchor, want)
    if mode == "probabilistic":
        np.testing.assert_array_equal(np.asarray(got_logits, np.float32), np.asarray(res.logits, np.float32))
    else:
        assert got_logits is None
    without = gpu_measure.decode_loop_program(None, mode, 3)(flush, heads[0], base, anchor, inputs, logits)
    np.testing.assert_array_equal(without[0], anchor)  # the loop without the walk keeps the anchor


def test_memory_per_call_counts_the_arms_head_and_xla_scratch(small_problem):
    heads, base, anchor = small_problem
    int8 = gpu_measure.memory_per_call("reference-int8", "greedy", heads[1], base, anchor, {})
    bf16 = gpu_measure.memory_per_call("eager", "greedy", heads[0], base, anchor, {})
    # W1 bf16, W2 int8, scales, and W2 stored tile by tile (QuantizedMarkovHead.tiles) where the plan is built
    tiles = 1024 * 256 if jm.native.plan_available() else 0
    assert int8["persistent_bytes"] == 1024 * 256 * 2 + 1024 * 256 + 1024 * 4 + tiles
    assert bf16["persistent_bytes"] == 2 * 1024 * 256 * 2
    # The reference widens the int8 W2 to float32 for its product: at least that much scratch.
    assert int8["scratch_bytes"] >= 1024 * 256 * 4 > 0
    assert gpu_measure.arm_head("kernel-int8", heads) is heads[1] and gpu_measure.arm_head("kernel-bf16", heads) is heads[0]
    assert isinstance(gpu_measure.arm_head("kernel-certified", heads), jm.CertifiedMarkovHead)
    certified = gpu_measure.memory_per_call("reference-int8", "greedy", heads[2], base, anchor, {})
    # the int8 layouts, tiles included, plus the certificate: the unquantized W2 (bf16) and a residual norm a row
    assert certified["persistent_bytes"] == int8["persistent_bytes"] + 1024 * 256 * 2 + 1024 * 4


def measured(vocab, steps, batch, mode, arm, us, loop=None, **extra):
    """A measured row as run_gpu makes it."""
    return dict(vocab=vocab, steps=steps, batch=batch, mode=mode, arm=arm, us=us, wall_us=us + 5.0,
                decode_loop_us=loop, decode_loop_busy_us=None if loop is None else loop - 1.0,
                persistent_bytes=120_000_000, scratch_bytes=2_000_000, **extra)


# Published (greedy, probabilistic): (151936,7,1) 60.5, 80.9; (151936,7,16) 68.0, 91.4; (151936,7,64) 112.3, 179.8.
SYNTHETIC = [
    measured(151936, 7, 1, "greedy", EAGER, 250.0, loop=300.0),
    measured(151936, 7, 1, "greedy", KERNEL, 50.0, loop=70.0),       # faster; the loop is not
    measured(151936, 7, 1, "greedy", CERTIFIED, 56.0),                # 1.12x the int8 kernel
    measured(151936, 7, 1, "probabilistic", EAGER, 300.0),
    measured(151936, 7, 1, "probabilistic", KERNEL, 60.0, loop=75.0),  # faster, in the loop too
    measured(151936, 7, 1, "probabilistic", CERTIFIED, 72.0),            # 1.2x
    measured(151936, 7, 1, "greedy-t0", KERNEL, 55.0),
    measured(151936, 7, 16, "greedy", KERNEL, 90.0),                  # slower, no loop time
    measured(151936, 7, 16, "probabilistic", KERNEL, 126.0),
    measured(151936, 7, 64, "probabilistic", KERNEL, 170.0, loop=150.0),
    measured(151936, 7, 128, "greedy", KERNEL, 300.0),                # no published figure
]


def test_derived_columns_against_eager_and_the_published_figures():
    rows = {gpu_report.row_key(r): r for r in gpu_report.complete_rows(SYNTHETIC, 4e12, None)}
    kernel = rows[(151936, 7, 1, "greedy", KERNEL)]
    assert kernel["speedup"] == pytest.approx(5.0) and rows[(151936, 7, 1, "greedy", EAGER)]["speedup"] == 1.0
    assert kernel["published_h100_us"] == 60.5
    assert rows[(151936, 7, 1, "probabilistic", KERNEL)]["published_h100_us"] == 80.9
    assert rows[(151936, 7, 1, "greedy", EAGER)]["published_h100_us"] is None  # the kernel's figure only
    assert rows[(151936, 7, 1, "greedy-t0", KERNEL)]["speedup"] is None  # no eager arm in that mode
    assert rows[(151936, 7, 1, "greedy-t0", KERNEL)]["published_h100_us"] is None
    floor = gpu_report.floor_bytes(151936, 7, 1, "greedy", 1) / 4e12 * 1e6
    assert kernel["floor_us"] == pytest.approx(floor) and kernel["floor_fraction"] == pytest.approx(floor / 50.0)
    assert np.isnan(kernel["design_floor_us"])  # no probe constants
    # sorted by ROWS, then MODES, then ARMS
    keys = list(rows)
    assert keys.index((151936, 7, 16, "greedy", KERNEL)) > keys.index((151936, 7, 1, "greedy-t0", KERNEL))
    assert keys[-1][:3] == (151936, 7, 128)


def test_published_summary_counts_device_and_decode_loop_cells():
    summary = gpu_report.published_summary(SYNTHETIC)
    assert summary["greedy"] == dict(cells=2, faster=1, loop_cells=1, loop_faster=0)
    assert summary["probabilistic"] == dict(cells=3, faster=2, loop_cells=2, loop_faster=2)
    assert "greedy-t0" not in summary


def test_sampled_and_zero_temperature_ratios_against_the_target():
    assert gpu_report.sampled_target(1) == gpu_report.sampled_target(16) == 1.3
    assert gpu_report.sampled_target(17) == gpu_report.sampled_target(256) == 1.5
    ratios = {(q["vocab"], q["steps"], q["batch"]): q for q in gpu_report.mode_ratios(SYNTHETIC)}
    assert set(ratios) == {(151936, 7, 1), (151936, 7, 16), (151936, 7, 128)}  # rows with a greedy kernel time
    assert ratios[(151936, 7, 1)]["sampled_ratio"] == pytest.approx(1.2)
    assert ratios[(151936, 7, 1)]["zero_temperature_ratio"] == pytest.approx(1.1)
    assert ratios[(151936, 7, 16)]["sampled_ratio"] == pytest.approx(1.4)
    assert ratios[(151936, 7, 16)]["greedy_t0_us"] is None
    assert ratios[(151936, 7, 128)]["sampled_ratio"] is None and ratios[(151936, 7, 128)]["target"] == 1.5


def run_info(command):
    return dict(command=command, xla_flags="--xla_enable_command_buffers_during_profiling=true",
                no_cmd_buffer_xla_flags="--xla_gpu_enable_command_buffer=", bandwidth=4e12, design_constants=None)


def table_of(rows, command="python3 benchmarks/gpu_timing.py --rows 151936,7,1", **info):
    info = dict(dict(gpu="NVIDIA H200", jax_version="0.11.2", commit="abc1234"), **info)
    return gpu_report.make_table([run_info(command)], rows, **info)


def test_table_files_hold_every_row_and_the_summaries(tmp_path):
    rows = [dict(r, decode_loop_no_cmd_buffer_us=r["decode_loop_us"] + 10.0) if r["decode_loop_us"] else r
            for r in SYNTHETIC]
    text = gpu_report.write_table(table_of(rows), tmp_path / "h200")
    assert (tmp_path / "h200.md").read_text() == text
    saved = json.loads((tmp_path / "h200.json").read_text())
    assert saved["commit"] == "abc1234" and saved["runs"][0]["command"].endswith("--rows 151936,7,1")
    assert len(saved["rows"]) == len(SYNTHETIC)
    assert "- command: `python3 benchmarks/gpu_timing.py --rows 151936,7,1`" in text
    assert "- greedy: the int8 kernel is faster on 1 of 2 published cells in device time, in the decode loop on 0 of 1" in text
    assert "- probabilistic: the int8 kernel is faster on 2 of 3 published cells in device time, in the decode loop on 2 of 2" in text
    assert "| 151936 | 7 | 1 | 50.0 | 60.0 | 1.20 | 1.3 | yes | 55.0 | 1.10 |" in text
    assert "| 151936 | 7 | 16 | 90.0 | 126.0 | 1.40 | 1.3 | no |  |  |" in text
    assert "| 151936 | 7 | 1 | greedy | 50.0 | 56.0 | 1.120 | yes |" in text
    assert "| 151936 | 7 | 1 | probabilistic | 60.0 | 72.0 | 1.200 | no |" in text
    # us/call, wall, decode loop (default flags, command buffers off), ..., published, head MB, scratch MB
    line = next(line for line in text.splitlines() if line.startswith("| 151936 | 7 | 1 | greedy | kernel (int8) |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5:10] == ["50.0", "55.0", "70.0", "80.0", "5.00x"]
    assert cells[-3:] == ["60.5", "120.0", "2.0"]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "h200.png").stat().st_size > 0


def test_merge_joins_runs_over_different_rows(tmp_path):
    first = table_of(SYNTHETIC[:5], command="python3 benchmarks/gpu_timing.py --rows 151936,7,1")
    rerun = measured(151936, 7, 1, "greedy-t0", KERNEL, 52.0)
    second = table_of(SYNTHETIC[5:] + [rerun], command="python3 benchmarks/gpu_timing.py --rows 151936,7,16")
    paths = []
    for i, table in enumerate((first, second)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(table))
    gpu_timing.main(["--merge", *map(str, paths), "--out", str(tmp_path / "h200")])
    merged = json.loads((tmp_path / "h200.json").read_text())
    assert [run["command"] for run in merged["runs"]] == [first["runs"][0]["command"], second["runs"][0]["command"]]
    assert "--merge" in merged["merge_command"]
    rows = {gpu_report.row_key(r): r for r in merged["rows"]}
    assert len(rows) == len(SYNTHETIC)
    assert rows[(151936, 7, 1, "greedy-t0", KERNEL)]["us"] == 52.0  # the later run's
    assert rows[(151936, 7, 1, "greedy", KERNEL)]["speedup"] == pytest.approx(5.0)
    text = (tmp_path / "h200.md").read_text()
    assert text.count("- command: `") == 2 and "- merged into one table by `" in text


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H100 80GB HBM3"), ("commit", "def5678"), ("jax_version", "0.11.3")])
def test_merge_refuses_tables_of_different_runs(field, value):
    with pytest.raises(ValueError, match="differ in"):
        gpu_report.merge_tables([table_of(SYNTHETIC[:2]), table_of(SYNTHETIC[2:], **{field: value})], "merge")


def test_the_child_processes_decode_loops_go_into_their_rows():
    results = [dict(r) for r in SYNTHETIC[:2]]
    loops = [dict(vocab=151936, steps=7, batch=1, mode="greedy", arm=KERNEL, decode_loop_us=90.0, decode_loop_busy_us=60.0)]
    gpu_timing.add_no_command_buffer_loops(results, loops)
    assert results[1]["decode_loop_no_cmd_buffer_us"] == 90.0 and results[1]["decode_loop_no_cmd_buffer_busy_us"] == 60.0
    assert "decode_loop_no_cmd_buffer_us" not in results[0]


def test_the_child_process_gets_the_same_selection():
    args = gpu_timing.selection_args([(151936, 7, 1), (129280, 5, 64)], ["greedy", "greedy-t0"], ["kernel-int8"], 5, 8)
    parsed = gpu_timing.parser().parse_args(args)
    assert parsed.rows == [(151936, 7, 1), (129280, 5, 64)] and parsed.modes == ["greedy", "greedy-t0"]
    assert parsed.arms == ["kernel-int8"] and parsed.repeats == 5 and parsed.iterations == 8
    assert gpu_timing.parser().parse_args(gpu_timing.selection_args([(1, 2, 3)], ["greedy"], None, 5, 8)).arms is None
    assert gpu_timing.mode_arms("greedy-t0") == ("kernel-int8",) and len(gpu_timing.mode_arms("greedy")) == 5
    assert gpu_timing.mode_arms("greedy-t0", ["eager"]) == ("eager",)


def test_a_row_has_no_arm_whose_head_the_kernel_refuses(monkeypatch):
    from jax_markov import native

    if not native.plan_available():
        pytest.skip("the launch plan module is not built")
    monkeypatch.setattr(native, "_markov_cuda", native._markov_cuda or object())  # the plan needs no GPU
    lines = []
    one = gpu_timing.mode_arms("probabilistic", None, (151936, 7, 1), lines.append)
    many = gpu_timing.mode_arms("probabilistic", None, (151936, 7, 64), lines.append)
    assert "kernel-certified" in one and "kernel-certified" not in many and many == tuple(
        arm for arm in one if arm != "kernel-certified")
    assert len(lines) == 1 and "no kernel-certified arm" in lines[0] and "B=64" in lines[0]
    assert "kernel-certified" in gpu_timing.mode_arms("greedy", None, (151936, 7, 64), lines.append)


def test_xla_flags_are_appended_once():
    assert gpu_timing.with_flag("", "--a=1") == "--a=1"
    assert gpu_timing.with_flag("--b=2", "--a=1") == "--b=2 --a=1"
    assert gpu_timing.with_flag("--a=1 --b=2", "--a=1") == "--a=1 --b=2"


@pytest.mark.parametrize("kind,name", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090")])
def test_results_are_named_after_the_gpu(kind, name):
    assert gpu_timing.results_name(kind) == name


def test_a_run_without_device_activity_still_writes_its_table(tmp_path, monkeypatch):
    """run_gpu's wiring on the CPU: no GPU events, so wall times and no decode-loop column, with warnings."""
    monkeypatch.setattr(gpu_timing, "measure_copy_bandwidth", lambda: 1e11)
    monkeypatch.setattr(gpu_measure, "flush_buffer", lambda l2_bytes: jnp.zeros((4096,), jnp.float32))
    with pytest.warns(RuntimeWarning):
        bandwidth, constants, rows = gpu_timing.run_gpu([(1024, 3, 2)], ["greedy", "greedy-t0"], None, repeats=2,
                                                         iterations=2, log=lambda s: None)
    assert constants is None and bandwidth == 1e11
    arms = gpu_timing.mode_arms("greedy", None, (1024, 3, 2), log=lambda s: None)  # certified where the plan takes it
    assert [(r["mode"], r["arm"]) for r in rows] == [("greedy", gpu_report.ARMS[a]) for a in arms] + [
        ("greedy-t0", KERNEL)]
    assert all(r["us"] > 0 and r["decode_loop_us"] is None and r["scratch_bytes"] >= 0 for r in rows)
    text = gpu_report.write_table(table_of(rows, jax_version=jax.__version__), tmp_path / "t")
    certified = "kernel-certified" in arms
    # an arm row each, a sampled/zero-temperature ratio row, a certified/int8 row where certified ran
    assert text.count("| 1024 | 3 | 2 |") == len(arms) + 1 + 1 + certified


def test_the_child_process_for_command_buffers_off_runs_and_answers():
    """The child's command line and its answer file (on the CPU it finds no device activity: no rows)."""
    logged = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a child that fails warns
        loops = gpu_timing.run_decode_loops_without_command_buffers([(1024, 3, 2)], ["greedy"], ["kernel-int8"],
                                                                    repeats=2, iterations=2, log=logged.append)
    assert loops == []
    assert "--xla_gpu_enable_command_buffer=" in logged[0] and "--decode-loop-only" in logged[0]
    assert "--rows 1024,3,2 --modes greedy" in logged[0]
