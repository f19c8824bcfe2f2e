"""Validate the simulator's structure on the machine at hand (``experiment=validate_host``).

1. Single-stream runs of our real engine (concurrency 1): the workload's prompt length (TPOT and
   TTFT) and a second, longer prompt (TTFT): the only numbers the host model is fitted on
   (``research.perf.host_model.fit_host``), as GB10 is fitted on single-request points.
2. The fitted model predicts the concurrency sweep: our engine and scheduler over a simulated
   executor with the real engine's KV pool, the same requests, the same seeds. With
   ``experiment.refit_per_point=true`` step 1 runs again (fresh prompts) right before each
   point, so each prediction comes from single streams of its own minute.
3. The real engine runs the sweep; predicted and measured are printed side by side with the
   error of per-user tok/s, aggregate output tok/s and median TTFT, and the median |error| of
   per-user tok/s over the sweep.

Writes ``results.jsonl`` (measured points, then predicted ones, ``executor`` telling them apart)
and ``validate_host.md`` (the table) into the run directory. A benchmark: its figures depend on
what else the machine is doing, and are printed, never asserted.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from research.bench.report import append_result
from research.config import RunConfig

log = logging.getLogger(__name__)

METRICS = ("per_user_tok_s", "output_throughput", "median_ttft_ms")


class SimulatedBackend:
    """The ``Backend`` of ``experiments.sweep`` over an engine with a simulated executor."""

    def __init__(self, engine: Any, like: Any, label: str):
        self.engine = engine
        self.model_id, self.vocab_size, self.special_ids = (
            like.model_id,
            like.vocab_size,
            like.special_ids,
        )
        self.label = label

    def run(self, requests: list, max_concurrency: int | None, progress: bool) -> Any:
        from research.bench import run_benchmark

        e = self.engine
        return run_benchmark(
            e,
            requests,
            max_concurrency=max_concurrency,
            clock=e.clock,
            # a router of replicas advances its own clock; one engine, its executor's
            sleep=e.sleep if hasattr(e, "sleep") else e.executor.clock.sleep,
        )

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


def _single_stream(run: RunConfig, backend: Any, prompt_len: int, round_: int = 0) -> dict:
    """Median TPOT and TTFT (ms) of ``prompts_per_concurrency`` requests sent one at a time,
    after untimed requests of the same lengths (one, or two per replica behind a router), and the engine's host seconds per step
    (None where the backend does not report it: replicas behind the router, measured over
    HTTP, whose host time is then fitted)."""
    from experiments.sweep import _requests

    w = dataclasses.replace(run.workload, input_len=prompt_len)
    one = dataclasses.replace(run, workload=w)
    # Fresh prompts each round: a repeated fit must not find its prompts in the prefix cache.
    seed = w.seed * 1_000_003 + prompt_len + 7919 * round_
    # Untimed requests first: one per engine is not enough behind a router, which may send the
    # timed ones to a replica that has not run these shapes yet (a compile inside the timing).
    warmups = 2 * run.hardware.num_replicas if run.hardware.num_replicas > 1 else 1
    backend.run(_requests(one, backend, warmups, seed + 7), 1, False)
    before = backend.stats()
    n = run.experiment.prompts_per_concurrency
    result = backend.run(_requests(one, backend, n, seed), 1, False)
    after = backend.stats()
    if failed := [r.error for r in result.records if not r.success]:
        raise ValueError(f"single-stream run at prompt {prompt_len} failed: {failed[0]}")
    if "num_steps" not in after:
        return result.metrics() | {"host_s_per_step": None}
    steps = after["num_steps"] - before["num_steps"]
    host = (after["host_time_s"] - before["host_time_s"]) / steps
    out = result.metrics() | {"host_s_per_step": host}
    if "server_loop_cpu_s" in after:  # replicas: the CPU work outside the engines, per token
        tokens = after["generation_tokens"] - before["generation_tokens"]

        def per_token(*keys: str) -> float:
            return sum(after[k] - before[k] for k in keys) / tokens

        out["server_s_per_token"] = per_token("server_loop_cpu_s")
        out["shared_s_per_token"] = per_token("router_cpu_s", "client_cpu_s")
    return out


def fit_single_stream(run: RunConfig, real: Any, local: Any, round_: int = 0) -> tuple[Any, Any]:
    """The single-stream runs of ``real`` (the workload's prompt and the longest one
    max_model_len takes) and the host model fitted on them, sized as ``local``'s engine (one
    replica's)."""
    from research.perf.engines.serving import from_run
    from research.perf.host_model import NATIVE_GEMM_COMBINE, SingleStream, fit_host

    w, s = run.workload, from_run(run)
    engine = local.llm.engine
    # The second prompt: as long as max_model_len takes. Its decode steps read the most cache a
    # single stream can, so the difference of the two TPOTs (which prices attention's reads)
    # is well above the noise of a shared host; a prompt 4x the workload's (384 tokens over 128)
    # moved TPOT by 0.4-1.0 ms of 9, and two fits minutes apart put attention's reads at 14.3
    # and 6.4 GB/s.
    long_prompt = engine.max_model_len - w.output_len
    if long_prompt <= w.input_len:
        raise ValueError(f"max_model_len {engine.max_model_len} leaves no longer prompt")
    log.info(
        f"[validate_host] {real.label}: single-stream runs (prompts {w.input_len}, {long_prompt})"
    )
    runs = {n: _single_stream(run, real, n, round_) for n in (w.input_len, long_prompt)}

    def mean(key: str) -> float | None:  # over the two runs; None where a run did not measure it
        values = [r.get(key) for r in runs.values()]
        return None if None in values else sum(values) / len(values)

    measured = SingleStream(
        output_len=w.output_len,
        tpot_s={n: r["median_tpot_ms"] / 1e3 for n, r in runs.items()},
        ttft_s={n: r["median_ttft_ms"] / 1e3 for n, r in runs.items()},
        host_s_per_step=mean("host_s_per_step"),
        server_s_per_token=mean("server_s_per_token"),
        shared_s_per_token=mean("shared_s_per_token"),
    )
    model = fit_host(
        run.model.model,
        measured,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=s.block_size,
        quantization=run.quantization.quantization,
        dtype=run.model.dtype,
        attention_backend=local.attention_backend,
        combine=NATIVE_GEMM_COMBINE if engine.executor.gemm_backend == "native" else "max",
    )
    return measured, model


