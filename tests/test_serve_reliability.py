"""The server under hostile clients, on tiny-llama over a real socket: a bad or failing request
fails alone, every disconnect aborts, the queue bound holds at admission, errors are OpenAI JSON
for every status, and the API key guards every /v1 path.

Prompts are token ids (tiny-llama has no tokenizer); ``return_token_ids`` lets every test
compare exact tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from research import LLM
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.serve import create_app
from research.serve.background import serve_in_thread
from tests.serve_faults import FaultyExecutor, metrics, runs_prompt

MODEL = "tiny"
KEY = "secret-key"
PROMPTS = [[3 + i, 50 + i, 90 + i, 130 + i, 170 + i, 210 + i, 7, 9] for i in range(8)]
POISON = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_model_len=512)


def _engine(llm, max_num_seqs: int = 64) -> Engine:
    return Engine(
        llm.model_config,
        llm.params,
        cache_config=CacheConfig(block_size=16, num_kv_blocks=1200),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        max_model_len=512,
    )


def _body(prompt=PROMPTS[0], max_tokens: int = 16, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


async def _stream_ids(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict]:
    """A streaming completion: (status, {"token_ids", "finish_reason", "error", "done"})."""
    body = {**body, "stream": True}
    result = {"token_ids": [], "finish_reason": None, "error": None, "done": False}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.json()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result["error"] = chunk["error"]
                    continue
                choice = chunk["choices"][0]
                result["token_ids"] += choice["token_ids"]
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
    return 200, result


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Greedy tokens of each prompt, offline."""
    from research import SamplingParams

    engine = _engine(llm)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, [sp] * len(PROMPTS))]


BAD_FIELDS = [
    {"top_k": 2**31},
    {"stop": [1]},
    {"stop": [["x"]]},
    {"seed": "x"},
    {"temperature": 10**400},
    {"top_p": 10**30},
    {"max_tokens": 2**40},
]


def test_bad_requests_among_8_streams_get_400_and_the_8_get_their_exact_tokens(llm, reference):
    engine = _engine(llm)
    engine.executor = FaultyExecutor(engine.executor, delay=0.01)
    with serve_in_thread(create_app(engine, served_model_name=MODEL)) as url:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                streams = [
                    asyncio.ensure_future(_stream_ids(client, url, _body(p))) for p in PROMPTS
                ]
                await asyncio.sleep(0.05)
                bad = [client.post(f"{url}/v1/completions", json=_body(**f)) for f in BAD_FIELDS]
                return await asyncio.gather(*streams), await asyncio.gather(*bad)

        streams, bad = asyncio.run(main())
    for response, fields in zip(bad, BAD_FIELDS, strict=True):
        assert response.status_code == 400, (fields, response.text)
        assert next(iter(fields)) in response.json()["error"]["message"]
    for (status, result), tokens in zip(streams, reference, strict=True):
        assert status == 200 and result["error"] is None and result["done"]
        assert result["token_ids"] == tokens and result["finish_reason"] == "length"


def test_a_request_that_fails_in_the_step_fails_alone(llm, reference):
    engine = _engine(llm)
    engine.executor = FaultyExecutor(engine.executor, runs_prompt(POISON), delay=0.005)
    with serve_in_thread(create_app(engine, served_model_name=MODEL)) as url:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                streams = [
                    asyncio.ensure_future(_stream_ids(client, url, _body(p))) for p in PROMPTS
                ]
                await asyncio.sleep(0.05)
                poisoned_stream = await _stream_ids(client, url, _body(POISON))
                poisoned = await client.post(f"{url}/v1/completions", json=_body(POISON))
                return await asyncio.gather(*streams), poisoned_stream, poisoned

        streams, poisoned_stream, poisoned = asyncio.run(main())
        after = metrics(url, MODEL)
    assert poisoned.status_code == 500 and "injected fault" in poisoned.json()["error"]["message"]
    status, result = poisoned_stream
    assert status == 200 and "injected fault" in result["error"]["message"] and result["done"]
    for (status, result), tokens in zip(streams, reference, strict=True):
        assert status == 200 and result["error"] is None
        assert result["token_ids"] == tokens
    assert after['research:request_finished_total{finished_reason="error"}'] == 2
    assert after["research:kv_blocks_used"] == 0


