"""The short soak (about a minute): mixed streaming, disconnects and invalid requests against
a tiny-llama server on loopback; no 5xx or unexpected status, and the KV pool idle at the end.
The figures are printed; ``python -m experiments.soak --minutes N`` is the long version."""

from __future__ import annotations

import json

from experiments.soak import run_soak


def test_short_soak_has_no_unexpected_response_and_ends_idle(capsys):
    summary = run_soak(["--minutes", "0.5", "--warmup-minutes", "0.25", "--concurrency", "12"])
    with capsys.disabled():
        shown = {k: v for k, v in summary.items() if k not in ("responses", "heap_growth")}
        print("\nsoak:", json.dumps(shown))
    assert summary["num_unexpected"] == 0, summary["unexpected"]
    assert summary["completed"] > 0
    assert summary["idle_at_end"]["kv_blocks_used"] == 0
    assert summary["idle_at_end"]["running"] == summary["idle_at_end"]["waiting"] == 0
    assert summary["ok"]
