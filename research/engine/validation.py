"""What a request must satisfy before the engine queues it: every reason a request cannot be
served is a ValueError naming it, raised before anything changes (vLLM's input processing)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from research.engine.request import SamplingParams


def validate_request(engine: Any, prompt_token_ids: Seq[int], sp: SamplingParams) -> None:
    """Raise ValueError with the reason if ``engine`` cannot serve the request."""
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
    sp.validate()
    if (sp.logprobs is not None or sp.prompt_logprobs is not None) and not getattr(
        engine.executor, "computes_logprobs", False
    ):
        raise ValueError(
            f"logprobs need the model's logits; the {type(engine.executor).__name__} does not "
            "compute any"
        )
    vocab = engine.model_config.vocab_size
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise ValueError(
            f"a prompt is a list of token ids here, got {type(prompt_token_ids).__name__}"
        )
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty (0 tokens)")
    for t in prompt_token_ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
    n = len(prompt_token_ids)
    if n >= engine.max_model_len:
        raise ValueError(f"prompt has {n} tokens; max_model_len is {engine.max_model_len}")
    if n + sp.max_tokens > engine.max_model_len:
        raise ValueError(
            f"prompt has {n} tokens and max_tokens is {sp.max_tokens}: {n + sp.max_tokens} "
            f"exceeds max_model_len {engine.max_model_len}"
        )
    budget = engine.scheduler_config.max_num_batched_tokens
    if not engine.scheduler_config.enable_chunked_prefill and n + sp.max_tokens > budget:
        # A preempted request recomputes prompt + outputs in one step without chunking.
        raise ValueError(
            f"prompt + max_tokens = {n + sp.max_tokens} tokens exceeds "
            f"max_num_batched_tokens {budget} and chunked prefill is off"
        )
    pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    if n + sp.max_tokens > pool_tokens:
        raise ValueError(
            f"prompt + max_tokens = {n + sp.max_tokens} tokens exceeds the whole KV pool "
            f"({pool_tokens} tokens); raise num_kv_blocks"
        )
