"""Data parallelism: N engine replicas (``research.serve`` processes) behind one
OpenAI-compatible endpoint.

``python -m research.serve.router MODEL --num-replicas 2 --routing least_loaded [--cpus-per-replica
1] [server flags]`` starts the replicas on free ports (each pinned to its own CPU cores
when ``--cpus-per-replica`` is given), waits until each answers ``/health``, and serves ``--port``
itself. ``--replica-url`` (repeatable) routes to servers already running instead.

``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) pass through as they are,
status and body, to the replica the policy picks (``research.parallel.replicas``: random,
least_loaded, prefix_aware), counting requests in flight through this router.

A replica that fails or cannot be reached answers with a 502 naming it; the others keep serving.
A pooled connection the replica closed while idle (its keep-alive ran out as the request left)
is not a failure: the request is sent once more on a fresh connection, and pooled connections
expire after ``KEEPALIVE_EXPIRY_S``, well inside uvicorn's 5 s keep-alive, so the race is rare.
``GET /router/stats[?min_in_flight=N]`` reports requests routed, in flight now and in flight on
average (over time, since the first request or ``POST /router/reset``) per replica, and the
share of the time the busiest replica had at most one request more than the least busy one
(counting only the time with at least N in flight in all), and the router process's CPU seconds
so far (``process_cpu_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from research.parallel.replicas import ROUTING, Replica, Router

__all__ = ["ROUTING", "Replica", "Router", "create_router_app", "free_port", "main"]

# Idle pooled connections to a replica are dropped after this long: below uvicorn's keep-alive
# timeout (5 s), so the router seldom picks a connection the replica is closing.
KEEPALIVE_EXPIRY_S = 1.0
# What a connection the replica closed while it sat in the pool raises on reuse (the request
# got no response): sent again, once, on a fresh connection. Timeouts are never retried.
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def prompt_prefix(body: dict) -> str:
    """The text a request starts with: its prompt, or its chat messages in order."""
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True)[:4096]
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:4096]


def create_router_app(router: Router, timeout: float = 600.0) -> FastAPI:
    client: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=4096,
            max_keepalive_connections=256,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        client["c"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        yield
        await client["c"].aclose()

    app = FastAPI(title="research router", lifespan=lifespan)
    app.state.router = router

    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        replica = router.choose(prompt_prefix(body if isinstance(body, dict) else {}))
        router.start(replica)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        req = client["c"].build_request(
            "POST", f"{replica.url}{path}", content=raw, headers=headers
        )
        try:
            try:
                upstream = await client["c"].send(req, stream=True)
            except STALE_CONNECTION:  # the body is bytes: the same request goes out again
                upstream = await client["c"].send(req, stream=True)
        except httpx.HTTPError as error:
            router.done(replica)
            return JSONResponse(
                {"error": {"message": f"replica {replica.url} failed: {error}", "type": "router"}},
                status_code=502,
            )
        media = upstream.headers.get("content-type", "application/json")
        if not media.startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                router.done(replica)
            return Response(content, status_code=upstream.status_code, media_type=media)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # finished, failed or the client left: the replica sees the close too
                await upstream.aclose()
                router.done(replica)

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client["c"].get(f"{router.replicas[0].url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for replica in router.replicas:
            try:
                r = await client["c"].get(f"{replica.url}/health", timeout=5)
            except httpx.HTTPError:
                return Response(status_code=503)
            if r.status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/router/stats")
    async def stats(min_in_flight: int = 0) -> dict:
        # process_cpu_s: the router process's CPU seconds so far (proxying every streamed event).
        return router.stats(min_in_flight) | {"process_cpu_s": time.process_time()}

    @app.post("/router/reset")
    async def reset() -> dict:
        router.reset()
        return router.stats()

    return app


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_replicas(
    server_args: list[str], num: int, cpus_per_replica: int | None
) -> tuple[list[subprocess.Popen], list[str]]:
    """``python -m research.serve`` ``num`` times on free ports, each pinned to its own
    ``cpus_per_replica`` cores (Linux) when given."""
    procs, urls = [], []
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    for i in range(num):
        port = free_port()
        cmd = [sys.executable, "-m", "research.serve", *server_args, "--port", str(port)]
        mine: list[int] = []
        if cpus_per_replica:
            mine = cores[i * cpus_per_replica : (i + 1) * cpus_per_replica]
            if len(mine) < cpus_per_replica:
                raise ValueError(
                    f"{num} replicas x {cpus_per_replica} cores need {num * cpus_per_replica} "
                    f"cores; this process may use {len(cores)}"
                )
        preexec = _child_setup(mine)
        procs.append(subprocess.Popen(cmd, preexec_fn=preexec))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def _child_setup(cores: list[int]):
    """In the replica, before it starts: die with the router (uvicorn ends the router by
    re-raising SIGTERM, so no cleanup code of ours would run), and keep to ``cores``."""

    def setup() -> None:
        if sys.platform == "linux":
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 900) -> None:
    """Return once every server in ``urls`` answers ``/health``; RuntimeError if one of
    ``procs`` exits first, TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a server exited with status {proc.returncode} at start")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {sorted(pending)}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m research.serve.router", description=__doc__)
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--routing", default="least_loaded", choices=ROUTING)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpus-per-replica", type=int, default=None)
    parser.add_argument("--replica-url", action="append", default=[], help="route to these")
    parser.add_argument("--seed", type=int, default=0)
    args, server_args = parser.parse_known_args(argv)
    if args.num_replicas < 1:
        parser.error("--num-replicas must be >= 1")
    procs: list[subprocess.Popen] = []
    urls = args.replica_url
    if not urls:
        procs, urls = start_replicas(server_args, args.num_replicas, args.cpus_per_replica)
    try:
        wait_healthy(urls, procs)
        import uvicorn

        router = Router([Replica(u) for u in urls], args.routing, seed=args.seed)
        uvicorn.run(create_router_app(router), host=args.host, port=args.port)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
