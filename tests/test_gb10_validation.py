"""The simulator against public GB10 measurements (research.perf.validation): the data, the
pieces of structure taken from outside the fit (GGUF bytes, the routing law), and the error
bounds on the points that were never fitted."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from research.perf import routing
from research.perf.cost_model import CostModel, StepShape
from research.perf.llama_cpp_fit import (
    DATA,
    GGUF_MODELS,
    LLAMA_CPP_SOURCES,
    PROFILES,
    Point,
    _base_params,
    cost_model,
    eager_layer_overhead,
    first_timed_run,
    growth,
    is_fit_point,
    load_points,
    summary,
    validate,
)

DENSE = "ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF"
GPT_OSS_20B = "ggml-org/gpt-oss-20b-GGUF"
QWEN3 = "ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF"
GIB = 2**30


@pytest.fixture(scope="module")
def validated():
    return validate(moe_routing="lognormal")


def _validate_with(points, **profile_changes):
    """``validate(points)`` under the llama.cpp profile with ``profile_changes``."""
    prof = PROFILES["llama.cpp"]
    try:
        PROFILES["llama.cpp"] = dataclasses.replace(prof, **profile_changes)
        return validate(points)
    finally:
        PROFILES["llama.cpp"] = prof


def test_every_record_names_a_source_and_batched_rows_match_their_printed_row():
    data = json.loads(DATA.read_text())
    checked = 0
    for r in data["records"]:
        assert r["source"] in data["sources"], r
        if r.get("tool") != "llama-batched-bench":
            continue
        cells = [c.strip() for c in r["raw_row"].strip("|").split("|")]
        numbers = [float(c) for c in cells]
        fields = ("pp", "tg", "batch", "n_kv", "t_pp_s", "s_pp_tok_s", "t_tg_s", "s_tg_tok_s")
        assert numbers[: len(fields)] == [r[f] for f in fields], r["raw_row"]
        assert r["n_kv"] == r["batch"] * (r["pp"] + r["tg"])
        checked += 1
    assert checked >= 4 * 18 * 3  # four models, 18 rows, three page revisions at least


def test_the_four_models_of_the_llama_cpp_page_at_every_batch_and_context():
    points = load_points()
    for source in LLAMA_CPP_SOURCES:
        for model in GGUF_MODELS:
            mine = [p for p in points if p.key == (source, model)]
            batched = {(p.batch, p.pp) for p in mine if p.tool == "llama-batched-bench"}
            assert batched == {(b, pp) for b in (1, 2, 4, 8, 16, 32) for pp in (512, 4096, 8192)}
            depths = {p.depth for p in mine if p.tool == "llama-bench"}
            assert depths == {0, 4096, 8192, 16384, 32768}


@pytest.mark.parametrize("model", sorted(GGUF_MODELS))
def test_gguf_bytes_match_the_printed_file_size(model):
    """The byte model of the GGUF formats (not fitted) against llama-bench's size column."""
    printed = json.loads(DATA.read_text())["models"][model]["file_size_gib"]
    preset, fmt = GGUF_MODELS[model]
    cm = CostModel(preset, fmt, "gb10")
    cfg = cm.cfg
    total = (
        cm.dense_layer_bytes
        + sum(cm.expert_bytes_per_layer) * cfg.num_experts
        + cm.lm_head_bytes
        + (0 if cfg.tie_word_embeddings else cm.embed_row_bytes * cfg.vocab_size)
    )
    assert total / GIB == pytest.approx(printed, rel=0.015)


def test_routing_law_reproduces_the_measured_router_it_comes_from():
    """LOAD_SIGMA is recomputed from gpt-oss-20b's measured distinct-expert counts, and the law
    is within 8% of every count; Qwen3's shape is recomputed from its measured coverage."""
    assert routing.fit_load_sigma() == pytest.approx(routing.LOAD_SIGMA, abs=0.01)
    m = routing.MEASURED_DISTINCT
    for b, d in m["distinct"].items():
        got = routing.lognormal_distinct(m["experts"], m["top_k"], b, routing.LOAD_SIGMA)
        assert got == pytest.approx(d, rel=0.08), b
    assert routing.coverage_sigma() == pytest.approx(routing.LOAD_SIGMAS["qwen3-30b-a3b"], abs=0.01)
    # Limits: no skew is the uniform law; a law never exceeds E nor falls below k.
    assert routing.lognormal_distinct(128, 8, 32, 0.0) == pytest.approx(
        routing.expected_distinct_experts(128, 8, 32)
    )
    counts = [routing.lognormal_distinct(128, 8, b, 1.26) for b in (1, 2, 8, 32, 256)]
    assert counts == sorted(counts) and counts[0] == pytest.approx(8) and counts[-1] <= 128


