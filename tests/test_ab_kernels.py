"""benchmarks/ab_kernels.py's bookkeeping (CPU): ncu durations to launches per config, and the summary."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ab_kernels


def ncu_report(values_with_units):
    return "\n".join(f"  void MarkovWalkKernel<...>(WalkArgs) (132, 1, 1)x(384, 1, 1)\n"
                     f"    gpu__time_duration.sum      {unit}      {value}" for value, unit in values_with_units)


def test_durations_in_microseconds_per_config():
    configs = ["151936,7,1,greedy", "151936,7,256,greedy"]  # 3 launches, then 3 walks of 4 launches
    report = ncu_report([(61.5, "us"), (60.25, "usecond"), ("1,234.5", "ns")] + [(0.26, "ms")] * 12)
    runs = ab_kernels.per_config(ab_kernels.parse_durations(report), configs)
    assert runs["151936,7,1,greedy"] == pytest.approx([61.5, 60.25, 1.2345])
    assert runs["151936,7,256,greedy"] == pytest.approx([260.0] * 12)


def test_noise_launches_count_in_the_walk_launch_that_follows():
    report = ("  MarkovWalkNoise(jax_markov::walk::WalkArgs, float *) (149, 7, 64)x(256, 1, 1), Context 1\n"
              "    gpu__time_duration.sum      us      30.5\n" + ncu_report([(100.0, "us"), (90.0, "us")]) + "\n"
              "  jax_markov::walk::MarkovWalkNoise(jax_markov::walk::WalkArgs, float *) (149, 7, 64)x(256, 1, 1)\n"
              "    gpu__time_duration.sum      ms      0.02\n" + ncu_report([(80.0, "us")]))
    assert ab_kernels.parse_durations(report) == pytest.approx([130.5, 90.0, 100.0])


def test_launch_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="reported 2 kernel launches, the configs make 3"):
        ab_kernels.per_config([1.0, 2.0], ["5003,3,3,greedy"])


def test_summary_medians_over_rounds_and_change_against_the_first_tree():
    configs = ["a,1,1,greedy"]
    runs = {"main": [{configs[0]: [100.0, 102.0, 98.0]}, {configs[0]: [101.0, 99.0, 100.0]}],
            "new": [{configs[0]: [90.0, 91.0, 89.0]}, {configs[0]: [90.5, 89.5, 90.0]}]}
    table = ab_kernels.summary(runs, configs).splitlines()
    assert table[0] == "| config | main | new | new vs main |"
    assert table[2] == "| a,1,1,greedy | 100.0 | 90.0 | -10.0 % |"


def test_a_tree_given_as_dot_is_named_by_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ab_kernels.tree_name(Path(".")) == tmp_path.name
    assert ab_kernels.tree_name(Path("../" + tmp_path.name)) == tmp_path.name


def test_each_config_is_measured_in_an_ncu_run_of_its_own(monkeypatch, tmp_path):
    calls = []

    def fake_ncu(cmd, **kwargs):
        calls.append(cmd[cmd.index("benchmarks/profile_kernel.py") + 1:])
        launches = ab_kernels.launches(calls[-1][0])
        return subprocess.CompletedProcess(cmd, 0, stdout=ncu_report([(10.0 * len(calls), "us")] * launches), stderr="")

    monkeypatch.setattr(ab_kernels.subprocess, "run", fake_ncu)
    runs = ab_kernels.measure(tmp_path, ["5003,3,3,greedy", "151936,7,128,greedy"])
    assert calls == [["5003,3,3,greedy"], ["151936,7,128,greedy"]]
    assert runs == {"5003,3,3,greedy": [10.0] * 3, "151936,7,128,greedy": [20.0] * 6}


def test_device_times_per_config_with_the_noise_folded_in():
    configs = ["151936,7,64,probabilistic", "5003,3,3,greedy"]
    output = "\n".join(
        ["V=... warm-up line that is not a kernel"]
        + [f"KERNEL {configs[0]} {name} {us}" for _ in range(3) for name, us in (("MarkovWalkNoise", 280.0),
                                                                                  ("MarkovWalkKernel", 500.5))]
        + [f"KERNEL {configs[1]} MarkovWalkTransposedKernel {us}" for us in (50.0, 51.0, 52.0)])
    runs = ab_kernels.parse_device_times(output, configs)
    assert runs == {configs[0]: pytest.approx([780.5] * 3), configs[1]: pytest.approx([50.0, 51.0, 52.0])}
    with pytest.raises(ValueError, match="reported 2 kernel launches, the configs make 3"):
        ab_kernels.parse_device_times("\n".join(output.splitlines()[:-1]), configs)


def test_the_profiler_timer_runs_one_process_a_tree(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd[cmd.index("benchmarks/profile_kernel.py") + 1:])
        lines = [f"KERNEL {c} MarkovWalkKernel 10.0" for c in cmd[cmd.index("--device-times") + 1:]
                 for _ in range(ab_kernels.launches(c))]
        return subprocess.CompletedProcess(cmd, 0, stdout="\n".join(lines), stderr="")

    monkeypatch.setattr(ab_kernels.subprocess, "run", fake_run)
    runs = ab_kernels.measure(tmp_path, ["5003,3,3,greedy", "151936,7,128,greedy"], timer="profiler")
    assert calls == [["--device-times", "5003,3,3,greedy", "151936,7,128,greedy"]]
    assert runs == {"5003,3,3,greedy": [10.0] * 3, "151936,7,128,greedy": [10.0] * 6}


@pytest.mark.parametrize("timer,what", [("ncu", "ncu"), ("profiler", "profile_kernel.py --device-times")])
def test_a_run_that_hangs_is_an_error_that_shows_its_output(monkeypatch, tmp_path, timer, what):
    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"KERNEL 5003,3,3,greedy MarkovWalkKernel 1.0")

    monkeypatch.setattr(ab_kernels.subprocess, "run", hang)
    with pytest.raises(RuntimeError, match=f"{what} in .* ran past 300 s; it printed:\nKERNEL 5003"):
        ab_kernels.measure(tmp_path, ["5003,3,3,greedy"], timer=timer)


def test_tokens_per_config_and_whether_each_tree_matches_the_first():
    printed = "noise\nTOKENS 5003,3,17,greedy tokens=aaa logits=-\nTOKENS 151936,7,64,greedy tokens=bbb logits=-\n"
    assert ab_kernels.parse_tokens(printed) == {"5003,3,17,greedy": "tokens=aaa logits=-",
                                                "151936,7,64,greedy": "tokens=bbb logits=-"}
    fingerprints = {"main": ab_kernels.parse_tokens(printed),
                    "v2": {"5003,3,17,greedy": "tokens=aaa logits=-", "151936,7,64,greedy": "tokens=ccc logits=-"},
                    "v3": {"5003,3,17,greedy": "tokens=aaa logits=-"}}
    table = ab_kernels.tokens_summary(fingerprints, ["5003,3,17,greedy", "151936,7,64,greedy"])
    assert table.splitlines()[2] == ("| 5003,3,17,greedy | tokens=aaa logits=- | tokens=aaa logits=- | tokens=aaa logits=- "
                                     "| yes | yes |")
    assert table.splitlines()[3] == ("| 151936,7,64,greedy | tokens=bbb logits=- | tokens=ccc logits=- | missing "
                                     "| NO | NO |")


def test_trees_whose_folders_share_a_name_are_refused(tmp_path):
    """Two trees named alike would share a build folder (and a column): refused before anything builds."""
    trees = [str(tmp_path / "a" / "main"), str(tmp_path / "b" / "main")]
    done = subprocess.run([sys.executable, "benchmarks/ab_kernels.py", "--out", str(tmp_path), *trees, "--", "5003,3,3,greedy"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert done.returncode == 2 and "distinct names, got ['main', 'main']" in done.stderr


def test_a_log_cut_short_gives_the_table_of_its_finished_rounds(tmp_path):
    """--from-log: a run stopped by a time limit (tree b measured once) still gives its medians."""
    log = tmp_path / "ab_durations.log"
    log.write_text("# python3 benchmarks/profile_kernel.py --device-times CONFIGS, a run a tree of 5003,3,2,greedy "
                   "5003,3,70,greedy\n"
                   "== a round 1: 10.00 11.00 12.00 1.00 2.00 3.00 4.00 5.00 6.00\n"
                   "== b round 1: 20.00 21.00 22.00 1.00 2.00 3.00 4.00 5.00 6.00\n"
                   "== a round 2: 13.00 14.00 15.00 1.00 2.00 3.00 4.00 5.00 6.00\n")
    configs, runs = ab_kernels.rounds_from_log(log.read_text())
    assert configs == ["5003,3,2,greedy", "5003,3,70,greedy"]
    assert [len(r) for r in runs.values()] == [2, 1]
    assert runs["a"][1]["5003,3,2,greedy"] == [13.0, 14.0, 15.0] and runs["b"][0]["5003,3,70,greedy"] == [1, 2, 3, 4, 5, 6]
    assert ab_kernels.summary(runs, configs).splitlines()[2] == "| 5003,3,2,greedy | 12.5 | 21.0 | +68.0 % |"
    with pytest.raises(ValueError, match="launches"):
        ab_kernels.rounds_from_log(log.read_text() + "== b round 2: 1.00\n")
