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
from research.perf.validation import (
    DATA,
    GGUF_MODELS,
    LLAMA_CPP_SOURCES,
    PROFILES,
    Point,
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
    # Two per model, one shared (attention), one gpt-oss-120b routing shape point.
    assert len(fitted) == 2 * len(GGUF_MODELS) + 1 + len(prof.routing_fit)
    assert all(abs(r.error) < 0.02 for r in fitted)


def test_one_512_token_prompt_prefills_at_half_rate_on_moe_models_only():
    """Why the prefill rate is fitted on llama-bench pp2048 and not on the batched bench's first
    row: one 512-token prompt prefills at under 60% of the rate of two (too few routed rows per
    expert for the GEMM tiles) on every MoE, while the dense model's rate is the same."""
    data = json.loads(DATA.read_text())["records"]
    for source in LLAMA_CPP_SOURCES:
        for model in GGUF_MODELS:
            rate = {r["batch"]: r["s_pp_tok_s"] for r in data if r["source"] == source
                    and r["model"] == model and r.get("tool") == "llama-batched-bench"
                    and r["pp"] == 512}  # fmt: skip
            if model == DENSE:
                assert rate[1] > 0.95 * rate[2], source
            else:
                assert rate[1] < 0.6 * rate[2], (source, model)


def test_out_of_sample_errors_are_bounded(validated):
    """Every point not fitted (522): median error 4.0% today. The bounds guard today's accuracy
    with a little room; the goal (10% median, none beyond 30%) is met on the median only: the
    17 points beyond 30% are one-prompt MoE prefills, B=2 MoE decodes and Qwen3 decodes at
    B >= 16 (docs/experiments/gb10_validation.md)."""
    rows, _ = validated
    s = summary(rows)
    assert s["points"] >= 500
    assert s["median"] < 0.06
    assert s["beyond_30"] <= 20
    decode = summary([r for r in rows if r.point.metric == "decode_tok_s"])
    assert decode["median"] < 0.08
    dense = summary([r for r in rows if r.point.model == DENSE])
    assert dense["median"] < 0.06 and dense["beyond_30"] == 0


def test_moe_decode_growth_with_batch(validated):
    """Decode rate at B=32 over B=1 (pp=512): the dense 7B's ~20x within 10%; gpt-oss-20b's
    ~7.5x within 20% (its own router's law); Qwen3's ~6x within 30% (goal: 15%)."""
    rows, _ = validated
    bounds = {DENSE: 0.10, GPT_OSS_20B: 0.20, QWEN3: 0.30}
    g = growth(rows)
    for (source, model), (published, predicted) in g.items():
        if model in bounds:
            assert abs(predicted / published - 1) < bounds[model], (source, model)
    assert len([k for k in g if k[1] in bounds]) == 3 * len(bounds)


def test_routing_law_and_combine_mode_are_what_fits_the_shape_of_the_curves():
    """Structure, not parameters: with the uniform law Qwen3's growth error is 1.5x larger; with
    overlapped (max) GEMMs everywhere the dense model's growth misses by more than 25% (+29%;
    +-3% with the profile's additive dense GEMMs)."""
    lognormal, _ = validate(moe_routing="lognormal")
    uniform, _ = validate(moe_routing="uniform")

    def qwen_error(rows):
        return max(abs(b / a - 1) for k, (a, b) in growth(rows).items() if k[1] == QWEN3)

    assert qwen_error(uniform) > 1.5 * qwen_error(lognormal)
    prof = PROFILES["llama.cpp"]
    overlapped = dataclasses.replace(prof, combine="max")
    try:
        PROFILES["llama.cpp"] = overlapped
        rows, _ = validate([p for p in load_points() if p.model == DENSE])
    finally:
        PROFILES["llama.cpp"] = prof
    assert all(abs(b / a - 1) > 0.25 for a, b in growth(rows).values())


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
