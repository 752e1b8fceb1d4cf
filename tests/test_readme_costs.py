"""The README's kernel-cost section is what benchmarks/readme_costs.py makes of the committed results."""
from __future__ import annotations

from benchmarks import readme_costs


def test_readme_section_matches_the_results():
    assert readme_costs.main(["--check"]) == 0, "run python3 benchmarks/readme_costs.py"


def test_section_reports_every_kernel_row():
    text = readme_costs.section()
    table = readme_costs.json.loads((readme_costs.ROOT / "benchmarks/results/h200.json").read_text())
    kernel_rows = [r for r in table["rows"] if r["arm"] in readme_costs.KERNEL_ARMS]
    assert kernel_rows
    cost_lines = [line for line in text.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(cost_lines) == len(kernel_rows)
    first = kernel_rows[0]
    assert f"{first['us'] * 1e3 / (first['batch'] * first['steps']):.0f}" in cost_lines[0]
