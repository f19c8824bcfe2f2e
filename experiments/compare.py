"""Compare result files on one figure: ``python -m experiments.compare A.jsonl B.json ...``.

Each file is our results.jsonl or a real ``vllm bench serve --save-result`` JSON; a directory
stands for every results.jsonl below it (a Hydra multirun folder), in natural order (job 2
before job 10). Series are built per POINT, not per file (``research.bench.stats``): one series
per configuration, i.e. per value of every swept axis (model, hardware, quantization, policy,
block size, engine, ...), so a file holding two models gives two series and two configurations
never share one. Points of one configuration at one concurrency (``experiment.repeats``, or the
same run twice) are repeats: averaged, with a 95% bootstrap interval.

Series are named by the axes that differ between them, as ``key=value`` with the results'
column names (``model=llama-3.3-70b, block_size=8``); the values every series shares are one
caption line (``shared: hardware=gb10, engine=vllm, ...``) under the figures and ``table.tex``.
``--labels`` puts one word per file first (still completed with the axes that differ);
``--group-by quantization,scheduling_policy`` puts those axes first (colour per value of the
first, line style per value of the second, then any other axis that varies). Runs that agree on
every axis (two peer servers) are told apart by their own ``label``; files written by
``vllm bench serve --save-result`` (one per concurrency) are named by their ``model_id``.

Written to ``--out`` (default ``<dir>/comparison`` for one directory, else ``comparison/``): one
figure per metric (300-dpi PNG, PDF, SVG; error bars where there are repeats), ``summary.csv``
(per series and concurrency: the axes, ``n``, ``<metric>_mean``, ``<metric>_ci_lo``,
``<metric>_ci_hi``), ``table.tex`` (booktabs) and ``table.md`` with the intervals, and
``significance.md``: for every two series that differ in one axis, whether each difference is
outside the intervals. ``python -m experiments.table`` writes the tables only.

    python -m experiments.compare ours/results.jsonl hf/results.jsonl --labels ours hf \\
        --metrics output_throughput per_user_tok_s median_ttft_ms --out comparison
    python -m experiments.compare multirun/<date>/<time> --group-by block_size --facet-by model

Figures get one panel per model when several models are compared (``--facet-by``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from research.bench.provenance import write_csv
from research.bench.report import read_results, result_files
from research.bench.stats import (
    LABEL_SEPARATOR,
    SERIES_AXES,
    latex_table,
    markdown_table,
    series_of,
    significance_notes,
    summary_rows,
)

DEFAULT_METRICS = ("output_throughput", "per_user_tok_s", "median_ttft_ms", "p99_ttft_ms")
FACTORS = SERIES_AXES  # the axes a series is keyed by (kept under its old name)


def expand(paths: list[Path]) -> list[Path]:
    """``research.bench.report.result_files`` (kept under the CLI's old name)."""
    return result_files(paths)


def is_vllm_file(points: list[dict[str, Any]]) -> bool:
    """A ``vllm bench serve --save-result`` file: its points carry no label of ours."""
    return bool(points) and all("label" not in p and p.get("model_id") for p in points)


def styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """Colour by the first ``k=v`` part of a label, line style by the second."""
    colors = [f"C{i}" for i in range(10)]
    dashes = ["-", "--", ":", "-."]
    first: dict[str, int] = {}
    second: dict[str, int] = {}
    out = {}
    for label in labels:
        words = label.split(LABEL_SEPARATOR)
        style: dict[str, Any] = {"color": colors[first.setdefault(words[0], len(first)) % 10]}
        if len(words) > 1:
            style["linestyle"] = dashes[second.setdefault(words[1], len(second)) % 4]
        out[label] = style
    return out


def load(files: list[Path], labels: list[str] | None) -> tuple[list[dict], list[str]]:
    """Every point of ``files`` and the word its series name starts with: its file's
    ``--labels`` word, its vLLM ``model_id`` (vLLM files), its folder's name for a point that
    names nothing itself, else none (the axes that vary name it: ``series_of``)."""
    points, base = [], []
    for i, f in enumerate(files):
        pts = read_results(f)
        vllm = is_vllm_file(pts)
        for p in pts:
            points.append(p)
            if labels:
                base.append(labels[i])
            elif vllm:
                base.append(str(p["model_id"]))
            else:
                base.append("" if p.get("label") or p.get("model") else f.parent.name)
    return points, base


def facet_axis(
    series: dict[str, list[dict]], group_by: list[str], requested: str | None
) -> str | None:
    """The axis figures are split into panels by: ``requested`` ("none": one panel), else
    ``model`` when the series hold several models and ``--group-by`` does not name it."""
    if requested is not None:
        return None if requested == "none" else requested
    models = {str(p.get("model")) for pts in series.values() for p in pts}
    return "model" if len(models) > 1 and "model" not in group_by else None


def style_note(group_by: list[str]) -> str:
    """What ``styles`` encodes, for the caption."""
    parts = []
    if group_by:
        parts.append(f"colour: {group_by[0]}")
    if len(group_by) > 1:
        parts.append(f"line style: {group_by[1]}")
    return ", ".join(parts)


def write_tables(rows: list[dict[str, Any]], metrics: list[str], out: Path, caption: str) -> dict:
    """summary.csv, table.md, table.tex and significance.md in ``out``; ``caption`` (what the
    series share) under both tables."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary": write_csv(rows, out / "summary.csv"),
        "markdown": out / "table.md",
        "latex": out / "table.tex",
        "significance": out / "significance.md",
    }
    paths["markdown"].write_text(
        markdown_table(rows, metrics) + "\n" + (f"\n{caption}\n" if caption else "")
    )
    paths["latex"].write_text(latex_table(rows, metrics, caption=caption, label="tab:comparison"))
    notes = [n for m in metrics for n in significance_notes(rows, m)]
    paths["significance"].write_text(
        "# Differences between series that differ in one axis\n\n"
        + ("\n".join(f"- {n}" for n in notes) if notes else "No two series differ in one axis.")
        + "\n"
    )
    return paths


def parse_args(argv: list[str] | None, tables_only: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+", help="one per file (default: the points' labels)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument(
        "--group-by", help="comma-separated axes that name the series (colour, then style)"
    )
    parser.add_argument(
        "--facet-by",
        default=None,
        help="one panel per value of this axis (default: model, when several models are "
        "compared and --group-by does not name it; 'none' for one panel)",
    )
    args = parser.parse_args(argv)
    args.parser = parser
    if args.out is None:
        one_dir = len(args.files) == 1 and args.files[0].is_dir()
        args.out = args.files[0] / "comparison" if one_dir else Path("comparison")
    return args


def prepare(args: argparse.Namespace) -> tuple[dict[str, list[dict]], list[dict], list[str]]:
    """(series, summary rows, group-by axes) of the command line, or a parser error."""
    parser = args.parser
    try:
        files = expand(args.files)
    except ValueError as e:
        parser.error(str(e))
    if args.labels and len(args.labels) != len(files):
        parser.error(f"{len(files)} files but {len(args.labels)} labels")
    if args.labels and len(set(args.labels)) != len(args.labels):
        parser.error(f"labels must be distinct, got {args.labels}")
    points, base = load(files, args.labels)
    group_by = [f for f in (args.group_by or "").split(",") if f]
    numeric = {
        k
        for p in points
        for k, v in p.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if unknown := [m for m in args.metrics if m not in numeric]:
        parser.error(f"no point has the metric(s) {unknown}; known: {', '.join(sorted(numeric))}")
    try:
        series = series_of(points, group_by, None if group_by else base)
    except ValueError as e:
        parser.error(str(e))
    return series, summary_rows(series, args.metrics), group_by


def main(argv: list[str] | None = None) -> list[Path]:
    from research.bench.plots import caption, plot_comparison
    from research.bench.stats import markdown_table as md

    args = parse_args(argv)
    series, rows, group_by = prepare(args)
    shared = caption(series)
    print(md(rows, args.metrics) + (f"\n\n{shared}" if shared else ""))
    line_styles = styles(list(series)) if group_by else None
    note = style_note(group_by)
    facet = facet_axis(series, group_by, args.facet_by)
    paths = [
        plot_comparison(
            series, m, args.out / f"{m}.png", styles=line_styles, style_note=note, facet_by=facet
        )
        for m in args.metrics
    ]
    tables = write_tables(rows, args.metrics, args.out, shared)
    print("plots:", ", ".join(map(str, paths)))
    print("summary:", tables["summary"])
    print("tables:", tables["latex"], tables["markdown"])
    print("significance:", tables["significance"])
    return paths


if __name__ == "__main__":
    main()
