"""Requests as the user sees them: sampling parameters, outputs and per-request timings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those filters. ``seed`` makes a
    request's samples reproducible whatever else is in the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the params are hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt: generated text and ids, why it stopped, and its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or string) | "length" | None (running)
    metrics: RequestMetrics
    stop_reason: int | str | None = None
    # Gap between the two largest logits at each sampled position: near-ties show up here.
    top2_logit_gaps: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
