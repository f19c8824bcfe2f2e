"""One experiment = a sweep over concurrency on one backend, inside one process.

Compiled step functions are reused across the sweep's points. Each point: an untimed warmup pass
(one request per slot, same lengths: it compiles the shapes the point will use), then
``prompts_per_concurrency * C`` requests in a closed loop at concurrency C (or the workload's
open-loop rate), recorded with the driver of ``research.bench``. Every point becomes one line of
``results.jsonl`` in the run directory, a row of the W&B run, and a row of the printed table;
plots are drawn at the end.

Backends: ``real`` (this project's engine), ``hf`` (HF transformers ``generate`` in static
batches, the peer), ``simulated`` (a cost model of a named machine), ``http`` (an OpenAI-compatible
server, ours or vLLM, over the network).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from research.bench import BenchmarkResult, BenchRequest, random_requests, run_benchmark
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


class Backend(Protocol):
    model_id: str
    label: str
    vocab_size: int
    special_ids: tuple[int, ...]

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult: ...

    def stats(self) -> dict[str, Any]: ...


class EngineBackend:
    """This project's engine (``LLM``) on this machine."""

    def __init__(self, run: RunConfig):
        from research.llm import LLM

        m, q, s, c = run.model, run.quantization, run.scheduler, run.cache
        self.simulated = run.executor.kind == "simulated"
        sim = {}
        if self.simulated:
            sim = dict(
                executor="simulated",
                hardware=run.hardware.name,
                gpu_memory_utilization=run.hardware.gpu_memory_utilization,
                tensor_parallel_size=run.hardware.tensor_parallel_size,
                cost_model_options={"moe_routing": run.hardware.moe_routing},
            )
        elif run.hardware.tensor_parallel_size > 1 or run.hardware.num_replicas > 1:
            raise ValueError("several boxes (TP or replicas) are modelled by executor=simulated")
        else:
            from research.engine.compile_cache import enable_compilation_cache

            enable_compilation_cache(run.executor.compilation_cache_dir)

        def make_llm() -> LLM:
            return LLM(
                m.model,
                **sim,
                dtype=m.dtype,
                max_model_len=m.max_model_len,
                seed=m.seed,
                quantization=q.quantization,
                kv_cache_dtype=q.kv_cache_dtype,
                attention_backend=run.executor.attention_backend,
                max_num_seqs=s.max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens,
                scheduling_policy=s.scheduling_policy,
                enable_chunked_prefill=s.enable_chunked_prefill,
                block_size=c.block_size,
                num_kv_blocks=c.num_kv_blocks,
                kv_cache_memory_bytes=c.kv_cache_memory_bytes,
                enable_prefix_caching=c.enable_prefix_caching,
            )

        self.llm = make_llm()
        self.engine = self.llm.engine
        if self.simulated and run.hardware.num_replicas > 1:
            from research.perf.simulated import ReplicaRouter

            engines = [self.engine] + [
                make_llm().engine for _ in range(run.hardware.num_replicas - 1)
            ]
            self.engine = ReplicaRouter(engines, seed=run.workload.seed)
        cfg = self.llm.model_config
        self.model_id = m.model
        engine_name = f"simulated-{run.hardware.name}" if self.simulated else "ours"
        if run.hardware.tensor_parallel_size > 1:
            engine_name += f"-tp{run.hardware.tensor_parallel_size}"
        if run.hardware.num_replicas > 1:
            engine_name += f"-x{run.hardware.num_replicas}"
        self.label = " ".join([engine_name, m.model, *([q.quantization] if q.quantization else [])])
        self.vocab_size = cfg.vocab_size
        tokenizer = self.llm.tokenizer
        special = set(cfg.eos_token_ids)
        if tokenizer is not None:
            special |= set(tokenizer.all_special_ids)
        self.special_ids = tuple(sorted(special))
        self.run_config = run

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        return run_benchmark(
            self.engine,
            requests,
            max_concurrency=max_concurrency,
            **self._load(),
            progress=progress,
            # A simulated executor's virtual clock stamps the engine; waiting advances it.
            clock=self.engine.clock,
            sleep=self._sleep,
        )

    def _load(self) -> dict[str, Any]:
        """The workload's arrival process, as ``run_benchmark`` takes it."""
        w = self.run_config.workload
        return dict(request_rate=w.request_rate, burstiness=w.burstiness, seed=w.seed)

    def precompile(self, requests: list[BenchRequest], concurrency: int) -> int:
        """Compile the step shapes serving ``requests`` will use (predicted by a shadow run of
        the scheduler, ``research.engine.shapes``) so that none compiles inside the timed point;
        returns how many were compiled."""
        if self.simulated or self.run_config.executor.enforce_eager:
            return 0
        from research.engine.shapes import predict_step_shapes

        t0 = time.perf_counter()
        shapes = predict_step_shapes(
            self.engine, requests, max_concurrency=concurrency, **self._load()
        )
        n = self.engine.executor.precompile(shapes)
        if n:
            log.info(
                f"  compiled {n} of the point's {len(shapes)} step shapes before timing it "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        return n

    @contextlib.contextmanager
    def recording_steps(self) -> Iterator[list[Any]]:
        """Yields a list that collects the ``StepShape`` of every step run inside the block."""
        log: list[Any] = []
        if self.simulated:
            yield log
            return
        from research.perf.cost_model import step_shape_from_plan

        executor = self.engine.executor
        execute = executor.execute

        def recorded(plan: Any) -> Any:
            log.append(step_shape_from_plan(plan))
            return execute(plan)

        executor.execute = recorded
        try:
            yield log
        finally:
            del executor.execute

    def roofline(self, shapes: list[Any], seconds: float) -> dict[str, float]:
        """The point's achieved FLOP/s and bytes/s against this machine's measured peaks
        (``research.perf.host_peaks``): the work of the padded calls the executor ran, counted
        by ``research.perf.host_model``, over the steps' wall time. Empty for a model the cost
        model cannot size (a checkpoint path)."""
        from research.perf.host_model import HostCostModel, host_hardware, roofline
        from research.perf.host_peaks import device_peaks

        run = self.run_config
        if (peaks := device_peaks(run.model.dtype)) is None:
            return {}
        try:
            model = HostCostModel(
                run.model.model,
                run.quantization.quantization,
                host_hardware(peaks["bandwidth"], peaks["flops"]),
                max_num_seqs=run.scheduler.max_num_seqs,
                max_num_batched_tokens=run.scheduler.max_num_batched_tokens,
                max_model_len=self.engine.max_model_len,
                block_size=run.cache.block_size,
                dtype=run.model.dtype,
            )
        except ValueError:
            return {}
        return roofline(model, shapes, seconds, peaks)

    def _sleep(self, seconds: float) -> None:
        if not self.simulated:
            time.sleep(seconds)
        elif hasattr(self.engine, "sleep"):  # a router of replicas
            self.engine.sleep(seconds)
        else:
            self.engine.executor.clock.sleep(seconds)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


class HFBackend:
    """HF transformers ``generate`` (greedy, in the run's dtype) in static batches of
    ``max_concurrency``."""

    def __init__(self, run: RunConfig):
        from research.bench.hf_peer import load_hf_model

        dtype = "float32" if run.model.dtype == "auto" else run.model.dtype
        self.model, self.tokenizer = load_hf_model(run.model.model, dtype)
        self.model_id = run.model.model
        self.label = f"hf-transformers {run.model.model}"
        self.vocab_size = int(self.model.config.vocab_size)
        self.special_ids = tuple(sorted(self.tokenizer.all_special_ids)) if self.tokenizer else ()

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        from research.bench.hf_peer import run_hf_benchmark

        return run_hf_benchmark(
            self.model,
            self.tokenizer,
            requests,
            max_concurrency=max_concurrency or len(requests),
            progress=progress,
        )

    def stats(self) -> dict[str, Any]:
        return {}


class HTTPBackend:
    """An OpenAI-compatible server at ``run.executor.base_url`` serving ``run.model.model``,
    driven by the streaming HTTP client. The vocabulary for random prompts is the ``vocab_size``
    our server lists in ``/v1/models``; other servers (vLLM) list none, so 32000 is assumed."""

    def __init__(self, run: RunConfig):
        import httpx

        e = run.executor
        if e.base_url is None:
            raise ValueError("executor=http needs executor.base_url (e.g. http://127.0.0.1:8000)")
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        response = httpx.get(f"{e.base_url.rstrip('/')}/v1/models", headers=headers)
        response.raise_for_status()
        models = {m["id"]: m for m in response.json()["data"]}
        if run.model.model not in models:
            raise ValueError(f"{e.base_url} serves {sorted(models)}, not {run.model.model!r}")
        self.base_url, self.api_key = e.base_url, e.api_key
        self.model_id = run.model.model
        self.label = f"{e.label or 'http'} {run.model.model}"
        self.vocab_size = int(models[run.model.model].get("vocab_size", 32000))
        self.special_ids: tuple[int, ...] = ()
        self.workload = run.workload

    def run(
        self, requests: list[BenchRequest], max_concurrency: int | None, progress: bool
    ) -> BenchmarkResult:
        from research.bench.http_client import run_http_benchmark

        w = self.workload
        return run_http_benchmark(
            self.base_url,
            self.model_id,
            requests,
            max_concurrency=max_concurrency,
            api_key=self.api_key,
            request_rate=w.request_rate,
            burstiness=w.burstiness,
            seed=w.seed,
        )

    def stats(self) -> dict[str, Any]:
        return {}


def make_backend(run: RunConfig) -> Backend:
    kind = run.executor.kind
    if kind in ("real", "simulated"):
        if kind == "simulated" and run.hardware.name == "host":
            raise ValueError("the simulated executor models a named machine: hardware=gb10|h200")
        return EngineBackend(run)
    if kind == "hf":
        if run.quantization.quantization or run.quantization.kv_cache_dtype != "auto":
            raise ValueError("the hf peer runs the unquantized model; use quantization=none")
        return HFBackend(run)
    if kind == "http":
        return HTTPBackend(run)
    raise ValueError(f"executor kind {kind!r} is not available in this sweep")


def _slos(run: RunConfig) -> dict[str, float] | None:
    e = run.experiment
    slos = {"ttft": e.slo_ttft_ms, "tpot": e.slo_tpot_ms, "e2el": e.slo_e2el_ms}
    slos = {k: v for k, v in slos.items() if v is not None}
    return slos or None


def _requests(run: RunConfig, backend: Backend, n: int, seed: int) -> list[BenchRequest]:
    w = run.workload
    return random_requests(
        n,
        w.input_len,
        w.output_len,
        w.range_ratio,
        vocab_size=backend.vocab_size,
        seed=seed,
        special_ids=backend.special_ids,
    )


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0.0)) - float(before.get(key, 0.0))


