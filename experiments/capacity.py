"""``experiment=capacity``: how many users (or agents, or trace requests per minute) one machine
serves at a service level, found by simulation.

The population is the workload: ``chat_sessions`` (users who think between turns, starting a new
conversation every ``workload.turns`` turns; agents a new task every ``workload.turns`` calls; the default
config draws think times from an exponential so a user asks about every two minutes, the
write-up's duty cycle), ``agents``, or a trace whose rate is scaled (the population is then
requests per minute). Every user is active at once (no concurrency cap: an open population),
starting at a uniform offset over one period so they are out of step.

For a population N (``evaluate``): a simulated run long enough that ``min_measured_requests``
requests fall after the warm-up (each user's first ``warmup_turns`` turns and the start spread,
or a trace's first tenth; a run that measured fewer is lengthened), and each user goes through
at least two whole conversations (or agent tasks) after it, so histories reach their steady mix;
the SLO holds when p99 TTFT <= ``slo_p99_ttft_ms`` and the median request's speed
(1000 / its mean TPOT) >= ``slo_min_tok_s``. Convergence: the measured requests are split in
two halves by send time, and while the halves disagree on the verdict the run is doubled (up to
``max_doublings``); the row says whether it converged. The search doubles N from
``start_population`` (8: a handful of users is never the question, and small populations are
the slowest to simulate, one stream at a time) until the SLO fails, then bisects to the largest N that holds (``search``): the metrics worsen with load,
so one crossing is assumed. Each of ``experiment.repeats`` searches draws its own traffic
(seed); the answer is their mean with a 95% bootstrap interval.

Beside it, the write-up's arithmetic (``research.perf.sizing``) on a closed-loop curve of the
same engine: streams at the speed floor, a duty cycle of answer time over the user's period, a
Poisson 99th-percentile margin.

Writes ``evaluations.jsonl`` as the search goes (a line per population tried, with its verdict,
appended as each run finishes), then ``capacity.json`` (the count, its interval, the
arithmetic's count, the binding constraint, the SLO, every evaluation), ``results.jsonl`` (one
row per evaluation) and ``capacity.png`` (the SLO metrics against population, thresholds
dashed). A search started again in the same directory (``hydra.run.dir=<the killed run's
directory>``) reuses the evaluations there whose configuration matches (``fingerprint``) and
runs only the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from research.config import SESSION_DATASETS, TRACE_DATASETS, RunConfig

log = logging.getLogger(__name__)
WARMUP_TRACE_FRACTION = 0.1
EVALUATIONS_FILE = "evaluations.jsonl"
# SLO percentile of time to first token the verdict reads (the 99th: the write-up's tail).
TTFT_PERCENTILE = 0.99


@dataclass(frozen=True)
class Evaluation:
    population: int
    seed: int
    passed: bool
    failing: tuple[str, ...]  # SLO terms that failed: "p99_ttft", "median_tok_s", "refused"
    p99_ttft_ms: float
    median_tok_s: float
    measured: int  # requests in the measured window
    refused: int
    converged: bool
    turns: int  # per user (sessions) or requests (trace)


def _period_s(run: RunConfig) -> float:
    """Mean time between one user's requests at the SLO's speed: answer time plus think (or
    tool) time."""
    w, cap = run.workload, run.experiment.capacity
    speed = cap.slo_min_tok_s or 15.0
    gap = w.tool_time_s if w.dataset == "agents" else w.think_time_s
    return gap + w.output_len * w.length_scale / speed


def _population(run: RunConfig, backend: Any, n: int, turns: int, seed: int) -> tuple[list, float]:
    """(sessions or requests, warm-up seconds) of population ``n``."""
    from research.bench import datasets

    w, cap = run.workload, run.experiment.capacity
    ids = dict(vocab_size=backend.vocab_size, seed=seed, special_ids=backend.special_ids)
    spread = _period_s(run) if cap.start_spread_s is None else cap.start_spread_s

    if w.dataset in SESSION_DATASETS:
        from experiments.workloads import build_load

        pop = build_load(run, backend, n, seed, turns=turns, start_spread_s=spread)
        return pop, spread + cap.warmup_turns * _period_s(run)
    records = datasets.load_trace(w.path if w.dataset == "trace" else w.dataset, w.trace_format)
    records = records[:turns]
    span = records[-1].timestamp_s or 1.0
    per_minute = 60.0 * len(records) / span
    reqs = datasets.trace_requests(
        records, length_scale=w.length_scale, time_scale=per_minute / n, **ids
    )
    return reqs, WARMUP_TRACE_FRACTION * span * per_minute / n


def _verdict(run: RunConfig, records: list) -> tuple[bool, tuple[str, ...], float, float]:
    cap = run.experiment.capacity
    ok = [r for r in records if r.success and r.first_token_time is not None]
    if not ok:
        return False, ("refused",), math.inf, 0.0
    ttfts = sorted(1000 * (r.first_token_time - r.send_time) for r in ok)
    # Nearest rank: the smallest TTFT that at least 99% of the requests do not exceed.
    p99 = ttfts[min(len(ttfts) - 1, math.ceil(TTFT_PERCENTILE * len(ttfts)) - 1)]
    speeds = [
        (r.output_len - 1) / (r.finish_time - r.first_token_time)
        for r in ok
        if r.output_len > 1 and r.finish_time > r.first_token_time
    ]
    median = statistics.median(speeds) if speeds else math.inf
    failing = []
    if cap.slo_p99_ttft_ms is not None and p99 > cap.slo_p99_ttft_ms:
        failing.append("p99_ttft")
    if cap.slo_min_tok_s is not None and median < cap.slo_min_tok_s:
        failing.append("median_tok_s")
    return not failing, tuple(failing), p99, median


def evaluate(run: RunConfig, backend: Any, n: int, seed: int) -> Evaluation:
    """One population's simulated run and its SLO verdict (module notes)."""
    cap, w = run.experiment.capacity, run.workload
    is_sessions = w.dataset in SESSION_DATASETS
    if is_sessions:  # and at least two whole conversations (tasks) per user after the warm-up
        turns = cap.warmup_turns + max(1 + math.ceil(cap.min_measured_requests / n), 2 * w.turns)
    else:
        turns = math.ceil(cap.min_measured_requests / (1 - WARMUP_TRACE_FRACTION))
    for attempt in range(cap.max_doublings + 1):
        backend.reset(seed)
        load, warm_s = _population(run, backend, n, turns, seed)
        if is_sessions:
            result = backend.run_sessions(load, None, False)
        else:
            result = backend.run(load, None, False)
        t0 = result.start_time
        measured = sorted(
            (r for r in result.records if r.send_time - t0 >= warm_s), key=lambda r: r.send_time
        )
        refused = sum(not r.success for r in result.records)
        passed, failing, p99, median = _verdict(run, measured)
        if refused:
            passed, failing = False, (*failing, "refused")
        half = len(measured) // 2
        halves = [_verdict(run, measured[:half])[0], _verdict(run, measured[half:])[0]]
        converged = half > 0 and halves[0] == halves[1]
        enough = len(measured) >= cap.min_measured_requests
        if (converged and enough) or attempt == cap.max_doublings:
            break
        # Twice as long when the halves disagree; else long enough for the measured count.
        grow = 2.0 if not converged else cap.min_measured_requests / max(1, len(measured))
        turns = math.ceil(turns * max(grow, 1.25))
    return Evaluation(
        n, seed, passed, failing, p99, median, len(measured), refused, converged, turns
    )


