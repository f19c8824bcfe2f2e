"""Datasets, shipped traces, sessions and the prefix cache they exercise (research.bench)."""

from __future__ import annotations

import csv
import json
import statistics
from datetime import datetime

import pytest

from research.bench import run_benchmark
from research.bench.cache_replay import replay_prefix_cache
from research.bench.datasets import (
    SHIPPED_TRACES,
    TRACE_DIR,
    DatasetError,
    burstgpt_requests,
    custom_requests,
    load_trace,
    prefix_random_requests,
    prefix_repetition_requests,
    trace_requests,
)
from research.bench.sessions import Session, Turn, agent_sessions, chat_sessions, run_sessions
from research.engine.request import RequestMetrics, RequestOutput

# ------------------------------------------------------------------ shipped traces


@pytest.mark.parametrize(
    ("name", "median_in", "median_out", "rate"),
    [("azure_code", 1469, 13, 2.567), ("azure_conv", 1020, 129, 5.530)],
)
def test_azure_lengths_and_rate_are_the_files(name, median_in, median_out, rate):
    """Medians and request rate read back from the CSV by an independent parse, and as
    printed in docs/experiments/traces.md."""
    records = load_trace(name)
    with (TRACE_DIR / SHIPPED_TRACES[name][1]).open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(records) == len(rows)
    assert [r.input_len for r in records] == [int(r["ContextTokens"]) for r in rows]
    assert [r.output_len for r in records] == [int(r["GeneratedTokens"]) for r in rows]
    t = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    span = (t[-1] - t[0]).total_seconds()
    assert records[-1].timestamp_s == pytest.approx(span, abs=1e-3)
    assert statistics.median(r.input_len for r in records) == median_in
    assert statistics.median(r.output_len for r in records) == median_out
    assert len(records) / records[-1].timestamp_s == pytest.approx(rate, abs=1e-3)


def test_mooncake_hash_blocks_are_shared_token_runs():
    records = load_trace("mooncake_conversation")[:3]
    # The first three requests share hash id 0 (one 512-token block), then differ.
    assert [r.hash_ids[0] for r in records] == [0, 0, 0] and records[0].hash_ids[1] != records[
        1
    ].hash_ids[1]
    reqs = trace_requests(records, vocab_size=5000, seed=3)
    a, b = reqs[0].prompt_token_ids, reqs[1].prompt_token_ids
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]
    assert [len(r.prompt_token_ids) for r in reqs] == [r.input_len for r in records]
    again = trace_requests(records, vocab_size=5000, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


@pytest.mark.parametrize(
    ("name", "published"), [("mooncake_synthetic", 0.66), ("mooncake_conversation", 0.40)]
)
def test_mooncake_hit_ratio_unbounded_within_3_points(name, published):
    """Token-weighted prefix-cache hit ratio of the whole trace through the engine's block
    manager with an unbounded pool, at 1/32 of the lengths (16-token trace blocks, one engine
    block each: the same sharing, 32x less hashing); the full-length figures are 65.1% and
    37.4% (docs/experiments/traces.md)."""
    reqs = trace_requests(load_trace(name), vocab_size=151936, length_scale=1 / 32)
    replay = replay_prefix_cache(reqs, None, block_size=16)
    assert replay.evictions == 0 and replay.too_long == 0
    assert abs(replay.hit_rate - published) <= 0.03, replay.hit_rate


def test_hit_ratio_grows_with_the_pool():
    reqs = trace_requests(load_trace("mooncake_synthetic"), vocab_size=151936, length_scale=1 / 32)
    replays = [replay_prefix_cache(reqs, n, 16) for n in (500, 2000, 8000, None)]
    rates = [r.hit_rate for r in replays]
    assert rates == sorted(rates) and rates[0] < rates[-1] - 0.3, rates
    evictions = [r.evictions for r in replays]
    assert evictions == sorted(evictions, reverse=True) and evictions[-1] == 0


# ------------------------------------------------------------------ bad input names file and line


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "a.csv",
            "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.97,10\n",
            r"a\.csv:1: missing column",
        ),
        (
            "b.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,2\n"
            "2023-11-16 18:17:04.00,-5,2\n",
            r"b\.csv:3: ContextTokens is -5",
        ),
        (
            "c.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05.00,10,2\n"
            "2023-11-16 18:17:04.00,10,2\n",
            r"c\.csv:3: timestamp .* comes before",
        ),
        (
            "d.jsonl",
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
            '{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}\n',
            r"d\.jsonl:2: 3 hash ids of 512 tokens cover more than input_length 600",
        ),
        ("e.jsonl", '{"timestamp": 0, "input_length": 6}\n', r"e\.jsonl:1: missing key"),
        (
            "f.jsonl",
            '{"timestamp": 9, "input_length": 6, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 3, "input_length": 6, "output_length": 1, "hash_ids": [1]}\n',
            r"f\.jsonl:2: timestamp",
        ),
    ],
)
def test_bad_trace_names_file_and_line(tmp_path, name, text, message):
    with pytest.raises(DatasetError, match=message):
        load_trace(_write(tmp_path, name, text))