def test_fitted_parameters_see_only_the_fit_points():
    """Doubling every published number that is not a fit point changes no fitted parameter and
    no prediction: the validation points are out of sample."""
    points = load_points()
    prof = PROFILES["llama.cpp"]
    mine = [p for p in points if p.source == LLAMA_CPP_SOURCES[0]]
    doubled = [p if is_fit_point(p, prof) else dataclasses.replace(p, published=2 * p.published)
               for p in mine]  # fmt: skip
    rows, params = validate(mine, moe_routing="lognormal")
    rows2, params2 = validate(doubled, moe_routing="lognormal")
    assert params == params2
    assert [r.predicted for r in rows] == [r.predicted for r in rows2]
    fitted = [r for r in rows if r.fitted]
    # Two per model, one shared (attention), one gpt-oss-120b routing shape point. The 120b
    # fits two efficiencies to three points (its shape is one mean over three revisions), so
    # least squares meets its points within 2.5%, the others exactly.
    assert len(fitted) == 2 * len(GGUF_MODELS) + 1 + len(prof.routing_fit)
    assert all(abs(r.error) < 0.03 for r in fitted)
    assert all(abs(r.error) < 0.001 for r in fitted if "120b" not in r.point.model)


def test_one_prompt_moe_prefill_costs_about_what_two_do():
    """The batched bench's first row is not a fit point: on every MoE one 512-token prompt takes
    at least 85% of the time two take (the dense model: under 60%). Most of it is MMQ's tile
    padding (next test); on gpt-oss-20b one prompt even takes LONGER than two in every
    revision, a cost of the process's first prompt-sized forward that no step price whose time
    grows with its tokens can hold."""
    data = json.loads(DATA.read_text())["records"]
    for source in LLAMA_CPP_SOURCES:
        for model in GGUF_MODELS:
            t = {r["batch"]: r["t_pp_s"] for r in data if r["source"] == source
                 and r["model"] == model and r.get("tool") == "llama-batched-bench"
                 and r["pp"] == 512}  # fmt: skip
            if model == DENSE:
                assert t[1] < 0.6 * t[2], source
            else:
                assert t[1] > 0.85 * t[2], (source, model)
            if model == GPT_OSS_20B:
                assert t[1] > t[2], source
    rows, _ = validate([p for p in load_points() if p.source == LLAMA_CPP_SOURCES[0]])
    first = [r for r in rows if first_timed_run(r.point)]
    assert {r.point.label for r in first} == {"batched pp B=1 pp=512"} and len(first) == 4
    for r in first:
        two = next(x for x in rows if x.point.key == r.point.key
                   and x.point.label == "batched pp B=2 pp=512")  # fmt: skip
        assert 512 / r.predicted <= 1024 / two.predicted  # the model's step grows with tokens


def test_mmq_tiles_are_llama_cpp_widths_and_padding_is_exact_at_width_one():
    assert [routing.mmq_tile(n) for n in (1, 2, 8, 9, 40, 47, 50, 128, 129, 512, 2048)] == [
        8, 8, 8, 16, 40, 48, 64, 128, 80, 128, 128,
    ]  # fmt: skip
    for sigma in (0.0, 1.26):
        assert routing.lognormal_padded_rows(128, 8, 300, sigma, 1) == pytest.approx(2400, 1e-6)
        padded = routing.lognormal_padded_rows(128, 8, 512, sigma, 128)
        # ~32 rows an expert, one tile each (a popular expert's rows may take two)
        assert 4096 * 3.5 < padded < 1.05 * 128 * 128
    big = routing.lognormal_padded_rows(32, 4, 100_000, 0.0, 128)
    assert 400_000 <= big < 400_000 * 1.02  # thousands of rows an expert: little padding


