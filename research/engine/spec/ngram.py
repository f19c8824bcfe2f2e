"""Draft proposers for speculative decoding, on the host. No JAX here.

``NgramProposer`` is prompt lookup (vLLM's ``method="ngram"``): the sequence's last n tokens,
for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, are searched for earlier in its
own tokens (prompt and output); at the latest match that has k tokens after it (else the latest),
the tokens that followed it are proposed.
The proposal costs no model call; the target verifies it in the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from research.config import SpeculativeConfig


class NgramProposer:
    """``propose_batch`` / ``release``: the interface the engine calls (as the draft-model
    proposer, ``research.engine.spec.draft``)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to ``min(k, max_drafts)`` tokens that followed the latest earlier occurrence of the
        longest matching suffix n-gram of ``token_ids``; [] if none matches."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        tokens = np.asarray(token_ids, np.int64)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every n-gram but the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                # The latest match with k tokens after it (a short period repeats too close to
                # the end to propose k), else the latest match.
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose_batch(self, requests: list[tuple[Any, int]]) -> dict[str, list[int]]:
        """Drafts for each (sequence, most drafts it may take), by request id."""
        return {seq.request_id: self.propose(seq.token_ids, room) for seq, room in requests}

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""
