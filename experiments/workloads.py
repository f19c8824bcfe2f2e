"""What a workload config sends: ``build_load`` turns ``run.workload`` into the requests or
sessions of one run (the concurrency sweep's points, the capacity search's populations).
``experiments.context_len`` sizes ``model.max_model_len`` for its longest request before the run
starts.
"""

from __future__ import annotations

from typing import Any

from research.config import TRACE_DATASETS, RunConfig


def scaled(length: int, length_scale: float) -> int:
    """A trace or session length times ``workload.length_scale``, rounded, at least 1."""
    return max(1, round(length * length_scale))


def tokenizer_encode(backend: Any) -> Any:
    """The engine's tokenizer's ``encode``; a simulated model has none, so text datasets are
    counted in SmolLM2's tokens (the bundled GGUF's tokenizer)."""
    tokenizer = getattr(getattr(backend, "llm", None), "tokenizer", None)
    if tokenizer is None:
        from research.models.weights import smollm2_gguf_path
        from research.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    return tokenizer.encode


def build_load(
    run: RunConfig,
    backend: Any,
    n: int,
    seed: int,
    *,
    turns: int | None = None,
    start_spread_s: float = 0.0,
) -> list[Any]:
    """``n`` requests of the workload's dataset (``research.bench.datasets``), or for a
    sessions dataset ``n`` sessions (``research.bench.sessions``). ``turns`` (default the
    workload's) lets a session run past one conversation: a new one starts every
    ``workload.turns`` turns; sessions start offset over ``start_spread_s``."""
    from research.bench import datasets, sessions

    w = run.workload
    ids = dict(vocab_size=backend.vocab_size, seed=seed, special_ids=backend.special_ids)
    scale = w.length_scale

    if w.dataset == "random":
        return datasets.prefix_random_requests(
            n, w.prefix_len, w.input_len, w.output_len, w.range_ratio, **ids
        )
    if w.dataset == "prefix_repetition":
        return datasets.prefix_repetition_requests(
            n, w.prefix_len, w.suffix_len, w.num_prefixes, w.output_len, **ids
        )
    if w.dataset == "burstgpt":
        return datasets.burstgpt_requests(w.path, n, length_scale=scale, **ids)
    if w.dataset == "custom":
        return datasets.custom_requests(w.path, n, tokenizer_encode(backend), w.output_len)
    if w.dataset == "sharegpt":
        return datasets.sharegpt_requests(w.path, n, tokenizer_encode(backend))
    if w.dataset in TRACE_DATASETS:
        name = w.path if w.dataset == "trace" else w.dataset
        records = datasets.load_trace(name, w.trace_format)[:n]
        reqs = datasets.trace_requests(records, length_scale=scale, time_scale=w.time_scale, **ids)
        if not w.replay_timestamps:
            reqs = [datasets.BenchRequest(r.prompt_token_ids, r.output_len) for r in reqs]
        return reqs
    users = dict(user_rate=w.request_rate, start_spread_s=start_spread_s, **ids)
    turns = w.turns if turns is None else turns
    if w.dataset == "chat_sessions":
        return sessions.chat_sessions(
            n,
            turns=turns,
            conversation_turns=w.turns,
            system_len=scaled(w.system_len, scale),
            message_len=scaled(w.input_len, scale),
            output_len=scaled(w.output_len, scale),
            think_time_s=w.think_time_s,
            think_time_dist=w.think_time_dist,
            range_ratio=w.range_ratio,
            **users,
        )
    if w.dataset == "agents":
        return sessions.agent_sessions(
            n,
            calls=turns,
            conversation_turns=w.turns,
            context_len=scaled(w.context_len, scale),
            output_len=scaled(w.output_len, scale),
            tool_output_len=scaled(w.tool_output_len, scale),
            tool_time_s=w.tool_time_s,
            **users,
        )
    conversations = datasets.load_sharegpt(w.path)  # sharegpt_sessions
    return sessions.sharegpt_sessions(
        conversations, n, tokenizer_encode(backend), think_time_s=w.think_time_s,
        user_rate=w.request_rate, seed=seed,
    )  # fmt: skip
