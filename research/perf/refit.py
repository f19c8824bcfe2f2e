"""Refit every stored cost-model fit (``research.perf.fits``) from the public points:
``python -m research.perf.refit`` prints the fits and how far the stored ones are;
``--write`` stores them in ``research/perf/data/fits.json``. Run it after changing what the
cost model charges; ``tests/test_fits.py`` fails until the stored fits match. The top of the
fitting layer: it imports the fitters, nothing imports it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from research.perf.params import CostParams

MADE_BY = "python -m research.perf.refit --write"


def vllm_fit_options() -> dict[str, Any]:
    """The cost-model options the vLLM single-request points are priced with: the vLLM
    profile's GB10 kernels and random-token routing (the points come from ``vllm bench
    serve``'s random dataset). Every point is AWQ on Qwen3 or Llama: one kernel table."""
    from research.perf.engines.profiles import VLLM
    from research.perf.engines.serving import mechanism_options

    return mechanism_options(VLLM, "gb10", "qwen3-coder-30b-a3b", "awq", "random", 16)


def refit() -> dict[str, CostParams]:
    """Every fit, by the key ``research.perf.fits`` stores it under."""
    from research.perf import llama_cpp_fit
    from research.perf.calibration import CALIBRATION_POINTS, fit_calibration
    from research.perf.engines.calibration import LLAMA_CPP_REVISION

    out = {
        "gb10": fit_calibration(CALIBRATION_POINTS),
        "gb10/vllm": fit_calibration(CALIBRATION_POINTS, **vllm_fit_options()),
    }
    _, params = llama_cpp_fit.validate()
    for (source, model), p in params.items():
        if source == LLAMA_CPP_REVISION:
            out[f"gb10/llama_cpp/{llama_cpp_fit.GGUF_MODELS[model][0]}"] = p
    return out


def differences(a: dict[str, CostParams], b: dict[str, CostParams]) -> list[str]:
    """Human-readable differences beyond a relative 1e-6 between two sets of fits."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            out.append(f"{key}: only in {'the refit' if key in a else 'the stored fits'}")
            continue
        for name, x in a[key].to_dict().items():
            y = b[key].to_dict()[name]
            if abs(x - y) > 1e-6 * max(abs(x), abs(y), 1e-12):
                out.append(f"{key}.{name}: refit {x:.6g}, stored {y:.6g}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from research.perf.fits import FITS_PATH, stored_fits, write_fits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"store the fits in {FITS_PATH.name}")
    args = ap.parse_args(argv)
    fits = refit()
    for key, p in fits.items():
        print(key, {k: round(v, 6) for k, v in p.to_dict().items()})
    try:
        diff = differences(fits, stored_fits())
    except FileNotFoundError:
        diff = ["no stored fits"]
    print("\n".join(diff) or "the stored fits match")
    if args.write:
        print(f"wrote {write_fits(fits, MADE_BY)}")


if __name__ == "__main__":
    main()
