"""Series, repeats and intervals: how benchmark points become the rows of a comparison.

A *configuration* is the value of every swept axis (``SERIES_AXES``: model, hardware,
quantization, policy, block size, engine, ...); a *series* is one configuration across
concurrency. Points of one configuration at one concurrency are *repeats* (``repeat`` 0, 1, ...
of one sweep, or the same command run twice): they are averaged, never drawn as separate lines,
and carry a 95% bootstrap confidence interval of the mean. Two configurations never share a
series: ``series_of`` names each series by the axes that vary between the points it is given,
as ``key=value`` (``model=qwen3-coder-30b-a3b, block_size=8``; the ``--group-by`` axes first),
and raises if two configurations would get one name; ``series_caption`` is the one line of the
values they all share (``shared: hardware=gb10, engine=vllm, ...``). ``varying_labels`` does
both for any list of configurations (the sizing CLI's curves, the figures, the tables).

``summary_rows`` gives one row per series and concurrency with ``<metric>_mean``,
``<metric>_ci_lo``, ``<metric>_ci_hi`` and ``n`` (the interval is empty for n = 1: one run has
none); ``significance`` compares series that differ in one axis only (an ablation) point by
point and says when the difference is inside the intervals; ``latex_table`` (booktabs) and
``markdown_table`` write the rows as a paper table. NumPy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# Keys of a results row that name what a run varied: a series is one value of all of them.
SERIES_AXES = (
    "model",
    "hardware",
    "engine",
    "quantization",
    "kv_cache_dtype",
    "dtype",
    "executor",
    "attention_backend",
    "gemm_backend",
    "num_scheduler_steps",
    "scheduling_policy",
    "block_size",
    "enable_prefix_caching",
    "max_num_seqs",
    "tensor_parallel_size",
    "num_replicas",
    "replica_routing",
    "moe_routing",
    "speculative_method",
    "num_speculative_tokens",
    "dataset",
    "input_len",
    "output_len",
    "range_ratio",
    "request_rate",
)
# Keys that tell repeats of one configuration apart (averaged, never a series of their own).
REPEAT_KEYS = ("repeat",)
CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 10_000


def bootstrap_ci(
    values: Sequence[float], confidence: float = CONFIDENCE, samples: int = BOOTSTRAP_SAMPLES
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (deterministic: a fixed seed);
    (nan, nan) for fewer than two values."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if x.size < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(0)
    means = x[rng.integers(0, x.size, size=(samples, x.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _value(point: Mapping[str, Any], axis: str) -> str:
    v = point.get(axis)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return "" if v is None else str(v)


def varied_axes(
    points: Sequence[Mapping[str, Any]], axes: Sequence[str] = SERIES_AXES
) -> list[str]:
    """The axes on which ``points`` do not all agree."""
    return [a for a in axes if len({_value(p, a) for p in points}) > 1]


LABEL_SEPARATOR = ", "
SHARED_PREFIX = "shared: "
MISSING = "-"  # a varying key a configuration does not have, where its name would be empty


def varying_labels(
    configs: Sequence[Mapping[str, Any]],
    keys: Sequence[str] = SERIES_AXES,
    *,
    always: Sequence[str] = (),
    lead: bool = True,
) -> tuple[list[str], str]:
    """Names for configurations compared side by side, and one caption line for the rest.

    Each name is the ``keys`` on which ``configs`` differ, as ``key=value`` joined by ", "
    (``model=qwen3-coder-30b-a3b, quantization=awq``); the caption is ``shared: key=value, ...``
    of the keys every config gives the same value. Keys are the results' own column names (the
    last part of a Hydra override: ``cache.block_size=8`` is ``block_size=8``), in ``keys``
    order after the ``always`` ones, which are in every name whether they vary or not. A key no
    config has is left out; a varying key that one config lacks is left out of its name (written
    ``key=-`` only where the name would be empty). When nothing varies (one config, or all
    equal) and ``lead`` is set, each name is the first shared key (the model) and the caption
    holds the rest; without ``lead`` the names are then empty."""
    keys = [*always, *(k for k in keys if k not in always)]
    varying = set(varied_axes(configs, keys)) | set(always)
    shared = [
        f"{k}={_value(configs[0], k)}"
        for k in keys
        if configs and k not in varying and _value(configs[0], k) != ""
    ]
    labels = []
    for c in configs:
        parts = [f"{k}={_value(c, k)}" for k in keys if k in varying and _value(c, k) != ""]
        if not parts and varying:
            parts = [f"{k}={_value(c, k) or MISSING}" for k in keys if k in varying]
        labels.append(LABEL_SEPARATOR.join(parts))
    if lead and shared and not any(labels):
        labels, shared = [shared[0]] * len(configs), shared[1:]
    caption = SHARED_PREFIX + LABEL_SEPARATOR.join(shared) if shared else ""
    return labels, caption


def configuration(
    points: Sequence[Mapping[str, Any]], axes: Sequence[str] = SERIES_AXES
) -> dict[str, Any]:
    """The ``axes`` values all ``points`` agree on (None where they do not, or have none)."""
    return {
        a: points[0].get(a) if points and len({_value(p, a) for p in points}) == 1 else None
        for a in axes
    }


def series_of(
    points: Sequence[Mapping[str, Any]],
    group_by: Sequence[str] = (),
    base: Sequence[str] | None = None,
    axes: Sequence[str] = SERIES_AXES,
) -> dict[str, list[dict[str, Any]]]:
    """``points`` as {series name: points}, one series per configuration: its ``axes`` values
    (and its own ``label`` where two runs agree on every axis, e.g. two peer servers). A name is
    what varies between the configurations, as ``varying_labels`` writes it: the ``group_by``
    axes first, then every other axis that varies, ``axis=value`` joined by ", "; after a
    ``base`` word where one is given for a point (``--labels``, a vLLM file's ``model_id``: an
    axis whose value the word already says is not repeated), and after the point's own label
    where the axes do not tell two configurations apart. With nothing varying, the model names
    the one series (``series_caption`` gives the values they share). Raises ValueError if two
    configurations would share a name, or a ``group_by`` axis is on no point."""
    for axis in group_by:
        if not any(axis in p for p in points):
            raise ValueError(f"--group-by {axis}: no point has it; axes: {', '.join(SERIES_AXES)}")
    words = [str(w) for w in base] if base is not None else [""] * len(points)
    first: dict[tuple[str, ...], Mapping[str, Any]] = {}
    keys = []
    for p, word in zip(points, words, strict=True):
        key = (*(_value(p, a) for a in axes), word, str(p.get("label") or ""))
        keys.append(key)
        first.setdefault(key, p)
    # The run's own label names a series only where the axes and given words do not.
    by_label = len({k[:-1] for k in first}) < len(first)
    labels, _ = varying_labels(
        list(first.values()), axes, always=group_by, lead=not (any(words) or by_label)
    )
    names: dict[tuple[str, ...], str] = {}
    for key, label in zip(first, labels, strict=True):
        lead = [w for w in (key[-2], key[-1] if by_label else "") if w]
        said = {w for word in lead for w in word.split()}
        parts = [x for x in label.split(LABEL_SEPARATOR) if x and x.split("=", 1)[1] not in said]
        names[key] = LABEL_SEPARATOR.join([*lead, *parts]) or "results"
    seen: dict[str, tuple[str, ...]] = {}
    for key, name in names.items():
        if (other := seen.setdefault(name, key)) != key:
            raise ValueError(
                f"two configurations would share the series {name!r}: they differ in "
                + ", ".join(
                    a
                    for a, x, y in zip((*axes, "base", "label"), key, other, strict=True)
                    if x != y
                )
            )
    series: dict[str, list[dict[str, Any]]] = {}
    for p, key in zip(points, keys, strict=True):
        series.setdefault(names[key], []).append(dict(p))
    return series


def series_caption(
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    axes: Sequence[str] = SERIES_AXES,
    extra: Sequence[str] = (),
) -> str:
    """``shared: key=value, ...``: the ``axes`` every series of ``series`` agrees on, less what
    every series name already says (the model naming the only series), after the ``extra``
    words (what a caller's own series names share); "" when there is nothing to say."""
    names = [set(str(name).split(LABEL_SEPARATOR)) for name in series]
    configs = [configuration(list(pts), axes) for pts in series.values()]
    said = {
        a
        for a in axes
        if configs and all(f"{a}={_value(c, a)}" in n for c, n in zip(configs, names, strict=True))
    }
    rest = [{a: c[a] for a in axes if a not in said} for c in configs]
    caption = varying_labels(rest, axes, lead=False)[1].removeprefix(SHARED_PREFIX)
    items = caption.split(LABEL_SEPARATOR) if caption else []
    values = {x.split("=", 1)[-1] for x in items}
    words = [w for w in extra if w and w not in items and w not in values]
    return SHARED_PREFIX + LABEL_SEPARATOR.join(words + items) if words or items else ""


METRIC_LABELS = {
    "output_throughput": "aggregate output tok/s",
    "total_token_throughput": "total (prompt + output) tok/s",
    "request_throughput": "requests/s",
    "per_user_tok_s": "per-user tok/s (1000 / median TPOT)",
    "median_ttft_ms": "median TTFT (ms)",
    "p99_ttft_ms": "p99 TTFT (ms)",
    "median_tpot_ms": "median TPOT (ms)",
    "median_itl_ms": "median ITL (ms)",
    "median_e2el_ms": "median E2EL (ms)",
}


def concurrency(point: Mapping[str, Any]) -> int | None:
    """How many requests a point kept in flight: its cap, or all of them when sent at once."""
    if point.get("max_concurrency") is not None:
        return int(point["max_concurrency"])
    if math.isinf(float(point.get("request_rate", math.inf))):
        return int(point["num_prompts"])
    return None


def summary_rows(
    series: Mapping[str, Sequence[Mapping[str, Any]]], metrics: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per series and concurrency: the series' axes, ``n`` and per metric its mean and
    95% bootstrap interval (``<metric>_mean``, ``<metric>_ci_lo``, ``<metric>_ci_hi``)."""
    rows = []
    for name, points in series.items():
        by_c: dict[int, list[Mapping[str, Any]]] = {}
        for p in points:
            if (c := concurrency(p)) is not None:
                by_c.setdefault(c, []).append(p)
        for c in sorted(by_c):
            reps = by_c[c]
            row: dict[str, Any] = {"label": name}
            row |= {a: reps[0].get(a) for a in SERIES_AXES if reps[0].get(a) is not None}
            row |= {"max_concurrency": c, "n": len(reps)}
            for m in metrics:
                vals = [float(p[m]) for p in reps if p.get(m) is not None]
                mean = float(np.mean(vals)) if vals else math.nan
                lo, hi = bootstrap_ci(vals)
                row |= {f"{m}_mean": mean, f"{m}_ci_lo": lo, f"{m}_ci_hi": hi}
            rows.append(row)
    return rows


def significance(
    rows: Sequence[Mapping[str, Any]], metric: str, axes: Iterable[str] = SERIES_AXES
) -> list[dict[str, Any]]:
    """For every two series that differ in exactly one axis, at each concurrency both have:
    the relative difference of the means and whether it is outside both 95% intervals
    (``significant``: the intervals do not overlap; None where either has one run)."""
    axes = list(axes)
    by_label: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in rows:
        by_label.setdefault(r["label"], {})[r["max_concurrency"]] = r
    labels = list(by_label)
    out = []
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            ra, rb = next(iter(by_label[a].values())), next(iter(by_label[b].values()))
            diff = [x for x in axes if _value(ra, x) != _value(rb, x)]
            if len(diff) != 1:
                continue
            for c in sorted(set(by_label[a]) & set(by_label[b])):
                pa, pb = by_label[a][c], by_label[b][c]
                ma, mb = pa[f"{metric}_mean"], pb[f"{metric}_mean"]
                intervals = [
                    (p[f"{metric}_ci_lo"], p[f"{metric}_ci_hi"]) for p in (pa, pb)
                ]  # fmt: skip
                known = all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in intervals)
                (alo, ahi), (blo, bhi) = intervals
                out.append(
                    {
                        "axis": diff[0],
                        "a": a,
                        "b": b,
                        "max_concurrency": c,
                        "relative_difference": mb / ma - 1 if ma else math.nan,
                        "significant": (ahi < blo or bhi < alo) if known else None,
                    }
                )
    return out


def significance_notes(rows: Sequence[Mapping[str, Any]], metric: str) -> list[str]:
    """``significance`` as sentences, one per compared point."""
    notes = []
    for s in significance(rows, metric):
        head = (
            f"{metric} at concurrency {s['max_concurrency']}: {s['b']} vs {s['a']} "
            f"({s['axis']}) {s['relative_difference']:+.1%}"
        )
        if s["significant"] is None:
            notes.append(f"{head}: one run per point, no interval (use experiment.repeats)")
        elif s["significant"]:
            notes.append(f"{head}: outside both 95% intervals")
        else:
            notes.append(f"{head}: inside the 95% intervals, not significant")
    return notes


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "--"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def _cells(row: Mapping[str, Any], metrics: Sequence[str], tex: bool) -> list[str]:
    cells = []
    for m in metrics:
        mean, lo, hi = row[f"{m}_mean"], row[f"{m}_ci_lo"], row[f"{m}_ci_hi"]
        if math.isfinite(lo):
            cells.append(f"{_fmt(mean)} [{_fmt(lo)}, {_fmt(hi)}]")
        else:
            cells.append(_fmt(mean))
    if tex:
        cells = [c.replace("--", "---") for c in cells]
    return cells


TEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "_": r"\_",
    "%": r"\%",
    "&": r"\&",
    "#": r"\#",
    "$": r"\$",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _tex_escape(s: str) -> str:
    out = []
    for ch in s:
        out.append(TEX_SPECIALS.get(ch, ch))
    return "".join(out)


def metric_header(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def markdown_table(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> str:
    """Series, concurrency, n and each metric as ``mean [95% CI]``."""
    head = ["series", "concurrency", "n", *(metric_header(m) for m in metrics)]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * len(metrics)]
    for r in rows:
        cells = [
            str(r["label"]),
            str(r["max_concurrency"]),
            str(r["n"]),
            *_cells(r, metrics, False),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def latex_table(
    rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], caption: str = "", label: str = ""
) -> str:
    """A booktabs ``table`` environment: one row per series and concurrency, each metric as
    mean [95% CI] (``\\usepackage{booktabs}``)."""
    head = ["Series", "Conc.", "$n$", *(_tex_escape(metric_header(m)) for m in metrics)]
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        r"\begin{tabular}{l" + "r" * (2 + len(metrics)) + "}",
        r"\toprule",
        " & ".join(head) + r" \\",
        r"\midrule",
    ]
    previous = None
    for r in rows:
        if previous is not None and r["label"] != previous:
            lines.append(r"\addlinespace")
        previous = r["label"]
        cells = [_tex_escape(str(r["label"])), str(r["max_concurrency"]), str(r["n"])]
        cells += [_tex_escape(c) for c in _cells(r, metrics, True)]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(r"\caption{" + _tex_escape(caption) + "}")
    if label:
        lines.append(r"\label{" + label + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"
