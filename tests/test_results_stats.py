"""Comparisons a reviewer would accept: one series per configuration, repeats averaged with a
bootstrap interval, paper tables, simulated points independent of their neighbours, and
figures whose captions say what is drawn and whose text does not overlap."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from research.bench.stats import (
    bootstrap_ci,
    latex_table,
    series_of,
    significance,
    summary_rows,
)

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


def _points(models=("qwen3-coder-30b-a3b", "llama-3.3-70b"), blocks=(8, 16, 32), reps=1):
    """A block-size ablation over two models in ONE file per block size, as the README's
    ``-m experiment=reproduce_spark cache.block_size=8,16,32`` writes it."""
    out = []
    for block in blocks:
        for model in models:
            for c in (1, 8, 32):
                for r in range(reps):
                    out.append({
                        "label": f"simulated-gb10 {model} awq", "model": model,
                        "block_size": block, "max_concurrency": c, "repeat": r,
                        "output_throughput": (100 if "qwen" in model else 10) * c + block + r,
                        "executor": "simulated-gb10", "hardware": "gb10",
                    })  # fmt: skip
    return out


def test_two_models_never_share_a_series():
    """The bug this guards: a job's results.jsonl holds both models, and a per-file series drew
    them as one sawtooth. Per-point series: 2 models x 3 block sizes = 6 series, each of one
    model and one block size."""
    series = series_of(_points())
    assert len(series) == 6
    for name, pts in series.items():
        assert len({p["model"] for p in pts}) == 1, name
        assert len({p["block_size"] for p in pts}) == 1, name
        assert f"block_size={pts[0]['block_size']}" in name and pts[0]["model"] in name
    grouped = series_of(_points(), group_by=["model"])
    for name, pts in grouped.items():
        assert name == f"model={pts[0]['model']}, block_size={pts[0]['block_size']}"


def test_the_same_configuration_in_two_files_is_one_series_of_repeats():
    """Files are not series: the same configuration run twice (two folders) is two repeats of
    one series; a configuration that differs in any axis is another series."""
    pts = _points(models=("m",), blocks=(8,))
    again = [dict(p, repeat=0) for p in pts]
    fp8 = [dict(p, kv_cache_dtype="fp8") for p in pts]
    assert [len(v) for v in series_of(pts + again).values()] == [2 * len(pts)]
    assert len(series_of(pts + fp8)) == 2


def test_repeats_average_with_a_bootstrap_interval():
    rows = summary_rows(series_of(_points(reps=3)), ["output_throughput"])
    assert len(rows) == 18 and all(r["n"] == 3 for r in rows)
    r = rows[0]
    assert (
        r["output_throughput_ci_lo"] <= r["output_throughput_mean"] <= r["output_throughput_ci_hi"]
    )
    assert r["output_throughput_ci_lo"] < r["output_throughput_ci_hi"]
    one = summary_rows(series_of(_points()), ["output_throughput"])
    assert all(r["n"] == 1 and math.isnan(r["output_throughput_ci_lo"]) for r in one)
    lo, hi = bootstrap_ci([10.0, 11.0, 12.0, 13.0])
    assert (lo, hi) == bootstrap_ci([10.0, 11.0, 12.0, 13.0])  # deterministic
    assert 10.0 <= lo < 11.5 < hi <= 13.0


def test_significance_says_when_an_ablation_is_inside_its_intervals():
    """Block sizes 8 and 16 differ by 8 tok/s on values spread by 0..2 (inside nothing); a
    spread wider than the gap makes the difference not significant."""
    rows = summary_rows(series_of(_points(models=("m",), blocks=(8, 16), reps=3)),
                        ["output_throughput"])  # fmt: skip
    s = significance(rows, "output_throughput")
    assert {x["axis"] for x in s} == {"block_size"} and all(x["significant"] for x in s)
    noisy = _points(models=("m",), blocks=(8, 16), reps=3)
    for p in noisy:
        p["output_throughput"] += 40 * (p["repeat"] - 1)
    rows = summary_rows(series_of(noisy), ["output_throughput"])
    assert not any(x["significant"] for x in significance(rows, "output_throughput"))


def test_latex_table_is_booktabs_with_intervals():
    rows = summary_rows(series_of(_points(reps=3)), ["output_throughput", "p99_ttft_ms"])
    tex = latex_table(rows, ["output_throughput", "p99_ttft_ms"], caption="a_b 50%")
    assert tex.count(r"\toprule") == tex.count(r"\midrule") == tex.count(r"\bottomrule") == 1
    body = tex.split(r"\midrule")[1].split(r"\bottomrule")[0]
    data = [ln for ln in body.splitlines() if ln.endswith(r"\\")]
    assert len(data) == len(rows)
    cells = data[0].rstrip("\\ ").split(" & ")
    assert len(cells) == 5 and re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\]", cells[3])
    assert r"a\_b 50\%" in tex and "\\begin{tabular}{lrrrr}" in tex


def test_a_simulated_point_is_the_same_whatever_ran_before_it(tmp_path):
    """n-gram speculation on the simulated GB10: concurrency 32 alone and after 8 give the
    same figure (acceptance draws and the engine's state start from the point's own seed)."""
    from hydra import compose, initialize_config_dir

    from experiments.sweep import run_experiment
    from research.config import register_configs, run_config_from

    def run(concurrencies, out):
        register_configs()
        with initialize_config_dir(config_dir=CONFIGS, version_base=None):
            cfg = compose(config_name="config", overrides=[
                "experiment=speculative", "speculative=ngram", "tracking=disabled",
                f"experiment.concurrencies=[{','.join(map(str, concurrencies))}]",
                "workload.output_len=64",
            ])  # fmt: skip
        return run_experiment(run_config_from(cfg), out, progress=False)

    alone = run([32], tmp_path / "a")[-1]
    after = run([8, 32], tmp_path / "b")[-1]
    assert alone["spec_acceptance_rate"] == after["spec_acceptance_rate"]
    assert alone["output_throughput"] == after["output_throughput"]
    assert alone["median_ttft_ms"] == after["median_ttft_ms"]


@pytest.fixture(scope="module")
def repeated_run(tmp_path_factory):
    """The real engine (tiny-llama), three repeats of two concurrencies."""
    from hydra import compose, initialize_config_dir

    from experiments.sweep import run_experiment
    from research.config import register_configs, run_config_from

    out = tmp_path_factory.mktemp("repeats") / "run"
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "model=tiny_llama", "experiment.concurrencies=[1,4]", "experiment.repeats=3",
            "experiment.prompts_per_concurrency=1", "workload.input_len=16",
            "workload.output_len=8", "tracking=disabled",
        ])  # fmt: skip
    points = run_experiment(run_config_from(cfg), out, progress=False)
    return out, points


def test_three_repeats_of_the_real_engine_compare_into_ci_columns_and_a_latex_table(repeated_run):
    from experiments.compare import main as compare

    out, points = repeated_run
    assert [(p["max_concurrency"], p["repeat"]) for p in points] == [
        (1, 0), (1, 1), (1, 2), (4, 0), (4, 1), (4, 2)
    ]  # fmt: skip
    assert len({p["seeds"]["prompts"] for p in points}) == 6  # new prompts per repeat
    compare([str(out), "--metrics", "output_throughput", "median_ttft_ms"])
    cmp = out / "comparison"
    with (cmp / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["max_concurrency"], r["n"]) for r in rows] == [("1", "3"), ("4", "3")]
    for col in ("output_throughput_mean", "output_throughput_ci_lo", "output_throughput_ci_hi"):
        assert all(float(r[col]) > 0 for r in rows)
    tex = (cmp / "table.tex").read_text()
    data = [ln for ln in tex.splitlines() if ln.endswith(r"\\") and "[" in ln]
    assert len(data) == 2
    for suffix in (".png", ".pdf", ".svg"):
        assert (cmp / f"output_throughput{suffix}").stat().st_size > 1000
    assert "Differences" in (cmp / "significance.md").read_text()


def _texts(fig):
    """Every text ``fig`` draws, with its window extent: tick labels of the ticks inside the
    view (matplotlib keeps others it does not draw), axis labels, legends, annotations and the
    caption."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [fig._supxlabel] if fig._supxlabel is not None else []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            texts += [t.label1 for t in axis._update_ticks() if t.label1.get_visible()]
            texts.append(axis.label)
        texts += list(ax.texts)
        if (legend := ax.get_legend()) is not None:
            texts += legend.get_texts()
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text().strip()]


