"""Calibration of the cost model: its free parameters, fitted ONLY on published single-stream
points of one machine.

``fit_calibration`` fits ``CostParams``; ``CALIBRATED`` is computed at import from
``CALIBRATION_POINTS``, the published REFERENCE.md section 1 figures, so no fitted constant is
written in this file.
The four numbers are single-stream on GB10, 128 prompt tokens, 512 generated:
Qwen3-Coder-30B-A3B AWQ decode 12.3 ms/token and TTFT 37 ms; Llama-3.3-70B AWQ 167.4 ms/token and
TTFT 186 ms. Single-stream decode time per token is the mean step time of ``((1, c),)`` over
c = prompt_len .. prompt_len + output_len - 2 (the first token comes from the prefill, the other
output_len - 1 from decode steps: vLLM's TPOT); TTFT is one prefill step ``((prompt_len, 0),)``.
Four numbers determine four parameters, fitted in closed form, one regime at a time:

1. Decode steps at batch 1 are memory bound (checked), and a single token touches exactly k
   experts under any routing law, so each decode point is ``bytes / (e * BW) + s``: linear in
   ``(1/e, s)``. Least squares (exact with two points) gives ``bandwidth_efficiency`` e and
   ``per_step_overhead_s`` s. Two decode points cannot tell a per-step from a per-layer
   overhead; the fit puts all of it in the per-step term and sets ``per_layer_overhead_s = 0``
   (the field is there for machines calibrated on more points).
2. A dense 128-token prefill is compute bound (checked): ``compute_efficiency`` =
   mean over dense TTFT points of ``flops / (peak * (ttft - s))``.
3. The MoE prefill is memory bound (checked): ``moe_hot_fraction`` solves
   ``bytes(fraction) / (e * BW) + s = ttft`` by bisection (mean over MoE TTFT points).

``calibration_report()`` prices the four targets with the full model and gives the errors.
On H200 (or any machine without its own entry in ``CALIBRATED``) the GB10 parameters are used as
they are: an assumption, not a fit to H200 (the efficiencies are relative to each machine's own
achievable bandwidth and peak FLOP/s; the per-step overhead, mostly host-side, is kept in
seconds).

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from research.config import ModelConfig
from research.perf.cost_model import CostModel, CostParams, StepShape
from research.perf.hardware import Hardware, get_hardware
from research.perf.kv_capacity import resolve_model


@dataclass(frozen=True)
class CalibrationPoint:
    """A published single-stream measurement: time per output token (TPOT) and median TTFT,
    seconds. The quoted ms per output token is the target (REFERENCE gives it next to the
    rounded tok/s: 6.0 tok/s is 1000 / 167.4)."""

    model: str
    quantization: str | None
    hardware: str
    tpot_s: float
    ttft_s: float
    prompt_len: int = 128
    output_len: int = 512
    source: str = field(default="", compare=False)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.tpot_s


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint(
        "qwen3-coder-30b-a3b",
        "awq",
        "gb10",
        tpot_s=0.0123,
        ttft_s=0.037,
        source="REFERENCE.md section 1: 80.9 tok/s (12.3 ms/token), median TTFT 37 ms",
    ),
    CalibrationPoint(
        "llama-3.3-70b",
        "awq",
        "gb10",
        tpot_s=0.1674,
        ttft_s=0.186,
        source="REFERENCE.md section 1: 6.0 tok/s (167.4 ms/token), median TTFT 186 ms",
    ),
)


def _decode_bytes(model: CostModel, pt: CalibrationPoint) -> float:
    """Mean bytes of the single-stream decode steps (bytes are linear in the context, and one
    token touches k experts under any routing law, so the mean context prices the mean)."""
    mean_context = pt.prompt_len + (max(pt.output_len - 1, 1) - 1) / 2
    lo = model.breakdown(StepShape(((1, math.floor(mean_context)),)))["bytes_total"]
    hi = model.breakdown(StepShape(((1, math.ceil(mean_context)),)))["bytes_total"]
    return lo + (hi - lo) * (mean_context - math.floor(mean_context))


def fit_calibration(points: Sequence[CalibrationPoint] = CALIBRATION_POINTS) -> CostParams:
    """Fit ``CostParams`` on single-stream points of ONE machine (module docstring, steps 1-3).

    Needs at least two decode points with different weight bytes, at least one dense point
    (for compute_efficiency) and, for ``moe_hot_fraction``, MoE points (else it stays 1.0).
    Raises a ValueError when a fitted point is not in the regime the scheme assumes.
    """
    points = list(points)
    if len({pt.hardware for pt in points}) != 1:
        raise ValueError("calibrate one machine at a time")
    if len(points) < 2:
        raise ValueError("need at least two single-stream points")
    probe = CostParams(1.0, 1.0, 0.0)
    models = [CostModel(pt.model, pt.quantization, pt.hardware, params=probe) for pt in points]
    hw = models[0].hw

    # 1. decode: t = bytes / (e * BW) + s, least squares in relative error over (1/e, s).
    xs = [
        _decode_bytes(m, pt) / hw.achievable_bandwidth for m, pt in zip(models, points, strict=True)
    ]
    ts = [pt.tpot_s for pt in points]
    # Weighted normal equations of t_i ~ a * x_i + s with weights 1/t_i^2.
    w = [1.0 / t**2 for t in ts]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    st = sum(wi * t for wi, t in zip(w, ts, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("decode points must differ in bytes read to separate e from overhead")
    a = (sw * sxt - sx * st) / det
    s = (st - a * sx) / sw
    if a <= 0 or s < 0:
        raise ValueError(f"decode fit is unphysical: 1/e = {a:.4g}, overhead {s:.4g} s")
    e = 1.0 / a

    # 2. dense TTFT: compute bound, t = flops / (c * peak) + s.
    cs = []
    for m, pt in zip(models, points, strict=True):
        if m.cfg.is_moe:
            continue
        bd = m.breakdown(StepShape.prefill(pt.prompt_len))
        if pt.ttft_s <= s:
            raise ValueError(f"{pt.model}: TTFT {pt.ttft_s} s is below the per-step overhead")
        c = bd["flops_total"] / (m.peak_flops * (pt.ttft_s - s))
        if bd["bytes_total"] / (e * hw.achievable_bandwidth) > pt.ttft_s - s:
            raise ValueError(f"{pt.model}: prefill is not compute bound; cannot fit compute")
        cs.append(c)
    if not cs:
        raise ValueError("need a dense model's TTFT to fit compute_efficiency")
    c = sum(cs) / len(cs)

    # 3. MoE TTFT: memory bound, solve bytes(fraction) / (e * BW) + s = ttft by bisection.
    fractions = []
    for pt in points:
        cfg = resolve_model(pt.model)
        if not cfg.is_moe:
            continue

        def ttft_at(frac: float, pt: CalibrationPoint = pt) -> dict[str, Any]:
            params = CostParams(e, c, s, 0.0, frac)
            model = CostModel(pt.model, pt.quantization, pt.hardware, params=params)
            return model.breakdown(StepShape.prefill(pt.prompt_len))

        lo, hi = cfg.num_experts_per_tok / cfg.num_experts, 1.0
        if ttft_at(hi)["total_s"] <= pt.ttft_s:
            fractions.append(1.0)
            continue
        if ttft_at(lo)["total_s"] > pt.ttft_s:
            raise ValueError(f"{pt.model}: TTFT {pt.ttft_s} s unreachable even with k experts")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ttft_at(mid)["total_s"] < pt.ttft_s else (lo, mid)
        if ttft_at(hi)["bound"] != "memory":
            raise ValueError(f"{pt.model}: MoE prefill is compute bound; routing not identifiable")
        fractions.append((lo + hi) / 2)
    hot = sum(fractions) / len(fractions) if fractions else 1.0
    return CostParams(
        bandwidth_efficiency=e,
        compute_efficiency=c,
        per_step_overhead_s=s,
        per_layer_overhead_s=0.0,
        moe_hot_fraction=hot,
    )


CALIBRATED: dict[str, CostParams] = {"gb10": fit_calibration(CALIBRATION_POINTS)}


def params_for(hardware: str | Hardware) -> CostParams:
    """The calibration of ``hardware``, or GB10's where the machine has none (an assumption:
    efficiencies and overheads carried over, not fitted to that machine)."""
    name = get_hardware(hardware).name
    return CALIBRATED.get(name, CALIBRATED["gb10"])


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
    points: Iterable[CalibrationPoint] = CALIBRATION_POINTS, params: CostParams | None = None
) -> list[dict[str, Any]]:
    """Predicted vs target for every calibration number (ms per output token and TTFT ms), with
    the relative error in percent."""
    rows = []
    for pt in points:
        kw = {} if params is None else {"params": params}
        pred = predict_single_stream(
            pt.model, pt.quantization, pt.hardware, pt.prompt_len, pt.output_len, **kw
        )
        for metric, got, want in (
            ("tpot_ms", pred["tpot_ms"], pt.tpot_s * 1e3),
            ("ttft_ms", pred["ttft_ms"], pt.ttft_s * 1e3),
        ):
            rows.append(
                {
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


def format_calibration_report(rows: list[dict[str, Any]] | None = None) -> str:
    """``calibration_report()`` as a fixed-width text table."""
    rows = calibration_report() if rows is None else rows
    lines = [f"{'model':<22}{'quant':<7}{'hw':<6}{'metric':<9}{'pred':>9}{'target':>9}{'err%':>7}"]
    for r in rows:
        lines.append(
            f"{r['model']:<22}{r['quantization'] or '-':<7}{r['hardware']:<6}{r['metric']:<9}"
            f"{r['predicted']:>9.2f}{r['target']:>9.2f}{r['error_pct']:>7.2f}"
        )
    return "\n".join(lines)


__all__ = [
    "CALIBRATED",
    "CALIBRATION_POINTS",
    "CalibrationPoint",
    "calibration_report",
    "fit_calibration",
    "format_calibration_report",
    "params_for",
    "predict_single_stream",
]
