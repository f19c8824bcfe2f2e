"""research.perf.host_model: the cost model of our real engine prices the calls the executor
really makes, and its fit recovers a machine from single-stream numbers alone."""

from __future__ import annotations

import pytest

from research.engine.attention import num_tiles, tile_size
from research.engine.compile_manager import token_bucket
from research.engine.executor import bucket, context_bucket
from research.perf.cost_model import CostParams, StepShape
from research.perf.host_model import (
    HostCostModel,
    SingleStream,
    _bucket,
    _context_bucket,
    _num_tiles,
    _tile_size,
    fit_host,
    host_hardware,
)

SIZES = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512)


def _model(
    bw=12e9, flops=40e9, host=2e-3, attention=0.3, read=0.25, combine="max"
) -> HostCostModel:
    params = CostParams(1.0, host, attention_efficiency=attention, attention_read_efficiency=read)
    hw = host_hardware(bw, flops)
    return HostCostModel("smollm2-135m", None, hw, params=params, combine=combine, **SIZES)


def test_buckets_match_the_executor():
    for n in range(1, 300):
        assert _bucket(n, 1, 64) == bucket(n, 1, 64)
        assert _bucket(n, 16, 2048) == bucket(n, 16, 2048)
        assert _context_bucket(n, 8, 32) == context_bucket(n, 8, 32)
    cm = _model()
    for n in range(1, 300):  # the step's tokens, as the host model pads them
        assert cm.work(StepShape(((n, 0),)))[0].tokens == token_bucket(n, 2048)
    for n in (1, 4, 16, 64, 256, 2048):
        for r in (1, 4, 16, 64):
            assert _tile_size(n, r) == tile_size(n, r)
            assert _num_tiles(n, r, 4) == num_tiles(n, r, 4)


def test_a_mixed_step_is_one_padded_call():
    cm = _model()
    mixed = StepShape(((1, 130),) * 3 + ((100, 0),))
    (call,) = cm.work(mixed)
    assert (call.tokens, call.logits_rows) == (128, 4)  # 103 tokens -> 128, 4 rows
    assert cm.work(StepShape(((1, 130),) * 3 + ((64, 0),)))[0].tokens == 96  # 67 -> 96
    b = tile_size(128, 4)
    tiles = num_tiles(128, 4, b)
    # ceil(131/16) = 9 blocks -> 16, twice the 8-block (128-token) minimum bucket
    assert call.kv_read_tokens == tiles * 256
    assert call.attention_pairs == tiles * b * (256 + 128)  # tiles x queries x (context + new)
    fresh = cm.work(StepShape(((100, 0),)))[0]
    assert fresh.kv_read_tokens == 0  # fresh prompts read no context
    one = cm.breakdown(StepShape(((1, 130),) * 3))
    assert cm.breakdown(mixed)["overhead_s"] == pytest.approx(one["overhead_s"])  # one dispatch


def _single_stream(truth: HostCostModel, **extra) -> SingleStream:
    """What ``truth`` prices for single-stream runs at two prompt lengths (32 output tokens)."""
    prompts = (128, 480)
    return SingleStream(
        output_len=32,
        tpot_s={n: truth.step_time(StepShape.decode(1, n + 15)) for n in prompts},
        ttft_s={n: truth.ttft(n) for n in prompts},
        host_s_per_step=2e-3,
        **extra,
    )


def test_fit_recovers_a_machine_from_single_stream_numbers():
    """Numbers priced by a known model: the fit finds it again and predicts batch 16."""
    truth = _model()
    fit = fit_host("smollm2-135m", _single_stream(truth), **SIZES)
    assert fit.hw.achievable_bandwidth == pytest.approx(12e9, rel=0.02)
    assert fit.hw.tensor_flops["fp32"] == pytest.approx(40e9, rel=0.02)
    # The decode-time difference between the two prompt lengths is attention's reads alone.
    assert fit.params.attention_read_efficiency == pytest.approx(0.25, rel=0.05)
    batch = StepShape.decode(16, 200)
    assert fit.step_time(batch) == pytest.approx(truth.step_time(batch), rel=0.02)


def test_the_fit_prices_with_the_kernels_combine_law():
    """Kernels that read and multiply on the same cores (``NATIVE_GEMM_COMBINE``: the
    projections' and head's reads and arithmetic add): a fit told so finds the machine again
    and predicts 16 rows; fitted with the default law (the larger of the two) on the same
    single streams, it prices 16 rows well short of them."""
    from experiments.validate_host import combine_law, describe_fit
    from research.perf.host_model import NATIVE_GEMM_COMBINE

    truth = _model(flops=60e9, combine=NATIVE_GEMM_COMBINE)
    measured = _single_stream(truth)
    fit = fit_host("smollm2-135m", measured, combine=NATIVE_GEMM_COMBINE, **SIZES)
    assert fit.combine == NATIVE_GEMM_COMBINE
    assert fit.hw.achievable_bandwidth == pytest.approx(12e9, rel=0.02)
    batch = StepShape.decode(16, 200)
    assert fit.step_time(batch) == pytest.approx(truth.step_time(batch), rel=0.02)
    overlapped = fit_host("smollm2-135m", measured, **SIZES)
    assert overlapped.step_time(batch) < 0.9 * truth.step_time(batch)
    # What a results row and the printed fit say of the law.
    assert combine_law(fit.combine) == "dense_gemm=sum,lm_head=sum"
    assert describe_fit(measured, fit).endswith("combined by dense_gemm=sum,lm_head=sum")
    assert combine_law(overlapped.combine) == "max"


def test_server_time_per_stream_is_taken_out_of_the_kernels_and_charged_per_sequence():
    """Replicas behind a server: the same single-stream numbers with 1 ms of server CPU per
    token (on the engine's core) and 0.5 ms of router and client CPU. The server's share is no
    longer read as slow kernels (faster fitted rates), and the prediction charges 1.5 ms per
    sequence and step, so 32 streams cost ~46 ms more per step than one engine alone."""
    truth = _model()
    alone = fit_host("smollm2-135m", _single_stream(truth), **SIZES)
    served = fit_host(
        "smollm2-135m",
        _single_stream(truth, server_s_per_token=1e-3, shared_s_per_token=5e-4),
        **SIZES,
    )
    assert served.params.per_seq_overhead_s == pytest.approx(1.5e-3)
    assert served.hw.achievable_bandwidth > 1.01 * alone.hw.achievable_bandwidth
    one, many = StepShape.decode(1, 200), StepShape.decode(32, 200)
    # One stream: what was measured, less the router's share (on another core then).
    assert served.step_time(one) == pytest.approx(alone.step_time(one) + 5e-4, rel=0.03)
    assert served.step_time(many) - alone.step_time(many) > 0.03


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
