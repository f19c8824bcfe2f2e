"""The simulator against public GB10 measurements it was never fitted on: llama.cpp's DGX
Spark page (``research.perf.llama_cpp_fit`` replays and fits it) and the vLLM profile's curves
(``research.perf.validation_vllm``), reported; the error quantiles the prediction bands widen
by (``validation_errors.json``).

``python -m research.perf.validation`` prints the report (docs/experiments/gb10_validation.md).
Pure Python (scipy for the fits); JAX is not imported.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from research.perf.llama_cpp_fit import (  # noqa: F401 (the fitter's names, re-exported)
    GGUF_MODELS,
    LLAMA_CPP_SOURCES,
    PROFILES,
    TOKEN_SOURCE,
    EngineProfile,
    Point,
    Row,
    cost_model,
    eager_layer_overhead,
    first_timed_run,
    fit,
    growth,
    implied_sigma,
    is_fit_point,
    load_points,
    simulate,
    summary,
    ubatches,
    validate,
)
from research.perf.measurements import DATA
from research.perf.params import CostParams

ERRORS_PATH = DATA.parent / "validation_errors.json"
ERROR_QUANTILES = (0.05, 0.95)


def error_quantiles(rows: Sequence[Row], q: Sequence[float] = ERROR_QUANTILES) -> dict:
    """The 5th and 95th percentiles of the signed error (predicted / published - 1) over the
    points not fitted, per model kind (``moe`` / ``dense``) and metric (``decode`` /
    ``prefill``): what ``research.perf.bands`` widens a simulated curve by."""
    import numpy as np

    out: dict[str, dict[str, list[float]]] = {}
    for kind in ("moe", "dense"):
        for metric in ("decode", "prefill"):
            errors = [
                r.error
                for r in rows
                if not r.fitted
                and r.point.metric == f"{metric}_tok_s"
                and (GGUF_MODELS[r.point.model][0] != "qwen2.5-coder-7b") == (kind == "moe")
            ]
            out.setdefault(kind, {})[metric] = [float(np.quantile(errors, x)) for x in q]
    return out


def write_errors(rows: Sequence[Row], path: Path = ERRORS_PATH) -> Path:
    """``error_quantiles(rows)`` as JSON, with how it was made."""
    data = {
        "made_by": "python -m research.perf.validation --write-errors",
        "quantiles": list(ERROR_QUANTILES),
        "points_not_fitted": sum(not r.fitted for r in rows),
        "signed_error": error_quantiles(rows),
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def format_report(rows: Sequence[Row], params: dict[tuple[str, str], CostParams]) -> str:
    lines = []
    by_key: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by_key.setdefault(r.point.key, []).append(r)
    for key, rs in by_key.items():
        prm = params[key]
        lines.append(
            f"\n### {key[1]} ({key[0]})  bandwidth_efficiency {prm.bandwidth_efficiency:.3f}, "
            f"native_gemm_efficiency {prm.native_gemm_efficiency:.3f}, "
            f"attention_efficiency {prm.attention_efficiency:.3f}\n"
        )
        lines.append("| point | published tok/s | predicted tok/s | error |")
        lines.append("|---|---:|---:|---:|")
        for r in rs:
            mark = (
                " (fitted)"
                if r.fitted
                else " (first timed run)"
                if first_timed_run(r.point)
                else ""
            )
            lines.append(
                f"| {r.point.label}{mark} | {r.point.published:.2f} | {r.predicted:.2f} | "
                f"{r.error:+.1%} |"
            )
        s = summary(rs)
        lines.append(
            f"\nnot fitted: {s['points']} points, median |error| {s['median']:.1%}, worst "
            f"{s['worst']:.1%}, {s['beyond_30']} beyond 30%"
        )
    s = summary(rows)
    head = [
        "| set | points not fitted | median abs error | worst | beyond 30% |",
        "|---|---:|---:|---:|---:|",
        f"| all | {s['points']} | {s['median']:.1%} | {s['worst']:.1%} | {s['beyond_30']} |",
    ]
    for metric in ("decode_tok_s", "prefill_tok_s"):
        sm = summary([r for r in rows if r.point.metric == metric])
        head.append(
            f"| {metric} | {sm['points']} | {sm['median']:.1%} | {sm['worst']:.1%} | "
            f"{sm['beyond_30']} |"
        )
    sm = summary(rows, first_run=False)
    head.append(
        f"| all but the first timed run's prefill | {sm['points']} | {sm['median']:.1%} | "
        f"{sm['worst']:.1%} | {sm['beyond_30']} |"
    )
    head += ["", "| model (source) | decode B=32 / B=1 at pp=512: published | predicted | error |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for key, (pub, pred) in growth(rows).items():
        head.append(f"| {key[1]} ({key[0]}) | {pub:.2f}x | {pred:.2f}x | {pred / pub - 1:+.1%} |")
    from research.perf.routing import routing_for

    head += ["", "Diagnostic (not used by the model): the lognormal routing shape at which the "
             "fitted model meets the published B=32 pp=512 decode rate, against the shape in "
             "use (random token ids: one shape, fitted on gpt-oss-120b's points).", "",
             "| model (source) | shape in use | shape the B=32 point implies |", "|---|---:|---:|"]  # fmt: skip
    for key, sigma in implied_sigma(rows, params).items():
        used = routing_for(GGUF_MODELS[key[1]][0], TOKEN_SOURCE)[1]
        head.append(f"| {key[1]} ({key[0]}) | {used:.2f} | {sigma:.2f} |")
    return "\n".join(head + lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama.cpp", choices=sorted(PROFILES))
    ap.add_argument("--routing", default=None, help="MoE routing law (default: the profile's)")
    ap.add_argument(
        "--write-errors",
        action="store_true",
        help=f"write the error quantiles the prediction bands use to {ERRORS_PATH.name}",
    )
    args = ap.parse_args(argv)
    options = {} if args.routing is None else {"moe_routing": args.routing}
    rows, params = validate(profile=args.profile, **options)
    print(format_report(rows, params))
    from research.perf import validation_vllm

    print("\n## vLLM profile: continuous batching through our scheduler\n")
    print(validation_vllm.format_report(*validation_vllm.validate()))
    if args.write_errors:
        print(f"\nwrote {write_errors(rows)}")


if __name__ == "__main__":
    main()
