"""experiment=capacity: the largest population whose SLO holds, by simulated runs
(experiments/capacity.py)."""

from __future__ import annotations

import json

import pytest

from experiments.capacity import capacity, evaluate, search
from tests.test_experiments import _compose

# Small and quick: a tenth of the default lengths, short think times, few measured requests.
SMALL = [
    "experiment=capacity",
    "experiment.repeats=2",
    "workload.length_scale=0.1",
    "workload.think_time_s=4.0",
    "experiment.capacity.min_measured_requests=40",
    "experiment.capacity.max_population=64",
    "experiment.capacity.arithmetic_concurrencies=[1,8,32]",
    "experiment.capacity.tolerance=0",
    "experiment.capacity.max_doublings=2",
    "tracking=disabled",
]


def test_capacity_writes_the_count_its_interval_and_the_arithmetic(tmp_path):
    run = _compose(SMALL)
    rows = capacity(run, tmp_path)
    out = json.loads((tmp_path / "capacity.json").read_text())
    assert out["unit"] == "users" and len(out["capacity_per_repeat"]) == 2
    assert out["capacity"] == pytest.approx(sum(out["capacity_per_repeat"]) / 2)
    assert out["slo"] == {"p99_ttft_ms": 3000.0, "min_median_tok_s": 15.0}
    assert out["arithmetic"]["users"] is not None and out["arithmetic"]["duty_cycle"] > 0
    assert len(rows) == len(out["evaluations"]) and (tmp_path / "capacity.png").exists()
    on_disk = (tmp_path / "evaluations.jsonl").read_text().splitlines()
    assert len(on_disk) == len(out["evaluations"])  # each written as it finished
    for seed, best in zip(
        sorted({e["seed"] for e in out["evaluations"]}), out["capacity_per_repeat"], strict=True
    ):
        evals = [e for e in out["evaluations"] if e["seed"] == seed]
        # The answer holds; one more user fails (unless the search hit max_population).
        assert any(e["population"] == best and e["passed"] for e in evals) or best == 0
        if not out["lower_bound"]:
            assert any(e["population"] == best + 1 and not e["passed"] for e in evals)
            assert out["binding_constraint"]


def test_an_slo_nobody_meets_reports_zero_and_names_the_binding_constraint(tmp_path):
    run = _compose([*SMALL, "experiment.repeats=1", "experiment.capacity.slo_p99_ttft_ms=1.0"])
    capacity(run, tmp_path)
    out = json.loads((tmp_path / "capacity.json").read_text())
    assert out["capacity"] == 0 and out["binding_constraint"] == ["p99_ttft"]


def test_search_bisects_to_the_crossing():
    """A fake backend whose SLO holds up to 37 users: the doubling then bisection finds 37 in
    O(log N) evaluations."""
    from experiments import capacity as cap_mod

    run = _compose(SMALL)
    calls = []

    def fake_evaluate(run, backend, n, seed):
        calls.append(n)
        ok = n <= 37
        return cap_mod.Evaluation(
            n, seed, ok, () if ok else ("median_tok_s",), 1.0, 20.0 if ok else 5.0, 50, 0, True, 3
        )

    orig = cap_mod.evaluate
    cap_mod.evaluate = fake_evaluate
    try:
        best, _, lower = search(run, None, 0)
    finally:
        cap_mod.evaluate = orig
    assert (best, lower) == (37, False) and len(calls) <= 2 * 7
    assert calls[:4] == [8, 16, 32, 64]  # doubling from start_population, then bisection


def _records(ttfts_ms, tok_s=20.0, output_len=11):
    """Finished requests with the given TTFTs and a per-user speed of ``tok_s``."""
    from types import SimpleNamespace

    return [
        SimpleNamespace(
            success=True,
            send_time=float(i),
            first_token_time=i + t / 1000,
            finish_time=i + t / 1000 + (output_len - 1) / tok_s,
            output_len=output_len,
        )
        for i, t in enumerate(ttfts_ms)
    ]


def test_the_verdict_reads_the_99th_percentile_ttft():
    """Nearest rank over 100 requests: one slow request in 100 is inside the 99th percentile,
    two are not. Read at the median (or the 98th) the two-slow case would pass."""
    from experiments.capacity import _verdict

    run = _compose(SMALL)  # p99 TTFT <= 3,000 ms, median >= 15 tok/s
    one_slow = _verdict(run, _records([100.0] * 99 + [5000.0]))
    assert one_slow[0] and one_slow[2] == pytest.approx(100.0)
    two_slow = _verdict(run, _records([100.0] * 98 + [5000.0] * 2))
    assert not two_slow[0] and two_slow[1] == ("p99_ttft",)
    assert two_slow[2] == pytest.approx(5000.0) and two_slow[3] == pytest.approx(20.0)
    slow_tokens = _verdict(run, _records([100.0] * 100, tok_s=10.0))
    assert slow_tokens[1] == ("median_tok_s",)


