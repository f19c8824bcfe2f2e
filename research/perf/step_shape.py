"""What one engine step computes, independent of the engine and the machine: ``StepShape``
(one ``(num_new_tokens, context_before)`` pair per scheduled sequence; a mixed step holds a
prompt chunk and everyone's decodes) and ``StepWork`` (what the kernels process for it). Pure
Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepShape:
    """What one step computes, independent of the engine: ``(num_new_tokens, context_before)``
    per scheduled sequence (decodes are ``(1, context)``, a prefill chunk ``(n, start)``).
    ``extra_logits_rows``: logits rows beyond one per sequence (speculative decoding verifies
    a row's last token and its d drafts as a chunk ``(1 + d, context)`` and scores all 1 + d
    positions: d extra rows)."""

    seqs: tuple[tuple[int, int], ...]
    extra_logits_rows: int = 0

    def __post_init__(self) -> None:
        seqs = tuple((int(n), int(c)) for n, c in self.seqs)
        for n, c in seqs:
            if n < 1 or c < 0:
                raise ValueError(
                    f"each sequence needs num_new_tokens >= 1 and context >= 0: {seqs}"
                )
        object.__setattr__(self, "seqs", seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.seqs)

    @classmethod
    def decode(cls, batch: int, context: int) -> StepShape:
        """``batch`` single-token decodes, each with ``context`` tokens already cached."""
        return cls(((1, context),) * batch)

    @classmethod
    def prefill(cls, prompt_len: int, context_before: int = 0) -> StepShape:
        """One prefill chunk of ``prompt_len`` tokens after ``context_before`` cached ones."""
        return cls(((prompt_len, context_before),))


def step_shape_from_plan(plan: Any) -> StepShape:
    """The ``StepShape`` of a scheduler ``StepPlan`` (duck-typed: ``plan.decodes``,
    ``plan.prefills`` and ``plan.verifies`` are lists of items with ``.start`` and
    ``.num_new_tokens``; verified items also have ``.draft_token_ids``)."""
    verifies = list(getattr(plan, "verifies", []))
    items = list(plan.decodes) + list(plan.prefills) + verifies
    drafts = sum(len(s.draft_token_ids) for s in verifies)
    return StepShape(tuple((s.num_new_tokens, s.start) for s in items), drafts)


@dataclass(frozen=True)
class StepWork:
    """What one kernel launch sequence processes (one call of the model's forward)."""

    tokens: int  # rows through the GEMMs (packed; padded where the engine pads)
    logits_rows: int  # rows through lm_head and the sampler
    seq_tokens: tuple[int, ...]  # real new tokens per sequence (the routing law reads these)
    kv_read_tokens: float  # K/V tokens read per layer, summed over sequences (whole pages)
    kv_pages: float  # pages read per layer and kv head
    attention_pairs: float  # query-key pairs per layer and head
    kv_write_tokens: int
    # The same per sliding-window layer (None: those layers read like full ones, as our XLA
    # engine's gather does).
    window_read_tokens: float | None = None
    window_pairs: float | None = None


__all__ = ["StepShape", "StepWork", "step_shape_from_plan"]
