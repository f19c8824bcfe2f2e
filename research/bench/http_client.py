"""`vllm bench serve` over HTTP: drive any OpenAI-compatible server and record every request.

The same load shapes as the in-process driver (``research.bench.driver``): at most
``max_concurrency`` requests in flight (an asyncio semaphore) and open-loop arrivals from
``arrival_times``; a request's send time is when it gets a slot, as in vLLM. Each request streams
``/v1/completions`` with the prompt as token ids, ``ignore_eos`` (a vLLM extension) and
``max_tokens = output_len``, and asks for a usage chunk.

Token accounting follows vLLM's ``benchmark_serving.py``: every SSE chunk that carries a choice is
one token arrival (its time goes to ``token_times``; the first is the TTFT), and ``output_len`` is
the server's ``usage.completion_tokens`` (the number of chunks if the server sends no usage). A
server that packs several tokens into one chunk therefore shows fewer, longer ITLs, while TPOT,
computed from E2EL, TTFT and the token count, stays right. Non-200 answers, error chunks and
transport errors are recorded as failed requests with the error.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence

import httpx

from research.bench.driver import BenchmarkResult
from research.bench.metrics import RequestRecord
from research.bench.workload import BenchRequest, arrival_times


async def _send(
    client: httpx.AsyncClient, url: str, payload: dict, request: BenchRequest
) -> RequestRecord:
    """Stream one request and stamp its send, token and finish times."""
    send = time.perf_counter()
    token_times: list[float] = []
    completion_tokens = None
    error = ""
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {body}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"error chunk: {chunk['error']}"
                        break
                    if chunk.get("choices"):
                        token_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finish = time.perf_counter()
    if not error and not token_times:
        error = "the stream carried no token"
    return RequestRecord(
        prompt_len=request.prompt_len,
        output_len=len(token_times) if completion_tokens is None else completion_tokens,
        send_time=send,
        first_token_time=token_times[0] if token_times else None,
        token_times=token_times,
        finish_time=finish,
        success=not error,
        error=error,
    )


async def _run(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    max_concurrency: int | None,
    api_key: str | None,
    endpoint: str,
    offsets: Sequence[float],
) -> tuple[list[RequestRecord], float]:
    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/{endpoint}"
    async with httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(None),
        # Idle connections expire well inside uvicorn's 5 s keep-alive: a connection reused as
        # the server closes it would fail a request the server never saw.
        limits=httpx.Limits(
            max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=1.0
        ),
    ) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = {
                "model": model,
                "prompt": request.prompt_token_ids,
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with semaphore:
                return await _send(client, url, payload, request)

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return list(records), start


def run_http_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: int | None,
    api_key: str | None = None,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> BenchmarkResult:
    """Send ``requests`` to the server at ``base_url`` (``http://host:port``, without ``/v1``)
    under the given load; ``max_concurrency=None`` puts no bound on requests in flight. The
    duration runs from the first send to the last finish. Runs its own asyncio event loop."""
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    if endpoint != "completions":
        raise ValueError(
            f"only the 'completions' endpoint takes token-id prompts, got {endpoint!r}"
        )
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    records, start = asyncio.run(
        _run(base_url, model, requests, max_concurrency, api_key, endpoint, offsets.tolist())
    )
    return BenchmarkResult(
        records=records,
        start_time=start,
        duration=max(r.finish_time for r in records) - min(r.send_time for r in records),
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
    )