def validate_host(run: RunConfig, out_dir: str | Path) -> list[dict[str, Any]]:
    from experiments.backends import EngineBackend, ReplicasBackend
    from experiments.sweep import fresh_results, point_seeds, run_point
    from research.bench.provenance import provenance, write_csv
    from research.perf.host_model import simulated_engine
    from research.perf.simulated import ReplicaRouter

    if run.executor.kind != "real":
        raise ValueError("experiment=validate_host measures the real engine: use executor=real")
    out_dir = Path(out_dir)
    results = fresh_results(out_dir)
    config = dataclasses.asdict(run)
    t0 = time.perf_counter()
    replicas = run.hardware.num_replicas
    # The engine one replica runs (with one replica: the engine measured): its sizes, pool and
    # attention backend describe each simulated box.
    one = dataclasses.replace(run, hardware=dataclasses.replace(run.hardware, num_replicas=1))
    local = EngineBackend(one)
    # With replicas, everything is measured on the deployment itself (each replica pinned to
    # its share of the cores, behind the router): the single-stream fit included.
    real = ReplicasBackend(run) if replicas > 1 else local
    engine = local.llm.engine
    w = run.workload
    cache = dataclasses.replace(engine.cache_config, num_kv_blocks=engine.block_manager.num_blocks)

    def fitted(round_: int) -> tuple[Any, Any, SimulatedBackend]:
        measured, model = fit_single_stream(run, real, local, round_)
        log.info(f"  {describe_fit(measured, model)}")
        boxes = [
            simulated_engine(model, cache, engine.scheduler_config, engine.max_model_len)
            for _ in range(replicas)
        ]
        sim_engine = (
            ReplicaRouter(boxes, seed=w.seed, routing=run.hardware.routing)
            if replicas > 1
            else boxes[0]
        )
        return measured, model, SimulatedBackend(sim_engine, real, f"host-model {run.model.model}")

    measured, model, sim = fitted(0)
    fits = []
    rows = []
    for i, c in enumerate(run.experiment.concurrencies):
        if run.experiment.refit_per_point and i > 0:
            measured, model, sim = fitted(i)
        fits.append(describe_fit(measured, model))
        predicted = run_point(run, sim, c, progress=False) | {
            "executor": "host-model",
            "host_fit": fits[-1],
            "combine": combine_law(model.combine),
        }
        t = time.perf_counter()
        got = run_point(run, real, c, progress=False)
        for point in (got, predicted):
            point |= provenance(config, point_seeds(run, c))
            append_result(results, point)
        errors = {m: 100.0 * (predicted[m] - got[m]) / got[m] for m in METRICS}
        rows.append({"concurrency": c, "measured": got, "predicted": predicted, "error": errors})
        log.info(
            f"  concurrency {c:>3}: per-user {predicted['per_user_tok_s']:6.1f} predicted, "
            f"{got['per_user_tok_s']:6.1f} measured ({errors['per_user_tok_s']:+.0f}%) "
            f"[{time.perf_counter() - t:.0f} s]"
        )
    if run.experiment.refit_per_point:
        fit_lines = "\n".join(
            f"- before concurrency {c}: {f}"
            for c, f in zip(run.experiment.concurrencies, fits, strict=True)
        )
        table = "fitted again before each point:\n" + fit_lines + "\n\n" + format_validation(rows)
    else:
        table = fits[0] + "\n\n" + format_validation(rows)
    (out_dir / "validate_host.md").write_text(table + "\n")
    write_csv([r[k] for k in ("measured", "predicted") for r in rows], out_dir / "results.csv")
    log.info("\n%s", table)
    log.info(f"results: {results} ({time.perf_counter() - t0:.0f} s)")
    return [r["measured"] for r in rows] + [r["predicted"] for r in rows]


