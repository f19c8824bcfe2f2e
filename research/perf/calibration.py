"""Calibration of the cost model: its free parameters, fitted ONLY on published single-request
points of one machine, and the leave-one-out check of that fit.

``CALIBRATION_POINTS`` are docs/reference.md section 1, single request on one GB10 under vLLM, AWQ:

- ``qwen-128``: Qwen3-Coder-30B-A3B, 128 prompt / 512 generated: 12.3 ms per output token, TTFT
  37 ms;
- ``llama-128``: Llama-3.3-70B, same lengths: 167.4 ms per output token, TTFT 186 ms;
- ``qwen-8192``: Qwen3-Coder-30B-A3B prefills one 8,192-token prompt at 5,705 tok/s (TTFT
  8192 / 5705 s); the only point with large-M low-bit expert GEMMs.

TPOT is the mean decode step ``((1, c),)`` over the output (vLLM's TPOT); TTFT is one prefill
step of the whole prompt (8,192 tokens fit vLLM's 8,192-token budget on GB10).

``fit_calibration`` is a bounded least squares on the log of every target number over
``FITTED`` parameters, each bounded so that no efficiency exceeds 1 (no operator above the
machine's measured peaks, ``Hardware.sustained_flops``). What no point constrains is settled by
weak priors (``PRIOR_WEIGHT``): bandwidth efficiency 1 (reads at the measured read-kernel rate),
dense and expert W4A16 GEMMs equally efficient (one kernel family), MoE concentration 1 (no
locality). Fixed assumptions, not fitted: native-format GEMMs and attention at the measured bf16
matmul rate, and ``ASSUMED_PER_SEQ_OVERHEAD_S`` of host time per scheduled sequence (a single
request cannot separate it from the per-step overhead; it is taken out of the fitted total).

``leave_one_out()`` fits on every pair of the three points and predicts the third;
``python -m research.perf.calibration`` prints the fit, its residuals and that table. On a
machine without its own calibration (H200) the GB10 parameters are used as they are: an
assumption, not a fit. Pure Python (scipy for the least squares); JAX is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from research.config import ModelConfig
from research.perf.cost_model import CostModel, CostParams, StepShape
from research.perf.fits import calibrated_machines, calibration_of, fit, params_for
from research.perf.hardware import Hardware, get_hardware

FITTED = (
    "bandwidth_efficiency",
    "per_step_overhead_s",
    "dense_gemm_efficiency",
    "expert_gemm_efficiency",
    "moe_concentration",
)
PRIOR_WEIGHT = 1e-4
# vLLM V1's host work per scheduled request per step (scheduler bookkeeping, input preparation,
# sampler metadata, incremental detokenization): an assumption of ~20 us, not a measurement.
ASSUMED_PER_SEQ_OVERHEAD_S = 20e-6
MAX_OVERHEAD_S = 0.1


@dataclass(frozen=True)
class CalibrationPoint:
    """A published single-request measurement, seconds (``tpot_s`` None when only the prefill
    is published)."""

    name: str
    model: str
    quantization: str | None
    hardware: str
    tpot_s: float | None
    ttft_s: float
    prompt_len: int = 128
    output_len: int = 512
    source: str = field(default="", compare=False)

    def targets(self) -> dict[str, float]:
        out = {"ttft_ms": self.ttft_s * 1e3}
        if self.tpot_s is not None:
            out = {"tpot_ms": self.tpot_s * 1e3} | out
        return out


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint(
        "qwen-128",
        "qwen3-coder-30b-a3b",
        "awq",
        "gb10",
        tpot_s=0.0123,
        ttft_s=0.037,
        source="docs/reference.md section 1: 80.9 tok/s (12.3 ms/token), median TTFT 37 ms",
    ),
    CalibrationPoint(
        "llama-128",
        "llama-3.3-70b",
        "awq",
        "gb10",
        tpot_s=0.1674,
        ttft_s=0.186,
        source="docs/reference.md section 1: 6.0 tok/s (167.4 ms/token), median TTFT 186 ms",
    ),
    CalibrationPoint(
        "qwen-8192",
        "qwen3-coder-30b-a3b",
        "awq",
        "gb10",
        tpot_s=None,
        ttft_s=8192 / 5705,
        prompt_len=8192,
        output_len=1,
        source="docs/reference.md section 1: one 8,192-token prompt prefilled at 5,705 tok/s",
    ),
)


def _predict(model: CostModel, pt: CalibrationPoint, exact: bool) -> dict[str, float]:
    out = {"ttft_ms": model.ttft(pt.prompt_len) * 1e3}
    if pt.tpot_s is not None:
        if exact:
            tpot = model.decode_time_per_token(pt.prompt_len, pt.output_len)
        else:  # decode cost is ~linear in the context: price the mean context
            mean = pt.prompt_len + (max(pt.output_len - 1, 1) - 1) // 2
            tpot = model.step_time(StepShape.decode(1, mean))
        out["tpot_ms"] = tpot * 1e3
    return out


def _params(x: Sequence[float], base: CostParams) -> CostParams:
    e, s_ms, gd, ge, f = x
    total = s_ms / 1e3
    return replace(
        base,
        bandwidth_efficiency=min(1.0, math.exp(e)),
        per_step_overhead_s=max(0.0, total - base.per_seq_overhead_s),
        dense_gemm_efficiency=min(1.0, math.exp(gd)),
        expert_gemm_efficiency=min(1.0, math.exp(ge)),
        moe_concentration=min(1.0, math.exp(f)),
    )


def fit_calibration(
    points: Sequence[CalibrationPoint] = CALIBRATION_POINTS,
    per_seq_overhead_s: float = ASSUMED_PER_SEQ_OVERHEAD_S,
    **cost_options: Any,
) -> CostParams:
    """Fit ``FITTED`` on single-request points of ONE machine (module docstring).
    ``cost_options`` go to every ``CostModel`` (the engine profile's mechanisms and the routing
    law of the points' tokens: ``research.perf.engines``)."""
    from scipy.optimize import least_squares

    points = list(points)
    if not points:
        raise ValueError("need at least one calibration point")
    if len({pt.hardware for pt in points}) != 1:
        raise ValueError("calibrate one machine at a time")
    base = CostParams(1.0, 0.0, per_seq_overhead_s=per_seq_overhead_s)
    models = [
        CostModel(pt.model, pt.quantization, pt.hardware, params=base, **cost_options)
        for pt in points
    ]
    moe = [m.cfg for m in models if m.cfg.is_moe]
    f_min = max((c.num_experts_per_tok / c.num_experts for c in moe), default=0.01)

    def residuals(x: Sequence[float]) -> list[float]:
        params = _params(x, base)
        res = []
        for m, pt in zip(models, points, strict=True):
            m.params = params
            pred = _predict(m, pt, exact=False)
            res += [math.log(pred[k] / v) for k, v in pt.targets().items()]
        w = math.sqrt(PRIOR_WEIGHT)
        return [*res, w * x[0], w * (x[2] - x[3]), w * x[4]]

    lower = [math.log(0.05), per_seq_overhead_s * 1e3, math.log(0.02), math.log(0.02)]
    lower.append(math.log(f_min))
    upper = [0.0, MAX_OVERHEAD_S * 1e3, 0.0, 0.0, 0.0]
    x0 = [math.log(0.8), max(1.0, lower[1]), math.log(0.5), math.log(0.5), math.log(0.5)]
    fit = least_squares(residuals, x0, bounds=(lower, upper), x_scale=[0.1, 1, 0.1, 0.1, 0.1])
    if not fit.success:
        raise ValueError(f"calibration did not converge: {fit.message}")
    return _params(fit.x, base)


def predict_single_stream(
    model: str | ModelConfig,
    quantization: str | None,
    hardware: str | Hardware,
    prompt_len: int = 128,
    output_len: int = 512,
    **kwargs: Any,
) -> dict[str, float]:
    """Single-request figures as ``vllm bench serve`` reports them: ``tok_s`` = 1 / TPOT (mean
    decode step over the output), ``tpot_ms`` and ``ttft_ms`` (one prefill step). Extra keyword
    arguments go to ``CostModel`` (``params``, ``moe_routing``, ``kv_cache_dtype``, ``dtype``)."""
    cm = CostModel(model, quantization, hardware, **kwargs)
    tpot = cm.decode_time_per_token(prompt_len, output_len)
    return {"tok_s": 1.0 / tpot, "tpot_ms": tpot * 1e3, "ttft_ms": cm.ttft(prompt_len) * 1e3}


def calibration_report(
    points: Sequence[CalibrationPoint] = CALIBRATION_POINTS,
    params: CostParams | None = None,
    **cost_options: Any,
) -> list[dict[str, Any]]:
    """Predicted vs target for every number of ``points`` (ms per output token and TTFT ms),
    with the relative error in percent, priced by ``params`` (default: the calibration)."""
    rows = []
    for pt in points:
        cm = CostModel(pt.model, pt.quantization, pt.hardware, params=params, **cost_options)
        pred = _predict(cm, pt, exact=True)
        for metric, want in pt.targets().items():
            got = pred[metric]
            rows.append(
                {
                    "point": pt.name,
                    "model": pt.model,
                    "quantization": pt.quantization,
                    "hardware": pt.hardware,
                    "metric": metric,
                    "predicted": got,
                    "target": want,
                    "error_pct": 100.0 * (got - want) / want,
                }
            )
    return rows


def leave_one_out(points: Sequence[CalibrationPoint] = CALIBRATION_POINTS) -> list[dict[str, Any]]:
    """Fit on all points but one, predict the one left out, for each choice: rows of
    ``calibration_report`` for the held-out point, with ``held_out`` and the fitted
    ``params``."""
    rows = []
    for i, held in enumerate(points):
        params = fit_calibration([p for j, p in enumerate(points) if j != i])
        for row in calibration_report([held], params):
            rows.append(row | {"held_out": held.name, "params": params})
    return rows


def efficiency_table(params: CostParams, hardware: str | Hardware = "gb10") -> list[str]:
    """The fitted rates against the machine's measured ceilings, one line each."""
    hw = get_hardware(hardware)
    bf16, gbs = hw.sustained_flops("bf16"), hw.achievable_bandwidth
    return [
        f"reads           {params.bandwidth_efficiency * gbs / 1e9:7.1f} GB/s"
        f"   <= measured {gbs / 1e9:.0f} GB/s",
        f"W4A16 dense     {params.dense_gemm_efficiency * bf16 / 1e12:7.1f} TFLOP/s"
        f" <= measured bf16 {bf16 / 1e12:.0f}",
        f"W4A16 experts   {params.expert_gemm_efficiency * bf16 / 1e12:7.1f} TFLOP/s"
        f" <= measured bf16 {bf16 / 1e12:.0f}",
        f"host per step   {params.per_step_overhead_s * 1e3:7.2f} ms"
        f" (+ {params.per_seq_overhead_s * 1e6:.0f} us per sequence, assumed)",
        f"MoE concentration {params.moe_concentration:5.3f} (sequence working set / experts)",
    ]


def _row_line(r: dict[str, Any]) -> str:
    return (
        f"{r['point']:<11}{r['metric']:<9}{r['predicted']:>10.2f}{r['target']:>10.2f}"
        f"{r['error_pct']:>+8.1f}"
    )


def format_calibration_report(rows: list[dict[str, Any]] | None = None) -> str:
    """``calibration_report()`` as a fixed-width text table."""
    rows = calibration_report() if rows is None else rows
    head = f"{'point':<11}{'metric':<9}{'pred':>10}{'target':>10}{'err%':>8}"
    return "\n".join([head] + [_row_line(r) for r in rows])


def format_leave_one_out(rows: list[dict[str, Any]] | None = None) -> str:
    """``leave_one_out()`` as a text table: per held-out point, the prediction of the fit on
    the other two and the fitted rates of that fit."""
    rows = leave_one_out() if rows is None else rows
    lines = [f"{'held out':<11}{'metric':<9}{'pred':>10}{'target':>10}{'err%':>8}  fit on the rest"]
    for r in rows:
        p = r["params"]
        lines.append(
            f"{_row_line(r)}  bw {p.bandwidth_efficiency:.2f} host {p.per_step_overhead_s * 1e3:.2f}"
            f" ms dense {p.dense_gemm_efficiency:.2f} experts {p.expert_gemm_efficiency:.2f}"
            f" conc {p.moe_concentration:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    params = params_for("gb10")
    print("GB10 calibration (all three single-request points):")
    print("\n".join("  " + line for line in efficiency_table(params)))
    print()
    print(format_calibration_report())
    print()
    print("Leave one out (fit on two points, predict the third):")
    print(format_leave_one_out())


def __getattr__(name: str) -> Any:
    if name == "CALIBRATED":  # the stored fit of every calibrated machine (research.perf.fits)
        return {m: fit(m) for m in calibrated_machines()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: F822 (CALIBRATED is read on first use, by __getattr__)
    "ASSUMED_PER_SEQ_OVERHEAD_S",
    "CALIBRATED",
    "CALIBRATION_POINTS",
    "CalibrationPoint",
    "calibration_of",
    "calibration_report",
    "efficiency_table",
    "fit_calibration",
    "format_calibration_report",
    "format_leave_one_out",
    "leave_one_out",
    "params_for",
    "predict_single_stream",
]

if __name__ == "__main__":
    main()