def _overlaps(fig):
    texts = _texts(fig)
    bad = []
    for i, (a, ba) in enumerate(texts):
        for b, bb in texts[i + 1 :]:
            if (
                ba.overlaps(bb)
                and ba.intersection(ba, bb).width * ba.intersection(ba, bb).height > 1
            ):
                bad.append((a[:40], b[:40]))
    return bad


def test_figures_have_captions_true_to_their_styles_and_no_overlapping_text(repeated_run):
    """Drawn from points with repeats (error bars) and a simulated series: the caption names
    what the lines and bars are, its claim about dashes matches the lines drawn, and no two
    texts overlap (matplotlib's own extents)."""
    from experiments.compare import styles
    from research.bench.plots import comparison_figure, concurrency_figure, ttft_figure

    _, points = repeated_run
    sim = [dict(p, executor="simulated-gb10", label="simulated tiny-llama") for p in points]
    series = {"ours tiny-llama": points, "simulated tiny-llama": sim}
    fig = comparison_figure(series, "output_throughput")
    caption = fig._supxlabel.get_text().replace("\n", " ")
    assert "dashed: simulated" in caption and "error bars: 95% bootstrap CI" in caption
    ax = fig.axes[0]
    drawn = {
        ln.get_label(): ln.get_linestyle() for ln in ax.get_lines() if hasattr(ln, "simulated")
    }
    assert drawn == {"ours": "-", "simulated (simulated)": "--"}
    assert not _overlaps(fig)
    # Styles that take the line style away from "simulated": the caption stops claiming dashes.
    grouped = comparison_figure(series, "output_throughput",
                                styles=styles(["a=1 b=1", "a=1 b=2"]) | {
                                    "ours tiny-llama": {"linestyle": "--"},
                                    "simulated tiny-llama": {"linestyle": "-"}},
                                style_note="colour: a, line style: b")  # fmt: skip
    text = grouped._supxlabel.get_text().replace("\n", " ")
    assert "dashed: simulated" not in text and "(simulated): cost model" in text
    assert "line style: b" in text
    for f in (concurrency_figure(series), ttft_figure(series)):
        assert not _overlaps(f), _overlaps(f)
    assert "dotted: p99" in ttft_figure(series)._supxlabel.get_text().replace("\n", " ")
    json.dumps([p["max_concurrency"] for p in points])


