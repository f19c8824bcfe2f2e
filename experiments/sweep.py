"""One experiment = a sweep over concurrency on one backend, inside one process.

Compiled step functions are reused across the sweep's points. Each point: an untimed warmup pass
(one request per slot, same lengths: it compiles the shapes the point will use), then
``prompts_per_concurrency * C`` requests in a closed loop at concurrency C (or the workload's
open-loop rate), recorded with the driver of ``research.bench``. Every point becomes one line of
``results.jsonl`` in the run directory, a row of the W&B run, and a row of the printed table;
plots are drawn at the end.

Backends: ``real`` (this project's engine), ``hf`` (HF transformers ``generate`` in static
batches, the peer), ``simulated`` (a cost model of a named machine), ``http`` (an OpenAI-compatible
server, ours or vLLM, over the network): ``experiments.backends``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from experiments.backends import Backend, make_backend
from research.bench.provenance import provenance, write_csv
from research.bench.report import append_result, format_table, result_point
from research.config import RunConfig
from research.tracking import Tracker

log = logging.getLogger(__name__)

TABLE_COLUMNS = (
    "label",
    "max_concurrency",
    "completed",
    "output_throughput",
    "total_token_throughput",
    "per_user_tok_s",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "host_overhead_fraction",
    "new_compilations",
)


def _slos(run: RunConfig) -> dict[str, float] | None:
    e = run.experiment
    slos = {"ttft": e.slo_ttft_ms, "tpot": e.slo_tpot_ms, "e2el": e.slo_e2el_ms}
    slos = {k: v for k, v in slos.items() if v is not None}
    return slos or None


def _requests(run: RunConfig, backend: Backend, n: int, seed: int) -> list[Any]:
    """``n`` requests (or sessions) of the workload: ``experiments.workloads.build_load``."""
    from experiments.workloads import build_load

    return build_load(run, backend, n, seed)


def _attention_reason(backend: Backend) -> str:
    """Why the run's attention backend is the one it is (the executor's choice), or ""."""
    choice = getattr(
        getattr(getattr(backend, "engine", None), "executor", None), "attention_choice", None
    )
    return choice.reason if choice is not None else ""


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0.0)) - float(before.get(key, 0.0))


def run_point(
    run: RunConfig, backend: Backend, concurrency: int, progress: bool = True, repeat: int = 0
) -> dict[str, Any]:
    """Warm up (first repeat only), then benchmark ``prompts_per_concurrency * concurrency``
    requests drawn with the point's seed. A simulated backend starts the point from a fresh
    engine seeded by it (``reset``): the figure depends on the point alone."""
    w, e = run.workload, run.experiment
    # The same seed gives the same prompts to every backend at a given concurrency and repeat.
    seed = point_seeds(run, concurrency, repeat)["prompts"]
    if w.is_sessions and not hasattr(backend, "run_sessions"):
        raise ValueError(
            f"workload {w.dataset!r} runs multi-turn sessions on this project's engine "
            f"(executor=real or simulated), not on {backend.label!r}"
        )
    run_load = backend.run_sessions if w.is_sessions else backend.run
    if e.warmup and repeat == 0:
        n_warmup = e.warmup_prompts_per_concurrency * concurrency
        run_load(_requests(run, backend, n_warmup, seed + 7), concurrency, False)
    if (reset := getattr(backend, "reset", None)) is not None:
        reset(seed)
    requests = _requests(run, backend, e.prompts_per_concurrency * concurrency, seed)
    precompiled = 0
    if not w.is_sessions and (precompile := getattr(backend, "precompile", None)) is not None:
        precompiled = precompile(requests, concurrency)
    executor = _band_executor(run, backend)
    if executor is not None:
        executor.step_log = []
    from research.engine.step import STEP_TRACES

    recording = getattr(backend, "recording_steps", None)
    before, traces = backend.stats(), STEP_TRACES[0]
    with recording() if recording is not None else contextlib.nullcontext([]) as step_log:
        result = run_load(requests, concurrency, progress)
    after, traces = backend.stats(), STEP_TRACES[0] - traces
    if not any(r.success for r in result.records):
        raise ValueError(
            f"every request failed at concurrency {concurrency}; the first: "
            f"{result.records[0].error}"
        )
    steps = _delta(after, before, "num_steps")
    step_time = _delta(after, before, "step_time_s")
    extra: dict[str, Any] = {
        "label": backend.label,
        "quantization": run.quantization.quantization or "none",
        "kv_cache_dtype": run.quantization.kv_cache_dtype,
        "dtype": run.model.dtype,
        "hardware": run.hardware.name,
        "executor": run.executor.kind,
        "attention_backend": getattr(backend, "attention_backend", run.executor.attention_backend),
        "attention_backend_reason": _attention_reason(backend),
        "gemm_backend": getattr(backend, "gemm_backend", run.executor.gemm_backend),
        "num_scheduler_steps": run.executor.num_scheduler_steps,
        "dataset": w.dataset,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "range_ratio": w.range_ratio,
        "experiment": e.name,
        "tensor_parallel_size": run.hardware.tensor_parallel_size,
        "num_replicas": run.hardware.num_replicas,
        "replica_routing": run.hardware.routing if run.hardware.num_replicas > 1 else None,
        "repeat": repeat,
        # The engine's limit on prompt + output, and the configured one where the run raised it
        # to the workload's longest request (experiments.context_len.fit_max_model_len).
        "max_model_len": getattr(
            getattr(backend, "llm", None), "max_model_len", run.model.max_model_len
        ),
        "max_model_len_raised_from": run.model.max_model_len_raised_from,
    }
    # The engine profile, its batch policy and pool; simulated: the routing law and shape of the
    # workload's tokens and the calibration that priced the row (research.perf.engines).
    serving = getattr(backend, "serving", None)
    if serving is not None:
        extra |= serving.row()
    cost_model = getattr(getattr(backend, "engine", None), "executor", None)
    cost_model = getattr(cost_model, "cost_model", None)
    if cost_model is not None:  # simulated: the term that binds a decode step at this point
        from research.perf.cost_model import StepShape
        from research.perf.speculation import binding_term

        context = w.input_len + w.output_len // 2
        extra["binding_term"] = binding_term(cost_model, StepShape(((1, context),) * concurrency))
        if run.speculative.method:
            k = run.speculative.num_speculative_tokens
            spec = StepShape(((1 + k, context),) * concurrency, k * concurrency)
            extra["binding_term_speculative"] = binding_term(cost_model, spec)
    if run.speculative.method:
        drafted = _delta(after, before, "spec_num_draft_tokens")
        accepted = _delta(after, before, "spec_num_accepted_tokens")
        rows = _delta(after, before, "spec_num_drafts")
        extra |= {
            "speculative_method": run.speculative.method,
            "num_speculative_tokens": run.speculative.num_speculative_tokens,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_acceptance_length": 1 + accepted / rows if rows else 0.0,
        }
    if "num_preemptions" in after:
        extra["num_preemptions"] = int(_delta(after, before, "num_preemptions"))
    if "prefix_cache_queries" in after:  # prompt tokens found cached vs computed
        queried = _delta(after, before, "prefix_cache_queries")
        cached = _delta(after, before, "prefix_cache_hits")
        extra |= {
            "prefix_cache_hit_rate": cached / queried if queried else 0.0,
            "cached_prompt_tokens": int(cached),
            "computed_prompt_tokens": int(queried - cached),
            "kv_evictions": int(_delta(after, before, "kv_evictions")),
        }
    if steps and step_time and run.executor.kind == "real":  # (a simulated router: no wall time)
        extra |= {
            "num_steps": int(steps),
            "mean_step_ms": 1000 * step_time / steps,
            "host_overhead_fraction": _delta(after, before, "host_time_s") / step_time,
            # Native CPU kernels' share of the step (0 on XLA's dots and attention); the steps'
            # device time less this is XLA's own work between the kernels.
            "kernel_time_fraction": _delta(after, before, "kernel_time_s") / step_time,
            "new_compilations": int(_delta(after, before, "num_compilations")),
            "compiled_shapes": int(after.get("num_compilations", 0)),
            "forward_passes_per_step": _delta(after, before, "num_forward_passes") / steps,
            "precompiled_shapes": precompiled,
            "step_traces": traces,  # jax traces of the step inside the point: 0 = no compile
        }
        if (roofline := getattr(backend, "roofline", None)) is not None:
            extra |= roofline(step_log, step_time)
    point = result_point(result, model_id=backend.model_id, extra=extra, goodput_slos=_slos(run))
    if executor is not None:
        from research.perf.bands import band_keys, band_variants, retime
        from research.perf.simulated import trace_summary

        log, executor.step_log = executor.step_log, None
        point |= trace_summary(log, sum(r.prompt_len for r in requests))
        variants = band_variants(executor.cost_model)
        point |= band_keys(
            point,
            {k: retime(result, log, v).metrics() for k, v in variants.items()},
            moe=executor.cost_model.cfg.is_moe,
        )
    return point


def _band_executor(run: RunConfig, backend: Backend) -> Any:
    """The simulated executor whose steps the prediction band re-prices, or None."""
    if not run.experiment.prediction_band:
        return None
    if run.executor.kind != "simulated":
        raise ValueError("experiment.prediction_band needs executor=simulated")
    if run.hardware.num_replicas > 1 or math.isfinite(run.workload.request_rate):
        # Re-pricing needs step plans that do not depend on the clock: one box, closed loop.
        log.info("  (no prediction band: it is drawn for a closed loop on one box)")
        return None
    return backend.engine.executor


def point_seeds(run: RunConfig, concurrency: int, repeat: int = 0) -> dict[str, int]:
    """The seeds a point ran with: the model's (init, sampling), the workload's and the one its
    prompts (and a simulated engine's draws) come from (``run_point``): a function of the
    workload seed, the concurrency and the repeat only."""
    w = run.workload
    return {
        "model": run.model.seed,
        "workload": w.seed,
        "prompts": w.seed * 1_000_003 + concurrency + 7919 * repeat,
        "repeat": repeat,
    }


def fresh_results(out_dir: Path) -> Path:
    """``out_dir/results.jsonl`` for a new run: refused if it exists (appending would mix two
    runs' points in one file and one plot)."""
    results = out_dir / "results.jsonl"
    if results.exists():
        raise ValueError(
            f"{results} already exists: a second run into the same output_dir would mix its "
            "points with the first's; choose a new output_dir or remove the old one"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    return results


def point_key(run: RunConfig, concurrency: int, repeat: int) -> str:
    """What makes a simulated point's figures: the resolved config (less where it is written
    and how it is logged), the concurrency, the repeat and its seeds, and the code (commit, and
    the diff of tracked files when the checkout is dirty)."""
    import hashlib

    from research.bench.provenance import code_state

    config = dataclasses.asdict(run)
    config.pop("output_dir", None)
    config.pop("tracking", None)
    blob = json.dumps(
        {
            "config": config,
            "concurrency": concurrency,
            "repeat": repeat,
            "seeds": point_seeds(run, concurrency, repeat),
            "code": code_state(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def completed_points(run: RunConfig, out_dir: Path) -> dict[str, dict[str, Any]]:
    """Points of an earlier, interrupted run of this same simulated config in ``out_dir``, by
    ``point_key``; the file is moved aside (``results.jsonl.partial``) so the run rewrites it in
    order. A file from another config, or from a real run, is refused as ``fresh_results``
    refuses it; a line cut short by the interruption is dropped."""
    results = out_dir / "results.jsonl"
    if run.executor.kind != "simulated" or not results.exists():
        return {}
    done = {}
    for line in results.read_text().splitlines():
        try:
            point = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "point_key" in point:
            done[point["point_key"]] = point
    models = run.experiment.models or (run.model.model,)
    wanted = {
        point_key(dataclasses.replace(run, model=dataclasses.replace(run.model, model=m)), c, r)
        for m in models
        for c in run.experiment.concurrencies
        for r in range(run.experiment.repeats)
    }
    if not done or not set(done) <= wanted:
        return {}  # fresh_results refuses the file
    results.rename(out_dir / "results.jsonl.partial")
    return done


def kv_capacity_line(run: RunConfig, backend: Backend) -> str | None:
    """vLLM's start-up line: KV blocks and tokens, and how many of the workload's requests
    (input_len + output_len tokens; a trace's or session's longest) fit at once. None for peers
    that do not say."""
    from experiments.context_len import longest_request

    engine = getattr(getattr(backend, "llm", None), "engine", None)
    if engine is None:
        return None
    bm, tokens = engine.block_manager, run.workload.input_len + run.workload.output_len
    which = ""
    if (longest := longest_request(run)) is not None:
        tokens, which = longest.tokens, " (the workload's longest)"
    return (
        f"KV cache: {bm.num_blocks} blocks x {bm.block_size} tokens = "
        f"{bm.num_blocks * bm.block_size} tokens; maximum concurrency for "
        f"{tokens}-token requests{which}: {bm.max_concurrency(tokens):.1f}x"
    )


def run_experiment(
    run: RunConfig,
    out_dir: str | Path,
    progress: bool = True,
    job_name: str | None = None,
    group: str | None = None,
    job_type: str = "run",
) -> list[dict]:
    """The whole sweep: results.jsonl, plots and the W&B run land in ``out_dir``. ``job_name``
    names the W&B run (``experiments.run`` passes the job's swept values), ``group`` and
    ``job_type`` place it (``experiments.run.sweep_group``). Experiments that are not a
    concurrency sweep name another runner (``experiments.runners``)."""
    out_dir = Path(out_dir)
    done = completed_points(run, out_dir)
    results = fresh_results(out_dir)
    config = dataclasses.asdict(run)
    (out_dir / "run_config.json").write_text(json.dumps(config, indent=2, default=str))
    models = run.experiment.models or (run.model.model,)
    tracker = Tracker(
        out_dir,
        config,
        mode=run.tracking.wandb_mode,
        project=run.tracking.project,
        name=job_name or " ".join([run.experiment.name, *models]),
        group=group or run.experiment.name,
        job_type=job_type,
        tags=(
            run.experiment.name,
            *models,
            run.executor.kind,
            run.hardware.name,
            run.quantization.quantization or "unquantized",
            run.model.dtype,
            run.engine.name,
        ),
    )
    paths: list[Any] = []
    points = []
    skipped = 0
    repeats = run.experiment.repeats
    total = len(models) * len(run.experiment.concurrencies) * repeats
    try:
        for model in models:
            model_run = dataclasses.replace(run, model=dataclasses.replace(run.model, model=model))
            t0 = time.perf_counter()
            backend = make_backend(model_run)
            log.info(
                f"[{run.experiment.name}] {backend.label}: loaded in {time.perf_counter() - t0:.1f} s"
            )
            capacity = kv_capacity_line(model_run, backend)
            if capacity:
                log.info(f"  {capacity}")
            for c, repeat in ((c, r) for c in run.experiment.concurrencies for r in range(repeats)):
                t = time.perf_counter()
                key = point_key(model_run, c, repeat) if run.executor.kind == "simulated" else None
                if key in done:  # completed by an interrupted run of this same config
                    point = done[key]
                    skipped += 1
                else:
                    point = run_point(model_run, backend, c, progress, repeat)
                    point |= provenance(config, point_seeds(model_run, c, repeat))
                    if key is not None:
                        point["point_key"] = key
                append_result(results, point)
                tracker.log_point(point)
                points.append(point)
                rep = f" repeat {repeat + 1}/{repeats}" if repeats > 1 else ""
                log.info(
                    f"  [{len(points)}/{total}] concurrency {c:>4}{rep}: "
                    f"{point['output_throughput']:8.1f} output tok/s, "
                    f"{_fmt(point.get('per_user_tok_s'))} tok/s per user, median TTFT "
                    f"{point['median_ttft_ms']:.0f} ms ({time.perf_counter() - t:.1f} s)"
                )
                if point.get("num_preemptions"):
                    log.info(
                        f"    {point['num_preemptions']} preemptions: concurrency {c} needs more "
                        "KV cache than the pool holds (requests were recomputed, none lost)"
                    )
            if close := getattr(backend, "close", None):  # replica processes stop here
                close()
        if skipped:
            log.info(f"skipped {skipped} point(s) already complete from an interrupted run")
        table = format_table(points, TABLE_COLUMNS)
        (out_dir / "table.md").write_text(table + "\n")
        write_csv(points, out_dir / "results.csv")
        log.info("\n%s", table)
        if run.tracking.plots:
            from research.bench.plots import plot_all

            paths = plot_all(points, out_dir)
            if any("band_variants" in p for p in points):
                from research.perf.bands import plot_prediction_bands

                paths.append(plot_prediction_bands(points, out_dir / "prediction_bands.png"))
            tracker.log_plots(paths)
            log.info("plots: %s", ", ".join(str(p) for p in paths))
        tracker.log_files([results, out_dir / "results.csv", out_dir / "table.md", *paths])
    finally:
        tracker.finish()
    log.info(f"results: {results}")
    if tracker.run_dir is not None:
        log.info(f"W&B ({run.tracking.wandb_mode}) run: {tracker.run_dir}")
    if sync := tracker.sync_command():
        log.info(f"upload it with: {sync}")
    return points


def _fmt(x: float | None) -> str:
    return "   -" if x is None or not math.isfinite(x) else f"{x:6.1f}"
