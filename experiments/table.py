"""The comparison as paper tables only: ``python -m experiments.table SWEEP_DIR [files ...]``.

Same arguments as ``experiments.compare`` (series, ``--labels``, ``--group-by``, ``--metrics``,
``--out``); writes ``table.tex`` (booktabs: ``\\usepackage{booktabs}``), ``table.md``,
``summary.csv`` and ``significance.md``, each metric as the mean over repeats with its 95%
bootstrap interval, and prints the Markdown table. Series are named by what varies between
them (``block_size=8``), with what they share as the tables' caption (``shared: ...``). No
figures.
"""

from __future__ import annotations

from pathlib import Path

from experiments.compare import parse_args, prepare, write_tables


def main(argv: list[str] | None = None) -> dict[str, Path]:
    from research.bench.plots import caption
    from research.bench.stats import markdown_table

    args = parse_args(argv)
    series, rows, _group_by = prepare(args)
    shared = caption(series)
    tables = write_tables(rows, args.metrics, args.out, shared)
    print(markdown_table(rows, args.metrics) + (f"\n\n{shared}" if shared else ""))
    print("tables:", tables["latex"], tables["markdown"])
    return tables


if __name__ == "__main__":
    main()
