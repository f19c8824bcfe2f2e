"""Prefill and time to first token against public GB10 measurements, per engine and format.

Each ``kind=prefill`` record of ``data/gb10_public.json`` is one prompt of ``input_len`` tokens
at batch 1, replayed as the engine runs it: the engine profile's kernels for the format on GB10
(``research.perf.gemm``; a source's own build flags, such as a CUTLASS MXFP4 build, override
them: ``SOURCE_KERNELS``), its token budget cutting the prompt into prefill steps, its
calibration's parameters. Metrics:

- ``prefill_tok_s``: prompt tokens over the prefill steps' time;
- ``ttft_ms``: the prefill steps plus the request path (``CostParams.request_path_s``).

Fit, declared: per source with TTFT at several prompt lengths, ``request_path_s`` on its
shortest prompt (the point where the path is most of the TTFT); every other point is predicted
with the engine's calibration as is (no prefill point of these sources was used by any fit).
Records whose prompt length the source does not print carry ``input_len_assumed`` and are
reported apart. ``python -m research.perf.validation_prefill`` prints the table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from research.perf.cost_model import CostModel, StepShape
from research.perf.measurements import DATA, Row, records
from research.perf.params import CostParams

# Build flags of a source that change the kernels its engine profile runs.
SOURCE_KERNELS: dict[str, dict[str, str]] = {
    # christopherowen/vllm mxfp4_v2: --mxfp4-backend CUTLASS --mxfp4-layers moe,qkv,o,lm_head
    "jaim_readme": {"dense": "cutlass_fp4", "expert": "cutlass_fp4"},
}
SOURCE_OPTIONS: dict[str, dict[str, Any]] = {
    "jaim_readme": {
        "quantized_weights": ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"),
        "kv_cache_dtype": "fp8",
    },
}


@dataclass(frozen=True)
class PrefillPoint:
    source: str
    preset: str
    engine: str
    quantization: str
    input_len: int
    metric: str  # "ttft_ms" | "prefill_tok_s"
    published: float
    assumed_len: bool = False

    @property
    def label(self) -> str:
        mark = " (length assumed)" if self.assumed_len else ""
        return f"{self.preset} {self.quantization} {self.metric} at {self.input_len}{mark}"


def load_prefill_points() -> tuple[PrefillPoint, ...]:
    return tuple(
        PrefillPoint(
            r["source"],
            r["preset"],
            r["engine"],
            r["quantization"],
            int(r["input_len"]),
            r["metric"],
            float(r["value"]),
            bool(r.get("input_len_assumed", False)),
        )
        for r in records(DATA)
        if r.get("kind") == "prefill"
    )


def cost_model(p: PrefillPoint, params: CostParams | None = None) -> tuple[CostModel, int]:
    """The point's engine on GB10 as ``resolve`` gives it (kernels, calibration), with the
    source's build flags; and the engine's prefill step size (its token budget)."""
    from research.perf.engines import resolve

    s = resolve(p.engine, "gb10", model=p.preset, quantization=p.quantization,
                max_model_len=max(p.input_len + 1, 2048))  # fmt: skip
    options = dict(s.cost_model_options)
    if p.source in SOURCE_KERNELS:
        options["gemm_kernels"] = SOURCE_KERNELS[p.source]
    options |= SOURCE_OPTIONS.get(p.source, {})
    if params is not None:
        options["params"] = params
    return CostModel(p.preset, s.quantization, "gb10", **options), s.max_num_batched_tokens


def prefill_seconds(cm: CostModel, prompt: int, budget: int) -> float:
    """The prompt's prefill steps: chunks of ``budget`` tokens, each after the ones before."""
    total, start = 0.0, 0
    while start < prompt:
        n = min(budget, prompt - start)
        total += cm.step_time(StepShape.prefill(n, start))
        start += n
    return total


def predict(p: PrefillPoint, params: CostParams | None = None) -> float:
    cm, budget = cost_model(p, params)
    seconds = prefill_seconds(cm, p.input_len, budget)
    if p.metric == "prefill_tok_s":
        return p.input_len / seconds
    return (seconds + cm.params.request_path_s) * 1e3


def validate() -> tuple[list[Row], dict[str, CostParams]]:
    """Per source: ``request_path_s`` fitted on the shortest TTFT point where the source has
    TTFT at two or more lengths; every point predicted (module docstring)."""
    points = load_prefill_points()
    rows, fitted = [], {}
    for source in dict.fromkeys(p.source for p in points):
        pts = sorted((p for p in points if p.source == source), key=lambda p: p.input_len)
        ttft = [p for p in pts if p.metric == "ttft_ms"]
        params = None
        if len(ttft) >= 2:
            anchor = ttft[0]
            cm, budget = cost_model(anchor)
            path = anchor.published / 1e3 - prefill_seconds(cm, anchor.input_len, budget)
            params = replace(cm.params, request_path_s=max(0.0, path))
            fitted[source] = params
        for p in pts:
            is_anchor = bool(ttft) and len(ttft) >= 2 and p is ttft[0]
            rows.append(Row(p, predict(p, params), is_anchor))
    return rows, fitted


def summary_rows(rows: list[Row]) -> list[dict[str, Any]]:
    """One results row per point (what ``experiment=validate_gb10`` writes)."""
    return [
        {
            "engine": r.point.engine,
            "source": r.point.source,
            "model": r.point.preset,
            "point": r.point.label,
            "metric": f"prefill_{r.point.metric}",
            "published": r.point.published,
            "predicted": r.predicted,
            "error": r.error,
            "fitted": r.fitted,
            "length_assumed": r.point.assumed_len,
        }
        for r in rows
    ]


def format_report(rows: list[Row], fitted: dict[str, CostParams]) -> str:
    lines = [
        "| source | engine | point | published | predicted | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        mark = " (fitted: request path)" if r.fitted else ""
        lines.append(
            f"| {r.point.source} | {r.point.engine} | {r.point.label}{mark} | "
            f"{r.point.published:.0f} | {r.predicted:.0f} | {r.error:+.1%} |"
        )
    for source, p in fitted.items():
        lines.append(f"\n{source}: request path fitted {p.request_path_s * 1e3:.0f} ms")
    for engine in sorted({r.point.engine for r in rows}):
        errs = [abs(r.error) for r in rows if r.point.engine == engine and not r.fitted]
        if errs:
            lines.append(
                f"\n{engine}: {len(errs)} points not fitted, median |error| "
                f"{statistics.median(errs):.1%}, worst {max(errs):.1%}"
            )
    return "\n".join(lines)


def main() -> None:
    print(format_report(*validate()))


if __name__ == "__main__":
    main()
