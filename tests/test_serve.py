"""The OpenAI-compatible server on real SmolLM2 over a real socket: the official ``openai`` client,
64 concurrent streams, errors, disconnects, the queue bound, and the HTTP benchmark client.

Every prompt but the chat one has the same length, so the engine compiles few step shapes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from research import SamplingParams
from research.bench import BenchRequest, compute_metrics
from research.bench.http_client import run_http_benchmark
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.serve import create_app

MODEL = "smollm2"
KEY = "secret"
PROMPT = [1000 + i for i in range(8)]  # 8 token ids: one prefill length for all tests


def _engine(llm) -> Engine:
    """A small engine over the session's SmolLM2 weights (its own pool and batch)."""
    return Engine(
        llm.model_config,
        llm.params,
        llm.tokenizer,
        cache_config=CacheConfig(block_size=16, num_kv_blocks=256),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        max_model_len=256,
    )


@contextmanager
def _serve(app) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port in a background thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2_llm) -> Iterator[str]:
    with _serve(create_app(_engine(smollm2_llm), served_model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(smollm2_llm) -> Iterator[str]:
    """A second server with an API key and room for only 2 waiting requests."""
    app = create_app(_engine(smollm2_llm), served_model_name=MODEL, max_waiting=2, api_key=KEY)
    with _serve(app) as url:
        yield url


def _body(max_tokens: int = 4, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict]:
    """POST a streaming completion; returns the status and (for 200) the text chunks' count,
    the usage and whether ``[DONE]`` came, or (otherwise) the headers and JSON error."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, {"headers": response.headers, **response.json()}
        result = {"chunks": 0, "usage": None, "done": False}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[len("data: ") :])
            result["chunks"] += bool(chunk["choices"])
            result["usage"] = chunk.get("usage") or result["usage"]
        return 200, result


async def _burst(url: str, n: int, headers: dict | None = None) -> list[tuple[int, dict]]:
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:
        return await asyncio.gather(*(_stream(client, url, _body()) for _ in range(n)))


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples as {name (plus labels other than model_name): value}."""
    text = httpx.get(f"{url}/metrics").text
    assert "# TYPE research:kv_blocks_free gauge" in text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.replace(f'model_name="{MODEL}"', "").replace("{,", "{").replace("{}", "")
            samples[name] = float(value)
    return samples


def test_openai_client_streams_a_chat_answer(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0.0,
        max_tokens=12,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 4
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text


def test_64_concurrent_streams_complete_with_their_token_counts(server):
    results = asyncio.run(_burst(server, 64))
    for status, result in results:
        assert status == 200
        assert result["done"] and result["chunks"] == 4
        assert result["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"model": "smollm2", "prompt": ', "not valid JSON"),
        (json.dumps(_body(model="gpt-4")).encode(), "does not exist"),
        (json.dumps(_body(temperature=-1)).encode(), "temperature"),
        (json.dumps(_body(prompt=PROMPT * 40)).encode(), "max_model_len"),
        (json.dumps(_body(max_tokens="four")).encode(), "max_tokens"),
    ],
)
def test_bad_requests_get_400_with_a_reason_and_the_server_keeps_serving(server, content, reason):
    response = httpx.post(f"{server}/v1/completions", content=content)
    assert response.status_code == 400
    error = response.json()["error"]
    assert reason in error["message"] and error["type"] == "invalid_request_error"
    ok = httpx.post(f"{server}/v1/completions", json=_body(), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_api_key_is_required_when_set(keyed_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{keyed_server}/v1/completions", json=_body(), headers=headers)
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    ok = httpx.post(f"{keyed_server}/v1/completions", json=_body(), headers=headers, timeout=60)
    assert ok.status_code == 200


def test_disconnected_streams_are_aborted_and_free_their_blocks(server):
    before = _metrics(server).get('research:request_finished_total{finished_reason="abort"}', 0)

    async def read_one_chunk_and_leave(client: httpx.AsyncClient) -> None:
        body = {**_body(max_tokens=100), "stream": True}
        async with client.stream("POST", f"{server}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(read_one_chunk_and_leave(client) for _ in range(10)))

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while True:
        m = _metrics(server)
        aborted = m.get('research:request_finished_total{finished_reason="abort"}', 0) - before
        idle = m["research:num_requests_running"] == 0 and m["research:kv_blocks_used"] == 0
        if (aborted == 10 and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 10, "every disconnected stream should be aborted, not run to the end"
    assert idle and m["research:kv_blocks_free"] == m["research:kv_blocks_total"]


def test_a_burst_beyond_the_queue_bound_gets_429s_and_the_admitted_complete(keyed_server):
    results = asyncio.run(_burst(keyed_server, 40, headers={"Authorization": f"Bearer {KEY}"}))
    statuses = [status for status, _ in results]
    assert set(statuses) == {200, 429}, statuses
    for status, result in results:
        if status == 429:
            assert result["headers"]["retry-after"] and "retry" in result["error"]["message"]
        else:
            assert result["done"] and result["usage"]["completion_tokens"] == 4
    m = _metrics(keyed_server)
    assert m["research:requests_rejected_total"] == statuses.count(429)


def test_http_benchmark_client_records_ttft_and_tpot(server):
    requests = [BenchRequest(PROMPT, 4) for _ in range(8)]
    before = _metrics(server)
    result = run_http_benchmark(server, MODEL, requests, max_concurrency=4)
    # The engine's own time is exported (what validate_host reads from replicas over HTTP).
    after = _metrics(server)
    steps, busy, host = (
        after[k] - before[k]
        for k in (
            "research:num_steps",
            "research:engine_step_seconds_total",
            "research:engine_host_seconds_total",
        )
    )
    assert steps >= 4 and 0 < host < busy < result.duration
    # And the server's event-loop CPU (what validate_host charges replicas per streamed token).
    loop = after["research:server_loop_cpu_seconds_total"]
    assert 0 < loop - before["research:server_loop_cpu_seconds_total"] < result.duration
    assert all(r.success for r in result.records), [r.error for r in result.records]
    assert all(r.output_len == 4 and len(r.token_times) == 4 for r in result.records)
    metrics = compute_metrics(result.records, result.duration)
    assert metrics["completed"] == 8 and metrics["total_output_tokens"] == 32
    assert metrics["median_ttft_ms"] > 0 and metrics["median_tpot_ms"] > 0


UNSUPPORTED = {
    "echo": True,
    "best_of": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": 1.0,
    "repetition_penalty": 1.2,
    "logit_bias": {"50": 10},
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "suffix": "end",
}


def test_fields_the_server_would_ignore_are_refused_by_name(server):
    """Every OpenAI field that would have no effect gets a 400 naming it; its neutral value
    (what clients send by default) is accepted; a zero token budget is refused."""
    for name, value in UNSUPPORTED.items():
        response = httpx.post(f"{server}/v1/completions", json=_body(**{name: value}), timeout=60)
        assert response.status_code == 400, name
        assert f"'{name}' is not supported" in response.json()["error"]["message"]
    neutral = dict(logprobs=None, presence_penalty=0, frequency_penalty=0.0, echo=False, best_of=1)
    ok = httpx.post(f"{server}/v1/completions", json=_body(**neutral), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    for name in ("max_completion_tokens", "max_tokens"):
        body = {k: v for k, v in _body().items() if k != "max_tokens"} | {name: 0}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and f"'{name}' must be at least 1" in response.text


def test_chat_content_parts_are_read_as_text(server):
    """OpenAI content parts (what vllm bench serve --backend openai-chat and guidellm send)."""

    def chat(content) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0.0,
        }
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)

    plain = chat("What is the capital of France?")
    parts = chat(
        [
            {"type": "text", "text": "What is the capital"},
            {"type": "text", "text": " of France?"},
        ]
    )
    assert plain.status_code == parts.status_code == 200
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    image = chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert image.status_code == 400 and "only text content parts" in image.text


def test_chat_streams_as_vllm_bench_serve_openai_chat_sends_them(server):
    """``vllm bench serve --backend openai-chat``'s request: text content parts,
    max_completion_tokens, ignore_eos, streaming with usage. Eight at once: every one
    succeeds, streams its tokens and reports them in its usage chunk."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict, bool]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": f"Count to {i}"}]}],
            "temperature": 0.0,
            "max_completion_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage, done = "", None, False
        async with client.stream("POST", f"{server}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[len("data: ") :])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["delta"].get("content") or ""
                    usage = chunk.get("usage") or usage
        return text, usage, done

    async def run() -> list[tuple[str, dict, bool]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    for text, usage, done in asyncio.run(run()):
        assert done and text and usage["completion_tokens"] == 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_logprobs_through_the_openai_client(server, smollm2_llm):
    """Completions ``logprobs=n`` and chat ``logprobs``/``top_logprobs``, streamed or not, carry
    the engine's log-probabilities; bad combinations are refused."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompt = "The capital of France is"
    ref = smollm2_llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    )[0]
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0.0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = completion.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for e, t in zip(ref.outputs[0].logprobs, ref.token_ids, strict=True)],
        abs=1e-4,
    )
    assert "".join(lp.tokens) == completion.choices[0].text == ref.text
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0.0)
    plain = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = [
        item
        for chunk in client.chat.completions.create(
            **kwargs, logprobs=True, top_logprobs=2, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == [
        (i.token, round(i.logprob, 4)) for i in content
    ]
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is None

    for body, reason in (
        ({"messages": messages, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ({"messages": messages, "logprobs": True, "top_logprobs": 21}, "logprobs must be in"),
        ({"prompt": prompt, "logprobs": -1}, "whole vocabulary"),
    ):
        path = "chat/completions" if "messages" in body else "completions"
        response = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400 and reason in response.text, response.text


def test_completions_prompt_logprobs_as_vllm(server, smollm2_llm):
    body = _body(prompt_logprobs=1)
    choice = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ref = smollm2_llm.generate(
        [PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    )[0]
    assert choice["prompt_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == len(PROMPT)
    for got, want in zip(choice["prompt_logprobs"][1:], ref.prompt_logprobs[1:], strict=True):
        assert {int(t) for t in got} == set(want)
        for t, entry in got.items():
            assert entry["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-4)
            assert entry["rank"] == want[int(t)].rank


def test_tokenize_and_detokenize_as_vllm(server, smollm2_llm):
    text = "The capital of France is"
    tok = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert tok.status_code == 200
    body = tok.json()
    assert body["tokens"] == smollm2_llm.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["tokens"] == smollm2_llm.tokenizer.apply_chat_template(messages, True)
    back = httpx.post(f"{server}/detokenize", json={"tokens": body["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json()["prompt"] == text
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [1, -3]}, timeout=60)
    assert bad.status_code == 400 and "'tokens'" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tiny-llama", "--model", "smollm2-135m"], "two models given"),
        (["tiny-llama", "--gpu-memory-utilization", "0.9"], "--kv-cache-memory-bytes"),
        (["tiny-llama", "--tensor-parallel-size", "3"], "does not divide num_heads"),
    ],
)
def test_serve_cli_takes_the_model_positionally_and_says_what_vllm_flags_mean_here(
    argv, message, capsys
):
    from research.serve.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_a_peer_server_and_ours_in_one_comparison(server, tmp_path, capsys):
    """The peers recipe end to end, with our own server standing in for llama-server / vLLM:
    an executor=http sweep labelled by its server, next to a second run, in one
    experiments.compare figure and summary.csv."""
    import csv

    from hydra import compose, initialize_config_dir

    from experiments.compare import main as compare
    from experiments.sweep import run_experiment
    from research.config import register_configs, run_config_from

    register_configs()
    dirs = []
    for label in ("llama-server", "vllm"):
        overrides = [
            "executor=http",
            f"executor.base_url={server}",
            f"executor.label={label}",
            f"model.model={MODEL}",
            "experiment.concurrencies=[1,4]",
            "experiment.prompts_per_concurrency=1",
            "experiment.warmup=false",
            "workload.input_len=16",
            "workload.output_len=8",
            "tracking=disabled",
        ]
        configs = str(Path(__file__).resolve().parents[1] / "configs")
        with initialize_config_dir(config_dir=configs, version_base=None):
            run = run_config_from(compose(config_name="config", overrides=overrides))
        points = run_experiment(run, tmp_path / label, progress=False)
        assert [p["completed"] for p in points] == [1, 4] and all(p["failed"] == 0 for p in points)
        dirs.append(str(tmp_path / label))
    compare([*dirs, "--metrics", "output_throughput", "--out", str(tmp_path / "cmp")])
    with (tmp_path / "cmp" / "summary.csv").open() as f:
        labels = [row["label"] for row in csv.DictReader(f)]
    assert labels == [f"llama-server {MODEL}"] * 2 + [f"vllm {MODEL}"] * 2
    assert (tmp_path / "cmp" / "output_throughput.pdf").exists()