def fingerprint(run: RunConfig) -> str:
    """What an evaluation's outcome depends on: every config group but tracking, the output
    directory, the repeat count and the experiment's name (a search resumed with more repeats,
    or under another name, reuses what it has)."""
    d = dataclasses.asdict(run)
    del d["tracking"], d["output_dir"]
    d["experiment"] = {k: v for k, v in d["experiment"].items() if k not in ("repeats", "name")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


class EvaluationLog:
    """``evaluations.jsonl``: one line per evaluation, appended (and flushed) as it finishes.
    Opened on a directory that already holds one, it keeps the evaluations whose fingerprint
    matches this configuration; a line cut off by a kill is dropped."""

    def __init__(self, path: Path, run: RunConfig) -> None:
        self.path, self.fingerprint = path, fingerprint(run)
        self.done: dict[tuple[int, int], Evaluation] = {}
        text = path.read_text() if path.exists() else ""
        if text and not text.endswith("\n"):  # a kill mid-write: drop the partial line
            text = text[: text.rfind("\n") + 1]
            path.write_text(text)
        for line in text.splitlines():
            row = json.loads(line)
            if row.get("fingerprint") != self.fingerprint:
                continue
            e = Evaluation(**{f.name: row[f.name] for f in dataclasses.fields(Evaluation)})
            e = dataclasses.replace(e, failing=tuple(e.failing))
            self.done[(e.seed, e.population)] = e
        if self.done:
            log.info(f"[capacity] resuming: {len(self.done)} evaluations from {path}")

    def get(self, seed: int, population: int) -> Evaluation | None:
        return self.done.get((seed, population))

    def add(self, e: Evaluation) -> None:
        self.done[(e.seed, e.population)] = e
        row = dataclasses.asdict(e) | {"fingerprint": self.fingerprint}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def search(
    run: RunConfig, backend: Any, seed: int, done: EvaluationLog | None = None
) -> tuple[int, list[Evaluation], bool]:
    """(largest passing population, evaluations, whether it is only a lower bound: the SLO
    still held at ``max_population``). With ``done``, an evaluation already there is reused
    and each new one is appended as it finishes."""
    cap = run.experiment.capacity
    evals: list[Evaluation] = []

    def ok(n: int) -> bool:
        e = done.get(seed, n) if done is not None else None
        resumed = e is not None
        if e is None:
            e = evaluate(run, backend, n, seed)
            if done is not None:
                done.add(e)
        evals.append(e)
        log.info(
            f"  N={n:>5} seed {seed}{' (resumed)' if resumed else ''}: p99 TTFT "
            f"{e.p99_ttft_ms:,.0f} ms, median "
            f"{e.median_tok_s:.1f} tok/s over {e.measured} requests -> "
            f"{'holds' if e.passed else 'fails (' + ', '.join(e.failing) + ')'}"
            f"{'' if e.converged else ' [halves disagree]'}"
        )
        return e.passed

    lo, hi, n = 0, None, min(cap.start_population, cap.max_population)
    while n <= cap.max_population:
        if ok(n):
            lo, n = n, n * 2
        else:
            hi = n
            break
    if hi is None:
        if lo < cap.max_population and ok(cap.max_population):
            lo = cap.max_population
        return lo, evals, True
    while hi - lo > max(1, cap.tolerance * lo):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, evals, False


def arithmetic(run: RunConfig, backend: Any, seed: int) -> dict[str, Any]:
    """The write-up's sizing on a closed-loop curve of this engine (``research.perf.sizing``)."""
    from research.bench import random_requests
    from research.perf.sizing import duty_cycle, floor_crossing, max_users_for_streams

    w, cap = run.workload, run.experiment.capacity
    if w.dataset not in SESSION_DATASETS:
        return {"users": None, "why": "the write-up's arithmetic sizes users, not a trace's rate"}
    floor = cap.slo_min_tok_s or 15.0
    prompt = round(
        (w.context_len if w.dataset == "agents" else w.system_len + w.input_len) * w.length_scale
    )
    answer = max(1, round(w.output_len * w.length_scale))
    curve = []
    for c in cap.arithmetic_concurrencies:
        backend.reset(seed)
        reqs = random_requests(3 * c, prompt, answer, vocab_size=backend.vocab_size, seed=seed)
        result = backend.run(reqs, c, False)
        curve.append((c, result.metrics()["per_user_tok_s"]))
    streams, lower_bound = floor_crossing(curve, floor)
    gap = w.tool_time_s if w.dataset == "agents" else w.think_time_s
    duty = duty_cycle(answer, floor, 1.0, gap + answer / floor)
    return {
        "users": max_users_for_streams(streams, duty),
        "streams_at_floor": streams,
        "streams_lower_bound": lower_bound,
        "duty_cycle": duty,
        "curve": curve,
        "prompt_tokens": prompt,
        "answer_tokens": answer,
    }


def figure(evals: list[Evaluation], run: RunConfig, best: float, path: Path) -> Path:
    from matplotlib.figure import Figure

    from research.bench import plots

    cap = run.experiment.capacity
    fig = Figure(figsize=(plots.WIDTH_IN, 2.6), layout="constrained")
    ax_ttft, ax_speed = fig.subplots(1, 2)
    for e in sorted(evals, key=lambda e: (e.seed, e.population)):
        color = "tab:green" if e.passed else "tab:red"
        ax_ttft.plot(e.population, e.p99_ttft_ms / 1e3, "o", color=color, markersize=3)
        ax_speed.plot(e.population, e.median_tok_s, "o", color=color, markersize=3)
    if cap.slo_p99_ttft_ms is not None:
        ax_ttft.axhline(cap.slo_p99_ttft_ms / 1e3, linestyle="--", color="grey")
    if cap.slo_min_tok_s is not None:
        ax_speed.axhline(cap.slo_min_tok_s, linestyle="--", color="grey")
    for ax in (ax_ttft, ax_speed):
        ax.axvline(best, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(_unit(run), fontsize=7)
        ax.tick_params(labelsize=6)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("p99 TTFT (s)", fontsize=7)
    ax_speed.set_ylabel("median per-user tok/s", fontsize=7)
    fig.supxlabel(
        f"{run.model.model} on {run.hardware.name}, engine={run.engine.name}, "
        f"{run.workload.dataset}: green holds the SLO, red fails it; dashed: the SLO; "
        f"solid: the capacity found ({best:g})",
        fontsize=plots.CAPTION_FONTSIZE,
    )
    return plots._save(fig, path)


def _unit(run: RunConfig) -> str:
    w = run.workload.dataset
    return (
        "agents" if w == "agents" else "users" if w in SESSION_DATASETS else "requests per minute"
    )


def with_boxes(run: RunConfig) -> RunConfig:
    """``experiment.capacity.boxes`` spent as replicas of ``tensor_parallel_size`` boxes each."""
    boxes, tp = run.experiment.capacity.boxes, run.hardware.tensor_parallel_size
    if boxes is None:
        return run
    if boxes % tp:
        raise ValueError(f"{boxes} boxes do not split into tensor-parallel groups of {tp}")
    hw = dataclasses.replace(run.hardware, num_replicas=boxes // tp)
    return dataclasses.replace(run, hardware=hw)


def objective(out_dir: str | Path) -> tuple[float, float]:
    """What a configuration search optimizes (``capacity.json``): the population served at the
    SLO (maximize) and the p99 TTFT there (minimize), averaged over the repeats."""
    out = json.loads((Path(out_dir) / "capacity.json").read_text())
    at = [
        e["p99_ttft_ms"]
        for e in out["evaluations"]
        for best in out["capacity_per_repeat"]
        if e["population"] == best and e["passed"]
    ]
    return float(out["capacity"]), float(statistics.fmean(at)) if at else math.inf


def capacity(run: RunConfig, out_dir: str | Path, **_: Any) -> list[dict[str, Any]]:
    """The search, repeated, its interval, the arithmetic beside it, and the files (notes)."""
    from experiments.backends import make_backend
    from research.bench.stats import bootstrap_ci

    w = run.workload
    if w.dataset not in (*SESSION_DATASETS, *TRACE_DATASETS):
        raise ValueError(
            f"experiment=capacity needs a population: workload=chat_sessions, agents or a trace "
            f"(got dataset {w.dataset!r})"
        )
    if run.executor.kind != "simulated":
        raise ValueError("experiment=capacity searches in simulation: executor=simulated")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = with_boxes(run)
    backend = make_backend(run)
    done = EvaluationLog(out_dir / EVALUATIONS_FILE, run)
    bests, evals, bounded = [], [], False
    for r in range(run.experiment.repeats):
        seed = w.seed + 1000 * r
        log.info(f"[capacity] search {r + 1}/{run.experiment.repeats} (seed {seed})")
        best, es, lower = search(run, backend, seed, done)
        bests.append(best)
        evals += es
        bounded |= lower
    lo, hi = bootstrap_ci(bests) if len(bests) > 1 else (math.nan, math.nan)
    mean = statistics.fmean(bests)
    binding: set[str] = set()
    for seed in {e.seed for e in evals}:  # what failed just above each search's answer
        fails = [e for e in evals if e.seed == seed and not e.passed]
        if fails:
            binding |= set(min(fails, key=lambda e: e.population).failing)
    binding = sorted(binding)
    arith = arithmetic(run, backend, w.seed)
    cap = run.experiment.capacity
    out = {
        "unit": _unit(run),
        "capacity": mean,
        "capacity_per_repeat": bests,
        "ci95": [lo, hi],
        "lower_bound": bounded,
        "binding_constraint": binding,
        "slo": {"p99_ttft_ms": cap.slo_p99_ttft_ms, "min_median_tok_s": cap.slo_min_tok_s},
        "arithmetic": arith,
        "model": run.model.model,
        "hardware": run.hardware.name,
        "engine": run.engine.name,
        "quantization": run.quantization.quantization,
        "workload": dataclasses.asdict(w),
        "evaluations": [dataclasses.asdict(e) for e in evals],
    }
    (out_dir / "capacity.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    rows = [dataclasses.asdict(e) | {"experiment": run.experiment.name} for e in evals]
    (out_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if run.tracking.plots:
        log.info(f"figure: {figure(evals, run, mean, out_dir / 'capacity.png')}")
    ci = "" if math.isnan(lo) else f" (95% CI {lo:.1f}-{hi:.1f})"
    log.info(
        f"[capacity] {mean:.1f} {_unit(run)}{ci}{' or more' if bounded else ''} at p99 TTFT <= "
        f"{cap.slo_p99_ttft_ms} ms and median >= {cap.slo_min_tok_s} tok/s; binding: "
        f"{', '.join(binding) or 'none (max_population reached)'}; the write-up's arithmetic: "
        f"{arith['users']} {_unit(run)}"
    )
    return rows


__all__ = [
    "Evaluation",
    "EvaluationLog",
    "arithmetic",
    "capacity",
    "evaluate",
    "fingerprint",
    "objective",
    "search",
    "with_boxes",
]