def run_point(
    run: RunConfig, backend: Backend, concurrency: int, progress: bool = True
) -> dict[str, Any]:
    """Warm up, then benchmark ``prompts_per_concurrency * concurrency`` requests."""
    w, e = run.workload, run.experiment
    # The same seed gives the same prompts to every backend at a given concurrency.
    seed = point_seeds(run, concurrency)["prompts"]
    if e.warmup:
        n_warmup = e.warmup_prompts_per_concurrency * concurrency
        backend.run(_requests(run, backend, n_warmup, seed + 7), concurrency, False)
    requests = _requests(run, backend, e.prompts_per_concurrency * concurrency, seed)
    precompiled = 0
    if (precompile := getattr(backend, "precompile", None)) is not None:
        precompiled = precompile(requests, concurrency)
    executor = _band_executor(run, backend)
    if executor is not None:
        executor.step_log = []
    from research.engine.executor import STEP_TRACES

    recording = getattr(backend, "recording_steps", None)
    before, traces = backend.stats(), STEP_TRACES[0]
    with recording() if recording is not None else contextlib.nullcontext([]) as step_log:
        result = backend.run(requests, concurrency, progress)
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
        "attention_backend": run.executor.attention_backend,
        "scheduling_policy": run.scheduler.scheduling_policy,
        "block_size": run.cache.block_size,
        "max_num_seqs": run.scheduler.max_num_seqs,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "range_ratio": w.range_ratio,
        "experiment": e.name,
    }
    if "num_preemptions" in after:
        extra["num_preemptions"] = int(_delta(after, before, "num_preemptions"))
    if steps and run.executor.kind == "real":
        extra |= {
            "num_steps": int(steps),
            "mean_step_ms": 1000 * step_time / steps,
            "host_overhead_fraction": _delta(after, before, "host_time_s") / step_time,
            "new_compilations": int(_delta(after, before, "num_compilations")),
            "precompiled_shapes": precompiled,
            "step_traces": traces,  # jax traces of the step inside the point: 0 = no compile
        }
        if (roofline := getattr(backend, "roofline", None)) is not None:
            extra |= roofline(step_log, step_time)
    point = result_point(result, model_id=backend.model_id, extra=extra, goodput_slos=_slos(run))
    if executor is not None:
        from research.perf.bands import band_keys, band_variants, retime

        log, executor.step_log = executor.step_log, None
        variants = band_variants(executor.cost_model)
        point |= band_keys(
            point, {k: retime(result, log, v).metrics() for k, v in variants.items()}
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


def point_seeds(run: RunConfig, concurrency: int) -> dict[str, int]:
    """The seeds a point ran with: the model's (init, sampling), the workload's and the one its
    prompts were drawn from (``run_point``)."""
    w = run.workload
    return {
        "model": run.model.seed,
        "workload": w.seed,
        "prompts": w.seed * 1_000_003 + concurrency,
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


def kv_capacity_line(run: RunConfig, backend: Backend) -> str | None:
    """vLLM's start-up line: KV blocks and tokens, and how many of the workload's requests
    (input_len + output_len tokens) fit at once. None for peers that do not say."""
    engine = getattr(getattr(backend, "llm", None), "engine", None)
    if engine is None:
        return None
    bm, w = engine.block_manager, run.workload
    per_request = -(-(w.input_len + w.output_len) // bm.block_size)
    return (
        f"KV cache: {bm.num_blocks} blocks x {bm.block_size} tokens = "
        f"{bm.num_blocks * bm.block_size} tokens; maximum concurrency for "
        f"{w.input_len + w.output_len}-token requests: {bm.num_blocks / per_request:.1f}x"
    )


def run_experiment(
    run: RunConfig, out_dir: str | Path, progress: bool = True, job_name: str | None = None
) -> list[dict]:
    """The whole sweep: results.jsonl, plots and the W&B run land in ``out_dir``. ``job_name``
    names the W&B run (``experiments.run`` passes the job's overrides).
    ``experiment=validate_host`` runs ``experiments.validate_host`` instead."""
    if run.experiment.name == "validate_host":
        from experiments.validate_host import validate_host

        return validate_host(run, out_dir)
    out_dir = Path(out_dir)
    results = fresh_results(out_dir)
    config = dataclasses.asdict(run)
    (out_dir / "run_config.json").write_text(json.dumps(config, indent=2, default=str))
    models = run.experiment.models or (run.model.model,)
    tracker = Tracker(
        out_dir,
        config,
        mode=run.tracking.wandb_mode,
        project=run.tracking.project,
        name=job_name or f"{run.experiment.name}-{'-'.join(models)}",
        group=run.experiment.name,
        tags=(
            run.experiment.name,
            *models,
            run.executor.kind,
            run.hardware.name,
            run.quantization.quantization or "unquantized",
            run.model.dtype,
            run.scheduler.scheduling_policy,
        ),
    )
    paths: list[Any] = []
    points = []
    total = len(models) * len(run.experiment.concurrencies)
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
            for c in run.experiment.concurrencies:
                t = time.perf_counter()
                point = run_point(model_run, backend, c, progress)
                point |= provenance(config, point_seeds(model_run, c))
                append_result(results, point)
                tracker.log_point(point)
                points.append(point)
                log.info(
                    f"  [{len(points)}/{total}] concurrency {c:>4}: "
                    f"{point['output_throughput']:8.1f} output tok/s, "
                    f"{_fmt(point.get('per_user_tok_s'))} tok/s per user, median TTFT "
                    f"{point['median_ttft_ms']:.0f} ms ({time.perf_counter() - t:.1f} s)"
                )
                if point.get("num_preemptions"):
                    log.info(
                        f"    {point['num_preemptions']} preemptions: concurrency {c} needs more "
                        "KV cache than the pool holds (requests were recomputed, none lost)"
                    )
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
