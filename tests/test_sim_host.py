"""research.perf.host_model: the cost model of our real engine prices the calls the executor
really makes, and its fit recovers a machine from single-stream numbers alone."""

from __future__ import annotations

import pytest

from research.engine.executor import bucket, context_bucket
from research.perf.cost_model import CostParams, StepShape
from research.perf.host_model import (
    HostCostModel,
    SingleStream,
    _bucket,
    _context_bucket,
    fit_host,
    host_hardware,
)

SIZES = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512)


def _model(bw=12e9, flops=40e9, host=2e-3, attention=0.3, read=0.25) -> HostCostModel:
    params = CostParams(1.0, host, attention_efficiency=attention, attention_read_efficiency=read)
    return HostCostModel("smollm2-135m", None, host_hardware(bw, flops), params=params, **SIZES)


def test_buckets_match_the_executor():
    for n in range(1, 300):
        assert _bucket(n, 1, 64) == bucket(n, 1, 64)
        assert _bucket(n, 16, 2048) == bucket(n, 16, 2048)
        assert _context_bucket(n, 8, 32) == context_bucket(n, 8, 32)


def test_decodes_and_prefills_are_two_padded_calls():
    cm = _model()
    decode, prefill = cm.work(StepShape(((1, 130),) * 3 + ((100, 0),)))
    assert (decode.tokens, decode.logits_rows) == (4, 4)  # 3 rows padded to 4
    # ceil(131/16) = 9 blocks -> 16, twice the 8-block (128-token) minimum bucket
    assert decode.kv_read_tokens == 4 * 256
    assert (prefill.tokens, prefill.logits_rows) == (128, 1)  # 100 tokens padded to 128
    assert prefill.attention_pairs == 1 * 128 * 128  # padded queries x bucketed keys
    two = cm.breakdown(StepShape(((1, 130),) * 3 + ((100, 0),)))
    one = cm.breakdown(StepShape(((1, 130),) * 3))
    assert two["overhead_s"] == pytest.approx(2 * one["overhead_s"])  # one dispatch per call


def test_fit_recovers_a_machine_from_single_stream_numbers():
    """Numbers priced by a known model: the fit finds it again and predicts batch 16."""
    truth = _model()
    prompts = (128, 480)
    measured = SingleStream(
        output_len=32,
        tpot_s={n: truth.step_time(StepShape.decode(1, n + 15)) for n in prompts},
        ttft_s={n: truth.ttft(n) for n in prompts},
        host_s_per_step=2e-3,
    )
    fit = fit_host("smollm2-135m", measured, **SIZES)
    assert fit.hw.achievable_bandwidth == pytest.approx(12e9, rel=0.02)
    assert fit.hw.tensor_flops["fp32"] == pytest.approx(40e9, rel=0.02)
    # The decode-time difference between the two prompt lengths is attention's reads alone.
    assert fit.params.attention_read_efficiency == pytest.approx(0.25, rel=0.05)
    batch = StepShape.decode(16, 200)
    assert fit.step_time(batch) == pytest.approx(truth.step_time(batch), rel=0.02)


def test_attention_reads_its_own_bandwidth():
    """A gathered-context attention (read efficiency < 1) makes decode steps grow with rows x
    keys; the weights' read time does not change."""
    fast, slow = _model(attention=1.0, read=1.0), _model(attention=1.0, read=0.2)
    for shape in (StepShape.decode(1, 200), StepShape.decode(64, 200)):
        f, s = fast.breakdown(shape), slow.breakdown(shape)
        assert s["dense_gemm_s"] == f["dense_gemm_s"]
        assert s["attention_s"] == pytest.approx(5 * f["attention_s"], rel=1e-6)
    big = slow.breakdown(StepShape.decode(64, 200))
    assert big["attention_s"] > 10 * slow.breakdown(StepShape.decode(1, 200))["attention_s"]
