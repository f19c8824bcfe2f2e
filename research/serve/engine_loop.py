"""The engine's own thread, for the HTTP server: ``EngineLoop`` is the only caller of the engine.

It runs the commands HTTP handlers post on a thread-safe queue (add a request, abort one) between
steps, steps while there is work, and hands every ``RequestOutput`` to the asyncio queue of its
request with ``call_soon_threadsafe``. A new request therefore joins the running batch at the
next step, and a blocking JAX step never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from research.engine.engine import Engine
from research.engine.request import RequestOutput, SamplingParams
from research.engine.sequence import SequenceStatus
from research.serve.errors import APIError

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- engine loop


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the event loop that added it."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    num_tokens: int = 0


@dataclass
class LoopCounters:
    """Totals since start, for ``/metrics`` (written by the loop thread, read by handlers)."""

    requests: int = 0  # admitted into the engine
    rejected: int = 0  # refused with 429
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0


class EngineLoop:
    """The engine's only thread: drain commands, step while there is work, deliver outputs.

    ``max_waiting`` bounds the requests admitted but not yet scheduled, counted when ``add`` is
    called (not from a snapshot), so a burst can never queue more; beyond it ``add`` raises a
    429 ``APIError``. A step that fails fails only the requests that cause it (the engine
    isolates them); should ``engine.step`` itself raise, every request in flight fails with the
    error and the thread keeps serving. ``stats`` (for ``/metrics``) is refreshed after each
    batch of commands (admissions, aborts), after each schedule and after each step.
    """

    def __init__(self, engine: Engine, max_waiting: int = 256):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.counters = LoopCounters()
        self.stats: dict[str, Any] = engine.stats()  # snapshot, replaced by the loop thread
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._lock = threading.Lock()
        self._num_unscheduled = 0  # admitted and not yet scheduled (guarded by _lock)
        self._unscheduled: set[str] = set()  # the ids of those added (loop thread only)
        self._ids = itertools.count()
        self._running = False
        self._thread: threading.Thread | None = None
        engine.on_schedule = self._on_schedule

    @property
    def num_unscheduled(self) -> int:
        """Requests admitted by ``add`` that the engine has not scheduled yet."""
        return self._num_unscheduled

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _admit(self) -> None:
        with self._lock:
            if self._num_unscheduled >= self.max_waiting:
                self.counters.rejected += 1
                raise APIError(
                    429,
                    f"the server has {self.max_waiting} requests waiting; retry later",
                    headers={"Retry-After": "1"},
                )
            self._num_unscheduled += 1

    def _settle(self, request_id: str) -> None:
        """Loop thread: ``request_id`` no longer waits (scheduled, finished or refused)."""
        if request_id in self._unscheduled:
            self._unscheduled.discard(request_id)
            with self._lock:
                self._num_unscheduled -= 1

    async def add(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns its id and the queue its outputs arrive on. Raises
        ``APIError`` 400 if the engine refuses it and 429 if the waiting queue is full."""
        self._admit()
        loop = asyncio.get_running_loop()
        added: asyncio.Future[None] = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        request_id = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"

        def resolve(error: Exception | None) -> None:
            if not added.done():
                added.set_exception(error) if error else added.set_result(None)

        def command() -> None:
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, prompt)
            except Exception as error:
                with self._lock:
                    self._num_unscheduled -= 1
                if not isinstance(error, ValueError):
                    logger.exception("adding request %s failed", request_id)
                    error = APIError(500, f"the server could not add the request: {error}")
                else:
                    error = APIError(400, str(error))
                loop.call_soon_threadsafe(resolve, error)
                return
            self._streams[request_id] = stream
            self._unscheduled.add(request_id)
            self.counters.requests += 1
            self.counters.prompt_tokens += len(prompt_token_ids)
            loop.call_soon_threadsafe(resolve, None)

        try:
            self._post(command)
            await added
        except asyncio.CancelledError:  # the client left before the add ran: undo it
            self.abort(request_id)
            raise
        return request_id, stream.outputs

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already finished); safe from any thread."""

        def command() -> None:
            self._settle(request_id)
            if self._streams.pop(request_id, None) is not None and self.engine.abort(request_id):
                self._count_finish("abort")

        self._post(command)

    def _count_finish(self, reason: str) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    def _on_schedule(self) -> None:
        """Loop thread, after each schedule: settle the newly scheduled, refresh the gauges."""
        for request_id in list(self._unscheduled):
            seq = self.engine.requests.get(request_id)
            if seq is None or seq.status is not SequenceStatus.WAITING:
                self._settle(request_id)
        self.stats = self.engine.stats()

    def _run(self) -> None:
        while self._running:
            if not self._commands.empty():
                while not self._commands.empty():
                    try:
                        self._commands.get()()
                    except Exception:  # a command must never end the loop
                        logger.exception("an engine-loop command failed")
                self.stats = self.engine.stats()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # keep serving: fail what was in flight, not the server
                logger.exception("engine step failed; failing %d requests", len(self._streams))
                self._fail_all(error)
                continue
            for out in outputs:
                self._deliver(out)
            self.stats = self.engine.stats()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        self.counters.generation_tokens += len(out.token_ids) - stream.num_tokens
        stream.num_tokens = len(out.token_ids)
        if out.finished:
            del self._streams[out.request_id]
            self._settle(out.request_id)
            self._count_finish(out.finish_reason)
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            self._settle(request_id)
            self._count_finish("error")
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        self._streams.clear()
