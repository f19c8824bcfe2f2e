"""Multi-turn users: chat sessions and coding agents, driven in closed loops.

A ``Session`` is a list of turns. Each turn's prompt is the session's history (every earlier
prompt and the tokens the engine generated for it) plus the turn's new tokens, so a prefix cache
finds the history cached; the next turn is sent ``gap_s`` after the previous one finishes.

- Chat users (``chat_sessions``), after vLLM's multi-turn benchmark
  (benchmarks/multi_turn/benchmark_serving_multi_turn.py): a system prompt, then ``turns`` user
  messages of ``message_len`` tokens, each answered with ``output_len`` tokens, a think time
  between an answer and the next message. ShareGPT conversations give real lengths
  (``sharegpt_sessions``).
- Coding agents (``agent_sessions``): a call with a ``context_len``-token context, the answer,
  then a tool runs for ``tool_time_s`` and its ``tool_output_len`` tokens join the context for
  the next call. The default (``workload=agents``) is a 20,000-token context resent about every
  30 s.

``run_sessions`` runs sessions against an engine with at most ``max_concurrency`` sessions
active (a session keeps its slot through its think and tool times, as a user would); sessions
start at once or at given times (Poisson user arrivals, or a trace). A turn the engine refuses
(its prompt past ``max_model_len``) is recorded as failed and ends its session: counted, never
a crash.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from research.bench.driver import (
    BenchmarkResult,
    EngineLike,
    _record,
    _refused,
    finished_result,
)
from research.bench.workload import (
    BenchRequest,
    allowed_token_ids,
    arrival_times,
    length_bounds,
)
from research.engine.request import SamplingParams


@dataclass(frozen=True)
class Turn:
    new_token_ids: list[int]  # appended to the history
    output_len: int
    gap_s: float = 0.0  # think or tool time before this turn is sent (after the previous ends)
    new_conversation: bool = False  # the history restarts with this turn (a new chat or task)


@dataclass(frozen=True)
class Session:
    turns: list[Turn]
    start_s: float = 0.0  # seconds from the start of the run


def _draw(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return rng.choice(allowed, size=n).tolist()


def _starts(n: int, user_rate: float, seed: int) -> np.ndarray:
    return arrival_times(n, user_rate, 1.0, seed)


def chat_sessions(
    num_sessions: int,
    *,
    turns: int = 5,
    system_len: int = 256,
    message_len: int = 128,
    output_len: int = 256,
    think_time_s: float = 10.0,
    range_ratio: float = 0.0,
    user_rate: float = math.inf,
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
    think_time_dist: str = "fixed",
    start_spread_s: float = 0.0,
    conversation_turns: int | None = None,
) -> list[Session]:
    """``num_sessions`` chat users: a system prompt, then ``turns`` messages (lengths uniform
    around ``message_len`` / ``output_len`` with ``range_ratio``, as the random dataset), a
    think time between an answer and the next message (``think_time_dist``: "fixed", or
    "exponential" with mean ``think_time_s``); users arrive at ``user_rate`` per second
    (Poisson; inf: all at once), each also offset by a uniform draw in [0, ``start_spread_s``]
    (so a population starts out of step). With ``conversation_turns`` a user starts a new
    conversation (the system prompt, no history) every that many turns."""
    if think_time_dist not in ("fixed", "exponential"):
        raise ValueError(
            f"think_time_dist must be 'fixed' or 'exponential', got {think_time_dist!r}"
        )
    if num_sessions < 1 or turns < 1 or think_time_s < 0:
        raise ValueError("num_sessions and turns must be >= 1 and think_time_s >= 0")
    allowed = allowed_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    msg, out = length_bounds(message_len, range_ratio), length_bounds(output_len, range_ratio)
    sessions = []
    for start in _starts(num_sessions, user_rate, seed):
        system = _draw(rng, allowed, system_len)
        ts = []
        for k in range(turns):
            new = _draw(rng, allowed, int(rng.integers(msg[0], msg[1], endpoint=True)))
            n_out = int(rng.integers(out[0], out[1], endpoint=True))
            think = think_time_s
            if think_time_dist == "exponential":
                think = float(rng.exponential(think_time_s)) if think_time_s > 0 else 0.0
            fresh = k == 0 or bool(conversation_turns and k % conversation_turns == 0)
            ts.append(Turn(system + new if fresh else new, n_out, 0.0 if k == 0 else think, fresh))
        offset = float(rng.uniform(0.0, start_spread_s)) if start_spread_s > 0 else 0.0
        sessions.append(Session(ts, float(start) + offset))
    return sessions


def agent_sessions(
    num_agents: int,
    *,
    calls: int = 10,
    context_len: int = 20000,
    output_len: int = 400,
    tool_output_len: int = 600,
    tool_time_s: float = 25.0,
    user_rate: float = math.inf,
    vocab_size: int = 32000,
    seed: int = 0,
    special_ids: Iterable[int] = (),
    start_spread_s: float = 0.0,
    conversation_turns: int | None = None,
) -> list[Session]:
    """``num_agents`` coding agents: the first call sends ``context_len`` tokens; every later
    call resends it with each answer and ``tool_output_len`` tokens of tool output added, after
    ``tool_time_s`` of tool time; starts offset by a uniform draw in [0, ``start_spread_s``].
    With ``conversation_turns`` an agent starts a new task (a fresh context) every that many
    calls."""
    if num_agents < 1 or calls < 1 or tool_time_s < 0 or context_len < 1:
        raise ValueError("num_agents, calls and context_len must be >= 1 and tool_time_s >= 0")
    allowed = allowed_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    sessions = []
    for start in _starts(num_agents, user_rate, seed):
        ts = [Turn(_draw(rng, allowed, context_len), output_len)]
        for k in range(1, calls):
            if conversation_turns and k % conversation_turns == 0:
                ts.append(Turn(_draw(rng, allowed, context_len), output_len, tool_time_s, True))
            else:
                ts.append(Turn(_draw(rng, allowed, tool_output_len), output_len, tool_time_s))
        offset = float(rng.uniform(0.0, start_spread_s)) if start_spread_s > 0 else 0.0
        sessions.append(Session(ts, float(start) + offset))
    return sessions


def sharegpt_sessions(
    conversations: Sequence[Sequence[str]],
    num_sessions: int,
    tokenize: Callable[[str], list[int]],
    *,
    think_time_s: float = 10.0,
    user_rate: float = math.inf,
    seed: int = 0,
) -> list[Session]:
    """ShareGPT conversations as sessions: every user turn a message, the assistant turn after
    it setting the output length (at least 1)."""
    out = []
    starts = _starts(num_sessions, user_rate, seed)
    for conv, start in zip(conversations, starts, strict=False):
        ts = []
        for k in range(0, len(conv) - 1, 2):
            msg, reply = tokenize(conv[k]), tokenize(conv[k + 1])
            if msg:
                ts.append(Turn(msg, max(1, len(reply)), 0.0 if not ts else think_time_s))
        if ts:
            out.append(Session(ts, float(start)))
    if not out:
        raise ValueError("no ShareGPT conversation gave a turn")
    return out


@dataclass(order=True)
class _Ready:
    time: float
    session: int
    turn: int = field(compare=False)
    prompt: list[int] = field(compare=False)


def run_sessions(
    engine: EngineLike,
    sessions: Sequence[Session],
    *,
    max_concurrency: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = False,
    request_path_s: float = 0.0,
) -> BenchmarkResult:
    """Every turn of every session against ``engine`` (module notes). Records are in the order
    turns finish; a refused turn ends its session. A turn sent at t reaches the engine
    ``request_path_s`` later (``research.bench.driver``); its TTFT counts from t."""
    if not sessions:
        raise ValueError("no sessions to run")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    if not (request_path_s >= 0 and math.isfinite(request_path_s)):
        raise ValueError(f"request_path_s must be a finite number >= 0, got {request_path_s}")
    start = clock()
    waiting = [(s.start_s, i) for i, s in enumerate(sessions)]  # not yet active
    heapq.heapify(waiting)
    ready: list[_Ready] = []  # active sessions' next turns
    active = 0
    in_flight: dict[str, tuple[int, int, BenchRequest]] = {}
    on_path: deque[tuple[float, _Ready]] = deque()  # (send time, turn): not yet delivered
    records = []
    bar = tqdm(total=sum(len(s.turns) for s in sessions), disable=not progress, unit="turn")

    def end_session() -> None:
        nonlocal active
        active -= 1

    def deliver(send: float, r: _Ready) -> None:
        turn = sessions[r.session].turns[r.turn]
        request = BenchRequest(r.prompt, turn.output_len)
        params = SamplingParams(max_tokens=turn.output_len, temperature=0.0, ignore_eos=True)
        try:
            rid = engine.add_request(r.prompt, params, arrival_time=send)
        except ValueError as error:
            records.append(_refused(request, send, error))
            bar.update(len(sessions[r.session].turns) - r.turn)
            end_session()
            return
        in_flight[rid] = (r.session, r.turn, request)

    while waiting or ready or on_path or in_flight:
        now = clock() - start
        while (
            waiting
            and waiting[0][0] <= now
            and (max_concurrency is None or active < max_concurrency)
        ):
            _, i = heapq.heappop(waiting)
            active += 1
            turn = sessions[i].turns[0]
            heapq.heappush(ready, _Ready(now, i, 0, list(turn.new_token_ids)))
        while ready and ready[0].time <= now:
            on_path.append((clock(), heapq.heappop(ready)))
            if not request_path_s:
                deliver(*on_path.pop())
        while on_path and on_path[0][0] + request_path_s <= start + now:
            deliver(*on_path.popleft())
        if not in_flight:
            nexts = [ready[0].time] if ready else []
            if on_path:
                nexts.append(on_path[0][0] + request_path_s - start)
            if waiting and (max_concurrency is None or active < max_concurrency):
                nexts.append(waiting[0][0])
            if nexts:
                sleep(max(0.0, min(nexts) - now))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            i, k, request = in_flight.pop(out.request_id)
            records.append(_record(request, out))
            bar.update()
            turns = sessions[i].turns
            if k + 1 < len(turns) and out.finish_reason in ("length", "stop"):
                nxt = turns[k + 1]
                prompt = list(nxt.new_token_ids)
                if not nxt.new_conversation:
                    prompt = request.prompt_token_ids + list(out.token_ids) + prompt
                done = out.metrics.finished_time - start
                heapq.heappush(ready, _Ready(done + nxt.gap_s, i, k + 1, prompt))
            else:
                end_session()
    bar.close()
    return finished_result(engine, records, start, max_concurrency)


__all__ = [
    "Session",
    "Turn",
    "agent_sessions",
    "chat_sessions",
    "run_sessions",
    "sharegpt_sessions",
]