def test_bad_local_datasets_name_file_and_line(tmp_path):
    bg = _write(
        tmp_path, "burst.csv", "Timestamp,Model,Request tokens,Response tokens\n1,GPT-4,x,3\n"
    )
    with pytest.raises(DatasetError, match=r"burst\.csv:2: Request tokens is 'x'"):
        burstgpt_requests(bg, 5)
    custom = _write(tmp_path, "c.jsonl", '{"prompt_token_ids": [1, 2]}\n{"text": "hi"}\n')
    with pytest.raises(DatasetError, match=r"c\.jsonl:2: each line needs"):
        custom_requests(custom, 5, None, 8)
    with pytest.raises(ValueError, match="not a shipped one"):
        load_trace(tmp_path / "missing.jsonl")


def test_workload_config_errors():
    from research.config import WorkloadConfig

    with pytest.raises(ValueError, match=r"reads a local file: set workload\.path"):
        WorkloadConfig(dataset="sharegpt")
    with pytest.raises(ValueError, match="dataset must be one of"):
        WorkloadConfig(dataset="lmsys")


# ------------------------------------------------------------------ vLLM's synthetic datasets


def test_random_prefix_and_prefix_repetition():
    reqs = prefix_random_requests(6, 32, 16, 4, vocab_size=1000, seed=1)
    assert all(len(r.prompt_token_ids) == 48 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:32]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 6
    reps = prefix_repetition_requests(12, 20, 5, 3, 4, vocab_size=1000, seed=1)
    assert len({tuple(r.prompt_token_ids[:20]) for r in reps}) == 3
    assert all(len(r.prompt_token_ids) == 25 and r.output_len == 4 for r in reps)


def test_burstgpt_and_custom(tmp_path):
    bg = _write(
        tmp_path,
        "burst.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1,ChatGPT,100,20,120,Conversation log\n2,GPT-4,50,0,50,Conversation log\n"
        "3,GPT-4,70,9,79,Conversation log\n",
    )
    (r,) = burstgpt_requests(bg, 5)  # GPT-4 rows with a response, as vLLM keeps
    assert (r.prompt_len, r.output_len) == (70, 9)
    custom = _write(
        tmp_path, "c.jsonl", json.dumps({"prompt_token_ids": [5, 6, 7], "output_tokens": 2}) + "\n"
    )
    (c,) = custom_requests(custom, 5, None, 8)
    assert (c.prompt_token_ids, c.output_len) == ([5, 6, 7], 2)


# ------------------------------------------------------------------ sessions


class _FakeEngine:
    """Finishes each request after one step with output ids 900, 901, ...; a virtual clock that
    ``sleep`` advances and each step moves by 1 s."""

    def __init__(self, max_len=10_000):
        self.now, self.pending, self.sent, self.max_len = 0.0, [], [], max_len

    def clock(self):
        return self.now

    def sleep(self, s):
        self.now += s

    def add_request(
        self,
        prompt_token_ids,
        sampling_params=None,
        request_id=None,
        prompt=None,
        arrival_time=None,
    ):
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_len}"
            )
        rid = str(len(self.sent))
        self.sent.append((self.now, list(prompt_token_ids)))
        self.pending.append((rid, sampling_params.max_tokens, arrival_time))
        return rid

    def step(self):
        self.now += 1.0
        outs = []
        for rid, n, arrival in self.pending:
            m = RequestMetrics(
                arrival,
                first_token_time=self.now,
                token_times=[self.now] * n,
                finished_time=self.now,
            )
            outs.append(RequestOutput(rid, None, [], "", list(range(900, 900 + n)), "length", m))
        self.pending = []
        return outs

    def stats(self):
        return {}


