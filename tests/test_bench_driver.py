"""The benchmark driver on a tiny random model (closed loop, open loop on a fake clock, refused
requests), results files (ours and a vLLM --save-result file) and the plots."""

from __future__ import annotations

import json
import math

import pytest

from research.bench import (
    BenchRequest,
    append_result,
    arrival_times,
    format_table,
    random_requests,
    read_results,
    result_point,
    run_benchmark,
)
from research.bench.plots import plot_all, plot_comparison

# Inputs 8..16 tokens, outputs 4..8 tokens.
REQUESTS = random_requests(
    12, input_len=12, output_len=6, range_ratio=0.3, vocab_size=256, seed=0, special_ids=(0, 1, 2)
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class CountingEngine:
    """Wraps an engine; before every step, notes how many requests are in flight."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight = 0
        self.finished = 0
        self.in_flight_at_add = []
        self.before_step = []  # (in flight, finished so far) before each step

    def add_request(self, *args, **kwargs):
        request_id = self.engine.add_request(*args, **kwargs)
        self.in_flight += 1
        self.in_flight_at_add.append(self.in_flight)
        return request_id

    def step(self):
        self.before_step.append((self.in_flight, self.finished))
        outputs = self.engine.step()
        done = sum(out.finished for out in outputs)
        self.in_flight -= done
        self.finished += done
        return outputs

    def stats(self):
        return self.engine.stats()


class FakeClock:
    """Virtual time: every reading advances 1 ms; sleeping advances by the amount slept."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def __call__(self):
        self.now += 1e-3
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture(scope="module")
def llm():
    from research.llm import LLM

    return LLM("tiny-llama", max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def closed_loop(llm):
    engine = CountingEngine(llm.engine)
    return engine, run_benchmark(engine, REQUESTS, max_concurrency=2)


def test_requests_fit_the_tiny_model():
    assert all(8 <= r.prompt_len <= 16 and 4 <= r.output_len <= 8 for r in REQUESTS)


def test_closed_loop_keeps_the_cap_and_refills_at_once(closed_loop):
    engine, result = closed_loop
    assert max(engine.in_flight_at_add) == 2
    # Before every step the driver has filled every free slot with a waiting request.
    for in_flight, finished in engine.before_step:
        assert in_flight == min(2, len(REQUESTS) - finished)
    # The records agree: no request was sent while two others were still running.
    for r in result.records:
        running = [o for o in result.records if o.send_time < r.send_time < o.finish_time]
        assert len(running) < 2


def test_every_request_gets_exactly_its_tokens(closed_loop):
    _, result = closed_loop
    assert len(result.records) == len(REQUESTS)
    for request, record in zip(REQUESTS, result.records, strict=True):
        assert record.success and record.error == ""
        assert record.prompt_len == request.prompt_len
        assert record.output_len == request.output_len == len(record.token_times)
        assert record.send_time < record.first_token_time == record.token_times[0]
        assert record.token_times == sorted(record.token_times)
        assert record.token_times[-1] <= record.finish_time
    first_send = min(r.send_time for r in result.records)
    last_finish = max(r.finish_time for r in result.records)
    assert result.duration == pytest.approx(last_finish - first_send)
    m = result.metrics()
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == sum(r.output_len for r in REQUESTS)
    assert m["total_input_tokens"] == sum(r.prompt_len for r in REQUESTS)
    assert 0 < m["median_ttft_ms"] < m["median_e2el_ms"]


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_open_loop_respects_arrival_offsets(llm, max_concurrency):
    clock = FakeClock()
    engine = CountingEngine(llm.engine)
    rate = 20.0
    result = run_benchmark(
        engine,
        REQUESTS,
        request_rate=rate,
        burstiness=1.0,
        seed=5,
        max_concurrency=max_concurrency,
        clock=clock,
        sleep=clock.sleep,
    )
    offsets = arrival_times(len(REQUESTS), rate, 1.0, seed=5)
    sends = [r.send_time - result.start_time for r in result.records]
    assert sends == sorted(sends)
    for sent, offset in zip(sends, offsets, strict=True):
        # Never early; late only by the few clock readings of one driver iteration.
        assert offset <= sent <= offset + 0.005
    # The tiny model finishes a request in far fewer ticks than the mean 50 ms gap: it idles.
    assert clock.sleeps
    assert max(engine.in_flight_at_add) <= (max_concurrency or len(REQUESTS))
    assert all(r.success for r in result.records)


def test_refused_request_is_recorded_as_failed(llm):
    requests = [REQUESTS[0], BenchRequest(list(range(3, 253)), 10), REQUESTS[1]]
    result = run_benchmark(llm.engine, requests, max_concurrency=1)
    assert [r.success for r in result.records] == [True, False, True]
    assert "max_model_len" in result.records[1].error
    m = result.metrics()
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == REQUESTS[0].prompt_len + REQUESTS[1].prompt_len


# ---------------------------------------------------------------- results files

REQUIRED_KEYS = {
    "date",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "per_user_tok_s",
    "model",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}


def test_results_jsonl_round_trip(closed_loop, tmp_path):
    _, result = closed_loop
    extra = {
        "quantization": None,
        "hardware": "cpu",
        "executor": "real",
        "scheduling_policy": "continuous",
        "block_size": 16,
    }
    path = tmp_path / "run" / "results.jsonl"
    point = result_point(result, model_id="tiny-llama", extra=extra, goodput_slos={"ttft": 1e6})
    append_result(path, point)
    append_result(path, point)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    # Strict JSON: an infinite rate is the string "inf", as vLLM writes it.
    raw = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert raw["request_rate"] == "inf"
    points = read_results(path)
    assert len(points) == 2
    assert REQUIRED_KEYS | set(extra) <= set(points[0])
    assert points[0]["request_rate"] == math.inf
    assert points[0]["max_concurrency"] == 2 and points[0]["num_prompts"] == 12
    assert points[0]["request_goodput"] == pytest.approx(point["request_throughput"])
    assert points[0]["per_user_tok_s"] == pytest.approx(1000 / points[0]["median_tpot_ms"])
    assert points[0]["hardware"] == "cpu" and points[0]["model"] == "tiny-llama"


VLLM_RESULT = {
    "date": "20250301-120000",
    "endpoint_type": "openai",
    "label": None,
    "model_id": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    "tokenizer_id": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
    "num_prompts": 3,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 1,
    "duration": 20.5,
    "completed": 3,
    "total_input_tokens": 1536,
    "total_output_tokens": 768,
    "request_throughput": 0.146,
    "request_goodput": None,
    "output_throughput": 37.46,
    "total_token_throughput": 112.39,
    "max_output_tokens_per_s": 82.0,
    "max_concurrent_requests": 1,
    "mean_ttft_ms": 41.2,
    "median_ttft_ms": 37.0,
    "std_ttft_ms": 5.1,
    "p99_ttft_ms": 52.3,
    "mean_tpot_ms": 12.4,
    "median_tpot_ms": 12.5,
    "std_tpot_ms": 0.2,
    "p99_tpot_ms": 12.9,
    "mean_itl_ms": 12.4,
    "median_itl_ms": 12.3,
    "std_itl_ms": 0.9,
    "p99_itl_ms": 15.0,
    "input_lens": [512, 512, 512],
    "output_lens": [256, 256, 256],
    "ttfts": [0.037, 0.034, 0.0526],
    "itls": [[0.0123] * 255] * 3,
    "generated_texts": ["def f():", "import os", "class A:"],
    "errors": ["", "", ""],
}


def test_read_results_reads_a_vllm_save_result_file(tmp_path):
    path = tmp_path / "openai-infqps-concurrency1-Qwen3-Coder.json"
    path.write_text(json.dumps(VLLM_RESULT))
    (point,) = read_results(path)
    assert point["model"] == VLLM_RESULT["model_id"]
    assert point["per_user_tok_s"] == pytest.approx(1000 / 12.5)
    assert point["request_rate"] == math.inf and point["max_concurrency"] == 1
    assert point["output_throughput"] == 37.46
    assert not {"ttfts", "itls", "input_lens", "output_lens", "generated_texts", "errors"} & set(
        point
    )
    table = format_table([point], columns=("model", "max_concurrency", "per_user_tok_s"))
    assert table.splitlines() == [
        "| model | max_concurrency | per_user_tok_s |",
        "|---|---|---|",
        "| Qwen/Qwen3-Coder-30B-A3B-Instruct | 1 | 80.00 |",
    ]


# ---------------------------------------------------------------- plots


def _sweep(model, scale):
    return [
        {
            "model": model,
            "max_concurrency": c,
            "num_prompts": 3 * c,
            "request_rate": math.inf,
            "output_throughput": scale * 80 * c / (1 + c / 16),
            "per_user_tok_s": scale * 80 / (1 + c / 16),
            "median_ttft_ms": 37 * (1 + c / 8),
            "p99_ttft_ms": 60 * (1 + c / 8),
            "median_tpot_ms": 12.5 * (1 + c / 16),
        }
        for c in (1, 8, 32, 64)
    ]


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plots_write_png_files(tmp_path):
    points = _sweep("moe", 1.0) + _sweep("dense", 0.1)
    paths = plot_all(points, tmp_path / "figs")
    assert [p.name for p in paths] == ["concurrency_curves.png", "ttft.png"]
    for path in paths:
        _assert_png(path)
    series = {"block 8": _sweep("m", 0.9), "block 16": _sweep("m", 1.0)}
    _assert_png(plot_comparison(series, "median_tpot_ms", tmp_path / "cmp.png"))
    for path in plot_all(series, tmp_path / "series"):
        _assert_png(path)


def test_figures_are_paper_ready(tmp_path):
    """Log axes where ranges span decades (TTFT always, in seconds), PDF and SVG beside a
    300-dpi PNG, legends without what every line shares, a caption with the workload, machine
    and executor, simulated curves dashed and named, labelled floors, the published point."""
    from matplotlib.image import imread

    from research.bench.plots import comparison_figure, concurrency_figure, ttft_figure

    def sim(model, label, scale):
        return [
            p
            | {
                "label": label,
                "executor": "simulated",
                "hardware": "gb10",
                "quantization": "awq",
                "input_len": 512,
                "output_len": 256,
            }
            for p in _sweep(model, scale)
        ]

    points = sim("qwen3-coder-30b-a3b", "simulated-gb10 qwen3-coder-30b-a3b", 1.0)
    points += sim("llama-3.3-70b", "simulated-gb10 llama-3.3-70b", 0.02)
    fig = concurrency_figure(points)
    ax_total, ax_user = fig.axes
    assert ax_total.get_yscale() == "log"  # 70B and MoE lines are 50x apart
    legend = [t.get_text() for t in ax_user.get_legend().get_texts()]
    # Named by what differs, key=value; what the lines share is the caption.
    assert "model=qwen3-coder-30b-a3b (simulated)" in legend
    assert "comfortable floor 15" in legend and "minimum floor 10" in legend
    assert ax_user.get_ylabel() == "per-user tok/s (1000 / median TPOT)"
    assert all(line.get_linestyle() == "--" for line in ax_total.get_lines())
    annotations = [t.get_text() for t in ax_user.texts]
    assert "published qwen-128" in annotations and "published llama-128" in annotations
    (caption,) = [t.get_text() for t in fig.texts]
    caption = caption.replace("\n", " ")
    assert caption.startswith(
        "shared: hardware=gb10, quantization=awq, executor=simulated, input_len=512, "
        "output_len=256, request_rate=inf;"
    )
    assert "model=" not in caption and "dashed: simulated" in caption

    ttft = ttft_figure(points).axes[0]
    assert ttft.get_yscale() == "log" and ttft.get_ylabel() == "TTFT (s)"
    ys = ttft.get_lines()[0].get_ydata()
    assert ys[0] == pytest.approx(37 * (1 + 1 / 8) / 1e3)  # seconds

    close = {"block 8": _sweep("m", 0.9), "block 16": _sweep("m", 1.0)}
    assert comparison_figure(close, "output_throughput").axes[0].get_yscale() == "log"
    assert comparison_figure(close, "per_user_tok_s").axes[0].get_yscale() == "linear"

    path = plot_all(points, tmp_path)[0]
    assert path.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
    assert b"<svg" in path.with_suffix(".svg").read_bytes()[:500]
    assert imread(path).shape[1] == 7 * 300  # 7 in at 300 dpi
