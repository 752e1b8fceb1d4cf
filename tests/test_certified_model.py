"""benchmarks/certified_model.py (CPU): the exact-round model's margins nest, and its report."""
from __future__ import annotations

from benchmarks import certified_model


def test_looser_margins_take_every_exact_round_that_tighter_ones_take():
    # The head's margin is at least every CTA's, so a decision that each CTA's margins leave open stays
    # open with the head's margin for the winner alone, and again with it for every column.
    counts, differ, candidates = certified_model.model(40, vocab=4096, seed=3)
    assert counts["CTA margins"] <= counts["mixed"] <= counts["global margin"] <= 40
    assert counts["global margin"] > 0, "a vocabulary this small leaves some decision open"
    assert 0 <= differ <= counts["CTA margins"], "the exact choice moves only where a round was taken"
    assert len(candidates) == 40 and min(candidates) >= 0


def test_report_names_every_margin_and_batch():
    text = certified_model.report(2)
    for name in ("CTA margins", "global margin", "mixed"):
        assert f"| {name} | " in text
    assert "P(a step of 64 has one)" in text and "of 2 decisions" in text