def test_a_turn_resends_the_history_after_its_gap():
    s = Session([Turn([1, 2, 3], 2), Turn([4, 5], 3, gap_s=10.0), Turn([6], 1, gap_s=10.0)])
    engine = _FakeEngine()
    result = run_sessions(engine, [s], clock=engine.clock, sleep=engine.sleep)
    (_, p0), (t1, p1), (t2, p2) = engine.sent
    assert p0 == [1, 2, 3]
    assert p1 == [1, 2, 3, 900, 901, 4, 5]
    assert p2 == [*p1, 900, 901, 902, 6]
    assert t1 == pytest.approx(1.0 + 10.0) and t2 == pytest.approx(t1 + 1.0 + 10.0)
    assert len(result.records) == 3 and all(r.success for r in result.records)


def test_a_session_past_max_model_len_is_refused_and_counted():
    long = Session([Turn([1] * 8, 2), Turn([2] * 8, 2)])
    ok = Session([Turn([3] * 4, 2)])
    engine = _FakeEngine(max_len=16)
    result = run_sessions(
        engine, [long, ok], max_concurrency=1, clock=engine.clock, sleep=engine.sleep
    )
    assert [r.success for r in result.records] == [True, False, True]
    assert "max_model_len is 16" in result.records[1].error


def test_sessions_generators():
    chats = chat_sessions(3, turns=4, system_len=10, message_len=5, output_len=7, vocab_size=100)
    assert [len(s.turns) for s in chats] == [4, 4, 4]
    assert len(chats[0].turns[0].new_token_ids) == 15 and chats[0].turns[1].gap_s == 10.0
    agents = agent_sessions(
        2, calls=3, context_len=50, tool_output_len=6, tool_time_s=25.0, vocab_size=100
    )
    assert [len(t.new_token_ids) for t in agents[0].turns] == [50, 6, 6]
    assert [t.gap_s for t in agents[0].turns] == [0.0, 25.0, 25.0]


def test_agents_hit_the_prefix_cache_in_simulation():
    """Qwen3-Coder on a simulated GB10, vLLM's profile: each call after the first finds its
    grown context cached, so TTFT falls several-fold with prefix caching on."""
    from research.llm import LLM

    def ttft(caching):
        llm = LLM(
            "qwen3-coder-30b-a3b",
            executor="simulated",
            hardware="gb10",
            quantization="awq",
            enable_prefix_caching=caching,
            max_model_len=8192,
            num_kv_blocks=4000,
        )
        agents = agent_sessions(
            2,
            calls=4,
            context_len=4000,
            output_len=50,
            tool_output_len=200,
            tool_time_s=25.0,
            vocab_size=151936,
        )
        e = llm.engine
        res = run_sessions(e, agents, clock=e.clock, sleep=e.executor.clock.sleep)
        return statistics.median(r.first_token_time - r.send_time for r in res.records), e.stats()

    on, stats_on = ttft(True)
    off, stats_off = ttft(False)
    assert stats_on["prefix_cache_hits"] > 0.7 * stats_on["prefix_cache_queries"]
    assert stats_off["prefix_cache_hits"] == 0
    assert off > 3 * on, (on, off)


# ------------------------------------------------------------------ real engine = simulator on hits


def _sharing_subset(records, n):
    """The first requests (in trace order) that share 8 or more blocks with an earlier one,
    with that earlier one, until ``n``: a short stretch of the trace with its sharing kept."""
    owner, chosen = {}, set()
    for i, r in enumerate(records):
        ids = r.hash_ids
        k = next((j for j in range(len(ids), 0, -1) if ids[:j] in owner), 0)
        if k >= 8 and len(chosen) < n:
            chosen |= {owner[ids[:k]], i}
        owner |= {ids[:j]: i for j in range(1, len(ids) + 1)}
        if len(chosen) >= n:
            break
    return [records[i] for i in sorted(chosen)]


