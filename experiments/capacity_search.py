"""The end of a configuration search (``experiment=capacity_search``, or any multirun of
``experiment=capacity``): every job's users at the SLO against its p99 TTFT there, the Pareto
front (no other job serves more users at a lower p99 TTFT) and the best configuration.

Reads each job's ``capacity.json`` and the overrides Hydra recorded for it
(``<job>/.hydra/overrides.yaml``); a job that failed (an infeasible configuration: no room for
the KV cache) has no ``capacity.json`` and is listed as failed. Writes ``pareto.json`` (every
job, the front, the best) and ``pareto.png`` into the sweep directory;
``python -m experiments.capacity_search SWEEP_DIR`` redraws them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def jobs(sweep: Path) -> list[dict[str, Any]]:
    import yaml

    out = []
    for job in sorted(
        (p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    ):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
        row: dict[str, Any] = {"job": int(job.name), "overrides": overrides}
        result = job / "capacity.json"
        if result.exists():
            from experiments.capacity import objective

            users, p99 = objective(job)
            row |= {"users": users, "p99_ttft_ms": p99, "failed": False}
        else:
            row |= {"users": None, "p99_ttft_ms": None, "failed": True}
        out.append(row)
    return out


def front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Jobs no other job dominates (at least as many users and at most the p99 TTFT, one of
    them strictly)."""
    ok = [r for r in rows if not r["failed"] and math.isfinite(r["p99_ttft_ms"])]

    def dominated(r: dict[str, Any]) -> bool:
        return any(
            o["users"] >= r["users"] and o["p99_ttft_ms"] <= r["p99_ttft_ms"]
            and (o["users"] > r["users"] or o["p99_ttft_ms"] < r["p99_ttft_ms"])
            for o in ok
        )  # fmt: skip

    return sorted((r for r in ok if not dominated(r)), key=lambda r: -r["users"])


def pareto(sweep: str | Path) -> dict[str, Any] | None:
    from matplotlib.figure import Figure

    from research.bench import plots

    sweep = Path(sweep)
    rows = jobs(sweep)
    if not rows:
        return None
    best_front = front(rows)
    best = best_front[0] if best_front else None
    out = {"jobs": rows, "pareto": [r["job"] for r in best_front], "best": best}
    (sweep / "pareto.json").write_text(json.dumps(out, indent=2) + "\n")
    fig = Figure(figsize=(plots.WIDTH_IN * 0.6, 2.8), layout="constrained")
    ax = fig.subplots()
    ok = [r for r in rows if not r["failed"]]
    ax.scatter([r["p99_ttft_ms"] for r in ok], [r["users"] for r in ok], s=8, color="tab:blue")
    xs = [r["p99_ttft_ms"] for r in sorted(best_front, key=lambda r: r["p99_ttft_ms"])]
    ys = [r["users"] for r in sorted(best_front, key=lambda r: r["p99_ttft_ms"])]
    ax.plot(xs, ys, color="tab:red", marker="o", markersize=4, label="Pareto front")
    ax.set_xlabel("p99 TTFT at the capacity (ms)", fontsize=7)
    ax.set_ylabel("users at the SLO", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=6)
    failed = sum(r["failed"] for r in rows)
    fig.supxlabel(
        f"{len(rows)} configurations, {failed} infeasible; best: "
        + (" ".join(best["overrides"]) if best else "none"),
        fontsize=plots.CAPTION_FONTSIZE,
        wrap=True,
    )
    plots._save(fig, sweep / "pareto.png")
    if best:
        print(f"best of {len(rows)} configurations: {best['users']:g} users, p99 TTFT "
              f"{best['p99_ttft_ms']:.0f} ms: {' '.join(best['overrides'])}")  # fmt: skip
    return out


if __name__ == "__main__":
    pareto(sys.argv[1])
