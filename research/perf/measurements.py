"""Public measurements of GB10 serving, and their loader: below both calibration and
validation.

``data/gb10_public.json`` holds public single-box DGX Spark measurements (llama.cpp's
``benches/dgx-spark.md`` in three revisions, forum and blog records, vLLM curves, prefill and
TTFT tables), each record with the ``source`` it was read from; ``sources`` says where each
source lives (address, title, date, how it was verified). ``records`` refuses a record without
a known source: a number nobody can trace is not data. Pure Python.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "gb10_public.json"


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def check_sources(data: dict[str, Any], where: str = "") -> None:
    """Every record names a source that the file describes (address and title)."""
    sources = data.get("sources", {})
    for key, src in sources.items():
        if not src.get("url") or not src.get("title"):
            raise ValueError(f"{where}: source {key!r} needs a url and a title")
    for i, r in enumerate(data.get("records", [])):
        if not r.get("source"):
            raise ValueError(f"{where}: record {i} ({r.get('model')}) has no source")
        if r["source"] not in sources:
            raise ValueError(f"{where}: record {i} cites unknown source {r['source']!r}")


def records(path: Path = DATA) -> list[dict[str, Any]]:
    """The file's records, after ``check_sources``."""
    data = _load(Path(path))
    check_sources(data, str(path))
    return data["records"]


def sources(path: Path = DATA) -> dict[str, dict[str, Any]]:
    return _load(Path(path))["sources"]


@dataclass(frozen=True)
class Row:
    """A published point (anything with ``published``), what we predict for it, and whether the
    prediction was fitted on it."""

    point: Any
    predicted: float
    fitted: bool

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted / self.point.published - 1.0


__all__ = ["DATA", "Row", "check_sources", "records", "sources"]