def test_mmq_tile_padding_explains_one_prompt_moe_prefills():
    """A 512-token prompt gives gpt-oss-120b's 128 experts 16 rows each and Qwen3's 32, each
    computed as a 128-column tile. Without the padding their one-prompt prefills are predicted
    60% or more too fast in every revision; with it within 35%, nothing refitted on them."""
    moes = ("ggml-org/gpt-oss-120b-GGUF", QWEN3)
    pts = [p for p in load_points() if p.model in moes]
    padded, _ = validate(pts)
    exact, _ = _validate_with(pts, expert_tiles=None)

    def first_errors(rows):
        return [r.error for r in rows if first_timed_run(r.point)]

    assert len(first_errors(padded)) == 2 * len(LLAMA_CPP_SOURCES)
    assert all(e > 0.6 for e in first_errors(exact))
    # 35%: under the random-token routing shape (2.24, fitted on gpt-oss-120b) Qwen3's v1 first
    # timed prefill is predicted 32% too fast (its text shape, 1.26, gave under 30%); these
    # points carry a one-time cost no per-step price holds (first_timed_run).
    assert all(abs(e) < 0.35 for e in first_errors(padded))


def test_eager_steps_pay_the_measured_per_layer_host_cost():
    """llama.cpp's own A/B on a DGX Spark (PR #19645): graphs off costs 3.5 ms per step at 2
    and at 3 token rows of a 47-layer MoE, 75 us per layer. The profile charges it to every
    step of more than one row and to none of one row."""
    per_layer = eager_layer_overhead()
    assert 70e-6 < per_layer < 80e-6
    prof = PROFILES["llama.cpp"]
    params = dataclasses.replace(_base_params(prof), bandwidth_efficiency=0.9)
    cm = cost_model(GPT_OSS_20B, params, prof)
    graphed = cost_model(GPT_OSS_20B, params, prof, graph_max_tokens=None)
    layers = cm.cfg.num_layers
    one, two = StepShape.decode(1, 512), StepShape.decode(2, 512)
    assert cm.step_time(one) == pytest.approx(graphed.step_time(one))
    assert cm.step_time(two) - graphed.step_time(two) == pytest.approx(layers * per_layer)


def test_without_the_eager_host_cost_two_row_moe_decodes_miss_by_more_than_30_percent():
    """The mechanism behind the B=2 decode rows: priced as if graphs replayed them, 6 or more
    gpt-oss B=2 decode rows miss by more than 30% (+37% to +47% under the random-token routing
    shape) in the builds before llama.cpp#19645; with the measured eager cost, at most two do
    (+30%, +32%: gpt-oss-20b, whose own points imply a less skewed shape than the one fitted on
    gpt-oss-120b; at most one did under its text shape)."""
    pts = [p for p in load_points() if p.source != LLAMA_CPP_SOURCES[2]
           and p.model.startswith("ggml-org/gpt-oss") and p.batch == 2
           and p.metric == "decode_tok_s"]  # fmt: skip
    assert len(pts) == 2 * 2 * 3
    models = {p.model for p in pts}
    every = [p for p in load_points() if p.model in models and p.source != LLAMA_CPP_SOURCES[2]]

    def misses(rows):
        return sum(abs(r.error) > 0.30 for r in rows if r.point in pts)

    with_eager, _ = validate(every)
    without, _ = _validate_with(every, graph_max_tokens=None)
    assert misses(without) >= 6
    assert misses(with_eager) <= 2


def test_out_of_sample_errors_are_bounded(validated):
    """Every point not fitted (522): median error 3.6% today (3.3% when each MoE took its text
    routing shape; every bench here feeds random ids, so every MoE now takes the one
    random-token shape fitted on gpt-oss-120b), 7 beyond 30%: four first timed runs (+37% to
    +70%, test above) and three gpt-oss-20b decodes (+31% to +34%: its own points imply a less
    skewed shape). The bounds guard today's accuracy with a little room."""
    rows, _ = validated
    s = summary(rows)
    assert s["points"] >= 500
    assert s["median"] < 0.04
    assert s["beyond_30"] <= 7
    rest = summary(rows, first_run=False)
    assert rest["points"] == s["points"] - 4 * len(LLAMA_CPP_SOURCES)
    assert rest["beyond_30"] <= 3 and rest["worst"] < 0.35
    decode = summary([r for r in rows if r.point.metric == "decode_tok_s"])
    assert decode["median"] < 0.05 and decode["beyond_30"] <= 3
    dense = summary([r for r in rows if r.point.model == DENSE])
    assert dense["median"] < 0.04 and dense["beyond_30"] == 0


