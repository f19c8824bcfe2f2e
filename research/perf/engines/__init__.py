"""Serving engines as validated profiles (``profiles``), their calibration per machine
(``calibration``) and the one function that turns a profile into the engine and cost model a
run uses (``serving.resolve``)."""

from research.perf.engines.profiles import DEFAULT_ENGINE, PROFILES, EngineProfile, get_profile
from research.perf.engines.serving import Serving, resolve

__all__ = ["DEFAULT_ENGINE", "PROFILES", "EngineProfile", "Serving", "get_profile", "resolve"]
