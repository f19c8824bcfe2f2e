"""Serving metrics on hand-made timings with hand-computed values, and the benchmark workloads."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from research.bench import (
    RandomDataset,
    RequestRecord,
    arrival_times,
    compute_metrics,
    random_requests,
)
from research.bench.workload import length_bounds


def _record(prompt_len, send, token_times, success=True):
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=len(token_times),
        send_time=send,
        first_token_time=token_times[0] if token_times else None,
        token_times=list(token_times),
        finish_time=token_times[-1] if token_times else send,
        success=success,
        error="" if success else "refused",
    )


# A: TTFT 100 ms, E2EL 300 ms, 4 tokens -> TPOT (300 - 100) / 3 = 66.67 ms, ITLs 50, 100, 50 ms.
# B: TTFT 200 ms, E2EL 300 ms, 2 tokens -> TPOT 100 ms, ITL 100 ms.
# C: TTFT 50 ms, E2EL 50 ms, 1 token -> no TPOT, no ITL.
# D: failed; its 40 prompt tokens count nowhere.
RECORDS = [
    _record(10, 0.0, [0.1, 0.15, 0.25, 0.30]),
    _record(20, 1.0, [1.2, 1.3]),
    _record(30, 2.0, [2.05]),
    _record(40, 3.0, [], success=False),
]
DURATION = 4.0


def test_counts_and_throughputs():
    m = compute_metrics(RECORDS, DURATION)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["duration"] == DURATION
    assert m["total_input_tokens"] == 60
    assert m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(7 / 4)
    # Total throughput adds the prompt tokens: (60 + 7) / 4.
    assert m["total_token_throughput"] == pytest.approx(67 / 4)
    assert m["request_goodput"] is None


def test_latency_statistics():
    m = compute_metrics(RECORDS, DURATION, percentiles=(50, 90, 99))
    # TTFT [100, 200, 50] ms; linear percentiles over sorted [50, 100, 200].
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((50**2 / 9 + 250**2 / 9 + 200**2 / 9) / 3))
    assert m["p50_ttft_ms"] == pytest.approx(100)
    assert m["p90_ttft_ms"] == pytest.approx(180)  # index 1.8: 100 + 0.8 * 100
    assert m["p99_ttft_ms"] == pytest.approx(198)  # index 1.98
    # TPOT only from A and B (C has one token).
    assert m["mean_tpot_ms"] == pytest.approx((200 / 3 + 100) / 2)
    assert m["median_tpot_ms"] == pytest.approx((200 / 3 + 100) / 2)
    assert m["per_user_tok_s"] == pytest.approx(1000 / ((200 / 3 + 100) / 2))
    # ITLs pooled over requests: [50, 100, 50, 100].
    assert m["mean_itl_ms"] == pytest.approx(75)
    assert m["median_itl_ms"] == pytest.approx(75)
    assert m["p99_itl_ms"] == pytest.approx(100)
    # E2EL [300, 300, 50].
    assert m["mean_e2el_ms"] == pytest.approx(650 / 3)
    assert m["median_e2el_ms"] == pytest.approx(300)


def test_percentiles_interpolate_linearly_like_numpy():
    gaps_ms = np.arange(10, 101, 10)  # 10, 20, ..., 100
    times = np.concatenate([[0.0], np.cumsum(gaps_ms) / 1000.0]) + 1.0
    m = compute_metrics([_record(5, 0.5, times.tolist())], 2.0, percentiles=(50, 90, 99, 99.9))
    assert m["median_itl_ms"] == pytest.approx(55)
    assert m["p90_itl_ms"] == pytest.approx(91)  # index 8.1: 90 + 0.1 * 10
    assert m["p99_itl_ms"] == pytest.approx(99.1)  # index 8.91
    assert m["p99.9_itl_ms"] == pytest.approx(np.percentile(gaps_ms, 99.9))
    assert m["std_itl_ms"] == pytest.approx(np.std(gaps_ms))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 150}, 2),  # B's 200 ms fails
        ({"ttft": 100}, 2),  # a bound is inclusive: A's 100 ms passes
        ({"tpot": 80}, 2),  # B's 100 ms fails; C's one token counts as TPOT 0
        ({"e2el": 250}, 1),  # A and B (300 ms) fail
        ({"ttft": 150, "tpot": 80, "e2el": 350}, 2),
        ({"ttft": 150, "e2el": 250}, 1),  # B fails one bound, A the other: only C meets both
        ({"ttft": 10}, 0),
    ],
)
def test_goodput_counts_requests_within_every_slo(slos, good):
    m = compute_metrics(RECORDS, DURATION, goodput_slos=slos)
    assert m["request_goodput"] == pytest.approx(good / DURATION)


def test_bad_slos_and_duration_are_refused():
    with pytest.raises(ValueError, match="unknown goodput SLO"):
        compute_metrics(RECORDS, DURATION, goodput_slos={"itl": 10})
    with pytest.raises(ValueError, match="must be > 0"):
        compute_metrics(RECORDS, DURATION, goodput_slos={"ttft": 0})
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(RECORDS, 0.0)


def test_only_failed_or_one_token_requests():
    failed = compute_metrics([RECORDS[3]], 1.0)
    assert failed["completed"] == 0 and failed["failed"] == 1
    assert failed["total_input_tokens"] == 0 and failed["median_ttft_ms"] == 0
    one_token = compute_metrics([RECORDS[2]], 1.0)
    assert one_token["median_tpot_ms"] == 0 and one_token["per_user_tok_s"] is None
    assert one_token["median_ttft_ms"] == pytest.approx(50)


# ---------------------------------------------------------------- workloads


def test_length_bounds():
    assert length_bounds(10, 0.25) == (7, 13)  # floor(7.5), ceil(12.5)
    assert length_bounds(512, 0.0) == (512, 512)
    assert length_bounds(2, 0.9) == (1, 4)  # never below 1
    with pytest.raises(ValueError):
        length_bounds(10, 1.0)


def test_random_lengths_cover_the_range_and_no_more():
    requests = random_requests(
        600, input_len=100, output_len=50, range_ratio=0.3, vocab_size=1000, seed=3
    )
    input_lens = {r.prompt_len for r in requests}
    output_lens = {r.output_len for r in requests}
    assert min(input_lens) == 70 and max(input_lens) == 130
    assert min(output_lens) == 35 and max(output_lens) == 65
    assert all(0 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    fixed = random_requests(5, input_len=512, output_len=256, vocab_size=1000)
    assert all(r.prompt_len == 512 and r.output_len == 256 for r in fixed)


def test_random_requests_avoid_special_ids():
    requests = random_requests(50, 20, 4, vocab_size=8, seed=0, special_ids=(0, 1, 2))
    tokens = {t for r in requests for t in r.prompt_token_ids}
    assert tokens == {3, 4, 5, 6, 7}


def test_random_requests_are_deterministic_per_seed():
    dataset = RandomDataset(input_len=32, output_len=8, range_ratio=0.5, vocab_size=500)
    assert dataset.sample(20, seed=7) == dataset.sample(20, seed=7)
    assert dataset.sample(20, seed=7) != dataset.sample(20, seed=8)
    assert dataset.sample(20, seed=7) == random_requests(20, 32, 8, 0.5, 500, seed=7)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_variance_gamma_predicts(burstiness):
    rate, n = 4.0, 40_000
    offsets = arrival_times(n, rate, burstiness, seed=1)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(k, theta = 1 / (rate k)): variance k theta^2 = 1 / (k rate^2), so CV^2 = 1 / k.
    assert gaps.var() == pytest.approx(1 / (burstiness * rate**2), rel=0.08)
    assert np.array_equal(offsets, arrival_times(n, rate, burstiness, seed=1))


def test_bad_arrival_parameters():
    with pytest.raises(ValueError):
        arrival_times(3, request_rate=0.0)
    with pytest.raises(ValueError):
        arrival_times(3, request_rate=1.0, burstiness=0.0)


def test_bench_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import research.bench, research.bench.plots\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