def test_moe_decode_growth_with_batch(validated):
    """Decode rate at B=32 over B=1 (pp=512): the dense 7B's ~20x within 10%; Qwen3's ~6x
    within 10% under the random-token shape fitted on gpt-oss-120b (it was 23-25% too slow
    under its text shape); gpt-oss-20b's ~7.5x within 25% (+10% to +22%: over-predicted, its
    own points imply a shape of 1.4-1.8 where 2.24 is used)."""
    rows, _ = validated
    bounds = {DENSE: 0.10, GPT_OSS_20B: 0.25, QWEN3: 0.10}
    g = growth(rows)
    for (source, model), (published, predicted) in g.items():
        if model in bounds:
            assert abs(predicted / published - 1) < bounds[model], (source, model)
    assert len([k for k in g if k[1] in bounds]) == 3 * len(bounds)


def test_routing_law_and_combine_mode_are_what_fits_the_shape_of_the_curves():
    """Structure, not parameters: with the uniform law Qwen3's growth error is 1.5x larger; with
    overlapped (max) GEMMs everywhere the dense model's growth misses by more than 20% (+23%;
    -7% with the profile's additive dense GEMMs)."""
    lognormal, _ = validate(moe_routing="lognormal")
    uniform, _ = validate(moe_routing="uniform")

    def qwen_error(rows):
        return max(abs(b / a - 1) for k, (a, b) in growth(rows).items() if k[1] == QWEN3)

    assert qwen_error(uniform) > 1.5 * qwen_error(lognormal)
    rows, _ = _validate_with([p for p in load_points() if p.model == DENSE], combine="max")
    assert all(abs(b / a - 1) > 0.20 for a, b in growth(rows).values())


def test_point_labels_are_unique_per_source_and_model():
    points = load_points()
    seen = set()
    for p in points:
        key = (p.source, p.model, p.label)
        assert key not in seen, key
        seen.add(key)
    assert isinstance(points[0], Point) and re.match(r"(batched|bench) ", points[0].label)


def test_decode_step_reads_fewer_experts_under_the_measured_law():
    cm = CostModel("qwen3-coder-30b-a3b", "q8_0", "gb10", moe_routing="lognormal")
    uni = CostModel("qwen3-coder-30b-a3b", "q8_0", "gb10", moe_routing="uniform")
    shape = StepShape.decode(32, 512)
    assert (
        cm.breakdown(shape)["distinct_experts_per_layer"]
        < 0.8 * uni.breakdown(shape)["distinct_experts_per_layer"]
    )


def test_stored_band_errors_are_the_validation_errors(validated):
    """data/validation_errors.json is what the validation gives today (regenerate it with
    ``python -m research.perf.validation --write-errors`` after a model change)."""
    from research.perf.bands import validation_errors
    from research.perf.validation import error_quantiles

    rows, _ = validated
    fresh = error_quantiles(rows)
    stored = validation_errors()
    for kind in ("moe", "dense"):
        for phase in ("decode", "prefill"):
            assert stored[kind][phase] == pytest.approx(fresh[kind][phase], abs=1e-9)
    assert fresh["moe"]["decode"][0] < 0 < fresh["moe"]["decode"][1]


def test_bands_widen_by_the_validation_errors():
    """A rate predicted at 100 whose MoE decode errors ran from r05 to r95 spans
    100 / (1 + r95) .. 100 / (1 + r05); a time 10 spans 10 (1 + r05) .. 10 (1 + r95); without a
    model kind the corners are left as they are."""
    from research.perf.bands import band_keys, validation_errors

    r05, r95 = validation_errors()["moe"]["decode"]
    point = {"output_throughput": 100.0, "median_tpot_ms": 10.0}
    keys = band_keys(point, {"optimistic": point, "pessimistic": point}, moe=True)
    assert keys["band_output_throughput_lo"] == pytest.approx(100 / (1 + r95))
    assert keys["band_output_throughput_hi"] == pytest.approx(100 / (1 + r05))
    assert keys["band_median_tpot_ms_lo"] == pytest.approx(10 * (1 + r05))
    assert keys["band_median_tpot_ms_hi"] == pytest.approx(10 * (1 + r95))
    plain = band_keys(point, {"optimistic": point})
    assert plain["band_output_throughput_lo"] == plain["band_output_throughput_hi"] == 100.0