@pytest.mark.slow  # compiles tiny-llama's steps (about 40 s)
def test_real_engine_and_simulator_hit_the_same_prefix_blocks():
    """24 Mooncake conversation requests that share prefixes, at 1/32 of their lengths
    (16-token trace blocks) and cut to tiny-llama's context, closed loop at 4, through the real
    engine (tiny-llama on this CPU) and the simulated one with the same pool, scheduler and
    block size: the same prompt tokens are found cached, and the count is pinned, so a change
    to either side's hashing or lookup fails."""
    from research.llm import LLM

    records = _sharing_subset(load_trace("mooncake_conversation"), 24)
    reqs = trace_requests(records, vocab_size=256, length_scale=1 / 32)
    reqs = [type(r)(r.prompt_token_ids[:400], 4) for r in reqs]  # tiny-llama's 512 context
    common = dict(max_model_len=512, num_kv_blocks=400, block_size=16, max_num_seqs=4)
    counts = []
    for kind in ("real", "simulated"):
        extra = dict(executor="simulated", hardware="gb10") if kind == "simulated" else {}
        llm = LLM("tiny-llama", **common, **extra)
        e = llm.engine
        sleep = e.executor.clock.sleep if kind == "simulated" else (lambda s: None)
        run_benchmark(e, reqs, max_concurrency=4, clock=e.clock, sleep=sleep)
        s = e.stats()
        counts.append((s["prefix_cache_queries"], s["prefix_cache_hits"]))
    assert counts[0] == counts[1]
    assert counts[0] == (sum(r.prompt_len for r in reqs), EXPECTED_HITS)


# Cached prompt tokens of that run (48.7% of 8,185): both executors, same block manager.
EXPECTED_HITS = 3984


def test_sharegpt_first_turns_and_sessions(tmp_path):
    from research.bench.datasets import load_sharegpt, sharegpt_requests
    from research.bench.sessions import sharegpt_sessions

    data = [
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "f g h i"},
                           {"from": "human", "value": "j k"}, {"from": "gpt", "value": "l m n"}]},
        {"conversations": [{"from": "human", "value": "too short"}]},  # one turn: dropped
        {"conversations": [{"from": "human", "value": "x y"}, {"from": "gpt", "value": "z z z z"}]},
    ]  # fmt: skip
    path = _write(tmp_path, "sg.json", json.dumps(data))

    def tokenize(text):
        return [ord(w[0]) for w in text.split()]

    assert len(load_sharegpt(path)) == 2
    # vLLM's sampling: first turn and the reply's length; pairs under 4 tokens skipped.
    (r,) = sharegpt_requests(path, 10, tokenize)
    assert (r.prompt_len, r.output_len) == (5, 4)
    sessions = sharegpt_sessions(load_sharegpt(path), 10, tokenize, think_time_s=3.0)
    assert [len(s.turns) for s in sessions] == [2, 1]
    assert [t.output_len for t in sessions[0].turns] == [4, 3] and sessions[0].turns[1].gap_s == 3.0


@pytest.mark.slow  # compiles tiny-llama's steps (about 40 s)
def test_the_real_engine_runs_chat_sessions_from_hydra(tmp_path):
    """workload=chat_sessions on tiny-llama on this CPU, lengths scaled to its context: every
    turn after the first finds its history cached."""
    from experiments.sweep import run_experiment
    from tests.test_experiments import _compose

    run = _compose([
        "model=tiny_llama", "workload=chat_sessions", "workload.length_scale=0.125",
        "workload.turns=3", "workload.think_time_s=0.0", "experiment.concurrencies=[2]",
        "experiment.prompts_per_concurrency=1", "experiment.warmup=false", "tracking=disabled",
        "tracking.plots=false",
    ])  # fmt: skip
    (point,) = run_experiment(run, tmp_path, progress=False)
    assert point["completed"] == 2 * 3 and point["dataset"] == "chat_sessions"
    assert point["prefix_cache_hit_rate"] > 0.5 and point["cached_prompt_tokens"] > 0
