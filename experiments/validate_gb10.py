"""``experiment=validate_gb10``: the simulator against public GB10 measurements, per engine
profile, through the same profiles, routing laws and calibrations every experiment runs
(``research.perf.engines``).

- ``llama_cpp``: llama.cpp's DGX Spark page (``llama-batched-bench``, ``llama-bench``; three
  revisions, four models), replayed by ``research.perf.validation``;
- ``vllm``: published vLLM concurrency curves, replayed through our engine and scheduler by
  ``research.perf.validation_vllm``;
- prefill and TTFT per engine and format (vLLM, llama.cpp, Ollama, SGLang), priced by the
  kernels each engine runs: ``research.perf.validation_prefill``.

Writes ``results.jsonl`` (one row per published point: engine, source, model, point, published,
predicted, signed error, whether it was fitted, routing law and shape, calibration),
``validation.md`` (the full report) and ``summary.json`` (per engine: points not fitted, median
and worst absolute error). ``SUMMARY_PATH`` keeps the summary the docs quote; a test recomputes
it.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from research.config import RunConfig

log = logging.getLogger(__name__)
SUMMARY_PATH = Path(__file__).parents[1] / "research" / "perf" / "data" / "validation_summary.json"


def llama_cpp_rows() -> tuple[list[dict[str, Any]], str]:
    from research.perf import validation
    from research.perf.engines.calibration import LLAMA_CPP_REVISION
    from research.perf.routing import routing_for

    rows, params = validation.validate()
    out = []
    for r in rows:
        preset = validation.GGUF_MODELS[r.point.model][0]
        law, shape = routing_for(preset, validation.TOKEN_SOURCE)
        out.append(
            {
                "engine": "llama_cpp",
                "source": r.point.source,
                "model": r.point.model,
                "point": r.point.label,
                "published": r.point.published,
                "predicted": r.predicted,
                "error": r.error,
                "fitted": r.fitted,
                "first_timed_run": validation.first_timed_run(r.point),
                "moe_routing": law,
                "routing_shape": shape,
                "token_source": validation.TOKEN_SOURCE,
                "calibration": f"gb10/llama_cpp: fitted per model and revision "
                f"({LLAMA_CPP_REVISION} is what engine=llama_cpp experiments use)",
            }
        )
    return out, validation.format_report(rows, params)


def vllm_rows() -> tuple[list[dict[str, Any]], str]:
    from research.perf import validation_vllm

    rows, params = validation_vllm.validate()
    out = []
    for r in rows:
        serve = validation_vllm.serving(r.point.source)
        out.append(
            {
                "engine": "vllm",
                "source": r.point.source,
                "model": r.point.model,
                "point": r.point.label,
                "published": r.point.published,
                "predicted": r.predicted,
                "error": r.error,
                "fitted": r.fitted,
                "first_timed_run": False,
                "moe_routing": serve.routing,
                "routing_shape": serve.routing_shape,
                "token_source": serve.token_source,
                "calibration": serve.calibration + " (bandwidth refitted on the curve's C=1)",
            }
        )
    return out, validation_vllm.format_report(rows, params, ablation=False)


def prefill_rows() -> tuple[list[dict[str, Any]], str]:
    from research.perf import validation_prefill

    rows, fitted = validation_prefill.validate()
    return validation_prefill.summary_rows(rows), validation_prefill.format_report(rows, fitted)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine and per source: points not fitted, median and worst |error| over them.
    Prefill and TTFT points (``metric`` starting ``prefill_``) are summarized apart, per
    engine as ``<engine>/prefill_ttft`` (points whose prompt length the source does not print
    count only in ``<engine>/prefill_ttft_length_assumed``)."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r["fitted"]:
            continue
        if str(r.get("metric", "")).startswith("prefill_"):
            key = "prefill_ttft_length_assumed" if r.get("length_assumed") else "prefill_ttft"
            groups.setdefault(f"{r['engine']}/{key}", []).append(abs(r["error"]))
        else:
            groups.setdefault(r["engine"], []).append(abs(r["error"]))
            groups.setdefault(f"{r['engine']}/{r['source']}", []).append(abs(r["error"]))
    for key, errors in sorted(groups.items()):
        out[key] = {
            "points": len(errors),
            "median_abs_error": round(statistics.median(errors), 4),
            "worst_abs_error": round(max(errors), 4),
        }
    return out


def validate_gb10(run: RunConfig, out_dir: str | Path) -> list[dict[str, Any]]:
    from experiments.sweep import fresh_results

    out_dir = Path(out_dir)
    results = fresh_results(out_dir)
    rows, reports = [], []
    for name, fn in (
        ("llama_cpp", llama_cpp_rows),
        ("vllm", vllm_rows),
        ("prefill and TTFT", prefill_rows),
    ):
        log.info(f"[validate_gb10] replaying the {name} points")
        r, report = fn()
        rows += r
        reports.append(f"## engine={name}\n\n{report}\n")
    with results.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    summary = summarize(rows)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "validation.md").write_text("\n".join(reports))
    for key, s in summary.items():
        log.info(
            f"  {key}: {s['points']} points not fitted, median |error| "
            f"{s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}"
        )
    log.info(f"results: {results}")
    return rows


def main() -> None:
    """``python -m experiments.validate_gb10 --write``: store the summary the docs quote."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {SUMMARY_PATH.name}")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        rows = validate_gb10(RunConfig(), tmp)
    if args.write:
        SUMMARY_PATH.write_text(json.dumps(summarize(rows), indent=1) + "\n")
        print(f"wrote {SUMMARY_PATH}")


if __name__ == "__main__":
    main()
