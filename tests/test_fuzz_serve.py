"""Property-based fuzzing of the HTTP surface: hypothesis draws request bodies (well-formed,
ill-typed, out of range, deeply odd) against a live tiny-llama server on loopback.

The invariant after every request: no 5xx (nor a server error inside a 200 stream), ``/health``
answers, and the next valid request is answered with its tokens. The run count is printed."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from research import LLM
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.serve import create_app
from research.serve.background import serve_in_thread

MODEL = "tiny"
MAX_EXAMPLES = 300
VALID = {
    "model": MODEL,
    "prompt": [1, 2, 3],
    "max_tokens": 2,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}

# Text with lone surrogates, control characters and astral code points.
text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
)
token_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=70)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), anything),
        "content": st.one_of(text, anything),
    },
)
body_fields = {
    "model": st.one_of(st.just(MODEL), anything),
    "prompt": st.one_of(token_ids, st.lists(token_ids, max_size=2), text, anything),
    "messages": st.one_of(st.lists(message, max_size=3), anything),
    "max_tokens": st.one_of(st.integers(1, 4), anything),
    "max_completion_tokens": anything,
    "temperature": st.one_of(st.floats(0, 2), anything),
    "top_p": st.one_of(st.floats(0, 1), anything),
    "top_k": st.one_of(st.integers(-1, 300), anything),
    "seed": st.one_of(st.integers(0, 2**32), anything),
    "stop": st.one_of(text, st.lists(text, max_size=3), anything),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 300), max_size=3), anything),
    "n": st.one_of(st.just(1), anything),
    "stream": st.one_of(st.booleans(), anything),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "ignore_eos": st.one_of(st.booleans(), anything),
    "skip_special_tokens": anything,
    "return_token_ids": anything,
}
# Stop strings an OpenAI client can send: non-empty, valid Unicode (no lone surrogates).
stop_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)
plausible = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 300),
    "seed": st.integers(0, 2**32 - 1),
    "stop": st.lists(stop_text, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
valid_bodies = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.lists(st.integers(0, 255), min_size=1, max_size=20),
        "max_tokens": st.integers(1, 4),
    },
    optional=plausible,
)
mutated_bodies = st.tuples(
    valid_bodies, st.dictionaries(st.sampled_from(sorted(body_fields)), anything, max_size=2)
).map(lambda t: {**t[0], **t[1]})
bodies = st.one_of(valid_bodies, mutated_bodies, st.fixed_dictionaries({}, optional=body_fields))


def _raw(body: dict) -> bytes:
    return json.dumps(body).encode()  # NaN / Infinity go out as their (invalid) literals


raw_bodies = st.one_of(
    bodies.map(_raw),
    st.tuples(bodies.map(_raw), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),  # cut short
    st.binary(max_size=64),
    anything.map(lambda v: json.dumps(v).encode()),
)


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-llama", max_model_len=64)
    engine = Engine(
        llm.model_config,
        llm.params,
        cache_config=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        max_model_len=64,
    )
    with serve_in_thread(create_app(engine, served_model_name=MODEL, max_waiting=8)) as url:
        yield url, engine


def _openai_error(payload: bytes) -> dict:
    """The error object of an OpenAI-style error body: {"error": {"message", "type", ...}}."""
    body = json.loads(payload)
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert {"param", "code"} <= set(error), body
    return error


def _check(client: httpx.Client, path: str, content: bytes) -> int:
    headers = {"Content-Type": "application/json"}
    with client.stream("POST", path, content=content, headers=headers) as response:
        payload = response.read()
        assert response.status_code < 500, (content[:300], payload[:300])
        if response.status_code >= 400:
            _openai_error(payload)  # every refusal says why, as the OpenAI API does
        if response.status_code == 200 and b"data: " in payload[:6]:
            assert b"server_error" not in payload, payload[-300:]
            assert payload.rstrip().endswith(b"data: [DONE]"), payload[-300:]
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json=VALID)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    return response.status_code


def test_no_request_body_gets_a_5xx_or_hurts_the_next_request(server, capsys):
    url, engine = server
    statuses: dict[int, int] = {}
    paths = ["/v1/completions"] * 3 + ["/v1/chat/completions"]  # chat: no tokenizer, all 400

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(path=st.sampled_from(paths), raw=raw_bodies)
    def one(path: str, raw: bytes) -> None:
        status = _check(client, path, raw)
        statuses[status] = statuses.get(status, 0) + 1

    with httpx.Client(base_url=url, timeout=60) as client:
        one()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    runs = sum(statuses.values())
    with capsys.disabled():
        print(f"\nfuzz: {runs} requests, statuses {dict(sorted(statuses.items()))}")
    assert runs >= MAX_EXAMPLES // 2


def test_every_valid_body_is_answered(server):
    """Bodies inside the API (model, prompt ids, max_tokens and any plausible sampling field):
    200 with a completion (or a stream that ends in [DONE]) every time, never a refusal."""
    url, engine = server

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=valid_bodies)
    def one(body: dict) -> None:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, (body, response.text[:300])
        if body.get("stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        else:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")

    with httpx.Client(base_url=url, timeout=60) as client:
        one()
    assert not engine.has_unfinished_requests()


def test_refusals_are_openai_style_errors(server):
    """A few known-bad bodies: 400 with {"error": {"message", "type", "param", "code"}}."""
    url, _ = server
    bad = [
        {"model": MODEL, "prompt": [1, 2], "max_tokens": -1},
        {"model": MODEL, "prompt": [1, 2], "temperature": "hot"},
        {"model": "nope", "prompt": [1, 2]},
        {"model": MODEL, "prompt": list(range(100))},  # longer than max_model_len 64
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        for body in bad:
            response = client.post("/v1/completions", json=body)
            assert 400 <= response.status_code < 500, (body, response.text)
            error = _openai_error(response.content)
            assert error["type"] in ("invalid_request_error", "NotFoundError", "BadRequestError")