def test_32_non_streaming_disconnects_leave_nothing_running_within_one_step(llm):
    engine = _engine(llm)
    engine.executor = FaultyExecutor(engine.executor, delay=0.05)  # 50 ms a step
    with serve_in_thread(create_app(engine, served_model_name=MODEL)) as url:

        async def main():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
                body = _body(max_tokens=400)
                tasks = [
                    asyncio.ensure_future(c.post(f"{url}/v1/completions", json=body))
                    for _ in range(32)
                ]
                deadline = time.monotonic() + 30
                while len(engine.scheduler.running) < 32 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                for task in tasks:
                    task.cancel()  # closes each connection
                steps_at_close = engine.num_steps
                await asyncio.gather(*tasks, return_exceptions=True)
                return steps_at_close

        steps_at_close = asyncio.run(main())
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.005)
        steps_to_idle = engine.num_steps - steps_at_close
        m = metrics(url, MODEL)
    assert not engine.has_unfinished_requests()
    # the step running when the sockets closed may finish; no step after it runs them
    assert steps_to_idle <= 2, steps_to_idle
    assert m['research:request_finished_total{finished_reason="abort"}'] == 32
    assert m["research:num_requests_running"] == 0 and m["research:kv_blocks_used"] == 0


def test_max_waiting_is_counted_at_admission_and_metrics_show_admissions(llm):
    """Two long requests hold both slots, and the engine is held mid-step (a gated executor)
    while 16 more arrive one by one, each sent only once the previous one is settled (admitted:
    the loop's unscheduled count grew; or refused): exactly 4 are admitted to wait, the other
    12 get 429 with Retry-After. No timing: the gate, not the machine's speed, keeps the slots
    busy."""
    import threading

    gate = threading.Event()
    gate.set()
    engine = _engine(llm, max_num_seqs=2)
    engine.executor = FaultyExecutor(engine.executor, gate=gate)
    app = create_app(engine, served_model_name=MODEL, max_waiting=4)
    loop = app.state.engine_loop
    with serve_in_thread(app) as url:

        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
                post = lambda body: asyncio.ensure_future(  # noqa: E731
                    c.post(f"{url}/v1/completions", json=body)
                )
                blockers = [post(_body(PROMPTS[i], max_tokens=40)) for i in range(2)]
                while len(engine.scheduler.running) < 2:
                    await asyncio.sleep(0.01)
                gate.clear()  # the next step waits: both slots stay taken
                arrivals = []
                for i in range(16):
                    before = loop._num_unscheduled
                    arrivals.append(post(_body(PROMPTS[i % 8], max_tokens=1)))
                    while not arrivals[-1].done() and loop._num_unscheduled == before:
                        await asyncio.sleep(0.005)
                refused = [a for a in arrivals if a.done()]
                gauges = metrics(url, MODEL)
                gate.set()
                return (
                    gauges,
                    refused,
                    await asyncio.gather(*arrivals),
                    await asyncio.gather(*blockers),
                )

        gauges, refused_early, responses, blockers = asyncio.run(main())
        after = metrics(url, MODEL)
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 4 and statuses.count(429) == 12, statuses
    assert statuses[:4] == [200] * 4  # the first four found room; every later one was refused
    assert len(refused_early) == 12  # refused at once, while the engine was held
    assert all(r.headers["retry-after"] for r in responses if r.status_code == 429)
    assert [b.status_code for b in blockers] == [200, 200]
    assert gauges["research:requests_rejected_total"] == 12
    assert after["research:requests_total"] == 6
    assert after["research:requests_rejected_total"] == 12


