"""A bounded soak of the OpenAI server on loopback: mixed traffic for N minutes, then checks.

``python -m benchmarks.soak --minutes 10 [--model tiny-llama --concurrency 16 --seed 0]``
serves ``--model`` in this process (uvicorn on a free 127.0.0.1 port; nothing else is
contacted) and runs ``--concurrency`` clients until the time is up. Each request is one of:
a streamed or plain completion (and a chat, when the model has a tokenizer), a stream the
client leaves after a chunk or two, a plain request the client abandons after up to 300 ms,
or an invalid request (an out-of-range field, NaN, a lone surrogate, deep JSON, a wrong
content type, an unknown model, a prompt longer than the model).

It prints completed requests, responses by status, p50/p99 latency of the completed ones and
the process RSS over time, and exits 1 if any response was a 5xx or unexpected, if the
engine is not idle with every KV block free when the traffic stops, or if nothing completed.
The same traffic runs for ``--warmup-minutes`` first, untallied but checked, so the figures are
not dominated by the first compilation of each step shape. ``--trace-malloc`` also prints the
Python allocations that grew most from the end of the warmup (the heap profile to read when
RSS keeps growing).

Memory is checked two ways. The object census is exact: at idle after the warmup and again
at idle after the soak (every background compile finished, a full ``gc.collect()``), it counts
live objects whose class comes from ``research`` or ``experiments`` and all gc-tracked objects;
an engine or server that keeps anything per request (a finished request, its sequence, a
stream queue) grows them by the number of requests served. A shape compiled in the background
after the warmup adds the argument tree its executable keeps, once per shape; that growth is
reported apart (``compiled_objects_growth``) and the bound applies to the rest
(``retained_objects_growth``). RSS is sampled as well and its
slope over the second half reported (``--max-rss-slope`` bounds it on long soaks): over a
short soak the allocator's settling and the background compiles dominate it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import sys
import time
import tracemalloc
from collections import Counter
from typing import Any

import httpx
import numpy as np

from benchmarks.census import census_growth, held_by_executables, object_census
from research import LLM
from research.serve import create_app
from research.serve.background import serve_in_thread
from research.serve.metrics import metric_samples

MODEL_NAME = "soak"


def executables(llm: LLM) -> tuple[list[Any], list[Any]]:
    """The compiled steps and the compiled K/V writes the engine keeps (none where it has no
    compiler)."""
    compiler = getattr(llm.engine.executor, "compiler", None)
    if compiler is None:
        return [], []
    return list(compiler.compiled.values()), [w for w in compiler.writes.values() if w is not None]


def objects_per_compiled_shape(llm: LLM) -> int:
    """The most of this project's objects one compiled shape keeps: its step's argument tree
    and, where the write is separate, its K/V write's."""
    steps, writes = executables(llm)
    return sum(
        max((sum(held_by_executables([c]).values()) for c in kind), default=0)
        for kind in (steps, writes)
    )


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _invalid_requests(max_model_len: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) of requests the server must refuse with a 4xx."""
    json_headers = {"Content-Type": "application/json"}

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": MODEL_NAME, "prompt": [1, 2, 3], **fields}).encode()

    cases = [
        body(top_k=2**31),
        body(stop=[1]),
        body(seed="x"),
        body(temperature=10**400),
        body(max_tokens=0),
        body(prompt=[5] * (max_model_len + 1)),
        body(model="gpt-4"),
        b'{"prompt": [1, 2], "temperature": NaN}',
        b'{"prompt": "a\\ud800b"}',
        b"[" * 50_000 + b"]" * 50_000,
        b'{"prompt": [1, 2',
    ]
    requests = [("/v1/completions", c, json_headers) for c in cases]
    requests.append(("/v1/completions", body(), {"Content-Type": "text/plain"}))
    requests.append(("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', json_headers))
    return requests


class Soak:
    """The clients, their tallies and the RSS samples of one soak run."""

    def __init__(self, url: str, llm: LLM, args: argparse.Namespace):
        self.url, self.llm, self.args = url, llm, args
        self.rng = random.Random(args.seed)
        self.statuses: Counter[str] = Counter()  # "<kind> <status>" -> count
        self.unexpected: list[str] = []
        self.latencies: list[float] = []
        self.completed = 0
        self.rss: list[tuple[float, float]] = []
        special = set(llm.model_config.eos_token_ids)
        if llm.tokenizer is not None:
            special |= set(llm.tokenizer.all_special_ids)
        self.token_ids = [t for t in range(llm.model_config.vocab_size) if t not in special]
        self.invalid = _invalid_requests(llm.max_model_len)

    def _body(self, stream: bool) -> dict:
        rng = self.rng
        body = {
            "model": MODEL_NAME,
            "prompt": rng.choices(self.token_ids, k=rng.randint(4, 48)),
            "max_tokens": rng.randint(1, self.args.max_tokens),
            "temperature": rng.choice([0.0, 0.7]),
            "seed": rng.randrange(2**32),
            "ignore_eos": rng.random() < 0.8,
            "stream": stream,
        }
        if self.llm.tokenizer is not None and rng.random() < 0.3:
            body.pop("prompt")
            words = " ".join(rng.choice(["Paris", "is", "the", "a", "of"]) for _ in range(8))
            body["messages"] = [{"role": "user", "content": words}]
        return body

    def _tally(self, kind: str, status: int, expected: bool) -> None:
        self.statuses[f"{kind} {status}"] += 1
        if not expected or status >= 500:
            self.unexpected.append(f"{kind} got {status}")

    async def _complete(self, client: httpx.AsyncClient, stream: bool, leave: bool) -> None:
        body = self._body(stream)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        kind = ("stream" if stream else "plain") + ("-leave" if leave else "")
        t0 = time.perf_counter()
        if not stream:
            request = client.post(path, json=body)
            if leave:  # the client gives up (closes the connection) after up to 300 ms
                try:
                    response = await asyncio.wait_for(request, self.rng.uniform(0.0, 0.3))
                except TimeoutError:
                    self.statuses[f"{kind} left"] += 1
                    return
            else:
                response = await request
            self._tally(kind, response.status_code, response.status_code in (200, 429))
            if response.status_code == 200:
                self.completed += 1
                self.latencies.append(time.perf_counter() - t0)
            return
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._tally(kind, response.status_code, response.status_code == 429)
                return
            chunks, done = 0, False
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if b"server_error" in line.encode():
                        self.unexpected.append(f"{kind}: {line[:200]}")
                    done = line == "data: [DONE]"
                    if leave and chunks >= self.rng.randint(1, 2):
                        self.statuses[f"{kind} left"] += 1
                        return
            self._tally(kind, 200, done)
            if done:
                self.completed += 1
                self.latencies.append(time.perf_counter() - t0)

    async def _invalid(self, client: httpx.AsyncClient) -> None:
        path, content, headers = self.rng.choice(self.invalid)
        response = await client.post(path, content=content, headers=headers)
        self._tally("invalid", response.status_code, 400 <= response.status_code < 500)

    async def _client(self, deadline: float) -> None:
        kinds = ["stream", "plain", "stream-leave", "plain-leave", "invalid"]
        weights = [0.35, 0.25, 0.1, 0.1, 0.2]
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            while time.monotonic() < deadline:
                kind = self.rng.choices(kinds, weights)[0]
                try:
                    if kind == "invalid":
                        await self._invalid(client)
                    else:
                        await self._complete(client, kind.startswith("stream"), "leave" in kind)
                except httpx.HTTPError as error:
                    self.unexpected.append(f"{kind}: {type(error).__name__}: {error}")

    async def _sample_rss(self, start: float, deadline: float) -> None:
        interval = max(1.0, (deadline - start) / 20)
        while time.monotonic() < deadline:
            self.rss.append((time.monotonic() - start, rss_mb()))
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        self.rss.append((time.monotonic() - start, rss_mb()))

    async def run(self) -> None:
        start = time.monotonic()
        deadline = start + self.args.minutes * 60
        clients = [self._client(deadline) for _ in range(self.args.concurrency)]
        await asyncio.gather(self._sample_rss(start, deadline), *clients)


def _idle_state(soak: Soak, timeout: float = 30.0) -> dict[str, Any]:
    """Wait for the engine to drain; the pool and queue state it settled in."""
    engine = soak.llm.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # let the last aborts land
    gauges = {
        name.removeprefix("research:"): value
        for name, labels, value in metric_samples(httpx.get(f"{soak.url}/metrics").text)
        if name.startswith("research:") and "finished_reason" not in labels
    }
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv_blocks_used": engine.block_manager.num_used_blocks,
        "metrics_kv_blocks_used": gauges.get("kv_blocks_used"),
        "metrics_running": gauges.get("num_requests_running"),
    }


def run_soak(argv: list[str] | None = None) -> dict[str, Any]:
    """Run a soak; returns its summary (``summary["ok"]`` says whether every check held)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, required=True, help="how long traffic runs")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--concurrency", type=int, default=16, help="clients at once")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step's token budget (default: the engine's); fewer step shapes to compile",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens asked")
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=0.25,
        help="the same traffic first, not tallied (it compiles the step shapes)",
    )
    parser.add_argument("--trace-malloc", action="store_true", help="print the heap growth")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    parser.add_argument(
        "--max-rss-slope",
        type=float,
        default=None,
        help="fail if RSS grows faster than this many MiB per minute over the timed soak",
    )
    parser.add_argument(
        "--max-retained-objects",
        type=int,
        default=None,
        help="fail if more of this project's objects are live at idle after the soak than "
        "at idle after the warmup, beyond this many and those the shapes compiled meanwhile "
        "keep",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="serve without compiling the covering step shapes first (as research.serve)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        parser.error("--minutes must be in (0, 1440]")

    budget = (
        {}
        if args.max_num_batched_tokens is None
        else {"max_num_batched_tokens": args.max_num_batched_tokens}
    )
    llm = LLM(
        args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, **budget
    )
    if not args.enforce_eager:
        llm.engine.executor.precompile_covers()
    app = create_app(llm, served_model_name=MODEL_NAME, max_waiting=args.max_waiting)
    if args.trace_malloc:
        tracemalloc.start(10)
    with serve_in_thread(app, log_config=None) as url:
        warmup = Soak(url, llm, argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
        if args.warmup_minutes > 0:
            warmup.args.minutes = args.warmup_minutes
            asyncio.run(warmup.run())
        _idle_state(warmup)
        settled = llm.engine.executor.wait_for_background_compiles()
        census_before = object_census()
        compiled_before = held_by_executables(itertools.chain(*executables(llm)))
        compiled_in_warmup = llm.engine.num_compilations
        step_compiles_in_warmup = llm.engine.executor.step_compiles
        baseline = tracemalloc.take_snapshot() if args.trace_malloc else None
        soak = Soak(url, llm, args)
        t0 = time.monotonic()
        asyncio.run(soak.run())
        duration = time.monotonic() - t0
        idle = _idle_state(soak)
        settled = llm.engine.executor.wait_for_background_compiles() and settled
        census = census_growth(
            census_before,
            object_census(),
            (compiled_before, held_by_executables(itertools.chain(*executables(llm)))),
        )
    growth = []
    if baseline is not None:
        stats = tracemalloc.take_snapshot().compare_to(baseline, "lineno")
        growth = [str(s) for s in stats[:10]]
        tracemalloc.stop()
    lat = np.array(soak.latencies) * 1000 if soak.latencies else np.zeros(1)
    errors = Counter()
    for key, count in soak.statuses.items():
        status = key.rsplit(" ", 1)[1]
        if status.isdigit() and status != "200":
            errors[status] += count
    summary = {
        "model": args.model,
        "minutes": args.minutes,
        "duration_s": round(duration, 1),
        "requests": sum(soak.statuses.values()),
        "completed": soak.completed,
        "errors_by_status": dict(sorted(errors.items())),
        "responses": dict(sorted(soak.statuses.items())),
        "p50_latency_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_latency_ms": round(float(np.percentile(lat, 99)), 1),
        "rss_mb": [(round(t, 1), round(m, 1)) for t, m in soak.rss],
        "step_shapes_compiled": [compiled_in_warmup, llm.engine.num_compilations],
        # Shapes compiled after the warmup: in the background while a cover served (no step
        # waited), and inside a step (one did).
        "compiled_after_warmup": llm.engine.num_compilations - compiled_in_warmup,
        "step_compiles_after_warmup": llm.engine.executor.step_compiles - step_compiles_in_warmup,
        "rss_slope_mb_per_min": rss_slope(soak.rss),
        # calls run padded to a compiled cover while their own shape compiled in the background
        "covered_calls": getattr(llm.engine.executor, "covered_calls", 0),
        "idle_at_end": idle,
        "background_compiles_settled": settled,
        "census": census,
        "objects_per_compiled_shape": objects_per_compiled_shape(llm),
        "retained_objects_per_request": round(
            census["retained_objects_growth"] / max(1, sum(soak.statuses.values())), 4
        ),
        "unexpected": (warmup.unexpected + soak.unexpected)[:20],
        "num_unexpected": len(warmup.unexpected) + len(soak.unexpected),
        "heap_growth": growth,
    }
    summary["ok"] = (
        summary["num_unexpected"] == 0
        and soak.completed > 0
        and idle["running"] == idle["waiting"] == idle["kv_blocks_used"] == 0
        and idle["metrics_kv_blocks_used"] == 0
        and (
            args.max_retained_objects is None
            or census["retained_objects_growth"] <= args.max_retained_objects
        )
        and (args.max_rss_slope is None or summary["rss_slope_mb_per_min"] <= args.max_rss_slope)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)
    return summary


def rss_slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS (MiB) against time over the second half of the timed soak,
    in MiB per minute (0 with fewer than 3 samples there). The first half holds the settling
    (background compiles of shapes the warmup did not reach, allocator pools filling); a leak
    grows in both halves."""
    if not samples:
        return 0.0
    t, m = np.array(samples, dtype=np.float64).T
    late = t >= t[-1] / 2
    if late.sum() < 3:
        return 0.0
    return float(np.polyfit(t[late] / 60.0, m[late], 1)[0])


def main(argv: list[str] | None = None) -> int:
    summary = run_soak(argv)
    for key, value in summary.items():
        if key == "heap_growth":
            continue
        print(f"{key}: {json.dumps(value)}")
    for line in summary["heap_growth"]:
        print("heap:", line)
    print("soak: OK" if summary["ok"] else "soak: FAILED")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
