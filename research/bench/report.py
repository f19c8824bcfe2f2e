"""Results files: benchmark points with `vllm bench serve --save-result` keys, and a table view.

Our runs append one JSON object per benchmark point to ``results.jsonl``: vLLM's keys (``date``,
``model_id``, ``num_prompts``, ``request_rate``, ``burstiness``, ``max_concurrency``,
``completed``, ``duration``, token counts, throughputs, ``mean/median/std/p<P>_<metric>_ms`` for
ttft, tpot, itl and e2el) plus ours (``failed``, ``per_user_tok_s``, ``num_preemptions``,
``model`` and whatever the caller passes: quantization, hardware, executor, ...). An infinite
request rate is written as the string "inf", as vLLM does, so the files are strict JSON.

``read_results`` reads those files and also the single-object ``.json`` files a real
``vllm bench serve --save-result`` writes, and returns flat, normalized point dicts: vLLM's
per-request lists (``ttfts``, ``itls``, ``generated_texts``, ...) are dropped, ``request_rate``
is a float, ``model`` falls back to ``model_id`` and ``per_user_tok_s`` to 1000 / median TPOT.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from research.bench.driver import BenchmarkResult

# Per-request lists in a `vllm bench serve --save-result` file; points keep only scalars.
PER_REQUEST_KEYS = frozenset(
    {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "start_times"}
)

DEFAULT_COLUMNS = (
    "model",
    "max_concurrency",
    "request_rate",
    "completed",
    "failed",
    "output_throughput",
    "total_token_throughput",
    "per_user_tok_s",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
)


def result_point(
    result: BenchmarkResult,
    *,
    model_id: str,
    extra: Mapping[str, Any] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput_slos: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One results.jsonl point for a benchmark run; ``extra`` adds or overrides our own keys."""
    point: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model_id": model_id,
        "num_prompts": result.num_prompts,
        "request_rate": "inf" if math.isinf(result.request_rate) else result.request_rate,
        "burstiness": result.burstiness,
        "max_concurrency": result.max_concurrency,
    }
    point |= result.metrics(percentiles=percentiles, goodput_slos=goodput_slos)
    point["num_preemptions"] = sum(r.num_preemptions for r in result.records)
    point["model"] = model_id
    point |= dict(extra or {})
    return point


def append_result(path: str | Path, point: Mapping[str, Any]) -> Path:
    """Append ``point`` as one line of JSON to ``path`` (created with its folders if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(dict(point), allow_nan=False) + "\n")
    return path


def _normalize(raw: Mapping[str, Any]) -> dict[str, Any]:
    point = {k: v for k, v in raw.items() if k not in PER_REQUEST_KEYS}
    rate = point.get("request_rate", "inf")
    point["request_rate"] = math.inf if rate is None else float(rate)
    point.setdefault("max_concurrency", None)
    if point.get("model") is None:
        point["model"] = point.get("model_id")
    if point.get("per_user_tok_s") is None:
        median_tpot = point.get("median_tpot_ms")
        point["per_user_tok_s"] = 1000.0 / median_tpot if median_tpot else None
    return point


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Points from our results.jsonl (one object per line) or a vLLM ``--save-result`` file (one
    object, or a list of them)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    objects = data if isinstance(data, list) else [data]
    return [_normalize(obj) for obj in objects]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return str(value) if math.isinf(value) else f"{value:.2f}"
    return str(value).replace("|", "\\|")


def format_table(
    points: Sequence[Mapping[str, Any]], columns: Sequence[str] = DEFAULT_COLUMNS
) -> str:
    """A markdown table of ``points``, one row each; missing values are blank."""
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(_cell(p.get(c)) for c in columns) + " |" for p in points]
    return "\n".join(lines)


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def result_files(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; a directory (a run or a Hydra multirun folder) stands for every
    results.jsonl below it, in natural order (job 2 before job 10). ValueError for a path that
    does not exist or a directory with no results.jsonl."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.rglob("results.jsonl"), key=_natural_key)
            if not found:
                raise ValueError(f"{path} is a directory with no results.jsonl below it")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path} does not exist")
    return files
