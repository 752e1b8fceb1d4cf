"""The README's kernel-cost section is what benchmarks/readme_costs.py makes of the committed results."""
from __future__ import annotations

import json

from benchmarks import gpu_report, readme_costs

KERNEL, BF16, EAGER = gpu_report.KERNEL_INT8, gpu_report.ARMS["kernel-bf16"], gpu_report.EAGER


def test_readme_section_matches_the_results():
    assert readme_costs.main(["--check"]) == 0, "run python3 benchmarks/readme_costs.py"


def test_cost_table_has_every_kernel_row_of_the_committed_tables():
    paths = [readme_costs.RESULTS / f"{gpu}.json" for gpu in readme_costs.GPUS]
    tables = [json.loads(path.read_text()) for path in paths if path.exists()]
    assert tables
    for table in tables:
        kernel_rows = [r for r in table["rows"] if r["arm"] in readme_costs.KERNEL_ARMS]
        lines = readme_costs.cost_table(table)
        assert len(lines) == 2 + len(kernel_rows)
        first = kernel_rows[0]
        cells = [c.strip() for c in lines[2].strip("|").split("|")]
        assert cells[9] == f"{first['us'] * 1e3 / (first['batch'] * first['steps']):.0f}"  # ns per draft token


def row(batch, mode, arm, us, **extra):
    return dict(vocab=151936, steps=7, batch=batch, mode=mode, arm=arm, us=us, **extra)


# Published: greedy 60.5 (B = 1), 68.0 (B = 16); probabilistic 80.9 (B = 1).
TABLE = dict(gpu="NVIDIA H100 80GB HBM3", jax="0.11.2", commit="abc1234", rows=gpu_report.complete_rows([
    row(1, "greedy", EAGER, 250.0),
    row(1, "greedy", KERNEL, 50.0, decode_loop_us=70.0, decode_loop_no_cmd_buffer_us=80.0,
        persistent_bytes=117_000_000, scratch_bytes=0),
    row(1, "greedy", BF16, 100.0),
    row(1, "probabilistic", EAGER, 300.0),
    row(1, "probabilistic", KERNEL, 60.0, decode_loop_us=75.0),
    row(1, "greedy-t0", KERNEL, 55.0),
    row(16, "greedy", EAGER, 270.0),
    row(16, "greedy", KERNEL, 90.0),
], 3e12, None))


def test_summary_counts_published_cells_and_ratios_per_mode():
    text = readme_costs.summary(TABLE)
    assert "Over the 4 int8-kernel rows of the table (commit abc1234)" in text
    assert "runs at 3.00x-5.00x the speed of the eager walk" in text
    assert ("greedy: faster on 1 of 2 cells in device time and on 0 of 1 in the decode loop; probabilistic: "
            "faster on 1 of 1 cells in device time and on 1 of 1 in the decode loop") in text
    assert "takes 1.20x-1.20x its greedy walk's time, within the target" in text and "on 1 of 1 rows" in text
    assert "(greedy-t0), its greedy walk takes 1.10x-1.10x" in text
    assert "bf16 walk runs at 2.50x-2.50x" in text
    assert "reaches (not measured) of its design floor" in text  # no probe constants


def test_cost_table_shows_the_decode_loop_the_published_figure_and_memory():
    lines = readme_costs.cost_table(TABLE)
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:5]): [c.strip() for c in line.strip("|").split("|")]
             for line in lines[2:]}
    greedy = cells[("151936", "7", "1", "greedy", "int8")]
    assert greedy[5:9] == ["50.0", "70.0", "80.0", "7.1"] and greedy[10] == "5.00x"
    assert greedy[12:] == ["60.5", "117.0", "0.0"]
    assert cells[("151936", "7", "1", "greedy", "bf16")][12:] == ["", "", ""]  # the published figure is the int8 kernel's
    assert cells[("151936", "7", "1", "greedy-t0", "int8")][10] == ""  # no eager arm in that mode
    assert len(lines) == 2 + 5  # the kernel arms' rows


def test_section_has_each_gpu_whose_results_are_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_costs, "RESULTS", tmp_path)
    assert readme_costs.section() == f"{readme_costs.BEGIN}\n\n{readme_costs.END}"
    (tmp_path / "h100.json").write_text(json.dumps(TABLE))
    text = readme_costs.section()
    assert "#### NVIDIA H100 80GB HBM3" in text and "`benchmarks/results/h100.md`" in text
    assert "Where a step goes" not in text  # no h100_timeline.json
