"""Compare result files on one figure: ``python -m experiments.compare A.jsonl B.json ...``.

Each file (our results.jsonl or a real ``vllm bench serve --save-result`` JSON) becomes one line
per metric, labelled by its file name unless ``--labels`` are given, with concurrency on x:
block size, quantization or policy ablations, our engine against HF generate or vLLM.

    python -m experiments.compare ours/results.jsonl hf/results.jsonl --labels ours hf \\
        --metrics output_throughput per_user_tok_s median_ttft_ms --out comparison
"""

from __future__ import annotations

import argparse
from pathlib import Path

from research.bench.report import format_table, read_results

DEFAULT_METRICS = ("output_throughput", "per_user_tok_s", "median_ttft_ms", "p99_ttft_ms")


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+", help="one per file (default: file names)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    parser.add_argument("--out", type=Path, default=Path("comparison"), help="output directory")
    args = parser.parse_args(argv)
    labels = args.labels or [f.parent.name if f.stem == "results" else f.stem for f in args.files]
    if len(labels) != len(args.files):
        parser.error(f"{len(args.files)} files but {len(labels)} labels")

    from research.bench.plots import plot_comparison

    series = {label: read_results(f) for label, f in zip(labels, args.files, strict=True)}
    rows = [{**p, "label": label} for label, points in series.items() for p in points]
    print(format_table(rows, ("label", "max_concurrency", *args.metrics)))
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [plot_comparison(series, m, args.out / f"{m}.png") for m in args.metrics]
    print("plots:", ", ".join(map(str, paths)))
    return paths


if __name__ == "__main__":
    main()
