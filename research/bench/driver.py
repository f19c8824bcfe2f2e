"""An in-process `vllm bench serve`: drive an engine with a workload and record every request.

Three load shapes, as in vLLM:

- closed loop (``max_concurrency=C``): at most C requests in flight; the next one is added as soon
  as one finishes (vLLM's semaphore);
- open loop (finite ``request_rate``): request i is added once its arrival offset has passed; when
  nothing is running and the next arrival is ahead, the driver sleeps until it;
- both: a request is added when it has arrived *and* a slot is free. Its send time (from which
  TTFT counts) is when it is added, not when it arrived, as in vLLM.

Requests that carry their own ``arrival_time`` (a replayed trace) arrive then instead.

``request_path_s`` (a simulated server's request path: HTTP, tokenization, the API server's
queue): a request sent at t reaches the engine at the first step boundary after
t + ``request_path_s`` and holds its slot meanwhile; its TTFT and latency count from t.

Every request is greedy with ``ignore_eos`` so it generates exactly its ``output_len`` tokens.
The driver stamps the send time with ``clock()`` and hands it to the engine as the arrival time;
token and finish times are the engine's own stamps (``RequestMetrics``), so ``clock`` must be the
clock the engine stamps with (``time.perf_counter`` for the real engine, the virtual clock for a
simulated one).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from research.bench.metrics import RequestRecord, compute_metrics
from research.bench.workload import BenchRequest, arrival_times
from research.engine.request import RequestOutput, SamplingParams


class EngineLike(Protocol):
    """What the driver needs from an engine (``research.engine.engine.Engine`` has it)."""

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> dict[str, Any]: ...


@dataclass
class BenchmarkResult:
    """Records in request order, the load that produced them and the engine's stats after."""

    records: list[RequestRecord]
    start_time: float
    duration: float
    max_concurrency: int | None
    request_rate: float
    burstiness: float
    engine_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.records)

    def metrics(self, **kwargs: Any) -> dict[str, Any]:
        """``compute_metrics`` over this run (keyword arguments pass through)."""
        return compute_metrics(self.records, self.duration, **kwargs)


def _record(request: BenchRequest, out: RequestOutput) -> RequestRecord:
    m = out.metrics
    success = out.finish_reason in ("length", "stop")
    return RequestRecord(
        prompt_len=request.prompt_len,
        output_len=len(out.token_ids),
        send_time=m.arrival_time,
        first_token_time=m.first_token_time,
        token_times=list(m.token_times),
        finish_time=m.finished_time,
        success=success,
        error="" if success else f"finished with reason {out.finish_reason!r}",
        num_preemptions=out.num_preemptions,
    )


def _refused(request: BenchRequest, send_time: float, error: ValueError) -> RequestRecord:
    return RequestRecord(
        prompt_len=request.prompt_len,
        output_len=0,
        send_time=send_time,
        first_token_time=None,
        token_times=[],
        finish_time=send_time,
        success=False,
        error=str(error),
    )


def run_benchmark(
    engine: EngineLike,
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = False,
    request_path_s: float = 0.0,
) -> BenchmarkResult:
    """Send ``requests`` to ``engine`` under the given load and step it until all finish.

    A request the engine refuses (ValueError from ``add_request``) is recorded as failed and
    frees its slot at once. The duration runs from the first send to the last finish.
    ``request_path_s``: module notes.
    """
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    if not (request_path_s >= 0 and math.isfinite(request_path_s)):
        raise ValueError(f"request_path_s must be a finite number >= 0, got {request_path_s}")
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    if any(r.arrival_time is not None for r in requests):  # a trace's own arrival times
        if any(r.arrival_time is None for r in requests):
            raise ValueError("either every request carries its arrival time or none does")
        offsets = [r.arrival_time for r in requests]
        if any(b < a for a, b in itertools.pairwise(offsets)):
            raise ValueError("trace arrival times must not decrease")
    records: list[RequestRecord | None] = [None] * len(requests)
    pending = deque(range(len(requests)))
    on_path: deque[tuple[float, int]] = deque()  # (send time, index): sent, not yet delivered
    in_flight: dict[str, int] = {}  # engine request id -> index into requests
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")

    def deliver(i: int, send_time: float) -> None:
        request = requests[i]
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        try:
            request_id = engine.add_request(
                request.prompt_token_ids, params, arrival_time=send_time
            )
        except ValueError as error:
            records[i] = _refused(request, send_time, error)
            bar.update()
            return
        in_flight[request_id] = i

    start = clock()
    while pending or on_path or in_flight:
        now = clock()
        while (
            pending
            and (max_concurrency is None or len(in_flight) + len(on_path) < max_concurrency)
            and start + offsets[pending[0]] <= now
        ):
            on_path.append((clock(), pending.popleft()))
            if not request_path_s:
                deliver(*reversed(on_path.pop()))
        while on_path and on_path[0][0] + request_path_s <= now:
            deliver(*reversed(on_path.popleft()))
        if not in_flight:
            nexts = [on_path[0][0] + request_path_s] if on_path else []
            if pending and (
                max_concurrency is None or len(in_flight) + len(on_path) < max_concurrency
            ):
                nexts.append(start + offsets[pending[0]])
            if nexts:
                sleep(max(0.0, min(nexts) - now))
            continue
        for out in engine.step():
            if out.finished:
                i = in_flight.pop(out.request_id)
                records[i] = _record(requests[i], out)
                bar.update()
    bar.close()
    return finished_result(engine, records, start, max_concurrency, request_rate, burstiness)


def finished_result(
    engine: EngineLike,
    records: list[RequestRecord],
    start: float,
    max_concurrency: int | None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
) -> BenchmarkResult:
    """The result of a run whose requests have all finished: its duration runs from the first
    send to the last finish; the engine's stats after it."""
    first_send = min(r.send_time for r in records)
    last_finish = max(r.finish_time for r in records)
    return BenchmarkResult(
        records=records,
        start_time=start,
        duration=last_finish - first_send,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        engine_stats=engine.stats(),
    )
