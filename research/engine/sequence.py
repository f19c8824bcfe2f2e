"""A request's host-side state while the engine serves it. No JAX here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from research.engine.request import RequestMetrics, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its tokens, how many of them are in the KV cache, and its blocks.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. A sequence is "caught up"
    when every token but the last sampled one is computed; then its next step is a decode.
    After preemption it recomputes from scratch (num_computed_tokens = 0).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    metrics: RequestMetrics
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Sliding-window layers' table (models that have them): entry i holds the same positions as
    # block_ids[i], or -1 once they slid out of the window (the block went back to the pool).
    sliding_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    # Gap between the two largest logits when each output token was sampled (ties show here).
    top2_gaps: list[float] = field(default_factory=list)
    # SamplingParams.logprobs: one {token id: Logprob} per output token.
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the step's raw entries by prompt position (a preempted
    # request recomputes them; the same position gets the same entry), and the decoded list.
    prompt_logprobs_raw: dict[int, Any] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # Speculative decoding: draft tokens proposed for the next step (verified there, then
    # cleared; never part of ``token_ids`` until accepted).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
