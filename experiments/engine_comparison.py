"""``experiment=engine_comparison``: which engine should a shared DGX Spark run?

Every engine profile (``experiment.engines``: vLLM, SGLang, llama.cpp's server, Ollama, static
batches) serves every model of ``experiment.models`` on the simulated machine, over the
concurrency sweep, in each topology of ``experiment.topologies``:

- ``one``: one box;
- ``tp2``: two boxes as one tensor-parallel group (``hardware.tensor_parallel_size=2``), for the
  engines that shard a model across nodes (vLLM and SGLang; llama.cpp's RPC backend splits
  layers, not tensors, and is not modelled);
- ``replicas2``: two boxes, one engine each, behind a proxy that routes every request to a
  random one (``hardware.num_replicas=2``, ``hardware.routing=random``).

Each model runs in the weight format a GB10 owner would give it (``experiment.model_formats``;
GGUF engines run the GGUF file of that width, ``research.perf.engines.profiles.GGUF_WEIGHTS``).
Every cell is the ordinary concurrency sweep (``experiments.sweep.run_experiment``: the same
scheduler, pool sizing and cost model as any simulated run) in ``<out>/<model>/<topology>/
<engine>``; its rows carry the engine profile, routing law and shape, and calibration.

Written to ``out_dir``: ``results.jsonl`` (every point, with ``topology``), ``table.md`` (per
model, topology and engine: per-user and aggregate tok/s and median TTFT at each concurrency,
with the prediction band where one is drawn), and one figure per model and topology
(``engines_<model>_<topology>.png``: one line per engine, band shaded; the band is drawn for
one box only, as ``experiment.prediction_band`` says).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from research.config import ENGINE_NAMES, RunConfig

log = logging.getLogger(__name__)

TOPOLOGIES = ("one", "tp2", "replicas2")
TP_ENGINES = ("vllm", "sglang")  # engines that shard one model across two nodes


def cell_run(run: RunConfig, model: str, engine: str, topology: str) -> RunConfig:
    """The ``RunConfig`` of one cell: ``run`` with the model, its weight format, the engine and
    the topology's hardware settings."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; expected one of {TOPOLOGIES}")
    if engine not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINE_NAMES}")
    formats = run.experiment.model_formats
    if model not in formats:
        raise ValueError(
            f"experiment.model_formats has no weight format for {model!r} (it has "
            f"{sorted(formats)}); add one, e.g. experiment.model_formats.{model}=awq"
        )
    fmt = formats[model]
    hw = run.hardware
    if topology == "tp2":
        hw = dataclasses.replace(hw, tensor_parallel_size=2, num_replicas=1)
    elif topology == "replicas2":
        hw = dataclasses.replace(hw, tensor_parallel_size=1, num_replicas=2, routing="random")
    else:
        hw = dataclasses.replace(hw, tensor_parallel_size=1, num_replicas=1)
    return dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, model=model),
        quantization=dataclasses.replace(
            run.quantization, quantization=None if fmt == "none" else fmt
        ),
        engine=dataclasses.replace(run.engine, name=engine),
        hardware=hw,
        experiment=dataclasses.replace(run.experiment, models=(model,), runner="sweep"),
        tracking=dataclasses.replace(run.tracking, plots=False),
    )


def cells(run: RunConfig) -> list[tuple[str, str, str]]:
    """(model, topology, engine) of every cell the experiment runs, in order."""
    out = []
    for model in run.experiment.models or (run.model.model,):
        for topology in run.experiment.topologies:
            for engine in run.experiment.engines:
                if topology == "tp2" and engine not in TP_ENGINES:
                    continue
                out.append((model, topology, engine))
    return out


def _fmt_band(p: dict[str, Any], metric: str, digits: int = 1) -> str:
    v = p[metric]
    lo, hi = p.get(f"band_{metric}_lo"), p.get(f"band_{metric}_hi")
    text = f"{v:.{digits}f}"
    return text if lo is None else f"{text} [{lo:.{digits}f}, {hi:.{digits}f}]"


def format_table(points: list[dict[str, Any]], concurrencies: tuple[int, ...]) -> str:
    """Markdown: one row per (model, topology, engine), per-user tok/s at each concurrency (band
    in brackets), then aggregate tok/s and median TTFT at the largest concurrency."""
    top = max(concurrencies)
    head = (
        "| model | topology | engine | weights | "
        + " | ".join(f"tok/s/user C={c}" for c in concurrencies)
        + f" | aggregate tok/s C={top} | median TTFT s C={top} |"
    )
    lines = [head, "|" + "---|" * (5 + len(concurrencies) + 1)]
    keys = sorted(
        {(p["model"], p["topology"], p["engine"]) for p in points},
        key=lambda k: (k[0], TOPOLOGIES.index(k[1]), k[2]),
    )
    for model, topology, engine in keys:
        pts = {
            p["max_concurrency"]: p
            for p in points
            if (p["model"], p["topology"], p["engine"]) == (model, topology, engine)
        }
        any_point = next(iter(pts.values()))
        cols = [_fmt_band(pts[c], "per_user_tok_s") if c in pts else "-" for c in concurrencies]
        last = pts.get(top)
        agg = _fmt_band(last, "output_throughput", 0) if last else "-"
        ttft = f"{last['median_ttft_ms'] / 1e3:.2f}" if last else "-"
        lines.append(
            f"| {model} | {topology} | {engine} | {any_point.get('weight_format', '-')} | "
            + " | ".join(cols)
            + f" | {agg} | {ttft} |"
        )
    return "\n".join(lines)


def engine_comparison(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict[str, Any]]:
    """Every cell's sweep, then the combined results, table and figures (module notes)."""
    from experiments.sweep import fresh_results, run_experiment
    from research.bench.report import append_result

    out_dir = Path(out_dir)
    results = fresh_results(out_dir)
    todo = cells(run)
    points: list[dict[str, Any]] = []
    for i, (model, topology, engine) in enumerate(todo, 1):
        log.info(f"[engine_comparison] {i}/{len(todo)}: {model}, {topology}, {engine}")
        cell = cell_run(run, model, engine, topology)
        cell_dir = out_dir / model / topology / engine
        name = f"{run.experiment.name} {model} {topology} {engine}"
        group = kw.get("group") or run.experiment.name
        for p in run_experiment(cell, cell_dir, False, job_name=name, group=group, job_type="cell"):
            p = p | {"topology": topology, "label": engine}
            append_result(results, p)
            points.append(p)
    table = format_table(points, run.experiment.concurrencies)
    (out_dir / "table.md").write_text(table + "\n")
    log.info("\n%s", table)
    if run.tracking.plots:
        from research.perf.bands import plot_prediction_bands

        for model in dict.fromkeys(p["model"] for p in points):
            for topology in dict.fromkeys(p["topology"] for p in points):
                pts = [p for p in points if (p["model"], p["topology"]) == (model, topology)]
                if pts:
                    path = out_dir / f"engines_{model}_{topology}.png"
                    log.info(f"figure: {plot_prediction_bands(pts, path)}")
    log.info(f"results: {results}")
    return points


__all__ = ["TOPOLOGIES", "TP_ENGINES", "cell_run", "cells", "engine_comparison", "format_table"]
