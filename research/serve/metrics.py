"""Prometheus text for ``/metrics``: the engine loop's gauges and counters."""

from __future__ import annotations

from research.serve.engine_loop import EngineLoop


def metric_samples(text: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample in Prometheus text (``prometheus_text``'s or a
    peer's), comments skipped; labels as written between the braces ("" when none)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        samples.append((name, labels.rstrip("}"), float(value)))
    return samples


def prometheus_text(
    engine_loop: EngineLoop, model_name: str, server_loop_cpu_s: float | None = None
) -> str:
    """The server's gauges and counters in Prometheus' text format, ``research:`` prefixed.
    ``server_loop_cpu_s``: CPU seconds of the HTTP server's event-loop thread so far (the
    caller reads it on that thread), exported when given."""
    s, c = engine_loop.stats, engine_loop.counters
    label = f'{{model_name="{model_name}"}}'
    gauges = [
        ("num_requests_running", "Requests in the running batch.", s["num_running"]),
        (
            "num_requests_waiting",
            "Requests admitted and waiting to be scheduled.",
            max(s["num_waiting"], engine_loop.num_unscheduled),
        ),
        ("kv_blocks_total", "KV-cache blocks in the pool.", s["kv_blocks_total"]),
        ("kv_blocks_free", "KV-cache blocks free (incl. evictable cached).", s["kv_blocks_free"]),
        (
            "kv_blocks_used",
            "KV-cache blocks held by requests.",
            s["kv_blocks_total"] - s["kv_blocks_free"],
        ),
        (
            "prefix_cache_hit_rate",
            "Prefix-cache hits per block queried.",
            s["prefix_cache_hit_rate"],
        ),
        ("num_steps", "Engine steps run.", s["num_steps"]),
    ]
    counters = [
        ("requests_total", "Requests admitted into the engine.", c.requests),
        ("requests_rejected_total", "Requests refused because the queue was full.", c.rejected),
        ("prompt_tokens_total", "Prompt tokens of admitted requests.", c.prompt_tokens),
        ("generation_tokens_total", "Tokens generated.", c.generation_tokens),
        ("engine_step_seconds_total", "Seconds in engine steps.", s["step_time_s"]),
        (
            "engine_host_seconds_total",
            "Seconds of engine steps outside the compiled calls (scheduling, packing, "
            "dispatch, reading the sampled tokens back).",
            s["host_time_s"],
        ),
        (
            "engine_kernel_seconds_total",
            "Seconds of engine steps inside the native CPU kernels (projections, attention); "
            "the compiled calls' other time is XLA's own work between them.",
            s.get("kernel_time_s", 0.0),
        ),
    ]
    if server_loop_cpu_s is not None:
        counters.append(
            (
                "server_loop_cpu_seconds_total",
                "CPU seconds of the HTTP server's event-loop thread (parsing requests, "
                "streaming every token as an event, JSON), outside the engine's thread.",
                server_loop_cpu_s,
            )
        )
    if "spec_num_drafts" in s:  # speculative decoding (vLLM's spec_decode counters)
        counters += [
            ("spec_decode_num_drafts_total", "Verified rows with drafts.", s["spec_num_drafts"]),
            (
                "spec_decode_num_draft_tokens_total",
                "Draft tokens proposed.",
                s["spec_num_draft_tokens"],
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                s["spec_num_accepted_tokens"],
            ),
        ]
    lines = []
    for kind, rows in (("gauge", gauges), ("counter", counters)):
        for name, help_text, value in rows:
            lines += [f"# HELP research:{name} {help_text}", f"# TYPE research:{name} {kind}"]
            lines.append(f"research:{name}{label} {value}")
    name = "research:request_finished_total"
    lines += [f"# HELP {name} Finished requests by reason.", f"# TYPE {name} counter"]
    for reason, count in sorted(c.finished.items()):
        lines.append(f'{name}{{model_name="{model_name}",finished_reason="{reason}"}} {count}')
    return "\n".join(lines) + "\n"
