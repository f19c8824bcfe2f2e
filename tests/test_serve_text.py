"""The server's text path on SmolLM2 (a real tokenizer): streamed stop strings never leak, and a
huge text prompt is refused without keeping ``/health`` waiting."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.serve import create_app
from research.serve.background import serve_in_thread

MODEL = "smollm2"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_llm):
    engine = Engine(
        smollm2_llm.model_config,
        smollm2_llm.params,
        smollm2_llm.tokenizer,
        cache_config=CacheConfig(block_size=16, num_kv_blocks=256),
        scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        max_model_len=256,
    )
    with serve_in_thread(create_app(engine, served_model_name=MODEL)) as url:
        yield url


def _body(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, **extra}


async def _completion(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    text, finish_reason = "", None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: ") :])["choices"][0]
                text += choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
    return text, finish_reason


def test_streamed_text_equals_the_non_streamed_text_for_every_stop_string(server):
    async def run(bodies: list[dict], stream: bool) -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            fn = _streamed if stream else _completion
            return await asyncio.gather(*(fn(client, server, body) for body in bodies))

    [(full, _)] = asyncio.run(run([_body()], stream=False))
    assert len(full) > 20, full
    stops = [
        [" Paris.\n\nThe answer is: 2018"],  # longer than the text for most of the stream
        [full + " and more"],  # longer than the whole text: never matched
        ["x" * 300],
        [full],  # matched only by the last token
        [full[:3]],  # matched at the start: empty output
        [full[5:12]],
        [full[-4:]],
        [full[8]],
        ["x" * 300, full[10:14]],  # a long unmatched one beside a short matched one
        [full[12:], full[6:9]],
    ]
    bodies = [_body(stop=stop) for stop in stops]
    plain = asyncio.run(run(bodies, stream=False))
    streamed = asyncio.run(run(bodies, stream=True))
    for stop, expected, got in zip(stops, plain, streamed, strict=True):
        assert got == expected, (stop, expected, got)
        for s in stop:
            assert s not in got[0]
    assert plain[1][0] == full and plain[3][0] == "" and plain[4][0] == ""


def test_a_5mb_prompt_gets_its_4xx_and_the_server_keeps_answering(server):
    response = httpx.post(
        f"{server}/v1/completions", json=_body(prompt="hello world " * 437_000, max_tokens=1),
        timeout=120,
    )  # fmt: skip
    assert 400 <= response.status_code < 500
    assert "bytes" in response.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200
    ok = httpx.post(f"{server}/v1/completions", json=_body(max_tokens=2), timeout=120)
    assert ok.status_code == 200


class _GatedTokenizer:
    """The engine's tokenizer, whose ``encode`` says when it starts and then waits for the
    test to let it finish."""

    def __init__(self, inner):
        self.inner = inner
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text, *args, **kwargs):
        self.started.set()
        if not self.release.wait(timeout=120):
            raise RuntimeError("the test never released the tokenizer")
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_long_prompt_under_the_byte_bound_is_tokenized_off_the_loop(smollm2_llm):
    """The tokenizer is held inside ``encode`` (events, no timing): while it is, /health and
    a token-id request are answered, which they could not be if tokenizing ran on the event
    loop; released, the long prompt gets its 400."""
    tokenizer = _GatedTokenizer(smollm2_llm.tokenizer)
    engine = Engine(
        smollm2_llm.model_config,
        smollm2_llm.params,
        tokenizer,
        cache_config=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        max_model_len=256,
    )
    with serve_in_thread(create_app(engine, served_model_name=MODEL)) as url:
        box = {}

        def post() -> None:
            box["response"] = httpx.post(
                f"{url}/v1/completions", json=_body(prompt="Paris is nice. " * 500, max_tokens=1),
                timeout=120,
            )  # fmt: skip

        thread = threading.Thread(target=post)
        thread.start()
        assert tokenizer.started.wait(timeout=120), "the prompt never reached the tokenizer"
        try:
            assert httpx.get(f"{url}/health", timeout=60).status_code == 200
            ids = httpx.post(
                f"{url}/v1/completions", json=_body(prompt=[1, 2, 3], max_tokens=2), timeout=60
            )
            assert ids.status_code == 200
            assert thread.is_alive()  # the long prompt was still being tokenized meanwhile
        finally:
            tokenizer.release.set()
            thread.join(timeout=120)
    response = box["response"]
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    assert not engine.has_unfinished_requests()
