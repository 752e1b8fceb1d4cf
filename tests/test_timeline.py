"""benchmarks/timeline.py's summary of the timeline build's stamps, on stamps made here (no GPU)."""
import numpy as np
import pytest

from benchmarks import timeline

CTAS, STEPS, WARPS = 3, 2, 4
MAX_STEPS, PHASES, MAX_WARPS = 16, 6, 16  # the timeline build's layout (read_timeline states it)


def stamps(rng):
    """Phases and warp stamps (ns) of a 2-step walk of 3 CTAs: each phase and the per-warp scoring times
    drawn at random, the warps of a CTA done between the start of its score phase and the end of its
    reduction; unstamped words (later steps, absent warps) are 0, as the kernel leaves them."""
    phases = np.zeros((CTAS, MAX_STEPS + 1, PHASES), np.int64)
    warps = np.zeros((CTAS, MAX_STEPS, MAX_WARPS), np.int64)
    for c in range(CTAS):
        t = 1_000_000 + int(rng.integers(0, 500))
        for k in range(STEPS + 1):
            for p in range(PHASES if k < STEPS else 4):
                t += int(rng.integers(100, 3000))
                phases[c, k, p] = t
            if k < STEPS:
                score_start, reduced = phases[c, k, 3], phases[c, k, 4]
                warps[c, k, :WARPS] = rng.integers(score_start, reduced, WARPS)
    return phases, warps


def test_after_scoring_is_the_reduction_past_the_last_warp():
    rng = np.random.default_rng()
    phases, warps = stamps(rng)
    rows, totals = timeline.summarize(phases, warps, STEPS)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for k, r in enumerate(rows):
        last = warps[:, k, :WARPS].max(axis=1)
        first = warps[:, k, :WARPS].min(axis=1)
        assert r["after_scoring"] == pytest.approx(np.median(phases[:, k, 4] - last) / 1e3)
        assert r["warp_spread"] == pytest.approx(np.median(last - first) / 1e3)
        assert r["score"] == pytest.approx(np.median(phases[:, k, 4] - phases[:, k, 3]) / 1e3)
        assert 0 < r["after_scoring"] < r["score"]
    assert totals["kernel_us"] == pytest.approx((phases.max() - phases[:, 0, 0].min()) / 1e3)


def test_render_has_the_after_scoring_column():
    rng = np.random.default_rng()
    rows, totals = timeline.summarize(*stamps(rng), STEPS)
    report = dict(command="c", gpu="g", jax="j", commit="x",
                  configs=[dict(vocab=5003, steps=STEPS, batch=1, mode="greedy", head="certified", steps_us=rows,
                                **totals)])
    text = timeline.render(report)
    header = next(line for line in text.splitlines() if line.startswith("| step |"))
    cells = header.strip("|").split("|")
    assert "after scoring" in header
    row0 = next(line for line in text.splitlines() if line.startswith("| 0 |"))
    values = row0.strip("|").split("|")
    assert len(values) == len(cells)
    assert float(values[cells.index(" after scoring ")]) == pytest.approx(rows[0]["after_scoring"], abs=0.006)


def test_render_states_a_certified_walks_counters():
    rng = np.random.default_rng()
    rows, totals = timeline.summarize(*stamps(rng), STEPS)
    counts = {name: int(rng.integers(0, 100)) for name in ("decisions", "exact_rounds", "rescored")}
    config = dict(vocab=5003, steps=STEPS, batch=1, mode="greedy", steps_us=rows, **totals)
    report = dict(command="c", gpu="g", jax="j", commit="x",
                  configs=[dict(config, head="certified", certified_counts=counts), dict(config, head="int8")])
    sections = timeline.render(report).split("\n## ")[1:]
    assert len(sections) == 2
    stated = [line for line in sections[0].splitlines() if line.startswith("the certified walk's counters")]
    assert stated and all(f"{name} {n}" in stated[0] for name, n in counts.items())
    assert "counters" not in sections[1]