def test_a_killed_search_resumes_from_its_evaluations_on_disk(tmp_path, monkeypatch):
    """Each evaluation is on disk before the next starts; a search killed mid-write resumes
    from the whole lines and runs only the rest; another configuration reuses none."""
    from experiments import capacity as cap_mod
    from experiments.capacity import EvaluationLog

    path = tmp_path / "evaluations.jsonl"
    calls, on_disk = [], []

    def fake_evaluate(run, backend, n, seed):
        on_disk.append(len(path.read_text().splitlines()) if path.exists() else 0)
        calls.append(n)
        ok = n <= 37
        return cap_mod.Evaluation(
            n, seed, ok, () if ok else ("median_tok_s",), 1.5, 20.0 if ok else 5.0, 50, 0, True, 3
        )

    monkeypatch.setattr(cap_mod, "evaluate", fake_evaluate)
    run = _compose(SMALL)
    best, evals, _ = search(run, None, 0, EvaluationLog(path, run))
    full = list(calls)
    assert best == 37 and on_disk == list(range(len(full)))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + lines[3][:25])  # killed writing the fourth
    calls.clear()
    again, evals_again, _ = search(run, None, 0, EvaluationLog(path, run))
    assert (again, evals_again) == (best, evals) and calls == full[3:]
    assert path.read_text().splitlines(keepends=True) == lines
    other = _compose([*SMALL, "experiment.capacity.slo_min_tok_s=10"])
    calls.clear()
    search(other, None, 0, EvaluationLog(path, other))
    assert calls == full


def test_capacity_needs_a_population_and_the_simulator():
    with pytest.raises(ValueError, match="needs a population: workload=chat_sessions"):
        capacity(_compose([*SMALL, "workload=spark"]), "/tmp/unused")
    with pytest.raises(ValueError, match="a capacity SLO needs"):
        _compose(
            [
                *SMALL,
                "experiment.capacity.slo_p99_ttft_ms=null",
                "experiment.capacity.slo_min_tok_s=null",
            ]
        )


def test_evaluate_measures_enough_requests_and_lengthens_when_the_halves_disagree(monkeypatch):
    from experiments import capacity as cap_mod
    from experiments.backends import make_backend

    run = _compose([*SMALL, "experiment.capacity.max_doublings=1"])
    backend = make_backend(run)
    e = evaluate(run, backend, 2, 0)
    assert e.passed and e.converged and e.measured >= 40
    # A verdict that flips between the halves: the run is doubled once, then reported as not
    # converged.
    real = cap_mod._verdict
    state = {"calls": 0}

    def flipping(run, records):
        state["calls"] += 1
        verdict = real(run, records)
        return (state["calls"] % 3 != 0, *verdict[1:])  # whole, first half pass; second fails

    monkeypatch.setattr(cap_mod, "_verdict", flipping)
    flipped = evaluate(run, backend, 2, 0)
    assert not flipped.converged and flipped.turns == 2 * (1 + 1 + 40 // 2)  # twice the first run


# ------------------------------------------------------------------ the configuration search

SEARCH = [
    "experiment=capacity_search",
    "workload.length_scale=0.1",
    "workload.think_time_s=4.0",
    "experiment.capacity.min_measured_requests=40",
    "experiment.capacity.max_population=64",
    "experiment.capacity.start_population=8",
    "experiment.capacity.arithmetic_concurrencies=[1,8]",
    "hydra.sweeper.n_jobs=1",
    "tracking=disabled",
]


def _search(tmp_path, sweep, *extra):
    import os
    import subprocess
    import sys

    from tests.test_experiments import ROOT

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", *SEARCH,
        f"hydra.sweeper.storage=sqlite:///{tmp_path}/study.db", f"hydra.sweep.dir={sweep}", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _trials(tmp_path):
    import optuna

    study = optuna.load_study(
        study_name="capacity_search", storage=f"sqlite:///{tmp_path}/study.db"
    )
    return [(t.number, t.state.name, t.params, t.values) for t in study.trials]


@pytest.mark.slow  # two Optuna multiruns in subprocesses (about 30 s)
def test_a_stopped_search_resumes_from_its_storage_and_infeasible_trials_fail_alone(tmp_path):
    """Two trials, one of them infeasible (utilization 0.05 leaves no room for the KV cache):
    it is a failed trial and the search goes on; run again, the storage keeps both and adds
    the new trial; the sweep ends with its Pareto front."""
    grid = ["hydra.sweeper.params=null", "hydra.sweeper.n_trials=2"]  # this axis alone
    _search(tmp_path, tmp_path / "a", *grid, "hardware.gpu_memory_utilization=choice(0.05,0.85)")
    first = _trials(tmp_path)
    assert sorted(state for _, state, _, _ in first) == ["COMPLETE", "FAIL"]
    failed = next(t for t in first if t[1] == "FAIL")
    assert failed[2] == {"hardware.gpu_memory_utilization": 0.05}
    pareto = json.loads((tmp_path / "a" / "pareto.json").read_text())
    assert [j["failed"] for j in pareto["jobs"]].count(True) == 1 and pareto["best"]["users"] > 0
    # Run again (as after a kill): the same study and search space, one more trial.
    again = ["hydra.sweeper.params=null", "hydra.sweeper.n_trials=1"]
    _search(tmp_path, tmp_path / "b", *again, "hardware.gpu_memory_utilization=choice(0.05,0.85)")
    second = _trials(tmp_path)
    assert second[: len(first)] == first and len(second) == len(first) + 1
    assert second[-1][1] in ("COMPLETE", "FAIL")


def test_a_missing_launcher_plugin_names_the_extra():
    from experiments.run import missing_plugin

    message = missing_plugin(["-m", "hydra/launcher=submitit_slurm"])
    if message is not None:  # not installed here: the error says what to install
        assert "pip install -e '.[slurm]'" in message
    assert missing_plugin(["hydra/launcher=joblib"]) is None  # a dependency: always there
    assert missing_plugin(["model=tiny_llama"]) is None
