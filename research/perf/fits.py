"""The cost model's fitted parameters, stored as data (``data/fits.json``) below everything that
prices with them.

Fitting needs the cost model and the cost model needs a fit for its defaults: the fits are
therefore computed by ``python -m research.perf.refit --write`` (which imports the fitters:
``research.perf.calibration`` for the vLLM single-request points, ``research.perf.
llama_cpp_fit`` for llama.cpp's DGX Spark page) and read here; ``tests/test_fits.py`` refits
and fails when the stored values are stale. Entries:

- ``gb10``: every GB10 single-request point, the machine's default (``params_for``);
- ``gb10/vllm``: the same points under the vLLM profile's mechanisms and random-token routing;
- ``gb10/llama_cpp/<preset>``: llama.cpp's fit of that model on the page's newest revision.

A machine without a fit of its own borrows GB10's (``params_for`` warns once per machine).
Pure Python.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from research.perf.hardware import Hardware, get_hardware
from research.perf.params import CostParams

FITS_PATH = Path(__file__).parent / "data" / "fits.json"


@functools.cache
def stored_fits(path: Path = FITS_PATH) -> dict[str, CostParams]:
    """Every stored fit, by key (module docstring)."""
    data = json.loads(Path(path).read_text())
    return {key: CostParams(**values) for key, values in data["fits"].items()}


def fit(key: str) -> CostParams:
    fits = stored_fits()
    if key not in fits:
        raise KeyError(f"no stored fit {key!r} in {FITS_PATH.name}; run python -m "
                       "research.perf.refit --write")  # fmt: skip
    return fits[key]


def calibrated_machines() -> tuple[str, ...]:
    return tuple(k for k in stored_fits() if "/" not in k)


@functools.cache
def warn_borrowed(name: str) -> None:
    message = (
        f"hardware {name!r} has no calibration of its own: its cost model uses the efficiencies "
        "and host overheads fitted on GB10 measurements (research/perf/calibration.py). Its "
        "peaks are its own, but every efficiency is GB10's: treat its figures as a GB10-shaped "
        "extrapolation, not a prediction for that machine"
    )
    warnings.warn(message, stacklevel=3)
    logging.getLogger(__name__).warning(message)


def calibration_of(hardware: str | Hardware) -> str:
    """The machine whose measurements ``hardware``'s cost-model parameters were fitted on: its
    own name, or ``"gb10"`` where it has no calibration of its own."""
    name = get_hardware(hardware).name
    return name if name in calibrated_machines() else "gb10"


def params_for(hardware: str | Hardware) -> CostParams:
    """The calibration of ``hardware``, or GB10's where the machine has none (an assumption:
    efficiencies and overheads carried over, not fitted to that machine; said once per machine
    as a warning, and in every results row as ``calibration``)."""
    name = get_hardware(hardware).name
    if name not in calibrated_machines():
        warn_borrowed(name)
    return fit(calibration_of(name))


def llama_cpp_fits(hardware: str = "gb10") -> dict[str, CostParams]:
    """Preset -> llama.cpp's stored fit of that model on ``hardware``."""
    prefix = f"{hardware}/llama_cpp/"
    return {k[len(prefix) :]: p for k, p in stored_fits().items() if k.startswith(prefix)}


def write_fits(fits: dict[str, CostParams], made_by: str, path: Path = FITS_PATH) -> Path:
    data: dict[str, Any] = {
        "made_by": made_by,
        "fits": {k: p.to_dict() for k, p in sorted(fits.items())},
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    stored_fits.cache_clear()
    return Path(path)


__all__ = [
    "FITS_PATH",
    "calibration_of",
    "fit",
    "llama_cpp_fits",
    "params_for",
    "stored_fits",
    "warn_borrowed",
    "write_fits",
]
