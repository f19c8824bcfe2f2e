"""One calibration per machine and engine profile, used by every experiment that runs it.

- ``vllm`` on ``gb10``: the three vLLM single-request points (``research.perf.calibration``),
  fitted with the routing law of their tokens (``vllm bench serve``'s random dataset) and the
  profile's mechanisms. SGLang and static batches have no public GB10 points in the set: they
  borrow this fit (their rows say so).
- ``llama_cpp`` on ``gb10``: the fits of llama.cpp's DGX Spark page (``research.perf.
  llama_cpp_fit``, newest revision): the model's own where the page has it, else the mean of the
  page's models. Ollama runs llama.cpp and borrows it.
- any other machine borrows GB10's fit of the same engine (``fits.params_for`` warns).

Fits are read from ``research.perf.fits`` (stored by ``python -m research.perf.refit --write``).
``engine_params`` returns the parameters and the label every results row carries
(``calibration``).
"""

from __future__ import annotations

import statistics
from dataclasses import fields, replace

from research.perf.engines.profiles import EngineProfile, get_profile
from research.perf.fits import fit, llama_cpp_fits, warn_borrowed
from research.perf.hardware import get_hardware
from research.perf.params import CostParams

LLAMA_CPP_REVISION = "llamacpp_dgx_spark_v3"


def vllm_gb10_params() -> CostParams:
    """The vLLM single-request fit on GB10 under random-token routing (module docstring)."""
    return fit("gb10/vllm")


def llama_cpp_gb10_fits() -> dict[str, CostParams]:
    """Preset name -> the llama.cpp profile's fit of that model on the page's newest revision."""
    return llama_cpp_fits("gb10")


def _mean_params(ps: list[CostParams]) -> CostParams:
    return replace(ps[0], **{f.name: statistics.fmean(getattr(p, f.name) for p in ps)
                             for f in fields(CostParams)})  # fmt: skip


def engine_params(
    profile: str | EngineProfile, hardware: str, model: str
) -> tuple[CostParams, str]:
    """(cost-model parameters, calibration label) of ``model`` served by ``profile`` on
    ``hardware`` (module docstring)."""
    prof = get_profile(profile)
    hw = get_hardware(hardware).name
    borrowed = "" if hw == "gb10" else f" (borrowed by {hw})"
    if hw != "gb10":
        warn_borrowed(hw)
    if prof.calibration == "llama_cpp":
        fits = llama_cpp_gb10_fits()
        if model in fits:
            params, what = fits[model], f"{model}'s fit"
        else:
            params, what = _mean_params(list(fits.values())), f"mean of {len(fits)} models' fits"
        label = f"gb10/llama_cpp: llama.cpp DGX Spark page ({LLAMA_CPP_REVISION}), {what}"
    else:
        params = vllm_gb10_params()
        label = "gb10/vllm: 3 vLLM single-request points, random-token routing"
        if prof.name != "vllm":
            label += f" (borrowed by {prof.name}: no public GB10 points of it in the set)"
    if prof.fixed:
        params = replace(params, **prof.fixed)
    return params, label + borrowed


__all__ = ["LLAMA_CPP_REVISION", "engine_params", "llama_cpp_gb10_fits", "vllm_gb10_params"]
