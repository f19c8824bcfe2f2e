"""The stored fits (research/perf/data/fits.json) are what the fitters give today: refitting
every one from the public points reproduces them (run ``python -m research.perf.refit
--write`` after changing what the cost model charges)."""

from __future__ import annotations

from dataclasses import replace

from research.perf import fits, refit


def test_stored_fits_match_a_refit():
    fresh = refit.refit()
    diff = refit.differences(fresh, fits.stored_fits())
    assert not diff, (
        "stale research/perf/data/fits.json (python -m research.perf.refit --write):\n"
        + "\n".join(diff)
    )


def test_differences_sees_a_changed_parameter():
    stored = fits.stored_fits()
    changed = dict(stored) | {"gb10": replace(stored["gb10"], per_step_overhead_s=0.004)}
    assert refit.differences(changed, stored) == [
        f"gb10.per_step_overhead_s: refit 0.004, stored {stored['gb10'].per_step_overhead_s:.6g}"
    ]
    assert refit.differences({}, {"x": stored["gb10"]}) == ["x: only in the stored fits"]
