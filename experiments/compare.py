"""Compare result files on one figure: ``python -m experiments.compare A.jsonl B.json ...``.

Each file (our results.jsonl or a real ``vllm bench serve --save-result`` JSON) becomes one line
per metric, with concurrency on x: block size, quantization or policy ablations, our engine
against HF generate or vLLM. A directory stands for every results.jsonl below it (a Hydra
multirun folder), in natural order (job 2 before job 10). Lines are labelled by ``--labels``,
else by the ``label`` the points carry, completed with the factors that differ between the
files (``scheduling_policy=static``, ``block_size=8``, ...), else by the file's folder or name.

    python -m experiments.compare ours/results.jsonl hf/results.jsonl --labels ours hf \\
        --metrics output_throughput per_user_tok_s median_ttft_ms --out comparison
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from research.bench.report import format_table, read_results

DEFAULT_METRICS = ("output_throughput", "per_user_tok_s", "median_ttft_ms", "p99_ttft_ms")
# Keys of a results row that name what a run varied; the differing ones complete the labels.
FACTORS = (
    "model",
    "quantization",
    "kv_cache_dtype",
    "dtype",
    "hardware",
    "executor",
    "attention_backend",
    "scheduling_policy",
    "block_size",
    "max_num_seqs",
    "input_len",
    "output_len",
    "range_ratio",
)


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def expand(paths: list[Path]) -> list[Path]:
    """Files as given; a directory becomes the results.jsonl files below it, natural order."""
    files = []
    for path in paths:
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


def default_labels(files: list[Path], series: list[list[dict[str, Any]]]) -> list[str]:
    """The points' own label plus the factors that differ between files; unique, or the file's
    folder / name appended."""
    base = []
    for f, points in zip(files, series, strict=True):
        own = {p.get("label") for p in points} - {None}
        base.append(
            own.pop() if len(own) == 1 else (f.parent.name if f.stem == "results" else f.stem)
        )
    varied = [
        k
        for k in FACTORS
        if len({str(points[0].get(k)) if points else "" for points in series}) > 1
    ]
    labels = [
        " ".join([b, *(f"{k}={points[0].get(k)}" for k in varied if points)])
        for b, points in zip(base, series, strict=True)
    ]
    if len(set(labels)) < len(labels):
        labels = [
            f"{label} ({f.parent.name if f.stem == 'results' else f.stem})"
            for label, f in zip(labels, files, strict=True)
        ]
    return labels


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+", help="one per file (default: file names)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    parser.add_argument("--out", type=Path, default=Path("comparison"), help="output directory")
    args = parser.parse_args(argv)
    try:
        files = expand(args.files)
    except ValueError as e:
        parser.error(str(e))
    results = [read_results(f) for f in files]
    labels = args.labels or default_labels(files, results)
    if len(labels) != len(files):
        parser.error(f"{len(files)} files but {len(labels)} labels")
    if len(set(labels)) != len(labels):
        parser.error(f"labels must be distinct, got {labels}")
    numeric = {
        k
        for points in results
        for p in points
        for k, v in p.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if unknown := [m for m in args.metrics if m not in numeric]:
        parser.error(f"no point has the metric(s) {unknown}; known: {', '.join(sorted(numeric))}")

    from research.bench.plots import plot_comparison

    series = dict(zip(labels, results, strict=True))
    rows = [{**p, "label": label} for label, points in series.items() for p in points]
    print(format_table(rows, ("label", "max_concurrency", *args.metrics)))
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [plot_comparison(series, m, args.out / f"{m}.png") for m in args.metrics]
    print("plots:", ", ".join(map(str, paths)))
    return paths


if __name__ == "__main__":
    main()