@pytest.mark.parametrize("ratio", [1.01, 1.04, 1.3, 1.5, 3.0, 30.0, 3000.0])
@pytest.mark.parametrize("low_ms", [1.35, 13.0, 900.0])
def test_figures_label_any_range_without_overlapping_text(low_ms, ratio):
    """Curves whose values span from a hair to several decades (timed runs land anywhere):
    no two tick labels, legend entries or captions overlap in any figure."""
    from research.bench.plots import comparison_figure, concurrency_figure, ttft_figure

    points = [
        dict(max_concurrency=c, repeat=r, median_ttft_ms=v, p99_ttft_ms=1.02 * v,
             output_throughput=v, per_user_tok_s=v / 10, executor="engine")
        for c, f in ((1, 1.0), (4, ratio))
        for r in range(3)
        for v in [low_ms * f * (1 + 0.002 * r)]
    ]  # fmt: skip
    sim = [dict(p, executor="simulated-gb10") for p in points]
    series = {"ours tiny-llama": points, "simulated tiny-llama": sim}
    figures = (comparison_figure(series, "output_throughput"), concurrency_figure(series),
               ttft_figure(series))  # fmt: skip
    for fig in figures:
        assert not _overlaps(fig), (fig.axes[0].get_ylabel(), _overlaps(fig))


def test_prediction_bands_figure_is_paper_grade(tmp_path):
    """300-dpi PNG with PDF and SVG beside it, TTFT on a log axis, a caption that says what the
    line and the band are, and no overlapping text."""
    from matplotlib.image import imread

    from research.perf.bands import plot_prediction_bands, prediction_bands_figure

    points = []
    for model, scale in (("qwen3-coder-30b-a3b", 10.0), ("llama-3.3-70b", 1.0)):
        for c in (1, 8, 64, 256):
            p = {"label": f"simulated-gb10 {model} awq", "max_concurrency": c,
                 "output_throughput": scale * 6 * c ** 0.7, "per_user_tok_s": scale * 6 / c ** 0.3,
                 "median_ttft_ms": 40.0 * c, "executor": "simulated-gb10", "hardware": "gb10"}  # fmt: skip
            for m in ("output_throughput", "per_user_tok_s", "median_ttft_ms"):
                p[f"band_{m}_lo"], p[f"band_{m}_hi"] = 0.8 * p[m], 1.2 * p[m]
            points.append(p)
    path = plot_prediction_bands(points, tmp_path / "prediction_bands.png")
    assert path.with_suffix(".pdf").exists() and path.with_suffix(".svg").exists()
    assert imread(path).shape[1] == 7 * 300  # 7 in at 300 dpi
    fig = prediction_bands_figure(points)
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "log", "log"]  # each spans decades
    text = fig._supxlabel.get_text().replace("\n", " ")
    assert "solid line: prediction" in text and "shaded band" in text
    assert not _overlaps(fig), _overlaps(fig)


def test_a_two_model_ablation_draws_one_panel_per_model_with_its_series(tmp_path):
    """The README's block-size ablation over Qwen and Llama through the compare CLI: one panel
    per model, each with its three block sizes labelled, and summary.csv rows per model."""
    from experiments.compare import main as compare
    from research.bench.plots import comparison_figure

    for block in (8, 16, 32):
        job = tmp_path / "sweep" / str(block)
        job.mkdir(parents=True)
        pts = [p for p in _points(blocks=(block,))]
        (job / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pts))
    compare([str(tmp_path / "sweep"), "--metrics", "output_throughput", "--group-by", "block_size"])
    with (tmp_path / "sweep" / "comparison" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["label"], r["model"]) for r in rows} == {
        (f"block_size={b}, model={m}", m)
        for b in (8, 16, 32) for m in ("qwen3-coder-30b-a3b", "llama-3.3-70b")
    }  # fmt: skip
    series = series_of(_points(), group_by=["block_size"])
    fig = comparison_figure(series, "output_throughput", facet_by="model")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["model=qwen3-coder-30b-a3b", "model=llama-3.3-70b"]
    for ax in panels:
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert sorted(legend) == [f"block_size={b} (simulated)" for b in ("16", "32", "8")]
    assert not _overlaps(fig), _overlaps(fig)
