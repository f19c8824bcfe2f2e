"""Traces and sessions at their own lengths: before the first point, ``experiments.run`` raises
``model.max_model_len`` to the workload's longest request when a config file set it (within the
model's context and the KV pool), and stops naming the override or ``workload.length_scale``
otherwise (``experiments.context_len.fit_max_model_len``)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from experiments.context_len import (
    fit_max_model_len,
    longest_request,
    max_model_len_given,
    trace_requests_read,
)
from experiments.workloads import build_load
from research.config import register_configs
from tests.test_experiments import CONFIGS, _compose

GB10_AWQ = ["executor=simulated", "hardware=gb10", "model=qwen3_coder_30b_a3b", "quantization=awq"]
# Unsized, this command stopped at concurrency 1 on the trace's first prompt (40,160 tokens).
MOONCAKE_SYNTHETIC = [*GB10_AWQ, "workload=mooncake_synthetic"]


def _run_app(overrides: list[str], tmp_path: Path, monkeypatch) -> list:
    """``experiments.run.main`` on ``overrides`` as Hydra would call it, its runner replaced by
    one that records the ``RunConfig`` it is given (and runs nothing)."""
    import experiments.run as app
    import experiments.runners as runners

    given: list = []
    monkeypatch.setattr(
        runners, "get_runner", lambda name: lambda run, out, **kw: given.append(run)
    )
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[*overrides, f"output_dir={tmp_path}"],
            return_hydra_config=True,
        )
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]  # Hydra hands the task its config without it
        try:
            app.main.__wrapped__(cfg)
        finally:
            HydraConfig.instance().cfg = None  # as before: no Hydra run in progress
    return given


def test_mooncake_synthetic_runs_at_its_own_lengths(tmp_path, monkeypatch, caplog):
    """The preset's 4,096 (a config file's value) is raised to the longest of the 192 requests
    the default sweep sends, rounded up to 1,024, and the run says so."""
    with caplog.at_level(logging.WARNING, logger="experiments.context_len"):
        (run,) = _run_app(MOONCAKE_SYNTHETIC, tmp_path, monkeypatch)
    longest = longest_request(run)
    assert longest.tokens == 82_831 + 22  # the trace's first 192 requests
    assert run.model.max_model_len >= longest.tokens
    assert run.model.max_model_len == 82_944 and run.model.max_model_len % 1024 == 0
    assert run.model.max_model_len_raised_from == 4096
    assert "raised from 4,096" in caplog.text and "to 82,944" in caplog.text


def test_an_explicit_max_model_len_too_small_stops_before_the_runner(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as error:
        _run_app(
            [*MOONCAKE_SYNTHETIC, "model.max_model_len=4096", "experiment.concurrencies=[1]"],
            tmp_path,
            monkeypatch,
        )
    message = str(error.value)
    assert "model.max_model_len=4096 was set on the command line" in message
    assert "prompt of 40,160 tokens (+6 output)" in message
    assert "model.max_model_len=40960" in message and "workload.length_scale=0.0625" in message


def test_a_model_whose_context_is_shorter_than_the_trace_stops_naming_length_scale(
    tmp_path, monkeypatch
):
    """The default model (SmolLM2, 8,192-token context) on the real executor: nothing loads."""
    with pytest.raises(ValueError) as error:
        _run_app(["workload=mooncake_synthetic"], tmp_path, monkeypatch)
    message = str(error.value)
    assert "smollm2-135m's context is 8,192 tokens" in message
    assert "workload.length_scale=0.0625" in message


def test_a_pool_that_cannot_hold_one_request_stops_naming_it():
    run = _compose([*GB10_AWQ, "workload=agents", "cache.num_kv_blocks=100"])
    with pytest.raises(ValueError, match=r"KV pool on gb10 holds 1,600 tokens.*num_kv_blocks"):
        fit_max_model_len(run, explicit=False)


def test_a_run_that_fits_is_left_as_it_is():
    run = _compose([*GB10_AWQ, "workload=chat_sessions"])  # 2,176 tokens at most
    assert fit_max_model_len(run, explicit=False) is run
    run = _compose(["workload=spark", *GB10_AWQ])  # random lengths: not sized
    assert longest_request(run) is None and fit_max_model_len(run, explicit=False) is run


@pytest.mark.parametrize(
    "overrides, given",
    [
        (["model.max_model_len=4096"], True),
        (["+model.max_model_len=4096"], True),
        (["++model.max_model_len=4096"], True),
        (["model=qwen3_coder_30b_a3b", "experiment=agents"], False),
        (["model.max_model_len_raised_from=1"], False),
    ],
)
def test_what_counts_as_setting_max_model_len(overrides, given):
    assert max_model_len_given(overrides) is given


class _Backend:
    vocab_size, special_ids = 1000, ()


def _sent(run) -> int:
    """The most prompt + output tokens one request of ``build_load`` has (all the trace requests
    the run reads, or 8 sessions): a session's turn resends its history (every earlier prompt
    and answer) unless it starts a new conversation."""
    load = build_load(
        run, _Backend(), trace_requests_read(run) if not run.workload.is_sessions else 8, seed=0
    )
    if not run.workload.is_sessions:
        return max(len(r.prompt_token_ids) + r.output_len for r in load)
    most = 0
    for session in load:
        history = 0
        for turn in session.turns:
            prompt = len(turn.new_token_ids) + (0 if turn.new_conversation else history)
            most = max(most, prompt + turn.output_len)
            history = prompt + turn.output_len
    return most


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "workload=mooncake_conversation",
            "workload.length_scale=0.03125",
            "experiment.concurrencies=[2]",
        ],
        [
            "workload=azure_code",
            "experiment.concurrencies=[1]",
            "experiment.prompts_per_concurrency=8",
        ],
        ["workload=chat_sessions", "workload.length_scale=0.5"],
        ["workload=agents", "workload.length_scale=0.01", "workload.turns=3"],
    ],
    ids=["mooncake", "azure", "chat", "agents"],
)
def test_the_longest_request_is_the_one_the_workload_sends(overrides):
    run = _compose(overrides)
    assert longest_request(run).tokens == _sent(run)


def test_chat_lengths_drawn_in_a_range_stay_under_the_longest():
    run = _compose(["experiment=capacity"])  # messages and answers drawn +-50%
    longest = longest_request(run)
    assert longest.tokens == 256 + 5 * (192 + 600)
    run = dataclasses.replace(
        run,
        workload=dataclasses.replace(run.workload, range_ratio=0.0, input_len=192, output_len=600),
    )
    assert _sent(run) == longest.tokens  # the top of both ranges, every turn