def describe_fit(measured: Any, model: Any) -> str:
    hw, p = model.hw, model.params
    host = "measured" if measured.host_s_per_step is not None else "fitted"
    fitted_on = ", ".join(
        f"prompt {n}: TPOT {measured.tpot_s[n] * 1e3:.1f} ms, TTFT {t * 1e3:.0f} ms"
        for n, t in measured.ttft_s.items()
    )
    outside = ""
    if measured.server_s_per_token is not None:
        outside = (
            f"; per token and stream, server {measured.server_s_per_token * 1e3:.2f} ms and "
            f"router + client {(measured.shared_s_per_token or 0.0) * 1e3:.2f} ms of CPU, measured"
        )
    law = combine_law(model.combine)
    return (
        f"fitted on single-stream runs ({fitted_on}; host {p.per_step_overhead_s * 1e3:.2f} ms "
        f"per step, {host}{outside}) -> {hw.achievable_bandwidth / 1e9:.1f} GB/s, "
        f"{hw.tensor_flops['fp32'] / 1e9:.1f} GFLOP/s, attention FLOPs at "
        f"{p.attention_efficiency:.2f} of that, attention reads at "
        f"{p.attention_read_efficiency * hw.achievable_bandwidth / 1e9:.1f} GB/s; reads and "
        f"arithmetic combined by {law}"
    )


def combine_law(combine: str | dict[str, str]) -> str:
    """A cost model's ``combine`` as a results row gives it: "max", "sum", or per operator
    ("dense_gemm=sum,lm_head=sum"; the others "max")."""
    if isinstance(combine, str):
        return combine
    return ",".join(f"{op}={mode}" for op, mode in sorted(combine.items()))


def format_validation(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| concurrency | per-user tok/s pred | meas | err % | output tok/s pred | meas | err % "
        "| median TTFT ms pred | meas | err % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [str(r["concurrency"])]
        for m in METRICS:
            cells += [
                f"{r['predicted'][m]:.1f}",
                f"{r['measured'][m]:.1f}",
                f"{r['error'][m]:+.1f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    med = statistics.median(abs(r["error"]["per_user_tok_s"]) for r in rows)
    lines.append("")
    lines.append(f"median |error| of per-user tok/s: {med:.1f}%")
    return "\n".join(lines)
