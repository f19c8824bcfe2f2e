"""Compare result files on one figure: ``python -m experiments.compare A.jsonl B.json ...``.

Each file (our results.jsonl or a real ``vllm bench serve --save-result`` JSON) becomes one line
per metric, with concurrency on x: block size, quantization or policy ablations, our engine
against HF generate or vLLM. A directory stands for every results.jsonl below it (a Hydra
multirun folder), in natural order (job 2 before job 10). Lines are labelled by ``--labels``,
else by the ``label`` the points carry, completed with the factors that differ between the
files (``scheduling_policy=static``, ``block_size=8``, ...), else by the file's folder or name. ``--group-by quantization,scheduling_policy`` labels lines by
those factors only, one colour per value of the first and one line style per value of the
second. Files written by ``vllm bench serve --save-result`` (one per concurrency) are grouped by
their ``model_id``: one curve per model. Figures (PNG, PDF, SVG) and ``summary.csv`` (label,
concurrency and the metrics) go to ``--out``.

    python -m experiments.compare ours/results.jsonl hf/results.jsonl --labels ours hf \\
        --metrics output_throughput per_user_tok_s median_ttft_ms --out comparison
    python -m experiments.compare multirun/<date>/<time> --group-by quantization,scheduling_policy
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from research.bench.provenance import write_csv
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
    "gemm_backend",
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


def grouped_labels(series: list[list[dict[str, Any]]], factors: list[str]) -> list[str]:
    """Labels made of the ``--group-by`` factors' values only."""
    for f in factors:
        if not any(f in p for points in series for p in points):
            raise ValueError(f"--group-by {f}: no point has it; factors: {', '.join(FACTORS)}")
    return [
        " ".join(f"{f}={points[0].get(f)}" if points else f for f in factors) for points in series
    ]


def is_vllm_file(points: list[dict[str, Any]]) -> bool:
    """A ``vllm bench serve --save-result`` file: its points carry no label of ours."""
    return bool(points) and all("label" not in p and p.get("model_id") for p in points)


def merge(labels: list[str], results: list[list[dict[str, Any]]]) -> dict[str, list[dict]]:
    """One series per label: files with the same label (one vLLM file per concurrency, or one
    group of ``--group-by``) become one curve."""
    series: dict[str, list[dict[str, Any]]] = {}
    for label, points in zip(labels, results, strict=True):
        series.setdefault(label, []).extend(points)
    return series


def styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """Colour by the first ``k=v`` word of a label, line style by the second."""
    colors = [f"C{i}" for i in range(10)]
    dashes = ["-", "--", ":", "-."]
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    out = {}
    for label in labels:
        words = label.split()
        style: dict[str, Any] = {"color": colors[first.setdefault(words[0], len(first)) % 10]}
        if len(words) > 1:
            style["linestyle"] = dashes[second.setdefault(words[1], len(second)) % 4]
        out[label] = style
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+", help="one per file (default: file names)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    parser.add_argument("--out", type=Path, default=Path("comparison"), help="output directory")
    parser.add_argument(
        "--group-by", help="comma-separated factors that label the lines (colour, then style)"
    )
    args = parser.parse_args(argv)
    try:
        files = expand(args.files)
    except ValueError as e:
        parser.error(str(e))
    results = [read_results(f) for f in files]
    group_by = [f for f in (args.group_by or "").split(",") if f]
    try:
        if args.labels:
            labels = args.labels
        elif group_by:
            labels = grouped_labels(results, group_by)
        else:
            labels = default_labels(files, results)
            vllm = [is_vllm_file(points) for points in results]
            labels = [
                str(points[0]["model_id"]) if v else label
                for label, points, v in zip(labels, results, vllm, strict=True)
            ]
    except ValueError as e:
        parser.error(str(e))
    if len(labels) != len(files):
        parser.error(f"{len(files)} files but {len(labels)} labels")
    if args.labels and len(set(labels)) != len(labels):
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

    series = merge(labels, results)
    rows = [
        {**p, "label": label}
        for label, points in series.items()
        for p in sorted(points, key=lambda p: p.get("max_concurrency") or 0)
    ]
    columns = ("label", "max_concurrency", *args.metrics)
    print(format_table(rows, columns))
    args.out.mkdir(parents=True, exist_ok=True)
    line_styles = styles(list(series)) if group_by else None
    paths = [
        plot_comparison(series, m, args.out / f"{m}.png", styles=line_styles) for m in args.metrics
    ]
    summary = write_csv([{k: r.get(k) for k in columns} for r in rows], args.out / "summary.csv")
    print("plots:", ", ".join(map(str, paths)))
    print("summary:", summary)
    return paths


if __name__ == "__main__":
    main()