@pytest.fixture(scope="module")
def keyed_server(llm):
    app = create_app(_engine(llm), served_model_name=MODEL, api_key=KEY, max_body_bytes=4096)
    with serve_in_thread(app) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_auth_scheme_is_case_insensitive_and_every_v1_path_needs_the_key(keyed_server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} {KEY}"}
        ok = httpx.post(f"{keyed_server}/v1/completions", json=_body(), headers=headers)
        assert ok.status_code == 200, scheme
    for path in ("/v1/completions", "/v1/models", "/v1/nothing-here", "/v1"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.post(f"{keyed_server}{path}", headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_server}/health").status_code == 200
    assert httpx.get(f"{keyed_server}/metrics").status_code == 200


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


def test_every_error_status_is_openai_json(keyed_server):
    url = keyed_server
    assert "Not Found" in _error(httpx.get(f"{url}/v1/nothing", headers=AUTH), 404)
    assert "Not Found" in _error(httpx.get(f"{url}/nothing"), 404)
    assert "Method Not Allowed" in _error(httpx.get(f"{url}/v1/completions", headers=AUTH), 405)
    big = json.dumps(_body(prompt=[5] * 2000))
    assert "larger than 4096" in _error(
        httpx.post(f"{url}/v1/completions", content=big, headers=AUTH), 413
    )
    headers = {**AUTH, "Content-Type": "text/plain"}
    assert "application/json" in _error(
        httpx.post(f"{url}/v1/completions", content=json.dumps(_body()), headers=headers), 415
    )


@pytest.fixture(scope="module")
def plain_server(llm):
    """An open server (no key), with a body limit big enough for the hostile bodies."""
    app = create_app(_engine(llm), served_model_name=MODEL, max_body_bytes=1 << 20)
    with serve_in_thread(app) as url:
        yield url


BAD_BODIES = {
    "deep_json": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "deep_object": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    "huge_int": (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    "infinity": (b'{"prompt": [1, 2], "stop_token_ids": [Infinity]}', "Infinity"),
    "nan": (b'{"prompt": [1, 2], "temperature": NaN}', "NaN"),
    "huge_temperature": (json.dumps(_body(temperature=10**400)).encode(), "temperature"),
    "huge_top_p": (json.dumps(_body(top_p=10**400)).encode(), "top_p"),
    "lone_surrogate_prompt": (b'{"prompt": "a\\ud800b"}', "not valid text"),
    "lone_surrogate_content": (
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "not valid text",
    ),
    "lone_surrogate_role": (
        b'{"messages": [{"role": "\\ud800", "content": "hi"}]}',
        "not valid text",
    ),
    "bad_utf8": (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    "prompt_too_long_ids": (json.dumps(_body(prompt=[5] * 600)).encode(), "max_model_len"),
    "stream_options_list": (json.dumps(_body(stream=True, stream_options=[1])).encode(), "stream"),
}


@pytest.mark.parametrize(("content", "reason"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_hostile_bodies_get_400_and_the_server_keeps_serving(plain_server, content, reason):
    server = plain_server
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    response = httpx.post(f"{server}{path}", content=content, timeout=30)
    assert reason in _error(response, 400)
    ok = httpx.post(f"{server}/v1/completions", json=_body(max_tokens=2), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_early_disconnects_log_no_traceback(plain_server, caplog):
    host, port = urlparse(plain_server).hostname, urlparse(plain_server).port
    with caplog.at_level(logging.WARNING):
        for _ in range(5):  # headers promise a body that never comes
            with socket.create_connection((host, port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b'\r\nContent-Length: 1000\r\n\r\n{"prompt": ['
                )
        for stream in (True, False):  # and bodies whose reader leaves at once
            for _ in range(5):
                with socket.create_connection((host, port)) as sock:
                    body = json.dumps(_body(max_tokens=50, stream=stream)).encode()
                    sock.sendall(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
        time.sleep(1.0)
        ok = httpx.post(f"{plain_server}/v1/completions", json=_body(max_tokens=2), timeout=30)
    assert ok.status_code == 200
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, [r.getMessage() for r in problems]
